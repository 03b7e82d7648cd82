"""An OpenAI-compatible chat server for any transformers model, for tests and quick checks.

`ChatServer` puts a `LocalGenerator` (eyas.serve.generator) behind `POST /v1/chat/completions`
and `GET /v1/models`, answering the way vLLM and SGLang do (non-streaming, n = 1):

    python -m eyas.serve.openai_server /path/to/model --port 8000

Every connection gets a thread; the model runs one request at a time (use vLLM or SGLang for
throughput). Constructor options inject the faults a client (eyas.serve.openai_client's
`ChatClient`) must survive: HTTP 500 answers, slow answers, a context-length limit (HTTP 400).
"""

from __future__ import annotations

import argparse
import hmac
import json
import logging
import os
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from eyas.serve.generator import LocalGenerator, load_generator

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256  # when a request names no max_tokens
MAX_TOKENS_LIMIT = 8192  # the most new tokens one request may ask for (--max-tokens-limit)
MAX_BODY_BYTES = 8 << 20  # larger request bodies get HTTP 413 unread (--max-body-mb)
SOCKET_TIMEOUT_S = 60.0  # a client silent this long mid-request loses its connection
API_KEY_ENV = "EYAS_API_KEY"  # the key `python -m eyas.serve.openai_server` requires, if set


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
