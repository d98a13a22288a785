"""A local stand-in for the Hugging Face Hub: the routes the real huggingface_hub client calls, on
127.0.0.1, so the tests drive the real client (HF_ENDPOINT pointed here) without the network.

Routes: ``GET /api/models/{repo}[/revision/{rev}]`` (model info: sha, siblings),
``GET /api/models/{repo}/tree/{rev}`` (the file listing), ``HEAD``/``GET /{repo}/resolve/{rev}/{path}``
(ETag, X-Repo-Commit, Content-Length; ``Range: bytes=N-`` answered 206). Errors carry the Hub's
``X-Error-Code`` (RepoNotFound, GatedRepo, RevisionNotFound, EntryNotFound), which the client maps to
its exception types. ``cut_after`` drops the connection once, mid-body, after that many bytes of a
file: the client must resume with a Range request.
"""
from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


@dataclass
class Repo:
    # revision name (branch or tag) -> commit; commit -> {path: bytes}
    refs: dict[str, str]
    commits: dict[str, dict[str, bytes]]
    gated_token: str | None = None  # set: only "Authorization: Bearer <token>" may read it


@dataclass
class FakeHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    log: list[tuple[str, str, dict]] = field(default_factory=list)  # (method, path, headers, lower case)
    cut_after: dict[str, int] = field(default_factory=dict)  # file path -> bytes sent before a drop
    url: str = ""

    def add(self, repo_id: str, files: dict[str, bytes], *, revision: str = "main", commit: str | None = None,
            gated_token: str | None = None) -> str:
        commit = commit or hashlib.sha1(repo_id.encode() + revision.encode()).hexdigest()
        repo = self.repos.setdefault(repo_id, Repo(refs={}, commits={}, gated_token=gated_token))
        repo.refs[revision] = commit
        repo.commits[commit] = dict(files)
        return commit

    def downloads(self) -> list[str]:
        """The file paths GET (not HEAD) was asked for, in order."""
        return [p.split("/resolve/", 1)[1].split("/", 1)[1] for m, p, _ in self.log if m == "GET" and "/resolve/" in p]


def _etag(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def do_GET(self) -> None:
        self._serve(head=False)

    def _error(self, status: int, code: str, message: str = "") -> None:
        body = json.dumps({"error": message or code}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message or code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, obj) -> None:
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _repo(self, repo_id: str) -> Repo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", f"Repository Not Found for {repo_id}")
            return None
        if repo.gated_token is not None and self.headers.get("Authorization") != f"Bearer {repo.gated_token}":
            self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted")
            return None
        return repo

    def _commit(self, repo: Repo, rev: str) -> str | None:
        commit = repo.refs.get(rev) or (rev if rev in repo.commits else None)
        if commit is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return commit

    def _serve(self, head: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        self.hub.log.append((self.command, path, {k.lower(): v for k, v in self.headers.items()}))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo_id = "/".join(parts[2:4])
            rest = parts[4:]
            repo = self._repo(repo_id)
            if repo is None:
                return
            if not rest or rest[0] == "revision":
                commit = self._commit(repo, rest[1] if rest else "main")
                if commit is not None:
                    self._json({"id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                                "siblings": [{"rfilename": f} for f in repo.commits[commit]]})
                return
            if rest[0] == "tree":
                commit = self._commit(repo, "/".join(rest[1:]))
                if commit is not None:
                    self._json([{"type": "file", "path": f, "size": len(d), "oid": hashlib.sha1(d).hexdigest(),
                                 "lfs": {"oid": _etag(d), "size": len(d), "pointerSize": 130}}
                                for f, d in repo.commits[commit].items()])
                return
            self._error(404, "EntryNotFound")
            return
        if len(parts) >= 5 and parts[2] == "resolve":
            repo_id = "/".join(parts[:2])
            repo = self._repo(repo_id)
            if repo is None:
                return
            commit = self._commit(repo, parts[3])
            if commit is None:
                return
            name = "/".join(parts[4:])
            data = repo.commits[commit].get(name)
            if data is None:
                self._error(404, "EntryNotFound", f"{name} not found")
                return
            start = 0
            rng = self.headers.get("Range")
            if rng and rng.startswith("bytes=") and not head:
                start = int(rng[len("bytes="):].split("-")[0])
            body = data[start:]
            self.send_response(206 if start else 200)
            self.send_header("ETag", f'"{_etag(data)}"')
            self.send_header("X-Repo-Commit", commit)
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(body)))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if head:
                return
            cut = self.hub.cut_after.pop(name, None)
            if cut is not None:
                self.wfile.write(body[:cut])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)
                return
            self.wfile.write(body)
            return
        self._error(404, "EntryNotFound", path)


def start(hub: FakeHub) -> tuple[ThreadingHTTPServer, threading.Thread]:
    handler = type("Handler", (_Handler,), {"hub": hub})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread
