"""`jaxpage serve` in a child process for the benchmarks, and one streaming completion timed as a client sees it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, engine_args: dict, port: int, timeout_s: float = 900) -> subprocess.Popen:
    """`python -m jaxpage serve` with these engine arguments (as flags), served model name "bench", once its /health
    answers 200 (after its warm-up); SystemExit if it exits or does not come up in `timeout_s`."""
    import httpx

    command = [sys.executable, "-m", "jaxpage", "serve", "--port", str(port), "--served-model-name", "bench"]
    if model:
        command += ["--model", model]
    for key, value in engine_args.items():
        flag = f"--{key.replace('_', '-')}"
        if isinstance(value, bool):  # --name / --no-name
            command.append(flag if value else f"--no-{flag[2:]}")
        elif value is not None:
            command += [flag, str(value)]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout_s
    while True:
        if server.poll() is not None:
            raise SystemExit(f"jaxpage serve exited: {server.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            server.kill()
            raise SystemExit(f"jaxpage serve did not come up in {timeout_s:.0f} s")
        time.sleep(0.5)


def completion_body(prompt: str | list[int], max_tokens: int) -> dict:
    """A streaming, greedy /v1/completions body that generates exactly max_tokens tokens (ignore_eos)."""
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def stream_completion(http, url: str, body: dict) -> dict:
    """Sends `body` to {url}/v1/completions and reads its events: {"sent", "done" (perf_counter seconds), "tokens"
    (the usage chunk's completion tokens), "chunk_times" (each chunk with a choice: a token, whose text the
    detokenizer may still hold back, as vLLM's benchmark counts)}."""
    sent = time.perf_counter()
    chunk_times, tokens = [], 0
    async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise SystemExit(f"the server answered {response.status_code}: {await response.aread()}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"]:
                chunk_times.append(time.perf_counter())
    return {"sent": sent, "done": time.perf_counter(), "tokens": tokens, "chunk_times": chunk_times}
