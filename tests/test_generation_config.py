"""The model's generation_config.json (jaxpage.models.generation_config): its EOS ids end sequences, its sampling
fields are the defaults of requests that leave them unset (Python API, server and batch bodies), --generation-config
vllm reads none, overrides set fields over it; a bad file is a ModelLoadError naming the file and the field."""

from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import FULL_VOCAB_ENGINE

from jaxpage import LLM, SamplingParams
from jaxpage.entrypoints.batch import run_batch
from jaxpage.entrypoints.openai_api import CHAT, COMPLETIONS, parse_request
from jaxpage.errors import ModelLoadError
from jaxpage.models.generation_config import FILE, generation_defaults

PROMPT = {"prompt_token_ids": [5, 17, 230, 41, 9]}
GREEDY_8 = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def write(directory, fields) -> None:
    (directory / FILE).write_text(json.dumps(fields))


def test_fields_read_by_sampling_params_names(tmp_path):
    write(tmp_path, {"eos_token_id": [7, 9], "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                     "repetition_penalty": 1.1, "max_new_tokens": 64, "do_sample": True, "top_a": None,
                     "pad_token_id": 0, "transformers_version": "4.51.0"})  # fmt: skip
    defaults = generation_defaults("auto", tmp_path)
    assert defaults.eos_token_ids == (7, 9)
    assert defaults.sampling_dict == dict(
        temperature=0.6, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1, max_tokens=64
    )
    assert defaults.source == str(tmp_path / FILE)
    params = defaults.sampling_params()
    assert (params.temperature, params.top_k, params.max_tokens) == (0.6, 20, 64)


def test_one_eos_id_nulls_and_no_file(tmp_path):
    write(tmp_path, {"eos_token_id": 3, "temperature": None})
    one = generation_defaults("auto", tmp_path)
    assert (one.eos_token_ids, one.sampling) == ((3,), ())
    assert generation_defaults("auto", tmp_path / "elsewhere").sampling == ()  # a directory without the file
    assert generation_defaults("auto", None).eos_token_ids == ()  # the default model, a GGUF file: none


def test_vllm_reads_none_and_overrides_set_fields(tmp_path):
    write(tmp_path, {"eos_token_id": 3, "temperature": 0.6, "top_p": 0.9})
    vllm = generation_defaults("vllm", tmp_path, {"temperature": 0.2})
    assert (vllm.eos_token_ids, vllm.sampling_dict, vllm.source) == (
        (),
        {"temperature": 0.2},
        "override_generation_config",
    )
    auto = generation_defaults("auto", tmp_path, {"temperature": 0.2, "max_new_tokens": 10})
    assert auto.sampling_dict == {"temperature": 0.2, "top_p": 0.9, "max_tokens": 10}
    other = tmp_path / "other"
    other.mkdir()
    write(other, {"top_k": 5})
    assert generation_defaults(str(other), tmp_path).sampling_dict == {"top_k": 5}  # a directory named instead


@pytest.mark.parametrize(
    ("mode", "overrides", "message"),
    [
        ("/no/such/dir", None, "generation_config must be 'auto', 'vllm' or a directory holding generation_config"),
        ("auto", {"do_sample": False}, r"override_generation_config has fields jaxpage does not read: \['do_sample'\]"),
        ("auto", {"temperature": -1}, "override_generation_config: temperature must be"),
        ("auto", {"eos_token_id": "2"}, "override_generation_config: eos_token_id must be a token id"),
    ],
)
def test_bad_modes_and_overrides_are_refused_by_name(tmp_path, mode, overrides, message):
    with pytest.raises(ValueError, match=message):
        generation_defaults(mode, tmp_path, overrides)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temperature": "hot"}, "temperature must be"),
        ({"top_p": 0}, "top_p must be"),
        ({"top_k": 1.5}, "top_k must be"),
        ({"max_new_tokens": 0}, "max_new_tokens must be"),
        ({"repetition_penalty": -2}, "repetition_penalty must be"),
        ({"eos_token_id": []}, "eos_token_id must be"),
        ({"eos_token_id": [1, -1]}, "eos_token_id must be"),
        ({"eos_token_id": True}, "eos_token_id must be"),
    ],
)
def test_bad_fields_name_the_file_and_field(tmp_path, fields, message):
    write(tmp_path, fields)
    with pytest.raises(ModelLoadError, match=f"{FILE}: {message}"):
        generation_defaults("auto", tmp_path)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
READ = ["temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens", "eos_token_id"]


@settings(max_examples=150, deadline=None)
@given(document=JSON | st.dictionaries(st.sampled_from([*READ, "do_sample"]), JSON, max_size=4))
def test_any_json_document_loads_or_is_a_model_load_error_naming_the_file(tmp_path_factory, document):
    directory = tmp_path_factory.mktemp("generation")
    (directory / FILE).write_text(json.dumps(document))
    try:
        generation_defaults("auto", directory)
    except ModelLoadError as e:
        assert str(e).startswith(str(directory / FILE))


def test_a_file_that_is_no_json_is_named(tmp_path):
    (tmp_path / FILE).write_bytes(b"\xff{")
    with pytest.raises(ModelLoadError, match=f"{FILE}: not readable JSON"):
        generation_defaults("auto", tmp_path)


def test_server_and_batch_bodies_take_the_defaults_for_the_fields_they_leave_out():
    defaults = {"temperature": 0.25, "top_k": 3, "max_tokens": 7}
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    request = parse_request(CHAT, chat, defaults=defaults)
    assert (request.params.temperature, request.params.top_k, request.params.max_tokens) == (0.25, 3, 7)
    assert request.default_max_tokens  # the server bounds it by the context instead of refusing the request
    assert not parse_request(CHAT, chat | {"max_tokens": 7}, defaults=defaults).default_max_tokens
    params = parse_request(CHAT, chat | {"temperature": 1.5, "max_completion_tokens": 2}, defaults=defaults).params
    assert (params.temperature, params.top_k, params.max_tokens) == (1.5, 3, 2)
    params = parse_request(CHAT, chat | {"max_tokens": None}, defaults=defaults).params
    assert params.max_tokens is None  # null asks for the context's length, as without defaults
    params = parse_request(COMPLETIONS, {"prompt": "hi"}, defaults=defaults).params
    assert (params.temperature, params.max_tokens) == (0.25, 7)
    assert parse_request(COMPLETIONS, {"prompt": "hi"}).params.max_tokens == 16  # OpenAI's, without defaults


@pytest.fixture(scope="module")
def model_dir(full_vocab_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("generation-config-model")
    shutil.copytree(full_vocab_dir, directory, dirs_exist_ok=True)
    return directory


def test_eos_ids_and_defaults_of_the_file_reach_the_engine(model_dir):
    # 'vllm' reads no file: only the override shapes what a request without sampling params gets.
    write(model_dir, {"temperature": 1.7, "max_new_tokens": 6})
    llm = LLM(str(model_dir), generation_config="vllm", override_generation_config={"temperature": 0.0,
              "max_new_tokens": 3}, **FULL_VOCAB_ENGINE)  # fmt: skip
    greedy = llm.generate(PROMPT, GREEDY_8)[0].outputs[0].token_ids
    assert llm.generate(PROMPT)[0].outputs[0].token_ids == greedy[:3]
    # A token the model's config.json does not end on: only the generation config's EOS list stops it there.
    stop_at = next(i for i in range(1, len(greedy)) if greedy[i] not in greedy[:i])
    config_eos = json.loads((model_dir / "config.json").read_text())["eos_token_id"]
    assert greedy[stop_at] != config_eos
    write(model_dir, {"eos_token_id": [config_eos, greedy[stop_at]], "temperature": 0.0, "max_new_tokens": 6})
    llm = LLM(str(model_dir), **FULL_VOCAB_ENGINE)  # generation_config "auto"
    assert (llm.get_default_sampling_params().temperature, llm.get_default_sampling_params().max_tokens) == (0.0, 6)
    out = llm.generate(PROMPT)[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == (greedy[: stop_at + 1], "stop")
    # Sampling params given are the caller's: no default changes them, and ignore_eos passes the EOS ids by.
    assert llm.generate(PROMPT, GREEDY_8)[0].outputs[0].token_ids == greedy
    # A batch line without sampling fields gets the same defaults (its text: the tokens up to the EOS, skipped).
    body = {"prompt": PROMPT["prompt_token_ids"]}
    lines = [{"custom_id": "defaults", "method": "POST", "url": "/v1/completions", "body": body}]
    (model_dir / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    run_batch(model_dir / "in.jsonl", model_dir / "out.jsonl", llm, quiet=True)
    result = json.loads((model_dir / "out.jsonl").read_text())["response"]["body"]
    assert (result["usage"]["completion_tokens"], result["choices"][0]["finish_reason"]) == (stop_at + 1, "stop")
