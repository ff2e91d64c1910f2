"""Hugging Face transformers as a serving baseline on a benchmark workload: static batches of model.generate(),
and transformers' continuous batching (torch and transformers are test extras: imported inside these functions)."""

from __future__ import annotations

import math
import time
from pathlib import Path

from jaxpage.benchmarks.measure import cpu_seconds, machine_load
from jaxpage.benchmarks.progress import log


def load_hf_model(path: Path, attn_implementation: str | None = None):
    """transformers' float32 model, in eval mode, from a .gguf file (dequantized by transformers) or an HF
    directory."""
    import torch
    import transformers

    path = Path(path)
    kwargs = dict(dtype=torch.float32, attn_implementation=attn_implementation)
    if path.suffix == ".gguf":
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kwargs)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    return model.eval()


def hf_source(model: str | None) -> Path:
    """The .gguf file or HF directory transformers loads; exits early for a source it cannot read."""
    from jaxpage.models.default_model import default_model_path

    path = Path(model) if model else default_model_path()
    if path.suffix != ".gguf" and not ((path / "config.json").is_file() and any(path.glob("*.safetensors*"))):
        raise SystemExit(f"transformers cannot load {path}: give a .gguf file or an HF directory, or skip the HF runs")
    return path


def load_hf_baseline(path: Path):
    """transformers' float32 model that generates to max_new_tokens, like ignore_eos."""
    hf = load_hf_model(path)
    hf.generation_config.eos_token_id = None
    return hf


def run_hf_static(hf, rows: list[dict], batch_size: int) -> tuple[dict, dict[str, list[int]]]:
    """model.generate() over left-padded static batches of batch_size rows in workload order, greedy, each batch to
    its largest max_tokens; only each row's own max_tokens count as output. (figures, request id -> tokens)"""
    import torch
    from transformers import GenerationConfig

    pad_id = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    outputs: dict[str, list[int]] = {}
    generated = 0
    batches = [rows[i : i + batch_size] for i in range(0, len(rows), batch_size)]
    cpu_start, start = cpu_seconds(), time.perf_counter()
    for index, batch in enumerate(batches):
        width = max(len(r["prompt_token_ids"]) for r in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, row in enumerate(batch):  # left padding
            ids = row["prompt_token_ids"]
            input_ids[i, width - len(ids) :] = torch.tensor(ids)
            mask[i, width - len(ids) :] = 1
        max_new = max(r["max_tokens"] for r in batch)
        config = GenerationConfig(max_new_tokens=max_new, do_sample=False, pad_token_id=pad_id, eos_token_id=None)
        batch_start = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
        new = out[:, width:]
        if new.shape[1] != max_new:
            raise SystemExit(f"hf_static: batch {index} generated {new.shape[1]} tokens, expected {max_new}")
        generated += new.numel()
        for i, row in enumerate(batch):
            outputs[row["id"]] = new[i, : row["max_tokens"]].tolist()
        log(
            f"hf_static: batch {index + 1}/{len(batches)} ({len(batch)} rows, width {width}, {max_new} new tokens) "
            f"in {time.perf_counter() - batch_start:.1f}s"
        )
    wall_s = time.perf_counter() - start
    useful = sum(len(t) for t in outputs.values())
    return {
        "output_tokens": useful,
        "generated_tokens_incl_waste": generated,
        "wall_s": round(wall_s, 3),
        "output_tokens_per_s": round(useful / wall_s, 2),
        "batch_size": batch_size,
        "attn_implementation": hf.config._attn_implementation,
        **machine_load(cpu_seconds() - cpu_start, wall_s),
    }, outputs


def cb_page_size(config) -> int:
    """Tokens per page of a ContinuousBatchingConfig: `page_size` since transformers 5.17's successors, `block_size`
    in 5.17 itself (the version on the lent H200s)."""
    return getattr(config, "page_size", None) or config.block_size


def run_hf_continuous(
    hf, rows: list[dict], max_num_batched_tokens: int, max_num_seqs: int, kv_tokens: int, warmup_rows=()
) -> tuple[dict, dict[str, list[int]]]:
    """transformers' continuous batching with jaxpage's token budget, row limit and KV capacity (kv_tokens), every
    row greedy to its max_tokens, after `warmup_rows` (untimed: the first launches of its kernels). (figures, request
    id -> tokens)"""
    import torch
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    page_size = cb_page_size(ContinuousBatchingConfig())
    cb_config = ContinuousBatchingConfig(
        max_batch_tokens=max_num_batched_tokens,
        max_requests_per_batch=max_num_seqs,
        num_blocks=math.ceil(kv_tokens / page_size),  # the same KV capacity as jaxpage's pool
    )
    hints = WorkloadHints(
        max_prompt_length=max(len(r["prompt_token_ids"]) for r in rows),
        max_generated_length=max(r["max_tokens"] for r in rows),
        num_requests=len(rows),
    )
    config = GenerationConfig(do_sample=False, max_new_tokens=max(r["max_tokens"] for r in rows), eos_token_id=-1)
    outputs: dict[str, list[int]] = {}
    errors: dict[str, str] = {}
    attn_before = hf.config._attn_implementation
    log("hf_continuous: starting the manager (not timed)")
    setup_start = time.perf_counter()
    with (
        torch.inference_mode(),
        hf.continuous_batching_context_manager(
            generation_config=config, continuous_batching_config=cb_config, workload_hints=hints, block=True
        ) as manager,
    ):
        setup_s = time.perf_counter() - setup_start
        attn_used = hf.config._attn_implementation
        log(f"hf_continuous: manager ready in {setup_s:.1f}s (attn {attn_used})")
        warmup = [row | {"id": f"warmup-{row['id']}"} for row in warmup_rows]
        if warmup:
            warmup_start = time.perf_counter()
            _collect(manager, warmup, {}, errors)
            log(f"hf_continuous: {len(warmup)} warm-up requests in {time.perf_counter() - warmup_start:.1f}s")
        log(f"hf_continuous: queuing {len(rows)} requests")
        cpu_start, start = cpu_seconds(), time.perf_counter()
        _collect(manager, rows, outputs, errors)
        wall_s = time.perf_counter() - start
        load = machine_load(cpu_seconds() - cpu_start, wall_s)
        resolved = manager.continuous_batching_config
    if errors:
        first = next(iter(errors.items()))
        raise SystemExit(f"hf_continuous: {len(errors)} requests failed, e.g. {first}")
    tokens = sum(len(t) for t in outputs.values())
    return {
        "output_tokens": tokens,
        "wall_s": round(wall_s, 3),
        "output_tokens_per_s": round(tokens / wall_s, 2),
        "setup_s": round(setup_s, 2),
        "warmup_requests": len(warmup),
        "attn_implementation": attn_used,
        "attn_implementation_loaded": attn_before,
        "page_size": cb_page_size(resolved),
        "num_blocks": resolved.num_blocks,
        "max_batch_tokens": resolved.max_batch_tokens,
        "max_requests_per_batch": resolved.max_requests_per_batch,
        **load,
    }, outputs


def _collect(manager, rows: list[dict], outputs: dict[str, list[int]], errors: dict[str, str]) -> None:
    """Queues `rows` on a running continuous-batching manager and waits for every one of them to finish, into outputs
    (request id -> tokens) or errors (request id -> message)."""
    for row in rows:
        manager.add_request(
            row["prompt_token_ids"], request_id=row["id"], max_new_tokens=row["max_tokens"], eos_token_id=-1
        )
    start = last_report = time.perf_counter()
    done = 0
    while done < len(rows):
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise SystemExit("hf_continuous: the generation thread stopped before every request finished")
        elif result.is_finished():
            done += 1
            if result.error is not None:
                errors[result.request_id] = str(result.error)
            else:
                outputs[result.request_id] = list(result.generated_tokens)
        now = time.perf_counter()
        if now - last_report > 10:
            log(f"hf_continuous: {done}/{len(rows)} done, {now - start:.0f}s")
            last_report = now
