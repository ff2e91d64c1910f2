"""XLA's persistent compilation cache is on by default, in jaxpage's cache directory; an engine argument and a
command-line flag move it or turn it off. (A second start served by it: test_llm_api.)"""

from __future__ import annotations

from pathlib import Path

import jax
import pytest

from jaxpage.cli import CommandError, _parser
from jaxpage.compilation_cache import compilation_cache_path
from jaxpage.config import EngineConfig
from jaxpage.llm import LLM
from jaxpage.sampling_params import SamplingParams

ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, page_size=8)
PROMPT = {"prompt_token_ids": [5, 9, 13]}


def files_in(directory: Path) -> set[Path]:
    return {p for p in directory.rglob("*") if p.is_file()} if directory.exists() else set()


def test_the_default_is_the_jaxpage_cache_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXPAGE_CACHE", str(tmp_path))
    assert EngineConfig().compilation_cache_dir == "auto"
    assert compilation_cache_path("auto") == str(tmp_path / "compilation-cache")
    assert compilation_cache_path("~/x") == str(Path.home() / "x")


def test_an_engine_caches_its_programs_by_default_and_not_when_turned_off(monkeypatch, tmp_path, tiny_dir):
    monkeypatch.setenv("JAXPAGE_CACHE", str(tmp_path))
    cache = tmp_path / "compilation-cache"
    llm = LLM(tiny_dir, **ENGINE)
    assert jax.config.jax_compilation_cache_dir == str(cache)
    llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2))
    written = files_in(cache)
    assert written  # the step's programs, at least

    off = LLM(tiny_dir, compilation_cache_dir=None, **ENGINE | dict(max_num_batched_tokens=16))  # new shapes
    assert jax.config.jax_compilation_cache_dir is None
    off.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2))
    assert off.engine.runner.num_compilations > 0 and files_in(cache) == written


def test_command_line_flags(tmp_path):
    parser = _parser()
    assert parser.parse_args(["generate", "hi"]).compilation_cache_dir == "auto"
    assert parser.parse_args(["generate", "hi", "--no-compilation-cache"]).compilation_cache_dir is None
    args = parser.parse_args(["batch", "in.jsonl", "out.jsonl", "--compilation-cache-dir", str(tmp_path)])
    assert args.compilation_cache_dir == str(tmp_path)
    with pytest.raises(CommandError, match="not allowed with"):
        parser.parse_args(["generate", "hi", "--no-compilation-cache", "--compilation-cache-dir", str(tmp_path)])
