"""LoRA adapters against the base model, in one run: output tokens/s of one batch of requests over several adapters.

    python scripts/bench_lora.py [--model SRC] [--requests 32] [--adapters 4] [--ranks 8,16] [--max-tokens 128]
        [--max-loras 4] [--repeats 2] [--dtype D] [--max-model-len 512]
        [--skip-warmup]

Adapters (every projection: q/k/v/o, gate/up/down; ranks cycling through --ranks) with random weights are written
in PEFT's format into a temporary directory. Two engines of the same model and arguments serve in one process:
`base` (no LoRA) and `lora` (enable_lora, --max-loras slots of the largest rank), the latter with request i on
adapter i mod --adapters. Each is warmed up first (untimed; --skip-warmup: not, for checking the script, whose
figures then count compiling). Both serve the same prompts at the same time, taking
turns one engine.step() each, so that whatever slows this (noisy, shared) machine slows both alike; an engine's
seconds are the sum of its own steps, its throughput output tokens / those seconds. Greedy, ignore_eos: every
request makes --max-tokens tokens. The last line of stdout is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from jaxpage.benchmarks.progress import log
from jaxpage.benchmarks.turns import serve_in_turns, warm_up

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(directory: Path, config, rank: int, seed: int) -> None:
    """A random LoRA adapter of every projection, as PEFT saves one (lora_alpha = 2 * rank)."""
    from jaxpage.models.lora_adapter import module_features, tensor_name

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module in TARGETS:
            n_in, n_out = module_features(config, module)
            tensors[tensor_name(layer, module, "A")] = (rng.standard_normal((rank, n_in)) / np.sqrt(n_in)).astype(
                np.float32
            )
            tensors[tensor_name(layer, module, "B")] = (rng.standard_normal((n_out, rank)) * 0.01).astype(np.float32)
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    settings = dict(peft_type="LORA", r=rank, lora_alpha=2 * rank, target_modules=list(TARGETS), bias="none")
    (directory / "adapter_config.json").write_text(json.dumps(settings))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model source (default: the default model)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--ranks", default="8,16")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-loras", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--skip-warmup", action="store_true", help="compile as shapes come (checks the script quickly)")
    args = parser.parse_args()

    from jaxpage.entrypoints.llm import LLM
    from jaxpage.lora_request import LoRARequest
    from jaxpage.sampling_params import SamplingParams

    ranks = [int(r) for r in args.ranks.split(",")]
    engine_args = dict(
        max_num_seqs=args.requests, max_num_batched_tokens=512, max_model_len=args.max_model_len, dtype=args.dtype
    )
    log("loading the base engine")
    base = LLM(args.model, **engine_args)
    log("loading the LoRA engine")
    lora = LLM(args.model, enable_lora=True, max_loras=args.max_loras, max_lora_rank=max(ranks), **engine_args)
    engines = {"base": base, "lora": lora}
    compile_s = {} if args.skip_warmup else warm_up(engines)

    with tempfile.TemporaryDirectory() as tmp:
        config = base.engine.model_config
        requests = []
        for i in range(args.adapters):
            path = Path(tmp) / f"adapter{i}"
            write_adapter(path, config, ranks[i % len(ranks)], seed=i)
            requests.append(LoRARequest(f"adapter{i}", i + 1, str(path)))
        tokenizer = base.get_tokenizer()
        topics = ["the sea", "a city at night", "an old library", "a mountain road", "a garden in spring"]
        texts = [f"Write a long description of {topics[i % len(topics)]}, number {i}." for i in range(args.requests)]
        prompts = [{"prompt_token_ids": tokenizer.encode(text)} for text in texts]
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        loras = {"lora": [requests[i % args.adapters] for i in range(args.requests)]}
        seconds, tokens = dict.fromkeys(engines, 0.0), dict.fromkeys(engines, 0)
        for repeat in range(args.repeats):
            step_seconds, outputs = serve_in_turns(engines, prompts, params, f"r{repeat}", loras)
            for name in engines:
                seconds[name] += step_seconds[name]
                tokens[name] += sum(map(len, outputs[name]))
            log(f"repeat {repeat + 1}: " + ", ".join(f"{n} {tokens[n] / seconds[n]:.1f} tokens/s" for n in engines))

    throughput = {name: tokens[name] / seconds[name] for name in engines}
    ratio = throughput["lora"] / throughput["base"]
    print(f"{'engine':<6} {'tokens':>8} {'seconds':>8} {'tokens/s':>9}")
    for name in engines:
        print(f"{name:<6} {tokens[name]:>8} {seconds[name]:>8.2f} {throughput[name]:>9.1f}")
    print(f"lora / base: {ratio:.3f} ({args.adapters} adapters, ranks {args.ranks}, {args.requests} requests)")
    figures = dict(throughput=throughput, tokens=tokens, seconds=seconds, lora_over_base=ratio, compile_s=compile_s)
    print(json.dumps(figures | dict(vars(args))))


if __name__ == "__main__":
    main()
