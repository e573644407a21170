"""A local HTTP server that speaks the part of the Hugging Face Hub's API that `huggingface_hub` downloads
through, so the Hub tests run offline against real sockets (`HF_ENDPOINT=hub.url`):

- `GET /api/models/{repo}/revision/{revision}`: model info (`id`, `sha`, `siblings`);
- `GET /api/models/{repo}/tree/{revision}`: the file listing (size, blob oid, `lfs` for weights);
- `HEAD|GET /{repo}/resolve/{revision}/{path}`: the file, with `X-Repo-Commit`, `ETag`
  (`X-Linked-Etag` / `X-Linked-Size` for LFS files), `Content-Length` and `Range` support (206).

Errors carry the Hub's `X-Error-Code` header (RepoNotFound, RevisionNotFound, EntryNotFound), which is
how `huggingface_hub` tells them apart. `cut_once[name] = n` makes the first GET of a file send its
first n bytes and drop the connection, as a flaky network would; every request is recorded.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class HubRepo:
    files: dict[str, bytes]
    revisions: tuple[str, ...] = ("main",)  # branch and tag names; the commit sha always works too
    token: str | None = None  # private: requests must carry `Authorization: Bearer <token>`

    @property
    def sha(self) -> str:
        digest = hashlib.sha1()
        for name in sorted(self.files):
            digest.update(name.encode() + b"\0" + hashlib.sha1(self.files[name]).digest())
        return digest.hexdigest()

    def is_lfs(self, name: str) -> bool:
        return name.endswith((".safetensors", ".bin", ".gguf", ".onnx"))


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    authorization: str | None


@dataclass
class FakeHub:
    repos: dict[str, HubRepo] = field(default_factory=dict)
    cut_once: dict[str, int] = field(default_factory=dict)  # file name -> bytes sent before its first GET drops
    requests: list[Request] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def add_model_dir(self, repo_id: str, directory: Path, extra: dict[str, bytes] | None = None,
                      **kwargs) -> HubRepo:
        files = {p.relative_to(directory).as_posix(): p.read_bytes()
                 for p in sorted(directory.rglob("*")) if p.is_file()}
        self.repos[repo_id] = HubRepo({**files, **(extra or {})}, **kwargs)
        return self.repos[repo_id]

    def file_gets(self, name: str) -> list[Request]:
        return [r for r in self.requests if r.method == "GET" and r.path.endswith("/" + name)
                and "/resolve/" in r.path]

    def start(self) -> FakeHub:
        hub = self

        class Handler(_HubHandler):
            pass

        Handler.hub = hub
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


_INFO = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/(?P<kind>revision|tree)/(?P<rev>[^/?]+)(?P<rest>/[^?]*)?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")


class _HubHandler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet test output
        pass

    def do_GET(self) -> None:
        self._handle(send_body=True)

    def do_HEAD(self) -> None:
        self._handle(send_body=False)

    def _handle(self, send_body: bool) -> None:
        path = urlsplit(self.path).path
        self.hub.requests.append(Request(self.command, path, self.headers.get("Range"),
                                         self.headers.get("Authorization")))
        if m := _INFO.match(path):
            repo = self._repo(m["repo"], unquote(m["rev"]))
            if repo is None:
                return
            if m["kind"] == "revision":
                body = {"id": m["repo"], "modelId": m["repo"], "sha": repo.sha, "private": repo.token is not None,
                        "siblings": [{"rfilename": name} for name in sorted(repo.files)]}
            else:
                body = [self._tree_entry(repo, name) for name in sorted(repo.files)]
            self._json(200, body, send_body)
        elif m := _RESOLVE.match(path):
            repo = self._repo(m["repo"], unquote(m["rev"]))
            if repo is None:
                return
            name = unquote(m["path"])
            if name not in repo.files:
                self._error(404, "EntryNotFound", f"{name} not found", {"X-Repo-Commit": repo.sha})
                return
            self._file(repo, name, send_body)
        else:
            self._error(404, None, "not found")

    def _repo(self, repo_id: str, revision: str) -> HubRepo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is not None and repo.token and self.headers.get("Authorization") != f"Bearer {repo.token}":
            repo = None  # the Hub answers a private repo without the right token as if it did not exist
        if repo is None:
            self._error(401, "RepoNotFound", "Repository not found")
        elif revision not in (*repo.revisions, repo.sha):
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        else:
            return repo
        return None

    def _tree_entry(self, repo: HubRepo, name: str) -> dict:
        data = repo.files[name]
        entry = {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
        if repo.is_lfs(name):
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return entry

    def _file(self, repo: HubRepo, name: str, send_body: bool) -> None:
        data = repo.files[name]
        etag = hashlib.sha256(data).hexdigest() if repo.is_lfs(name) else hashlib.sha1(data).hexdigest()
        headers = {"X-Repo-Commit": repo.sha, "ETag": f'"{etag}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        if repo.is_lfs(name):
            headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))})
        start, status = 0, 200
        if send_body and (wanted := re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")):
            start, status = int(wanted[1]), 206
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        body = data[start:]
        cut = self.hub.cut_once.pop(name, None) if send_body else None
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        if cut is not None:
            self.send_header("Connection", "close")
        self.end_headers()
        if not send_body:
            return
        if cut is not None:  # part of the body, then the connection drops
            self.wfile.write(body[:cut])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(body)

    def _json(self, status: int, body, send_body: bool) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if send_body:
            self.wfile.write(data)

    def _error(self, status: int, code: str | None, message: str, extra: dict | None = None) -> None:
        data = json.dumps({"error": message}).encode()
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
