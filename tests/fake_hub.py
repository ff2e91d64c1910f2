"""A fake Hugging Face Hub on 127.0.0.1 for tests (this machine reaches no network), driven by the real
huggingface_hub (2.4, httpx2-based, plain HTTP only: the server sends no Xet header).

What huggingface_hub calls, and what the fake answers as the Hub does:
- `GET /api/models/{repo_id}` and `GET /api/models/{repo_id}/revision/{revision}` (HfApi.model_info / repo_info, which
  snapshot_download calls first, unless its revision is a 40-hex commit): JSON with `id`, `sha` (the commit the
  revision names), `siblings`, `gated`, `private`.
- `GET /api/models/{repo_id}/tree/{revision}[/{path}]?recursive=...` (list_repo_tree, list_repo_files; snapshot_download
  calls it with the commit): a JSON list of `{"type": "file", "path", "size", "oid"[, "lfs"]}` and
  `{"type": "directory", "path", "oid"}`, in one page (no Link header).
- `HEAD /{repo_id}/resolve/{revision}/{filename}` (hf_hub_download's metadata; snapshot_download's per-file call uses
  the commit as revision): `X-Repo-Commit`, `ETag` (the git blob sha1) and `Content-Length`. An LFS file (by suffix:
  LFS_SUFFIXES, as the Hub's default .gitattributes) answers 302 with `Location` on a second origin standing in for
  the CDN (`cdn_url`, another port), `X-Linked-Etag` (its sha256) and `X-Linked-Size`; huggingface_hub follows no
  redirect off the Hub's origin for the HEAD, and sends no `Authorization` to the CDN.
- `GET` of the same URL, or of the CDN's `/lfs/{repo_id}/{commit}/{filename}`: the content, 200, or 206 with
  `Content-Range` for `Range: bytes=N-` (huggingface_hub's resume, within the same call: see cut_next_download).

Errors carry `X-Error-Code` and `X-Error-Message`, which hf_raise_for_status maps to its exceptions: an unknown repo
404 RepoNotFound (RepositoryNotFoundError), an unknown revision 404 RevisionNotFound (RevisionNotFoundError), an
unknown file 404 EntryNotFound (RemoteEntryNotFoundError, an EntryNotFoundError). A gated repo's files, as on the Hub
(its info and tree are public): 401 GatedRepo without a token, 403 GatedRepo with a token that is not the repo's
(the Hub's answer to an account not on the authorized list), both GatedRepoError.

Tests import it as `from fake_hub import FakeHub, fake_hub  # noqa: F401` (tests/ is on sys.path, as for tiny_models).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

import pytest

# Files the Hub stores in LFS (its default .gitattributes): their resolve URL redirects to the CDN.
LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".model", ".npz")
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob: the ETag the Hub sends for a file stored in git (not LFS)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _lfs_pointer(data: bytes) -> bytes:
    """The pointer file git stores for an LFS file (its blob id is the `oid` of the Hub's tree entry)."""
    sha256 = hashlib.sha256(data).hexdigest()
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {len(data)}\n".encode()


@dataclass
class _Revision:
    name: str
    sha: str
    files: dict[str, bytes]


@dataclass
class _Repo:
    repo_id: str
    gated: bool
    token: str | None
    revisions: dict[str, _Revision] = field(default_factory=dict)  # by branch/tag name and by commit sha

    def revision(self, name: str) -> _Revision | None:
        return self.revisions.get(name)


class _HubHandler(BaseHTTPRequestHandler):
    # One request per connection: stop() then leaves no open connection that a handler thread would still serve.
    protocol_version = "HTTP/1.0"
    server_version = "FakeHub/1.0"

    def do_GET(self):
        self.server.hub._handle(self, "GET")

    def do_HEAD(self):
        self.server.hub._handle(self, "HEAD")

    def do_POST(self):
        self.server.hub._handle(self, "POST")

    do_PUT = do_DELETE = do_PATCH = do_POST

    def log_message(self, format, *args):  # noqa: A002 (BaseHTTPRequestHandler's signature)
        pass


class FakeHub:
    """An in-process Hub (two ThreadingHTTPServers on 127.0.0.1: the Hub at `url`, its CDN at `cdn_url`).

    `add_repo` serves a model repo; `bytes_served`, `files_served`, `requests` and `requests_with_headers` record what
    was asked and sent (`reset_counts` clears them); `cut_next_download` makes the next GET of a file stop mid-body.
    """

    def __init__(self):
        self._repos: dict[str, _Repo] = {}
        self._cuts: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self._servers: list[ThreadingHTTPServer] = []
        self._threads: list[threading.Thread] = []
        self.url = ""
        self.cdn_url = ""
        self.reset_counts()

    # -- repos -------------------------------------------------------------------------------------------------------

    def add_repo(
        self,
        repo_id: str,
        files: dict[str, bytes],
        revisions: dict[str, dict[str, bytes]] | None = None,
        gated: bool = False,
        token: str | None = None,
    ) -> None:
        """Serve `repo_id` (replacing a repo of that id): `files` on branch "main", `revisions` other branches or tags
        (name -> files). Each revision has a 40-hex commit sha (commit_sha), by which a request may name it too.
        A gated repo serves its files to `Authorization: Bearer <token>` alone."""
        if gated and not token:
            raise ValueError("a gated repo needs the token that may read it")
        repo = _Repo(repo_id, gated, token)
        for name, revision_files in {"main": files, **(revisions or {})}.items():
            revision = _Revision(name, self.commit_sha(repo_id, name), dict(revision_files))
            repo.revisions[name] = repo.revisions[revision.sha] = revision
        with self._lock:
            self._repos[repo_id] = repo

    @staticmethod
    def commit_sha(repo_id: str, revision: str = "main") -> str:
        """The commit a branch or tag of a repo names: sha1 of the repo id and the name (deterministic)."""
        return hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()

    # -- accounting and faults ---------------------------------------------------------------------------------------

    def reset_counts(self) -> None:
        """Forget what was asked and sent (not the repos, nor a pending cut)."""
        with self._lock:
            self.bytes_served = 0  # file-content bytes sent, on both origins (HEAD and error bodies not counted)
            self.files_served: list[tuple[str, str]] = []  # (repo_id, filename) of each GET that sent content
            self.requests: list[tuple[str, str]] = []  # (method, path without the query) of every request
            self.requests_with_headers: list[tuple[str, str, dict[str, str]]] = []  # headers' names lowercased

    def cut_next_download(self, repo_id: str, filename: str, after_bytes: int) -> None:
        """The next GET that sends `filename` of `repo_id` (from the Hub or the CDN) announces its full Content-Length,
        sends the first `after_bytes` bytes of its body and closes the connection.

        huggingface_hub 2.4 retries within the same call, after a second's sleep, from the bytes it has written: whole
        chunks of constants.DOWNLOAD_CHUNK_SIZE (10 MiB), as httpx2 yields no partial chunk. A cut past the first
        chunk is resumed with `Range: bytes=<chunks written>-` (206 here); a cut within it is asked again whole,
        without Range. A call that fails keeps nothing, so a later call starts over."""
        with self._lock:
            self._cuts[(repo_id, filename)] = after_bytes

    def go_offline(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """huggingface_hub's offline mode, in this process (its constant, read at each request) and in the commands
        a test starts (the environment variable, read when they import huggingface_hub)."""
        import huggingface_hub.constants

        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    # -- lifecycle ---------------------------------------------------------------------------------------------------

    def start(self) -> FakeHub:
        if self._servers:
            return self
        for cdn in (False, True):
            server = ThreadingHTTPServer(("127.0.0.1", 0), _HubHandler)
            server.daemon_threads = True
            server.hub = self
            server.is_cdn = cdn
            thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
            thread.start()
            self._servers.append(server)
            self._threads.append(thread)
        self.url, self.cdn_url = (f"http://127.0.0.1:{server.server_address[1]}" for server in self._servers)
        return self

    def stop(self) -> None:
        """Stop listening (again: a no-op); a request then finds nothing at `url`."""
        servers, self._servers = self._servers, []
        for server in servers:
            server.shutdown()
            server.server_close()
        for thread in self._threads:
            thread.join(timeout=5)
        self._threads = []

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- serving -----------------------------------------------------------------------------------------------------

    def _handle(self, handler: _HubHandler, method: str) -> None:
        split = urlsplit(handler.path)
        path, query = split.path, parse_qs(split.query)
        with self._lock:
            self.requests.append((method, path))
            self.requests_with_headers.append((method, path, {k.lower(): v for k, v in handler.headers.items()}))
        try:
            if handler.server.is_cdn:
                if path.startswith("/lfs/"):
                    return self._cdn(handler, method, path[len("/lfs/") :])
            elif method in ("GET", "HEAD"):
                if match := re.fullmatch(r"/api/models/([^/]+(?:/[^/]+)?)(?:/revision/([^/]+))?", path):
                    if method == "GET":
                        return self._info(handler, unquote(match[1]), unquote(match[2] or "main"), query)
                elif match := re.fullmatch(r"/api/models/([^/]+(?:/[^/]+)?)/tree/([^/]+)(?:/(.*))?", path):
                    if method == "GET":
                        return self._tree(handler, unquote(match[1]), unquote(match[2]), unquote(match[3] or ""), query)
                elif match := re.fullmatch(r"/([^/]+(?:/[^/]+)?)/resolve/([^/]+)/(.+)", path):
                    return self._resolve(handler, method, unquote(match[1]), unquote(match[2]), unquote(match[3]))
            self._error(handler, method, 404, None, f"Sorry, we can't find the page you are looking for ({path}).")
        except (BrokenPipeError, ConnectionResetError):
            handler.close_connection = True

    def _repo_and_revision(self, handler, method, repo_id, revision) -> tuple[_Repo, _Revision] | None:
        with self._lock:
            repo = self._repos.get(repo_id)
        if repo is None:
            self._error(handler, method, 404, "RepoNotFound", "Repository not found")
            return None
        rev = repo.revision(revision)
        if rev is None:
            self._error(handler, method, 404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return None
        return repo, rev

    def _info(self, handler, repo_id, revision, query) -> None:
        found = self._repo_and_revision(handler, "GET", repo_id, revision)
        if found is None:
            return
        repo, rev = found
        blobs = query.get("blobs", ["false"])[0].lower() == "true"  # files_metadata=True
        siblings = []
        for name, data in sorted(rev.files.items()):
            sibling = {"rfilename": name}
            if blobs:
                sibling |= self._blob_fields(name, data, sibling_style=True)
            siblings.append(sibling)
        info = {
            "_id": rev.sha[:24],
            "id": repo_id,
            "modelId": repo_id,
            "author": repo_id.split("/")[0] if "/" in repo_id else None,
            "sha": rev.sha,
            "lastModified": "2025-01-01T00:00:00.000Z",
            "createdAt": "2025-01-01T00:00:00.000Z",
            "private": False,
            "gated": "manual" if repo.gated else False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": siblings,
        }
        self._json(handler, info, rev.sha)

    def _tree(self, handler, repo_id, revision, folder, query) -> None:
        found = self._repo_and_revision(handler, "GET", repo_id, revision)
        if found is None:
            return
        _, rev = found
        recursive = query.get("recursive", ["false"])[0].lower() == "true"
        prefix = f"{folder.strip('/')}/" if folder.strip("/") else ""
        entries, directories = [], set()
        for name, data in sorted(rev.files.items()):
            if not name.startswith(prefix):
                continue
            parts = name[len(prefix) :].split("/")
            for depth in range(1, len(parts) if recursive else min(2, len(parts))):
                directories.add(prefix + "/".join(parts[:depth]))
            if recursive or len(parts) == 1:
                entries.append({"type": "file", "path": name, **self._blob_fields(name, data)})
        if prefix and not entries and not directories:
            return self._error(handler, "GET", 404, "EntryNotFound", f'{folder} does not exist on "{revision}"')
        entries += [
            {"type": "directory", "path": d, "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0}
            for d in sorted(directories)
        ]
        self._json(handler, entries, rev.sha)

    @staticmethod
    def _blob_fields(name: str, data: bytes, sibling_style: bool = False) -> dict:
        lfs = name.endswith(LFS_SUFFIXES)
        oid = git_blob_sha1(_lfs_pointer(data) if lfs else data)
        fields: dict = {"blobId": oid} if sibling_style else {"oid": oid}
        fields["size"] = len(data)
        if lfs:
            sha256_key = "sha256" if sibling_style else "oid"  # model_info's siblings and the tree name it differently
            sha256, pointer_size = hashlib.sha256(data).hexdigest(), len(_lfs_pointer(data))
            fields["lfs"] = {sha256_key: sha256, "size": len(data), "pointerSize": pointer_size}
        return fields

    def _resolve(self, handler, method, repo_id, revision, filename) -> None:
        with self._lock:
            repo = self._repos.get(repo_id)
        if repo is None:
            return self._error(handler, method, 404, "RepoNotFound", "Repository not found")
        if repo.gated:
            authorization = handler.headers.get("Authorization")
            if not authorization:
                return self._error(
                    handler,
                    method,
                    401,
                    "GatedRepo",
                    f"Access to model {repo_id} is restricted. You must have access to it and be authenticated to "
                    "access it. Please log in.",
                )
            if authorization != f"Bearer {repo.token}":
                return self._error(
                    handler,
                    method,
                    403,
                    "GatedRepo",
                    f"Access to model {repo_id} is restricted and you are not in the authorized list. Visit "
                    f"https://huggingface.co/{repo_id} to ask for access.",
                )
        found = self._repo_and_revision(handler, method, repo_id, revision)
        if found is None:
            return
        _, rev = found
        data = rev.files.get(filename)
        if data is None:
            return self._error(handler, method, 404, "EntryNotFound", "Entry not found", {"X-Repo-Commit": rev.sha})
        if filename.endswith(LFS_SUFFIXES):
            handler.send_response(302)
            handler.send_header("Location", f"{self.cdn_url}/lfs/{repo_id}/{rev.sha}/{quote(filename)}")
            handler.send_header("X-Repo-Commit", rev.sha)
            handler.send_header("ETag", f'"{git_blob_sha1(_lfs_pointer(data))}"')
            handler.send_header("X-Linked-Etag", f'"{hashlib.sha256(data).hexdigest()}"')
            handler.send_header("X-Linked-Size", str(len(data)))
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return
        self._content(handler, method, repo_id, filename, data, f'"{git_blob_sha1(data)}"', rev.sha)

    def _cdn(self, handler, method, rest) -> None:
        """The CDN's signed URL, `/lfs/{repo_id}/{commit}/{filename}`: no authorization asked (the Hub gave it)."""
        with self._lock:
            repos = list(self._repos.values())
        for repo in repos:
            if rest.startswith(repo.repo_id + "/"):
                sha, _, filename = rest[len(repo.repo_id) + 1 :].partition("/")
                rev = repo.revision(sha)
                data = rev.files.get(unquote(filename)) if rev is not None else None
                if data is not None:
                    etag = f'"{hashlib.sha256(data).hexdigest()}"'
                    return self._content(handler, method, repo.repo_id, unquote(filename), data, etag, None)
        self._error(handler, method, 404, None, "NoSuchKey")

    def _content(self, handler, method, repo_id, filename, data, etag, commit) -> None:
        """A file's content: all of it (200), or the part a `Range: bytes=N-[M]` asks (206), maybe cut short."""
        start, end = 0, len(data)
        status = 200
        asked = handler.headers.get("Range")
        if asked:
            match = _RANGE.fullmatch(asked.strip())
            if match is None or not (match[1] or match[2]):
                status = 416
            elif match[1]:
                start = int(match[1])
                end = min(int(match[2]) + 1, len(data)) if match[2] else len(data)
                status = 206 if start < len(data) and start < end else 416
            else:
                start = max(len(data) - int(match[2]), 0)
                status = 206
            if status == 416:
                handler.send_response(416)
                handler.send_header("Content-Range", f"bytes */{len(data)}")
                handler.send_header("Content-Length", "0")
                handler.end_headers()
                return
        body = data[start:end]
        handler.send_response(status)
        handler.send_header("Content-Type", "application/octet-stream")
        handler.send_header("Content-Length", str(len(body)))
        handler.send_header("Accept-Ranges", "bytes")
        handler.send_header("ETag", etag)
        if commit is not None:
            handler.send_header("X-Repo-Commit", commit)
        if status == 206:
            handler.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        handler.end_headers()
        if method != "GET":
            return
        with self._lock:
            cut = self._cuts.pop((repo_id, filename), None)
        sent = body if cut is None else body[:cut]
        with self._lock:  # counted before the bytes go: a client that has read them may look at once
            self.bytes_served += len(sent)
            self.files_served.append((repo_id, filename))
        handler.wfile.write(sent)
        handler.wfile.flush()
        if cut is not None:  # the rest never comes: the client reads a body shorter than its Content-Length
            handler.close_connection = True
            handler.connection.shutdown(socket.SHUT_WR)

    def _json(self, handler, payload, commit: str | None) -> None:
        body = json.dumps(payload).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json; charset=utf-8")
        handler.send_header("Content-Length", str(len(body)))
        if commit is not None:
            handler.send_header("X-Repo-Commit", commit)
        handler.end_headers()
        handler.wfile.write(body)

    @staticmethod
    def _error(handler, method, status: int, code: str | None, message: str, headers: dict | None = None) -> None:
        body = json.dumps({"error": message}).encode()
        handler.send_response(status)
        if code is not None:
            handler.send_header("X-Error-Code", code)
        handler.send_header("X-Error-Message", message)
        for name, value in (headers or {}).items():
            handler.send_header(name, value)
        handler.send_header("Content-Type", "application/json; charset=utf-8")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        if method != "HEAD":
            handler.wfile.write(body)


def use_fake_hub(hub: FakeHub, monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    """Point huggingface_hub at `hub`, with its home (cache, token) under `home`: in this process and in the commands
    the test starts (which inherit the environment)."""
    import huggingface_hub
    import huggingface_hub.constants as constants
    import huggingface_hub.hf_api
    import huggingface_hub.utils._cache_manager

    hf_home = home / "hf_home"
    cache = hf_home / "hub"
    env = {
        "HF_ENDPOINT": hub.url,
        "HF_HOME": str(hf_home),
        "HF_HUB_CACHE": str(cache),
        "HF_XET_CACHE": str(hf_home / "xet"),
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for name in (
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "HF_TOKEN_PATH",
        "HF_OIDC_RESOURCE",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "HUGGINGFACE_CO_STAGING",
        "HUGGINGFACE_HUB_CACHE",
    ):
        monkeypatch.delenv(name, raising=False)
    # What huggingface_hub read from the environment when it was imported.
    patched = {
        "ENDPOINT": hub.url,
        "HUGGINGFACE_CO_URL_TEMPLATE": hub.url + "/{repo_id}/resolve/{revision}/{filename}",
        "HF_URL_HOSTS": constants.HF_URL_HOSTS | {"127.0.0.1"},
        "HF_HOME": str(hf_home),
        "HF_HUB_CACHE": str(cache),
        "HUGGINGFACE_HUB_CACHE": str(cache),
        "HF_ASSETS_CACHE": str(hf_home / "assets"),
        "HF_XET_CACHE": str(hf_home / "xet"),
        "HF_TOKEN_PATH": str(hf_home / "token"),
        "HF_STORED_TOKENS_PATH": str(hf_home / "stored_tokens"),
        "HF_HUB_OFFLINE": False,
        "HF_HUB_DISABLE_XET": True,
        "HF_HUB_DISABLE_TELEMETRY": True,
    }
    for name, value in patched.items():
        monkeypatch.setattr(constants, name, value)
    # Copies made at import: the module-level HfApi behind huggingface_hub.model_info, list_repo_files, ...
    monkeypatch.setattr(huggingface_hub.hf_api.api, "endpoint", hub.url)
    monkeypatch.setattr(huggingface_hub.utils._cache_manager, "HF_HUB_CACHE", str(cache))
    assert huggingface_hub.is_offline_mode() is False and not os.path.exists(constants.HF_TOKEN_PATH)


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """A started FakeHub that huggingface_hub uses, here and in the commands the test starts: HF_ENDPOINT is its url,
    HF_HOME (token, xet) and HF_HUB_CACHE lie under tmp_path, Xet and telemetry are off, no token (HF_TOKEN unset, no
    token file) and online (HF_HUB_OFFLINE unset); the constants huggingface_hub read at import are patched to match.

    Offline mode: huggingface_hub 2.4 asks `huggingface_hub.is_offline_mode()` before every request, and that
    returns the constant `huggingface_hub.constants.HF_HUB_OFFLINE`, read from the environment once, at import. So a
    test sets both: `monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)` for this process and
    `monkeypatch.setenv("HF_HUB_OFFLINE", "1")` for the commands it starts; `fake_hub.go_offline(monkeypatch)` does
    both. Setting the environment variable alone changes nothing in this process.

    A token for a gated repo: `token=` to the call, or `monkeypatch.setenv("HF_TOKEN", ...)` (read at each call)."""
    hub = FakeHub().start()
    try:
        use_fake_hub(hub, monkeypatch, tmp_path)
        yield hub
    finally:
        hub.stop()
