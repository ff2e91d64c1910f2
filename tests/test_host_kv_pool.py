"""The host tier's device side (jaxpage.worker.host_kv_pool): page copies between the device pool and host slots in
pinned host memory, applied in the block manager's order, against numpy doing the same copies one by one; sharded over
a tensor-parallel mesh, each device's slots hold its own KV heads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpage.engine.host_page_cache import PageTransfer
from jaxpage.kv_cache import KVCache
from jaxpage.worker.host_kv_pool import HOST_MEMORY, TRANSFER_CHUNK, HostKVPool, transfer_calls

LAYERS, PAGES, SLOTS, PAGE_SIZE, KV_HEADS, HEAD_DIM = 2, 7, 5, 2, 2, 4


def pool_arrays(num_pages: int, seed: int, scales: bool) -> KVCache:
    rng = np.random.default_rng(seed)
    shape = (LAYERS, num_pages, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    k, v = (rng.standard_normal(shape).astype(np.float32) for _ in "kv")
    if not scales:
        return KVCache(k=k, v=v)
    return KVCache(
        k=k, v=v, k_scales=rng.random(shape[:-1]).astype(np.float32), v_scales=rng.random(shape[:-1]).astype(np.float32)
    )


def host_pool(scales: bool, shardings=None) -> HostKVPool:
    layout = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), pool_arrays(SLOTS + 1, 0, scales))
    if shardings is not None:
        shardings = jax.tree.map(lambda _: shardings, layout)
    return HostKVPool(layout, shardings, lambda name, args, compile: compile(), lambda tree: tree)


def test_transfers_become_ordered_runs_of_one_kind_padded_into_the_scratch_slot():
    transfers = [PageTransfer("offload", 3, 0), PageTransfer("offload", 4, 1), PageTransfer("load", 2, 0)]
    transfers += [PageTransfer("offload", p, p % 3) for p in range(1, 11)]  # 10: a full call and 2
    calls = transfer_calls(transfers, scratch_slot=9)
    assert [kind for kind, *_ in calls] == ["offload", "load", "offload", "offload"]
    assert all(len(src) == len(dst) == TRANSFER_CHUNK for _, src, dst in calls)
    kind, src, dst = calls[0]
    assert list(src) == [3, 4] + [0] * 6 and list(dst) == [0, 1] + [9] * 6  # padding: the null page, the scratch slot
    kind, src, dst = calls[1]
    assert list(src) == [0] + [9] * 7 and list(dst) == [2] + [0] * 7  # loads: slots into pages, padding the other way
    assert list(calls[3][1][:2]) == [9, 10] and list(calls[3][2][2:]) == [9] * 6


@settings(max_examples=20, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["offload", "load"]), st.integers(1, PAGES - 1), st.integers(0, SLOTS - 1)),
        max_size=20,
    ),
    st.booleans(),
)
def test_transfers_copy_pages_as_numpy_does_one_by_one(transfers, scales):
    transfers = [PageTransfer(*t) for t in transfers]
    pool, host = pool_arrays(PAGES, 1, scales), host_pool(scales)
    host.cache = jax.device_put(pool_arrays(SLOTS + 1, 2, scales), host.shardings)
    want_pool, want_host = jax.tree.map(np.array, pool), jax.tree.map(np.array, host.cache)
    for t in transfers:  # in order: each copy sees the ones before it
        for name in ("k", "v", "k_scales", "v_scales"):
            device, slots = getattr(want_pool, name), getattr(want_host, name)
            if device is None:
                continue
            if t.kind == "offload":
                slots[:, t.slot] = device[:, t.page]
            else:
                device[:, t.page] = slots[:, t.slot]
    got = host.transfer(jax.tree.map(jnp.asarray, pool), transfers)
    real = slice(1, None)  # the null page takes the loads' padding
    for name in ("k", "v", "k_scales", "v_scales"):
        if getattr(want_pool, name) is not None:
            np.testing.assert_array_equal(np.asarray(getattr(got, name))[:, real], getattr(want_pool, name)[:, real])
            np.testing.assert_array_equal(
                np.asarray(getattr(host.cache, name))[:, :SLOTS], getattr(want_host, name)[:, :SLOTS]
            )
    assert all(x.sharding.memory_kind == HOST_MEMORY for x in jax.tree.leaves(host.cache))
    assert host.bytes_moved["offload"] + host.bytes_moved["load"] == len(transfers) * host.page_bytes()


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices (the suite simulates 8 CPU devices)")
def test_a_tensor_parallel_pool_keeps_each_shard_s_kv_heads_in_its_own_host_slots():
    mesh = Mesh(np.asarray(jax.devices()[:2]), ("model",))
    heads = NamedSharding(mesh, P(None, None, None, "model", None))
    pool = jax.device_put(pool_arrays(PAGES, 3, False), heads)
    host = host_pool(False, heads)
    pool = host.transfer(pool, [PageTransfer("offload", 2, 1), PageTransfer("load", 5, 1)])
    for x in (host.cache.k, pool.k):
        assert x.sharding.spec == heads.spec and [s.data.shape[3] for s in x.addressable_shards] == [1, 1]
    assert host.cache.k.sharding.memory_kind == HOST_MEMORY
    for shard in host.cache.k.addressable_shards:  # each device's slot 1: its own KV head of page 2
        head = shard.index[3]
        np.testing.assert_array_equal(np.asarray(shard.data)[:, 1], pool_arrays(PAGES, 3, False).k[:, 2, :, head])
    np.testing.assert_array_equal(np.asarray(pool.k)[:, 5], pool_arrays(PAGES, 3, False).k[:, 2])
