"""DNS rebinding (Host), CORS, the bearer key and the body size limit."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from localpaged.server.app import serve_in_background


def _raw_request(base_url: str, request: bytes) -> bytes:
    u = urlsplit(base_url)
    with socket.create_connection((u.hostname, u.port), timeout=5) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data


@pytest.mark.parametrize("path", ["/v1/models", "/api/tags", "/metrics"])
def test_foreign_host_is_refused(base_url: str, path: str) -> None:
    r = httpx.get(base_url + path, headers={"Host": "evil.example"})
    assert r.status_code == 403
    r = httpx.get(base_url + path, headers={"Host": "evil.example:11435"})
    assert r.status_code == 403


def test_foreign_host_cannot_generate(base_url: str, model_name: str) -> None:
    r = httpx.post(base_url + "/v1/chat/completions", headers={"Host": "attacker.localhost.evil"},
                   json={"model": model_name, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"


def test_empty_host_is_refused(base_url: str) -> None:
    reply = _raw_request(base_url, b"GET /api/tags HTTP/1.1\r\nHost: \r\nConnection: close\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 403")


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "[::1]:80", "LOCALHOST:1234",
                                  "tab.localhost"])
def test_loopback_hosts_are_accepted(base_url: str, host: str) -> None:
    assert httpx.get(base_url + "/api/version", headers={"Host": host}).status_code == 200


def test_cross_origin_gets_no_cors_grant_by_default(base_url: str) -> None:
    evil = "https://evil.example"
    r = httpx.get(base_url + "/v1/models", headers={"Origin": evil})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    pre = httpx.options(base_url + "/v1/chat/completions", headers={
        "Origin": evil, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})
    assert "access-control-allow-origin" not in pre.headers


@pytest.mark.parametrize("origin", ["http://localhost:5173", "http://127.0.0.1:8080",
                                    "vscode-webview://1a2b3c4d", "vscode-file://vscode-app"])
def test_loopback_and_editor_origins_get_cors(base_url: str, origin: str) -> None:
    r = httpx.get(base_url + "/v1/models", headers={"Origin": origin})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
    pre = httpx.options(base_url + "/api/chat", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type,authorization"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == origin


KEY = "s3cret-key"


@pytest.fixture(scope="module")
def guarded(engine_client: Any) -> Iterator[str]:
    """A second server on the same engine with a key, extra host/origin and a small body cap."""
    handle = serve_in_background(engine_client, api_key=KEY, allowed_hosts=["box.lan"],
                                 allowed_origins=["https://chat.example"],
                                 max_body_bytes=4096)
    yield handle.url
    handle.stop()


def test_bearer_key(guarded: str, model_name: str) -> None:
    assert httpx.get(guarded + "/v1/models").status_code == 401
    wrong = httpx.get(guarded + "/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    assert httpx.get(guarded + "/api/tags").json() == {"error": "missing or invalid API key "
                                                                "(Authorization: Bearer ...)"}
    assert httpx.get(guarded + "/api/version").status_code == 200  # health checks stay open
    client = openai.OpenAI(base_url=guarded + "/v1", api_key=KEY, max_retries=0)
    r = client.chat.completions.create(model=model_name, max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
    assert r.usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded + "/v1", api_key="bad", max_retries=0).models.list()


def test_configured_host_and_origin(guarded: str) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(guarded + "/v1/models", headers={**auth, "Host": "box.lan:8080"}
                     ).status_code == 200
    assert httpx.get(guarded + "/v1/models", headers={**auth, "Host": "evil.example"}
                     ).status_code == 403
    r = httpx.get(guarded + "/v1/models", headers={**auth, "Origin": "https://chat.example"})
    assert r.headers["access-control-allow-origin"] == "https://chat.example"
    pre = httpx.options(guarded + "/v1/models", headers={
        "Origin": "https://chat.example", "Access-Control-Request-Method": "GET"})
    assert pre.status_code == 200  # preflights carry no key


def test_body_size_limit(guarded: str, model_name: str) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    big = {"model": model_name, "messages": [{"role": "user", "content": "x" * 5000}]}
    r = httpx.post(guarded + "/v1/chat/completions", json=big, headers=auth)
    assert r.status_code == 413 and r.json()["error"]["message"].startswith("request body")

    def chunks() -> Iterator[bytes]:  # no Content-Length: chunked transfer
        yield b'{"model": "x", "prompt": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}'

    r = httpx.post(guarded + "/api/generate", content=chunks(), headers=auth)
    assert r.status_code == 413 and "error" in r.json()


def test_model_names_never_become_paths(base_url: str) -> None:
    for name in ("../../etc/passwd", "/etc/passwd", "a/../../b", "x\u0000y"):
        r = httpx.post(base_url + "/api/show", json={"model": name})
        assert r.status_code in (400, 404)
        r = httpx.post(base_url + "/api/pull", json={"model": name, "stream": False})
        assert r.status_code == 400


def test_ip_literal_hosts_when_serving_beyond_loopback(engine_client: Any) -> None:
    """Bound beyond loopback, IP-literal Hosts are fine (no name, no rebinding); names are not."""
    from starlette.testclient import TestClient

    from localpaged.server.app import create_app

    lan = TestClient(create_app(engine_client, allow_ip_hosts=True), base_url="http://x")
    assert lan.get("/api/version", headers={"Host": "192.168.1.20:11435"}).status_code == 200
    assert lan.get("/api/version", headers={"Host": "[fe80::1]:80"}).status_code == 200
    assert lan.get("/api/version", headers={"Host": "evil.example"}).status_code == 403
    local = TestClient(create_app(engine_client), base_url="http://x")
    assert local.get("/api/version", headers={"Host": "192.168.1.20"}).status_code == 403
