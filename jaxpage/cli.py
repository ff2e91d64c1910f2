"""`jaxpage` command line.

jaxpage predict "PROMPT" [--model SRC] [--chat] [--top N] [--dtype D]   next-token distribution
jaxpage convert SRC DST [--dtype D]                                     write a jaxpage (orbax) checkpoint
jaxpage batch INPUT.jsonl OUTPUT.jsonl [--model SRC] [engine options]   an OpenAI-format batch job (resumable)
"""

from __future__ import annotations

import argparse
import sys
import time


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="HF model directory, .gguf file or jaxpage checkpoint (default: SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="parameter dtype (default: float32 on CPU, bfloat16 on GPU/TPU)",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxpage", description="PagedAttention LLM serving on JAX/XLA.")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate a completion and stream it to stdout")
    generate.add_argument("prompt")
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    generate.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    generate.add_argument("--temperature", type=float, default=1.0, help="0 for greedy decoding (default 1.0)")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0, help="0 keeps all tokens")
    generate.add_argument("--min-p", type=float, default=0.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument(
        "--compilation-cache-dir",
        default=None,
        help="XLA's persistent compilation cache: a later run with the same model loads its compiled steps from here",
    )
    _add_model_options(generate)

    predict = commands.add_parser("predict", help="print the most likely next tokens after a prompt")
    predict.add_argument("prompt")
    predict.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    predict.add_argument("--top", type=int, default=5, help="how many candidate tokens to print (default 5)")
    _add_model_options(predict)

    convert = commands.add_parser("convert", help="convert a model to a jaxpage checkpoint (orbax)")
    convert.add_argument("source", help="HF model directory or .gguf file")
    convert.add_argument("destination", help="new directory for the checkpoint")
    convert.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="stored parameter dtype (default: float32 on CPU, bfloat16 on GPU/TPU)",
    )
    batch = commands.add_parser(
        "batch",
        help="run an OpenAI-format batch file (JSONL); run it again to resume",
        description="Runs every request of INPUT (OpenAI batch request lines: custom_id, method, url, body) and "
        "appends one OpenAI batch output line per request to OUTPUT as it finishes. Run the same command again "
        "after a crash to resume: requests already in OUTPUT are skipped.",
    )
    batch.add_argument("input", help="JSONL of {custom_id, method, url, body} requests")
    batch.add_argument("output", help="JSONL of results (appended to; created if missing)")
    _add_model_options(batch)
    batch.add_argument("--max-num-seqs", type=int, default=64, help="sequences per step (default 64)")
    batch.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per step (default 512)")
    batch.add_argument("--max-model-len", type=int, default=None, help="default: the model's context length")
    batch.add_argument("--page-size", type=int, default=16)
    batch.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    batch.add_argument("--compilation-cache-dir", default=None, help="XLA's persistent compilation cache")
    batch.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _batch(args) -> None:
    from jaxpage.batch import run_batch

    engine_args = dict(
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        page_size=args.page_size,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        compilation_cache_dir=args.compilation_cache_dir,
    )
    summary = run_batch(args.input, args.output, model=args.model, quiet=args.quiet, **engine_args)
    print(f"jaxpage batch: {summary.describe()}", file=sys.stderr)


def _predict(args) -> None:
    import jax
    import numpy as np

    from jaxpage.models import forward, load_model
    from jaxpage.tokenizer import encode_prompt, load_tokenizer

    if args.top < 1:
        raise ValueError("--top must be at least 1")
    if not args.prompt:
        raise ValueError("the prompt is empty")
    start = time.perf_counter()
    config, params = load_model(args.model, dtype=args.dtype)
    tokenizer = load_tokenizer(args.model)
    loaded = time.perf_counter()
    token_ids = encode_prompt(tokenizer, args.prompt, chat=args.chat)
    logits = np.asarray(forward(config, params, [token_ids])[0, -1])
    done = time.perf_counter()
    probs = np.asarray(jax.nn.softmax(logits))
    print(f"prompt: {len(token_ids)} tokens; load {loaded - start:.1f}s, compile+forward {done - loaded:.1f}s")
    for rank, token in enumerate(np.argsort(-logits)[: args.top], start=1):
        print(f"{rank:>3}. {probs[token]:7.2%}  {token:>6}  {tokenizer.decode([int(token)])!r}")


def _generate(args) -> None:
    from jaxpage.llm import LLM
    from jaxpage.sampling_params import SamplingParams
    from jaxpage.tokenizer import encode_prompt

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
    )
    if not args.prompt:
        raise ValueError("the prompt is empty")
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=1, compilation_cache_dir=args.compilation_cache_dir)
    prompt = {"prompt_token_ids": encode_prompt(llm.get_tokenizer(), args.prompt, chat=args.chat)}
    printed = 0
    final = None
    for output in llm.generate_stream(prompt, params):
        text = output.outputs[0].text
        sys.stdout.write(text[printed:])
        sys.stdout.flush()
        printed = len(text)
        final = output
    sys.stdout.write("\n")
    completion = final.outputs[0]
    metrics = final.metrics
    seconds = metrics.last_token_time - metrics.first_token_time
    rate = (len(completion.token_ids) - 1) / seconds if seconds > 0 else float("nan")
    print(
        f"[{len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}, "
        f"first token {metrics.first_token_time - metrics.arrival_time:.2f}s, {rate:.1f} tokens/s after it]",
        file=sys.stderr,
    )


def _convert(args) -> None:
    from pathlib import Path

    from jaxpage.models import load_model
    from jaxpage.models.loader import resolve_source, source_format
    from jaxpage.models.orbax_checkpoint import save_checkpoint
    from jaxpage.tokenizer import load_tokenizer

    destination = Path(args.destination)
    if destination.exists() and any(destination.iterdir()):
        raise FileExistsError(f"{destination} exists and is not empty")
    if source_format(resolve_source(args.source)) == "orbax":
        raise ValueError(f"{args.source} is already a jaxpage checkpoint")
    start = time.perf_counter()
    config, params = load_model(args.source, dtype=args.dtype)
    tokenizer = load_tokenizer(args.source)
    save_checkpoint(destination, config, params)
    tokenizer.save_pretrained(str(destination))
    print(
        f"wrote {destination} ({config.architecture}, {config.num_layers} layers) in {time.perf_counter() - start:.1f}s"
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    from jaxpage.batch import BatchError
    from jaxpage.errors import ModelLoadError

    commands = {"generate": _generate, "predict": _predict, "convert": _convert, "batch": _batch}
    try:
        commands[args.command](args)
    except (ModelLoadError, BatchError, ValueError, FileExistsError) as e:
        print(f"jaxpage: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
