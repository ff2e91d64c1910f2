"""The paged engine end to end on the default model: token-for-token agreement with transformers' greedy
decoding, whatever the pool size, page size, chunking or prefix caching."""

from __future__ import annotations

import pytest
from hf_reference import hf_greedy_tokens

from jaxpage.entrypoints.llm import LLM
from jaxpage.sampling_params import SamplingParams

NEW_TOKENS = 32
SYSTEM = (  # about 80 tokens: full pages of 8, 16 and 32 tokens for the prefix cache to share
    "You are a careful assistant who answers questions about the natural world. Answer in one short paragraph "
    "of plain sentences, never use lists or headings, avoid jargon, and when a question has a simple answer, "
    "give that answer first and then one sentence that explains it to a curious twelve-year-old. Question: "
)
PROMPTS = [
    "The capital of France is",
    "def quicksort(items):\n",
    "Once upon a time",
    "List three colors of the rainbow:",
    SYSTEM + "Why is the sky blue?",
    SYSTEM + "What do bees make?",
    "1, 2, 3, 4, 5,",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. Again: The quick",
    "Translate to French: Good morning, my friend. How are you today? I hope the weather is nice where you are.",
]


@pytest.fixture(scope="session")
def hf_greedy(smollm2_path, smollm2_hf):
    """transformers' greedy continuations (NEW_TOKENS each, EOS ignored) of PROMPTS, in one left-padded batch:
    measured here the same tokens as one prompt at a time for every prompt, in 5.5 s instead of 23 (a float32
    decode step of this model reads its 0.5 GB of weights whatever the batch)."""
    from jaxpage.tokenizers.tokenizer import encode_prompt, load_tokenizer

    tokenizer = load_tokenizer(smollm2_path)
    return hf_greedy_tokens(smollm2_hf, [encode_prompt(tokenizer, prompt) for prompt in PROMPTS], NEW_TOKENS)


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)

# One engine per behaviour of the pool and the scheduler, several behaviours per engine (each default-model engine
# costs its compile): pages of 16 with prefix caching; pages of 8, every prompt chunked (16 tokens a step) and
# preemption (22 pages of 8: not enough for all at once; the pool must hold one max_model_len sequence), scheduled
# asynchronously (each step launched before the tokens of the one before are on the host); pages of 32 without prefix
# caching.
ENGINE_VARIANTS = {
    "default": dict(),
    "page-size-8-chunked-preemption-async": dict(
        page_size=8, num_pages=23, max_num_batched_tokens=16, max_model_len=160, async_scheduling=True
    ),
    "page-size-32-no-prefix-caching": dict(page_size=32, enable_prefix_caching=False),
}


@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS), ids=list(ENGINE_VARIANTS))
def test_greedy_equals_transformers(variant, smollm2_path, hf_greedy):
    llm = LLM(str(smollm2_path), **({"max_model_len": 256} | ENGINE_VARIANTS[variant]))
    # Two calls, so the second system-prompt request finds the first one's pages in the prefix cache.
    outputs = llm.generate(PROMPTS[:5], GREEDY) + llm.generate(PROMPTS[5:], GREEDY)
    for prompt, output, expected in zip(PROMPTS, outputs, hf_greedy, strict=True):
        assert output.outputs[0].token_ids == expected, prompt
        assert output.outputs[0].finish_reason == "length"
    engine = llm.engine
    assert engine.async_scheduling == ("async" in variant)
    if "preemption" in variant:
        assert engine.scheduler.num_preemptions > 0
    if "no-prefix-caching" in variant:
        assert engine.scheduler.num_prefix_hit_tokens == 0
    else:  # the second system-prompt request reuses every full page of the prefix it shares with the first
        first, second = (outputs[i].prompt_token_ids for i in (4, 5))
        common = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
        page_size = engine.block_manager.page_size
        shared = common // page_size * page_size
        assert common > 32 and engine.scheduler.num_prefix_hit_tokens >= shared
        if "preemption" not in variant:  # a preempted request also finds its own pages again when it comes back
            assert engine.scheduler.num_prefix_hit_tokens == shared
    assert engine.block_manager.num_used_pages == 0  # everything returned


def test_chat_reply_equals_transformers(smollm2_path, smollm2_hf):
    from jaxpage.tokenizers.tokenizer import encode_prompt, load_tokenizer

    llm = LLM(str(smollm2_path), max_model_len=256)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    [output] = llm.chat(messages, SamplingParams(temperature=0, max_tokens=16))
    ids = encode_prompt(load_tokenizer(smollm2_path), messages[0]["content"], chat=True)
    assert output.prompt_token_ids == ids
    [expected] = hf_greedy_tokens(smollm2_hf, [ids], 16)
    completion = output.outputs[0]
    if completion.finish_reason == "stop":  # <|im_end|>: the reply ended before 16 tokens
        expected = expected[: len(completion.token_ids)]
    assert completion.token_ids == expected
    assert "Paris" in completion.text
