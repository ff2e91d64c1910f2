"""The engine core, host side: requests in, one step at a time (schedule -> execute -> update), outputs
out. The scheduler and block manager (no jax), the sequences' bookkeeping, the input and output processors,
data-parallel replicas."""
