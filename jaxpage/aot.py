"""The engine's programs built ahead of time for a chip this host does not have (jaxpage.targets).

`build(target, engine_config, model)` does what LLMEngine does at start -- the attention backend for the target's
platform, the mesh over its (compile-only) devices, the model's config as it runs (batch-invariant with the engine
argument), the model's parameters placed shard by shard, the KV pool sized from the chip's memory with the engine's own
arithmetic (jaxpage.worker.pool_sizing), the runner(s), with the LoRA adapters' device slots where the engine arguments
enable LoRA -- with ShapeDtypeStructs instead of arrays: no weights are read and nothing runs. `compile_all` then
compiles every program the engine's warm-up compiles (ModelRunner.warmup_programs: the pool's fill, each forward step
shape, each sampler or verification, the page copy, the LoRA slot fill, a draft model's forward passes and proposals),
each with the chip's real compiler, and reports on each (`ProgramReport`): compiled or the compiler's error, seconds,
memory, the compiler's cost analysis, collectives executed, and any copy of a KV pool; on a GPU target, each Pallas
kernel of the programs that run the model's layers (KERNEL_KINDS) too: its launch, registers, stack frame, shared
memory, blocks per SM and SASS (jaxpage.benchmarks.gpu_kernels, from a dump of that compile read with ptxas and
cuobjdump).

Estimates, not measurements: `decode_roofline` gives a decode step's time as max(bytes / HBM bandwidth, FLOPs /
peak) of the chip's published figures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import tempfile
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, SingleDeviceSharding

from jaxpage.attention import AttentionBackend, engine_backend
from jaxpage.benchmarks import gpu_kernels
from jaxpage.benchmarks.hlo_collectives import executed
from jaxpage.benchmarks.hlo_copies import large_copies, sliced_copies
from jaxpage.benchmarks.hlo_fusions import fusions_across_scope
from jaxpage.config import CacheConfig, EngineConfig, ModelConfig
from jaxpage.kv_cache import pool_groups
from jaxpage.models.batch_invariant import ROW_TILE_SCOPE, batch_invariant_config
from jaxpage.models.bert import EncoderConfig, init_encoder_params
from jaxpage.models.llama import param_shapes
from jaxpage.models.lora import slots_device_bytes
from jaxpage.models.pooling_model import pooling_model
from jaxpage.targets import Target
from jaxpage.worker.executor import make_runners
from jaxpage.worker.model_runner import ModelRunner
from jaxpage.worker.packed_steps import input_slots, max_step_tokens, step_shapes
from jaxpage.worker.parallel import (
    check_divisible,
    make_mesh,
    param_specs,
    splits_experts,
    with_expert_parallel,
    with_replicated_kv_heads,
)
from jaxpage.worker.pool_sizing import (
    addressable_pages,
    engine_window_pages,
    fit_max_model_len,
    kv_pool_pages,
    window_share,
)
from jaxpage.worker.pooling_runner import PoolingRunner

# Model shapes compile_for knows by name, besides the default model and model directories.
LLAMA3_8B = ModelConfig(
    architecture="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=8192,
    bos_token_id=128000,
    eos_token_ids=(128001, 128009),
)
MODEL_SHAPES = {"llama3-8b": LLAMA3_8B}
KERNEL_KINDS = ("forward", "propose")  # the programs that run the model's layers, and so its attention kernels


def model_shape(name: str) -> ModelConfig:
    """The config of a model by name ("default": the default model's, read from its GGUF; "llama3-8b"), or of a
    model source (an HF directory, a .gguf file, a jaxpage checkpoint): its shapes, no weights."""
    if name in MODEL_SHAPES:
        return MODEL_SHAPES[name]
    from jaxpage.models import gguf_loader, hf_loader, orbax_checkpoint
    from jaxpage.models.loader import resolve_source, source_format

    path = resolve_source(None if name == "default" else name)
    fmt = source_format(path)
    if fmt == "gguf":
        return gguf_loader.config_from_gguf(gguf_loader.open_gguf(path), path)
    if fmt == "orbax":
        return orbax_checkpoint.read_checkpoint_config(path)[0]
    return hf_loader.read_hf_config(path)


@dataclasses.dataclass(frozen=True)
class ProgramReport:
    """One program built for the target: what the chip's compiler made of it (bytes per device)."""

    program: str  # "forward decode(T=4, S=4, R=8)", "sample rows=8", "pool (...)", ...
    # CompiledShape.program: "pool", "forward", "sample", "verify" (+masks, +penalties: with logits processors),
    # "prompt_logprobs", "propose", "copy", "lora" (the LoRA slot fill)
    kind: str
    seconds: float  # lowering and compiling
    error: str | None = None  # the compiler's error; None: compiled
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0  # outputs that reuse a donated argument's memory (the pool)
    temp_bytes: int = 0
    code_bytes: int = 0
    flops: float | None = None  # the compiler's cost analysis (None where it gives none: XLA GPU)
    bytes_accessed: float | None = None
    collectives: dict = dataclasses.field(default_factory=dict)  # kind -> executed per run (hlo_collectives)
    pool_copies: tuple[str, ...] = ()  # HLO instructions that copy or transpose a pool-sized array
    # ... and those that copy a dynamic slice as large as one layer's smallest weight matrix (a layer's weights copied
    # out of the stacked arrays before its products: every weight read three times a step), the pool copies apart
    weight_copies: tuple[str, ...] = ()
    # Fusions that join a batch-invariant row tile's ops with the ops around it (jaxpage.benchmarks.hlo_fusions): a
    # row's bits would then depend on its step. None outside the mode (no row tiles).
    row_tile_fusions: tuple[str, ...] = ()
    # A GPU target's Pallas kernels in a program of KERNEL_KINDS, a report per code and launch configuration. None:
    # not looked for (another kind or target, compile_all(kernels=False)), or nothing compiled (a program got before).
    kernels: tuple[gpu_kernels.KernelReport, ...] | None = None

    @property
    def compiled(self) -> bool:
        return self.error is None


@dataclasses.dataclass
class TargetBuild:
    """The engine as it would start on the target: its sizes, its runner(s), and (after compile_all) its programs."""

    target: Target
    model: ModelConfig  # as it runs (KV heads copied where fewer than the tensor-parallel shards)
    engine: EngineConfig
    dtype: jnp.dtype
    backend: AttentionBackend
    max_model_len: int
    num_pages: int  # per data-parallel replica, the null page included
    weight_bytes: int  # per device
    kv_token_bytes: int  # per device, per token (the backend's arithmetic; a draft model's pool included)
    runners: list[ModelRunner]  # the target model's, then a draft model's
    programs: list[ProgramReport] = dataclasses.field(default_factory=list)
    window_pages: int | None = None  # a hybrid's grouped pool: its window group's pages (jaxpage.kv_cache)
    window_token_bytes: int = 0  # ... and the bytes a token takes there, per device (out of kv_token_bytes)
    lora_bytes: int = 0  # per device: the LoRA adapters' slots (enable_lora), read by every forward pass as weights

    @property
    def pool_bytes(self) -> int:
        """The pool's bytes per device by the engine's budget arithmetic (pages * page_size * bytes per token, in
        each group of a grouped pool)."""
        full = self.num_pages * self.engine.page_size * (self.kv_token_bytes - self.window_token_bytes)
        return full + (self.window_pages or 0) * self.engine.page_size * self.window_token_bytes

    @property
    def pool_array_bytes(self) -> int:
        """The bytes per device of the target model's K pool (one array of the pool; each group's of a hybrid's)."""
        return sum(placed_bytes(group.k) for group in pool_groups(self.runners[0].kv_cache))

    @property
    def compiled_pool_bytes(self) -> int | None:
        """The pool's bytes per device as the compiler lays it out (the fill programs' outputs), None if one did not
        compile."""
        pools = [p for p in self.programs if p.kind == "pool"]
        if not pools or not all(p.compiled for p in pools):
            return None
        return sum(p.output_bytes for p in pools)


def build(
    target: Target,
    engine: EngineConfig,
    model: ModelConfig,
    draft: ModelConfig | None = None,
    num_speculative_tokens: int = 0,
) -> TargetBuild:
    """The engine's runner(s) for `target`, sized as LLMEngine sizes them, with placed ShapeDtypeStructs for
    weights. `num_speculative_tokens` > 0 adds the verify steps (n-gram drafts, or `draft`'s). ValueError for
    arguments the target cannot take (too many devices, a model tensor parallelism does not divide, a pool that
    does not fit)."""
    tp, dp = engine.tensor_parallel_size, engine.data_parallel_size
    dtype = jnp.dtype(engine.dtype or ("float32" if target.platform == "cpu" else "bfloat16"))
    backend = engine_backend(engine, target.platform)
    mesh = make_mesh(tp, dp, devices=target.devices(tp * dp)) if tp * dp > 1 else None
    device = None if mesh is not None else target.devices(1)[0]
    models = [model] + ([draft] if draft is not None else [])
    placed = []
    for config in models:
        # As LLMEngine runs it (jaxpage.engine.llm_engine.as_run): batch_invariant is the model config's, which picks
        # the row-tiled products, norms and sampler: without it the programs would not be the mode's.
        config = batch_invariant_config(
            dataclasses.replace(config, quantization=engine.quantization), engine.batch_invariant
        )
        check_divisible(config, tp, splits_experts(config, tp, engine.enable_expert_parallel))
        config = with_expert_parallel(with_replicated_kv_heads(config, tp), tp, engine.enable_expert_parallel)
        placed.append((config, _placed_params(config, dtype, mesh, device, target.platform)))
    weight_bytes = sum(placed_bytes(params) for _, params in placed)
    lora_bytes = 0  # the LoRA slots the target model's runner keeps, paid by the device's budget as the engine pays
    if engine.enable_lora:
        lora_bytes = slots_device_bytes(placed[0][0], engine.max_loras, engine.max_lora_rank, dtype.itemsize, tp)
    layout = dict(page_size=engine.page_size, tensor_parallel_size=tp)
    token_bytes = sum(backend.kv_bytes_per_token(config, dtype.itemsize, **layout) for config, _ in placed) // tp
    max_model_len = engine.max_model_len or model.max_position_embeddings
    cache = engine.part(CacheConfig)
    memory = (target.hbm_bytes, weight_bytes)
    sizing = (cache, engine.max_num_seqs, token_bytes, max_model_len)
    num_pages = kv_pool_pages(*sizing, device_memory=memory, unpooled_bytes=lora_bytes)
    num_pages = addressable_pages(backend, placed[0][0], num_pages, cache, tp)
    pool_tokens = (num_pages - 1) * engine.page_size
    max_model_len = fit_max_model_len(max_model_len, pool_tokens, engine.max_model_len is not None)
    window_pages = engine_window_pages(engine, model, num_pages)  # a hybrid's grouped pool: its window group's
    sized = (num_pages, max_model_len, mesh, num_speculative_tokens)
    runners = make_runners(
        *(engine, backend, placed[0], placed[1] if draft is not None else None, *sized),
        compile_only=True,
        window_pages=window_pages,
    )
    sizes = (max_model_len, num_pages, weight_bytes, token_bytes, runners)
    target_token_bytes = backend.kv_bytes_per_token(placed[0][0], dtype.itemsize, **layout) // tp
    window_token_bytes = window_share(model, target_token_bytes)
    return TargetBuild(
        *(target, placed[0][0], engine, dtype, backend, *sizes),
        window_pages=window_pages,
        window_token_bytes=window_token_bytes,
        lora_bytes=lora_bytes,
    )


def _placed_params(config: ModelConfig, dtype, mesh, device, platform: str) -> dict:
    """The parameters as ShapeDtypeStructs as `platform` holds them, each placed as the engine places it (split over
    "model" on a mesh)."""
    shapes = param_shapes(config, dtype, platform)
    if mesh is None:
        shardings = jax.tree.map(lambda _: SingleDeviceSharding(device), shapes)
    else:
        specs = param_specs(shapes, expert_parallel=config.expert_parallel_size > 1)
        shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)


def placed_bytes(tree) -> int:
    """Bytes one device holds of the placed arrays or ShapeDtypeStructs in `tree` (the most any device holds): int4
    codes (a quantized checkpoint's) two to a byte, as the chips' XLA packs them."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * _bits(x.dtype) // 8 for x in jax.tree.leaves(tree))


def _bits(dtype) -> int:
    dtype = jnp.dtype(dtype)
    return 4 if dtype in (jnp.dtype(jnp.int4), jnp.dtype(jnp.uint4)) else 8 * dtype.itemsize


def compile_all(
    build: TargetBuild, on_program=None, kinds: set[str] | None = None, kernels: bool | None = None
) -> list[ProgramReport]:
    """Compiles every program of `build`'s runners (a failure is reported, and the others still compile); calls
    on_program(report) as each ends. Returns (and keeps in build.programs) the reports, in warm-up order. kinds: only
    the programs of these kinds (ProgramReport.kind), e.g. {"pool", "forward", "copy"}: those that touch the pool.
    kernels: report the Pallas kernels of KERNEL_KINDS' programs (ProgramReport.kernels; a GPU target's only); None:
    on a GPU target. They need CUDA's ptxas and cuobjdump (pip install 'jaxpage[compile]'):
    gpu_kernels.MissingToolError before anything compiles when one is missing."""
    if kernels is None:
        kernels = build.target.platform == "gpu"
    if kernels and build.target.platform != "gpu":
        raise ValueError(f"no kernel report for {build.target.name}: the kernel report reads GPU kernels")
    read_kernels = kernel_reader(build.target) if kernels else None
    for index, runner in enumerate(build.runners):
        first = pool_groups(runner.kv_cache)[0]
        pool_array_bytes = placed_bytes(first.k) // first.k.shape[0]  # one layer of K
        weight_bytes = layer_weight_bytes(runner.params)
        for what, get in runner.warmup_programs():
            if kinds is not None and what.program not in kinds:
                continue
            label = str(what).split(":")[0] + (" (draft model)" if index else "")
            with dumped(runner, read_kernels is not None and what.program in KERNEL_KINDS) as dump:
                start = time.perf_counter()
                try:
                    compiled = get()
                except Exception as e:  # the compiler's refusal, reported with the program it refused
                    error = f"{type(e).__name__}: {e}"
                    report = ProgramReport(label, what.program, time.perf_counter() - start, error=error)
                else:
                    seconds = time.perf_counter() - start
                    # Weight copies only where the layers run (a sampler's loop over row tiles slices its logits)
                    layers = weight_bytes if what.program in KERNEL_KINDS else None
                    report = describe(label, what.program, seconds, compiled, pool_array_bytes, layers)
                    if dump is not None:
                        report = dataclasses.replace(report, kernels=read_kernels(dump))
            build.programs.append(report)
            if on_program is not None:
                on_program(report)
    return build.programs


def kernel_reader(target: Target):
    """read(dump directory) -> the Pallas kernels' reports (gpu_kernels.read_dump) for a GPU target's SMs, with the
    tools found now (MissingToolError when one is missing)."""
    limits = gpu_kernels.SmLimits.from_target_config(target.gpu_target_config())
    return functools.partial(gpu_kernels.read_dump, tools=gpu_kernels.find_tools(), limits=limits)


@contextlib.contextmanager
def dumped(runner: ModelRunner, dump: bool):
    """Where dump: a temporary directory, XLA's dump directory for what `runner` compiles meanwhile (added to its
    compiler_options), removed after; else None."""
    if not dump:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="jaxpage-xla-dump-") as directory:
        options = runner.compiler_options
        runner.compiler_options = {**(options or {}), "xla_dump_to": directory}
        try:
            yield directory
        finally:
            runner.compiler_options = options


def layer_weight_bytes(params) -> int:
    """The bytes per device of one layer's smallest weight matrix (the layers' parameters are stacked over a leading
    axis; norms' scales and biases, one vector a layer, are not matrices)."""
    leaves = [leaf for leaf in jax.tree.leaves(params["layers"]) if leaf.ndim >= 3]
    return min(placed_bytes(leaf) // leaf.shape[0] for leaf in leaves)


def describe(
    label: str, kind: str, seconds: float, compiled, pool_array_bytes: int, weight_bytes: int | None = None
) -> ProgramReport:
    """The report of one compiled program; pool_array_bytes: the bytes per device of one layer of one pool array
    (a copy that large is a copy of the pool); weight_bytes: those of one layer's smallest weight matrix
    (layer_weight_bytes; None: weight copies not looked for)."""
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    if isinstance(cost, list):  # older jax: one dict per program
        cost = cost[0] if cost else None
    hlo = compiled.as_text()
    pool_copies = large_copies(hlo, pool_array_bytes)
    return ProgramReport(
        label,
        kind,
        seconds,
        argument_bytes=memory.argument_size_in_bytes,
        output_bytes=memory.output_size_in_bytes,
        alias_bytes=memory.alias_size_in_bytes,
        temp_bytes=memory.temp_size_in_bytes,
        code_bytes=memory.generated_code_size_in_bytes,
        flops=None if not cost else cost.get("flops"),
        bytes_accessed=None if not cost else cost.get("bytes accessed"),
        collectives={k: n for k, n in executed(hlo).items() if n},
        pool_copies=() if kind == "pool" else tuple(pool_copies),  # "pool" writes it
        weight_copies=()
        if weight_bytes is None
        else tuple(c for c in sliced_copies(hlo, weight_bytes) if c not in pool_copies),
        row_tile_fusions=tuple(fusions_across_scope(hlo, ROW_TILE_SCOPE)),
    )


@dataclasses.dataclass(frozen=True)
class Roofline:
    """A decode step's time on the target by the chip's published figures: an estimate, not a measurement."""

    rows: int  # sequences, one new token each
    context: int  # tokens each sequence has in the cache
    flops: float  # per device
    bytes: float  # per device: every weight once, and each sequence's K/V
    hbm_seconds: float  # bytes / HBM bandwidth
    compute_seconds: float  # flops / peak bfloat16 FLOP/s

    @property
    def seconds(self) -> float:
        return max(self.hbm_seconds, self.compute_seconds)


def decode_roofline(
    target: Target,
    model: ModelConfig,
    weight_bytes: int,
    kv_token_bytes: int,
    dtype,
    rows: int,
    context: int,
    tensor_parallel_size: int = 1,
) -> Roofline:
    """The roofline estimate of one decode step of `rows` sequences of `context` tokens each on one device of
    `target`: it reads every weight it holds once (weight_bytes) and each sequence's K/V (kv_token_bytes per token),
    and does 2 FLOPs per weight per row (the embedding table counted as a matmul: an upper bound) plus 4 * context *
    head_dim per query head per layer of attention. All figures per device."""
    kv_bytes = rows * context * kv_token_bytes
    attention_flops = 4 * rows * context * model.head_dim * model.num_heads * model.num_layers / tensor_parallel_size
    matmul_params = weight_bytes / (1 if model.quantization == "int8" else jnp.dtype(dtype).itemsize)
    flops = 2 * matmul_params * rows + attention_flops
    total_bytes = weight_bytes + kv_bytes
    return Roofline(rows, context, flops, total_bytes, total_bytes / target.hbm_bandwidth, flops / target.peak_flops)


def build_roofline(build: TargetBuild, rows: int, context: int) -> Roofline:
    """decode_roofline for the engine `build` describes (its LoRA slots read as weights: every step multiplies by all
    of them)."""
    tp = build.engine.tensor_parallel_size
    weights = build.weight_bytes + build.lora_bytes
    return decode_roofline(build.target, build.model, weights, build.kv_token_bytes, build.dtype, rows, context, tp)


# Pooling models' shapes compile_for knows by name (--pooling-model), besides model directories.
POOLING_SHAPES = {
    "all-minilm-l6": EncoderConfig("bert", 30522, 384, 6, 12, 1536, 512, 2, 1e-12, "gelu", 0),
    "bge-base": EncoderConfig("bert", 30522, 768, 12, 12, 3072, 512, 2, 1e-12, "gelu", 0),
    "bge-m3": EncoderConfig("xlm-roberta", 250002, 1024, 24, 16, 4096, 8194, 1, 1e-5, "gelu", 2),
}


def pooling_model_shape(name: str) -> EncoderConfig | ModelConfig:
    """An encoder's config by name (POOLING_SHAPES), or a pooling model directory's (an encoder's or a decoder's)."""
    if name in POOLING_SHAPES:
        return POOLING_SHAPES[name]
    from jaxpage.models import bert, hf_loader
    from jaxpage.models.loader import resolve_source

    path = resolve_source(name, weights=False)
    hf = hf_loader.read_config_json(path)
    if bert.is_encoder_architecture(hf):
        return bert.encoder_config_from_hf(hf, str(path / "config.json"))
    return hf_loader.read_hf_config(path)


def compile_pooling(target: Target, config: EncoderConfig | ModelConfig, engine: EngineConfig, on_program=None):
    """Every step program a PoolingEngine of `config` compiles (one per token bucket: jaxpage.worker.packed_steps),
    built for `target` with placed ShapeDtypeStructs for weights; (the reports, the weights' bytes)."""
    dtype = jnp.dtype(engine.dtype or ("float32" if target.platform == "cpu" else "bfloat16"))
    device = SingleDeviceSharding(target.devices(1)[0])
    if isinstance(config, EncoderConfig):
        shapes = jax.eval_shape(functools.partial(init_encoder_params, config, jax.random.key(0), dtype))
    else:
        shapes = param_shapes(config, dtype, target.platform)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), shapes)
    model = pooling_model(config, params, dtype, target.platform)
    runner = PoolingRunner(model, "MEAN" if model.is_encoder else "LAST")
    max_model_len = min(engine.max_model_len or model.max_positions, model.max_positions)
    max_tokens = max_step_tokens(engine.max_num_batched_tokens, max_model_len)
    reports, weight_bytes = [], layer_weight_bytes(params)
    for row_length, tokens in step_shapes(max_tokens, max_model_len):
        slots = input_slots(tokens, row_length, engine.max_num_seqs)
        label = f"pooling T={tokens}, L={row_length}, S={slots}"
        start = time.perf_counter()
        try:
            compiled = runner.lower(tokens, slots, row_length, device).compile()
        except Exception as e:  # the compiler's refusal, reported with the program it refused
            report = ProgramReport(label, "pooling", time.perf_counter() - start, str(e))
        else:
            report = describe(label, "pooling", time.perf_counter() - start, compiled, 1 << 62, weight_bytes)
        reports.append(report)
        if on_program is not None:
            on_program(report)
    return reports, placed_bytes(params)
