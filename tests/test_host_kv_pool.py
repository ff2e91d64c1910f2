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
SPEC = P(None, "data", None, "model")  # pages over the replicas, KV heads over the shards (scales too)


def pool_arrays(num_pages: int, seed: int, scales: bool) -> KVCache:
    rng = np.random.default_rng(seed)
    shape = (LAYERS, num_pages, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    k, v = (rng.standard_normal(shape).astype(np.float32) for _ in "kv")
    if not scales:
        return KVCache(k=k, v=v)
    return KVCache(
        k=k, v=v, k_scales=rng.random(shape[:-1]).astype(np.float32), v_scales=rng.random(shape[:-1]).astype(np.float32)
    )


def host_pool(scales: bool, mesh=None, spec=SPEC, replicas: int = 1) -> HostKVPool:
    layout = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), pool_arrays(PAGES * replicas, 0, scales))
    specs = jax.tree.map(lambda _: spec, layout)
    return HostKVPool(
        layout, specs, (SLOTS,), mesh, jax.devices()[0], lambda name, args, compile: compile(), lambda t: t
    )


def apply(host: HostKVPool, pool: KVCache, transfers: list[list[PageTransfer]]) -> KVCache:
    for kind, sources, destinations in transfer_calls(transfers, SLOTS):
        pool = host.transfer(pool, 0, kind, sources, destinations)
    return pool


def test_transfers_become_ordered_runs_of_one_kind_padded_into_the_scratch_slot():
    transfers = [PageTransfer("offload", 3, 0), PageTransfer("offload", 4, 1), PageTransfer("load", 2, 0)]
    transfers += [PageTransfer("offload", p, p % 3) for p in range(1, 11)]  # 10: a full call and 2
    calls = transfer_calls([transfers], scratch_slot=9)
    assert [kind for kind, *_ in calls] == ["offload", "load", "offload", "offload"]
    assert all(src.shape == dst.shape == (1, TRANSFER_CHUNK) for _, src, dst in calls)
    kind, src, dst = calls[0]
    assert list(src[0]) == [3, 4] + [0] * 6 and list(dst[0]) == [0, 1] + [9] * 6  # padding: null page, scratch slot
    kind, src, dst = calls[1]
    assert list(src[0]) == [0] + [9] * 7 and list(dst[0]) == [2] + [0] * 7  # loads: slots into pages, padding reversed
    assert list(calls[3][1][0, :2]) == [9, 10] and list(calls[3][2][0, 2:]) == [9] * 6


def test_replicas_calls_keep_each_replica_s_order_and_pad_the_others():
    first = [PageTransfer("offload", 3, 0), PageTransfer("load", 2, 0)]
    second = [PageTransfer("load", 5, 1), PageTransfer("offload", 6, 2), PageTransfer("load", 7, 2)]
    calls = transfer_calls([first, second, []], scratch_slot=4)
    assert [kind for kind, *_ in calls] == ["offload", "load", "offload", "load"]
    rows = [[(kind, int(src[r, 0]), int(dst[r, 0])) for kind, src, dst in calls] for r in range(3)]
    assert rows[0] == [("offload", 3, 0), ("load", 0, 2), ("offload", 0, 4), ("load", 4, 0)]
    assert rows[1] == [("offload", 0, 4), ("load", 1, 5), ("offload", 6, 2), ("load", 2, 7)]
    assert rows[2] == [("offload", 0, 4), ("load", 4, 0), ("offload", 0, 4), ("load", 4, 0)]


def numpy_transfers(pool: KVCache, host: KVCache, transfers: list[PageTransfer]) -> None:
    for t in transfers:  # in order: each copy sees the ones before it
        for name in ("k", "v", "k_scales", "v_scales"):
            device, slots = getattr(pool, name), getattr(host, name)
            if device is None:
                continue
            if t.kind == "offload":
                slots[:, t.slot] = device[:, t.page]
            else:
                device[:, t.page] = slots[:, t.slot]


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
    host.cache = [jax.device_put(pool_arrays(SLOTS + 1, 2, scales), host.shardings(0))]
    want_pool, want_host = jax.tree.map(np.array, pool), jax.tree.map(np.array, host.cache[0])
    numpy_transfers(want_pool, want_host, transfers)
    got = apply(host, jax.tree.map(jnp.asarray, pool), [transfers])
    real = slice(1, None)  # the null page takes the loads' padding
    for name in ("k", "v", "k_scales", "v_scales"):
        if getattr(want_pool, name) is not None:
            np.testing.assert_array_equal(np.asarray(getattr(got, name))[:, real], getattr(want_pool, name)[:, real])
            np.testing.assert_array_equal(
                np.asarray(getattr(host.cache[0], name))[:, :SLOTS], getattr(want_host, name)[:, :SLOTS]
            )
    assert all(x.sharding.memory_kind == HOST_MEMORY for x in jax.tree.leaves(host.cache))
    assert host.bytes_moved["offload"] + host.bytes_moved["load"] == len(transfers) * host.page_bytes[0]


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices (the suite simulates 8 CPU devices)")
def test_a_tensor_parallel_pool_keeps_each_shard_s_kv_heads_in_its_own_host_slots():
    mesh = Mesh(np.asarray(jax.devices()[:2]).reshape(1, 2), ("data", "model"))
    spec = P(None, "data", None, "model", None)
    pool = jax.device_put(pool_arrays(PAGES, 3, False), NamedSharding(mesh, spec))
    host = host_pool(False, mesh, spec)
    pool = apply(host, pool, [[PageTransfer("offload", 2, 1), PageTransfer("load", 5, 1)]])
    for x in (host.cache[0].k, pool.k):
        assert x.sharding.spec == spec and [s.data.shape[3] for s in x.addressable_shards] == [1, 1]
    assert host.cache[0].k.sharding.memory_kind == HOST_MEMORY
    for shard in host.cache[0].k.addressable_shards:  # each device's slot 1: its own KV head of page 2
        head = shard.index[3]
        np.testing.assert_array_equal(np.asarray(shard.data)[:, 1], pool_arrays(PAGES, 3, False).k[:, 2, :, head])
    np.testing.assert_array_equal(np.asarray(pool.k)[:, 5], pool_arrays(PAGES, 3, False).k[:, 2])


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (the suite simulates 8 CPU devices)")
def test_data_parallel_replicas_move_their_own_pages_without_collectives():
    # Each replica's pages and slots are its own range of the arrays (its ids local): the copies run on each device's
    # shard, so no program gathers the pool (a plain jit's dynamic slice of a page-sharded pool all-gathers it).
    mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    spec = SPEC
    whole = pool_arrays(2 * PAGES, 4, True)
    pool = jax.device_put(whole, NamedSharding(mesh, spec))
    host = host_pool(True, mesh, spec, replicas=2)
    first = [PageTransfer("offload", 2, 1), PageTransfer("offload", 3, 0)]
    second = [PageTransfer("offload", 6, 1), PageTransfer("load", 4, 1)]
    pool = apply(host, pool, [first, second])
    slots, pages = np.asarray(host.cache[0].k), np.asarray(pool.k)
    np.testing.assert_array_equal(slots[:, 1], whole.k[:, 2])
    np.testing.assert_array_equal(slots[:, 0], whole.k[:, 3])
    np.testing.assert_array_equal(slots[:, SLOTS + 1 + 1], whole.k[:, PAGES + 6])  # replica 1's slot 1
    np.testing.assert_array_equal(pages[:, PAGES + 4], whole.k[:, PAGES + 6])  # ... loaded into its page 4
    np.testing.assert_array_equal(pages[:, 1:PAGES], whole.k[:, 1:PAGES])  # replica 0's pages untouched
    for kind in ("offload", "load"):
        text = host.program(kind, 0, pool).as_text()
        assert "all-gather" not in text and "all-reduce" not in text and "collective-permute" not in text, kind
