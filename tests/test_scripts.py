"""The benchmark scripts that must be ready to run on a device this machine does not have (their tiny modes), and
what the scripts import: the package's API, never one another or the tests."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from jaxpage.benchmarks.kv_plot import plot_kv_run

ROOT = Path(__file__).resolve().parents[1]


def test_bench_device_tiny_mode_runs_every_part():
    result = subprocess.run(
        [sys.executable, "scripts/bench_device.py", "--tiny"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    report = json.loads(lines[-1])
    for batch in (1, 8, 64):
        decode = report[f"decode_batch_{batch}"]
        assert decode["step_ms"] > 0 and decode["bytes_read_per_step"] > report["param_bytes"] // 2
    assert report["e2e_jaxpage"]["compilations"] == 0  # the timed run reuses the compile run's shapes
    assert report["e2e_jaxpage"]["output_tokens"] == report["e2e_hf"]["output_tokens"] > 0
    # each result also on a line of its own as it ends, for scripts/device_table.py
    checks = [json.loads(line)["check"] for line in lines[:-1] if line.startswith("{")]
    assert checks == ["decode_step"] * 3 + ["e2e_jaxpage", "e2e_hf"]


def test_bench_parallel_tiny_mode_reports_each_layout():
    """A tiny mixture of experts (8 experts): one device, 4 shards with expert parallelism, 2 replicas."""
    command = [sys.executable, "scripts/bench_parallel.py", "--tiny", "--moe", "--layouts", "1x1,4x1ep,1x2"]
    command += ["--max-tokens", "8", "--requests", "4", "--skip-warmup"]  # the layouts' facts, not compile seconds
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    one, four, replicas = json.loads(result.stdout.splitlines()[-1])["layouts"]
    assert one["forward_all_reduces"] == one["sampler_all_gathers"] == 0
    assert four["forward_all_reduces_per_layer"] == 2 and four["sampler_all_gathers"] == 1  # experts: no new one
    assert four["kv_bytes_per_token_per_device"] == one["kv_bytes_per_token_per_device"] // 2  # 2 KV heads, 4 copies
    assert 1 <= four["weight_ratio_to_stored_over_tp"] < 1.1 and four["same_tokens_as_first"]
    assert four["enable_expert_parallel"] and four["expert_bytes_per_device"] == one["expert_bytes_total"] // 4
    # Data parallelism: no collective, each replica's devices hold the whole model and their own pages.
    assert replicas["forward_all_reduces"] == replicas["sampler_all_gathers"] == 0 and not replicas["other_collectives"]
    assert replicas["weight_ratio_to_stored_over_tp"] == 1 and replicas["same_tokens_as_first"]
    assert replicas["kv_bytes_per_token_per_device"] == one["kv_bytes_per_token_per_device"]
    assert replicas["expert_bytes_per_device"] == one["expert_bytes_per_device"] == one["expert_bytes_total"]


def test_kv_plot_writes_a_png(tmp_path):
    path = tmp_path / "kv.png"
    plot_kv_run(path, [0.5, 1.0, 1.5], [0.97, 0.98, 0.99], [2, 5, 3], [10, 30, 20], 40, contiguous_requests=2)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_scripts_import_neither_one_another_nor_the_tests():
    local = {"scripts", "tests"} | {p.stem for folder in ("scripts", "tests") for p in (ROOT / folder).glob("*.py")}
    scripts = sorted((ROOT / "scripts").glob("*.py"))
    assert len(scripts) >= 8
    for script in scripts:
        tree = ast.parse(script.read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        assert not {name.split(".")[0] for name in imported} & local, script.name
        assert "sys.path" not in script.read_text(), f"{script.name}: import jaxpage's API instead"


def test_bench_memory_window_report_gives_back_what_no_layer_reads():
    command = [sys.executable, "scripts/bench_memory.py", "--window-context", "256", "--window", "40"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    every_layer, hybrid = json.loads(result.stdout.splitlines()[-1])["window_runs"]
    # every layer slides: the sequence holds only the pages of its window (at most 4 pages of 16 tokens for 40 keys),
    # of the context's 16
    assert every_layer["held_over_ideal"] <= 1 and every_layer["held_over_whole_context"] <= 4 / 16
    assert hybrid["kv_bytes_held_max"] <= hybrid["kv_bytes_whole_context"]
