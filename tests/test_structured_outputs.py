"""Structured outputs (jaxpage.structured, SamplingParams.structured_outputs): every token a constrained request
emits is one its grammar accepts, whatever the engine does around it (chunked prefill, preemption, prefix caching,
n > 1, stop strings, max_tokens, speculative decoding); grammars compile once per spec, and a bad one is refused at
add_request. A tiny random model with SmolLM2's vocabulary and tokenizer writes the outputs (it knows no JSON: only
the grammar makes them valid); the default model's answers to 24 schemas must all validate."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxpage.benchmarks.json_schemas import SCHEMA_TASKS
from jaxpage.entrypoints.llm import LLM
from jaxpage.sampling_params import SamplingParams, StructuredOutputsParams
from jaxpage.structured.grammar import GrammarCompiler

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "pet": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
SPECS = [
    StructuredOutputsParams(json=SCHEMA),
    StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"),
    StructuredOutputsParams(choice=["yes", "no", "maybe later"]),
    StructuredOutputsParams(grammar='start: "(" item ("," item)* ")"\nitem: /[a-z]{1,3}/'),
    StructuredOutputsParams(json_object=True),
]


def make_llm(model_dir, **engine_args) -> LLM:
    args = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, page_size=4)
    return LLM(model_dir, **args | engine_args)


def prompts(count: int) -> list[str]:
    return [f"Request {i}: write {'something ' * (i % 5)}now." for i in range(count)]


def fresh_matcher(llm: LLM, spec: StructuredOutputsParams):
    return llm.engine.input_processor.grammars.matcher(spec)


def assert_follows(llm: LLM, spec: StructuredOutputsParams, completion) -> None:
    """Every token of the completion is accepted by a fresh matcher of its grammar, in order; one that ended by
    itself ("stop", no stop string) holds a whole document of it."""
    matcher = fresh_matcher(llm, spec)
    tokens = completion.token_ids
    assert matcher.validate_tokens(tokens) == len(tokens), (spec, completion)
    assert matcher.consume_tokens(tokens)
    if completion.finish_reason == "stop" and not isinstance(completion.stop_reason, str):
        assert matcher.is_accepting(), completion
        if spec.kind == "json":
            jsonschema.validate(json.loads(completion.text), spec.json)
        elif spec.kind == "json_object":
            assert isinstance(json.loads(completion.text), dict)
        elif spec.kind == "choice":
            assert completion.text in spec.choice


@pytest.fixture(scope="module")
def llm(full_vocab_dir):
    """One engine for the module: a small pool (preemptions), 64-token steps (chunked prefill), prefix caching on,
    4 rows (few step shapes to warm up), asynchronous scheduling (a step whose sequences follow a grammar is taken
    before the next is scheduled; the free requests beside them are scheduled ahead)."""
    llm = make_llm(full_vocab_dir, num_pages=48, max_num_seqs=4, async_scheduling=True)
    llm.engine.warmup()
    return llm


def test_bad_specs_are_refused_at_add_request_naming_the_field(llm):
    engine = llm.engine
    bad = {
        "regex": StructuredOutputsParams(regex="a(b"),
        "grammar": StructuredOutputsParams(grammar="start: undefined_rule"),
        "json": StructuredOutputsParams(json={"type": "no-such-type"}),
    }
    for field, spec in bad.items():
        with pytest.raises(ValueError, match=rf"SamplingParams\.structured_outputs\.{field} does not compile"):
            engine.add_request("bad", "hello", SamplingParams(structured_outputs=spec))
        assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar, json_object"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="structured_outputs.json must be a JSON schema"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams or a dict"):
        SamplingParams(structured_outputs={"schema": {}})


def test_grammars_compile_once_per_spec(full_vocab_dir):
    from jaxpage.tokenizers.tokenizer import load_tokenizer

    compiler = GrammarCompiler(load_tokenizer(full_vocab_dir), 49152, [2])
    first = compiler.matcher(StructuredOutputsParams(json=SCHEMA))
    # The same schema as text with its keys in another order is the same spec.
    again = compiler.matcher(StructuredOutputsParams(json=json.dumps(dict(reversed(list(SCHEMA.items()))))))
    assert compiler.num_compiled == 1 and first is not again  # each sequence gets its own matcher
    assert first.consume_tokens(compiler.tokenizer.tokenize_str('{"name": "'))
    start = compiler.tokenizer.tokenize_str('{"name": "')
    assert again.validate_tokens(start) == len(start)  # at the start still: untouched by the other's tokens
    compiler.matcher(StructuredOutputsParams(regex="[0-9]+"))
    assert compiler.num_compiled == 2


def test_constrained_requests_mixed_with_free_ones(llm):
    """Constrained and free requests share steps under chunked prefill, preemption (a 47-page pool), prefix caching
    (shared prompt prefixes) and n = 2; every constrained token follows its grammar, the free requests' greedy
    outputs are the ones they have alone, no page is left referenced and nothing compiles after warm-up."""
    engine = llm.engine
    compiled = engine.runner.num_compilations
    preemptions = engine.scheduler.num_preemptions
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    shared = "A long shared system prompt that several requests start with, so its pages are cached. " * 2
    texts = [shared + p for p in prompts(12)]
    params = []
    for i in range(12):
        if i % 3 == 2:
            params.append(free)
        else:
            spec = SPECS[i % len(SPECS)]
            params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=60, n=2 if i % 4 == 0 else 1,
                                         structured_outputs=spec))  # fmt: skip
    outputs = llm.generate(texts, params, use_tqdm=False)
    for out, p in zip(outputs, params, strict=True):
        for completion in out.outputs:
            if p.structured_outputs is not None:
                assert_follows(llm, p.structured_outputs, completion)
    alone = llm.generate([texts[i] for i in range(12) if i % 3 == 2], free, use_tqdm=False)
    mixed = [outputs[i] for i in range(12) if i % 3 == 2]
    assert [o.outputs[0].token_ids for o in alone] == [o.outputs[0].token_ids for o in mixed]
    assert engine.scheduler.num_preemptions > preemptions  # the pool was tight enough to preempt
    assert engine.block_manager.num_used_pages == 0
    engine.block_manager.check_invariants()
    assert engine.runner.num_compilations == compiled


def test_max_tokens_stop_strings_and_eos_where_the_grammar_accepts(llm):
    # Cut mid-document by max_tokens: "length", a valid prefix.
    cut = SamplingParams(temperature=1.0, seed=3, max_tokens=5, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    completion = llm.generate("Hi", cut, use_tqdm=False)[0].outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 5
    assert_follows(llm, cut.structured_outputs, completion)
    # A stop string inside the document ends it there.
    stop = SamplingParams(
        temperature=0, max_tokens=60, stop=['"age"'], structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    completion = llm.generate("Hi", stop, use_tqdm=False)[0].outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == '"age"'
    assert completion.text.startswith('{"name": "') and '"age"' not in completion.text
    # A grammar that is complete ends the request without waiting for EOS; one that could go on allows EOS only
    # where it accepts, so every "stop" is a whole match.
    for spec in (StructuredOutputsParams(regex="[0-9]{3}"), StructuredOutputsParams(regex="[a-c]{1,40}")):
        for seed in range(4):
            p = SamplingParams(temperature=1.0, seed=seed, max_tokens=50, structured_outputs=spec)
            completion = llm.generate("Hi", p, use_tqdm=False)[0].outputs[0]
            assert_follows(llm, spec, completion)
            if spec.regex == "[0-9]{3}":
                assert completion.finish_reason == "stop" and len(completion.text) == 3 and completion.text.isdigit()


SCHEMA_PARTS = st.fixed_dictionaries(
    {},
    optional={
        "count": st.just({"type": "integer", "minimum": 0, "maximum": 999}),
        "flag": st.just({"type": "boolean"}),
        "kind": st.lists(st.sampled_from(["a", "bb", "ccc", "dd d"]), min_size=1, max_size=3, unique=True).map(
            lambda values: {"enum": values}
        ),
        "label": st.integers(1, 6).map(lambda n: {"type": "string", "maxLength": n}),
        "code": st.just({"type": "string", "pattern": "^[A-F]{2}[0-9]$"}),
        "items": st.integers(1, 3).map(lambda n: {"type": "array", "items": {"type": "integer"}, "maxItems": n}),
        "inner": st.just({"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}),
    },
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(properties=SCHEMA_PARTS, data=st.data(), seed=st.integers(0, 2**31 - 1))
def test_every_token_follows_random_schemas(llm, properties, data, seed):
    required = data.draw(st.lists(st.sampled_from(sorted(properties)), unique=True)) if properties else []
    schema = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    spec = StructuredOutputsParams(json=schema)
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=seed, n=2, max_tokens=60, structured_outputs=spec)
    for completion in llm.generate("Go", params, use_tqdm=False)[0].outputs:
        assert_follows(llm, spec, completion)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_checks_drafts_against_the_grammar(full_vocab_dir, method):
    """Drafts (n-gram lookup's, or a draft model's: the target itself, which knows no grammar) are verified under
    each position's grammar mask: greedy output is the same with and without speculation, every token follows the
    grammar, and drafts were accepted along the way."""
    spec_config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    if method == "draft_model":
        spec_config = {"method": "draft_model", "model": full_vocab_dir, "num_speculative_tokens": 3}
    small = dict(max_num_seqs=2, max_num_batched_tokens=32)  # few step shapes: warm-up compiles each
    plain = make_llm(full_vocab_dir, **small)
    speculating = make_llm(full_vocab_dir, speculative_config=spec_config, **small)
    speculating.engine.spec_decoder.policy.should_verify = lambda num_seqs, drafts, *shapes: bool(drafts)
    if method == "ngram":  # (a draft model's own programs are warmed up and checked in its own tests)
        speculating.engine.warmup()
    compiled = speculating.engine.runner.num_compilations
    repeated = 'Answer {"name": "ab", "age": 12, "pet": "cat"} {"name": "ab", "age": 12, "pet": "cat"} again'
    # What the model writes unconstrained, as one branch of a regex: drafts the grammar accepts (a draft model's too).
    free = plain.generate("Tell me", SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    own = StructuredOutputsParams(regex=f"({re.escape(free.text)})|(nothing)")
    specs = [SPECS[0], SPECS[3], StructuredOutputsParams(regex="(ab|cd){1,20}"), own]
    params = [SamplingParams(temperature=0, max_tokens=50, structured_outputs=s) for s in specs]
    texts = [repeated, "(ab,cd,ab,cd,ab,cd", "abababababcdcdcd", "Tell me"]
    expected = plain.generate(texts, params, use_tqdm=False)
    got = speculating.generate(texts, params, use_tqdm=False)
    for e, g, spec in zip(expected, got, specs, strict=True):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        assert_follows(speculating, spec, g.outputs[0])
    stats = speculating.engine.spec_decoding_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    if method == "ngram":
        assert speculating.engine.runner.num_compilations == compiled  # verify steps with masks were warmed up too
    assert speculating.engine.block_manager.num_used_pages == 0


def test_default_model_answers_validate_against_every_schema(smollm2_path):
    """The target: with the default model, every answer under the 24 schemas of jaxpage.benchmarks.json_schemas
    parses and validates (greedy, none cut by max_tokens)."""
    from jaxpage.tokenizers.tokenizer import encode_chat

    llm = LLM(str(smollm2_path), max_model_len=1024, max_num_seqs=24)  # all at once: a step reads every weight
    system = {"role": "system", "content": "Answer with a JSON object."}
    requests = [
        {"prompt_token_ids": encode_chat(llm.engine.tokenizer, [system, {"role": "user", "content": t.prompt}])}
        for t in SCHEMA_TASKS
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=200, structured_outputs=StructuredOutputsParams(json=t.schema))
        for t in SCHEMA_TASKS
    ]
    assert len(SCHEMA_TASKS) >= 20
    for task, out in zip(SCHEMA_TASKS, llm.generate(requests, params, use_tqdm=False), strict=True):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (task.name, completion.text)
        jsonschema.validate(json.loads(completion.text), task.schema)


def test_llguidance_masks_match_the_matcher(llm):
    """The bitmask a step fills (jaxpage.structured.bitmask) allows exactly the tokens the matcher would consume."""
    import numpy as np

    from jaxpage.structured.bitmask import fill_grammar_bitmasks

    matcher = fresh_matcher(llm, SPECS[1])
    mask = np.zeros((2, 49152 // 32), np.int32)
    fill_grammar_bitmasks([(matcher, 0, [])], mask)
    bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little").astype(bool)
    allowed = np.flatnonzero(bits)
    assert 0 < len(allowed) < 49152
    for token in allowed[:50]:
        assert matcher.validate_tokens([int(token)]) == 1
    refused = np.flatnonzero(~bits)[:50]
    assert all(matcher.validate_tokens([int(t)]) == 0 for t in refused)
