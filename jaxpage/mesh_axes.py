"""The mesh's axes ("data": data-parallel replicas, "model": tensor-parallel shards) and how the KV pool is split
over them (jaxpage.worker.parallel splits the parameters)."""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

DATA_AXIS = "data"
TP_AXIS = "model"
# [layers, pages, page_size, kv_heads, head_dim]: each data-parallel replica its own range of pages (its page p is
# page replica * pages_per_replica + p of the whole pool), each shard its KV heads.
POOL_SPEC = P(None, DATA_AXIS, None, TP_AXIS, None)
SCALE_SPEC = P(None, DATA_AXIS, None, TP_AXIS)  # 8-bit pages' scales: sharded like their pages
