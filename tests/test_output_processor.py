"""The output processor (host-only): text, stop strings and outputs from the scheduler's updates, with a fake
detokenizer whose token t is the letter chr(t)."""

from __future__ import annotations

import pytest

from jaxpage.engine.output_processor import OutputProcessor, Request
from jaxpage.engine.scheduler import SequenceUpdate
from jaxpage.outputs import CompletionOutput, RequestMetrics
from jaxpage.sampling_params import SamplingParams
from jaxpage.sequence import Sequence


class LetterDetokenizer:
    def __init__(self):
        self.text = ""

    def add(self, token: int) -> str:
        self.text += chr(token)
        return chr(token)


class NoLogprobs:
    logprobs = None


def processor_with_request(params: SamplingParams, detokenizer=None):
    params.validate()
    seq = Sequence(0, [1, 2], sampling_params=params)
    request = Request(
        "r",
        None,
        [1, 2],
        params,
        [seq],
        [detokenizer or LetterDetokenizer()],
        [CompletionOutput(0, "", [])],
        RequestMetrics(0.0),
    )
    processor = OutputProcessor(tokenizer=None)
    processor.add(request)
    return processor, seq


def process(processor, seq, text: str, finish_reason=None, stop_reason=None):
    update = SequenceUpdate(seq, 0, [ord(c) for c in text], 0, 0, finish_reason, stop_reason)
    return processor.process([([update], NoLogprobs())], now=1.0)


def test_a_stop_string_inside_the_step_s_tokens_ends_the_completion_at_the_token_that_completes_it():
    processor, seq = processor_with_request(SamplingParams(stop=["cd"]))
    (out,), ended = process(processor, seq, "abcdef")  # accepted drafts then the sampled token, in one step
    completion = out.outputs[0]
    assert completion.text == "ab" and completion.token_ids == [ord(c) for c in "abcd"]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", "cd") and out.finished
    assert ended == [(0, seq)]  # the scheduler did not end it: the engine must
    assert not processor.requests


def test_no_stop_string_ends_an_output_shorter_than_min_tokens():
    processor, seq = processor_with_request(SamplingParams(stop=["b"], min_tokens=3))
    (out,), ended = process(processor, seq, "abab")  # the first "b" is token 2 (<= min_tokens), the second token 4
    completion = out.outputs[0]
    assert (completion.text, completion.finish_reason, completion.stop_reason) == ("aba", "stop", "b")
    assert len(completion.token_ids) == 4 and ended == [(0, seq)]


def test_text_that_could_start_a_stop_string_is_held_back():
    processor, seq = processor_with_request(SamplingParams(stop=["xyz"]))
    (out,), ended = process(processor, seq, "abx")
    assert out.outputs[0].text == "a" and not out.finished and not ended
    (out,), ended = process(processor, seq, "q")
    assert out.outputs[0].text == "ab" and out.outputs[0].token_ids == [ord(c) for c in "abxq"]


@pytest.mark.parametrize(
    ("finish_reason", "stop_reason", "expected"),
    [
        ("length", None, ("stop", "cd", "ab")),  # a stop string at the last token allowed: "stop", as vLLM says
        ("stop", 100, ("stop", 100, "abcd")),  # a stop token id: its text is not searched for stop strings
    ],
)
def test_a_sequence_the_scheduler_ended_is_not_ended_again(finish_reason, stop_reason, expected):
    processor, seq = processor_with_request(SamplingParams(stop=["cd"]))
    (out,), ended = process(processor, seq, "abcd", finish_reason, stop_reason)
    completion = out.outputs[0]
    assert (completion.finish_reason, completion.stop_reason, completion.text) == expected
    assert not ended


def test_a_request_whose_detokenizer_fails_ends_with_the_error():
    class Broken(LetterDetokenizer):
        def add(self, token):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "broken")

    processor, seq = processor_with_request(SamplingParams(), Broken())
    (out,), ended = process(processor, seq, "a")
    assert out.outputs[0].finish_reason == "error" and "broken" in out.error and ended == [(0, seq)]
