"""Several hosts (jaxpage.entrypoints.distributed, jaxpage.worker.step_broadcast): two processes on this machine,
joined over 127.0.0.1 by jax.distributed with JAX's CPU collectives, give one process's greedy completions; in one
process, an engine that replays the leader's messages ends with the leader's KV pool, bit for bit; bad arguments are
refused clearly."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import FAST_COMPILE
from live_server import free_port
from test_batch import PROMPTS, choices, completion_line, read_records, write_lines
from tiny_models import cli_options

from jaxpage.config import EngineConfig
from jaxpage.entrypoints import distributed
from jaxpage.entrypoints.cli import main
from jaxpage.entrypoints.llm import LLM
from jaxpage.sampling_params import SamplingParams
from jaxpage.worker.step_broadcast import Message, StepBroadcast, pack, payload_words, unpack

# Fewer rows than the tests' shared engine (tiny_models.TINY_ENGINE): these engines warm up, which compiles every
# step shape, and their programs (tensor-parallel, several processes) are theirs alone.
ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, page_size=8)
REPETITIVE = [(p * 8)[:24] for p in PROMPTS]  # n-gram and draft-model drafts get accepted


def batch_process(tiny_dir, input_path, output_path, port: int, process_id: int, devices: int, options: list):
    hosts = ["--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(process_id)]
    command = [
        sys.executable,
        "-m",
        "jaxpage",
        "batch",
        str(input_path),
        str(output_path),
        "--model",
        tiny_dir,
    ]
    # Each process its own simulated devices (the tests' 8 would not be its host's).
    env = os.environ | {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"}
    return subprocess.Popen(
        [*command, *cli_options(ENGINE), *hosts, *options, "--quiet"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


@pytest.mark.parametrize(
    "devices, options",
    [
        (1, ["--tensor-parallel-size", "2"]),  # a shard per process: every all-reduce crosses the processes
        (2, ["--tensor-parallel-size", "2", "--data-parallel-size", "2"]),  # a replica per process
        (1, ["--tensor-parallel-size", "2", "--speculative-config", "DRAFT"]),  # proposals and catch-up steps too
    ],
    ids=["tp2", "tp2xdp2", "tp2-draft-model"],
)
def test_two_processes_give_one_processs_greedy_completions(tiny_dir, tmp_path, devices, options):
    options = [json.dumps({"model": tiny_dir, "num_speculative_tokens": 3}) if o == "DRAFT" else o for o in options]
    write_lines(tmp_path / "in.jsonl", [completion_line(f"r{i}", p, max_tokens=16) for i, p in enumerate(REPETITIVE)])
    out, port = tmp_path / "out.jsonl", free_port()
    jobs = [batch_process(tiny_dir, tmp_path / "in.jsonl", out, port, i, devices, options) for i in (1, 0)]
    logs = []
    try:
        for job in jobs:
            logs.append(job.communicate(timeout=400)[0].decode(errors="replace"))
    finally:
        for job in jobs:
            job.kill()
    assert [job.returncode for job in jobs] == [0, 0], "\n".join(logs)
    assert "4 succeeded" in logs[1] and "Traceback" not in "".join(logs), "\n".join(logs)
    one = LLM(tiny_dir, **ENGINE).generate(
        [{"prompt_token_ids": p} for p in REPETITIVE], SamplingParams(temperature=0, max_tokens=16)
    )
    want = {f"r{i}": [(c.text, c.finish_reason) for c in o.outputs] for i, o in enumerate(one)}
    assert {k: choices(r) for k, r in read_records(out).items()} == want


class Recorder(StepBroadcast):
    """A leader's channel that keeps what it broadcasts."""

    def __init__(self):
        super().__init__()
        self.sent: list[np.ndarray] = []

    def _broadcast(self, words):
        self.sent.append(words.copy())
        return words


class Replayer(StepBroadcast):
    """A follower's channel that receives what a Recorder kept."""

    def __init__(self, sent: list[np.ndarray]):
        super().__init__()
        self.is_leader = False
        self._sent = iter(sent)

    def _broadcast(self, words):
        sent = next(self._sent)
        assert sent.shape == words.shape and sent.dtype == words.dtype, "a message out of step"
        return sent


def attach(engine, channel) -> None:
    engine.channel = engine.executor.channel = channel
    engine.is_leader = channel.is_leader


@pytest.mark.parametrize(
    "extra",
    [{}, {"speculative_config": "DRAFT"}, {"tensor_parallel_size": 2}, {"kv_offload_bytes": 1 << 20, "num_pages": 18}],
    ids=["one-device", "draft", "tp2", "host-tier"],
)
def test_a_follower_replaying_the_leaders_messages_ends_with_its_pool(tiny_dir, extra):
    if extra.get("speculative_config") == "DRAFT":
        extra = {"speculative_config": {"model": tiny_dir, "num_speculative_tokens": 3}}
    leader, follower = (LLM(tiny_dir, **ENGINE, **extra) for _ in range(2))
    recorder = Recorder()
    attach(leader.engine, recorder)
    leader.engine.warmup()
    prompts = [{"prompt_token_ids": p} for p in REPETITIVE]
    leader.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    run_step = leader.engine.runner._run_step

    def fails(*args):
        raise RuntimeError("the device step failed")

    leader.engine.runner._run_step = fails  # after the step's message: the engine resets the pools (RESET)
    assert leader.generate(prompts[:1], SamplingParams(max_tokens=4))[0].outputs[0].finish_reason == "error"
    leader.engine.runner._run_step = run_step
    # Parallel samples share their prompt's last page: copy-on-write copies; seeds, logprobs: sampler inputs.
    leader.generate(prompts[:2], SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=10, logprobs=2))
    leader.generate(prompts[1:], SamplingParams(temperature=0, max_tokens=6))
    if "kv_offload_bytes" in extra:  # other prompts evict these to host memory, from where they come back
        others = [{"prompt_token_ids": [t + 1 for t in p["prompt_token_ids"]]} for p in prompts]
        for batch in (others, prompts):
            leader.generate(batch, SamplingParams(temperature=0, max_tokens=6))
    leader.engine.shutdown()
    kinds = [Message(int(words[0])) for words in recorder.sent if len(words) == 8 and words[0]]
    assert {Message.WARMUP, Message.COPY, Message.STEP, Message.RESET, Message.STOP} <= set(kinds)
    if "speculative_config" in extra:
        assert {Message.PROPOSE, Message.FORWARD} <= set(kinds)
    if "kv_offload_bytes" in extra:  # the host tier's copies: pages evicted to host slots, and loaded back
        assert {Message.OFFLOAD, Message.LOAD} <= set(kinds)
    attach(follower.engine, Replayer(recorder.sent))
    follower.engine.follow()
    for name in ("runner", "draft_runner"):
        ours, theirs = getattr(leader.engine, name), getattr(follower.engine, name)
        if ours is not None:
            assert np.array_equal(ours.kv_cache.k, theirs.kv_cache.k)
            assert np.array_equal(ours.kv_cache.v, theirs.kv_cache.v)
            assert {str(c.shape) for c in ours.compile_log} == {str(c.shape) for c in theirs.compile_log}
    if "kv_offload_bytes" in extra:
        ours, theirs = (llm.engine.runner.pool.host.cache[0] for llm in (leader, follower))
        assert np.array_equal(ours.k, theirs.k) and np.array_equal(ours.v, theirs.v)


def test_pack_and_unpack():
    tree = {"ids": np.arange(5, dtype=np.int32), "p": np.float32([[0.5, 2.0]]), "flag": np.bool_(True)}
    back = unpack(pack(tree), jax.tree.map(np.zeros_like, tree))
    pairs = zip(jax.tree.leaves(back), jax.tree.leaves(tree), strict=True)
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in pairs)
    with pytest.raises(ValueError, match="does not match"):
        unpack(b"\0" * 3, (np.zeros(1, np.int32),))
    assert payload_words(1) == payload_words(1024) == 256 and payload_words(1025) == 512


def test_bad_arguments_are_refused_clearly(tiny_dir, capsys):
    with pytest.raises(ValueError, match="coordinator_address must be host:port"):
        EngineConfig(coordinator_address="localhost")
    with pytest.raises(ValueError, match="num_processes must be an integer >= 1"):
        EngineConfig(num_processes=0)
    with pytest.raises(ValueError, match=r"process_id must be an integer in \[0, 1\]"):
        EngineConfig(num_processes=2, process_id=2)
    assert main(["batch", "in.jsonl", "out.jsonl", "--coordinator-address", "nowhere"]) == 2
    assert "coordinator_address must be host:port" in capsys.readouterr().err
    engine = LLM(tiny_dir, **ENGINE).engine
    with pytest.raises(ValueError, match="cannot join the other processes.*before any JAX calls"):
        distributed.initialize("127.0.0.1:1", 2, 0)  # this process runs JAX already: too late to join others
    with pytest.raises(RuntimeError, match="process 0, which leads"):
        engine.follow()
    engine.is_leader = False  # as on process 1
    with pytest.raises(RuntimeError, match="follows process 0"):
        engine.add_request("a", {"prompt_token_ids": [1, 2]})
