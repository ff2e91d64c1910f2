"""LoRA adapters through the server and batch jobs (jaxpage.entrypoints.served_models): `--lora-modules` adapters and
the base model picked by a request's `model` (the openai client), listed by /v1/models with their base as parent,
loaded and unloaded while serving (vLLM's endpoints, behind the API key); batch lines naming adapters; bad names,
bodies and adapters refused by name. Each adapter's completion is transformers + PEFT's greedy text."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import threading

import httpx
import openai
import pytest
from hf_reference import hf_greedy_tokens
from live_server import LiveServer
from test_batch import read_records, write_lines
from tiny_models import TINY_ENGINE

from jaxpage.entrypoints.async_engine import AsyncEngine
from jaxpage.entrypoints.batch import BatchError, run_batch
from jaxpage.entrypoints.cli import main
from jaxpage.entrypoints.llm import LLM
from jaxpage.entrypoints.served_models import LoRAModule, parse_lora_module
from jaxpage.entrypoints.server import create_app
from jaxpage.errors import ModelLoadError
from jaxpage.tokenizers.tokenizer import IncrementalDetokenizer

PROMPTS = [[5, 9, 13, 2, 40, 9, 9, 31], [77, 3, 64, 12, 12, 50]]
MAX_TOKENS = 8
KEY = {"Authorization": "Bearer sesame"}


@pytest.fixture(scope="module")
def model(tiny_dir, lora_adapters, tmp_path_factory):
    """(the tiny model's directory with a tokenizer, {name: adapter directory}, {name: PEFT's model, None: the
    base's}); the model is lora_adapters' (the same weights), so its adapters fit it."""
    _, hf, made = lora_adapters
    paths = {name: request.lora_path for name, (request, _) in made.items()}
    return tiny_dir, paths, {None: hf} | {name: peft for name, (_, peft) in made.items()}


@pytest.fixture(scope="module")
def llm(model):
    """The engine of this file: a batch job runs it first, then the server (whose loop alone steps it)."""
    return LLM(model[0], enable_lora=True, max_loras=2, **TINY_ENGINE)


def greedy_text(llm, reference, prompt: list[int]) -> str:
    """The text of transformers' (+ PEFT's) greedy tokens, detokenized as the engine does."""
    detokenizer = IncrementalDetokenizer(llm.engine.tokenizer, prompt, skip_special_tokens=True)
    for token in hf_greedy_tokens(reference, [prompt], MAX_TOKENS)[0]:
        detokenizer.add(token)
    return detokenizer.text


def body(prompt, model_name=None) -> dict:
    fields = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return fields | ({} if model_name is None else {"model": model_name})


def test_a_batch_job_runs_each_line_with_the_adapter_its_model_names(model, llm, tmp_path):
    directory, paths, references = model
    names = [None, "all-r8", directory, "attention-r16", "no-such-adapter"]
    lines = [
        {"custom_id": f"r{i}", "url": "/v1/completions", "body": body(PROMPTS[i % 2], name)}
        for i, name in enumerate(names)
    ]
    write_lines(tmp_path / "in.jsonl", lines)
    modules = [LoRAModule("all-r8", paths["all-r8"]), LoRAModule("attention-r16", paths["attention-r16"])]
    summary = run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", llm, quiet=True, lora_modules=modules)
    assert (summary.succeeded, summary.failed) == (4, 1)
    records = read_records(tmp_path / "out.jsonl")
    for i, name in enumerate(names[:4]):
        response = records[f"r{i}"]["response"]["body"]
        adapter = None if name == directory else name
        assert response["choices"][0]["text"] == greedy_text(llm, references[adapter], PROMPTS[i % 2]), name
        assert response["model"] == (directory if adapter is None else adapter)
    refused = records["r4"]["response"]
    assert refused["status_code"] == 404
    assert "model 'no-such-adapter' does not exist" in refused["body"]["error"]["message"]
    with pytest.raises(BatchError, match="LoRA adapter 'broken'.*no adapter_config.json"):
        run_batch(tmp_path / "in.jsonl", tmp_path / "x.jsonl", llm, lora_modules=[LoRAModule("broken", str(tmp_path))])


@pytest.fixture(scope="module")
def served(model, llm):
    _, paths, _ = model
    engine = AsyncEngine(llm.engine).start()
    modules = [LoRAModule("all-r8", paths["all-r8"]), LoRAModule("attention-r16", paths["attention-r16"], "tiny-base")]
    server = LiveServer(create_app(engine, "tiny", api_key="sesame", lora_modules=modules))
    yield server
    server.stop()
    engine.shutdown(timeout_s=5)


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="sesame", max_retries=0)


def test_the_openai_client_picks_the_base_model_or_an_adapter_by_model(model, llm, client):
    _, _, references = model
    listed = {m.id: m.model_dump() for m in client.models.list().data}
    assert list(listed) == ["tiny", "all-r8", "attention-r16"]
    assert listed["tiny"]["parent"] is None and listed["all-r8"]["parent"] == "tiny"
    assert listed["attention-r16"]["parent"] == "tiny-base"  # as its --lora-modules JSON said
    assert listed["all-r8"]["root"] == model[1]["all-r8"]
    texts = {name: greedy_text(llm, references[name], PROMPTS[0]) for name in (None, "all-r8", "attention-r16")}
    assert len(set(texts.values())) == 3  # each adapter changes the text
    for name in ("tiny", "all-r8", "attention-r16"):
        reference = references[None if name == "tiny" else name]
        for prompt in PROMPTS:
            completion = client.completions.create(
                model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
            )
            assert completion.model == name
            assert completion.choices[0].text == greedy_text(llm, reference, prompt), name
    with pytest.raises(openai.NotFoundError, match="model 'mlp-r4-rslora' does not exist"):
        client.completions.create(model="mlp-r4-rslora", prompt=PROMPTS[0], max_tokens=2)


def test_adapters_are_loaded_and_unloaded_while_serving(model, llm, served, client, tmp_path):
    _, paths, references = model
    url = served.url
    load = {"lora_name": "mlp", "lora_path": paths["mlp-r4-rslora"]}
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=load).status_code == 401  # the API key is required
    loaded = httpx.post(f"{url}/v1/load_lora_adapter", json=load, headers=KEY)
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'mlp' added successfully."
    assert "mlp" in [m.id for m in client.models.list().data]
    completion = client.completions.create(
        model="mlp", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert completion.choices[0].text == greedy_text(llm, references["mlp-r4-rslora"], PROMPTS[1])

    def refused(path: str, fields: dict, status: int, message: str) -> None:
        response = httpx.post(f"{url}{path}", json=fields, headers=KEY)
        assert response.status_code == status and message in response.json()["error"]["message"], response.text

    refused("/v1/load_lora_adapter", load, 400, "LoRA adapter 'mlp': the name is taken by an adapter")
    refused("/v1/load_lora_adapter", {**load, "lora_name": "tiny"}, 400, "the name is taken by the base model")
    refused("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)}, 400, "no adapter_config.json")
    big = tmp_path / "big"
    shutil.copytree(paths["attention-r16"], big)
    settings = json.loads((big / "adapter_config.json").read_text())
    (big / "adapter_config.json").write_text(json.dumps(settings | {"r": 32}))
    refused("/v1/load_lora_adapter", {"lora_name": "big", "lora_path": str(big)}, 400, "rank 32 is larger")
    listed = tmp_path / "listed"  # a safetensors header that is a JSON list (once a 500)
    shutil.copytree(paths["attention-r16"], listed)
    header = b"[1, 2]"
    (listed / "adapter_model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    refused("/v1/load_lora_adapter", {"lora_name": "l", "lora_path": str(listed)}, 400, "adapter_model.safetensors")
    refused("/v1/load_lora_adapter", {"lora_name": "x"}, 400, "the body takes lora_name, lora_path: missing lora_path")
    refused("/v1/load_lora_adapter", {**load, "load_inplace": True}, 400, "unknown load_inplace")
    refused("/v1/load_lora_adapter", {"lora_name": 3, "lora_path": "x"}, 400, "lora_name")
    unloaded = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "mlp"}, headers=KEY)
    assert unloaded.status_code == 200 and unloaded.text == "Success: LoRA adapter 'mlp' removed successfully."
    refused("/v1/unload_lora_adapter", {"lora_name": "mlp"}, 404, "LoRA adapter 'mlp' is not loaded")
    with pytest.raises(openai.NotFoundError, match="model 'mlp' does not exist"):
        client.completions.create(model="mlp", prompt=PROMPTS[1], max_tokens=2)
    again = httpx.post(f"{url}/v1/load_lora_adapter", json={**load, "lora_path": paths["all-r8"]}, headers=KEY)
    assert again.status_code == 200  # the name is free again: now another adapter, with an id of its own
    completion = client.completions.create(
        model="mlp", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert completion.choices[0].text == greedy_text(llm, references["all-r8"], PROMPTS[1])
    assert llm.engine.input_processor.lora_adapters.num_read <= 2  # max_cpu_loras defaults to max_loras


def test_an_adapter_loading_stalls_no_other_request(model, llm, served, client, monkeypatch):
    """While an adapter is read (on a handler's thread), requests of the base model and of adapters already served
    run and finish; the engine's loop never waits for the read."""
    from jaxpage.engine import lora_adapters

    _, paths, references = model
    reading, release = threading.Event(), threading.Event()
    read = lora_adapters.read_lora_adapter

    def slow_read(path, *args):
        if path == paths["mlp-r4-rslora"]:
            reading.set()
            assert release.wait(timeout=120)
        return read(path, *args)

    monkeypatch.setattr(lora_adapters, "read_lora_adapter", slow_read)
    load = {"lora_name": "slow", "lora_path": paths["mlp-r4-rslora"]}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        loaded = pool.submit(httpx.post, f"{served.url}/v1/load_lora_adapter", json=load, headers=KEY, timeout=180)
        assert reading.wait(timeout=60)
        for name in ("tiny", "attention-r16"):
            completion = client.with_options(timeout=30).completions.create(
                model=name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
            )
            reference = references[None if name == "tiny" else name]
            assert completion.choices[0].text == greedy_text(llm, reference, PROMPTS[0])
        assert not loaded.done()  # the adapter is still being read
        release.set()
        assert loaded.result().status_code == 200


def test_a_server_without_an_api_key_or_without_lora_refuses_to_load_adapters(model, llm):
    directory, paths, _ = model
    plain = LLM(directory, **TINY_ENGINE)
    with pytest.raises(ValueError, match="LoRA adapter 'a': this server serves no LoRA adapters; start it with"):
        create_app(AsyncEngine(plain.engine), "tiny", lora_modules=[LoRAModule("a", paths["all-r8"])])
    with pytest.raises(ModelLoadError, match="LoRA adapter 'a'.*no adapter_config.json"):
        create_app(AsyncEngine(llm.engine), "tiny", lora_modules=[LoRAModule("a", directory)])
    server = LiveServer(create_app(AsyncEngine(llm.engine), "tiny"))  # (not started: nothing steps)
    try:
        response = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "x"})
        assert response.status_code == 403 and "needs a server started with --api-key" in response.text
    finally:
        server.stop()


@pytest.mark.parametrize(
    "value, message",
    [
        ("sql", "expected name=path or a JSON object"),
        ("=path", "expected name=path"),
        ('{"name": "a"}', 'expected {"name", "path", "base_model_name"}'),
        ('{"name": "a", "path": "p", "rank": 8}', "unknown keys ['rank']"),
        ("{not json", "not JSON"),
    ],
)
def test_lora_modules_values_are_parsed_as_vllm_writes_them_or_refused_by_name(value, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("{", r"\{")):
        parse_lora_module(value)


def test_lora_modules_forms_and_the_commands_refusals(capsys, tmp_path):
    assert parse_lora_module("sql=/a/b=c") == LoRAModule("sql", "/a/b=c")
    assert parse_lora_module('{"name": "s", "path": "/p", "base_model_name": "b"}') == LoRAModule("s", "/p", "b")
    assert main(["serve", "--lora-modules", f"sql={tmp_path}"]) != 0
    assert "--lora-modules needs --enable-lora" in capsys.readouterr().err
    assert main(["batch", "in", "out", "--enable-lora", "--lora-modules", "sql"]) != 0
    assert "expected name=path or a JSON object" in capsys.readouterr().err


def test_an_engine_process_serves_adapters_and_hears_of_one_unloaded(model, llm):
    """jaxpage serve's engine process: a request through an adapter gives PEFT's greedy text; an adapter unloaded
    in the server's process is forgotten by the engine process too (one message, which it takes)."""
    from jaxpage.entrypoints.engine_process import EngineProcess

    directory, paths, references = model
    args = dict(model=directory, enable_lora=True, max_loras=2, **TINY_ENGINE)
    engine = AsyncEngine(EngineProcess(args, warmup=False)).start()
    server = LiveServer(
        create_app(engine, "tiny", api_key="sesame", lora_modules=[LoRAModule("all-r8", paths["all-r8"])])
    )
    try:
        reply = httpx.post(f"{server.url}/v1/completions", json=body(PROMPTS[0], "all-r8"), headers=KEY, timeout=120)
        assert reply.json()["choices"][0]["text"] == greedy_text(llm, references["all-r8"], PROMPTS[0])
        sent = engine._core._sent
        assert (
            httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "all-r8"}, headers=KEY).status_code
            == 200
        )
        assert engine._core._sent == sent + 1  # ("forget_lora", its id)
        reply = httpx.post(
            f"{server.url}/v1/completions", json=body(PROMPTS[0]), headers=KEY, timeout=120
        )  # taken in turn
        assert reply.status_code == 200 and engine._core._taken == engine._core._sent
        assert (
            httpx.post(f"{server.url}/v1/completions", json=body(PROMPTS[0], "all-r8"), headers=KEY).status_code == 404
        )
    finally:
        server.stop()
        engine.shutdown(timeout_s=5)
