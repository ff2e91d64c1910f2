"""Every program jaxpage's warm-up compiles, built for a chip this host does not have, with a report on each.

    python scripts/compile_for.py --target tpu-v5e --model default
    python scripts/compile_for.py --target gpu-h200 --model llama3-8b --kv-cache-dtype int8
    python scripts/compile_for.py --target tpu-v6e:2x4 --model llama3-8b --tensor-parallel-size 8
    python scripts/compile_for.py --target gpu-h100 --model default --num-speculative-tokens 3 --draft-model default
    python scripts/compile_for.py --target gpu-h200 --model llama3-8b --enable-lora --max-loras 4 --max-lora-rank 16
    python scripts/compile_for.py --target tpu-v5e --model default --batch-invariant
    python scripts/compile_for.py --target gpu-h200 --pooling-model bge-base --max-num-batched-tokens 2048

Targets (jaxpage.targets): tpu-v5e, tpu-v6e, tpu-v5p (needs libtpu: pip install 'jaxpage[tpu]'), gpu-h100, gpu-h200
(needs jax's CUDA plugin, and CUDA's ptxas and cuobjdump for the kernel report: pip install 'jaxpage[compile]');
":TOPOLOGY" picks the compile-only topology whose first devices are used (default: the smallest that holds the
mesh). The model is a shape, not weights: "default" (the default model's config, read from its GGUF), "llama3-8b",
or a model source's config. The KV pool is sized as the engine sizes it on that chip: gpu_memory_utilization of the
chip's HBM less the weights a device holds (and the LoRA adapters' slots, with --enable-lora).

For each program (the pool's fill, each forward step shape, each sampler or verification, the page copy, the LoRA slot
fill, a draft model's forward passes and proposals): compiled or the compiler's error, compile seconds, the compiler's
memory analysis per device (arguments, outputs, temporaries, code), its cost analysis (FLOPs and bytes accessed; XLA's
GPU compiler gives none), the collectives one run executes, and any copy of a KV pool or of a dynamic slice as large as
one layer's smallest weight matrix in the optimized HLO.

On a GPU, under each forward pass (and a draft model's proposals), a row for each of jaxpage's Pallas kernels in it
(jaxpage.benchmarks.gpu_kernels: XLA's dump of that compile, the kernel's PTX assembled by ptxas and disassembled by
cuobjdump; no device): launches x name, grid, threads per block, registers per thread, stack frame and spill stores
/ loads (bytes per thread), shared memory per block, blocks an SM holds at once, and instructions in its SASS (each
counted once, not as often as it runs): products on the tensor cores (HMMA, HGMMA; IMMA, QGMMA of 8-bit data) and
float32 FFMAs, local memory (LDL, STL), global loads by width in bits, cp.async (LDGSTS) and TMA (UTMALDG / UBLKCP).

With --pooling-model (a pooling model's shape: all-minilm-l6, bge-base, bge-m3, or a model directory, an encoder's or
a decoder embedder's), the programs a PoolingEngine compiles instead: one step per token bucket (its inputs packed end
to end, no KV pool), checked for compiling, no layer's weights copied, and fitting the chip.

Then the checks: every program compiled; no KV pool copied; no layer's weights copied (XLA's GPU compiler copies each
layer's weights out of a scan over stacked layers: the model unrolls its layers there); no temporary as large as a pool;
in the batch-invariant mode, no fusion that joins a row tile's ops with the ops around it; the pool's compiled bytes
within 2% of the engine's budget arithmetic; with tensor parallelism, the collectives Megatron needs (2 all-reduces per
layer and 1 for the embedding in a forward pass, the logits' all-gather in a sampler, or an all-reduce of one row's);
per-device memory (weights, LoRA slots, pool, the largest temporary) within the chip's HBM; on a GPU, no kernel with a
stack frame (spills or local arrays), and the kernels' products on the tensor cores for a model of 16-bit floats or an
8-bit pool (a float32 model with a float32 pool multiplies in float32 FFMAs by design: reported, not checked). And the
decode step's roofline ESTIMATE at batch 1 and 64 (max(bytes / HBM bandwidth, FLOPs / peak), the chip's published
figures; a compiler estimate, not a measurement). Exits 1 when a check fails. --json writes the whole report.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this host runs nothing: the targets' compilers need no backend

MIB = 1 << 20
KIB = 1 << 10


def parse_args(argv=None):
    from jaxpage.config import EngineConfig
    from jaxpage.targets import TARGETS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help=f"one of {', '.join(TARGETS)}, optionally :TOPOLOGY")
    parser.add_argument("--model", default="default", help="default, llama3-8b, or a model source's path")
    parser.add_argument("--dtype", choices=EngineConfig.DTYPES, default=None, help="default bfloat16")
    parser.add_argument("--quantization", choices=(None, "int8"), default=None)
    parser.add_argument("--kv-cache-dtype", choices=EngineConfig.KV_CACHE_DTYPES, default="auto")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--data-parallel-size", type=int, default=1)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens)
    parser.add_argument("--page-size", type=int, default=EngineConfig.page_size)
    parser.add_argument("--num-pages", type=int, default=None, help="default: sized from the chip's memory")
    parser.add_argument("--gpu-memory-utilization", type=float, default=EngineConfig.gpu_memory_utilization)
    parser.add_argument("--num-speculative-tokens", type=int, default=0, help="adds the verify steps")
    parser.add_argument("--draft-model", default=None, help="a draft model's shape (with --num-speculative-tokens)")
    parser.add_argument("--enable-lora", action="store_true", help="LoRA adapters' slots and their fill program")
    parser.add_argument("--max-loras", type=int, default=EngineConfig.max_loras, help="LoRA slots (--enable-lora)")
    parser.add_argument("--max-lora-rank", type=int, default=EngineConfig.max_lora_rank, help="their rank")
    parser.add_argument(
        "--batch-invariant", action="store_true", help="the batch-invariant mode: row-tiled products, XLA attention"
    )
    parser.add_argument(
        "--kv-offload-gib", type=float, default=None, help="the prefix cache's host tier: adds its offload and load"
    )
    parser.add_argument("--context", type=int, default=1024, help="tokens per sequence in the roofline estimate")
    parser.add_argument("--pooling-model", default=None, help="a pooling model's shape or directory (see above)")
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args(argv)
    if args.draft_model and not args.num_speculative_tokens:
        parser.error("--draft-model needs --num-speculative-tokens")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from jaxpage import aot
    from jaxpage.benchmarks import gpu_kernels
    from jaxpage.config import EngineConfig
    from jaxpage.targets import get_target

    name, _, topology = args.target.partition(":")
    try:
        target = get_target(name)
        engine = EngineConfig(
            dtype=args.dtype,
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            max_model_len=args.max_model_len,
            page_size=args.page_size,
            num_pages=args.num_pages,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            gpu_memory_utilization=args.gpu_memory_utilization,
            tensor_parallel_size=args.tensor_parallel_size,
            data_parallel_size=args.data_parallel_size,
            enable_lora=args.enable_lora,
            max_loras=args.max_loras,
            max_lora_rank=args.max_lora_rank,
            batch_invariant=args.batch_invariant,
            kv_offload_bytes=None if args.kv_offload_gib is None else int(args.kv_offload_gib * 2**30),
            compilation_cache_dir=None,
        )
        if topology:
            target = dataclasses.replace(target, fixed_topology=topology)
        if args.pooling_model:
            return compile_pooling(target, aot.pooling_model_shape(args.pooling_model), engine, args)
        model = aot.model_shape(args.model)
        draft = aot.model_shape(args.draft_model) if args.draft_model else None
        tools = gpu_kernels.find_tools() if target.platform == "gpu" else {}
        tools = {name: {"path": path, "version": tool_release(path)} for name, path in tools.items()}
        start = time.perf_counter()
        build = aot.build(target, engine, model, draft, args.num_speculative_tokens)
    except (ValueError, ImportError, RuntimeError) as e:  # RuntimeError: a compiler or a tool that cannot start
        print(f"compile_for.py: error: {e}", file=sys.stderr)
        return 2
    print_header(build, args, tools)
    print(f"{'program':<44} {'s':>6} {'args MiB':>9} {'out MiB':>8} {'temp MiB':>9} {'GFLOP':>9} {'GB read':>8}")
    if tools:
        print(KERNEL_HEADER)
    aot.compile_all(build, on_program=print_program)
    total_s = time.perf_counter() - start
    checks = run_checks(build)
    roofs = [aot.build_roofline(build, rows, args.context) for rows in (1, 64)]
    print_summary(build, checks, roofs, total_s)
    if args.json:
        write_json(args.json, build, checks, roofs, total_s, tools)
    return 0 if all(ok for _, ok, _ in checks) else 1


def compile_pooling(target, config, engine, args) -> int:
    """--pooling-model: a PoolingEngine's step programs for the target, with the checks that concern them."""
    from jaxpage import aot

    print(f"target {target.name}, pooling model {args.pooling_model}: {config.num_layers} layers, hidden "
          f"{config.hidden_size}; max_num_seqs {engine.max_num_seqs}, max_num_batched_tokens "
          f"{engine.max_num_batched_tokens}")  # fmt: skip
    print(f"{'program':<44} {'s':>6} {'args MiB':>9} {'out MiB':>8} {'temp MiB':>9} {'GFLOP':>9} {'GB read':>8}")
    start = time.perf_counter()
    programs, weight_bytes = aot.compile_pooling(target, config, engine, on_program=print_program)
    failed = [p.program for p in programs if not p.compiled]
    copies = [p.program for p in programs if p.weight_copies]
    peak = weight_bytes + max((p.temp_bytes for p in programs), default=0)
    checks = [
        ("every program compiled", not failed, ", ".join(failed) or f"{len(programs)} programs"),
        ("no layer's weights copied", not copies, ", ".join(copies) or "none as large as a layer's"),
        ("weights + largest temporary fit the chip", peak <= target.hbm_bytes, f"{peak / MIB:,.0f} MiB"),
    ]
    print(f"\n{len(programs) - len(failed)}/{len(programs)} programs compiled in {time.perf_counter() - start:.1f}s")
    for name, ok, detail in checks:
        print(f"  [{'ok' if ok else 'FAILED'}] {name}: {detail}")
    if args.json:
        report = {"target": target.name, "pooling_model": args.pooling_model, "weight_bytes": weight_bytes,
                  "programs": [dataclasses.asdict(p) for p in programs],
                  "checks": [{"check": n, "passed": ok, "detail": d} for n, ok, d in checks]}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0 if all(ok for _, ok, _ in checks) else 1


def print_header(build, args, tools) -> None:
    m, e = build.model, build.engine
    print(
        f"target {build.target.name} ({build.runners[0].mesh.devices.size if build.runners[0].mesh else 1} device(s) "
        f"of {build.target.devices(1)[0].device_kind}), {build.backend.name} attention, {build.dtype.name} weights"
        f"{' int8' if e.quantization else ''}, KV {e.kv_cache_dtype}, TP {e.tensor_parallel_size} x DP "
        f"{e.data_parallel_size}{', batch-invariant' if e.batch_invariant else ''}"
    )
    print(
        f"model {args.model}: {m.num_layers} layers, {m.num_heads} heads / {m.num_kv_heads} KV heads x {m.head_dim}, "
        f"vocab {m.vocab_size}; max_model_len {build.max_model_len}, max_num_seqs {e.max_num_seqs}, "
        f"max_num_batched_tokens {e.max_num_batched_tokens}"
    )
    lora = ""
    if e.enable_lora:
        lora = f"; LoRA slots ({e.max_loras} of rank {e.max_lora_rank}) {build.lora_bytes / MIB:,.1f} MiB"
    print(
        f"per device: weights {build.weight_bytes / MIB:,.0f} MiB{lora}; KV {build.kv_token_bytes} bytes/token, "
        f"{build.num_pages:,} pages of {e.page_size} = {build.pool_bytes / MIB:,.0f} MiB by the budget arithmetic "
        f"(HBM {build.target.hbm_bytes / MIB:,.0f} MiB x {e.gpu_memory_utilization})"
    )
    if tools:
        print("kernels read with " + ", ".join(f"{name} ({tool['version']})" for name, tool in tools.items()))


def tool_release(path: str) -> str:
    from jaxpage.benchmarks.gpu_kernels import tool_version

    return tool_version(path).split(", ", 1)[-1]  # "release 12.9, V12.9.86"


# A GPU kernel's row, under its program: launches x name, grid, threads per block, registers per thread, stack frame
# and spills (bytes per thread), shared memory per block, blocks per SM, tensor-core products, float32 FMAs, local
# loads and stores, global loads by width (8/16/32/64/128 bits), cp.async, TMA loads / bulk copies (SASS counts).
KERNEL_HEADER = (
    f"  {'kernel':<34} {'grid':>14} {'block':>5} {'regs':>4} {'stack':>6} {'spill st/ld':>13} {'smem KiB':>8} "
    f"{'blk/SM':>6} {'tensor-core MMA':>15} {'FFMA':>6} {'LDL':>5} {'STL':>5} {'LDG 8/16/32/64/128':>18} "
    f"{'LDGSTS':>6} {'TMA':>5}"
)


def kernel_line(k) -> str:
    """A kernel's row (KERNEL_HEADER's columns)."""
    from jaxpage.benchmarks.gpu_kernels import LOAD_WIDTHS, TENSOR_CORE_MMA

    mma = "+".join(f"{k.sass[op]} {op}" for op in TENSOR_CORE_MMA if k.sass[op]) or "0"
    loads = "/".join(str(k.sass[op]) for op in LOAD_WIDTHS)
    grid, threads = "x".join(map(str, k.grid)), k.threads[0] * k.threads[1] * k.threads[2]
    spills, tma = f"{k.spill_store_bytes}/{k.spill_load_bytes}", f"{k.sass['UTMALDG']}/{k.sass['UBLKCP']}"
    line = (
        f"  {f'{k.count} x {k.name}':<34} {grid:>14} {threads:>5} {k.registers:>4} {k.stack_bytes:>6} {spills:>13} "
        f"{k.shared_bytes / KIB:>8.1f} {k.blocks_per_sm:>6} {mma:>15} {k.sass['FFMA']:>6} {k.sass['LDL']:>5} "
        f"{k.sass['STL']:>5} {loads:>18} {k.sass['LDGSTS']:>6} {tma:>5}"
    )
    return line + (f"  (one of {k.codes} codes of this name)" if k.codes > 1 else "")


def print_program(report) -> None:
    if not report.compiled:
        print(f"{report.program:<44} {report.seconds:6.1f}  FAILED: {report.error.splitlines()[0][:300]}")
        return
    flops = "-" if report.flops is None else f"{report.flops / 1e9:.2f}"
    read = "-" if report.bytes_accessed is None else f"{report.bytes_accessed / 1e9:.3f}"
    args, out, temp = (report.argument_bytes / MIB, report.output_bytes / MIB, report.temp_bytes / MIB)
    line = f"{report.program:<44} {report.seconds:6.1f} {args:9.1f} {out:8.1f} {temp:9.1f} {flops:>9} {read:>8}"
    if report.collectives:
        line += "  " + ", ".join(f"{n} {kind}" for kind, n in report.collectives.items())
    print(line, flush=True)
    for copy in report.pool_copies:
        print(f"    POOL COPY: {copy[:200]}")
    for copy in report.weight_copies:
        print(f"    WEIGHT COPY: {copy[:200]}")
    if report.row_tile_fusions:
        print(f"    FUSED ACROSS A ROW TILE: {', '.join(report.row_tile_fusions)[:200]}")
    for kernel in report.kernels or ():
        print(kernel_line(kernel))


def run_checks(build) -> list[tuple[str, bool, str]]:
    """(check, passed, detail) for each of the script's checks (see the module docstring)."""
    from jaxpage.worker.kv_pool import POOL_BYTES_TOLERANCE

    programs = build.programs
    failed = [p.program for p in programs if not p.compiled]
    copies = [p.program for p in programs if p.pool_copies]
    weight_copies = [p.program for p in programs if p.weight_copies]
    tile_fusions = [p.program for p in programs if p.row_tile_fusions]
    big_temps = [
        f"{p.program} ({p.temp_bytes / MIB:,.0f} MiB)" for p in programs if p.temp_bytes >= build.pool_array_bytes
    ]
    compiled_pool = build.compiled_pool_bytes
    checks = [
        ("every program compiled", not failed, ", ".join(failed) or f"{len(programs)} programs"),
        ("no KV pool copied", not copies, ", ".join(copies) or "no copy or transpose of a pool-sized array"),
        ("no layer's weights copied", not weight_copies, ", ".join(weight_copies) or "none as large as a layer's"),
        ("no temporary as large as a pool", not big_temps, ", ".join(big_temps) or "none"),
    ]
    if build.model.batch_invariant:
        detail = ", ".join(tile_fusions) or "each tile's ops fused with none around them"
        checks.append(("no fusion across a row tile (batch-invariant)", not tile_fusions, detail))
    if compiled_pool is not None:
        ratio = compiled_pool / build.pool_bytes
        detail = f"{compiled_pool / MIB:,.1f} MiB compiled / {build.pool_bytes / MIB:,.1f} MiB arithmetic = {ratio:.4f}"
        checks.append(("pool bytes within 2% of the budget arithmetic", abs(ratio - 1) <= POOL_BYTES_TOLERANCE, detail))
    weights = build.weight_bytes + build.lora_bytes  # the LoRA slots too
    peak = weights + (compiled_pool or build.pool_bytes) + max((p.temp_bytes for p in programs), default=0)
    detail = f"{peak / MIB:,.0f} MiB of {build.target.hbm_bytes / MIB:,.0f} MiB"
    checks.append(("weights + pool + largest temporary fit the chip", peak <= build.target.hbm_bytes, detail))
    if build.engine.tensor_parallel_size > 1:
        checks.append(collectives_check(build))
    return checks + kernel_checks(build)


def kernel_checks(build) -> list[tuple[str, bool, str]]:
    """On a GPU: no kernel with a stack frame; products on the tensor cores, unless the model and its pool are both
    float32 (then reported only). A forward pass without a report, or with the Pallas backend without a kernel,
    fails both."""
    from jaxpage import aot

    programs = [p for p in build.programs if p.compiled and p.kind in aot.KERNEL_KINDS]
    if build.target.platform != "gpu" or not programs:
        return []
    pallas = build.backend.name == "pallas_gpu"
    missing = [p.program for p in programs if p.kernels is None or (pallas and not p.kernels)]
    unreported = f"no kernel report for {', '.join(missing)}; " if missing else ""
    launches = sum(len(p.kernels or ()) for p in programs)
    stacked = kernels_where(programs, lambda k: k.stack_bytes > 0)
    detail = "; ".join(
        f"{name}: {k.stack_bytes} B stack frame, {k.spill_store_bytes}/{k.spill_load_bytes} B spill stores/loads "
        f"(the largest, of {configurations(n)})"
        for name, (k, n) in stacked.items()
    )
    detail = unreported + (detail or f"{launches} kernel launch configurations, none")
    checks = [("GPU kernels: no stack frame (spills)", not missing and not stacked, detail)]
    off = kernels_where(programs, lambda k: k.tensor_core_mma == 0)
    detail = "; ".join(
        f"{name}: no tensor-core MMA, {k.sass['FFMA']} FFMA ({configurations(n)})" for name, (k, n) in off.items()
    )
    check = "GPU kernels: products on the tensor cores"
    if build.dtype.name != "float32" or build.engine.kv_cache_dtype != "auto":
        detail = unreported + (detail or f"all {launches} kernel launch configurations")
        checks.append((check, not missing and not off, detail))
    else:
        detail = f"float32 model and pool: float32 products by design, not checked ({detail or 'none off them'})"
        checks.append((check, True, detail))
    return checks


def configurations(n: int) -> str:
    return f"{n} launch configuration{'s' if n > 1 else ''}"


def kernels_where(programs, bad) -> dict:
    """{kernel name: (the report with the largest stack frame of those for which bad(report), how many)}."""
    found = {}
    for k in (k for p in programs for k in p.kernels or () if bad(k)):
        worst, n = found.get(k.name, (k, 0))
        found[k.name] = (max(worst, k, key=lambda r: r.stack_bytes), n + 1)
    return found


def collectives_check(build) -> tuple[str, bool, str]:
    """Megatron's collectives: 2 all-reduces per layer + 1 for the embedding in every forward pass of the target
    model, and an all-gather of the logits in every sampler (with logits processors or not) and prompt log-probs (of
    one row's logits XLA may make an all-reduce)."""
    layers = build.model.num_layers
    wrong = []
    for p in build.programs:
        if not p.compiled or "draft" in p.program:
            continue
        if p.kind == "forward" and p.collectives.get("all-reduce") != 2 * layers + 1:
            wrong.append(f"{p.program}: {p.collectives}")
        logits = p.kind.split("+")[0] in ("sample", "verify", "prompt_logprobs")  # an LM head over the shards
        if logits and p.collectives.get("all-gather", 0) + p.collectives.get("all-reduce", 0) < 1:
            wrong.append(f"{p.program}: {p.collectives}")
    detail = "; ".join(wrong) or f"forward: {2 * layers + 1} all-reduces, samplers: the logits' all-gather"
    return ("tensor-parallel collectives as designed", not wrong, detail)


def print_summary(build, checks, roofs, total_s) -> None:
    compiled = [p for p in build.programs if p.compiled]
    print(f"\n{len(compiled)}/{len(build.programs)} programs compiled in {total_s:.1f}s")
    for name, ok, detail in checks:
        print(f"  [{'ok' if ok else 'FAILED'}] {name}: {detail}")
    for roof in roofs:
        print(
            f"  decode step ESTIMATE (roofline, not measured), batch {roof.rows} at {roof.context} tokens each: "
            f"{roof.seconds * 1e3:.3f} ms ({roof.bytes / 1e9:.2f} GB / {build.target.hbm_bandwidth / 1e12:.2f} TB/s "
            f"= {roof.hbm_seconds * 1e3:.3f} ms; {roof.flops / 1e12:.3f} TFLOP / {build.target.peak_flops / 1e12:.0f} "
            f"TFLOP/s = {roof.compute_seconds * 1e3:.3f} ms)"
        )


def write_json(path, build, checks, roofs, total_s, tools) -> None:
    report = {
        "target": build.target.name,
        "kernel_tools": tools,
        "engine": {k: v for k, v in dataclasses.asdict(build.engine).items() if k != "speculative_config"},
        "model": dataclasses.asdict(build.model),
        "weight_bytes_per_device": build.weight_bytes,
        "lora_bytes_per_device": build.lora_bytes,
        "kv_bytes_per_token_per_device": build.kv_token_bytes,
        "num_pages": build.num_pages,
        "pool_bytes_arithmetic": build.pool_bytes,
        "pool_bytes_compiled": build.compiled_pool_bytes,
        "compile_seconds": total_s,
        "programs": [dataclasses.asdict(p) for p in build.programs],
        "checks": [{"check": c, "passed": ok, "detail": d} for c, ok, d in checks],
        "decode_roofline_estimates": [dataclasses.asdict(r) | {"seconds": r.seconds} for r in roofs],
    }
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
