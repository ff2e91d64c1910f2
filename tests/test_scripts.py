"""The benchmark scripts that must be ready to run on a device this machine does not have (their tiny modes), and
what the scripts import: the package's API, never one another or the tests."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

from jaxpage.benchmarks.device_table import failed, format_table, read_records, table_rows
from jaxpage.benchmarks.kv_plot import plot_kv_run

ROOT = Path(__file__).resolve().parents[1]


def test_device_checks_tiny_runs_every_stage_and_ends_with_the_table(tmp_path):
    """The device check as the device runs it (each stage a process of its own, the table over their logs), every
    stage in its tiny form: tiny figures meet no target, so each target is MISSING and the exit status is 1."""
    env = {**os.environ, "TINY": "1", "PYTHON": sys.executable}
    command = ["bash", "scripts/device_checks.sh", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    for name in ("devices", "decode_kernel", "prefill_kernel", "decode_steps", "e2e_jaxpage", "e2e_hf"):
        assert f"== {name}: exit 0 " in result.stdout, result.stdout[-3000:]
    assert result.returncode == 1
    records = read_records(sorted(tmp_path.glob("*.log")))
    checks = [record["check"] for record in records]
    assert checks.count("decode_kernel") == 4 and checks.count("prefill_kernel") == 1  # 2 shapes x 2 page formats
    assert all(record["rel_err_pallas_vs_xla"] < 1e-5 for record in records if "rel_err_pallas_vs_xla" in record)
    steps = {record["batch"]: record for record in records if record["check"] == "decode_step"}
    assert sorted(steps) == [1, 8, 64] and all(
        s["step_ms_async_on"] > 0 < s["step_ms_async_off"] for s in steps.values()
    )
    e2e = {record["check"]: record for record in records if record["check"].startswith("e2e")}
    assert e2e["e2e_jaxpage"]["compilations"] == 0  # the timed run reuses the compile run's shapes
    assert e2e["e2e_jaxpage"]["compile_run_loaded"] > 0  # those the decode stage compiled, from the cache
    assert e2e["e2e_jaxpage"]["output_tokens"] == e2e["e2e_hf"]["output_tokens"] > 0
    assert e2e["e2e_jaxpage"]["workload_sha256"] == e2e["e2e_hf"]["workload_sha256"]
    table = (tmp_path / "table.log").read_text()
    assert result.stdout.endswith(table) and "| tiny decode step, async on" in table
    assert table.count("MISSING") == 7 + 1 and "verdicts: 0 ok, 7 MISSING" in table  # the summary names it too


def good_device_run() -> list[dict]:
    """A device run's records as its stages print them, every target met."""
    layer = dict(heads=32, kv_heads=8, head_dim=128, dtype="bfloat16")
    kernel = dict(check="decode_kernel", device="cuda:0", num_seqs=64, kv_len=2048, kv_dtype="bfloat16", **layer)
    kernel |= dict(pallas_kv_gb_per_s=3200.0, pallas_fraction_of_copy=0.76, rel_err_pallas_vs_xla=0.004)
    kernel |= dict(xla_kv_gb_per_s=170.0, xla_fraction_of_copy=0.04, copy_gb_per_s=4214.0)
    prefill = dict(check="prefill_kernel", device="cuda:0", prompt_len=4096, matmul_tflop_per_s=780.0, **layer)
    prefill |= dict(pallas_tflop_per_s=420.0, pallas_fraction_of_matmul=0.54, rel_err_pallas_vs_xla=0.005)
    prefill |= dict(xla_tflop_per_s=90.0, xla_fraction_of_matmul=0.115)
    step = dict(check="decode_step", model="llama3-8b", device="cuda:0", kv_len=523, device_ms=4.0)
    steps = [step | dict(batch=1, step_ms_async_on=4.1, step_ms_async_off=4.6, roofline_ms_measured_bandwidth=3.6)]
    steps += [step | dict(batch=8, step_ms_async_on=4.4, step_ms_async_off=5.0, roofline_ms_measured_bandwidth=3.7)]
    steps += [step | dict(batch=64, step_ms_async_on=6.0, step_ms_async_off=6.9, roofline_ms_measured_bandwidth=4.7)]
    workload = dict(num_requests=64, output_tokens=6118)
    e2e = dict(model="llama3-8b", device="cuda:0", workload=workload, workload_sha256="96cf83f145cf3ea3")
    e2e_runs = [dict(check="e2e_jaxpage", output_tokens_per_s=9000.0, **e2e)]
    e2e_runs += [dict(check="e2e_hf", output_tokens_per_s=1500.0, **e2e)]
    return [kernel, prefill, *steps, *e2e_runs]


def test_device_table_puts_each_target_beside_its_figure():
    records = good_device_run()
    rows = table_rows(records)
    verdicts = {(row.check, row.case.split(",")[0]): (row.ratio, row.target, row.verdict) for row in rows}
    assert verdicts[("decode kernel (pallas)", "64 x 2")] == ("76%", ">= 70%", "ok")
    assert verdicts[("decode kernel (xla)", "64 x 2")] == ("4%", "-", "")  # beside it, no target
    assert verdicts[("prefill kernel (pallas)", "one 4")] == ("54%", ">= 50%", "ok")
    assert verdicts[("llama3-8b decode step, async off", "batch 1")] == ("1.28x", "<= 1.3x", "ok")
    assert verdicts[("llama3-8b decode step, async on", "batch 64")] == ("1.28x", "<= 1.5x", "ok")
    assert verdicts[("llama3-8b decode step, async on", "batch 8")] == ("1.19x", "-", "")
    assert verdicts[("end-to-end output tokens/s", "64 requests")] == ("6.00x", ">= 5.0x", "ok")
    assert not failed(rows) and "verdicts: 7 ok" in format_table(rows, records)


def test_device_table_flags_missed_missing_wrong_and_mismatched(tmp_path):
    kernel, prefill, batch_1, batch_8, batch_64, jaxpage, hf = good_device_run()
    kernel["pallas_fraction_of_copy"] = 0.69  # missed
    wrong = kernel | dict(num_seqs=256, kv_len=512, pallas_fraction_of_copy=0.9, rel_err_pallas_vs_xla=0.3)
    batch_64["step_ms_async_off"] = 7.1  # 1.51x: missed with synchronous scheduling only
    hf["workload_sha256"] = "another"
    records = [kernel, wrong, batch_1, batch_8, batch_64, jaxpage, hf]  # no prefill figure
    verdicts = [(row.check, row.case.split(",")[0], row.verdict) for row in table_rows(records) if row.verdict]
    assert verdicts == [
        ("decode kernel (pallas)", "64 x 2", "MISSED"),
        ("decode kernel (pallas)", "256 x 512", "WRONG"),
        ("llama3-8b decode step, async on", "batch 1", "ok"),
        ("llama3-8b decode step, async off", "batch 1", "ok"),
        ("llama3-8b decode step, async on", "batch 64", "ok"),
        ("llama3-8b decode step, async off", "batch 64", "MISSED"),
        ("end-to-end output tokens/s", "64 requests", "MISMATCH"),
        ("prefill kernel (pallas)", "one 4", "MISSING"),
    ]
    # The script reads the stages' logs, other lines and all, and says so in its exit status.
    log = "\n".join(["== a stage", "[bench 12:00:00] progress", *map(json.dumps, records), '{"not": "a check"}'])
    (tmp_path / "stage.log").write_text(log + "\n")
    command = [sys.executable, "scripts/device_table.py", str(tmp_path / "stage.log"), str(tmp_path / "absent.log")]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "verdicts: 3 ok, 2 MISSED, 1 MISSING, 1 WRONG, 1 MISMATCH" in result.stdout
    (tmp_path / "stage.log").write_text("\n".join(map(json.dumps, good_device_run())))
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout


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


def test_bench_lora_runs_both_engines_over_the_adapters(full_vocab_dir):
    command = [sys.executable, "scripts/bench_lora.py", "--model", full_vocab_dir, "--requests", "4", "--adapters", "2"]
    command += ["--max-tokens", "4", "--repeats", "1", "--max-loras", "2", "--max-model-len", "128", "--skip-warmup"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.splitlines()[-1])
    assert figures["tokens"] == {"base": 16, "lora": 16} and figures["lora_over_base"] > 0


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


def test_bench_host_times_every_phase_of_every_variant_and_profiles_one():
    """The host benchmark's tiny run: every batch size and variant has its phases, the stub keeps the batch full,
    and the profile names functions of each phase."""
    command = [sys.executable, "scripts/bench_host.py", "--batches", "2,8", "--steps", "4", "--max-tokens", "8"]
    command += ["--profile-batch", "8", "--profile-top", "3"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    variants = ("final", "stream", "stop", "logprobs", "no-prefix", "engine-process")
    assert sorted((row["batch"], row["variant"]) for row in report["rows"]) == sorted(
        (batch, variant) for batch in (2, 8) for variant in variants
    )
    for row in report["rows"]:
        assert row["seqs_per_step"] == row["batch"]  # each finished request replaced at once
        assert 0 < row["schedule_ms"] + row["arrays_ms"] + row["outputs_ms"] <= row["host_ms"]
        assert row["meets_target"] == (row["host_ms"] <= row["target_ms"])
        assert (row["text_chars_read"] > 0) == (row["variant"] != "engine-process")  # whose text is made elsewhere
    assert report["profile"]["batch"] == 8
    assert all(len(report["profile"][phase]) == 3 for phase in ("schedule", "arrays", "outputs"))
    assert "| batch | variant |" in result.stdout


def test_bench_serve_loop_counts_the_loops_steps_in_every_arrangement():
    """The serving loop benchmark's tiny run: each arrangement (the Python API, HTTP with the engine loop a thread of
    the server, HTTP with the engine in a process of its own) has its steps per second and its requests' times. (64
    tokens a request: the four must overlap in some step, which 12 no longer did once steps took a few milliseconds.)"""
    command = [sys.executable, "scripts/bench_serve_loop.py", "--clients", "4", "--max-tokens", "64", "--repeats", "1"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert sorted(report["rows"]) == ["async-api", "http-process", "http-thread", "python-api"]
    for rows in report["rows"].values():
        assert len(rows) == 1 and rows[0]["steps_per_s"] > 0
        assert 0 < rows[0]["request_s_median"] <= rows[0]["request_s_max"]
    assert "| http-process |" in result.stdout


def test_bench_embed_tiny_run_matches_sentence_transformers_and_counts_its_padding():
    """The embedding benchmark's tiny run (64 inputs of 8-32 tokens, 2-layer models): both models' embeddings equal
    sentence-transformers' to 1e-5, every step shape compiled before the timed call, none during it."""
    command = [sys.executable, "scripts/bench_embed.py", "--tiny"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert [m["model"] for m in report["models"]] == ["encoder", "decoder"]
    for model in report["models"]:
        st, (jaxpage,) = model["st"], model["jaxpage"]
        assert str(st["batch_size"]) in st["batch_size_tuning_inputs_per_s"] and 0 < st["padding_share"] < 1
        assert jaxpage["max_abs_diff"] <= 1e-5 and jaxpage["compiled_in_timed_call"] == 0
        shapes = [(s["row_length"], s["tokens"]) for s in jaxpage["compiled_shapes"]]
        assert sorted(shapes) == [(16, 16), (16, 32), (32, 32)] and jaxpage["max_step_tokens"] == 32
        assert 0 <= jaxpage["padding_share"] < 1 and jaxpage["inputs_per_s"] > 0 < st["inputs_per_s"]
    assert "| encoder (2 layers, mean) | jaxpage |" in result.stdout
