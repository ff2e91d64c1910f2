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
