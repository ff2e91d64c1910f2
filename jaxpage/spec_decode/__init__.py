"""Speculative decoding's proposers and policy; the engine calls them through SpeculativeDecoder
(jaxpage.engine.spec_decoder).

drafter.py     what each sequence may draft, and the n-gram drafts (ngram.py: prompt lookup)
draft_model.py a draft model loaded and checked against the target (its runner: jaxpage.worker.draft_runner)
policy.py      whether verifying pays (measured step times, acceptance by kind of draft and by sequence)
stats.py       vLLM's counters

Elsewhere, where the layers put them: the `speculative_config` argument (jaxpage.config.speculative, plain data the
engine arguments hold) and the rejection sampling that verifies drafts inside the target's sampler
(jaxpage.sample.rejection_sampler). The package's modules are imported one by one (this file imports none of them):
the host-side ones stay free of jax.
"""
