"""Chat generation over the OpenAI chat-completions API, both ends, for any transformers model.

- `LocalGenerator` renders prompts with the model's chat template and generates in left-padded
  batches with a KV cache (the engine of `eyas regenerate --backend transformers`).
- `ChatServer` puts it behind `POST /v1/chat/completions` and `GET /v1/models`, answering the
  way vLLM and SGLang do (non-streaming, n = 1), for tests and quick checks:

      python -m eyas.serve.openai_server /path/to/model --port 8000

  Every connection gets a thread; the model runs one request at a time (use vLLM or SGLang for
  throughput). Constructor options inject the faults a client must survive: HTTP 500 answers,
  slow answers, a context-length limit (HTTP 400).
- `ChatClient` calls such servers (vLLM, SGLang or `ChatServer`) round-robin with retries and
  exponential backoff (the engine of `eyas regenerate --backend openai`).
"""

from __future__ import annotations

import argparse
import hmac
import http.client
import itertools
import json
import logging
import os
import random
import socket
import threading
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from eyas.targets.chat import THINK_CLOSE, THINK_OPEN
from eyas.targets.masking import render
from eyas.errors import EyasError

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256  # when a request names no max_tokens
MAX_TOKENS_LIMIT = 8192  # the most new tokens one request may ask for (--max-tokens-limit)
MAX_BODY_BYTES = 8 << 20  # larger request bodies get HTTP 413 unread (--max-body-mb)
SOCKET_TIMEOUT_S = 60.0  # a client silent this long mid-request loses its connection
API_KEY_ENV = "EYAS_API_KEY"  # the key `python -m eyas.serve.openai_server` requires, if set
# HTTP statuses worth retrying (overload, timeouts, server faults); other 4xx are final.
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# What to do when GET /v1/models answers with these (ChatClient.check).
CHECK_HINTS = {401: " (set $OPENAI_API_KEY to the key the server was started with, its --api-key)",
               403: " (set $OPENAI_API_KEY to a key this server accepts)",
               404: " (give the server's base URL, http://HOST:PORT or http://HOST:PORT/v1: "
                    "eyas adds /v1/models and /v1/chat/completions)"}


@dataclass(frozen=True)
class Generation:
    """One generated turn: its text, why generation stopped ("stop" at an end-of-turn token,
    "length" at the token limit) and how many tokens it took."""

    text: str
    finish_reason: str
    num_tokens: int = 0


def stop_token_ids(generation_config, tokenizer) -> frozenset[int]:
    """End-of-turn ids: the generation config's eos ids (e.g. Llama 3's <|eot_id|>) and the
    tokenizer's eos, the set vLLM stops on."""
    ids = generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise EyasError("the target names no end-of-turn token: set eos_token_id in its "
                        "generation_config.json")
    return frozenset(ids)


def render_prompt(tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
    """Prompt ids for the assistant turn that follows `messages` (ChatFormatError where the
    chat template refuses them)."""
    text = render(tokenizer, messages, add_generation_prompt=True,
                  template_kwargs=template_kwargs)
    # The rendered template already holds BOS and every special token it needs.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def cut_at_stop(row: list[int], stop_ids: frozenset[int], tokenizer) -> Generation:
    """The Generation of generated ids `row`: its text up to the first end-of-turn id, "stop"
    if there is one ("length" if not), and the tokens it took (the end-of-turn id included)."""
    end = next((i for i, t in enumerate(row) if t in stop_ids), None)
    text = tokenizer.decode(row[:end], skip_special_tokens=True)
    return Generation(text, "length" if end is None else "stop",
                      len(row) if end is None else end + 1)


BATCHING = ("continuous", "padded", "lookup")
LOOKUP_K = 4  # drafts per step of --batching lookup (prompt lookup, 2..4-token suffixes)
CB_BLOCK_TOKENS = 256  # tokens per block of transformers' paged cache (its default)


class LocalGenerator:
    """Batched chat generation with a transformers model and its chat template.

    batching "continuous": transformers' continuous batching (`model.generate_batch`: a paged
    KV cache where a finished row frees its room for the next prompt at once, so a batch never
    waits for its longest answer); "padded": left-padded batches through `model.generate`,
    which run until their longest row ends; "lookup": prompt-lookup speculative decoding of
    the whole batch (eyas.serve.batched with the n-gram drafter: each row accepts its own
    drafts and leaves the batch when done; exact at any temperature, top_p 1 only, and the
    generation config's other sampling options, e.g. repetition_penalty, are not applied).
    Greedy outputs are the same (tests). Models without `generate_batch` (some remote code)
    or spread over several devices use padded instead of continuous.
    """

    def __init__(self, model, tokenizer, batching: str = "padded", concurrency: int = 64):
        if batching not in BATCHING:
            raise EyasError(f"batching {batching!r}: use one of {BATCHING}")
        devices = set(getattr(model, "hf_device_map", {}).values())
        if batching == "continuous" and (not hasattr(model, "generate_batch")
                                         or len(devices) > 1):
            log.info("continuous batching is not available for this model (%s); using "
                     "padded batches", "spread over several devices" if len(devices) > 1
                     else "no generate_batch")
            batching = "padded"
        self.batching = batching
        self.concurrency = concurrency  # continuous batching: conversations the cache holds
        self.model, self.tokenizer = model, tokenizer
        self.lock = threading.Lock()  # held by callers that share this generator across threads
        self.stop_ids = stop_token_ids(model.generation_config, tokenizer)
        self._batch_target = None  # batching "lookup": made at its first batch
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else min(self.stop_ids)

    def render(self, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
        """Prompt ids for the assistant turn that follows `messages`."""
        return render_prompt(self.tokenizer, messages, template_kwargs)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0) -> list[Generation]:
        """One Generation per prompt; a batch that runs out of GPU memory is split in two."""
        import torch

        try:
            return self._generate(prompts, max_new_tokens, temperature, top_p)
        except torch.cuda.OutOfMemoryError:
            pass  # retried below, outside this block: the exception's traceback holds the
            # failed forward's frames and so its activations, which must be freed first
        torch.cuda.empty_cache()
        if len(prompts) == 1:
            return [Generation("", "out_of_memory")]
        half = len(prompts) // 2
        log.warning("out of GPU memory with %d prompts; splitting the batch", len(prompts))
        return (self.generate(prompts[:half], max_new_tokens, temperature, top_p)
                + self.generate(prompts[half:], max_new_tokens, temperature, top_p))

    def _config(self, max_new_tokens: int, temperature: float, top_p: float):
        from transformers import GenerationConfig

        # Unset options (e.g. top_k) come from the model's generation_config, as in vLLM.
        sampling = (dict(do_sample=True, temperature=temperature, top_p=top_p)
                    if temperature > 0 else dict(do_sample=False))
        return GenerationConfig(max_new_tokens=max_new_tokens, pad_token_id=self.pad_id,
                                eos_token_id=sorted(self.stop_ids), **sampling)

    def _result(self, row: list[int]) -> Generation:
        return cut_at_stop(row, self.stop_ids, self.tokenizer)

    def _generate(self, prompts, max_new_tokens, temperature, top_p) -> list[Generation]:
        if self.batching == "continuous":
            return self._generate_continuous(prompts, max_new_tokens, temperature, top_p)
        if self.batching == "lookup" and top_p == 1.0:
            return self._generate_lookup(prompts, max_new_tokens, temperature)
        return self._generate_padded(prompts, max_new_tokens, temperature, top_p)

    def _generate_lookup(self, prompts, max_new_tokens, temperature) -> list[Generation]:
        import torch

        from eyas.serve.batched import BatchNgramDrafter, BatchTarget, generate_batch
        from eyas.serve.speculate import Sampling
        from eyas.targets.models import inspect_model, submodule

        if self._batch_target is None:
            info = inspect_model(self.model)
            self._batch_target = BatchTarget(self.model, submodule(self.model, info.layers_path),
                                             submodule(self.model, info.norm_path))
        target = self._batch_target
        # sampling: a generator seeded from the global one (which --seed seeds)
        gen = torch.Generator(device=target.device).manual_seed(
            int(torch.randint(2**62, (1,)))) if temperature > 0 else None
        done = generate_batch(target, BatchNgramDrafter(2, 4), [torch.tensor(p) for p in prompts],
                              LOOKUP_K, max_new_tokens, self.stop_ids, Sampling(temperature, gen))
        return [self._result(g.tokens) for g in done]

    def _generate_continuous(self, prompts, max_new_tokens, temperature,
                             top_p) -> list[Generation]:
        from transformers import ContinuousBatchingConfig

        gen_cfg = self._config(max_new_tokens, temperature, top_p)
        # A paged cache for `concurrency` conversations at once, not transformers' default of
        # most of the free memory: without flash attention every forward builds a mask over
        # the whole cache (on the H200 a 127 GB cache made 3000 prompts run for minutes
        # without a result; on a CPU it asked for 13.7 GB in a tiny test).
        longest = max(map(len, prompts)) + max_new_tokens
        blocks = self.concurrency * -(-longest // CB_BLOCK_TOKENS)
        # not under inference_mode: transformers generates in a thread of its own, which
        # updates in place the tensors made here (inference tensors there would refuse it)
        done = list(self.model.generate_batch(
            [list(p) for p in prompts], generation_config=gen_cfg,
            continuous_batching_config=ContinuousBatchingConfig(num_blocks=blocks),
            progress_bar=False).values())
        # results come in input order; a request that failed inside transformers is missing
        # or carries an error
        results, at = [], 0
        for p in prompts:
            out = done[at] if at < len(done) else None
            if out is None or list(out.prompt_ids) != list(p):
                results.append(Generation("", "error: no result from continuous batching"))
                continue
            at += 1
            results.append(Generation("", f"error: {out.error}") if out.error is not None
                           else self._result(list(out.generated_tokens)))
        if prompts and all(r.finish_reason.startswith("error") for r in results):
            # every request failed: continuous batching does not work here (its error is in
            # transformers' log); padded batches give the same answers
            log.warning("continuous batching failed for all %d prompts (%s); using padded "
                        "batches from now on", len(prompts), results[0].finish_reason[:200])
            self.batching = "padded"
            return self._generate_padded(prompts, max_new_tokens, temperature, top_p)
        return results

    def _generate_padded(self, prompts, max_new_tokens, temperature, top_p) -> list[Generation]:
        import torch

        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)  # (B, T)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding: every prompt ends at column T - 1
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        gen_cfg = self._config(max_new_tokens, temperature, top_p)
        device = self.model.device
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                      generation_config=gen_cfg)  # (B, T + new)
        return [self._result(row) for row in out[:, width:].tolist()]


def load_generator(model: str | Path, *, dtype: str = "auto", device: str | None = None,
                   device_map: str | None = None, revision: str | None = None,
                   trust_remote_code: bool = False, batching: str = "padded",
                   concurrency: int = 64) -> LocalGenerator:
    """A LocalGenerator for a hub name or folder, loaded through `eyas.targets.models`."""
    from eyas.targets.models import load_target, load_tokenizer

    target, _ = load_target(model, revision=revision, dtype=dtype, device=device,
                            device_map=device_map, trust_remote_code=trust_remote_code)
    tokenizer = load_tokenizer(model, revision=revision, trust_remote_code=trust_remote_code)
    return LocalGenerator(target, tokenizer, batching, concurrency)


def _error(status: int, message: str) -> tuple[int, dict]:
    kinds = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
             411: "LengthRequiredError", 413: "RequestTooLargeError",
             500: "InternalServerError"}
    return status, {"error": {"message": message, "type": kinds[status], "code": status}}


class _Listener(ThreadingHTTPServer):
    # socketserver's backlog of 5 overflows when a client opens its 64 connections at once
    # on a loaded machine: the kernel then resets some, and the client counts a server error
    # that the server never saw (a flaky regenerate test, seen beside a second test run)
    request_queue_size = 256


class ChatServer:
    """An OpenAI-compatible chat server on `host:port` (port 0 = a free one; see `.url`).

    Fault injection, counted over chat requests in arrival order (1-based): the first
    `fail_first` requests and every `fail_every`-th one answer HTTP 500; requests numbered in
    `slow_requests` wait `slow_seconds` first; prompts over `max_prompt_tokens` get HTTP 400.
    `stats` counts requests, injected failures and slow answers, completions and the most
    requests in flight at once.

    Limits: with `api_key`, every route but /health needs `Authorization: Bearer KEY` (HTTP
    401); bodies over `max_body_bytes` get HTTP 413 unread; `max_tokens` must be 1 to
    `max_tokens_limit` (HTTP 400, which clients do not retry); a connection silent for
    `timeout` seconds is closed, so a client announcing a body it never sends holds no thread.
    """

    def __init__(self, generator: LocalGenerator, name: str, *, host: str = "127.0.0.1",
                 port: int = 0, max_prompt_tokens: int | None = None, fail_first: int = 0,
                 fail_every: int = 0, slow_requests: tuple[int, ...] = (),
                 slow_seconds: float = 0.0, api_key: str | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES, max_tokens_limit: int = MAX_TOKENS_LIMIT,
                 timeout: float = SOCKET_TIMEOUT_S):
        self.generator, self.name = generator, name
        self.api_key = api_key or None
        self.max_body_bytes, self.max_tokens_limit = max_body_bytes, max_tokens_limit
        self.timeout = timeout
        self.max_prompt_tokens = max_prompt_tokens
        self.fail_first, self.fail_every = fail_first, fail_every
        self.slow_requests, self.slow_seconds = frozenset(slow_requests), slow_seconds
        self.stats: Counter = Counter()
        self._stats_lock = threading.Lock()
        self._in_flight = 0
        self.httpd = _Listener((host, port), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.chat = self
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "ChatServer":
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True,
                                        name="eyas-chat-server")
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> "ChatServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.name, "object": "model",
                                            "owned_by": "eyas"}]}

    def chat(self, raw: bytes) -> tuple[int, dict]:
        """(HTTP status, JSON body) for one chat request, faults included."""
        with self._stats_lock:
            self.stats["requests"] += 1
            number = self.stats["requests"]
            self._in_flight += 1
            self.stats["peak_in_flight"] = max(self.stats["peak_in_flight"], self._in_flight)
        try:
            if number <= self.fail_first or (self.fail_every and number % self.fail_every == 0):
                self._count("failed")
                return _error(500, f"induced failure of request {number}")
            if number in self.slow_requests:
                self._count("slowed")
                time.sleep(self.slow_seconds)
            return self._complete(raw, number)
        finally:
            with self._stats_lock:
                self._in_flight -= 1

    def _count(self, key: str) -> None:
        with self._stats_lock:
            self.stats[key] += 1

    def _complete(self, raw: bytes, number: int) -> tuple[int, dict]:
        try:
            body = json.loads(raw)
            messages = body["messages"]
            if not isinstance(messages, list) or not all(
                    isinstance(m, dict) and "role" in m for m in messages):
                raise ValueError("'messages' must be a list of {role, content} objects")
            max_tokens = next((body[k] for k in ("max_completion_tokens", "max_tokens")
                               if body.get(k) is not None), DEFAULT_MAX_TOKENS)
            if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or \
                    not 1 <= max_tokens <= self.max_tokens_limit:
                raise ValueError(f"max_tokens must be an integer from 1 to "
                                 f"{self.max_tokens_limit}, got {max_tokens!r} (ask for fewer, "
                                 f"or start the server with a larger --max-tokens-limit)")
            temperature = float(body.get("temperature", 1.0))
            top_p = float(body.get("top_p", 1.0))
            if not (0.0 <= temperature <= 100.0 and 0.0 < top_p <= 1.0):
                raise ValueError(f"temperature must be in [0, 100] and top_p in (0, 1], got "
                                 f"{temperature} and {top_p}")
            seed = None if body.get("seed") is None else int(body["seed"])
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            return _error(400, f"bad request: {err}")
        if body.get("model") != self.name:
            return _error(404, f"The model `{body.get('model')}` does not exist.")
        if body.get("stream") or body.get("n", 1) != 1:
            return _error(400, "only n=1 without streaming is supported")
        try:
            prompt = self.generator.render(messages, body.get("chat_template_kwargs"))
        except Exception as err:  # a chat template raises whatever its author chose
            return _error(400, f"chat template failed: {err}")
        if self.max_prompt_tokens is not None and len(prompt) > self.max_prompt_tokens:
            return _error(400, f"This model's maximum context length is "
                               f"{self.max_prompt_tokens} tokens. However, your request has "
                               f"{len(prompt)} input tokens.")
        with self.generator.lock:  # the model runs one request at a time
            try:
                if seed is not None:
                    import torch

                    torch.manual_seed(seed)
                (gen,) = self.generator.generate([prompt], max_tokens, temperature, top_p)
            except Exception as err:  # the server must answer whatever went wrong
                log.exception("generation failed")
                return _error(500, f"generation failed: {type(err).__name__}: {err}")
        self._count("completions")
        return 200, {
            "id": f"chatcmpl-{number}", "object": "chat.completion",
            "created": int(time.time()), "model": self.name,
            "choices": [{"index": 0, "finish_reason": gen.finish_reason,
                         "message": {"role": "assistant", "content": gen.text}}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": gen.num_tokens,
                      "total_tokens": len(prompt) + gen.num_tokens}}


class _Handler(BaseHTTPRequestHandler):
    server_version = "eyas-chat-server"

    def setup(self):
        self.timeout = self.server.chat.timeout  # applied to the socket by StreamRequestHandler
        super().setup()

    def do_GET(self):  # noqa: N802 (the http.server spelling)
        if self.path.rstrip("/") == "/health":
            self._send(200, {})
        elif not self._authorized():
            return
        elif self.path.rstrip("/") == "/v1/models":
            self._send(200, self.server.chat.models())
        else:
            self._send(*_error(404, f"no route {self.path}"))

    def do_POST(self):  # noqa: N802
        if not self._authorized():
            return
        if self.path.rstrip("/") != "/v1/chat/completions":
            self._send(*_error(404, f"no route {self.path}"))
            return
        limit = self.server.chat.max_body_bytes
        try:
            length = int(self.headers["Content-Length"])
        except (TypeError, ValueError):
            self.close_connection = True
            self._send(*_error(411, "a JSON body with a Content-Length header is required"))
            return
        if not 0 <= length <= limit:
            self.close_connection = True  # the body is never read
            self._send(*_error(413, f"the request body is {length} bytes; this server takes "
                                    f"at most {limit}"))
            return
        try:
            raw = self.rfile.read(length)
        except OSError:  # the socket timeout: a client that announced more than it sent
            self.close_connection = True
            return
        self._send(*self.server.chat.chat(raw))

    def _authorized(self) -> bool:
        """True without an API key or with the right one; else answers HTTP 401."""
        key = self.server.chat.api_key
        given = self.headers.get("Authorization") or ""
        if key is None or hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            return True
        self._send(*_error(401, "a valid API key is required: send the header "
                                "'Authorization: Bearer KEY'"))
        return False

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body, ensure_ascii=False).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            log.debug("client left before the answer (it timed out?)")

    def log_message(self, fmt, *args):
        log.debug("%s %s", self.address_string(), fmt % args)


# ---------------------------------------------------------------- client

class RequestFailed(Exception):
    """A chat request that failed for good: refused (4xx) or still failing after retries."""


class OutOfRetries(RequestFailed):
    """A chat request still failing (5xx, 429, timeout, lost connection) after every retry."""


class ClientClosed(Exception):
    """The ChatClient was closed (its user stopped): the request was not sent, or its answer
    is dropped. Not a RequestFailed: it says nothing of the row or the server."""


class RefusedAll(RequestFailed):
    """A refusal that is the server's, not the request's (401, 403: the key; 404: the path or
    model name): every request gets it, as when a key is rotated or the server reloads under
    another name mid-run."""


# refusals of every request, whatever it holds (RefusedAll)
REFUSED_ALL_STATUS = (401, 403, 404)


class ChatClient:
    """Calls OpenAI-compatible chat servers (vLLM, SGLang, ChatServer) round-robin, retrying
    overloads, server errors, timeouts and lost connections with exponential backoff.

    `params` go into every request body (max_tokens, temperature, chat_template_kwargs, ...).
    The key in $OPENAI_API_KEY, if set, is sent as a bearer token. Thread-safe. Each request
    opens its own connection straight to the server (no proxy from $http_proxy), so that
    `close()` can cut it.
    """

    def __init__(self, urls, model: str, *, params: dict | None = None, timeout: float = 600.0,
                 retries: int = 5, retry_backoff: float = 1.0):
        # the base URL, also from the endpoint a user copied from the server's docs
        self.urls = [url.rstrip("/").removesuffix("/chat/completions").removesuffix("/models")
                     .removesuffix("/v1") for url in urls]
        self.model, self.params = model, dict(params or {})
        self.timeout, self.retries, self.retry_backoff = timeout, retries, retry_backoff
        self.headers = {"Content-Type": "application/json"}
        if os.environ.get("OPENAI_API_KEY"):
            self.headers["Authorization"] = "Bearer " + os.environ["OPENAI_API_KEY"]
        self._turn = itertools.count()  # next() on a count is atomic: safe across threads
        self._closed = threading.Event()
        self._lock = threading.Lock()  # close() against requests about to send
        self._sockets: set[socket.socket] = set()  # of the requests in flight

    def check(self) -> None:
        """Keep the servers that answer and serve the model, warning about the others (their
        share would fail: a request to them is refused or retried until it runs out of tries);
        fail now, saying what to do, if none does."""
        served, usable, errors, refused = set(), [], [], []
        for url in self.urls:
            try:
                status, data = self._request("GET", url + "/v1/models", None,
                                             min(self.timeout, 30))
                if not 200 <= status < 300:  # it answers, but not with its models
                    refused.append(f"{url}: HTTP {status}: {_error_message(data)}"
                                   f"{CHECK_HINTS.get(status, '')}")
                    continue
                names = {m["id"] for m in json.loads(data)["data"]}
            except (OSError, ValueError, KeyError, TypeError, http.client.HTTPException) as err:
                errors.append(f"{url}: {err}")
                continue
            served |= names
            if self.model in names:
                usable.append(url)
            else:
                errors.append(f"{url} serves {sorted(names)}, not {self.model!r}")
        if not served and refused:
            raise EyasError(f"no server lists its models: {'; '.join(refused + errors)}")
        if not served:
            raise EyasError(f"no server answers ({'; '.join(errors)}); start one, e.g. "
                            f"`vllm serve {self.model} --port 8000`, and pass its URL as "
                            f"--server-url http://HOST:8000")
        if not usable:
            raise EyasError(f"the servers serve {sorted(served)}, not {self.model!r}; pass "
                            f"--served-model-name with one of those")
        for err in refused + errors:
            log.warning("not using server %s in this run; the others take its share", err)
        self.urls = usable

    def complete(self, messages: list[dict]) -> Generation:
        """The next assistant turn after `messages`; RequestFailed when it cannot be had,
        ClientClosed once the client is closed."""
        body = json.dumps({"model": self.model, "messages": messages, "n": 1,
                           "stream": False, **self.params}).encode()
        problem = ""
        for attempt in range(self.retries + 1):
            if attempt:
                # Jitter, so that the many threads hit by one outage do not retry in lockstep.
                delay = min(60.0, self.retry_backoff * 2 ** (attempt - 1))
                self._closed.wait(delay * random.uniform(0.5, 1.0))  # close() ends the wait
            url = self.urls[next(self._turn) % len(self.urls)]
            try:
                status, data = self._request("POST", url + "/v1/chat/completions", body,
                                             self.timeout)
                if 200 <= status < 300:
                    return _parse_choice(json.loads(data))
            except (OSError, http.client.HTTPException, ValueError, KeyError, IndexError,
                    TypeError) as err:
                problem = f"{type(err).__name__} from {url}: {err}"
                log.debug("request attempt %d failed: %s", attempt + 1, problem)
                continue
            problem = f"HTTP {status} from {url}: {_error_message(data)}"
            if status in REFUSED_ALL_STATUS:
                raise RefusedAll(f"server refused the request: {problem}")
            if status not in RETRY_STATUS:
                raise RequestFailed(f"server refused the request: {problem}")
            log.debug("request attempt %d failed: %s", attempt + 1, problem)
        raise OutOfRetries(f"server error after {self.retries + 1} attempts: {problem}")

    def close(self) -> None:
        """Stop for good: no request is sent after this returns, and the connections of the
        requests in flight are cut, so that every complete() running or called later raises
        ClientClosed at once (answers that were on their way are lost)."""
        with self._lock:
            self._closed.set()
            for sock in self._sockets:
                try:
                    # socket.socket's shutdown, not SSLSocket's: that one drops the TLS state,
                    # and the thread reading the socket would then read raw TLS bytes
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)
                except OSError:  # closed meanwhile
                    pass

    def _request(self, method: str, url: str, body: bytes | None,
                 timeout: float) -> tuple[int, bytes]:
        """(status, body) of one request on a connection of its own. It is sent only while
        the client is open: its socket is registered after connecting and before sending,
        under the lock close() takes, so close() either cuts it or came first."""
        if self._closed.is_set():  # saves a connection; the check that counts is below
            raise ClientClosed("the client was closed; the request was not sent")
        parts = urllib.parse.urlsplit(url)
        kind = (http.client.HTTPSConnection if parts.scheme == "https"
                else http.client.HTTPConnection)
        conn = kind(parts.hostname, parts.port, timeout=timeout)
        sock = None
        try:
            conn.connect()
            with self._lock:
                if self._closed.is_set():
                    raise ClientClosed("the client was closed; the request was not sent")
                sock = conn.sock
                self._sockets.add(sock)
            conn.request(method, parts.path, body, {**self.headers, "Connection": "close"})
            response = conn.getresponse()
            return response.status, response.read()
        except (OSError, http.client.HTTPException):
            if self._closed.is_set():  # close() cut it, or came while it connected
                raise ClientClosed("the client was closed; the answer is dropped") from None
            raise
        finally:
            with self._lock:
                self._sockets.discard(sock)
            conn.close()


def _parse_choice(response: dict) -> Generation:
    choice = response["choices"][0]
    text = choice["message"].get("content") or ""
    # A server started with a reasoning parser returns the thinking apart; keep it inline as
    # <think>...</think>, the form the target wrote and `eyas prepare` reads.
    reasoning = choice["message"].get("reasoning_content") or choice["message"].get("reasoning")
    if isinstance(reasoning, str) and reasoning.strip():
        text = f"{THINK_OPEN}\n{reasoning.strip()}\n{THINK_CLOSE}\n\n{text.lstrip()}"
    usage = response.get("usage") or {}
    return Generation(text, str(choice.get("finish_reason")),
                      int(usage.get("completion_tokens") or 0))


def _error_message(data: bytes) -> str:
    """The message of an error answer's body (OpenAI's {"error": {"message": ...}} or text)."""
    text = data.decode("utf-8", "replace")
    try:
        body = json.loads(text)
        detail = body.get("error", body)
        return str(detail.get("message", detail) if isinstance(detail, dict) else detail)[:500]
    except (ValueError, AttributeError):
        return text[:500]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eyas.serve.openai_server",
                                     description="Serve a transformers model over the OpenAI "
                                                 "chat API (tests and quick checks).")
    parser.add_argument("model", help="hub name or model folder")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None, help="default: the model argument")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16",
                                                            "float32"))
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if "
                                                       "available, else cpu)")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                        help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}; "
                             f"eyas regenerate sends $OPENAI_API_KEY)")
    parser.add_argument("--max-tokens-limit", type=int, default=MAX_TOKENS_LIMIT,
                        help="the most new tokens one request may ask for")
    parser.add_argument("--max-body-mb", type=float, default=MAX_BODY_BYTES / 2**20,
                        help="larger request bodies are refused (HTTP 413)")
    parser.add_argument("--timeout", type=float, default=SOCKET_TIMEOUT_S,
                        help="seconds a connection may stay silent mid-request")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("serving on %s without an API key: anyone who reaches this port can run "
                    "the model; pass --api-key (or set $%s)", args.host, API_KEY_ENV)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = load_generator(args.model, dtype=args.dtype, device=args.device,
                               trust_remote_code=args.trust_remote_code)
    server = ChatServer(generator, args.served_model_name or args.model, host=args.host,
                        port=args.port, api_key=args.api_key,
                        max_body_bytes=int(args.max_body_mb * 2**20),
                        max_tokens_limit=args.max_tokens_limit, timeout=args.timeout)
    log.info("serving %s at %s/v1 (Ctrl-C stops)", server.name, server.url)
    try:
        server.httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.httpd.server_close()


if __name__ == "__main__":
    main()
