"""tests/fake_hub.py driven by the real huggingface_hub (2.4): snapshot_download, hf_hub_download, model_info and
list_repo_files against the Hub on loopback, its errors, a gated repo, a cut download, offline mode."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import huggingface_hub
import pytest
from fake_hub import FakeHub, fake_hub  # noqa: F401  (the fixture)
from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    IncompleteSnapshotError,
    LocalEntryNotFoundError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoFolder

WEIGHTS = bytes(range(256)) * 20  # 5120 bytes; *.safetensors is an LFS file: its resolve URL redirects to the CDN
FILES = {
    "config.json": b'{"model_type": "llama"}',
    "tokenizer.json": b'{"version": "1.0", "model": {}}',
    "model.safetensors": WEIGHTS,
    "pytorch_model.bin": bytes(3000),
    "README.md": b"# tiny",
    "original/params.json": b"{}",
}
MAIN = FakeHub.commit_sha("org/tiny")


def files_of(folder) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in Path(folder).rglob("*") if p.is_file()}


def test_snapshot_downloads_only_what_its_patterns_allow(fake_hub):  # noqa: F811
    fake_hub.add_repo("org/tiny", FILES)
    folder = snapshot_download("org/tiny", allow_patterns=["*.json", "*.safetensors"], ignore_patterns=["*/*"])
    wanted = {name: FILES[name] for name in ("config.json", "tokenizer.json", "model.safetensors")}
    assert files_of(folder) == wanted
    assert Path(folder) == Path(huggingface_hub.constants.HF_HUB_CACHE) / "models--org--tiny" / "snapshots" / MAIN
    assert sorted(fake_hub.files_served) == sorted(("org/tiny", name) for name in wanted)
    assert fake_hub.bytes_served == sum(map(len, wanted.values()))
    # What huggingface_hub asked: the revision's commit, the tree at that commit, then each file by the commit; the
    # LFS file's bytes came from the CDN's origin.
    for request in [
        ("GET", "/api/models/org/tiny/revision/main"),
        ("GET", f"/api/models/org/tiny/tree/{MAIN}"),
        ("HEAD", f"/org/tiny/resolve/{MAIN}/config.json"),
        ("GET", f"/org/tiny/resolve/{MAIN}/config.json"),
        ("HEAD", f"/org/tiny/resolve/{MAIN}/model.safetensors"),
        ("GET", f"/lfs/org/tiny/{MAIN}/model.safetensors"),
    ]:
        assert request in fake_hub.requests
    assert not any("pytorch_model.bin" in path or "original" in path for _, path in fake_hub.requests)
    # One more file of the same snapshot: only its own requests.
    fake_hub.reset_counts()
    readme = hf_hub_download("org/tiny", "README.md")
    assert Path(readme) == Path(folder) / "README.md" and Path(readme).read_bytes() == b"# tiny"
    assert fake_hub.files_served == [("org/tiny", "README.md")] and fake_hub.bytes_served == len(b"# tiny")
    assert fake_hub.requests == [
        ("HEAD", "/org/tiny/resolve/main/README.md"),
        ("GET", "/org/tiny/resolve/main/README.md"),
    ]


def test_model_info_and_file_listings(fake_hub):  # noqa: F811
    fake_hub.add_repo("org/tiny", FILES, revisions={"v1": {"config.json": b"{}"}})
    info = HfApi().model_info("org/tiny", files_metadata=True)
    assert info.id == "org/tiny" and info.sha == MAIN and not info.gated
    sizes = {sibling.rfilename: sibling.size for sibling in info.siblings}
    assert sizes == {name: len(data) for name, data in FILES.items()}
    lfs = {sibling.rfilename: sibling.lfs for sibling in info.siblings if sibling.lfs is not None}
    assert set(lfs) == {"model.safetensors", "pytorch_model.bin"}
    assert lfs["model.safetensors"].sha256 == hashlib.sha256(WEIGHTS).hexdigest()
    # The module-level functions (huggingface_hub's own HfApi instance) reach the fake Hub too.
    assert huggingface_hub.model_info("org/tiny", revision="v1").sha == FakeHub.commit_sha("org/tiny", "v1")
    assert sorted(huggingface_hub.list_repo_files("org/tiny")) == sorted(FILES)
    assert huggingface_hub.list_repo_files("org/tiny", revision="v1") == ["config.json"]
    top = {entry.path: entry for entry in HfApi().list_repo_tree("org/tiny")}  # not recursive: files and a folder
    assert set(top) == {*FILES, "original"} - {"original/params.json"} and isinstance(top["original"], RepoFolder)
    assert top["model.safetensors"].lfs.size == len(WEIGHTS) and top["config.json"].lfs is None
    assert [entry.path for entry in HfApi().list_repo_tree("org/tiny", "original")] == ["original/params.json"]
    assert fake_hub.files_served == [] and fake_hub.bytes_served == 0


def test_a_revision_by_branch_tag_or_commit(fake_hub, tmp_path):  # noqa: F811
    revisions = {"dev": {"config.json": b"dev", "extra.json": b"[]"}, "v1.0": {"config.json": b"v1.0"}}
    fake_hub.add_repo("org/tiny", {"config.json": b"main"}, revisions=revisions)
    assert files_of(snapshot_download("org/tiny")) == {"config.json": b"main"}
    for name, files in revisions.items():  # a branch, a tag
        sha = FakeHub.commit_sha("org/tiny", name)
        folder = snapshot_download("org/tiny", revision=name)
        assert Path(folder).name == sha and files_of(folder) == files
        # By its commit, into another cache: snapshot_download skips the revision's info, asks the tree by the sha.
        fake_hub.reset_counts()
        by_sha = snapshot_download("org/tiny", revision=sha, cache_dir=tmp_path / name)
        assert Path(by_sha).name == sha and files_of(by_sha) == files
        assert ("GET", f"/api/models/org/tiny/tree/{sha}") in fake_hub.requests
        assert len(fake_hub.files_served) == len(files)
        one = hf_hub_download("org/tiny", "config.json", revision=sha, cache_dir=tmp_path / f"{name}-file")
        assert Path(one).read_bytes() == files["config.json"]
    assert HfApi().model_info("org/tiny", revision="v1.0").sha == FakeHub.commit_sha("org/tiny", "v1.0")


def test_unknown_repo_revision_and_file(fake_hub):  # noqa: F811
    fake_hub.add_repo("org/tiny", FILES)
    with pytest.raises(RepositoryNotFoundError) as error:
        snapshot_download("org/missing")
    assert not isinstance(error.value, GatedRepoError) and error.value.response.status_code == 404
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("org/missing", "config.json")
    with pytest.raises(RepositoryNotFoundError):
        HfApi().model_info("org/missing")
    with pytest.raises(RevisionNotFoundError):
        snapshot_download("org/tiny", revision="nope")
    with pytest.raises(RevisionNotFoundError):
        snapshot_download("org/tiny", revision="0" * 40)  # a commit the repo does not have
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download("org/tiny", "config.json", revision="nope")
    with pytest.raises(RevisionNotFoundError):
        huggingface_hub.list_repo_files("org/tiny", revision="nope")
    with pytest.raises(RemoteEntryNotFoundError) as error:
        hf_hub_download("org/tiny", "nope.json")
    assert isinstance(error.value, EntryNotFoundError) and error.value.response.status_code == 404
    assert fake_hub.files_served == [] and fake_hub.bytes_served == 0


def test_a_gated_repo_serves_its_token_alone(fake_hub, monkeypatch):  # noqa: F811
    fake_hub.add_repo("org/gated", FILES, gated=True, token="hf_right")
    assert HfApi().model_info("org/gated").gated == "manual"  # as on the Hub, its info and tree are public
    with pytest.raises(GatedRepoError) as error:
        snapshot_download("org/gated", allow_patterns=["config.json"])
    assert error.value.response.status_code == 401 and "Please log in" in str(error.value)
    with pytest.raises(GatedRepoError) as error:
        hf_hub_download("org/gated", "config.json", token="hf_wrong")
    assert error.value.response.status_code == 403 and "not in the authorized list" in str(error.value)
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")  # read at each call
    with pytest.raises(GatedRepoError):
        hf_hub_download("org/gated", "config.json")
    assert fake_hub.files_served == []

    monkeypatch.delenv("HF_TOKEN")
    folder = snapshot_download("org/gated", allow_patterns=["*.json", "*.safetensors"], token="hf_right")
    assert files_of(folder) == {name: FILES[name] for name in FILES if name.endswith((".json", ".safetensors"))}
    monkeypatch.setenv("HF_TOKEN", "hf_right")
    assert Path(hf_hub_download("org/gated", "README.md")).read_bytes() == b"# tiny"
    # The token went to the Hub, not to the CDN.
    sha = FakeHub.commit_sha("org/gated")
    authorization = {path: headers.get("authorization") for method, path, headers in fake_hub.requests_with_headers}
    assert authorization[f"/org/gated/resolve/{sha}/config.json"] == "Bearer hf_right"
    assert authorization["/org/gated/resolve/main/README.md"] == "Bearer hf_right"
    assert authorization[f"/lfs/org/gated/{sha}/model.safetensors"] is None


# huggingface_hub 2.4's http_get retries a body cut short (httpx2's RemoteProtocolError), within the same call and
# after a second's sleep, from what it has written: whole chunks of DOWNLOAD_CHUNK_SIZE (10 MiB; httpx2 yields no
# partial chunk). So a file cut past its first chunk resumes with `Range: bytes=<chunks written>-`, and one cut within
# its first chunk is asked again whole, without Range. A call that fails keeps nothing (its temporary file is unique
# and deleted): a second call starts over.
CHUNK = huggingface_hub.constants.DOWNLOAD_CHUNK_SIZE
BIG_WEIGHTS = bytes(range(256)) * ((CHUNK + CHUNK // 4) // 256)  # 12.5 MiB: a chunk and a quarter


@pytest.mark.parametrize(
    "filename, after_bytes, resumed_at",
    [
        ("model.safetensors", CHUNK + 1000, CHUNK),  # from the CDN: resumed with Range
        ("tokenizer.json", 7, None),  # from the Hub: within the first chunk, so asked again whole
    ],
)
def test_a_cut_download_is_retried_within_the_same_call(fake_hub, filename, after_bytes, resumed_at):  # noqa: F811
    files = FILES | {"model.safetensors": BIG_WEIGHTS}
    fake_hub.add_repo("org/tiny", files)
    fake_hub.cut_next_download("org/tiny", filename, after_bytes=after_bytes)
    folder = snapshot_download("org/tiny", allow_patterns=[filename])
    assert files_of(folder) == {filename: files[filename]}
    from_hub = f"/org/tiny/resolve/{MAIN}/{filename}"
    path = f"/lfs/org/tiny/{MAIN}/{filename}" if filename.endswith(".safetensors") else from_hub
    gets = [(p, headers.get("range")) for method, p, headers in fake_hub.requests_with_headers if method == "GET"]
    retry = None if resumed_at is None else f"bytes={resumed_at}-"
    assert [get for get in gets if get[0] == path] == [(path, None), (path, retry)]
    assert fake_hub.files_served == [("org/tiny", filename)] * 2
    assert fake_hub.bytes_served == after_bytes + len(files[filename]) - (resumed_at or 0)


def test_the_fake_hubs_ranges_and_routes(fake_hub):  # noqa: F811
    fake_hub.add_repo("org/tiny", FILES)
    url = f"{fake_hub.url}/org/tiny/resolve/main/tokenizer.json"
    data = FILES["tokenizer.json"]

    def get(url, method="GET", **headers):
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method=method, headers=headers)) as response:
                return response.status, response.headers, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.headers, error.read()

    status, headers, body = get(url, Range="bytes=5-")
    assert (status, headers["Content-Range"], body) == (206, f"bytes 5-{len(data) - 1}/{len(data)}", data[5:])
    assert int(headers["Content-Length"]) == len(data) - 5 and headers["X-Repo-Commit"] == MAIN
    assert get(url, Range="bytes=2-4")[::2] == (206, data[2:5])
    assert get(url, Range="bytes=-3")[::2] == (206, data[-3:])
    status, headers, _ = get(url, Range=f"bytes={len(data)}-")
    assert (status, headers["Content-Range"]) == (416, f"bytes */{len(data)}")
    status, headers, body = get(url, method="HEAD")
    assert (status, int(headers["Content-Length"]), body) == (200, len(data), b"")
    git_blob = b"blob %d\0" % len(data) + data  # what `git hash-object` hashes
    assert headers["ETag"] == f'"{hashlib.sha1(git_blob).hexdigest()}"'
    assert not any(name.lower().startswith("x-xet") for name in headers)
    status, headers, _ = get(f"{fake_hub.url}/org/tiny/resolve/main/nope")
    assert (status, headers["X-Error-Code"], headers["X-Repo-Commit"]) == (404, "EntryNotFound", MAIN)
    assert get(f"{fake_hub.url}/api/nothing")[0] == 404
    assert fake_hub.files_served == [("org/tiny", "tokenizer.json")] * 3
    assert fake_hub.bytes_served == len(data) - 5 + 3 + 3


def test_offline_a_second_snapshot_asks_nothing(fake_hub, monkeypatch):  # noqa: F811
    fake_hub.add_repo("org/tiny", FILES)
    online = snapshot_download("org/tiny", allow_patterns=["*.json"], ignore_patterns=["*/*"])
    # The environment variable alone does not switch this process: huggingface_hub read it at import.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    fake_hub.reset_counts()
    assert snapshot_download("org/tiny", allow_patterns=["*.json"], ignore_patterns=["*/*"]) == online
    assert fake_hub.requests and not huggingface_hub.is_offline_mode()

    fake_hub.go_offline(monkeypatch)
    fake_hub.reset_counts()
    assert huggingface_hub.is_offline_mode()
    assert snapshot_download("org/tiny", allow_patterns=["*.json"], ignore_patterns=["*/*"]) == online
    assert hf_hub_download("org/tiny", "config.json") == str(Path(online) / "config.json")
    with pytest.raises(IncompleteSnapshotError):  # the cached tree knows model.safetensors was never downloaded
        snapshot_download("org/tiny", allow_patterns=["*.safetensors"])
    with pytest.raises(LocalEntryNotFoundError):
        snapshot_download("org/other")
    assert fake_hub.requests == []


def test_commands_a_test_starts_use_the_fake_hub_and_go_offline_by_the_environment(fake_hub, monkeypatch, tmp_path):  # noqa: F811
    fake_hub.add_repo("org/tiny", FILES)
    code = "import huggingface_hub; print(huggingface_hub.snapshot_download('org/tiny', allow_patterns=['*.json']))"

    def run() -> str:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip()

    online = run()
    assert Path(online).is_relative_to(tmp_path) and Path(online).name == MAIN
    assert sorted(name for _, name in fake_hub.files_served) == [
        "config.json",
        "original/params.json",
        "tokenizer.json",
    ]
    fake_hub.go_offline(monkeypatch)
    fake_hub.reset_counts()
    assert run() == online
    assert fake_hub.requests == []


def test_a_stopped_hub_cannot_be_reached(fake_hub):  # noqa: F811
    fake_hub.add_repo("org/tiny", FILES)
    fake_hub.stop()
    fake_hub.stop()  # again: nothing
    with pytest.raises(LocalEntryNotFoundError, match="cannot find the appropriate snapshot folder"):
        snapshot_download("org/tiny")
    with FakeHub() as other:  # a context manager too, on another port
        assert other.url.startswith("http://127.0.0.1:") and other.url != fake_hub.url
