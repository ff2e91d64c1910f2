"""The chat page at GET /, in a real headless browser (Debian's chromium, driven over the DevTools protocol): the test
types the API key the server asks for, then a message, waits for the reply streamed from /v1/chat/completions and
the tokens/s of the last reply, and saves a screenshot (chat-page.png in the test's tmp_path)."""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import shutil
import subprocess
import time

import httpx
import pytest
import websockets.sync.client
from live_server import LiveServer, free_port
from tiny_models import FULL_VOCAB_ENGINE

from jaxpage.entrypoints.async_engine import AsyncEngine
from jaxpage.entrypoints.llm import LLM
from jaxpage.entrypoints.server import create_app


@pytest.fixture(scope="module")
def chromium() -> str:
    """Debian's chromium, installed with apt-get where it is missing and this user can."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None and shutil.which("apt-get") and os.geteuid() == 0:
        install = ["apt-get", "install", "-y", "--no-install-recommends", "chromium"]
        if subprocess.run(install, capture_output=True, timeout=1200).returncode != 0:
            subprocess.run(["apt-get", "update"], capture_output=True, timeout=600)
            subprocess.run(install, capture_output=True, timeout=1200)
        path = shutil.which("chromium")
    if path is None:
        pytest.skip("chromium is not installed and cannot be installed here (apt-get install chromium needs root)")
    return path


@pytest.fixture(scope="module")
def server(full_vocab_dir):
    llm = LLM(full_vocab_dir, **FULL_VOCAB_ENGINE)
    engine = AsyncEngine(llm.engine).start()
    live = LiveServer(create_app(engine, "tiny", api_key="sesame"))
    yield live
    live.stop()
    engine.shutdown(timeout_s=5)


class Browser:
    """A headless chromium showing one page, driven over the DevTools protocol."""

    def __init__(self, chromium: str, url: str, profile):
        port = free_port()
        self.process = subprocess.Popen(
            [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--window-size=900,700",
             f"--remote-debugging-port={port}", f"--user-data-dir={profile}", url],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while True:
            try:
                pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json").json() if t["type"] == "page"]
                if pages:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and self.process.poll() is None, "chromium did not start"
            time.sleep(0.1)
        self.connection = contextlib.ExitStack()
        url = pages[0]["webSocketDebuggerUrl"]
        self.socket = self.connection.enter_context(websockets.sync.client.connect(url, max_size=None))
        self.ids = itertools.count(1)

    def call(self, method: str, **params) -> dict:
        call_id = next(self.ids)
        self.socket.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv(timeout=30))
            if message.get("id") == call_id:
                assert "error" not in message, message
                return message["result"]

    def evaluate(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 60):
        deadline = time.monotonic() + timeout
        while not (value := self.evaluate(expression)):
            assert time.monotonic() < deadline, f"timed out waiting for {expression}"
            time.sleep(0.1)
        return value

    def close(self) -> None:
        self.connection.close()
        self.process.kill()
        self.process.wait()


def test_a_message_typed_in_the_chat_page_gets_a_streamed_reply(chromium, server, tmp_path):
    browser = Browser(chromium, server.url, tmp_path / "profile")
    try:
        browser.wait_for("!document.getElementById('api-key-label').hidden")  # the server wants a key: asked for
        browser.evaluate("document.getElementById('api-key').focus()")
        browser.call("Input.insertText", text="sesame")
        browser.wait_for("document.getElementById('model').textContent === 'tiny'")  # /v1/models with the key
        browser.evaluate("document.getElementById('max-tokens').value = 12")
        browser.evaluate("document.getElementById('input').focus()")
        browser.call("Input.insertText", text="Hello there")  # typed, as by a keyboard
        for kind in ("keyDown", "keyUp"):
            browser.call("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter", windowsVirtualKeyCode=13)
        stats = browser.wait_for("document.getElementById('stats').textContent")
        assert "last reply: 12 tokens" in stats and "tokens/s" in stats, stats
        messages = browser.evaluate("[...document.querySelectorAll('.message')].map(m => [m.className, m.textContent])")
        assert messages[0] == ["message user", "Hello there"]
        assert messages[1][0] == "message assistant" and messages[1][1]
        png = base64.b64decode(browser.call("Page.captureScreenshot", format="png")["data"])
        assert png.startswith(b"\x89PNG")
        (tmp_path / "chat-page.png").write_bytes(png)
    finally:
        browser.close()
