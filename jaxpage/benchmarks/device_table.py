"""The device check's one table (scripts/device_checks.sh ends with it, scripts/device_table.py prints it): every
figure the stages printed as JSON lines ({"check": ...}), beside what it is measured against in the same run and its
target, with a verdict.

Targets (each holds only at the device shapes: the Llama-3-8B layer and model; tiny runs meet none):
- the decode kernel (Pallas) at 64 sequences x 2,048 tokens, bfloat16 pages: >= 70% of the copy bandwidth;
- the prefill kernel (Pallas) on one 4,096-token causal prompt: >= 50% of the bfloat16 matmul rate;
- the Llama-3-8B-shaped decode step at batch 1: <= 1.3x, at batch 64: <= 1.5x its (weight + KV) bytes over the copy
  bandwidth, with asynchronous scheduling on and off alike;
- end-to-end output tokens/s: >= 5x transformers' continuous batching on the same workload and device.
A target with no figure (its stage failed or ran out of time) is MISSING; a kernel whose output is off the XLA
implementation's by more than its format allows is WRONG; end-to-end figures of two different workloads MISMATCH.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

LLAMA3_8B_LAYER = dict(heads=32, kv_heads=8, head_dim=128)
DECODE_KERNEL_TARGET = dict(num_seqs=64, kv_len=2048, kv_dtype="bfloat16", **LLAMA3_8B_LAYER)
PREFILL_KERNEL_TARGET = dict(prompt_len=4096, dtype="bfloat16", **LLAMA3_8B_LAYER)
DECODE_KERNEL_FRACTION, PREFILL_KERNEL_FRACTION = 0.70, 0.50
DECODE_STEP_RATIO = {1: 1.3, 64: 1.5}  # batch -> most step time over its roofline
E2E_RATIO = 5.0
TARGET_MODEL = "llama3-8b"
# ||pallas - xla|| / ||xla|| a kernel may reach: bfloat16 outputs round at 2^-8; float32 ones far below
MAX_REL_ERR = {"bfloat16": 2e-2, "float32": 1e-3}
FAILED = ("MISSED", "MISSING", "WRONG", "MISMATCH")


@dataclasses.dataclass
class Row:
    check: str  # what was measured: "decode kernel (pallas)"
    case: str  # at which size: "64 x 2,048, bfloat16 pages"
    measured: str = "-"  # the figure: "3,012 GB/s"
    against: str = "-"  # what it is measured against, in the same run: "copy 4,214 GB/s"
    ratio: str = "-"  # the one over the other: "71%", "1.12x"
    target: str = "-"  # ">= 70%"; "-" where none
    verdict: str = ""  # ok, MISSED, MISSING, WRONG, MISMATCH; "" where there is no target and nothing wrong
    notes: str = ""


def read_records(paths) -> list[dict]:
    """The JSON lines with a "check" key in these files (other lines, and files that do not exist, are skipped)."""
    records = []
    for path in map(Path, paths):
        if not path.is_file():
            continue
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(record, dict) and "check" in record:
                    records.append(record)
    return records


def number(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.3g}"


def verdict(met: bool) -> str:
    return "ok" if met else "MISSED"


def matches(record: dict, spec: dict) -> bool:
    return all(record.get(key) == value for key, value in spec.items())


def kernel_error_verdict(record: dict, output_dtype: str) -> tuple[str, str]:
    """("WRONG" or "", a note) for a kernel's relative error against the XLA implementation."""
    error = record.get("rel_err_pallas_vs_xla")
    if error is None:
        return "", ""
    wrong = not error <= MAX_REL_ERR.get(output_dtype, MAX_REL_ERR["bfloat16"])  # NaN is wrong
    return ("WRONG" if wrong else ""), f"rel. err vs xla {error:.2g}"


def _kernel_rows(
    record: dict, kernel: str, case: str, rate: tuple[str, str], against: tuple[str, str], target
) -> list[Row]:
    """The Pallas kernel's and the XLA implementation's rows of one case: each one's rate (the record's key suffix,
    its unit), against (a label, the key suffix of the fraction of it), and on the Pallas row the target (the cases
    it applies to, the least fraction) and the kernel's error against XLA's."""
    (rate_key, unit), (against_label, fraction_key), (spec, least) = rate, against, target
    rows = []
    for impl in ("pallas", "xla"):
        fraction = record[f"{impl}_{fraction_key}"]
        row = Row(f"{kernel} kernel ({impl})", case, f"{number(record[f'{impl}_{rate_key}'])} {unit}")
        row.against, row.ratio = against_label, f"{fraction:.0%}"
        if impl == "pallas":
            if matches(record, spec):
                row.target, row.verdict = f">= {least:.0%}", verdict(fraction >= least)
            wrong, row.notes = kernel_error_verdict(record, record["dtype"])
            row.verdict = wrong or row.verdict
        rows.append(row)
    return rows


def decode_kernel_rows(record: dict) -> list[Row]:
    case = f"{record['num_seqs']} x {record['kv_len']:,}, {record['kv_dtype']} pages"
    against = (f"copy {number(record['copy_gb_per_s'])} GB/s", "fraction_of_copy")
    target = (DECODE_KERNEL_TARGET, DECODE_KERNEL_FRACTION)
    return _kernel_rows(record, "decode", case, ("kv_gb_per_s", "GB/s"), against, target)


def prefill_kernel_rows(record: dict) -> list[Row]:
    case = f"one {record['prompt_len']:,}-token prompt, {record['dtype']}"
    against = (f"bf16 matmul {number(record['matmul_tflop_per_s'])} TFLOP/s", "fraction_of_matmul")
    target = (PREFILL_KERNEL_TARGET, PREFILL_KERNEL_FRACTION)
    return _kernel_rows(record, "prefill", case, ("tflop_per_s", "TFLOP/s"), against, target)


def decode_step_rows(record: dict) -> list[Row]:
    batch, roofline = record["batch"], record["roofline_ms_measured_bandwidth"]
    limit = DECODE_STEP_RATIO.get(batch) if record.get("model") == TARGET_MODEL else None
    rows = []
    for mode in ("on", "off"):
        step = record.get(f"step_ms_async_{mode}")
        if step is None:
            continue
        row = Row(f"{record.get('model')} decode step, async {mode}", f"batch {batch}, {record['kv_len']} tokens each")
        row.measured, row.against, row.ratio = f"{step} ms", f"bytes / copy = {roofline} ms", f"{step / roofline:.2f}x"
        if limit is not None:
            row.target, row.verdict = f"<= {limit}x", verdict(step / roofline <= limit)
        row.notes = f"device {record['device_ms']} ms" if mode == "on" else ""
        rows.append(row)
    return rows


def e2e_rows(jaxpage: dict | None, hf: dict | None) -> list[Row]:
    """The end-to-end row: jaxpage's output tokens/s against transformers' (what there is of them)."""
    if jaxpage is None and hf is None:
        return []
    workload = (jaxpage or hf)["workload"]
    row = Row("end-to-end output tokens/s", f"{workload['num_requests']} requests, {workload['output_tokens']:,} out")
    if jaxpage is not None:
        row.measured = f"jaxpage {number(jaxpage['output_tokens_per_s'])}"
    if hf is not None:
        row.against = f"HF continuous batching {number(hf['output_tokens_per_s'])}"
    if jaxpage is None or hf is None:
        row.notes = f"no {'jaxpage' if jaxpage is None else 'transformers'} figure"
        return [row]
    ratio = jaxpage["output_tokens_per_s"] / hf["output_tokens_per_s"]
    row.ratio = f"{ratio:.2f}x"
    if jaxpage.get("workload_sha256") != hf.get("workload_sha256"):
        row.verdict, row.notes = "MISMATCH", "the two ran different workloads"
    elif jaxpage.get("model") == hf.get("model") == TARGET_MODEL:
        row.target, row.verdict = f">= {E2E_RATIO}x", verdict(ratio >= E2E_RATIO)
    return [row]


def missing_rows(records: list[dict]) -> list[Row]:
    """A MISSING row for each target no record gives a figure for."""
    rows = []
    by_check = {}
    for record in records:
        by_check.setdefault(record["check"], []).append(record)
    if not any(matches(r, DECODE_KERNEL_TARGET) for r in by_check.get("decode_kernel", [])):
        rows.append(Row("decode kernel (pallas)", "64 x 2,048, bfloat16 pages", target=">= 70%", verdict="MISSING"))
    if not any(matches(r, PREFILL_KERNEL_TARGET) for r in by_check.get("prefill_kernel", [])):
        rows.append(Row("prefill kernel (pallas)", "one 4,096-token prompt", target=">= 50%", verdict="MISSING"))
    steps = [r for r in by_check.get("decode_step", []) if r.get("model") == TARGET_MODEL]
    for batch, limit in DECODE_STEP_RATIO.items():
        for mode in ("on", "off"):
            if not any(r["batch"] == batch and f"step_ms_async_{mode}" in r for r in steps):
                row = Row(f"{TARGET_MODEL} decode step, async {mode}", f"batch {batch}", target=f"<= {limit}x")
                rows.append(dataclasses.replace(row, verdict="MISSING"))
    if not all(any(r.get("model") == TARGET_MODEL for r in by_check.get(c, [])) for c in ("e2e_jaxpage", "e2e_hf")):
        rows.append(Row("end-to-end output tokens/s", "-", target=f">= {E2E_RATIO}x", verdict="MISSING"))
    return rows


def table_rows(records: list[dict]) -> list[Row]:
    """Every record's rows, in the stages' order, then a MISSING row for each target without a figure."""
    makers = {"decode_kernel": decode_kernel_rows, "prefill_kernel": prefill_kernel_rows}
    makers["decode_step"] = decode_step_rows
    rows = [row for check in makers for record in records if record["check"] == check for row in makers[check](record)]
    last = {record["check"]: record for record in records}  # a check printed twice: its last run
    rows += e2e_rows(last.get("e2e_jaxpage"), last.get("e2e_hf"))
    return rows + missing_rows(records)


def format_table(rows: list[Row], records: list[dict]) -> str:
    """The rows as a Markdown table, under the devices the records name and over a count of the verdicts."""
    fields = [field.name for field in dataclasses.fields(Row)]
    cells = [fields] + [[str(getattr(row, name)) for name in fields] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(fields))]
    lines = [
        "| " + " | ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)) + " |" for line in cells
    ]
    lines.insert(1, "|" + "|".join("-" * (width + 2) for width in widths) + "|")
    devices = sorted({str(record.get("device")) for record in records})
    counts = {name: sum(row.verdict == name for row in rows) for name in ("ok", *FAILED)}
    summary = ", ".join(f"{count} {name}" for name, count in counts.items() if count or name == "ok")
    return "\n".join([f"device: {', '.join(devices) or 'none reported'}", *lines, f"verdicts: {summary}"])


def failed(rows: list[Row]) -> bool:
    return any(row.verdict in FAILED for row in rows)
