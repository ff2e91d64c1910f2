"""`jaxpage` command line (also `python -m jaxpage`).

jaxpage generate "PROMPT" [--model SRC] [--chat] [--max-tokens N] [...]  stream a completion to stdout
jaxpage predict "PROMPT" [--model SRC] [--chat] [--top N] [--dtype D]   next-token distribution
jaxpage convert SRC DST [--dtype D] [--revision R]                      write a jaxpage (orbax) checkpoint
jaxpage batch INPUT.jsonl OUTPUT.jsonl [--model SRC] [engine options]   an OpenAI-format batch job (resumable)
jaxpage serve [MODEL] [--host H] [--port P] [engine options]           an OpenAI-compatible HTTP server
jaxpage --version

Failures never show a traceback: each is one line `jaxpage: error: ...` on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from typing import NoReturn

from jaxpage.config import EngineConfig
from jaxpage.entrypoints.tool_calls import TOOL_CALL_PARSERS
from jaxpage.version import installed_version

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command stopped by Ctrl-C
EXIT_STDOUT_CLOSED = 141  # 128 + SIGPIPE, as a shell reports `cat big | head -1`'s cat


class CommandError(Exception):
    """A failure whose message is all the user needs (a bad command line, a batch job that cannot run)."""


# Errors reported by their message alone; any other exception is reported with its type name. ModelLoadError is a
# ValueError.
_USER_ERRORS = (CommandError, ValueError, TypeError, OSError)


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad command line raises CommandError (reported as one line) instead of printing the usage."""

    def error(self, message: str) -> NoReturn:
        raise CommandError(f"{message} (see: {self.prog} --help)")


def add_engine_arguments(parser: argparse.ArgumentParser, groups=("model", "engine", "hosts"), exclude=()) -> None:
    """A flag for each engine argument of `groups` (see jaxpage.config.arg), but those in `exclude`: its name with
    dashes, EngineConfig's default, choices and help; booleans as --name / --no-name. The one source of the engine
    flags: `engine_args` reads them back by the same names."""
    names, hosts = [], None
    for field in dataclasses.fields(EngineConfig):
        meta = field.metadata
        if meta.get("cli") not in groups or field.name in exclude:
            continue
        names.append(field.name)
        if meta["cli"] == "hosts" and hosts is None:
            hosts = parser.add_argument_group(
                "several hosts",
                "run the same command on every host, with its own --process-id: process 0 does the job, the others "
                "follow it (jax.distributed; an option left out is for JAX to find, as on a TPU pod)",
            )
        target = hosts if meta["cli"] == "hosts" else parser
        kind = str(field.type).split(" ")[0]  # the annotation's first type: "int | None" -> "int"
        options = dict(default=field.default, help=meta["help"], choices=meta["choices"], metavar=meta["metavar"])
        if kind == "bool":
            options["action"] = argparse.BooleanOptionalAction
        elif kind in ("int", "float"):
            options["type"] = int if kind == "int" else float
        flag = "--" + field.name.replace("_", "-")
        if meta["gib"]:  # bytes, given in GiB
            flag, options["type"], options["metavar"] = flag.replace("-bytes", "-gib"), _gib_bytes, "GIB"
            options["dest"] = field.name
        if meta["off"] is None:
            target.add_argument(flag, **options)
            continue
        either = target.add_mutually_exclusive_group()
        either.add_argument(flag, **options)
        off_flag, off_help = meta["off"]
        either.add_argument(off_flag, dest=field.name, action="store_const", const=None, help=off_help)
    parser.set_defaults(engine_arguments=tuple(names))


def _gib_bytes(value: str) -> int:
    """A flag's size in GiB (a number >= 0), as bytes."""
    try:
        gib = float(value)
    except ValueError:
        gib = math.nan
    if not math.isfinite(gib) or gib < 0:
        raise argparse.ArgumentTypeError(f"expected a size in GiB (a number >= 0), got {value!r}")
    return int(gib * 2**30)


def engine_args(args: argparse.Namespace) -> dict:
    """The engine arguments a command's flags gave (add_engine_arguments), by EngineConfig's names."""
    return {name: getattr(args, name) for name in args.engine_arguments}


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jaxpage", description="PagedAttention LLM serving on JAX/XLA.")
    parser.add_argument("--version", action="version", version=f"jaxpage {installed_version()}")
    commands = parser.add_subparsers(dest="command", required=True)  # subparsers are _Parsers too

    generate = commands.add_parser("generate", help="generate a completion and stream it to stdout")
    generate.add_argument("prompt")
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    # Sampling flags left out take the model's generation config's defaults (--generation-config), else vLLM's.
    generate.add_argument("--max-tokens", type=int, default=None, help="most tokens to generate (default 256)")
    generate.add_argument("--temperature", type=float, default=None, help="0 for greedy decoding (default 1.0)")
    generate.add_argument("--top-p", type=float, default=None, help="(default 1.0)")
    generate.add_argument("--top-k", type=int, default=None, help="0 keeps all tokens (default 0)")
    generate.add_argument("--min-p", type=float, default=None, help="(default 0.0)")
    generate.add_argument("--seed", type=int, default=None)
    # One request: the engine's --seed is the sampling seed's, and one sequence runs at a time.
    add_engine_arguments(generate, exclude=("seed", "max_num_seqs"))

    predict = commands.add_parser("predict", help="print the most likely next tokens after a prompt")
    predict.add_argument("prompt")
    predict.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    predict.add_argument("--top", type=int, default=5, help="how many candidate tokens to print (default 5)")
    add_engine_arguments(predict, groups=("model",))

    convert = commands.add_parser("convert", help="convert a model to a jaxpage checkpoint (orbax)")
    convert.add_argument("source", help="HF model directory, .gguf file, or Hub id (org/name, org/name:Q4_K_M)")
    convert.add_argument("destination", help="new directory for the checkpoint")
    convert.add_argument(
        "--dtype",
        default=None,
        choices=EngineConfig.DTYPES,
        help="stored parameter dtype (default: float32 on CPU, bfloat16 on GPU/TPU)",
    )
    convert.add_argument(
        "--quantization",
        default=None,
        choices=EngineConfig.QUANTIZATIONS,
        help="int8: store the weights in int8 with a scale per output channel, quantized as they load (default: off)",
    )
    add_engine_arguments(convert, groups=("model",), exclude=("model", "dtype", "quantization"))
    batch = commands.add_parser(
        "batch",
        help="run an OpenAI-format batch file (JSONL); run it again to resume",
        description="Runs every request of INPUT (OpenAI batch request lines: custom_id, method, url, body) and "
        "appends one OpenAI batch output line per request to OUTPUT as it finishes. Run the same command again "
        "after a crash to resume: requests already in OUTPUT are skipped.",
    )
    batch.add_argument("input", help="JSONL of {custom_id, method, url, body} requests")
    batch.add_argument("output", help="JSONL of results (appended to; created if missing)")
    add_engine_arguments(batch)
    _add_lora_modules_argument(batch)
    batch.add_argument("--quiet", action="store_true", help="no progress bar")

    _add_serve_command(commands)
    return parser


def _add_serve_command(commands) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve an OpenAI-compatible HTTP API",
        description="Serves /v1/completions, /v1/chat/completions (streaming too), /v1/models, /health and /version "
        "until SIGINT or SIGTERM, then lets running requests finish (--shutdown-timeout) and exits 0.",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="default 8000")
    serve.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every path but /, /health, /metrics, /version (default: none)",
    )
    serve.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as --model takes it (vLLM's `vllm serve MODEL`)",
    )
    serve.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model's names in the API: requests may give any, the first is the default (default: the model)",
    )
    serve.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, help="larger bodies get 413")
    serve.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="requests that may wait; more get 503 with Retry-After (default: no limit)",
    )
    serve.add_argument(
        "--stall-timeout", type=float, default=120.0, help="/health fails after this many seconds without a step"
    )
    serve.add_argument(
        "--shutdown-timeout", type=float, default=30.0, help="seconds running requests get to finish on shutdown"
    )
    serve.add_argument(
        "--disable-log-requests", action="store_true", help="no log line per request (default: one when it ends)"
    )
    serve.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto" (the default with tools): the model decides, --tool-call-parser finds its calls',
    )
    serve.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="how the model writes tool calls: hermes (Qwen 2.5/3, Hermes) or llama3_json (Llama 3.1+)",
    )
    serve.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the engine steps in a process of its own, apart from the HTTP handling and tokenization (default: yes, "
        "but for several hosts, where it steps in a thread of the server's process)",
    )
    add_engine_arguments(serve)
    _add_lora_modules_argument(serve)


def _add_lora_modules_argument(parser: argparse.ArgumentParser) -> None:
    from jaxpage.entrypoints.served_models import parse_lora_module

    def lora_module(value: str):
        try:
            return parse_lora_module(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parser.add_argument(
        "--lora-modules",
        nargs="+",
        type=lora_module,
        default=[],
        metavar="NAME=PATH",
        help='LoRA adapters (PEFT directories) served under their names, which requests give as "model"; also '
        'vLLM\'s JSON form \'{"name": ..., "path": ..., "base_model_name": ...}\' (needs --enable-lora)',
    )


def _check_lora_modules(args) -> None:
    if args.lora_modules and not args.enable_lora:
        raise CommandError("--lora-modules needs --enable-lora")


def _check_prompt(prompt: str) -> None:
    """Refuses a prompt no model can take, before one loads."""
    if not prompt:
        raise ValueError("the prompt is empty")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        # Command line bytes that are not UTF-8 reach Python as lone surrogates U+DC80..U+DCFF (PEP 383).
        code = ord(prompt[e.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"lone surrogate U+{code:04X}"
        raise ValueError(f"the prompt is not valid UTF-8 text: {what} at character {e.start + 1}") from None


def _quiet_transformers() -> None:
    """transformers' warnings are not for the command's user (huggingface_hub's download progress bars are:
    transformers' disable_progress_bar would turn those off too)."""
    # Its advice at import ("PyTorch was not found ...": the bare install has no torch and needs none) comes before
    # set_verbosity_error can be called.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


def _follows(args) -> bool:
    """Several hosts: joins the other processes. On a process other than 0, follows process 0's engine until it
    shuts down and returns True: the command's own job is process 0's."""
    from jaxpage.config import EngineConfig
    from jaxpage.entrypoints import distributed

    hosts = ("coordinator_address", "num_processes", "process_id")
    config = EngineConfig(**{name: getattr(args, name) for name in hosts})  # checks them
    distributed.initialize(config.coordinator_address, config.num_processes, config.process_id)
    if distributed.is_leader():
        return False
    distributed.follow()
    return True


def _generate(args) -> None:
    from jaxpage.sampling_params import SamplingParams

    names = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed")
    given = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    SamplingParams(**given)  # checks the sampling flags before any model loads
    _check_prompt(args.prompt)
    _quiet_transformers()
    if _follows(args):
        return
    from jaxpage.entrypoints.llm import LLM
    from jaxpage.tokenizers.tokenizer import encode_prompt

    llm = LLM(max_num_seqs=1, **engine_args(args))
    params = SamplingParams(**(dict(max_tokens=256) | llm.engine.generation_defaults.sampling_dict | given))
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
    if final.error is not None:
        raise RuntimeError(f"generation failed: {final.error}")
    completion = final.outputs[0]
    metrics = final.metrics
    seconds = metrics.last_token_time - metrics.first_token_time
    rate = (len(completion.token_ids) - 1) / seconds if seconds > 0 else float("nan")
    print(
        f"[{len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}, "
        f"first token {metrics.first_token_time - metrics.arrival_time:.2f}s, {rate:.1f} tokens/s after it]",
        file=sys.stderr,
    )


def _predict(args) -> None:
    if args.top < 1:
        raise ValueError("--top must be at least 1")
    _check_prompt(args.prompt)
    _quiet_transformers()
    import jax
    import numpy as np

    from jaxpage.engine.llm_engine import engine_tokenizer, load_target_model
    from jaxpage.models import forward
    from jaxpage.tokenizers.tokenizer import encode_prompt

    engine = EngineConfig(**engine_args(args))  # checks the model flags
    start = time.perf_counter()
    config, params = load_target_model(engine)
    tokenizer = engine_tokenizer(engine)
    loaded = time.perf_counter()
    token_ids = encode_prompt(tokenizer, args.prompt, chat=args.chat)
    logits = np.asarray(forward(config, params, [token_ids])[0, -1])
    done = time.perf_counter()
    probs = np.asarray(jax.nn.softmax(logits))
    print(f"prompt: {len(token_ids)} tokens; load {loaded - start:.1f}s, compile+forward {done - loaded:.1f}s")
    for rank, token in enumerate(np.argsort(-logits)[: args.top], start=1):
        print(f"{rank:>3}. {probs[token]:7.2%}  {token:>6}  {tokenizer.decode([int(token)])!r}")


def _convert(args) -> None:
    from pathlib import Path

    destination = Path(args.destination)
    if destination.exists() and any(destination.iterdir()):
        raise FileExistsError(f"{destination} exists and is not empty")
    _quiet_transformers()
    from jaxpage.engine.llm_engine import engine_tokenizer, load_target_model
    from jaxpage.models.loader import resolve_source, source_format
    from jaxpage.models.orbax_checkpoint import save_checkpoint
    from jaxpage.sources import HubDownload

    flags = dict(model=args.source, dtype=args.dtype, quantization=args.quantization)
    engine = EngineConfig(**flags, **engine_args(args))  # checks the model flags
    if source_format(resolve_source(engine.model, HubDownload(engine.revision, engine.download_dir))) == "orbax":
        raise ValueError(f"{args.source} is already a jaxpage checkpoint")
    start = time.perf_counter()
    config, params = load_target_model(engine)
    tokenizer = engine_tokenizer(engine)
    save_checkpoint(destination, config, params)
    tokenizer.save_pretrained(str(destination))
    print(
        f"wrote {destination} ({config.architecture}, {config.num_layers} layers) in {time.perf_counter() - start:.1f}s"
    )


def _batch(args) -> None:
    _quiet_transformers()
    if _follows(args):
        return
    from jaxpage.entrypoints.batch import BatchError, run_batch

    _check_lora_modules(args)
    try:
        summary = run_batch(
            args.input,
            args.output,
            quiet=args.quiet,
            lora_modules=args.lora_modules,
            freeze_heap=True,
            **engine_args(args),
        )
    except BatchError as e:
        raise CommandError(str(e)) from e
    print(f"jaxpage batch: {summary.describe()}", file=sys.stderr)


def _serve(args) -> None:
    _quiet_transformers()
    if not 0 <= args.port <= 65535:
        raise CommandError(f"--port must be in [0, 65535], got {args.port}")
    for option in ("max_body_bytes", "max_waiting_requests", "stall_timeout", "shutdown_timeout"):
        value = getattr(args, option)
        if value is not None and value < 0:
            raise CommandError(f"--{option.replace('_', '-')} must be >= 0, got {value}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise CommandError("--enable-auto-tool-choice needs --tool-call-parser")
    _check_lora_modules(args)
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise CommandError(f"the model is given twice: {args.model_tag} and --model {args.model}; give one")
        args.model = args.model_tag
    if args.engine_process and (args.num_processes or 1) > 1:
        raise CommandError(
            "--engine-process: not with several hosts (--num-processes > 1), whose engine runs beside the server"
        )
    if _follows(args):
        return
    from jaxpage.entrypoints.server import serve

    serve(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        max_body_bytes=args.max_body_bytes,
        max_waiting_requests=args.max_waiting_requests,
        stall_timeout_s=args.stall_timeout,
        shutdown_timeout_s=args.shutdown_timeout,
        log_requests=not args.disable_log_requests,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        lora_modules=args.lora_modules,
        engine_process=args.engine_process,
        **engine_args(args),
    )


_COMMANDS = {"generate": _generate, "predict": _predict, "convert": _convert, "batch": _batch, "serve": _serve}


def main(argv: list[str] | None = None) -> int:
    """Runs `jaxpage ARGV` (default: the process's arguments) and returns its exit status.

    0: done. 2: failed, reported as one line `jaxpage: error: ...` on stderr, never a traceback. 130: interrupted
    (Ctrl-C). 141: stdout was closed before the output ended (`jaxpage generate ... | head -c 1`): stopped quietly.
    """
    try:
        status = _run(argv)
        sys.stdout.flush()  # a closed pipe shows here, where it is handled, not in the interpreter's final flush
        return status
    except BrokenPipeError:
        return _stdout_closed()
    except KeyboardInterrupt:
        print("jaxpage: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:
        print(f"jaxpage: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_ERROR


def _run(argv: list[str] | None) -> int:
    try:
        args, unknown = _parser().parse_known_args(argv)
    except SystemExit as e:  # --help or --version printed what was asked (errors raise CommandError instead)
        return int(e.code or 0)
    if unknown:  # argparse would send the user to the top-level help; the command's own help lists its options
        raise CommandError(f"unrecognized arguments: {' '.join(unknown)} (see: jaxpage {args.command} --help)")
    _COMMANDS[args.command](args)
    return 0


def _one_line(error: Exception) -> str:
    message = " ".join(str(error).split())  # one line, whatever the exception's text holds
    if isinstance(error, _USER_ERRORS):
        return message or type(error).__name__
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def _stdout_closed() -> int:
    # Whatever is still buffered for stdout would fail again, with a traceback, when the interpreter flushes it on
    # exit: point stdout at /dev/null first, as the Python docs advise for SIGPIPE.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout is not a file descriptor (main called in-process)
        pass
    return EXIT_STDOUT_CLOSED


if __name__ == "__main__":  # python -m jaxpage.entrypoints.cli (python -m jaxpage is the same)
    sys.exit(main())
