"""Speculative decoding: the engine calls it through SpeculativeDecoder (decoder.py).

config.py      the `speculative_config` engine argument (vLLM's keys)
drafter.py     what each sequence may draft, and the n-gram drafts (ngram.py: prompt lookup)
draft_model.py a draft model loaded and checked against the target; draft_runner.py its pool, catch-up, proposals
policy.py      whether verifying pays (measured step times, acceptance by kind of draft and by sequence)
verification.py  rejection sampling of the drafts inside the target's sampler
stats.py       vLLM's counters

The package's modules are imported one by one (this file imports none of them): the host-side ones stay free of
jax, and the target's runner imports verification.py without the draft runner, which imports the runner.
"""
