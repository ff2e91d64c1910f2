"""Models named by Hugging Face Hub ids (jaxpage.sources), downloaded from a Hub on loopback (tests/fake_hub.py) through
the real huggingface_hub: only what jaxpage reads, at the revision asked, resumed when cut, read from the cache
offline; every failure a ModelLoadError that names the id and says what happened."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import numpy as np
import pytest
from fake_hub import FakeHub, fake_hub  # noqa: F401  (the fixture)
from safetensors.numpy import save_file
from tiny_models import TINY_FAMILIES

from jaxpage.engine.lora_adapters import LoRAAdapters
from jaxpage.entrypoints.cli import main
from jaxpage.errors import ModelLoadError
from jaxpage.lora_request import LoRARequest
from jaxpage.models import load_model
from jaxpage.sources import HubDownload, model_source, resolve_model, resolve_tokenizer
from jaxpage.sources.hub import HubRepo
from jaxpage.spec_decode.draft_model import load_draft_model

FAMILY = TINY_FAMILIES[0]  # llama2-mha: 3 layers, hidden 64, 4 heads


@pytest.fixture(autouse=True)
def fresh_resolutions(monkeypatch):
    """Each test resolves Hub ids anew (a process remembers what it resolved)."""
    monkeypatch.setattr(model_source, "_resolved", {})


def files_of(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def tiny_files(tiny_model_path) -> dict[str, bytes]:
    return files_of(tiny_model_path(FAMILY))


def with_config(files: dict[str, bytes], **changes) -> dict[str, bytes]:
    return files | {"config.json": json.dumps(json.loads(files["config.json"]) | changes).encode()}


def test_a_repo_of_100_files_downloads_only_its_safetensors_and_configs(fake_hub, tiny_files):  # noqa: F811
    noise = {f"pytorch_model-{i:05d}-of-00060.bin": bytes(2000) for i in range(1, 61)}
    noise |= {f"original/consolidated.{i:02d}.pth": bytes(3000) for i in range(20)}
    noise |= {
        "original/params.json": b"{}",
        "original/tokenizer.model": bytes(500),
        "consolidated.safetensors": bytes(4000),
    }
    noise |= {f"images/figure-{i}.png": bytes(1000) for i in range(10)}
    noise |= {"README.md": b"# tiny", "LICENSE": b"apache", ".gitattributes": b"*.bin lfs"}
    wanted = tiny_files | {"generation_config.json": b'{"eos_token_id": 2}', "tokenizer_config.json": b"{}"}
    files = wanted | noise
    assert len(files) >= 100
    fake_hub.add_repo("org/tiny", files)
    path = resolve_model("org/tiny")
    assert sorted(name for _, name in fake_hub.files_served) == sorted(wanted)
    assert fake_hub.bytes_served == sum(map(len, wanted.values()))
    config, _ = load_model("org/tiny")
    assert (config.num_layers, config.hidden_size) == (3, 64)
    assert files_of(path) == wanted


def test_revisions_by_branch_tag_and_commit(fake_hub, tiny_files):  # noqa: F811
    fake_hub.add_repo("org/tiny", tiny_files, revisions={"v1": with_config(tiny_files, max_position_embeddings=64)})
    assert load_model("org/tiny", load_format="dummy")[0].max_position_embeddings == 256
    v1 = load_model("org/tiny", load_format="dummy", download=HubDownload(revision="v1"))[0]
    assert v1.max_position_embeddings == 64
    sha = Path(resolve_model("org/tiny", HubDownload(revision="v1"), weights=False)).name  # the snapshot's commit
    assert resolve_model("org/tiny", HubDownload(revision=sha), weights=False).name == sha
    with pytest.raises(ModelLoadError, match=r"org/tiny: no revision 'nope' \(a branch, tag or commit"):
        resolve_model("org/tiny", HubDownload(revision="nope"))


def test_dummy_weights_download_no_weights(fake_hub, tiny_files):  # noqa: F811
    fake_hub.add_repo("org/tiny", tiny_files)
    load_model("org/tiny", load_format="dummy")
    assert not any(name.endswith(".safetensors") for _, name in fake_hub.files_served)


def test_unknown_and_gated_repos(fake_hub, tiny_files, monkeypatch):  # noqa: F811
    with pytest.raises(ModelLoadError, match="org/missing: no such local path, and no such model repo on the Hub"):
        load_model("org/missing")
    fake_hub.add_repo("org/gated", tiny_files, gated=True, token="hf_right")
    with pytest.raises(ModelLoadError, match=r"org/gated: the repo is gated: accept its terms at .*\(HF_TOKEN=hf_"):
        resolve_model("org/gated")
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(ModelLoadError, match="org/gated: the repo is gated"):
        resolve_model("org/gated")
    monkeypatch.setenv("HF_TOKEN", "hf_right")
    assert (resolve_model("org/gated") / "model.safetensors").is_file()


def test_what_is_no_model_repo_is_named(fake_hub, tiny_files):  # noqa: F811
    config = {"config.json": tiny_files["config.json"]}
    fake_hub.add_repo("org/pickles", config | {"pytorch_model.bin": bytes(100)})
    with pytest.raises(ModelLoadError, match=r"org/pickles: no safetensors .* pickled PyTorch weights \(pytorch_model"):
        resolve_model("org/pickles")
    fake_hub.add_repo("org/nothing", {"README.md": b"hello"})
    with pytest.raises(ModelLoadError, match="org/nothing: no config.json at the repo's top level"):
        resolve_model("org/nothing")
    with pytest.raises(ModelLoadError, match="no such file or directory, and not a Hugging Face Hub id"):
        resolve_model("not-a-path-or-id")


def test_gguf_files_by_quantization_tag_or_name(fake_hub, smollm2_path):  # noqa: F811
    gguf = smollm2_path.read_bytes()
    fake_hub.add_repo(
        "org/smol-gguf",
        {
            "SmolLM2-135M-Instruct.Q4_1.gguf": gguf,
            "SmolLM2-135M-Instruct.Q8_0.gguf": b"GGUF-not-fetched",
            "SmolLM2-135M-Instruct-mmproj-Q4_1.gguf": b"GGUF-projector",
            "split/SmolLM2-Q6_K-00001-of-00002.gguf": b"GGUF",
            "split/SmolLM2-Q6_K-00002-of-00002.gguf": b"GGUF",
        },
    )
    path = resolve_model("org/smol-gguf:q4_1")  # any case
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.read_bytes() == gguf
    assert fake_hub.bytes_served == len(gguf)
    assert load_model("org/smol-gguf:Q4_1")[0].num_layers == 30
    assert resolve_tokenizer("org/smol-gguf:Q4_1") == path  # a GGUF file carries its tokenizer
    assert resolve_model("org/smol-gguf/split/SmolLM2-Q6_K-00001-of-00002.gguf").name.endswith("00001-of-00002.gguf")
    with pytest.raises(ModelLoadError, match="org/smol-gguf: a repo of GGUF files; name the one to serve: org/smol-gg"):
        resolve_model("org/smol-gguf")
    with pytest.raises(ModelLoadError, match=r"no GGUF file of quantization 'Q5_K_M'; it holds SmolLM2-135M-Instruct"):
        resolve_model("org/smol-gguf:Q5_K_M")
    with pytest.raises(ModelLoadError, match=r"'Q6_K' is split over 2 files .* `llama-gguf-split --merge`"):
        resolve_model("org/smol-gguf:Q6_K")
    with pytest.raises(ModelLoadError, match="org/smol-gguf: other.gguf: no such file in the repo"):
        resolve_model("org/smol-gguf/other.gguf")


def test_offline_a_warm_cache_asks_nothing(fake_hub, tiny_files, monkeypatch):  # noqa: F811
    fake_hub.add_repo("org/tiny", tiny_files)
    online = resolve_model("org/tiny")
    # Online, a second start asks the Hub what the revision is now and fetches no file again.
    monkeypatch.setattr(model_source, "_resolved", {})
    fake_hub.reset_counts()
    assert resolve_model("org/tiny") == online
    assert fake_hub.bytes_served == 0 and all(path.startswith("/api/") for _, path in fake_hub.requests)
    fake_hub.go_offline(monkeypatch)
    monkeypatch.setattr(model_source, "_resolved", {})
    fake_hub.reset_counts()
    assert resolve_model("org/tiny") == online
    assert load_model("org/tiny")[0].num_layers == 3
    assert fake_hub.requests == []
    with pytest.raises(ModelLoadError, match="org/other: not in the local Hugging Face cache, and HF_HUB_OFFLINE=1"):
        resolve_model("org/other")


def test_a_download_cut_mid_file_is_resumed(fake_hub, smollm2_path):  # noqa: F811
    gguf = smollm2_path.read_bytes()
    fake_hub.add_repo("org/smol-gguf", {"SmolLM2-135M-Instruct.Q4_1.gguf": gguf})
    # huggingface_hub keeps what it received in 10 MiB chunks and resumes from the last whole one (a Range request).
    fake_hub.cut_next_download("org/smol-gguf", "SmolLM2-135M-Instruct.Q4_1.gguf", after_bytes=25 << 20)
    path = resolve_model("org/smol-gguf:Q4_1")
    assert path.read_bytes() == gguf
    ranges = [h["range"] for method, _, h in fake_hub.requests_with_headers if method == "GET" and "range" in h]
    assert ranges == ["bytes=20971520-"]
    assert fake_hub.bytes_served == (25 << 20) + len(gguf) - (20 << 20)  # the cut part, then the rest from 20 MiB


def test_no_network_and_a_full_disk_are_named(tmp_path, monkeypatch, fake_hub, tiny_files):  # noqa: F811
    fake_hub.stop()  # nothing listens at HF_ENDPOINT now
    with pytest.raises(ModelLoadError, match="org/tiny: the Hub cannot be reached and the file is not in the local"):
        resolve_model("org/tiny")
    repo = HubRepo("org/tiny", None, str(tmp_path))
    with pytest.raises(ModelLoadError, match=f"org/tiny: the disk is full \\({tmp_path}\\); free space"):
        with repo.errors():
            raise OSError(errno.ENOSPC, "No space left on device")


def test_download_dir(fake_hub, tiny_files, tmp_path):  # noqa: F811
    fake_hub.add_repo("org/tiny", tiny_files)
    path = resolve_model("org/tiny", HubDownload(download_dir=str(tmp_path / "models")))
    assert path.is_relative_to(tmp_path / "models")


def test_adapters_draft_models_tokenizers_and_convert_take_hub_ids(fake_hub, tiny_files, full_vocab_dir, tmp_path):  # noqa: F811
    fake_hub.add_repo("org/tiny", tiny_files)
    config, _ = load_model("org/tiny")
    # A PEFT LoRA adapter of q_proj, rank 2, written by hand.
    rng = np.random.default_rng(0)
    tensors = {}
    for layer in range(config.num_layers):
        prefix = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        tensors[f"{prefix}.lora_A.weight"] = rng.normal(size=(2, 64)).astype(np.float32)
        tensors[f"{prefix}.lora_B.weight"] = rng.normal(size=(64, 2)).astype(np.float32)
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    settings = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
    adapter = {"adapter_config.json": json.dumps(settings).encode()}
    adapter["adapter_model.safetensors"] = (tmp_path / "adapter_model.safetensors").read_bytes()
    fake_hub.add_repo("org/tiny-lora", adapter | {"README.md": b"an adapter"})
    # As the engine reads an adapter that a request (--lora-modules, /v1/load_lora_adapter) names by its id.
    from_hub, _ = LoRAAdapters(config, 16, enabled=True).get(LoRARequest("hub-lora", 1, "org/tiny-lora"))
    assert from_hub.rank == 2 and set(from_hub.weights) == {"q_proj"}
    adapter_files = {("org/tiny-lora", name) for name in ("adapter_config.json", "adapter_model.safetensors")}
    assert adapter_files <= set(fake_hub.files_served) and ("org/tiny-lora", "README.md") not in fake_hub.files_served
    # A draft model by its id, checked against the target's config.
    assert load_draft_model("org/tiny", None, config)[0] == config
    # A model with its tokenizer: as a tokenizer only the tokenizer's files are fetched.
    fake_hub.add_repo("org/chat", files_of(Path(full_vocab_dir)))
    fake_hub.reset_counts()
    assert resolve_tokenizer("org/chat").is_dir()
    assert fake_hub.files_served and not any(name.endswith(".safetensors") for _, name in fake_hub.files_served)
    # jaxpage convert org/name DST, its flags honoured.
    overrides = '{"max_position_embeddings": 32}'
    assert main(["convert", "org/chat", str(tmp_path / "ckpt"), "--hf-overrides", overrides]) == 0
    assert load_model(tmp_path / "ckpt")[0].max_position_embeddings == 32
