"""The package's import surface: vLLM's names from `jaxpage`, imported lazily, and the version."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import jaxpage

VLLM_NAMES = {
    "LLM": "jaxpage.llm",
    "SamplingParams": "jaxpage.sampling_params",
    "LLMEngine": "jaxpage.llm_engine",
    "EngineConfig": "jaxpage.config",
    "RequestOutput": "jaxpage.outputs",
    "CompletionOutput": "jaxpage.outputs",
}

# Run in a fresh interpreter: what `import jaxpage` imports, then whether vLLM's names resolve to their classes.
PROBE = """
import importlib, json, sys

import jaxpage

heavy = [m for m in ("jax", "transformers", "torch") if m in sys.modules]
from jaxpage import LLM, SamplingParams, LLMEngine, EngineConfig, RequestOutput, CompletionOutput

resolved = {name: globals()[name] is getattr(importlib.import_module(module), name) for name, module in NAMES.items()}
print(json.dumps({"heavy": heavy, "resolved": resolved, "jax": "jax" in sys.modules}))
"""


def test_import_is_light_and_vllm_names_resolve_lazily():
    probe = f"NAMES = {VLLM_NAMES!r}\n{PROBE}"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["heavy"] == []  # `import jaxpage` imports neither jax nor transformers nor torch
    assert report["resolved"] == dict.fromkeys(VLLM_NAMES, True)
    assert report["jax"]  # LLM and LLMEngine need jax: they were imported on demand


def test_public_names():
    assert set(VLLM_NAMES) <= set(jaxpage.__all__)
    for name in jaxpage.__all__:
        assert getattr(jaxpage, name) is not None
    assert set(jaxpage.__all__) <= set(dir(jaxpage))
    assert jaxpage.ModelLoadError.__module__ == "jaxpage.errors"


def test_unknown_names_fail_as_usual():
    with pytest.raises(ImportError, match="cannot import name 'Nonexistent' from 'jaxpage'"):
        from jaxpage import Nonexistent  # noqa: F401
    with pytest.raises(AttributeError, match="module 'jaxpage' has no attribute 'Nonexistent'"):
        jaxpage.Nonexistent  # noqa: B018
    assert not hasattr(jaxpage, "nonexistent")


def test_version_is_the_installed_distributions():
    pyproject = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    assert jaxpage.__version__ == pyproject["project"]["version"]
