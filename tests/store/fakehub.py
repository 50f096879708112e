"""A small local HTTP server that speaks the part of the Hugging Face hub API huggingface_hub
uses to pull a repo: the repo listing with file sizes and hashes, HEAD for file metadata, and
GET with Range for the files. Faults can be switched on per file."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class FakeRepo:
    repo: str
    commit: str
    files: dict[str, bytes]  # in listing order
    lfs: set[str] = field(default_factory=set)


@dataclass
class Faults:
    drop_after: dict[str, int] = field(default_factory=dict)  # cut the first GET after N bytes
    fail_retries: set[str] = field(default_factory=set)  # GETs after a drop answer 500
    corrupt: set[str] = field(default_factory=set)  # same size, other bytes
    delay: dict[str, float] = field(default_factory=dict)  # seconds before answering a GET


class FakeHub:
    """`with FakeHub(repo) as hub:` serves at `hub.url`; `hub.log` records requests."""

    def __init__(self, *repos: FakeRepo) -> None:
        self.repos = {r.repo: r for r in repos}
        self.faults = Faults()
        self.log: list[tuple[str, str, str | None]] = []  # (method, file or api path, Range)
        self._dropped: set[str] = set()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def gets(self, filename: str) -> list[str | None]:
        """The Range headers of every GET of `filename` (None: a full GET)."""
        return [rng for method, name, rng in self.log if method == "GET" and name == filename]

    def _listing(self, repo: FakeRepo) -> dict:
        siblings = []
        for name, data in repo.files.items():
            s: dict = {"rfilename": name, "size": len(data)}
            if name in repo.lfs:
                s["blobId"] = hashlib.sha1(name.encode()).hexdigest()  # the LFS pointer's id
                s["lfs"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                            "pointerSize": 134}
            else:
                s["blobId"] = git_blob_sha1(data)
            siblings.append(s)
        return {"id": repo.repo, "modelId": repo.repo, "sha": repo.commit, "private": False,
                "siblings": siblings}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                return None

            def _find(self) -> tuple[FakeRepo, str] | None:
                path = unquote(urlsplit(self.path).path)
                for repo in hub.repos.values():
                    for rev in (repo.commit, "main"):
                        prefix = f"/{repo.repo}/resolve/{rev}/"
                        if path.startswith(prefix) and path[len(prefix):] in repo.files:
                            return repo, path[len(prefix):]
                return None

            def _send(self, code: int, body: bytes = b"", headers: dict | None = None) -> None:
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _file_headers(self, repo: FakeRepo, name: str) -> dict:
                data = repo.files[name]
                h = {"X-Repo-Commit": repo.commit, "Accept-Ranges": "bytes"}
                if name in repo.lfs:
                    h["X-Linked-Etag"] = f'"{hashlib.sha256(data).hexdigest()}"'
                    h["X-Linked-Size"] = str(len(data))
                h["ETag"] = f'"{git_blob_sha1(data)}"'
                return h

            def do_GET(self) -> None:
                path = unquote(urlsplit(self.path).path)
                for repo in hub.repos.values():
                    if path in (f"/api/models/{repo.repo}/revision/{repo.commit}",
                                f"/api/models/{repo.repo}/revision/main"):
                        hub.log.append(("GET", path, None))
                        return self._send(200, json.dumps(hub._listing(repo)).encode(),
                                          {"Content-Type": "application/json"})
                found = self._find()
                if found is None:
                    hub.log.append(("GET", path, None))
                    return self._send(404, b'{"error":"not found"}', {"X-Error-Code": "EntryNotFound"})
                repo, name = found
                rng = self.headers.get("Range")
                hub.log.append(("GET", name, rng))
                time.sleep(hub.faults.delay.get(name, 0.0))
                data = repo.files[name]
                if name in hub.faults.corrupt:
                    data = bytes(b ^ 0xFF for b in data)
                if name in hub.faults.fail_retries and name in hub._dropped:
                    return self._send(500, b"internal error")
                start = int(rng.split("=")[1].split("-")[0]) if rng else 0
                headers = self._file_headers(repo, name)
                body = data[start:]
                if rng:
                    headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                cut = hub.faults.drop_after.get(name)
                if cut is not None and name not in hub._dropped:
                    hub._dropped.add(name)
                    self.send_response(206 if rng else 200)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body[:cut])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)  # the connection drops mid-body
                    return None
                return self._send(206 if rng else 200, body, headers)

            def do_HEAD(self) -> None:
                found = self._find()
                if found is None:
                    hub.log.append(("HEAD", self.path, None))
                    return self._send(404, b"", {"X-Error-Code": "EntryNotFound"})
                repo, name = found
                hub.log.append(("HEAD", name, None))
                self.send_response(200)
                for k, v in self._file_headers(repo, name).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(repo.files[name])))
                self.end_headers()
                return None

        return Handler
