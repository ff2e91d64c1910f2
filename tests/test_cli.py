"""The `jaxpage` command as a user runs it (the console script, `python -m jaxpage`), and its failures: one line each,
never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import jaxpage
from jaxpage.entrypoints import cli
from jaxpage.entrypoints.cli import main
from jaxpage.errors import ModelLoadError


def test_predict_on_the_default_model(smollm2_path):
    env = {**os.environ, "JAXPAGE_CACHE": str(smollm2_path.parent.parent)}  # the cache the fixture filled
    result = subprocess.run(
        ["jaxpage", "predict", "The capital of France is", "--top", "3"], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("prompt: 5 tokens;")
    assert lines[1].endswith("' Paris'")  # SmolLM2's greedy answer, and transformers' too
    assert len(lines) == 4


def test_bad_arguments_are_reported_cleanly():
    result = subprocess.run(["jaxpage", "predict", "hi", "--top", "0"], capture_output=True, text=True)
    assert result.returncode == 2
    assert "jaxpage: error: --top must be at least 1" in result.stderr
    assert "Traceback" not in result.stderr


def test_generate_streams_greedy_text(smollm2_path):
    env = {**os.environ, "JAXPAGE_CACHE": str(smollm2_path.parent.parent)}
    result = subprocess.run(
        ["jaxpage", "generate", "The capital of France is", "--max-tokens", "8", "--temperature", "0"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(" Paris.\n\nThe answer is")  # transformers' greedy continuation too
    assert "[8 tokens, finish_reason=length" in result.stderr


def test_generate_rejects_bad_sampling_flags():
    result = subprocess.run(["jaxpage", "generate", "hi", "--top-p", "2"], capture_output=True, text=True)
    assert result.returncode == 2
    assert "jaxpage: error: SamplingParams.top_p must be in (0, 1], got 2.0" in result.stderr
    assert "Traceback" not in result.stderr


# Every failure is one line on stderr and exit status 2, and these fail before any model loads (about a second).
# (argv, the line's start): argparse's wording of a choice list varies with the Python version.
USAGE_ERRORS = [
    (
        ["generate", "hi", "--max-tokens", "x"],
        "argument --max-tokens: invalid int value: 'x' (see: jaxpage generate --help)",
    ),
    (["generate", "hi", "--bogus"], "unrecognized arguments: --bogus (see: jaxpage generate --help)"),
    ([], "the following arguments are required: command (see: jaxpage --help)"),
    (["frob"], "argument command: invalid choice: 'frob' (choose from "),
    (["predict", "hi", "--dtype", "int4"], "argument --dtype: invalid choice: 'int4' (choose from "),
    (["generate", "hi", "--kv-cache-dtype", "fp4"], "argument --kv-cache-dtype: invalid choice: 'fp4' (choose from "),
    (
        ["generate", "hi", "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'],
        "speculative_config['method'] must be 'ngram' or 'draft_model', got 'eagle'",
    ),
    (["generate", "hi", "--speculative-config", "{method"], "engine argument speculative_config must be a JSON object"),
    (["generate", ""], "the prompt is empty"),
    (["predict", ""], "the prompt is empty"),
]


@pytest.mark.parametrize("argv, start", USAGE_ERRORS)
def test_usage_errors_are_one_line(argv, start):
    result = subprocess.run(["jaxpage", *argv], capture_output=True, text=True)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.startswith(f"jaxpage: error: {start}")
    assert result.stderr.count("\n") == 1 and result.stderr.endswith("\n")


def test_engine_flags_are_engine_config_s_arguments_with_its_defaults():
    # One argument set: each command's engine flags are EngineConfig's fields (jaxpage.config.arg), with its
    # defaults and names, read back by engine_args.
    import dataclasses

    from jaxpage.config import EngineConfig
    from jaxpage.entrypoints.cli import _parser, engine_args

    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    flagged = {name for name, f in fields.items() if f.metadata.get("cli")}
    commands = {
        ("batch", "in.jsonl", "out.jsonl"): set(),
        ("serve",): set(),
        ("generate", "hi"): {"seed", "max_num_seqs"},
    }
    for command, left_out in commands.items():
        given = engine_args(_parser().parse_args(command))
        assert set(given) == flagged - left_out and given == {name: fields[name].default for name in given}
    model_flags = {name for name, f in fields.items() if f.metadata.get("cli") == "model"}
    assert {"model", "dtype", "quantization", "revision", "tokenizer", "hf_overrides"} <= model_flags
    assert set(engine_args(_parser().parse_args(["predict", "hi"]))) == model_flags
    convert = engine_args(_parser().parse_args(["convert", "src", "dst"]))  # its own source, --dtype, --quantization
    assert set(convert) == model_flags - {"model", "dtype", "quantization"}
    flags = ["--kv-cache-dtype", "fp8", "--no-enable-prefix-caching", "--no-compilation-cache", "--page-size", "8"]
    given = engine_args(_parser().parse_args(["serve", *flags]))
    assert (
        given | dict(kv_cache_dtype="fp8", enable_prefix_caching=False, compilation_cache_dir=None, page_size=8)
        == given
    )
    config = EngineConfig(**given)
    assert (config.kv_cache_dtype, config.enable_prefix_caching) == ("fp8_e4m3", False)  # one normalization


@pytest.mark.parametrize("command", ["generate", "predict"])
def test_prompts_that_are_not_text_are_refused(command):
    # Bytes that are not UTF-8 (here Latin-1 "café") reach Python's argv as lone surrogates.
    result = subprocess.run([b"jaxpage", command.encode(), b"caf\xe9"], capture_output=True)
    assert result.returncode == 2
    assert result.stderr == b"jaxpage: error: the prompt is not valid UTF-8 text: byte 0xe9 at character 4\n"


def test_os_errors_are_one_line(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").touch()
    result = subprocess.run(["jaxpage", "convert", "model", str(tmp_path / "taken")], capture_output=True, text=True)
    assert (result.returncode, result.stderr) == (2, f"jaxpage: error: {tmp_path / 'taken'} exists and is not empty\n")


def test_batch_errors_are_one_line(tmp_path, capsys):
    missing = tmp_path / "missing.jsonl"
    assert main(["batch", str(missing), str(tmp_path / "out.jsonl")]) == 2
    assert capsys.readouterr().err == f"jaxpage: error: cannot read the input {missing}: No such file or directory\n"


def test_serve_refuses_auto_tool_choice_without_a_parser(capsys):
    assert main(["serve", "--enable-auto-tool-choice"]) == 2  # refused before any model loads
    assert capsys.readouterr().err == "jaxpage: error: --enable-auto-tool-choice needs --tool-call-parser\n"


@pytest.mark.parametrize(
    "error, line, status",
    [
        (TypeError("max_tokens must be an int"), "jaxpage: error: max_tokens must be an int", 2),
        (ModelLoadError("m.gguf: tensor blk.0 is cut short"), "jaxpage: error: m.gguf: tensor blk.0 is cut short", 2),
        (
            FileNotFoundError(2, "No such file or directory", "x"),
            "jaxpage: error: [Errno 2] No such file or directory: 'x'",
            2,
        ),
        (RuntimeError("boom\n  in two lines"), "jaxpage: error: RuntimeError: boom in two lines", 2),  # the last resort
        (KeyError("k"), "jaxpage: error: KeyError: 'k'", 2),
        (KeyboardInterrupt(), "jaxpage: interrupted", 130),  # Ctrl-C
    ],
)
def test_failures_inside_a_command_are_one_line(monkeypatch, capsys, error, line, status):
    def command(args):
        raise error

    monkeypatch.setitem(cli._COMMANDS, "predict", command)
    assert main(["predict", "hi"]) == status
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", line + "\n")


# A command that writes N characters to stdout once the test has closed the pipe's reading end.
WRITER = """
import sys
from jaxpage.entrypoints import cli

def write(args):
    sys.stdin.read()
    sys.stdout.write("x" * int(args.prompt))

cli._COMMANDS["predict"] = write
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("size", [10, 1_000_000])  # still buffered when the command returns; more than a pipe holds
def test_a_closed_stdout_stops_quietly(size):
    job = subprocess.Popen(
        [sys.executable, "-c", WRITER, "predict", str(size)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    job.stdout.close()  # `jaxpage ... | head -c 1` after head exits
    job.stdin.close()
    stderr = job.stderr.read()
    assert job.wait(timeout=60) == 141
    assert stderr == b""


def test_version():
    result = subprocess.run(["jaxpage", "--version"], capture_output=True, text=True)
    assert (result.returncode, result.stdout, result.stderr) == (0, f"jaxpage {jaxpage.__version__}\n", "")


def test_version_imports_no_jax():
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "jaxpage", "--version"], capture_output=True, text=True
    )
    assert result.returncode == 0
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()}
    assert "jaxpage.entrypoints.cli" in imported
    assert not imported & {"jax", "transformers", "torch"}


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["generate", "hi", "--max-tokens", "x"], ["predict", ""]])
def test_python_m_jaxpage_is_the_jaxpage_command(argv):
    script = subprocess.run(["jaxpage", *argv], capture_output=True, text=True)
    module = subprocess.run([sys.executable, "-m", "jaxpage", *argv], capture_output=True, text=True)
    assert (module.returncode, module.stdout, module.stderr) == (script.returncode, script.stdout, script.stderr)
