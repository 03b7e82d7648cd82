"""The client side of the OpenAI chat-completions API: `ChatClient` calls such servers (vLLM,
SGLang or eyas.serve.openai_server's `ChatServer`) round-robin with retries and exponential
backoff (the engine of `eyas regenerate --backend openai`). A request that cannot be had raises
`RequestFailed` (`OutOfRetries` after every retry, `RefusedAll` where the server refuses every
request); once the client is closed, `ClientClosed`.
"""

from __future__ import annotations

import http.client
import itertools
import json
import logging
import os
import random
import socket
import threading
import urllib.parse

from eyas.targets.chat import THINK_CLOSE, THINK_OPEN
from eyas.errors import EyasError
from eyas.serve.generator import Generation

log = logging.getLogger(__name__)

# HTTP statuses worth retrying (overload, timeouts, server faults); other 4xx are final.
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# What to do when GET /v1/models answers with these (ChatClient.check).
CHECK_HINTS = {401: " (set $OPENAI_API_KEY to the key the server was started with, its --api-key)",
               403: " (set $OPENAI_API_KEY to a key this server accepts)",
               404: " (give the server's base URL, http://HOST:PORT or http://HOST:PORT/v1: "
                    "eyas adds /v1/models and /v1/chat/completions)"}


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
