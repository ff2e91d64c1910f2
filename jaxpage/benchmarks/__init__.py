"""What the benchmark scripts (scripts/) and the parity tests share: workloads, machine measurements, progress
lines, the KV plot, Hugging Face baselines and references, and tiny random models.

Not part of the serving API. No module here imports torch or transformers when imported: those are test extras,
imported inside the functions that need them.
"""
