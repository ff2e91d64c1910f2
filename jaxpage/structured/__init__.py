"""Grammar-constrained decoding on the host: llguidance matchers compiled from StructuredOutputsParams, advanced as
tokens commit, and the token bitmasks the jitted sampler applies (jaxpage.sample.logits_processors)."""
