"""On-device sampling: the sampler (`sampler`), logits processors (`logits_processors`, from the host's
`logits_controls`) and the rejection sampling that verifies speculative drafts (`rejection_sampler`)."""
