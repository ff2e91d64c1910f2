"""Each model family through the paged engine: greedy tokens equal to transformers' argmax loop on the family's tiny
random model (tests/tiny_models.py), through chunked prefill, preemption and prefix caching, with prompts longer than
a sliding window where the family has one. (Logits against transformers: tests/test_model_parity.py.)"""

from __future__ import annotations

import numpy as np
import pytest
from hf_reference import TINY_FAMILIES, hf_greedy_tokens

from jaxpage.entrypoints.llm import LLM
from jaxpage.sampling_params import SamplingParams

FAMILIES = [
    f
    for f in TINY_FAMILIES
    if f.name in ("mixtral-top2-sliding-window", "qwen2-moe-shared-expert", "qwen3-moe-norm-topk")
]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PAGE_SIZE = 8
# 15 usable pages of 8 tokens: one max_model_len sequence fits, the second call's four prompts (26 pages at their
# end) do not, so some are preempted; 16 tokens a step, so every longer prompt is prefilled in chunks.
ENGINE_ARGS = dict(
    skip_tokenizer_init=True, page_size=PAGE_SIZE, num_pages=16, max_num_batched_tokens=16, max_num_seqs=4,
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
    expected = hf_greedy_tokens(hf_model, prompts, GREEDY.max_tokens)
    llm = LLM(str(directory), **ENGINE_ARGS)
    requests = [{"prompt_token_ids": p} for p in prompts]
    # Two calls: the second prompt finds the first one's prefix pages in the cache.
    outputs = llm.generate(requests[:1], GREEDY) + llm.generate(requests[1:], GREEDY)
    for i, (output, tokens) in enumerate(zip(outputs, expected, strict=True)):
        assert output.outputs[0].token_ids == tokens, f"prompt {i}"
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions > 0
    assert scheduler.num_prefix_hit_tokens >= 40 // PAGE_SIZE * PAGE_SIZE
    assert llm.engine.block_manager.num_used_pages == 0
