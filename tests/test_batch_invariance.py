"""Batch invariance (engine argument batch_invariant; jaxpage.models.batch_invariant): a request's tokens and log-probs
bit for bit the same whatever runs beside it. The pieces (row-tiled products and reductions, the XLA attention's fixed
order) give a row the same bits whatever its step holds; then a hypothesis test drives one target request through
random companions, places in the batch, chunk sizes, prefix-cache states, preemptions, asynchronous scheduling, data-
parallel replicas and n > 1 samples, and compares its bits with the request served alone."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_reference import ragged_paged_attention_dense_reference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import TINY_FAMILIES, tiny_config

from jaxpage.benchmarks.hlo_fusions import fusions_across_scope
from jaxpage.config import EngineConfig, model_config_from_hf
from jaxpage.entrypoints.llm import LLM
from jaxpage.models.batch_invariant import ROW_TILE, ROW_TILE_SCOPE, in_row_tiles, invariant_dot_general, rowwise
from jaxpage.sampling_params import SamplingParams
from pallas_kernels.xla_ragged_attention import xla_ragged_attention

RNG = np.random.default_rng(0)
# XLA's CPU compiler as jaxpage runs it, LLVM's optimizations on: the suite turns them off (tests/conftest.py, for
# compile time), and with them off no multiply and add become one fused multiply-add, which is how a fusion across a
# row tile changes a row's bits (the GPU's compiler always contracts them).
PRODUCTION_XLA = {"xla_backend_optimization_level": 3, "xla_llvm_disable_expensive_passes": False}


def production_compiled(fn, *args):
    """fn jitted and compiled for args as XLA compiles it outside the suite (PRODUCTION_XLA)."""
    return jax.jit(fn).lower(*args).compile(PRODUCTION_XLA)


@pytest.fixture(scope="module")
def production_compiler(tmp_path_factory):
    """Every program this module's engines compile, compiled with PRODUCTION_XLA, and a compilation cache of their own
    (jaxpage's key does not hold compiler options), which the engines of the same sizes share."""
    compile_ = jax.stages.Lowered.compile
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            jax.stages.Lowered, "compile", lambda self, options=None: compile_(self, PRODUCTION_XLA | (options or {}))
        )
        yield str(tmp_path_factory.mktemp("production-compilation-cache"))


def test_a_row_s_product_is_the_same_bits_whatever_the_rows_beside_it():
    w = jnp.asarray(RNG.standard_normal((96, 160)), jnp.float32)
    x = RNG.standard_normal((100, 96)).astype(np.float32)
    product = jax.jit(lambda x, w: invariant_dot_general(x, w, (((1,), (0,)), ((), ()))))
    alone = np.asarray(product(x[7:8], w))[0]
    for rows in (8, 9, 17, 48, 100):  # plain products give other bits at 2..48 rows than at 1 (measured on CPU)
        assert np.array_equal(np.asarray(product(x[:rows], w))[7], alone), rows
    np.testing.assert_allclose(np.asarray(product(x, w)), x @ np.asarray(w), rtol=1e-5, atol=1e-5)
    # Leading axes flattened into rows, several contracting axes (the o projection's [..., H, d] x [H, d, D]).
    heads = RNG.standard_normal((2, 5, 4, 24)).astype(np.float32)
    kernel = RNG.standard_normal((4, 24, 96)).astype(np.float32)
    got = invariant_dot_general(heads, kernel, (((2, 3), (0, 1)), ((), ())))
    np.testing.assert_allclose(got, np.einsum("bthd,hdo->bto", heads, kernel), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="unsupported dimension numbers"):
        invariant_dot_general(heads, kernel, (((1,), (0,)), ((0,), (0,))))


def test_rowwise_and_in_row_tiles_give_each_row_its_own_result():
    x = RNG.standard_normal((3, 7, 96)).astype(np.float32)
    norm = jax.jit(lambda x: rowwise(lambda t: t / jnp.sqrt(jnp.mean(t * t, axis=-1, keepdims=True)), x))
    np.testing.assert_allclose(norm(x), x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True)), rtol=1e-6)
    assert np.array_equal(np.asarray(norm(x))[1, 3], np.asarray(norm(x[1:2, 3:4]))[0, 0])

    def per_row(logits, steps, flag):  # rows of 3 positions each, and one row-less scalar
        return logits.reshape(-1, 3, logits.shape[-1]).sum(axis=1) + steps[:, None] + flag, logits * 2

    rows = ROW_TILE + 5
    logits, steps = RNG.standard_normal((rows * 3, 8)).astype(np.float32), np.arange(rows, dtype=np.float32)
    tiled = in_row_tiles(per_row, rows, logits, steps, np.float32(0.5))
    for got, want in zip(tiled, per_row(logits, steps, np.float32(0.5)), strict=True):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_a_row_tile_s_ops_fuse_with_none_around_it_whatever_the_step_s_rows():
    # A norm (the tile's last multiply) and a residual add after it: in one fusion they are one multiply-add. XLA
    # fused them when one tile held every row (its loop of one trip replaced by its body), not at 2 tiles.
    scale = jnp.asarray(RNG.standard_normal(96), jnp.float32)

    def norm(t):
        return t * jax.lax.rsqrt(jnp.mean(t * t, axis=-1, keepdims=True) + 1e-6) * (1 + scale)

    x, residual = (RNG.standard_normal((40, 96)).astype(np.float32) for _ in range(2))

    def rows(n):
        program = production_compiled(lambda x, r: r + rowwise(norm, x), x[:n], residual[:n])
        assert not fusions_across_scope(program.as_text(), ROW_TILE_SCOPE), n
        return np.asarray(program(x[:n], residual[:n]))

    alone = rows(1)[0]
    for n in (2, ROW_TILE, ROW_TILE + 1, 40):
        assert np.array_equal(rows(n)[0], alone), n


def test_fusions_across_scope_finds_a_fusion_of_a_tile_s_op_with_its_neighbour():
    # The checker itself, on a program where one fusion holds a tile's multiply and the add outside it.
    hlo = jax.jit(lambda x, r: r + _in_scope(x)).lower(np.ones((4, 8), np.float32), np.ones((4, 8), np.float32))
    assert fusions_across_scope(hlo.compile().as_text(), ROW_TILE_SCOPE)
    apart = jax.jit(lambda x, r: _in_scope(x) * 2).lower(np.ones((4, 8), np.float32), np.ones((4, 8), np.float32))
    assert not fusions_across_scope(apart.compile().as_text(), ROW_TILE_SCOPE)


def _in_scope(x):
    with jax.named_scope(ROW_TILE_SCOPE):
        return x * 3.0


def attention_case(q_lens: list[int], kv_lens: list[int], seed: int = 1):
    """A ragged batch on a small pool: (q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs)."""
    rng = np.random.default_rng(seed)
    pages, page_size, kv_heads, head_dim, heads = 48, 8, 2, 16, 6
    k = jnp.asarray(rng.standard_normal((pages, page_size, kv_heads, head_dim)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((pages, page_size, kv_heads, head_dim)), jnp.float32)
    tables = np.asarray([rng.permutation(np.arange(1, pages))[:16] for _ in q_lens], np.int32)
    q = jnp.asarray(rng.standard_normal((sum(q_lens), heads, head_dim)), jnp.float32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return q, k, v, np.asarray(kv_lens, np.int32), tables, cu, np.int32(len(q_lens))


def test_the_fixed_order_attention_gives_a_row_the_same_bits_however_its_sequence_is_chunked():
    q, k, v, kv_lens, tables, cu, num_seqs = attention_case([37, 1, 5], [37, 60, 20])
    attend = fixed_order_attention(sm_scale=0.25)
    whole = np.asarray(attend(q, k, v, kv_lens, tables, cu, num_seqs))
    reference = ragged_paged_attention_dense_reference(q, k, v, kv_lens, tables, cu, num_seqs, sm_scale=0.25)
    np.testing.assert_allclose(whole, reference, rtol=2e-5, atol=2e-5)
    for chunk in (16, 5, 1):  # the first sequence's 37 rows a chunk at a time, each chunk alone
        rows = []
        for start in range(0, 37, chunk):
            n = min(chunk, 37 - start)
            out = attend(q[start : start + n], k, v, np.int32([start + n]), tables[:1], np.int32([0, n]), np.int32(1))
            rows.append(np.asarray(out))
        assert np.array_equal(np.concatenate(rows), whole[:37]), chunk
    decode = attend(q[42:43], k, v, kv_lens[2:], tables[2:], np.int32([0, 1]), np.int32(1), max_q_len=1)
    assert np.array_equal(np.asarray(decode)[0], whole[42])  # the third sequence's last row, as a decode row


def fixed_order_attention(**options):
    """xla_ragged_attention in its batch-invariant form."""

    def attend(*args, max_q_len=None):
        return xla_ragged_attention(*args, fixed_order=True, max_q_len=max_q_len, **options)

    return attend


# The engines of the hypothesis test: one model, the mode on; each a way a step can be shaped differently.
COMMON = dict(skip_tokenizer_init=True, max_model_len=128, page_size=8, max_num_seqs=8, batch_invariant=True)
ENGINES = {
    "one-chunk": dict(max_num_batched_tokens=64),
    # chunks of 16 tokens, asynchronous steps, and a pool of 9 pages of 8 tokens (a context of 64) for up to 16
    # sequences: companions preempt the target, even where every layer slides (pages before the window given back)
    "chunked-async-preempting": dict(
        max_num_batched_tokens=16, async_scheduling=True, max_model_len=64, num_pages=9, max_num_seqs=16
    ),
}
if len(jax.devices()) >= 2:  # the suite's simulated CPU devices; not on the device check's one GPU
    ENGINES["two-replicas"] = dict(max_num_batched_tokens=64, data_parallel_size=2)
# The replicas run a family's model as one device does: two replicas for SmolLM2's family and the default model only
# (9 s of compiling a family in the suite).
DATA_PARALLEL_MODELS = ("smollm2-tied", "default")
# The test after the hypothesis test reads what that test did on these engines: with pytest-xdist, both on one worker
# (--dist loadfile, the suite's, or --dist loadgroup, the device check's).
pytestmark = pytest.mark.xdist_group("batch_invariance_engines")
TARGET = [int(t) for t in np.random.default_rng(5).integers(3, 90, 37)]
# The models: every family of the tiny models that the mode accepts (a mixture of experts it refuses: the last test),
# each with its own engines; JAXPAGE_INVARIANCE_MODEL=NAME[,NAME...] some of them, or "default" the default model.
# Cases per model: JAXPAGE_INVARIANCE_EXAMPLES (README).
ACCEPTED_FAMILIES = {f.name: f for f in TINY_FAMILIES if not model_config_from_hf(tiny_config(f)).is_moe}
MODELS = os.environ.get("JAXPAGE_INVARIANCE_MODEL", ",".join(ACCEPTED_FAMILIES)).split(",")
EXAMPLES = int(os.environ.get("JAXPAGE_INVARIANCE_EXAMPLES", "20"))


@pytest.fixture(scope="module", params=MODELS)
def model(request) -> str:
    """Each model's name (MODELS), one after the other."""
    return request.param


@pytest.fixture(scope="module")
def model_source(model, request) -> str:
    """A tiny model of an accepted family, or the default model."""
    if model == "default":
        return str(request.getfixturevalue("smollm2_path"))
    assert model in ACCEPTED_FAMILIES, f"JAXPAGE_INVARIANCE_MODEL: not default or {sorted(ACCEPTED_FAMILIES)}"
    return str(request.getfixturevalue("tiny_model_path")(ACCEPTED_FAMILIES[model]))


@pytest.fixture(scope="module")
def engines(model, model_source, production_compiler):
    options = COMMON | dict(compilation_cache_dir=production_compiler)
    names = [name for name in ENGINES if name != "two-replicas" or model in DATA_PARALLEL_MODELS]
    return {name: LLM(model_source, **options | ENGINES[name]) for name in names}


def target_params(seeded: bool, n: int) -> SamplingParams:
    if not seeded:
        return SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    return SamplingParams(
        temperature=0.9, top_p=0.9, top_k=20, seed=11, n=n, max_tokens=10, ignore_eos=True, logprobs=2
    )


def served(llm, params: SamplingParams, companions: list[list[int]], place: int) -> list:
    """The target's samples (tokens, log-probs of each token and of its top 2) among `companions`, at `place`."""
    prompts = [{"prompt_token_ids": p} for p in companions]
    prompts.insert(place, {"prompt_token_ids": TARGET})
    others = SamplingParams(temperature=0.7, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(prompts, [params if i == place else others for i in range(len(prompts))])
    return [(list(c.token_ids), [dict(sorted((t, p.logprob) for t, p in lp.items())) for lp in c.logprobs])
            for c in outputs[place].outputs]  # fmt: skip


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    data=st.data(),  # draws one of the model's engines
    companions=st.lists(st.lists(st.integers(3, 90), min_size=1, max_size=60), max_size=10),
    place=st.integers(0, 10),
    cached=st.booleans(),
    seeded=st.booleans(),
    n=st.integers(1, 2),
)
def test_a_request_s_tokens_and_logprobs_are_the_same_bits_whatever_runs_beside_it(
    engines, alone, data, companions, place, cached, seeded, n
):
    engine = data.draw(st.sampled_from(sorted(engines)), label="engine")
    llm, params = engines[engine], target_params(seeded, n)
    if cached:  # the target's prompt pages in the prefix cache (or, where they were evicted, recomputed)
        llm.generate({"prompt_token_ids": TARGET}, SamplingParams(max_tokens=1))
    got = served(llm, params, companions, min(place, len(companions)))
    assert got == alone[seeded, n], (engine, len(companions), place, cached)


def test_the_cases_above_preempted_the_target_and_hit_its_cached_prefix(engines):
    """(After the hypothesis test, on its engines: what it claims to cover happened.) A model whose every layer slides
    gives its pages before the window back while it runs: its prompt is never found whole in the cache."""
    assert engines["chunked-async-preempting"].engine.scheduler.num_preemptions > 0
    hits = {name: llm.engine.scheduler.num_prefix_hit_tokens for name, llm in engines.items()}
    every_layer_slides = all(engines["one-chunk"].engine.model_config.sliding_layers)
    assert every_layer_slides or sum(hits.values()) > 0, hits


def test_no_fusion_joins_a_row_tile_with_the_ops_around_it(engines):
    """Every program the engines compiled (those of the hypothesis test, where it ran first), and at least those of
    the target alone (steps of one tile) and among 3 companions (of several): their compiled HLO."""
    programs = {}
    for name, llm in engines.items():
        served(llm, target_params(seeded=True, n=1), [[5] * 40] * 3, 0)
        served(llm, target_params(seeded=False, n=1), [], 0)
        runner = llm.engine.runner
        programs |= {(name, str(shape)): p for shape, p in [*runner.executables.items(), *runner.samplers.items()]}
    tokens = [shape.num_tokens for llm in engines.values() for shape in llm.engine.runner.executables]
    assert min(tokens) <= ROW_TILE < max(tokens), tokens
    across = {key: fusions_across_scope(p.as_text(), ROW_TILE_SCOPE) for key, p in programs.items()}
    assert not {key: found for key, found in across.items() if found}


@pytest.fixture(scope="module")
def alone(model_source, production_compiler):
    """The target served alone, on an engine of its own (one step shape per phase, nothing cached)."""
    options = dict(max_num_batched_tokens=64, enable_prefix_caching=False, compilation_cache_dir=production_compiler)
    llm = LLM(model_source, **COMMON | options)
    return {(seeded, n): served(llm, target_params(seeded, n), [], 0) for seeded in (False, True) for n in (1, 2)}


def test_the_mode_refuses_what_computes_a_row_by_its_batch(tiny_model_path):
    with pytest.raises(ValueError, match="batch_invariant: quantization 'int8' is not batch-invariant yet"):
        EngineConfig(batch_invariant=True, quantization="int8")
    with pytest.raises(ValueError, match="batch_invariant: attention_impl 'pallas_gpu': the Pallas kernels split"):
        EngineConfig(batch_invariant=True, attention_impl="pallas_gpu")
    moe = next(f for f in TINY_FAMILIES if f.name == "qwen3-moe-norm-topk")
    with pytest.raises(ValueError, match="batch_invariant: a mixture of experts"):
        LLM(str(tiny_model_path(moe)), skip_tokenizer_init=True, batch_invariant=True)
