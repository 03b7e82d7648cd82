"""Every relative link of the README and docs/ reaches a file of the repository, and every
`#anchor` a heading of the file it names (GitHub's slugs), so that a heading renamed in
docs/benchmarks.md cannot leave the README pointing at nothing (it did once, unnoticed)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped,
    spaces to `-`."""
    text = re.sub(r"[`*]", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a markdown file's headings (outside code blocks; a repeated heading's
    later ones get -1, -2, ...)."""
    seen: dict[str, int] = {}
    fenced = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            seen.setdefault(f"{base}-{n}" if n else base, 1)
    return set(seen)


def links(path: Path):
    for n, line in enumerate(path.read_text().splitlines(), 1):
        for target in LINK.findall(line):
            if not re.match(r"[a-z]+:", target):  # (http:, https:, mailto: are not checked)
                yield n, target


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for n, target in links(doc):
            file, _, anchor = target.partition("#")
            dest = (doc.parent / file).resolve() if file else doc
            where = f"{doc.relative_to(REPO)}:{n}: {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where} (no such heading)")
    assert not broken, "\n".join(broken)


def test_slugs_follow_github():
    assert slug("The fidelity table: H200, 2026-12-01 ~15:22 UTC (torch 2.11.0+cu130)") == \
        "the-fidelity-table-h200-2026-12-01-1522-utc-torch-2110cu130"
    assert slug("Served by a real vLLM (`benchmarks/vllm_serve.py`, issue 24)") == \
        "served-by-a-real-vllm-benchmarksvllm_servepy-issue-24"
    assert slug("What the defaults were chosen by (issue 31: speculators' recipe)") == \
        "what-the-defaults-were-chosen-by-issue-31-speculators-recipe"
