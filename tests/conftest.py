"""Shared fixtures: tiny random models of each family, and the default SmolLM2 model.

Importing this file imports no torch: tests that do not compare with Hugging Face transformers run without it.
The fixtures that return transformers' models (tiny_model_dir, smollm2_hf) import it when a test asks for them.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jax
import pytest

# TINY_COMMON_CONFIG and TINY_FAMILIES are imported from here by test_config and test_orbax_checkpoint.
from tiny_models import TINY_COMMON_CONFIG, TINY_FAMILIES, TinyFamily, write_tiny_model

__all__ = ["TINY_COMMON_CONFIG", "TINY_FAMILIES"]

# Eight simulated CPU devices for the tensor-parallel tests, in the test process and the commands it starts (never in
# jaxpage itself); everything else runs on the first. XLA reads the flag when jax first initializes its backend
# (no import above does).
SIMULATED_DEVICES = 8
# And LLVM's optimizations off in XLA's CPU compiler: the suite compiles hundreds of small programs, and a tiny model's
# warm-up spent 7.2 s in XLA's compiler with them, 4.9 s without (its steps run a little slower, which tiny models do
# not feel; no fast-math either way, so the values are the same up to rounding).
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={SIMULATED_DEVICES} {FAST_COMPILE}"
).strip()

# The compile tests (tests/test_compile_for.py and the others .ci/run gives the chips' compilers) run in several
# processes (-n): libtpu's lock file would let only the first of them build for a TPU, though none holds a chip.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# No test reaches the real Hugging Face Hub (a missing path that reads as a Hub id would try): huggingface_hub reads
# this at its import, here and in the commands the tests start, and then serves only from its cache. The tests of
# downloads point it at a Hub on loopback instead (tests/fake_hub.py's fixture turns this off).
os.environ["HF_HUB_OFFLINE"] = "1"

# On a GPU, float32 matrix products in float32: jax's default precision makes them TF32 there (10-bit mantissas),
# and the tests compare float32 programs with their references at float32 tolerances. The engine asks for it itself
# (ModelRunner: a float32 model's programs); this covers the programs the tests build directly, here and in the
# commands they start. Only on a GPU: on CPU it changes nothing, and Mosaic refuses "highest" for bfloat16 operands.
if jax.default_backend() == "gpu":
    os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"
    jax.config.update("jax_default_matmul_precision", "highest")


# With pytest-xdist (README: -n auto --dist loadfile) each file runs whole on one worker, and a worker that finishes a
# file takes the next in collection order. The files that take longest (measured on the 2-core CI machine) come
# first, so that no long file starts last and runs alone; the others keep their order.
SLOWEST_FILES_FIRST = [
    "test_spec_decode.py",
    "test_parallel.py",
    "test_engine.py",
    "test_spec_decode_draft_model.py",
    "test_structured_outputs.py",
    "test_ragged_paged_attention.py",
    "test_quantized_kv_attention.py",
    "test_kv_cache_dtype.py",
    "test_scripts.py",
    "test_attention_backend.py",
    "test_paged_attention.py",
    "test_rejection_sampler.py",
    "test_llm_api.py",
    "test_server.py",
    "test_tpu_kernels.py",
    "test_multihost.py",
    "test_int8.py",
    "test_batch.py",
]


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # xdist would otherwise order files by their number of tests
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """tiny_model_path(family) -> the directory of the family's tiny random model (config.json + model.safetensors),
    written once per family, without torch."""
    cache: dict[str, Path] = {}

    def get(family: TinyFamily) -> Path:
        if family.name not in cache:
            cache[family.name] = write_tiny_model(family, tmp_path_factory.mktemp(family.name))
        return cache[family.name]

    return get


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_path):
    """tiny_model_dir(family) -> (tiny_model_path(family), transformers' model loaded from it), made once per
    family. Imports torch: for tests that compare with transformers."""
    from hf_reference import load_tiny_hf_model

    cache: dict[str, tuple[Path, object]] = {}

    def get(family: TinyFamily) -> tuple[Path, object]:
        if family.name not in cache:
            directory = tiny_model_path(family)
            cache[family.name] = (directory, load_tiny_hf_model(directory))
        return cache[family.name]

    return get


# LoRA adapters of the smollm2-tied tiny model (tests/test_lora_*.py): name -> (lora_int_id, PEFT's arguments); ranks
# 8, 16 and 4, for slots of rank 16.
LORA_TARGETS_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_ADAPTERS = {
    "all-r8": (1, dict(target_modules=LORA_TARGETS_ALL, r=8, lora_alpha=32)),
    "attention-r16": (2, dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], r=16, lora_alpha=64)),
    "mlp-r4-rslora": (3, dict(target_modules=["gate_proj", "up_proj", "down_proj"], r=4, lora_alpha=16,
                              use_rslora=True)),
}  # fmt: skip


@pytest.fixture(scope="session")
def lora_adapters(tiny_model_dir, tmp_path_factory):
    """(the smollm2-tied tiny model's directory, transformers' model of it, {name: (LoRARequest, PEFT's model)}) for
    the adapters of LORA_ADAPTERS, written by PEFT. Imports torch and peft."""
    from peft_adapters import write_peft_adapter

    from jaxpage.lora_request import LoRARequest

    directory, hf = tiny_model_dir(next(f for f in TINY_FAMILIES if f.name == "smollm2-tied"))
    made = {}
    for seed, (name, (lora_id, kwargs)) in enumerate(LORA_ADAPTERS.items()):
        path = tmp_path_factory.mktemp(name)
        made[name] = (LoRARequest(name, lora_id, str(path)), write_peft_adapter(hf, path, seed=seed, **kwargs))
    return directory, hf, made


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The default model's GGUF file (fetched into the jaxpage cache on first use)."""
    from jaxpage.models.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path, tmp_path_factory):
    """transformers' own float32 model from the same GGUF file: the reference for jaxpage. Imports torch.

    Read from the GGUF file once a run: transformers takes about 20 s (more beside a busy worker). Under pytest-xdist
    the first worker to need it pickles it into the run's temporary folder, which the workers share, and the others
    unpickle it (0.3 s; the same tensors, config and eval mode)."""
    import torch
    from filelock import FileLock
    from hf_reference import load_hf_model

    if "PYTEST_XDIST_WORKER" not in os.environ:  # one process: nothing to share (the folder above is every run's)
        return load_hf_model(smollm2_path)
    pickled = tmp_path_factory.getbasetemp().parent / "smollm2-hf.pt"  # this run's, above each worker's own
    with FileLock(f"{pickled}.lock"):
        if pickled.is_file():
            return torch.load(pickled, weights_only=False)
        model = load_hf_model(smollm2_path)
        torch.save(model, pickled)
        return model


@pytest.fixture(scope="session")
def tiny_dir(tiny_model_path, smollm2_path, tmp_path_factory):
    """A tiny random model (smollm2-tied, vocab 96) with SmolLM2's tokenizer beside it, so its outputs decode to
    text. Prompts must be token ids below 96: the tokenizer's own ids are larger."""
    import shutil

    from jaxpage.tokenizers.tokenizer import load_tokenizer

    family = next(f for f in TINY_FAMILIES if f.name == "smollm2-tied")
    directory = tmp_path_factory.mktemp("tiny-engine")
    shutil.copytree(tiny_model_path(family), directory, dirs_exist_ok=True)
    load_tokenizer(smollm2_path).save_pretrained(str(directory))
    return str(directory)


FULL_VOCAB_FAMILY = TinyFamily(
    "tiny-full-vocab",
    "LlamaConfig",
    dict(vocab_size=49152, hidden_size=32, intermediate_size=48, num_attention_heads=2, num_key_value_heads=1,
         num_hidden_layers=2, tie_word_embeddings=True, max_position_embeddings=128, eos_token_id=2),
)  # fmt: skip


@pytest.fixture(scope="session")
def full_vocab_dir(smollm2_path, tmp_path_factory) -> str:
    """A tiny random model with SmolLM2's full vocabulary (49152) and its tokenizer beside it: text prompts and chat
    templates run end to end."""
    from jaxpage.tokenizers.tokenizer import load_tokenizer

    directory = tmp_path_factory.mktemp("tiny-full-vocab")
    write_tiny_model(FULL_VOCAB_FAMILY, directory)
    load_tokenizer(smollm2_path).save_pretrained(str(directory))
    return str(directory)


@pytest.fixture(scope="session")
def bert_st_dir(tmp_path_factory):
    """(a tiny random BERT saved as a sentence-transformers model: mean pooling, then Normalize; that model)."""
    from pooling_models import build_bert_st_dir

    return build_bert_st_dir(tmp_path_factory.mktemp("bert"))


@pytest.fixture(scope="session")
def bert_classifiers(tmp_path_factory):
    """{num_labels: a tiny random BertForSequenceClassification's directory, with its tokenizer} for 1 and 3."""
    from pooling_models import build_bert_classifiers

    return build_bert_classifiers(tmp_path_factory.mktemp("bert-classifiers"))


@pytest.fixture
def log_records():
    """The records the jaxpage and uvicorn loggers emit meanwhile (their own handler: jaxpage's logger does not
    propagate to the root logger, where caplog listens)."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    loggers = [logging.getLogger(name) for name in ("jaxpage", "uvicorn.error", "uvicorn")]
    for logger in loggers:
        logger.addHandler(handler)
    yield records
    for logger in loggers:
        logger.removeHandler(handler)
