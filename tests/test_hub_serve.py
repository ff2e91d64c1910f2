"""`jaxpage serve org/name` on a machine that has nothing: one command from a Hub id to a chat reply (the download's
progress shown, the model's generation config's defaults taken and logged), and a second start with the Hub gone and
HF_HUB_OFFLINE=1 serving from the cache. A subprocess: the command line and the process's environment are the test."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import openai
from fake_hub import fake_hub  # noqa: F401  (the fixture)
from live_server import free_port, start_jaxpage_serve
from tiny_models import FULL_VOCAB_ENGINE, cli_options

GENERATION_CONFIG = {"eos_token_id": 2, "temperature": 0.0, "top_k": 4, "max_new_tokens": 3, "do_sample": True}


def serve(model: str, *extra: str) -> tuple[subprocess.Popen, openai.OpenAI]:
    port = free_port()
    process = start_jaxpage_serve([model, "--port", str(port), *cli_options(FULL_VOCAB_ENGINE), *extra], port)
    return process, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)


def stop(process: subprocess.Popen) -> str:
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr[-3000:]
    return stderr


def test_serve_a_hub_id_then_again_offline(fake_hub, full_vocab_dir, monkeypatch):  # noqa: F811
    files = {p.name: p.read_bytes() for p in Path(full_vocab_dir).iterdir() if p.is_file()}
    files |= {"generation_config.json": json.dumps(GENERATION_CONFIG).encode(), "pytorch_model.bin": bytes(4096)}
    fake_hub.add_repo("org/tiny-chat", files)
    messages = [{"role": "user", "content": "Say hi."}]

    process, client = serve("org/tiny-chat")
    try:
        reply = client.chat.completions.create(model="org/tiny-chat", messages=messages)  # no sampling fields
        assert reply.model == "org/tiny-chat"
        assert reply.usage.completion_tokens <= 3  # the generation config's max_new_tokens
        again = client.chat.completions.create(model="org/tiny-chat", messages=messages)
        assert again.choices[0].message.content == reply.choices[0].message.content  # its temperature 0
    finally:
        stderr = stop(process)
    assert "Fetching" in stderr  # huggingface_hub's progress bar
    assert "sampling defaults from the model's generation config" in stderr and "'max_tokens': 3" in stderr
    assert "pytorch_model.bin" not in {name for _, name in fake_hub.files_served}

    fake_hub.stop()  # no Hub now: the cache alone
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    process, client = serve("org/tiny-chat", "--served-model-name", "tiny", "chat")
    try:
        offline = client.chat.completions.create(model="chat", messages=messages)
        assert (offline.model, offline.choices[0].message.content) == ("chat", reply.choices[0].message.content)
    finally:
        stop(process)
