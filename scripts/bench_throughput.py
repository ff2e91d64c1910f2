"""Offline throughput of jaxpage against Hugging Face transformers, on one mixed-length workload.

    python scripts/bench_throughput.py [--workload FILE.jsonl] [--model SRC] [--num-requests 64]
        [--write-workload FILE.jsonl] [--max-num-batched-tokens 512] [--max-num-seqs 64] [--max-model-len N]
        [--hf-batch-size 16] [--skip-hf-static] [--skip-hf-continuous] [--seed 0] [--plot FILE.png]

A workload is a JSONL file of rows {"id", "prompt_token_ids", "max_tokens"}. Without --workload one is made:
--num-requests requests whose prompts are windows, at seeded random offsets, of a varied text (the docstrings of a
fixed list of Python standard-library modules, tokenized with the model's tokenizer), prompt lengths uniform in
16..512 and max_tokens uniform in 16..256 (seed --seed); --write-workload saves it. Every request is generated
greedily to exactly its max_tokens (EOS ignored), by three systems on the same weights, one after the other:

  jaxpage        LLMEngine: add_request for every row, then engine.step() until done. Warm-up (engine.warmup(),
                 which compiles every step shape) runs first and is not timed; compilations during the timed run are
                 counted (must be 0). After every step the KV utilization (block_manager.kv_utilization(): filled
                 slots / slots of referenced pages), the pages in use and the requests in the step are sampled
                 while requests hold pages; --plot draws them over the run (matplotlib).
  hf_static      model.generate() over padded static batches of --hf-batch-size rows in workload order: left
                 padding, greedy, EOS disabled, max_new_tokens = the batch's largest max_tokens. Only each row's own
                 max_tokens count as useful output tokens; the extra tokens a row generates are waste.
  hf_continuous  transformers' continuous batching: model.continuous_batching_context_manager(...) and
                 manager.add_request(ids, request_id=..., max_new_tokens=<the row's>, eos_token_id=-1), results
                 read with manager.get_result(); same token budget, row limit and KV capacity as jaxpage.

Model FLOPs of a step: 2 x (the layers' weights, per token) x tokens + 2 x hidden x vocab x sampled rows (the LM
head runs on those only) + 4 x layers x heads x head_dim x query-key pairs (causal attention). Their rate over the
decode steps (every sequence of the step decodes) is printed against the float32 matmul rate of this machine,
measured in the same run (a 2048 x 2048 x 2048 jnp.dot).

Throughput is useful output tokens (the sum of the rows' max_tokens) / wall time from the first request queued to
the last token back. The HF model is loaded in float32 (a GGUF file is dequantized by transformers, as jaxpage
does); torch keeps its default thread count. Each system also reports the cores this process kept busy and the
1-minute load average after it: other work on the machine lowers the figures, so compare runs on an idle machine.
Outputs are compared too (greedy agreement with jaxpage). Progress goes to stderr; a table and, as the last line,
one JSON object with every figure go to stdout.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import statistics
import time
from pathlib import Path

from jaxpage.benchmarks.hf_baselines import hf_source, load_hf_baseline, run_hf_continuous, run_hf_static
from jaxpage.benchmarks.measure import copy_bandwidth, cpu_seconds, machine_load, matmul_flops_per_s
from jaxpage.benchmarks.progress import log
from jaxpage.benchmarks.workloads import describe, make_workload, read_workload, write_workload

# ----- jaxpage -----


def run_jaxpage(model: str | None, rows: list[dict], args) -> tuple[dict, dict[str, list[int]]]:
    import jax

    from jaxpage.entrypoints.llm import LLM
    from jaxpage.sampling_params import SamplingParams

    log("jaxpage: loading the model")
    start = time.perf_counter()
    llm = LLM(
        model,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    engine = llm.engine
    load_s = time.perf_counter() - start
    runner, bm = engine.runner, engine.block_manager
    log(f"jaxpage: loaded in {load_s:.1f}s; warming up {len(runner.shapes)} step shapes")
    start = time.perf_counter()
    for compiled in engine.warmup():
        log(f"jaxpage:   compiled {compiled}")
    warmup_s = time.perf_counter() - start
    compilations_warmup = runner.num_compilations
    log(f"jaxpage: warm-up took {warmup_s:.1f}s, {compilations_warmup} programs compiled")

    utilization: list[float] = []
    used_pages: list[int] = []
    sample_s: list[float] = []
    running: list[int] = []
    step_times: list[float] = []
    step_stats = []
    outputs: dict[str, list[int]] = {}
    total = len(rows)
    cpu_start, start = cpu_seconds(), time.perf_counter()
    for row in rows:
        params = SamplingParams(temperature=0, max_tokens=row["max_tokens"], ignore_eos=True)
        engine.add_request(row["id"], {"prompt_token_ids": row["prompt_token_ids"]}, params)
    last_report = start
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        now = time.perf_counter()
        step_times.append(now - step_start)
        step_stats.append(engine.last_step_stats)
        if bm.num_used_pages:  # requests still hold pages (after the last step none does: utilization is moot)
            utilization.append(bm.kv_utilization())
            used_pages.append(bm.num_used_pages)
            sample_s.append(now - start)
            running.append(engine.last_step_stats.num_seqs)
        if now - last_report > 10:
            log(f"jaxpage: {len(outputs)}/{total} done, {len(step_times)} steps, {now - start:.0f}s")
            last_report = now
    wall_s = time.perf_counter() - start
    load = machine_load(cpu_seconds() - cpu_start, wall_s)
    params = runner.params
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    if not engine.model_config.tie_word_embeddings:
        weight_bytes -= params["embed_tokens"]["embedding"].nbytes
    kv_token_bytes = engine.attention_backend.kv_bytes_per_token(engine.model_config, runner.dtype.itemsize)
    if args.plot:
        from jaxpage.benchmarks.kv_plot import plot_kv_run

        title = f"jaxpage, {total} requests, KV pool of {bm.num_pages - 1} pages"
        plot_kv_run(args.plot, sample_s, utilization, running, used_pages, bm.num_pages - 1, title=title)
        log(f"jaxpage: plot written to {args.plot}")
    compilations_run = runner.num_compilations - compilations_warmup
    tokens = sum(len(t) for t in outputs.values())
    log(f"jaxpage: {tokens} tokens in {wall_s:.1f}s, {len(step_times)} steps, {compilations_run} compilations")
    result = {
        "output_tokens": tokens,
        "wall_s": round(wall_s, 3),
        "output_tokens_per_s": round(tokens / wall_s, 2),
        "load_s": round(load_s, 2),
        "warmup_s": round(warmup_s, 2),
        "compilations_warmup": compilations_warmup,
        "compilations_after_warmup": compilations_run,
        "kv_utilization_mean": round(statistics.mean(utilization), 4) if utilization else None,
        "kv_utilization_min": round(min(utilization), 4) if utilization else None,
        "kv_peak_pages_in_use": max(used_pages, default=0),
        "kv_pool_pages": bm.num_pages - 1,
        "page_size": bm.page_size,
        "steps": len(step_times),
        "step_ms_median": round(1000 * statistics.median(step_times), 2),
        "step_ms_p90": round(1000 * statistics.quantiles(step_times, n=10)[-1], 2) if len(step_times) > 1 else None,
        "step_ms_max": round(1000 * max(step_times), 2),
        "steps_by_shape": steps_by_shape(step_stats),
        **decode_flops(engine.model_config, step_stats, weight_bytes, kv_token_bytes),
        "host_fraction_all_steps": round(
            sum(s.host_s for s in step_stats) / sum(s.host_s + s.device_s for s in step_stats), 4
        ),
        "preemptions": engine.scheduler.num_preemptions,
        "max_model_len": engine.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        **load,
    }
    del llm, engine, runner
    gc.collect()
    return result, outputs


def step_flops(config, stats) -> int:
    """Useful model FLOPs of one engine step (see the module docstring)."""
    c = config
    layer_weights = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim  # q, k, v
    layer_weights += c.num_heads * c.head_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size  # o, mlp
    return (
        2 * c.num_layers * layer_weights * stats.num_tokens
        + 2 * c.hidden_size * c.vocab_size * stats.num_sampled
        + 4 * c.num_layers * c.num_heads * c.head_dim * stats.num_attended_keys
    )


def decode_flops(config, stats: list, weight_bytes: int, kv_token_bytes: int) -> dict:
    """FLOP rate over the steps where every sequence decodes, with their host share, and what those steps must
    read: every weight once (the embedding table is the LM head when tied; otherwise only its rows are read) and
    K and V of every attended key."""
    decode = [s for s in stats if s.num_decodes == s.num_seqs]
    seconds = sum(s.host_s + s.device_s for s in decode)
    flops = sum(step_flops(config, s) for s in decode)
    read_bytes = sum(weight_bytes + s.num_attended_keys * kv_token_bytes for s in decode)
    return {
        "decode_flops": flops,
        "decode_bytes_read": read_bytes,
        "decode_steps": len(decode),
        "decode_seconds": round(seconds, 2),
        "decode_mean_seqs": round(statistics.mean(s.num_seqs for s in decode), 1) if decode else None,
        "decode_gflop_per_s": round(flops / seconds / 1e9, 1) if seconds else None,
        "decode_host_fraction": round(sum(s.host_s for s in decode) / seconds, 4) if seconds else None,
    }


def steps_by_shape(stats: list) -> dict[str, dict]:
    """Per step shape: steps, total seconds, mean sequences, mean host and device milliseconds per step."""
    groups: dict[str, list] = {}
    for s in stats:
        groups.setdefault(s.shape, []).append(s)
    return {
        shape: {
            "steps": len(g),
            "seconds": round(sum(s.host_s + s.device_s for s in g), 2),
            "mean_seqs": round(statistics.mean(s.num_seqs for s in g), 1),
            "mean_tokens": round(statistics.mean(s.num_tokens for s in g), 1),
            "host_ms": round(1000 * statistics.mean(s.host_s for s in g), 2),
            "device_ms": round(1000 * statistics.mean(s.device_s for s in g), 2),
        }
        for shape, g in sorted(groups.items())
    }


# ----- report -----


def agreement(a: dict[str, list[int]], b: dict[str, list[int]]) -> dict:
    """How far greedy outputs agree: requests identical, and the mean fraction of leading tokens that match."""
    prefix_fractions, identical = [], 0
    for rid, tokens in a.items():
        other = b.get(rid, [])
        n = 0
        while n < min(len(tokens), len(other)) and tokens[n] == other[n]:
            n += 1
        prefix_fractions.append(n / max(len(tokens), 1))
        identical += tokens == other
    return {"identical_requests": identical, "mean_common_prefix_fraction": round(statistics.mean(prefix_fractions), 4)}


def print_table(results: dict[str, dict]) -> None:
    header = f"{'system':<15}{'output tok':>12}{'wall s':>10}{'tok/s':>10}{'jaxpage/this':>14}{'cores busy':>12}"
    print(header)
    print("-" * len(header))
    jax_rate = results.get("jaxpage", {}).get("output_tokens_per_s")
    for name, r in results.items():
        ratio = f"{jax_rate / r['output_tokens_per_s']:.2f}x" if jax_rate and name != "jaxpage" else ""
        print(
            f"{name:<15}{r['output_tokens']:>12}{r['wall_s']:>10.1f}{r['output_tokens_per_s']:>10.1f}{ratio:>14}"
            f"{r['process_cores_busy']:>12.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", type=Path, help="JSONL rows {id, prompt_token_ids, max_tokens}")
    parser.add_argument("--model", help="HF directory or .gguf file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--write-workload", type=Path, help="save the workload used as JSONL")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, help="default: 1024, or the next power of two that fits")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--skip-hf-static", action="store_true")
    parser.add_argument("--skip-hf-continuous", action="store_true")
    parser.add_argument("--plot", type=Path, help="PNG of KV utilization and running requests over jaxpage's run")
    args = parser.parse_args()
    load_at_start = round(os.getloadavg()[0], 2)

    import jax
    import torch

    from jaxpage.tokenizers.tokenizer import load_tokenizer

    if args.workload:
        rows = read_workload(args.workload)
    else:
        rows = make_workload(load_tokenizer(args.model), args.num_requests, args.seed)
    if args.write_workload:
        write_workload(rows, args.write_workload)
        log(f"workload written to {args.write_workload}")
    workload = describe(rows)
    if args.max_model_len is None:
        args.max_model_len = max(1024, 1 << (workload["longest_request"] - 1).bit_length())
    log(f"workload: {workload}")

    run_hf = not (args.skip_hf_static and args.skip_hf_continuous)
    hf_path = hf_source(args.model) if run_hf else None
    results: dict[str, dict] = {}
    results["jaxpage"], jax_out = run_jaxpage(args.model, rows, args)
    j = results["jaxpage"]
    matmul_rate, bandwidth = matmul_flops_per_s(), copy_bandwidth(1 << 30)
    j["matmul_f32_gflop_per_s"] = round(matmul_rate / 1e9, 1)
    j["decode_fraction_of_matmul_rate"] = round(j["decode_gflop_per_s"] * 1e9 / matmul_rate, 3)
    # The most the decode steps could reach if every byte they must read came at the copy bandwidth.
    j["copy_bandwidth_gb_per_s"] = round(bandwidth / 1e9, 2)
    j["decode_roofline_gflop_per_s"] = round(j["decode_flops"] / (j["decode_bytes_read"] / bandwidth) / 1e9, 1)
    kv_tokens = results["jaxpage"]["kv_pool_pages"] * results["jaxpage"]["page_size"]
    hf_outputs = {}
    if run_hf:
        log("hf: loading the model")
        hf = load_hf_baseline(hf_path)
        if not args.skip_hf_static:
            results["hf_static"], hf_outputs["hf_static"] = run_hf_static(hf, rows, args.hf_batch_size)
        if not args.skip_hf_continuous:
            results["hf_continuous"], hf_outputs["hf_continuous"] = run_hf_continuous(
                hf, rows, args.max_num_batched_tokens, args.max_num_seqs, kv_tokens
            )

    summary = {
        "output_tokens_per_s": {name: r["output_tokens_per_s"] for name, r in results.items()},
        "ratios": {
            f"jaxpage/{name}": round(
                results["jaxpage"]["output_tokens_per_s"] / results[name]["output_tokens_per_s"], 3
            )
            for name in ("hf_continuous", "hf_static")
            if name in results
        },
        "kv_utilization": {
            key: results["jaxpage"][key]
            for key in ("kv_utilization_mean", "kv_utilization_min", "kv_peak_pages_in_use", "kv_pool_pages")
        },
        "compilations_after_warmup": results["jaxpage"]["compilations_after_warmup"],
        "decode": {
            key: results["jaxpage"][key]
            for key in (
                "decode_gflop_per_s",
                "matmul_f32_gflop_per_s",
                "decode_fraction_of_matmul_rate",
                "copy_bandwidth_gb_per_s",
                "decode_roofline_gflop_per_s",
                "decode_host_fraction",
                "host_fraction_all_steps",
            )
        },
        "wall_s": {name: r["wall_s"] for name, r in results.items()},
        "greedy_agreement_with_jaxpage": {name: agreement(jax_out, out) for name, out in hf_outputs.items()},
        "systems": results,
        "workload": {**workload, "source": str(args.workload) if args.workload else f"generated, seed {args.seed}"},
        "settings": {
            "model": args.model or "SmolLM2-135M-Instruct (default GGUF)",
            "max_model_len": args.max_model_len,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "hf_batch_size": args.hf_batch_size,
            "jax_backend": jax.default_backend(),
            "jax_version": jax.__version__,
            "torch_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "loadavg_1m_at_start": load_at_start,
            "torch_version": torch.__version__,
            "transformers_version": importlib.import_module("transformers").__version__,
            "dtype": "float32",
        },
        "notes": "output tokens = sum of rows' max_tokens (EOS ignored); hf_static pads each batch to its largest "
        "max_tokens and counts only each row's own max_tokens; warm-up and model loading are not timed",
    }
    print()
    print_table(results)
    j = results["jaxpage"]
    print(
        f"\njaxpage: warm-up {j['warmup_s']:.1f}s ({j['compilations_warmup']} compilations), "
        f"{j['compilations_after_warmup']} compilations after warm-up; KV utilization mean "
        f"{j['kv_utilization_mean']}, min {j['kv_utilization_min']}; peak {j['kv_peak_pages_in_use']} of "
        f"{j['kv_pool_pages']} pages in use; {j['steps']} steps, median {j['step_ms_median']} ms, "
        f"max {j['step_ms_max']} ms; {j['preemptions']} preemptions"
    )
    print(
        f"decode steps ({j['decode_steps']}, {j['decode_mean_seqs']} sequences on average): "
        f"{j['decode_gflop_per_s']} GFLOP/s of model FLOPs against {j['matmul_f32_gflop_per_s']} GFLOP/s for a "
        f"float32 matmul here ({j['decode_fraction_of_matmul_rate']:.0%}); the bytes they must read allow at most "
        f"{j['decode_roofline_gflop_per_s']} GFLOP/s at the {j['copy_bandwidth_gb_per_s']} GB/s copy bandwidth; "
        f"host {j['decode_host_fraction']:.1%} of their time, {j['host_fraction_all_steps']:.1%} over all steps"
    )
    for name, agree in summary["greedy_agreement_with_jaxpage"].items():
        print(f"greedy agreement jaxpage vs {name}: {agree}")
    print(f"torch threads: {torch.get_num_threads()}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
