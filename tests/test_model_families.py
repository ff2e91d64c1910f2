"""Each model family through the paged engine: greedy tokens equal to transformers' argmax loop on the family's tiny
random model (tests/tiny_models.py), through chunked prefill, preemption and prefix caching, with prompts longer than
a sliding window where the family has one. (Logits against transformers: tests/test_model_parity.py.)"""

from __future__ import annotations

import numpy as np
import pytest
from hf_reference import TINY_FAMILIES, hf_greedy_tokens, hf_greedy_tokens_split, longrope_switch
from tiny_models import FAMILIES_BEYOND_LLAMA

from jaxpage.entrypoints.llm import LLM
from jaxpage.sampling_params import SamplingParams

FAMILIES = [f for f in TINY_FAMILIES if f.name in FAMILIES_BEYOND_LLAMA]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PAGE_SIZE = 8
# 12 usable pages of 8 tokens: one max_model_len sequence fits, the second call's four prompts (26 pages at their
# end) do not, so some are preempted; 16 tokens a step, so every longer prompt is prefilled in chunks.
ENGINE_ARGS = dict(
    skip_tokenizer_init=True, page_size=PAGE_SIZE, num_pages=13, max_num_batched_tokens=16, max_num_seqs=4,
    max_model_len=96,
)  # fmt: skip


def family_prompts(vocab_size: int) -> list[list[int]]:
    """Five prompts: two that share a 40-token prefix (five pages for the second to find in the prefix cache), a
    70-token one, a 3-token one and a 21-token one; all but the short ones longer than the tiny Mixtral's window."""
    rng = np.random.default_rng(0)

    def tokens(n: int) -> list[int]:
        return rng.integers(3, vocab_size, n).tolist()

    prefix = tokens(40)
    return [prefix + tokens(9), prefix + tokens(5), tokens(70), tokens(3), tokens(21)]


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_engine_greedy_equals_transformers(family, tiny_model_dir):
    directory, hf_model = tiny_model_dir(family)
    prompts = family_prompts(hf_model.config.vocab_size)
    split = longrope_switch(hf_model.config)  # LongRoPE: transformers fed as jaxpage's per-position rule reads it
    if split is None:
        expected = hf_greedy_tokens(hf_model, prompts, GREEDY.max_tokens)
    else:
        expected = hf_greedy_tokens_split(hf_model, prompts, GREEDY.max_tokens, split)
    llm = LLM(str(directory), **ENGINE_ARGS)
    requests = [{"prompt_token_ids": p} for p in prompts]
    # Two calls: the second prompt finds the first one's prefix pages in the cache.
    outputs = llm.generate(requests[:1], GREEDY) + llm.generate(requests[1:], GREEDY)
    for i, (output, tokens) in enumerate(zip(outputs, expected, strict=True)):
        assert output.outputs[0].token_ids == tokens, f"prompt {i}"
    scheduler = llm.engine.scheduler
    if not all(llm.engine.model_config.sliding_layers):  # else pages go back as they leave the window: see below
        assert scheduler.num_preemptions > 0
    assert scheduler.num_prefix_hit_tokens >= 40 // PAGE_SIZE * PAGE_SIZE
    assert llm.engine.block_manager.num_used_pages == 0


@pytest.mark.parametrize("attention_impl", ["pallas_gpu_interpret", "pallas_tpu_interpret"])
def test_gemma2s_soft_capped_hybrid_attention_in_the_pallas_kernels(attention_impl, tiny_model_dir):
    """The kernels (in Pallas' interpreters) take Gemma 2's soft cap and each layer's window: transformers' tokens."""
    directory, hf_model = tiny_model_dir(next(f for f in TINY_FAMILIES if f.name == "gemma2-softcap-hybrid"))
    prompts = family_prompts(96)[2:4]  # 70 tokens and 3: past the window of 6
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm = LLM(str(directory), skip_tokenizer_init=True, page_size=PAGE_SIZE, max_num_seqs=2, max_model_len=96,
              attention_impl=attention_impl)  # fmt: skip
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy_tokens(hf_model, prompts, params.max_tokens)


# Gemma 2's chat template as its tokenizer_config.json holds it: no system role, user and model turns alternating.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)


def test_gemmas_chat_template_through_llm_chat(full_vocab_dir, tmp_path):
    """A template without a system role: LLM.chat renders user and model turns, and a system message is refused
    with the template's own message (the server answers it with a 400), the engine unharmed."""
    import shutil

    from jaxpage.tokenizers.tokenizer import load_tokenizer

    directory = shutil.copytree(full_vocab_dir, tmp_path / "gemma-template")
    tokenizer = load_tokenizer(str(directory))
    tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
    tokenizer.save_pretrained(str(directory))
    llm = LLM(str(directory), max_model_len=128, max_num_seqs=2, page_size=8)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    turns = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "?"},
    ]
    [output] = llm.chat(turns, params)
    prompt = load_tokenizer(str(directory)).decode(output.prompt_token_ids)
    assert prompt.endswith("<start_of_turn>model\nHello<end_of_turn>\n<start_of_turn>user\n?<end_of_turn>\n"
                           "<start_of_turn>model\n") and len(output.outputs[0].token_ids) == 4  # fmt: skip
    with pytest.raises(ValueError, match="System role not supported"):
        llm.chat([{"role": "system", "content": "Be brief."}, *turns], params)
    assert len(llm.chat(turns, params)[0].outputs[0].token_ids) == 4


def test_pages_outside_the_window_are_given_back_while_requests_run(tiny_model_dir):
    """A model whose every layer slides (Mistral's window of 5 here, pages of 4): each running sequence holds only the
    pages its next tokens can read, the rest go back to the pool at once (their table entries become the null page);
    before every step every page no sequence holds is poisoned with NaN, and the null page with large finite garbage
    (a kernel's key tile that straddles the window's start loads it, masked; the engine's null page holds zeros and
    padding K/V, never NaN), and the tokens stay transformers', through chunked prefill and preemption (eight
    sequences of 3 to 34 prompt tokens in a pool of one max_model_len sequence)."""

    directory, hf_model = tiny_model_dir(next(f for f in TINY_FAMILIES if f.name == "mistral-sliding-window"))
    window, page_size = 5, 4
    prompts = [*family_prompts(96)[3:], *([(7 * i + j) % 90 + 3 for j in range(24 + 2 * i)] for i in range(6))]
    expected = hf_greedy_tokens(hf_model, prompts, GREEDY.max_tokens)
    # Synchronous: what a sequence holds between steps, none in flight.
    llm = LLM(str(directory), skip_tokenizer_init=True, page_size=page_size, max_num_seqs=8, max_model_len=48,
              num_pages=13, max_num_batched_tokens=16, enable_prefix_caching=False, async_scheduling=False)  # fmt: skip
    engine = llm.engine
    assert engine.block_manager.sliding_window == window
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY)
    finished, most_held = {}, 0
    while engine.has_unfinished_requests():
        engine.runner.kv_cache = poisoned(engine.runner.kv_cache, engine.scheduler.running, "block_table")
        for output in engine.step():
            if output.finished:
                finished[int(output.request_id)] = output.outputs[0].token_ids
        for seq in engine.scheduler.running:
            kept = [page for page in seq.block_table if page != 0]
            most_held = max(most_held, len(kept))
            # the window's keys before the next token span at most this many pages
            assert len(kept) <= -(-(window - 1) // page_size) + 1, (seq.num_computed_tokens, seq.block_table)
    assert [finished[i] for i in range(len(prompts))] == expected
    assert most_held == 2 and engine.block_manager.num_used_pages == 0 and engine.scheduler.num_preemptions > 0


def test_a_hybrids_window_layers_keep_only_their_windows_pages(tiny_model_dir):
    """Gemma 3's layers (two sliding with a window of 6, one full; pages of 4) in a grouped pool: the full layer's
    pages hold every sequence's whole context, the sliding layers' pool is a group of its own, smaller, from which
    each running sequence holds only its window's pages. Before every step every page of either group that no
    running sequence holds is poisoned with NaN (the null pages with finite garbage, as above): the tokens stay
    transformers', through chunked prefill and preemption."""

    from jaxpage.kv_cache import HybridKVCache
    from jaxpage.worker.pool_sizing import window_pages_held

    directory, hf_model = tiny_model_dir(next(f for f in TINY_FAMILIES if f.name == "gemma3-qk-norm-local-rope"))
    window, page_size = 6, 4
    prompts = [*family_prompts(96)[3:], *([(7 * i + j) % 90 + 3 for j in range(24 + 2 * i)] for i in range(4))]
    expected = hf_greedy_tokens(hf_model, prompts, GREEDY.max_tokens)
    # Synchronous: what a sequence holds between steps, none in flight.
    llm = LLM(str(directory), skip_tokenizer_init=True, page_size=page_size, max_num_seqs=3, max_model_len=48,
              num_pages=17, max_num_batched_tokens=8, enable_prefix_caching=False, async_scheduling=False)  # fmt: skip
    engine = llm.engine
    groups = engine.block_manager
    pool = engine.runner.kv_cache
    assert isinstance(pool, HybridKVCache) and pool.full.k.shape[:2] == (1, 17)
    # 3 sequences * (the 5 keys before the next token: 2 pages, + 1 a step starts) + a step's 2 pages + the null page
    assert pool.window.k.shape[:2] == (2, 12) and groups.window.num_pages == 12
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY)
    finished, longest, most_held = {}, 0, 0
    while engine.has_unfinished_requests():
        cache, running = engine.runner.kv_cache, engine.scheduler.running
        engine.runner.kv_cache = HybridKVCache(
            poisoned(cache.full, running, "block_table"), poisoned(cache.window, running, "window_block_table")
        )
        for output in engine.step():
            if output.finished:
                finished[int(output.request_id)] = output.outputs[0].token_ids
        for seq in engine.scheduler.running:
            held = [page for page in seq.window_block_table if page != 0]
            most_held = max(most_held, len(held))
            longest = max(longest, seq.num_computed_tokens)
            assert len(held) <= window_pages_held(window, page_size), (seq.num_computed_tokens, seq.window_block_table)
            assert 0 not in seq.block_table  # the full layer reads every key
    assert [finished[i] for i in range(len(prompts))] == expected
    assert longest > 3 * window and most_held == 2 and engine.scheduler.num_preemptions > 0
    assert groups.num_used_pages == groups.window.num_used_pages == 0


def poisoned(pool, running, table: str):
    """The pool (a KVCache) with NaN in every page no running sequence's `table` holds, and large finite garbage in
    the null page (a kernel's key tile that straddles a window's start loads it, masked; the engine's null page holds
    zeros and padding K/V, never NaN)."""
    import jax
    import jax.numpy as jnp

    held = {page for seq in running for page in getattr(seq, table)}
    free = np.array([p for p in range(1, pool.k.shape[1]) if p not in held], np.int32)
    return jax.tree.map(lambda x: x.at[:, free].set(jnp.nan).at[:, 0].set(1e4), pool)
