"""Poolers: one vector per input from a pooling model's hidden states (device side)."""
