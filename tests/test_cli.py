"""The README's main-job command, run as a user runs it: the `jaxpage` console script."""

from __future__ import annotations

import os
import subprocess


def test_predict_on_the_default_model(smollm2_path):
    env = {**os.environ, "JAXPAGE_CACHE": str(smollm2_path.parent.parent)}  # the cache the fixture filled
    result = subprocess.run(
        ["jaxpage", "predict", "The capital of France is", "--top", "3"], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("prompt: 5 tokens;")
    assert lines[1].endswith("' Paris'")  # SmolLM2's greedy answer, and transformers' too
    assert len(lines) == 4


def test_bad_arguments_are_reported_cleanly():
    result = subprocess.run(["jaxpage", "predict", "hi", "--top", "0"], capture_output=True, text=True)
    assert result.returncode == 2
    assert "jaxpage: error: --top must be at least 1" in result.stderr
    assert "Traceback" not in result.stderr


def test_generate_streams_greedy_text(smollm2_path):
    env = {**os.environ, "JAXPAGE_CACHE": str(smollm2_path.parent.parent)}
    result = subprocess.run(
        ["jaxpage", "generate", "The capital of France is", "--max-tokens", "8", "--temperature", "0"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(" Paris.\n\nThe answer is")  # transformers' greedy continuation too
    assert "[8 tokens, finish_reason=length" in result.stderr


def test_generate_rejects_bad_sampling_flags():
    result = subprocess.run(["jaxpage", "generate", "hi", "--top-p", "2"], capture_output=True, text=True)
    assert result.returncode == 2
    assert "jaxpage: error: SamplingParams.top_p must be in (0, 1], got 2.0" in result.stderr
    assert "Traceback" not in result.stderr
