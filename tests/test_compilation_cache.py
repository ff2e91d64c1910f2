"""The persistent compilation cache is on by default, in jaxpage's cache directory; an engine argument and a
command-line flag move it or turn it off. A later engine loads its programs from it without tracing them."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxpage.config import EngineConfig
from jaxpage.entrypoints.cli import CommandError, _parser
from jaxpage.entrypoints.llm import LLM
from jaxpage.sampling_params import SamplingParams
from jaxpage.worker.compilation_cache import compilation_cache_path

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
    llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2))
    written = files_in(cache)
    assert len(written) == len(llm.engine.runner.compile_log) > 0  # the step's programs

    off = LLM(tiny_dir, compilation_cache_dir=None, **ENGINE | dict(max_num_batched_tokens=16))  # new shapes
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


class NoLowering:
    def lower(self, *args, **kwargs):
        raise AssertionError("a program was traced and lowered")


def test_a_second_engine_loads_its_programs_without_tracing_them(tmp_path, tiny_dir):
    args = ENGINE | dict(compilation_cache_dir=str(tmp_path))
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = LLM(tiny_dir, **args)
    want = first.generate(PROMPT, greedy)[0].outputs[0].token_ids
    compiled = first.engine.runner.compile_log
    assert compiled and not any(c.loaded for c in compiled)
    assert len(list(tmp_path.glob("*.program"))) == len(compiled)

    second = LLM(tiny_dir, **args)
    second.engine.runner._forward = second.engine.runner._sample = NoLowering()
    assert second.generate(PROMPT, greedy)[0].outputs[0].token_ids == want
    loaded = second.engine.runner.compile_log
    assert [(c.program, c.shape) for c in loaded] == [(c.program, c.shape) for c in compiled]
    assert all(c.loaded for c in loaded)

    for entry in tmp_path.glob("*.program"):  # damaged entries: compiled again, and rewritten
        entry.write_bytes(entry.read_bytes()[:100])
    third = LLM(tiny_dir, **args)
    assert third.generate(PROMPT, greedy)[0].outputs[0].token_ids == want
    assert not any(c.loaded for c in third.engine.runner.compile_log)
    fourth = LLM(tiny_dir, **args)
    assert fourth.generate(PROMPT, greedy)[0].outputs[0].token_ids == want
    assert all(c.loaded for c in fourth.engine.runner.compile_log)


def test_programs_of_other_arguments_are_not_loaded(tmp_path, tiny_dir):
    args = ENGINE | dict(compilation_cache_dir=str(tmp_path))
    LLM(tiny_dir, **args).generate(PROMPT, SamplingParams(temperature=0, max_tokens=2))
    other = LLM(tiny_dir, **args | dict(page_size=16))  # another pool shape: other forward programs
    other.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2))
    log = other.engine.runner.compile_log
    forward = [c.loaded for c in log if c.program in ("forward", "pool")]
    assert forward and not any(forward)
    samplers = [c.loaded for c in log if c.program == "sample"]  # the prompt's step's and one decode row's
    assert len(samplers) == 2 and all(samplers)  # the sampler does not read the pool


def test_a_runner_with_compiler_options_neither_loads_nor_keeps_its_programs(tmp_path, tiny_dir):
    # ModelRunner.compiler_options (jaxpage.aot's: a dump directory) may change a program, and are not in the key.
    args = ENGINE | dict(compilation_cache_dir=str(tmp_path / "cache"))
    LLM(tiny_dir, **args).generate(PROMPT, SamplingParams(temperature=0, max_tokens=1))
    dumped = LLM(tiny_dir, **args)
    runner, start = dumped.engine.runner, len(dumped.engine.runner.compile_log)  # the pool's fill: loaded at start
    entries = {p: p.stat().st_mtime_ns for p in files_in(tmp_path / "cache")}  # a load or a store touches its entry
    runner.compiler_options = {"xla_dump_to": str(tmp_path / "dump")}
    dumped.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1))
    log = runner.compile_log[start:]
    assert "forward" in [c.program for c in log] and not any(c.loaded for c in log)
    assert {p: p.stat().st_mtime_ns for p in files_in(tmp_path / "cache")} == entries
    assert list((tmp_path / "dump").glob("*_forward_fn*"))  # compiled with the options
