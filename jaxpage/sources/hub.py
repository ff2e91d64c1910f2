"""Downloads from the Hugging Face Hub, through huggingface_hub: only the files jaxpage reads, into the Hub's cache (or
a download directory), resumable, with huggingface_hub's progress bars; `HF_TOKEN` for gated repos, `HF_ENDPOINT` for
a mirror, `HF_HUB_OFFLINE=1` to read the cache alone. Every failure is a ModelLoadError that names the repo and says
what happened and what to do."""

from __future__ import annotations

import contextlib
import errno
from pathlib import Path

from jaxpage.errors import ModelLoadError

# Only the top level of a repo (never original/ or other subfolders: Meta's consolidated weights live there), and of
# its files those jaxpage reads: configs (config.json, generation_config.json, the safetensors index, the tokenizer's
# JSON files), weights in safetensors (never pickles: *.bin, *.pth; never Mistral's consolidated.safetensors, a second
# copy of the weights), the tokenizer's other formats and chat templates.
SKIPPED = ["*/*", "consolidated*"]  # subfolders; Mistral's consolidated.safetensors repeats the weights
TOKENIZER_PATTERNS = ["*.json", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt", "*.jinja"]
MODEL_PATTERNS = [*TOKENIZER_PATTERNS, "*.safetensors"]
ADAPTER_PATTERNS = ["adapter_config.json", "adapter_model.safetensors"]
PICKLE_SUFFIXES = (".bin", ".pth", ".pt", ".ckpt")


def is_offline() -> bool:
    """Whether huggingface_hub reads only its cache (HF_HUB_OFFLINE=1, which it reads at its import)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


class HubRepo:
    """One model repo at one revision: what jaxpage downloads from it. `what` names the repo in messages."""

    def __init__(self, repo_id: str, revision: str | None, download_dir: str | None):
        self.repo_id = repo_id
        self.revision = revision
        self.download_dir = download_dir
        self.what = repo_id if revision is None else f"{repo_id} (revision {revision!r})"

    def snapshot(self, patterns: list[str], local_only: bool = False) -> Path:
        """The local folder of the repo's files that match `patterns` (top level only), downloaded where missing."""
        import huggingface_hub

        with self.errors():
            folder = huggingface_hub.snapshot_download(
                self.repo_id,
                revision=self.revision,
                cache_dir=self.download_dir,
                allow_patterns=patterns,
                ignore_patterns=SKIPPED,
                local_files_only=local_only,
            )
        return Path(folder)

    def file(self, filename: str) -> Path:
        """The local path of one file of the repo, downloaded if missing."""
        import huggingface_hub

        with self.errors(filename):
            return Path(
                huggingface_hub.hf_hub_download(
                    self.repo_id, filename, revision=self.revision, cache_dir=self.download_dir
                )
            )

    def list_files(self) -> list[str] | None:
        """Every file of the repo at the revision (paths in the repo); None offline, where the Hub cannot be asked."""
        if is_offline():
            return None
        import huggingface_hub

        with self.errors():
            return huggingface_hub.list_repo_files(self.repo_id, revision=self.revision)

    @contextlib.contextmanager
    def errors(self, filename: str | None = None):
        """huggingface_hub's and the disk's failures as ModelLoadErrors naming the repo (and the file)."""
        from huggingface_hub import errors as hub

        what = self.what if filename is None else f"{self.what}: {filename}"
        try:
            yield
        except hub.GatedRepoError:
            raise ModelLoadError(
                f"{what}: the repo is gated: accept its terms at https://huggingface.co/{self.repo_id} with your "
                "account, then give jaxpage an access token of that account (HF_TOKEN=hf_..., or `hf auth login`)"
            ) from None
        except hub.RevisionNotFoundError:
            raise ModelLoadError(
                f"{self.repo_id}: no revision {self.revision!r} (a branch, tag or commit of the repo)"
            ) from None
        except hub.RepositoryNotFoundError:  # the Hub answers a private repo as it answers a missing one
            raise ModelLoadError(
                f"{self.repo_id}: no such local path, and no such model repo on the Hub (a private repo needs HF_TOKEN "
                "set to an access token that can read it)"
            ) from None
        except (hub.LocalEntryNotFoundError, hub.OfflineModeIsEnabled) as e:
            if is_offline():
                raise ModelLoadError(
                    f"{what}: not in the local Hugging Face cache, and HF_HUB_OFFLINE=1 forbids downloading it; "
                    "download it once with the network on"
                ) from None
            cause = e.__cause__ or e
            raise ModelLoadError(
                f"{what}: the Hub cannot be reached and the file is not in the local cache "
                f"({type(cause).__name__}: {' '.join(str(cause).split())[:200]})"
            ) from None
        except hub.EntryNotFoundError:  # (the Hub's answer: LocalEntryNotFoundError is one too, caught above)
            raise ModelLoadError(f"{what}: no such file in the repo") from None
        except hub.HfHubHTTPError as e:
            status = e.response.status_code if getattr(e, "response", None) is not None else "?"
            raise ModelLoadError(f"{what}: the Hub answered HTTP {status} ({' '.join(str(e).split())[:200]})") from None
        except hub.HFValidationError as e:
            raise ModelLoadError(f"{what}: not a valid Hub repo id or revision ({e})") from None
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise ModelLoadError(
                    f"{what}: the disk is full ({self.cache_folder()}); free space or choose another --download-dir"
                ) from None
            if isinstance(e, PermissionError):
                raise ModelLoadError(f"{what}: cannot write the download folder {self.cache_folder()} ({e})") from None
            raise ModelLoadError(f"{what}: download failed ({type(e).__name__}: {e})") from None
        except Exception as e:  # httpx's network errors and anything else a download trips on
            if type(e).__module__.split(".")[0] not in ("httpx", "httpx2", "httpcore", "huggingface_hub"):
                raise
            raise ModelLoadError(f"{what}: download failed ({type(e).__name__}: {e})") from None

    def cache_folder(self) -> str:
        if self.download_dir is not None:
            return str(self.download_dir)
        from huggingface_hub import constants

        return constants.HF_HUB_CACHE
