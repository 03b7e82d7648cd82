"""The local OpenAI-compatible server against a real socket (issue 34): 400 for bad requests,
an optional API key, a body-size limit and a socket timeout."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from eyas.errors import EyasError
from eyas.serve.generator import Generation
from eyas.serve.openai_client import ChatClient, ClientClosed, RequestFailed
from eyas.serve.openai_server import ChatServer, main


class EchoGenerator:
    """Stands in for LocalGenerator: every prompt has 3 tokens, every answer is "hi"."""

    def __init__(self):
        self.lock = threading.Lock()
        self.asked: list[int] = []

    def render(self, messages, template_kwargs=None):
        return [1, 2, 3]

    def generate(self, prompts, max_new_tokens, temperature=0.0, top_p=1.0):
        self.asked.append(max_new_tokens)
        return [Generation("hi", "stop", 1)]


def _post(url: str, body: dict, key: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _raw(server: ChatServer, head: bytes, body: bytes = b"", wait: float = 10.0) -> bytes:
    host, port = server.httpd.server_address[:2]
    with socket.create_connection((host, port), timeout=wait) as sock:
        sock.sendall(head + body)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


def test_bad_max_tokens_and_sampling_are_400_not_500():
    gen = EchoGenerator()
    with ChatServer(gen, "m", max_tokens_limit=64) as server:
        for bad in (-5, 0, 65, "7", 1.5, True):
            status, body = _post(server.url, {**CHAT, "max_tokens": bad})
            assert status == 400 and "max_tokens must be an integer from 1 to 64" in \
                body["error"]["message"], (bad, body)
        assert _post(server.url, {**CHAT, "temperature": -1})[0] == 400
        assert _post(server.url, {**CHAT, "top_p": 0})[0] == 400
        status, body = _post(server.url, {**CHAT, "max_tokens": 64})
        assert status == 200 and body["choices"][0]["message"]["content"] == "hi"
        assert _post(server.url, {**CHAT, "max_tokens": None, "max_completion_tokens": 5})[0] == 200
    assert gen.asked == [64, 5]  # refused requests never reached the model
    with ChatServer(EchoGenerator(), "m") as server:  # a client gives up at once on a 400
        client = ChatClient([server.url], "m", params={"max_tokens": -5}, retries=3)
        with pytest.raises(RequestFailed, match="refused the request: HTTP 400"):
            client.complete(CHAT["messages"])
        assert server.stats["requests"] == 1


def test_api_key_is_required_when_set(monkeypatch):
    with ChatServer(EchoGenerator(), "m", api_key="s3cret") as server:
        assert _post(server.url, CHAT)[0] == 401
        assert _post(server.url, CHAT, key="wrong")[0] == 401
        assert _post(server.url, CHAT, key="s3cret")[0] == 200
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(server.url + "/v1/models", timeout=10)
        assert err.value.code == 401
        with urllib.request.urlopen(server.url + "/health", timeout=10) as resp:
            assert resp.status == 200  # liveness stays open, as in vLLM
        monkeypatch.setenv("OPENAI_API_KEY", "s3cret")  # what eyas regenerate sends
        client = ChatClient([server.url], "m")
        client.check()
        assert client.complete(CHAT["messages"]).text == "hi"


def test_a_huge_content_length_is_413_unread_and_a_silent_client_is_dropped():
    with ChatServer(EchoGenerator(), "m", max_body_bytes=1000, timeout=0.5) as server:
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nContent-Length: 99999999999\r\n\r\n")
        answer = _raw(server, head)
        assert answer.startswith(b"HTTP/1.0 413") or answer.startswith(b"HTTP/1.1 413")
        assert _raw(server, head.replace(b"99999999999", b"-1")).split(b" ")[1] == b"413"
        assert _raw(server, head.replace(b"Content-Length: 99999999999\r\n", b""))\
            .split(b" ")[1] == b"411"
        start = time.perf_counter()
        answer = _raw(server, head.replace(b"99999999999", b"500"), b'{"model"')
        assert answer == b"" and time.perf_counter() - start < 5  # closed by the timeout
        assert _post(server.url, CHAT)[0] == 200  # and the server still answers


def test_cli_warns_when_exposed_without_a_key(monkeypatch, caplog):
    import eyas.serve.openai_server as srv

    started = {}

    class Stop(Exception):
        pass

    def fake_server(generator, name, **kw):
        started.update(kw)
        raise Stop

    monkeypatch.setattr(srv, "load_generator", lambda *a, **k: EchoGenerator())
    monkeypatch.setattr(srv, "ChatServer", fake_server)
    monkeypatch.delenv(srv.API_KEY_ENV, raising=False)
    with pytest.raises(Stop):
        main(["m", "--host", "0.0.0.0", "--device", "cpu"])
    assert "without an API key" in caplog.text and started["api_key"] is None
    monkeypatch.setenv(srv.API_KEY_ENV, "k")
    with pytest.raises(Stop):
        main(["m", "--host", "0.0.0.0", "--device", "cpu", "--max-tokens-limit", "9"])
    assert started["api_key"] == "k" and started["max_tokens_limit"] == 9


def test_check_leaves_out_the_servers_that_cannot_answer(monkeypatch, caplog):
    # A server that is down, serves another model or wants another key got its round-robin
    # share all the same: those rows came back refused (404, 401) or out of retries.
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{free.getsockname()[1]}"  # nothing listens there
    with ChatServer(EchoGenerator(), "m") as good, ChatServer(EchoGenerator(), "other") as other, \
            ChatServer(EchoGenerator(), "m", api_key="k") as keyed:
        client = ChatClient([good.url, other.url, keyed.url, down], "m", retries=0)
        client.check()
        assert client.urls == [good.url]
        for _ in range(8):
            assert client.complete(CHAT["messages"]).text == "hi"
        assert good.stats["completions"] == 8
        assert other.stats["requests"] == keyed.stats["requests"] == 0
    assert caplog.text.count("not using server") == 3


def test_check_names_the_fix_for_a_wrong_key_or_path(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "wrong")
    with ChatServer(EchoGenerator(), "m", api_key="k") as keyed:
        with pytest.raises(EyasError, match=r"HTTP 401: .*set \$OPENAI_API_KEY"):
            ChatClient([keyed.url], "m").check()
    monkeypatch.delenv("OPENAI_API_KEY")
    with ChatServer(EchoGenerator(), "m") as server:
        with pytest.raises(EyasError, match="HTTP 404: .*give the server's base URL"):
            ChatClient([server.url + "/api"], "m").check()
        # an endpoint copied from the server's docs is read as its base URL
        for endpoint in ("/v1/chat/completions", "/v1/models/", "/v1"):
            client = ChatClient([server.url + endpoint], "m")
            client.check()
            assert client.urls == [server.url]


def test_a_closed_client_sends_nothing_more_and_drops_what_is_in_flight():
    # Request 1 is held 5 s (in flight at close); request 2 fails, so its thread waits to retry.
    with ChatServer(EchoGenerator(), "m", slow_requests=(1,), slow_seconds=5,
                    fail_every=2) as server:
        client = ChatClient([server.url], "m", retries=3, retry_backoff=2.0)
        errors: list[BaseException] = []

        def ask():
            try:
                client.complete(CHAT["messages"])
            except BaseException as err:  # noqa: BLE001 (checked below)
                errors.append(err)

        threads = []
        for seen in ("slowed", "failed"):
            threads.append(threading.Thread(target=ask))
            threads[-1].start()
            while server.stats[seen] < 1:
                time.sleep(0.01)
        start = time.monotonic()
        client.close()
        for thread in threads:
            thread.join(timeout=5)
        assert time.monotonic() - start < 1  # neither waited for its answer or its retry
        assert [type(err) for err in errors] == [ClientClosed, ClientClosed]
        with pytest.raises(ClientClosed):
            client.complete(CHAT["messages"])
        time.sleep(2.5)  # past the retry the failed request would have made
        assert server.stats["requests"] == 2
