"""A loopback stand-in for the Hugging Face Hub, for tests and offline demos.

It speaks the endpoints that ``huggingface_hub`` (2.x) uses to download a model repository, with the
same headers and JSON shapes, so the real client library runs unmodified against it:

* ``GET /api/models/{repo}[/revision/{rev}]`` -- model info (``sha`` = the resolved commit).
* ``GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=..`` -- the file listing, paginated by a
  cursor in a ``Link: <..>; rel="next"`` header like the Hub (tests can set a small ``page_size``).
* ``HEAD|GET /{repo}/resolve/{rev}/{file}`` -- small (git) files are answered directly with
  ``ETag`` = git blob id, ``X-Repo-Commit`` and ``Content-Length``; LFS files get a ``302`` to a
  "CDN" on a *different host name* (``localhost`` instead of ``127.0.0.1``) carrying
  ``X-Linked-Etag`` (sha256) and ``X-Linked-Size``, which is exactly how the client learns an LFS
  file's size and hash without following the redirect.
* ``GET /cdn/{sha256}`` -- the LFS bytes, with ``Range`` support (``206`` + ``Content-Range``).
* Errors carry ``X-Error-Code`` (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``,
  ``GatedRepo``) because that header, not the status code, decides which exception the client raises.

Faults can be injected per file (drop the connection after N bytes, or answer an HTTP status), and
every request is logged so tests can assert what the client asked for (e.g. a ``Range`` header on a
resumed download).

Why the standard library and not FastAPI/uvicorn: a dropped connection mid-body has to be a clean
TCP FIN after a partial body, which is one line with a raw socket and awkward through an ASGI server.
Nothing here touches the network beyond 127.0.0.1.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

# What git-lfs tracks by default on the Hub (its .gitattributes template), trimmed to what models use.
DEFAULT_LFS_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.model", "*.msgpack", "*.h5", "*.png")
LFS_MIN_SIZE = 10 * 1024 * 1024  # the Hub rejects larger non-LFS files; treat them as LFS
_LAST_MODIFIED = "2026-01-01T00:00:00.000Z"


@dataclass(frozen=True)
class RepoFileEntry:
    """One file of one commit: where its bytes live and the ids the Hub would report for it."""

    path: str
    source: Path
    size: int
    git_oid: str  # sha1 of the git blob (of the LFS pointer, for LFS files)
    sha256: str
    lfs: bool
    pointer_size: int

    def read(self) -> bytes:
        return self.source.read_bytes()


@dataclass
class FakeRepo:
    repo_id: str
    refs: dict[str, str] = field(default_factory=dict)  # branch/tag -> commit
    commits: dict[str, dict[str, RepoFileEntry]] = field(default_factory=dict)
    gated: bool = False
    private: bool = False


@dataclass
class Fault:
    """Misbehaviour for the next ``times`` content GETs of one file."""

    repo_id: str
    path: str
    drop_after: int | None = None  # send this many body bytes, then close the connection
    status: int | None = None  # or answer with this HTTP status instead
    times: int = 1


@dataclass(frozen=True)
class LoggedRequest:
    method: str
    path: str  # URL path, percent-decoded
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-case names
    host: str


def _git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def _file_entry(path: str, source: Path, lfs_patterns: tuple[str, ...]) -> RepoFileEntry:
    data = source.read_bytes()
    sha256 = hashlib.sha256(data).hexdigest()
    lfs = len(data) > LFS_MIN_SIZE or any(fnmatch.fnmatch(path, p) for p in lfs_patterns)
    if lfs:
        pointer = _lfs_pointer(sha256, len(data))
        return RepoFileEntry(path, source, len(data), _git_blob_oid(pointer), sha256, True, len(pointer))
    return RepoFileEntry(path, source, len(data), _git_blob_oid(data), sha256, False, 0)


class FakeHub:
    """A threaded HTTP server on 127.0.0.1 (free port) that serves directories as Hub model repos.

    Use as a context manager::

        with FakeHub() as hub:
            hub.add_repo("org/model", some_dir)
            env = hub.env(tmp_path / "hf")      # HF_ENDPOINT, HF_HOME, ... for a subprocess
            subprocess.run([..., "eagle3", "download", "org/model"], env=env)
            assert hub.requests_for("config.json")
    """

    def __init__(self, page_size: int = 1000, tokens: tuple[str, ...] = ("hf_fake_valid_token",)) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.page_size = page_size
        self.tokens = set(tokens)
        self.log: list[LoggedRequest] = []
        self.faults: list[Fault] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- setup ------------------------------------------------------------------------------------

    def add_repo(self, repo_id: str, src: str | os.PathLike[str], revision: str = "main", *,
                 gated: bool = False, private: bool = False,
                 lfs_patterns: tuple[str, ...] = DEFAULT_LFS_PATTERNS) -> str:
        """Publish every file under ``src`` as commit ``revision`` (a branch name) of ``repo_id``.

        Calling it again with another ``revision`` adds a branch; the same one moves the branch.
        Returns the (deterministic) 40-hex commit id."""
        src = Path(src)
        files: dict[str, RepoFileEntry] = {}
        for p in sorted(src.rglob("*")):
            if p.is_file():
                rel = p.relative_to(src).as_posix()
                files[rel] = _file_entry(rel, p, lfs_patterns)
        h = hashlib.sha1(f"{repo_id}\0{revision}\0".encode())
        for rel, ent in files.items():
            h.update(f"{rel}\0{ent.git_oid}\0".encode())
        commit = h.hexdigest()
        with self._lock:
            repo = self.repos.setdefault(repo_id, FakeRepo(repo_id))
            repo.gated = repo.gated or gated
            repo.private = repo.private or private
            repo.commits[commit] = files
            repo.refs[revision] = commit
        return commit

    def add_fault(self, repo_id: str, path: str, *, drop_after: int | None = None,
                  status: int | None = None, times: int = 1) -> None:
        """Make the next ``times`` content downloads of ``path`` drop after ``drop_after`` bytes, or
        answer ``status``. HEAD (metadata) requests are not affected."""
        if (drop_after is None) == (status is None):
            raise ValueError("give exactly one of drop_after, status")
        with self._lock:
            self.faults.append(Fault(repo_id, path, drop_after, status, times))

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> FakeHub:
        handler = type("_BoundHandler", (_Handler,), {"hub": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fakehub", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def port(self) -> int:
        assert self._server is not None, "FakeHub not started"
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        """The value for ``HF_ENDPOINT``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def cdn_url(self) -> str:
        # Another host name for the same socket: the client must treat it as a foreign (CDN) host.
        return f"http://localhost:{self.port}"

    def env(self, hf_home: str | os.PathLike[str], base: dict[str, str] | None = None,
            **extra: str) -> dict[str, str]:
        """Environment for a subprocess that must talk to this hub and nothing else: HF_ENDPOINT,
        a private HF_HOME, no inherited token/offline/cache/proxy settings."""
        env = dict(os.environ if base is None else base)
        for k in list(env):
            if k.upper() in {"HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                             "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_XET_CACHE", "HF_TOKEN_PATH",
                             "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"}:
                del env[k]
        env.update({
            "HF_ENDPOINT": self.url,
            "HF_HOME": str(hf_home),
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_DISABLE_XET": "1",  # the fake hub serves plain HTTP only
            "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
            "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost",
        })
        env.update(extra)
        return env

    # -- inspection -------------------------------------------------------------------------------

    def requests(self, method: str | None = None) -> list[LoggedRequest]:
        with self._lock:
            return [r for r in self.log if method is None or r.method == method]

    def content_gets(self, repo_id: str, path: str) -> list[LoggedRequest]:
        """GET requests that fetched the bytes of ``path`` (the resolve URL or its CDN target)."""
        repo = self.repos[repo_id]
        shas = {c[path].sha256 for c in repo.commits.values() if path in c}
        out = []
        for r in self.requests("GET"):
            if r.path.startswith("/cdn/") and r.path.rsplit("/", 1)[-1] in shas:
                out.append(r)
            elif r.path.startswith(f"/{repo_id}/resolve/") and r.path.endswith("/" + path):
                out.append(r)
        return out

    def clear_log(self) -> None:
        with self._lock:
            self.log.clear()

    # -- internals used by the handler -------------------------------------------------------------

    def _take_fault(self, repo_id: str, path: str) -> Fault | None:
        with self._lock:
            for f in self.faults:
                if f.repo_id == repo_id and f.path == path and f.times > 0:
                    f.times -= 1
                    return f
        return None

    def _find_blob(self, sha256: str) -> tuple[str, RepoFileEntry] | None:
        with self._lock:
            for repo in self.repos.values():
                for files in repo.commits.values():
                    for ent in files.values():
                        if ent.lfs and ent.sha256 == sha256:
                            return repo.repo_id, ent
        return None


class _HubError(Exception):
    def __init__(self, status: int, code: str | None, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers or {}


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub  # bound by FakeHub.start
    protocol_version = "HTTP/1.1"  # keep-alive, like the Hub; every response carries Content-Length

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - silence stderr logging
        pass

    # -- dispatch ---------------------------------------------------------------------------------

    def do_HEAD(self) -> None:
        self._dispatch(head=True)

    def do_GET(self) -> None:
        self._dispatch(head=False)

    def _dispatch(self, head: bool) -> None:
        parts = urlsplit(self.path)
        path = unquote(parts.path)
        query = parse_qs(parts.query)
        with self.hub._lock:
            self.hub.log.append(LoggedRequest(self.command, path, query,
                                              {k.lower(): v for k, v in self.headers.items()},
                                              self.headers.get("Host", "")))
        try:
            if path.startswith("/api/models/"):
                self._api(parts.path[len("/api/models/"):], query)
            elif path.startswith("/cdn/"):
                self._cdn(path[len("/cdn/"):], head)
            elif "/resolve/" in parts.path:
                self._resolve(parts.path, head)
            else:
                raise _HubError(404, None, "Not Found")
        except _HubError as e:
            body = json.dumps({"error": e.message}).encode()
            hdrs = {"Content-Type": "application/json", **e.headers}
            if e.code:
                hdrs["X-Error-Code"] = e.code
            hdrs["X-Error-Message"] = e.message
            self._send(e.status, hdrs, body, head)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    # -- helpers ----------------------------------------------------------------------------------

    def _send(self, status: int, headers: dict[str, str], body: bytes, head: bool) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        if "Content-Length" not in headers:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _json(self, obj: Any, extra: dict[str, str] | None = None) -> None:
        self._send(200, {"Content-Type": "application/json", **(extra or {})}, json.dumps(obj).encode(), False)

    def _authorized(self) -> bool:
        auth = self.headers.get("Authorization", "")
        return auth.startswith("Bearer ") and auth[len("Bearer "):] in self.hub.tokens

    def _repo(self, repo_id: str, for_content: bool = False) -> FakeRepo:
        repo = self.hub.repos.get(repo_id)
        if repo is None or (repo.private and not self._authorized()):
            # The Hub answers 401 to anonymous callers so as not to reveal whether a private repo exists.
            status = 404 if self._authorized() else 401
            raise _HubError(status, "RepoNotFound", "Repository not found")
        if for_content and repo.gated and not self._authorized():
            status = 403 if self.headers.get("Authorization") else 401
            raise _HubError(status, "GatedRepo",
                            f"Access to model {repo_id} is restricted. You must have access to it and be authenticated to access it. Please log in.")
        return repo

    def _commit(self, repo: FakeRepo, rev: str) -> str:
        if rev in repo.refs:
            return repo.refs[rev]
        if rev in repo.commits:
            return rev
        raise _HubError(404, "RevisionNotFound", f"Invalid rev id: {rev}")

    def _split_repo(self, raw: str, marker: str) -> tuple[str, str] | None:
        """Split ``{repo_id}/{marker}/{rest}`` where repo_id is one or two path segments."""
        segs = raw.split("/")
        for n in (2, 1):
            if len(segs) > n and segs[n] == marker:
                return unquote("/".join(segs[:n])), "/".join(segs[n + 1:])
        return None

    # -- /api/models ------------------------------------------------------------------------------

    def _api(self, raw: str, query: dict[str, list[str]]) -> None:
        split = self._split_repo(raw, "tree")
        if split is not None:
            repo_id, rest = split
            rev, _, sub = rest.partition("/")
            repo = self._repo(repo_id)
            commit = self._commit(repo, unquote(rev))
            recursive = query.get("recursive", ["false"])[0].lower() == "true"
            self._tree(repo, commit, unquote(sub), recursive, query, raw)
            return
        split = self._split_repo(raw, "revision")
        if split is not None:
            repo_id, rev = split
        else:
            repo_id, rev = unquote(raw.strip("/")), "main"
        repo = self._repo(repo_id)
        commit = self._commit(repo, unquote(rev))
        owner = repo_id.split("/")[0] if "/" in repo_id else None
        self._json({
            "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24],
            "id": repo_id,
            "modelId": repo_id,
            "author": owner,
            "sha": commit,
            "lastModified": _LAST_MODIFIED,
            "createdAt": _LAST_MODIFIED,
            "private": repo.private,
            "disabled": False,
            "gated": "manual" if repo.gated else False,
            "tags": [],
            "downloads": 0,
            "likes": 0,
            "library_name": "transformers",
            "siblings": [{"rfilename": p} for p in sorted(repo.commits[commit])],
        })

    def _tree(self, repo: FakeRepo, commit: str, sub: str, recursive: bool,
              query: dict[str, list[str]], raw: str) -> None:
        files = repo.commits[commit]
        prefix = sub.strip("/") + "/" if sub.strip("/") else ""
        entries: dict[str, dict[str, Any]] = {}
        for path, ent in sorted(files.items()):
            if not path.startswith(prefix):
                continue
            rest = path[len(prefix):]
            # Directories on the way to the file (all of them when recursive, the first one otherwise).
            dirs = rest.split("/")[:-1]
            for i in range(len(dirs) if recursive else min(1, len(dirs))):
                d = prefix + "/".join(dirs[: i + 1])
                entries.setdefault(d, {"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(),
                                       "size": 0, "path": d})
            if dirs and not recursive:
                continue
            item: dict[str, Any] = {"type": "file", "oid": ent.git_oid, "size": ent.size, "path": path}
            if ent.lfs:
                item["lfs"] = {"oid": ent.sha256, "size": ent.size, "pointerSize": ent.pointer_size}
            entries[path] = item
        if prefix and not entries:
            raise _HubError(404, "EntryNotFound", f"{sub} does not exist on {commit}")
        items = [entries[k] for k in sorted(entries)]
        start = int(query.get("cursor", ["0"])[0])
        page = items[start:start + self.hub.page_size]
        extra = {}
        if start + self.hub.page_size < len(items):
            host = self.headers.get("Host", f"127.0.0.1:{self.hub.port}")
            nxt = (f"http://{host}/api/models/{raw.split('?')[0]}?recursive={str(recursive)}"
                   f"&expand=False&cursor={start + self.hub.page_size}")
            extra["Link"] = f'<{nxt}>; rel="next"'
        self._json(page, extra)

    # -- /{repo}/resolve/{rev}/{file} -------------------------------------------------------------

    def _resolve(self, raw_path: str, head: bool) -> None:
        split = self._split_repo(raw_path.lstrip("/"), "resolve")
        if split is None:
            raise _HubError(404, None, "Not Found")
        repo_id, rest = split
        rev_q, _, file_q = rest.partition("/")
        filename = unquote(file_q)
        repo = self._repo(repo_id, for_content=True)
        commit = self._commit(repo, unquote(rev_q))
        ent = repo.commits[commit].get(filename)
        if ent is None:
            raise _HubError(404, "EntryNotFound", f"{filename} does not exist on {commit}",
                            {"X-Repo-Commit": commit})
        common = {"X-Repo-Commit": commit, "Accept-Ranges": "bytes"}
        if ent.lfs:
            location = f"{self.hub.cdn_url}/cdn/{ent.sha256}?filename={quote(filename)}"
            body = f"Found. Redirecting to {location}".encode()
            self._send(302, {**common, "Location": location, "ETag": f'"{ent.git_oid}"',
                             "X-Linked-Etag": f'"{ent.sha256}"', "X-Linked-Size": str(ent.size),
                             "Content-Type": "text/plain; charset=utf-8"}, body, head)
            return
        self._content(repo_id, ent, {**common, "ETag": f'"{ent.git_oid}"'}, head)

    # -- /cdn/{sha256} ----------------------------------------------------------------------------

    def _cdn(self, sha256: str, head: bool) -> None:
        found = self.hub._find_blob(sha256)
        if found is None:
            raise _HubError(404, None, "NoSuchKey")
        repo_id, ent = found
        disp = f'attachment; filename="{ent.path.rsplit("/", 1)[-1]}"'
        self._content(repo_id, ent, {"ETag": f'"{ent.sha256}"', "Accept-Ranges": "bytes",
                                     "Content-Disposition": disp}, head)

    def _content(self, repo_id: str, ent: RepoFileEntry, headers: dict[str, str], head: bool) -> None:
        """Send a file's bytes, honouring ``Range: bytes=a-[b]`` and any injected fault."""
        data = ent.read()
        status, start, end = 200, 0, len(data)
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes="):
            a, _, b = rng[len("bytes="):].split(",")[0].partition("-")
            start = int(a) if a else 0
            end = int(b) + 1 if b else len(data)
            if start >= len(data):
                raise _HubError(416, None, "Range Not Satisfiable", {"Content-Range": f"bytes */{len(data)}"})
            end = min(end, len(data))
            status = 206
            headers = {**headers, "Content-Range": f"bytes {start}-{end - 1}/{len(data)}"}
        body = data[start:end]
        headers = {"Content-Type": "application/octet-stream", **headers, "Content-Length": str(len(body))}
        fault = None if head else self.hub._take_fault(repo_id, ent.path)
        if fault is not None and fault.status is not None:
            raise _HubError(fault.status, None, f"injected HTTP {fault.status} for {ent.path}")
        if fault is not None and fault.drop_after is not None:
            # Promise the whole body, send part of it, then close cleanly (FIN): the client sees a
            # truncated message body, as when a connection dies mid-download.
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body[: fault.drop_after])
            self.wfile.flush()
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            return
        self._send(status, headers, body, head)
