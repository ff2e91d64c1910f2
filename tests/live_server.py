"""A jaxpage server for the tests on a free port of 127.0.0.1: create_app served by uvicorn in a thread, or the
`jaxpage serve` command in a subprocess."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import httpx
import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """create_app served by uvicorn in a thread."""

    def __init__(self, app):
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def start_jaxpage_serve(arguments: list[str], port: int, timeout_s: float = 300) -> subprocess.Popen:
    """`python -m jaxpage serve ARGUMENTS` (which must give --port PORT) in a subprocess, once /health answers 200
    (stdout and stderr piped, as text)."""
    command = [sys.executable, "-m", "jaxpage", "serve", *arguments]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout_s
    while True:
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "jaxpage serve did not come up"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.2)
