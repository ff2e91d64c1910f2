"""What a user names as a model, a tokenizer or a LoRA adapter, made a local path.

A path that exists is used as it is. Otherwise a Hub id is downloaded (jaxpage.sources.hub):
- `org/name`: a Hugging Face model repo (config.json, safetensors, tokenizer files);
- `org/name:Q4_K_M`: the GGUF file of that quantization in the repo (llama.cpp's `-hf` and Ollama's form);
- `org/name/path/file.gguf`: that GGUF file of the repo.
A Hub id is resolved once per process (later calls get the same path without asking the Hub again).
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
from pathlib import Path, PurePosixPath

from jaxpage.errors import ModelLoadError
from jaxpage.sources.hub import ADAPTER_PATTERNS, MODEL_PATTERNS, PICKLE_SUFFIXES, TOKENIZER_PATTERNS, HubRepo

_REPO = r"[A-Za-z0-9][\w.-]*/[\w.-]+"
HUB_ID = re.compile(rf"^(?P<repo>{_REPO})(?::(?P<quant>[\w.-]+)|/(?P<file>[^:]+\.gguf))?$")
GGUF_SHARD = re.compile(r"-\d{5}-of-\d{5}\.gguf$")


@dataclasses.dataclass(frozen=True)
class HubId:
    repo_id: str
    quant: str | None = None  # org/name:Q4_K_M
    filename: str | None = None  # org/name/file.gguf

    @classmethod
    def parse(cls, text: str) -> HubId | None:
        match = HUB_ID.match(text)
        return None if match is None else cls(match["repo"], match["quant"], match["file"])


@dataclasses.dataclass(frozen=True)
class HubDownload:
    """Where downloads go and which revision they take: the engine arguments revision and download_dir."""

    revision: str | None = None
    download_dir: str | None = None


DEFAULT_DOWNLOAD = HubDownload()  # the default branch, into the Hugging Face cache

_resolved: dict[tuple, Path] = {}
_lock = threading.Lock()


def _resolve(source: str | os.PathLike, download: HubDownload, kind: str, fetch) -> Path:
    path = Path(source).expanduser()
    if path.exists():
        if download.revision is not None:
            raise ModelLoadError(
                f"{source}: a local path has no revisions; revision {download.revision!r} names one of a Hub repo"
            )
        return path
    text = os.fspath(source)
    hub_id = HubId.parse(text) if isinstance(text, str) else None
    if hub_id is None:
        raise ModelLoadError(
            f"{source}: no such file or directory, and not a Hugging Face Hub id (org/name, org/name:QUANT for a GGUF "
            "file of that quantization, or org/name/file.gguf)"
        )
    key = (kind, hub_id, download)
    with _lock:  # one download of a repo at a time: the model and its tokenizer may be asked for at once
        if kind == "tokenizer":  # a model's folder holds its tokenizer's files too
            key = next((k for k in (("model", hub_id, download), ("config", hub_id, download)) if k in _resolved), key)
        if key not in _resolved:
            _resolved[key] = fetch(hub_id, HubRepo(hub_id.repo_id, download.revision, download.download_dir))
        return _resolved[key]


def is_hub_id(source: str | os.PathLike) -> bool:
    """Whether `source` names a Hub repo (or a file of one): it is no local path and reads as a Hub id."""
    return not Path(source).expanduser().exists() and isinstance(source, str) and HubId.parse(source) is not None


def resolve_model(source: str | os.PathLike, download: HubDownload = DEFAULT_DOWNLOAD, weights: bool = True) -> Path:
    """A model's local path: `source` if it exists, else the Hub id downloaded (a folder of config.json, safetensors
    and the tokenizer's files, or one GGUF file; without `weights` no safetensors). ModelLoadError saying what is
    wrong otherwise."""
    if not weights:
        return _resolve(source, download, "config", _fetch_config)
    return _resolve(source, download, "model", _fetch_model)


def resolve_tokenizer(source: str | os.PathLike, download: HubDownload = DEFAULT_DOWNLOAD) -> Path:
    """A tokenizer's local path (a directory of tokenizer files, or a GGUF file): as resolve_model, but of a Hub repo
    only the tokenizer's files are downloaded."""
    return _resolve(source, download, "tokenizer", _fetch_tokenizer)


def resolve_adapter(source: str | os.PathLike, download: HubDownload = DEFAULT_DOWNLOAD) -> Path:
    """A LoRA adapter's local directory (adapter_config.json + adapter_model.safetensors), downloaded from the Hub
    when `source` is a Hub id and no local path."""
    return _resolve(source, download, "adapter", _fetch_adapter)


def _fetch_model(hub_id: HubId, repo: HubRepo) -> Path:
    if hub_id.quant is not None or hub_id.filename is not None:
        return _fetch_gguf(hub_id, repo)
    folder = repo.snapshot(MODEL_PATTERNS)
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder
    files = repo.list_files()
    if files is None:  # offline: only the cache to look at
        raise ModelLoadError(
            f"{repo.what}: its cached snapshot ({folder}) holds no config.json and safetensors; download it once "
            "with the network on (without HF_HUB_OFFLINE)"
        )
    ggufs = [name for name in files if name.endswith(".gguf")]
    if not (folder / "config.json").is_file():
        if ggufs:
            raise ModelLoadError(
                f"{repo.what}: a repo of GGUF files; name the one to serve: {repo.repo_id}:QUANT (e.g. "
                f"{repo.repo_id}:{_quant_of(ggufs[0])}) or {repo.repo_id}/FILE.gguf; it holds {_listing(ggufs)}"
            )
        raise ModelLoadError(f"{repo.what}: no config.json at the repo's top level; not a transformers model repo")
    pickles = [name for name in files if "/" not in name and name.endswith(PICKLE_SUFFIXES)]
    hint = f": it holds pickled PyTorch weights ({_listing(pickles)}), which jaxpage never unpickles" if pickles else ""
    raise ModelLoadError(f"{repo.what}: no safetensors weights at the repo's top level{hint}")


def _fetch_config(hub_id: HubId, repo: HubRepo) -> Path:
    if hub_id.quant is not None or hub_id.filename is not None:
        return _fetch_gguf(hub_id, repo)  # a GGUF file's config is its metadata
    folder = repo.snapshot(TOKENIZER_PATTERNS)
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{repo.what}: no config.json at the repo's top level; not a transformers model repo")
    return folder


def _fetch_tokenizer(hub_id: HubId, repo: HubRepo) -> Path:
    if hub_id.quant is not None or hub_id.filename is not None:
        return _fetch_gguf(hub_id, repo)  # a GGUF file carries its tokenizer
    return repo.snapshot(TOKENIZER_PATTERNS)


def _fetch_adapter(hub_id: HubId, repo: HubRepo) -> Path:
    if hub_id.quant is not None or hub_id.filename is not None:
        raise ModelLoadError(f"{hub_id}: a LoRA adapter is a PEFT repo (adapter_config.json), not a GGUF file")
    folder = repo.snapshot(ADAPTER_PATTERNS)
    if not (folder / "adapter_config.json").is_file():
        raise ModelLoadError(f"{repo.what}: no adapter_config.json at the repo's top level; not a PEFT adapter repo")
    return folder


def _fetch_gguf(hub_id: HubId, repo: HubRepo) -> Path:
    if hub_id.filename is not None:
        return repo.file(hub_id.filename)
    files = repo.list_files()
    if files is None:  # offline: the GGUF files of the cached snapshot
        folder = repo.snapshot(["*.gguf"], local_only=True)
        files = [p.relative_to(folder).as_posix() for p in folder.rglob("*.gguf")]
    return repo.file(choose_gguf(files, hub_id.quant, repo.what))


def choose_gguf(files: list[str], quant: str, what: str) -> str:
    """The one GGUF file of `files` whose name carries quantization tag `quant` (case-insensitive, a whole part of
    the name between '-' and '.': 'Q4_K_M' in 'Llama-3.2-1B-Instruct-Q4_K_M.gguf'), vision projectors (mmproj) left
    out. ModelLoadError when none or several do, or the quantization is split over several files."""
    ggufs = [name for name in files if name.endswith(".gguf") and "mmproj" not in PurePosixPath(name).name.lower()]
    matches = [name for name in ggufs if _has_part(name, quant)]
    if not matches:
        held = f"it holds {_listing(ggufs)}" if ggufs else "it holds no GGUF file"
        raise ModelLoadError(f"{what}: no GGUF file of quantization {quant!r}; {held}")
    shards = [name for name in matches if GGUF_SHARD.search(name)]
    if shards:
        raise ModelLoadError(
            f"{what}: quantization {quant!r} is split over {len(shards)} files ({_listing(shards)}); jaxpage reads "
            "one-file GGUFs: merge them with llama.cpp's `llama-gguf-split --merge`"
        )
    if len(matches) > 1:
        raise ModelLoadError(
            f"{what}: several GGUF files of quantization {quant!r} ({_listing(matches)}); name one: "
            f"{what.split(' ')[0]}/FILE.gguf"
        )
    return matches[0]


def _parts(name: str) -> list[str]:
    return re.split(r"[-.]", PurePosixPath(name).name[: -len(".gguf")])


def _has_part(name: str, quant: str) -> bool:
    return quant.lower() in (part.lower() for part in _parts(name))


def _quant_of(name: str) -> str:
    """The quantization tag a GGUF file's name ends with ('Q4_K_M' of 'model-Q4_K_M.gguf')."""
    return _parts(name)[-1]


def _listing(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"
