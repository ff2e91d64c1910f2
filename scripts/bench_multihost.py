"""What process 0's messages to the other processes cost (jaxpage.worker.step_broadcast), on this machine.

    python scripts/bench_multihost.py [--processes 2] [--sizes 0,4096,32768,163840,655360] [--messages 50]

Starts --processes processes over 127.0.0.1 (jax.distributed, one CPU device each, JAX's CPU collectives: gloo),
has process 0 send --messages messages of each payload size (bytes; 0: a header alone, as a pool reset) and the
others receive them, after StepBroadcast.warmup has compiled each size's broadcast. Prints milliseconds per message
(process 0's wall clock) and, last, one JSON object. A step sends one message with its arrays, a few KB for a
decode step of a few rows and up to the block tables' width x rows x 4 bytes more: on real hosts the broadcast runs
over the accelerators' interconnect instead.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--sizes", default="0,4096,32768,163840,655360")
    parser.add_argument("--messages", type=int, default=50)
    parser.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)  # a started process
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def run_process(args) -> None:
    import numpy as np

    from jaxpage.entrypoints import distributed

    distributed.initialize(f"127.0.0.1:{args.port}", args.processes, args.process_id)
    from jaxpage.worker.step_broadcast import Message, StepBroadcast

    channel = StepBroadcast()
    sizes = [int(s) for s in args.sizes.split(",")]
    channel.warmup([s for s in sizes if s])
    results = {}
    for size in sizes:
        payload = np.arange(size // 4, dtype=np.int32) if size else None
        start = time.perf_counter()
        for _ in range(args.messages):
            if channel.is_leader:
                channel.send(Message.STEP, payload=payload)
            else:
                channel.receive()
        results[size] = (time.perf_counter() - start) / args.messages
    if channel.is_leader:
        print(f"{'payload bytes':>13} {'ms per message':>15}")
        for size, seconds in results.items():
            print(f"{size:>13} {seconds * 1e3:>15.2f}")
        print(json.dumps({"processes": args.processes, "ms_per_message": {s: t * 1e3 for s, t in results.items()}}))


def main() -> None:
    args = parse_args()
    if args.process_id is not None:
        run_process(args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = os.environ | {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    command = [sys.executable, __file__, "--processes", str(args.processes), "--sizes", args.sizes]
    command += ["--messages", str(args.messages), "--port", str(port)]
    jobs = [
        subprocess.Popen([*command, "--process-id", str(i)], env=env, stdout=None if i == 0 else subprocess.DEVNULL)
        for i in range(args.processes)
    ]
    sys.exit(max(job.wait() for job in jobs))


if __name__ == "__main__":
    main()
