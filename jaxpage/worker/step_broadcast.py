"""Several hosts: what process 0 runs next reaches every process, so that all run the same SPMD programs.

Process 0 (the leader) schedules; before each program it launches with arrays it made on the host (a step, a
page copy, a draft model's proposal, a pool reset) it sends a message (jaxpage.worker.executor, the one door to the
device): a header (what to run, on which runner, for which compiled shape) and the arrays, packed into bytes. The
other processes (followers, in `LLMEngine.follow`) receive it, unpack the arrays after the same template (the
runner's padding input of that shape) and launch the same program on their own devices. Messages travel by JAX's
own collective broadcast (`multihost_utils.broadcast_one_to_all`) over the devices of every process: no transport
of our own.

Each message is two broadcasts: the header (a fixed HEADER_WORDS int32), then the payload padded to a power of two
of int32 words (at least MIN_PAYLOAD_WORDS), so that a handful of broadcast programs serve every message;
`warmup` compiles them. Sections that every process runs in the same order by itself (building the engine, its
warm-up) send nothing: `lockstep()`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils

HEADER_WORDS = 8
MIN_PAYLOAD_WORDS = 256


class Message(enum.IntEnum):
    CONFIG = 1  # the leader's engine arguments (JSON): the followers build the same engine
    WARMUP = 2  # LLMEngine.warmup
    COPY = 3  # copy-on-write page copies; key: their count
    STEP = 4  # a step's forward pass and sampler; key: the step shape's index; flag: with a draft model's probs
    PROPOSE = 5  # a draft model's proposal; key: the verify shape's index
    FORWARD = 6  # the forward pass alone (a draft model catching up); key: the step shape's index
    RESET = 7  # a fresh pool after a failed step
    STOP = 8  # the leader's engine shut down
    PROMPT_LOGPROBS = 9  # prompt log-probs from the latest step's hidden rows; payload: the prompt tokens asked about
    LORA = 10  # a LoRA adapter's weights into its device slot; key: the slot
    OFFLOAD = 11  # the host tier's copies of device pages into host slots; key: the pool's group of layers
    LOAD = 12  # the host tier's copies of host slots into device pages; key: the pool's group of layers


@dataclasses.dataclass(frozen=True)
class Header:
    kind: Message
    runner: int = 0  # 0: the target model's ModelRunner, 1: the draft model's
    key: int = 0
    flag: int = 0
    num_bytes: int = 0  # of the payload


def pack(tree) -> bytes:
    """The arrays of `tree` (numpy, any dtype), their bytes one after the other, in tree order."""
    return b"".join(np.ascontiguousarray(x).tobytes() for x in jax.tree.leaves(tree))


def unpack(data: bytes, template):
    """`template` (a tree of arrays) with its arrays' values read from `data` (as `pack` wrote them)."""
    leaves, treedef = jax.tree.flatten(template)
    leaves = [np.asarray(leaf) for leaf in leaves]
    expected = sum(leaf.nbytes for leaf in leaves)
    if expected != len(data):
        raise ValueError(f"a message of {len(data)} bytes does not match its template's {expected}")
    values, offset = [], 0
    for leaf in leaves:
        values.append(np.frombuffer(data, leaf.dtype, leaf.size, offset).reshape(leaf.shape).copy())
        offset += leaf.nbytes
    return jax.tree.unflatten(treedef, values)


def payload_words(num_bytes: int) -> int:
    """The int32 words a payload of num_bytes travels in: a power of two, at least MIN_PAYLOAD_WORDS."""
    words = -(-num_bytes // 4)
    return max(MIN_PAYLOAD_WORDS, 1 << max(words - 1, 0).bit_length())


class StepBroadcast:
    """The leader's messages to the followers (see the module's docstring). On a follower, `send` does nothing
    and `receive` waits for the next message."""

    def __init__(self):
        self.is_leader = jax.process_index() == 0
        self._quiet = 0  # depth of lockstep sections
        self._stopped = False
        self._lock = threading.Lock()  # the header and payload of one message go together

    @contextlib.contextmanager
    def lockstep(self):
        """A section every process runs by itself in the same order: the leader sends nothing inside it."""
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    def send(self, kind: Message, runner: int = 0, key: int = 0, flag: int = 0, payload=None) -> None:
        """On the leader, outside lockstep sections: the message (payload: a tree of numpy arrays, or bytes)."""
        if not self.is_leader or self._quiet or self._stopped:
            return
        data = payload if isinstance(payload, bytes) else pack(payload) if payload is not None else b""
        header = np.zeros(HEADER_WORDS, np.int32)
        header[:5] = (int(kind), runner, key, flag, len(data))
        with self._lock:
            self._broadcast(header)
            if data:
                words = np.zeros(payload_words(len(data)), np.int32)
                words.view(np.uint8)[: len(data)] = np.frombuffer(data, np.uint8)
                self._broadcast(words)

    def receive(self) -> tuple[Header, bytes]:
        """On a follower: the leader's next message (waits for it)."""
        header = self._broadcast(np.zeros(HEADER_WORDS, np.int32))
        kind, runner, key, flag, num_bytes = (int(x) for x in header[:5])
        data = b""
        if num_bytes:
            words = self._broadcast(np.zeros(payload_words(num_bytes), np.int32))
            data = words.view(np.uint8)[:num_bytes].tobytes()
        return Header(Message(kind), runner, key, flag, num_bytes), data

    def stop(self) -> None:
        """On the leader: tells the followers that its engine is done (once; later messages are not sent)."""
        if self.is_leader and not self._stopped:
            self.send(Message.STOP)
            self._stopped = True

    def warmup(self, payload_sizes) -> None:
        """Compiles the broadcast of the header and of every payload size in `payload_sizes` (bytes), on every
        process in the same order (inside a lockstep section)."""
        self._broadcast(np.zeros(HEADER_WORDS, np.int32))
        for words in sorted({payload_words(n) for n in payload_sizes}):
            self._broadcast(np.zeros(words, np.int32))

    def _broadcast(self, words: np.ndarray) -> np.ndarray:
        """The leader's `words` (int32) on every process; the others pass an array of the same shape."""
        return multihost_utils.broadcast_one_to_all(words)

    def share_config(self, config):
        """Every process gets the leader's EngineConfig (the followers' own are replaced), so that all build the
        same engine."""
        from jaxpage.config import EngineConfig

        if self.is_leader:
            self.send(Message.CONFIG, payload=json.dumps(dataclasses.asdict(config)).encode())
            return config
        header, data = self.receive()
        if header.kind is not Message.CONFIG:
            raise RuntimeError(f"expected the leader's engine arguments, got message {header.kind.name}")
        return EngineConfig(**json.loads(data))

    def agree_min(self, value: int) -> int:
        """The smallest of every process's `value` (each host sizes its memory by itself)."""
        return int(np.min(multihost_utils.process_allgather(np.int32(value))))
