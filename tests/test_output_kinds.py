"""SamplingParams.output_kind (vLLM's RequestOutputKind): which outputs LLMEngine.step returns. The same seeded
requests (n = 2, logprobs, a stop string, prompt log-probs) through one engine as CUMULATIVE, DELTA and FINAL_ONLY
give the same final completions; DELTA's outputs add up to them, FINAL_ONLY returns only the final one."""

from __future__ import annotations

import dataclasses

import pytest

from jaxpage.entrypoints.llm import LLM
from jaxpage.sampling_params import RequestOutputKind, SamplingParams

PROMPTS = [[5, 9, 13, 2, 40], [77, 3], list(range(10, 30))]


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(tiny_dir, max_model_len=96, max_num_seqs=4, max_num_batched_tokens=32, page_size=8)


def params(kind: RequestOutputKind, index: int) -> SamplingParams:
    return SamplingParams(
        n=2, temperature=1.0, seed=index, max_tokens=12, logprobs=2, prompt_logprobs=1, stop=["e"], output_kind=kind
    )


def run(llm, kind: RequestOutputKind) -> dict[str, list]:
    """Every output step() returned for each request, in order."""
    engine = llm.engine
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(f"{kind.name}-{index}", {"prompt_token_ids": prompt}, params(kind, index))
    outputs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs.setdefault(output.request_id.split("-")[1], []).append(output)
    return outputs


def approx_logprobs(entries):
    """Log-prob entries with their values as pytest.approx: runs in other batches (other step shapes) may differ in
    a float's last bits."""
    if entries is None:
        return None
    return [
        None if e is None else {t: (pytest.approx(lp.logprob, rel=1e-5, abs=1e-6), lp.rank) for t, lp in e.items()}
        for e in entries
    ]


def completions(output, approx: bool = False) -> list:
    """Its completions' fields; approx: the log-probs as pytest.approx (the expected side of a comparison)."""
    logprobs = approx_logprobs if approx else plain
    return [(c.text, c.token_ids, logprobs(c.logprobs), c.finish_reason, c.stop_reason) for c in output.outputs]


def plain(entries):
    return (
        None
        if entries is None
        else [None if e is None else {t: (lp.logprob, lp.rank) for t, lp in e.items()} for e in entries]
    )


def test_every_kind_gives_the_same_completions_and_delta_outputs_add_up_to_them(llm):
    cumulative, delta, final = (run(llm, kind) for kind in RequestOutputKind)
    assert cumulative.keys() == delta.keys() == final.keys() == {"0", "1", "2"}
    for request, outputs in cumulative.items():
        last = outputs[-1]
        assert last.finished and not any(o.finished for o in outputs[:-1])
        for earlier, later in zip(outputs[:-1], outputs[1:], strict=True):  # each output holds the one before it
            for a, b in zip(earlier.outputs, later.outputs, strict=True):
                assert b.text.startswith(a.text) and b.token_ids[: len(a.token_ids)] == a.token_ids
        # FINAL_ONLY: one output, the final one, as CUMULATIVE's last
        (only,) = final[request]
        assert only.finished and completions(only) == completions(last, approx=True)
        assert plain(only.prompt_logprobs) == approx_logprobs(last.prompt_logprobs) and only.prompt_logprobs
        # DELTA: the pieces add up to the final completions; the prompt's log-probs come once, first
        pieces = delta[request]
        assert pieces[-1].finished and not any(o.finished for o in pieces[:-1]) and len(pieces) > 1
        assert plain(pieces[0].prompt_logprobs) == approx_logprobs(last.prompt_logprobs)
        assert all(o.prompt_logprobs is None for o in pieces[1:])
        for i, expected in enumerate(last.outputs):
            text = "".join(o.outputs[i].text for o in pieces)
            token_ids = [t for o in pieces for t in o.outputs[i].token_ids]
            logprobs = [entry for o in pieces for entry in o.outputs[i].logprobs]
            assert (text, token_ids) == (expected.text, expected.token_ids)
            assert plain(logprobs) == approx_logprobs(expected.logprobs)
            assert (pieces[-1].outputs[i].finish_reason, pieces[-1].outputs[i].stop_reason) == (
                expected.finish_reason,
                expected.stop_reason,
            )
            assert pieces[-1].outputs[i].cumulative_logprob == pytest.approx(expected.cumulative_logprob, rel=1e-5)


def test_generate_reads_only_final_outputs_and_streams_as_asked(llm):
    """LLM.generate asks the engine for final outputs only (its results unchanged); generate_stream gives what the
    params ask for."""
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    given = [params(RequestOutputKind.CUMULATIVE, i) for i in range(len(PROMPTS))]
    generated = llm.generate(prompts, given)
    assert all(p.output_kind is RequestOutputKind.CUMULATIVE for p in given)  # the caller's params are left alone
    streamed = [o for o in llm.generate_stream(prompts, given) if o.finished]
    by_prompt = {o.prompt_token_ids[0]: o for o in streamed}
    assert [completions(o) for o in generated] == [completions(by_prompt[p[0]], approx=True) for p in PROMPTS]
    deltas = [dataclasses.replace(p, output_kind=RequestOutputKind.DELTA) for p in given]
    pieces = list(llm.generate_stream(prompts[:1], deltas[:1]))
    assert "".join(o.outputs[0].text for o in pieces) == generated[0].outputs[0].text


def test_output_kind_must_be_a_request_output_kind():
    with pytest.raises(ValueError, match="SamplingParams.output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind="delta")


def test_final_only_text_made_at_the_end_is_the_streamed_text(llm):
    """A FINAL_ONLY request without stop strings is detokenized when it ends, in one call: the same text as token by
    token, whether it finishes or is aborted half-way."""
    engine = llm.engine
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
        whole = SamplingParams(temperature=1.0, seed=7, max_tokens=16, skip_special_tokens=False, output_kind=kind)
        engine.add_request(f"whole-{kind.name}", {"prompt_token_ids": PROMPTS[0]}, whole)
        long = dataclasses.replace(whole, max_tokens=60, ignore_eos=True)
        engine.add_request(f"aborted-{kind.name}", {"prompt_token_ids": PROMPTS[1]}, long)
    finals, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        if steps == 6:
            engine.abort_request(["aborted-CUMULATIVE", "aborted-FINAL_ONLY"])
        for output in engine.step():
            assert output.request_id.endswith("CUMULATIVE") or output.finished  # FINAL_ONLY: the final one alone
            finals[output.request_id] = output
    for name in ("whole", "aborted"):
        (streamed,), (at_end,) = finals[f"{name}-CUMULATIVE"].outputs, finals[f"{name}-FINAL_ONLY"].outputs
        assert at_end.token_ids and at_end.text  # (tokens sampled before the abort too)
        assert (at_end.text, at_end.token_ids, at_end.finish_reason) == (
            streamed.text,
            streamed.token_ids,
            streamed.finish_reason,
        )
    assert finals["aborted-FINAL_ONLY"].outputs[0].finish_reason == "abort"
