"""OpenAI's response bodies for /v1/completions and /v1/chat/completions, from jaxpage's RequestOutputs:
`response_body(...)` turns a finished RequestOutput into the response body, `combine_bodies` joins those of a request's
prompts, and a `Stream` turns each RequestOutput of a streaming request into the chunks that say what is new (the
server's `stream: true`). The requests they answer are parsed by jaxpage.entrypoints.openai_api.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid

from jaxpage.entrypoints.openai_api import CHAT, COMPLETIONS, ParsedRequest
from jaxpage.entrypoints.tool_calls import ToolCallStream, tool_calls_from_output
from jaxpage.outputs import RequestOutput


def combine_bodies(bodies: list[dict]) -> dict:
    """One response body of the bodies of a request's prompts (split_prompts): their choices, their usage summed."""
    if len(bodies) == 1:
        return bodies[0]
    combined = dict(bodies[0], choices=[], usage=_sum_usage([b["usage"] for b in bodies]))
    offset = 0
    for body in bodies:
        combined["choices"] += [dict(c, index=c["index"] + offset) for c in body["choices"]]
        offset += len(body["choices"])
    return combined


def _usage(output: RequestOutput) -> dict:
    completion_tokens = sum(len(c.token_ids) for c in output.outputs)
    prompt_tokens = len(output.prompt_token_ids)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens},
    }


def _sum_usage(usages: list[dict]) -> dict:
    total = {key: sum(u[key] for u in usages) for key in ("prompt_tokens", "completion_tokens", "total_tokens")}
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    return dict(total, prompt_tokens_details={"cached_tokens": cached})


class Stream:
    """The chunks of one prompt of a streaming request (OpenAI's `chat.completion.chunk` / `text_completion`
    events): for each RequestOutput, the text each choice added since the last one (a chat choice's first chunk
    also gives its role), and the finish reason with a choice's last text. `index_offset`: the index of its first
    choice (the request's earlier prompts' choices come first); `usage_chunk`, after the last, the token counts."""

    def __init__(self, request: ParsedRequest, model: str, index_offset: int = 0, stream_id: str | None = None):
        self.request = request
        self.index_offset = index_offset
        chat = request.url == CHAT
        self._base = {
            "id": stream_id or f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
        }
        self._sent: dict[int, tuple[int, int]] = {}  # choice index -> (characters, tokens) sent
        self._done: set[int] = set()
        # With tools: each choice's text goes through a ToolCallStream, which sends content and whole calls.
        self._tool_streams: dict[int, ToolCallStream] = {}
        self._calls_sent: dict[int, int] = {}

    def chunks(self, output: RequestOutput) -> list[dict]:
        chat = self.request.url == CHAT
        chunks = []
        for completion in output.outputs:
            index = completion.index
            if index in self._done:
                continue
            first = index not in self._sent
            chars, tokens = self._sent.get(index, (0, 0))
            text = completion.text[chars:]
            finish_reason, calls = completion.finish_reason, []
            if _calls_tools(self.request):
                text, calls, finish_reason = self._tool_delta(index, text, finish_reason)
                if not text and not calls and not first and finish_reason is None:
                    self._sent[index] = (len(completion.text), tokens)  # held back by the ToolCallStream
                    continue
            if not text and not first and finish_reason is None:
                continue
            choice: dict = {"index": index + self.index_offset}
            if chat:
                choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
                if calls:
                    choice["delta"]["tool_calls"] = calls
            else:
                choice["text"] = text
            choice["logprobs"] = None
            if self.request.top_logprobs is not None:
                new = dataclasses.replace(
                    completion,
                    token_ids=completion.token_ids[tokens:],
                    logprobs=(completion.logprobs or [])[tokens:],
                )
                choice["logprobs"] = _logprobs(self.request, new, text_offset=chars)
            choice["finish_reason"] = finish_reason
            if finish_reason is not None:
                self._done.add(index)
            self._sent[index] = (len(completion.text), len(completion.token_ids))
            chunk = dict(self._base, choices=[choice])
            if self.request.continuous_usage:
                chunk["usage"] = _usage(output)
            chunks.append(chunk)
        return chunks

    def _tool_delta(self, index: int, text: str, finish_reason: str | None) -> tuple[str, list[dict], str | None]:
        """(content, tool calls as delta items, finish reason) of a choice's new text, with tools."""
        if index not in self._tool_streams:
            self._tool_streams[index] = ToolCallStream(self.request.tool_choice, self.request.tool_parser)
        stream = self._tool_streams[index]
        content, calls = stream.feed(text)
        if finish_reason is not None:
            more_content, more_calls = stream.finish()
            content, calls = content + more_content, calls + more_calls
        sent = self._calls_sent.get(index, 0)
        if not self.request.parallel_tool_calls:
            calls = calls[: max(0, 1 - sent)]
        self._calls_sent[index] = sent + len(calls)
        finish_reason = _tool_finish_reason(self.request, [None] * (sent + len(calls)), finish_reason)
        return content, [call.to_openai(index=sent + k) for k, call in enumerate(calls)], finish_reason

    def usage_chunk(self, outputs: list[RequestOutput]) -> dict:
        """The last chunk of a stream with include_usage: the token counts of the request's finished outputs."""
        return dict(self._base, choices=[], usage=_sum_usage([_usage(o) for o in outputs]))


def response_body(request: ParsedRequest, output: RequestOutput, model: str, tokenizer=None) -> dict:
    """The OpenAI response body (choices, usage) of a finished request (tokenizer: to echo a prompt of token ids)."""
    choices = []
    for completion in output.outputs:
        choice = {"index": completion.index, "finish_reason": completion.finish_reason}
        logprobs = _logprobs(request, completion) if request.top_logprobs is not None else None
        if request.url == CHAT:
            choice["message"] = {"role": "assistant", "content": completion.text}
            if _calls_tools(request):
                content, calls = tool_calls_from_output(request.tool_choice, completion.text, request.tool_parser)
                calls = calls if request.parallel_tool_calls else calls[:1]
                choice["message"]["content"] = content
                if calls:
                    choice["message"]["tool_calls"] = [call.to_openai() for call in calls]
                choice["finish_reason"] = _tool_finish_reason(request, calls, completion.finish_reason)
        elif request.echo:
            prompt_text, prompt_logprobs = _echo(request, output, tokenizer)
            choice["text"] = prompt_text + completion.text
            if logprobs is not None:
                shifted = [offset + len(prompt_text) for offset in logprobs["text_offset"]]
                logprobs = {key: prompt_logprobs[key] + value for key, value in logprobs.items()}
                logprobs["text_offset"] = prompt_logprobs["text_offset"] + shifted
        else:
            choice["text"] = completion.text
        choice["logprobs"] = logprobs
        if request.prompt_logprobs and request.url == COMPLETIONS:
            choice["prompt_logprobs"] = _vllm_prompt_logprobs(output)
        choices.append(choice)
    body = {
        "id": f"{'chatcmpl' if request.url == CHAT else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion" if request.url == CHAT else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": _usage(output),
    }
    if request.prompt_logprobs and request.url == CHAT:
        body["prompt_logprobs"] = _vllm_prompt_logprobs(output)
    return body


def _vllm_prompt_logprobs(output: RequestOutput) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token, null for the first, then {token id: {logprob, rank,
    decoded_token}} for the token and the most likely ones."""
    return [
        None
        if entry is None
        else {
            str(token_id): {"logprob": _finite(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for token_id, lp in entry.items()
        }
        for entry in output.prompt_logprobs or []
    ]


def _calls_tools(request: ParsedRequest) -> bool:
    return request.tool_choice is not None and request.tool_choice.mode != "none"


def _tool_finish_reason(request: ParsedRequest, calls: list, finish_reason: str | None) -> str | None:
    """ "tool_calls" for a choice that ended calling tools, as OpenAI says it (but for a named function: "stop")."""
    if calls and finish_reason == "stop" and request.tool_choice.mode != "named":
        return "tool_calls"
    return finish_reason


def _logprobs(request: ParsedRequest, completion, text_offset: int = 0) -> dict:
    """The log-probs of a completion's tokens in the endpoint's shape; text_offset: where the first token's text
    starts in the choice's text (a stream's later chunks)."""
    tokens = []  # per generated token: (text, logprob, [(text, logprob)] most likely first)
    for token_id, entry in zip(completion.token_ids, completion.logprobs or [], strict=False):
        chosen = entry[token_id]
        top = sorted((lp for tid, lp in entry.items() if lp.rank is not None), key=lambda lp: lp.rank)
        top = top[: request.top_logprobs]
        tokens.append(
            (chosen.decoded_token or "", chosen.logprob, [(lp.decoded_token or "", lp.logprob) for lp in top])
        )
    if request.url == CHAT:
        return {
            "content": [
                {
                    "token": text,
                    "logprob": _finite(logprob),
                    "bytes": list(text.encode()),
                    "top_logprobs": [{"token": t, "logprob": _finite(lp), "bytes": list(t.encode())} for t, lp in top],
                }
                for text, logprob, top in tokens
            ]
        }
    offsets, offset = [], text_offset
    for text, _, _ in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": [text for text, _, _ in tokens],
        "token_logprobs": [_finite(logprob) for _, logprob, _ in tokens],
        "top_logprobs": [{t: _finite(lp) for t, lp in top} for _, _, top in tokens],
        "text_offset": offsets,
    }


def _echo(request: ParsedRequest, output: RequestOutput, tokenizer) -> tuple[str, dict]:
    """(the prompt's text, its completions-style log-probs: each prompt token, the first with null log-probs, as
    OpenAI and vLLM echo them)."""
    if isinstance(request.prompt, str):
        text = request.prompt
    else:
        text = tokenizer.decode(output.prompt_token_ids) if tokenizer is not None else ""
    entries = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
    tokens, token_logprobs, top_logprobs, offsets, offset = [], [], [], [], 0
    for token_id, entry in zip(output.prompt_token_ids, entries, strict=True):
        if entry is None:
            piece = tokenizer.decode([token_id]) if tokenizer is not None else ""
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:
            piece = entry[token_id].decoded_token or ""
            token_logprobs.append(_finite(entry[token_id].logprob))
            top = sorted((lp for lp in entry.values() if lp.rank is not None), key=lambda lp: lp.rank)
            top_logprobs.append({lp.decoded_token or "": _finite(lp.logprob) for lp in top[: request.top_logprobs]})
        tokens.append(piece)
        offsets.append(offset)
        offset += len(piece)
    return text, {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0  # OpenAI's stand-in for -inf; JSON has no infinity
