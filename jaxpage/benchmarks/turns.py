"""Engines measured against each other in one run, taking turns one step each, so that whatever slows this (noisy,
shared) machine slows all alike."""

from __future__ import annotations

import time

from jaxpage.benchmarks.progress import log


def warm_up(engines: dict) -> dict:
    """Every engine (name -> LLM) warmed up (LLMEngine.warmup), logged: {name: seconds}."""
    seconds = {}
    for name, llm in engines.items():
        start = time.perf_counter()
        compiled = llm.engine.warmup()
        seconds[name] = time.perf_counter() - start
        log(f"{name}: warmed up, {len(compiled)} programs in {seconds[name]:.1f}s")
    return seconds


def serve_in_turns(
    engines: dict, prompts: list, params, tag: str, lora_requests: dict | None = None
) -> tuple[dict, dict]:
    """Every engine (name -> LLM) serves `prompts`, the engines taking turns one step each: (seconds of each engine's
    own steps, each engine's output token ids in prompt order). lora_requests: by engine name, each prompt's
    LoRARequest (or None) on that engine; engines not named run the base model."""
    seconds = dict.fromkeys(engines, 0.0)
    finished = {name: {} for name in engines}
    for name, llm in engines.items():
        loras = (lora_requests or {}).get(name) or [None] * len(prompts)
        for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
            llm.engine.add_request(f"{tag}-{i}", prompt, params, lora_request=lora)
    while any(llm.engine.has_unfinished_requests() for llm in engines.values()):
        for name, llm in engines.items():
            if llm.engine.has_unfinished_requests():
                start = time.perf_counter()
                outputs = llm.engine.step()
                seconds[name] += time.perf_counter() - start
                for output in outputs:
                    if output.finished:
                        finished[name][output.request_id] = list(output.outputs[0].token_ids)
    tokens = {name: [finished[name][f"{tag}-{i}"] for i in range(len(prompts))] for name in engines}
    return seconds, tokens
