"""Embeddings of many inputs of mixed length: jaxpage's LLM.embed against sentence-transformers' encode, on the same
machine, in one run (issue 57's target: >= 1.5x sentence-transformers' throughput on CPU, the same embeddings to
1e-5).

    python scripts/bench_embed.py [--num-inputs 10000] [--models encoder,decoder] [--max-num-batched-tokens 512]
        [--max-num-seqs 128] [--st-batch-sizes 16,32,64,128] [--tune-inputs 500] [--repeats 1]
        [--min-tokens 8] [--max-tokens 512] [--seed 0] [--model-dir DIR] [--tiny]

Models (random weights, torch.manual_seed(--seed); no hub needed), each written with transformers' save_pretrained
(safetensors) under a sentence-transformers wrapper (modules.json, 1_Pooling, 2_Normalize), in a temporary directory
or --model-dir (DIR/<model>[-tiny]-<max tokens>-seed<seed>, reused when there):
  encoder  all-MiniLM-L6-v2's shape: BertModel, 6 layers, hidden 384, 12 heads, intermediate 1536, vocab 30522,
           512 positions; mean pooling, then Normalize
  decoder  a small Qwen3-Embedding: Qwen3Model, 4 layers, hidden 256, 4 heads, 2 KV heads, head_dim 64,
           intermediate 768, vocab 32000, 1024 positions, tied embeddings (as Qwen3-Embedding-0.6B); last-token
           pooling, then Normalize
Both take inputs of up to --max-tokens tokens (sentence_bert_config.json's max_seq_length; jaxpage reads it as its
max_model_len).

The inputs: --num-inputs lengths (in tokens, special tokens included) drawn log-uniform over [--min-tokens,
--max-tokens] (numpy's default_rng(--seed): so about as many inputs of 8-64 tokens as of 64-512; the mean is ~120),
each input's tokens drawn uniformly from the vocabulary's plain ids (no special or unused ids). The models have a
word-level tokenizer (tokenizers' WordLevel, split on spaces) whose word for id i is `w{i:05d}`, with the model's
special tokens added as its family does ([CLS] ... [SEP] for the encoder, ... <|endoftext|> for the decoder), so
each input is a text whose tokens are exactly the drawn ids, and both sides are timed on the whole call a user makes,
tokenizing included: `LLM(model_dir, runner="pooling", ...).embed(texts)` and `SentenceTransformer(model_dir).encode(
texts, batch_size=B)` (which sorts its inputs by length, longest first, and pads each batch to its longest). Both
sides' token ids are checked against the drawn ones (jaxpage's prompt_token_ids; sentence-transformers' tokenizer).

sentence-transformers: torch at its default thread count (torch.get_num_threads(), printed), float32; its batch
size is tuned first: encode of the first --tune-inputs inputs with each of --st-batch-sizes in turn, twice, the
fastest taken. jaxpage: float32 (its CPU default), XLA's own threads; one LLM per --max-num-batched-tokens value
(default 512: steps of up to max(it, max_model_len) tokens, rounded up to a power of two), each warmed up
first (untimed: one step of every step shape the engine may run, jaxpage.worker.packed_steps.step_shapes: each
(tokens, row length) compiled before the timed call; compile seconds reported per shape, and any shape compiled
during the timed call counted). --repeats times, in turn: the
sentence-transformers call, then each jaxpage LLM's; the fastest of each is reported. Each timed call also gives
the cores it kept busy (the process's CPU seconds per wall second) and the machine's load average before it: on a
shared machine, others' work shows there.

Per model and side: inputs/s, tokens/s (the inputs' own tokens), the padding share (padding tokens / all tokens the
model ran: jaxpage's steps' token axes, rows of a power of two tokens; sentence-transformers' padded batches), the
max |difference| of every input's embedding from sentence-transformers', and the attention's work over the least it
could be (attention_pairs_over_ideal: the (query, key) pairs scored, over the sum of each input's length squared;
jaxpage scores every pair within a row, sentence-transformers every pair of a padded batch's rows). For jaxpage
also: the compiled (tokens, input slots, row length) shapes and their compile seconds, its steps per (tokens, row
length) (count, mean ms), and where its call's time went (preparing the inputs: tokenizing and checks; the device
steps; the rest: packing, normalizing, outputs), and the same steps' seconds with attention left out (the products,
norms and activations alone: most_over_st, sentence-transformers' seconds over those, is the most any packing,
attention kernel or host work could reach with XLA's CPU products). The last line of stdout is one JSON object with
every figure. The exit status is 1 where any embedding differs by more than 1e-5.

--tiny: a quick check of the script: 64 inputs of 8-32 tokens, 2-layer models, batch sizes 16 and 32, steps of
up to 32 tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxpage.benchmarks.progress import log

TOLERANCE = 1e-5
TARGET_RATIO = 1.5


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A benchmark model: its transformers config, its tokenizer's special tokens, its pooling."""

    family: str  # "bert" or "qwen3"
    config: dict  # the transformers config's fields
    specials: dict  # special token -> id
    template: str  # tokenizers' TemplateProcessing of a single input
    tokenizer_roles: dict  # PreTrainedTokenizerFast's special-token arguments
    pooling_mode: str  # sentence-transformers' Pooling mode
    first_plain_id: int  # inputs' tokens are drawn from [first_plain_id, last_plain_id)
    last_plain_id: int

    @property
    def num_specials(self) -> int:
        """Special tokens the tokenizer adds to each input."""
        return sum(word in self.specials for word in self.template.split())


MODELS = {
    "encoder": ModelSpec(
        family="bert",
        config=dict(
            vocab_size=30522,
            hidden_size=384,
            num_hidden_layers=6,
            num_attention_heads=12,
            intermediate_size=1536,
            max_position_embeddings=512,
        ),
        specials={"[PAD]": 0, "[UNK]": 100, "[CLS]": 101, "[SEP]": 102, "[MASK]": 103},
        template="[CLS] $A [SEP]",
        tokenizer_roles=dict(
            pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]"
        ),
        pooling_mode="mean",
        first_plain_id=1000,  # BERT's vocabulary: [unused] tokens and specials below
        last_plain_id=30522,
    ),
    "decoder": ModelSpec(
        family="qwen3",
        config=dict(
            vocab_size=32000,
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            intermediate_size=768,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
        ),
        specials={"<|endoftext|>": 31990, "<|im_start|>": 31991, "<|im_end|>": 31992},
        template="$A <|endoftext|>",
        tokenizer_roles=dict(pad_token="<|endoftext|>", unk_token="<|endoftext|>", eos_token="<|endoftext|>"),
        pooling_mode="lasttoken",
        first_plain_id=0,
        last_plain_id=31990,  # Qwen's special tokens follow the plain ones
    ),
}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-inputs", type=int, default=None, help="default 10000 (--tiny: 64)")
    parser.add_argument("--models", default="encoder,decoder")
    parser.add_argument(
        "--max-num-batched-tokens", default=None, help="comma-separated: a jaxpage LLM each (default 512; --tiny: 32)"
    )
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--st-batch-sizes", default=None, help="default 16,32,64,128 (--tiny: 16,32)")
    parser.add_argument("--tune-inputs", type=int, default=500, help="inputs of each batch-size trial")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--min-tokens", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=None, help="default 512 (--tiny: 32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-dir", default=None, help="where the models are written, and reused from")
    parser.add_argument("--tiny", action="store_true", help="64 short inputs, 2-layer models: a quick check")
    args = parser.parse_args()
    tiny = args.tiny
    args.num_inputs = args.num_inputs or (64 if tiny else 10000)
    args.max_tokens = args.max_tokens or (32 if tiny else 512)
    args.max_num_batched_tokens = [
        int(v) for v in (args.max_num_batched_tokens or ("32" if tiny else "512")).split(",")
    ]
    args.st_batch_sizes = [int(v) for v in (args.st_batch_sizes or ("16,32" if tiny else "16,32,64,128")).split(",")]
    args.models = args.models.split(",")
    unknown = set(args.models) - set(MODELS)
    if unknown:
        parser.error(f"--models: unknown {sorted(unknown)}; choose from {', '.join(MODELS)}")
    if not 1 <= args.min_tokens <= args.max_tokens:
        parser.error("--min-tokens must be at least 1 and at most --max-tokens")
    for name in args.models:
        spec = MODELS[name]
        if args.min_tokens <= spec.num_specials:
            parser.error(f"--min-tokens: the {name}'s tokenizer adds {spec.num_specials} tokens; give more than that")
        if args.max_tokens > spec.config["max_position_embeddings"]:
            parser.error(f"--max-tokens: the {name} takes {spec.config['max_position_embeddings']} tokens at most")
    return args


def word(token_id: int) -> str:
    return f"w{token_id:05d}"


def build_tokenizer(spec: ModelSpec, max_tokens: int):
    """A word-level tokenizer: the word `w{i:05d}` is token i, the specials at their ids, added by spec.template."""
    from tokenizers import Tokenizer, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    special_ids = set(spec.specials.values())
    vocab = {word(i): i for i in range(spec.config["vocab_size"]) if i not in special_ids} | spec.specials
    tokenizer = Tokenizer(WordLevel(vocab, unk_token=spec.tokenizer_roles["unk_token"]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    added = [(token, spec.specials[token]) for token in spec.template.split() if token in spec.specials]
    tokenizer.post_processor = processors.TemplateProcessing(single=spec.template, special_tokens=added)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=max_tokens, **spec.tokenizer_roles)


def write_model(spec: ModelSpec, directory: Path, num_layers: int | None, max_tokens: int, seed: int) -> None:
    """The random model as a sentence-transformers directory: the transformers model at its root (safetensors),
    then Pooling and Normalize."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import BertConfig, BertModel, Qwen3Config, Qwen3Model

    config_class, model_class = {"bert": (BertConfig, BertModel), "qwen3": (Qwen3Config, Qwen3Model)}[spec.family]
    fields = spec.config | ({} if num_layers is None else {"num_hidden_layers": num_layers})
    config = config_class(**fields)
    torch.manual_seed(seed)
    hf_dir = directory.with_name(directory.name + "-hf")
    model_class(config).eval().save_pretrained(hf_dir, safe_serialization=True)
    build_tokenizer(spec, max_tokens).save_pretrained(hf_dir)
    transformer = Transformer(str(hf_dir), max_seq_length=max_tokens)
    pooling = Pooling(config.hidden_size, pooling_mode=spec.pooling_mode)
    SentenceTransformer(modules=[transformer, pooling, Normalize()], device="cpu").save(str(directory))


def draw_inputs(spec: ModelSpec, num_inputs: int, min_tokens: int, max_tokens: int, seed: int):
    """(texts, token ids with the specials, lengths): lengths log-uniform over [min_tokens, max_tokens]."""
    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.uniform(np.log(min_tokens), np.log(max_tokens + 1), num_inputs)).astype(np.int64)
    lengths = np.clip(lengths, min_tokens, max_tokens)
    words = np.array([word(i) for i in range(spec.config["vocab_size"])])
    texts, token_ids = [], []
    template = spec.template.split()
    for length in lengths:
        plain = rng.integers(spec.first_plain_id, spec.last_plain_id, length - spec.num_specials)
        texts.append(" ".join(words[plain]))
        ids = []
        for part in template:
            ids.extend(plain.tolist() if part == "$A" else [spec.specials[part]])
        token_ids.append(ids)
    return texts, token_ids, lengths


@dataclasses.dataclass(frozen=True)
class Timing:
    """A timed call: its wall seconds, the process's CPU seconds per wall second during it (the cores it kept busy),
    and the machine's 1-minute load average just before it (others' work on a shared machine shows there)."""

    seconds: float
    cores: float
    load: float

    def __str__(self) -> str:
        return f"{self.seconds:.2f}s, {self.cores:.2f} cores busy, load {self.load:.2f} before"


def timed(call):
    """(call(), its Timing)."""
    load = os.getloadavg()[0]
    cpu, start = os.times(), time.perf_counter()
    result = call()
    seconds, end = time.perf_counter() - start, os.times()
    return result, Timing(seconds, (end.user - cpu.user + end.system - cpu.system) / seconds, load)


class STRun:
    """sentence-transformers' encode, each padded batch it runs recorded (its preprocess, wrapped)."""

    def __init__(self, model_dir: Path):
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(str(model_dir), device="cpu")
        self.batches: list[tuple[int, int, int]] = []  # (inputs, padded length, real tokens) of each batch
        preprocess = self.model.preprocess

        @functools.wraps(preprocess)
        def recorded(*args, **kwargs):
            features = preprocess(*args, **kwargs)
            mask = features["attention_mask"]
            self.batches.append((*mask.shape, int(mask.sum())))
            return features

        self.model.preprocess = recorded

    def encode(self, texts: list[str], batch_size: int) -> tuple[np.ndarray, Timing]:
        self.batches = []
        return timed(lambda: self.model.encode(texts, batch_size=batch_size))


class JaxpageRun:
    """An LLM over the model, each packed step and input preparation it runs recorded (wrapped) and timed."""

    def __init__(self, model_dir: Path, max_num_batched_tokens: int, max_num_seqs: int):
        from jaxpage import LLM

        self.llm = LLM(
            str(model_dir), runner="pooling", max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
        )
        engine = self.llm.engine
        self.steps: list[tuple[int, int, int, float]] = []  # (tokens, row length, real tokens, seconds) of each step
        self.prepare_s = 0.0
        run, prepare = engine.runner.run, engine.prepare_request

        def timed_run(step):
            start = time.perf_counter()
            pooled = run(step)
            self.steps.append((len(step.token_ids), step.row_length, step.num_tokens, time.perf_counter() - start))
            return pooled

        def timed_prepare(*args, **kwargs):
            start = time.perf_counter()
            request = prepare(*args, **kwargs)
            self.prepare_s += time.perf_counter() - start
            return request

        engine.runner.run, engine.prepare_request = timed_run, timed_prepare

    def warm_up(self, plain_id: int) -> None:
        """Compiles every step shape: for each (row length, tokens), one step of inputs that fill its rows, one a
        row."""
        from jaxpage.worker.packed_steps import step_shapes

        engine = self.llm.engine
        for row_length, tokens in step_shapes(engine.max_step_tokens, engine.max_model_len):
            length = min(row_length, engine.max_model_len)
            self.llm.embed([{"prompt_token_ids": [plain_id] * length}] * (tokens // row_length))

    def embed(self, texts: list[str]):
        self.steps, self.prepare_s = [], 0.0
        return timed(lambda: self.llm.embed(texts))

    def seconds_without_attention(self, steps: list[tuple[int, int, int, float]], plain_id: int) -> float:
        """The seconds `steps` (as self.steps records them) take with attention left out (each head's output its
        query): the products, norms and activations alone, each step shape's fastest of 5 (the same program but for
        attention). No attention, padding or host work could make a call faster than this."""
        from jaxpage.models.attention import PackedAttention
        from jaxpage.worker.packed_steps import StepPlan, pack
        from jaxpage.worker.pooling_runner import PoolingRunner

        engine = self.llm.engine
        attend = PackedAttention.attend
        PackedAttention.attend = lambda self, q, k, v, batch, kv_cache, layer: q
        try:
            runner = PoolingRunner(engine.model, engine.pooler.pooling_type)  # traced with the attention left out
            seconds = {}
            for tokens, row_length in {(t, r) for t, r, _, _ in steps}:
                rows = tokens // row_length
                plan = StepPlan(list(range(rows)), row_length, rows)
                step = pack([[plain_id] * row_length] * rows, plan, engine.max_num_seqs)
                runner.run(step)  # compiles
                seconds[tokens, row_length] = min(
                    timed(lambda step=step: runner.run(step))[1].seconds for _ in range(5)
                )
        finally:
            PackedAttention.attend = attend
        return sum(seconds[tokens, row_length] for tokens, row_length, _, _ in steps)


def padding_share(padded: int, real: int) -> float:
    return (padded - real) / padded


def timings(runs: list[Timing]) -> dict:
    return dict(
        seconds=[round(t.seconds, 3) for t in runs],
        cores_used=[round(t.cores, 2) for t in runs],
        load_before=[round(t.load, 2) for t in runs],
    )


def tune_batch_size(st: STRun, texts: list[str], batch_sizes: list[int], name: str) -> dict[int, float]:
    """Inputs/s of encode over `texts` at each batch size: the best of two rounds, the sizes in turn."""
    st.encode(texts[:8], batch_size=8)  # torch's first call
    rates = dict.fromkeys(batch_sizes, 0.0)
    for _ in range(2):
        for batch_size in batch_sizes:
            _, timing = st.encode(texts, batch_size)
            rates[batch_size] = max(rates[batch_size], round(len(texts) / timing.seconds, 2))
            log(f"{name}: sentence-transformers batch size {batch_size}: {len(texts) / timing.seconds:.1f} inputs/s")
    return rates


def bench_model(name: str, args, model_root: Path) -> dict:
    import torch

    spec = MODELS[name]
    num_layers = 2 if args.tiny else None
    directory = model_root / f"{name}{'-tiny' if args.tiny else ''}-{args.max_tokens}-seed{args.seed}"
    if (directory / "modules.json").exists():
        log(f"{name}: reusing {directory}")
    else:
        log(f"{name}: writing a random model to {directory}")
        write_model(spec, directory, num_layers, args.max_tokens, args.seed)
    texts, token_ids, lengths = draw_inputs(spec, args.num_inputs, args.min_tokens, args.max_tokens, args.seed)
    total_tokens = int(lengths.sum())
    log(f"{name}: {len(texts)} inputs, {total_tokens} tokens (mean {lengths.mean():.1f})")

    st = STRun(directory)
    st_ids, st_tokenize = timed(lambda: st.model.tokenizer(texts).input_ids)
    assert st_ids == token_ids, "sentence-transformers' tokenizer does not give the drawn token ids"
    tuning = tune_batch_size(st, texts[: args.tune_inputs], args.st_batch_sizes, name)
    batch_size = max(tuning, key=tuning.get)

    runs = {}
    for tokens in args.max_num_batched_tokens:
        log(f"{name}: jaxpage, max_num_batched_tokens {tokens}: loading and compiling")
        runs[tokens] = JaxpageRun(directory, tokens, args.max_num_seqs)
        runs[tokens].warm_up(spec.first_plain_id)

    st_timings, st_embeddings, st_batches = [], None, None
    jp_timings = {tokens: [] for tokens in runs}
    fastest = {}  # max_num_batched_tokens -> (steps, prepare seconds) of its fastest call
    compiled = dict.fromkeys(runs, 0)  # shapes compiled during the timed calls
    max_abs_diff = {}
    for repeat in range(args.repeats):
        embeddings, timing = st.encode(texts, batch_size)
        st_timings.append(timing)
        if st_embeddings is None:
            st_embeddings, st_batches = embeddings, st.batches
        log(f"{name}: sentence-transformers, batch size {batch_size}: {timing} (repeat {repeat + 1})")
        for tokens, run in runs.items():
            compiled_before = len(run.llm.engine.runner.compile_seconds)
            outputs, timing = run.embed(texts)
            compiled[tokens] += len(run.llm.engine.runner.compile_seconds) - compiled_before
            log(f"{name}: jaxpage, max_num_batched_tokens {tokens}: {timing} (repeat {repeat + 1})")
            if timing.seconds < min((t.seconds for t in jp_timings[tokens]), default=np.inf):
                fastest[tokens] = (run.steps, run.prepare_s)
            jp_timings[tokens].append(timing)
            if repeat == 0:
                assert [o.prompt_token_ids for o in outputs] == token_ids, "jaxpage's token ids are not the drawn ones"
                got = np.array([o.outputs.embedding for o in outputs], np.float32)
                max_abs_diff[tokens] = float(np.abs(got - st_embeddings).max())

    st_best = min(t.seconds for t in st_timings)
    st_padded = sum(rows * length for rows, length, _ in st_batches)
    ideal_pairs = int((lengths.astype(np.int64) ** 2).sum())  # attention's (query, key) pairs, each input alone
    assert sum(real for _, _, real in st_batches) == total_tokens
    report = dict(
        model=name,
        family=spec.family,
        config=spec.config | ({"num_hidden_layers": num_layers} if num_layers else {}),
        pooling=spec.pooling_mode,
        num_inputs=len(texts),
        tokens=total_tokens,
        mean_tokens=round(float(lengths.mean()), 2),
        st=dict(
            batch_size=batch_size,
            batch_size_tuning_inputs_per_s=tuning,
            tuning_inputs=min(args.tune_inputs, len(texts)),
            torch_threads=torch.get_num_threads(),
            **timings(st_timings),
            inputs_per_s=round(len(texts) / st_best, 2),
            tokens_per_s=round(total_tokens / st_best, 1),
            padding_share=round(padding_share(st_padded, total_tokens), 4),
            attention_pairs_over_ideal=round(sum(rows * length**2 for rows, length, _ in st_batches) / ideal_pairs, 3),
            batches=len(st_batches),
            tokenize_s=round(st_tokenize.seconds, 3),
        ),
        jaxpage=[],
    )
    for tokens, run in runs.items():
        best = min(t.seconds for t in jp_timings[tokens])
        steps, prepare_s = fastest[tokens]
        floor_s = run.seconds_without_attention(steps, spec.first_plain_id)
        assert sum(real for _, _, real, _ in steps) == total_tokens
        padded = sum(tokens for tokens, _, _, _ in steps)
        step_s = sum(seconds for _, _, _, seconds in steps)
        by_shape = {}
        for step_tokens, row_length, _, seconds in steps:
            count, total = by_shape.get((step_tokens, row_length), (0, 0.0))
            by_shape[step_tokens, row_length] = (count + 1, total + seconds)
        engine = run.llm.engine
        report["jaxpage"].append(
            dict(
                max_num_batched_tokens=tokens,
                max_num_seqs=args.max_num_seqs,
                max_step_tokens=engine.max_step_tokens,
                **timings(jp_timings[tokens]),
                inputs_per_s=round(len(texts) / best, 2),
                tokens_per_s=round(total_tokens / best, 1),
                over_st=round(st_best / best, 3),
                meets_target=st_best / best >= TARGET_RATIO,
                padding_share=round(padding_share(padded, total_tokens), 4),
                attention_pairs_over_ideal=round(sum(t * row for t, row, _, _ in steps) / ideal_pairs, 3),
                max_abs_diff=max_abs_diff[tokens],
                embeddings_match=max_abs_diff[tokens] <= TOLERANCE,
                compiled_shapes=[
                    dict(tokens=shape[0], slots=shape[1], row_length=shape[2], compile_s=round(seconds, 3))
                    for shape, seconds in sorted(engine.runner.compile_seconds.items())
                ],
                compile_s=round(sum(engine.runner.compile_seconds.values()), 2),
                compiled_in_timed_call=compiled[tokens],
                steps=len(steps),
                steps_by_shape=[
                    dict(tokens=shape[0], row_length=shape[1], steps=count, mean_ms=round(1e3 * total / count, 2))
                    for shape, (count, total) in sorted(by_shape.items())
                ],
                time_split_s=dict(
                    prepare=round(prepare_s, 3), device_steps=round(step_s, 3), rest=round(best - prepare_s - step_s, 3)
                ),
                steps_without_attention_s=round(floor_s, 3),
                most_over_st=round(st_best / floor_s, 3),
            )
        )
    return report


def print_table(reports: list[dict]) -> None:
    print(
        "| model | side | setting | seconds | cores busy | inputs/s | tokens/s | vs ST | padding share "
        "| attention pairs / ideal | max abs diff | compiled shapes |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for report in reports:
        st = report["st"]
        model = f"{report['model']} ({report['config']['num_hidden_layers']} layers, {report['pooling']})"
        best = int(np.argmin(st["seconds"]))
        print(
            f"| {model} | sentence-transformers | batch size {st['batch_size']}, {st['torch_threads']} torch threads "
            f"| {st['seconds'][best]:.2f} | {st['cores_used'][best]:.2f} | {st['inputs_per_s']:.1f} "
            f"| {st['tokens_per_s']:.0f} | 1.00x | {st['padding_share']:.1%} | {st['attention_pairs_over_ideal']:.2f} "
            "| - | - |"
        )
        for row in report["jaxpage"]:
            best = int(np.argmin(row["seconds"]))
            print(
                f"| {model} | jaxpage | max_num_batched_tokens {row['max_num_batched_tokens']} "
                f"| {row['seconds'][best]:.2f} | {row['cores_used'][best]:.2f} | {row['inputs_per_s']:.1f} "
                f"| {row['tokens_per_s']:.0f} | {row['over_st']:.2f}x | {row['padding_share']:.1%} "
                f"| {row['attention_pairs_over_ideal']:.2f} "
                f"| {row['max_abs_diff']:.1e} | {len(row['compiled_shapes'])} ({row['compile_s']:.1f}s) |"
            )
    print()
    for report in reports:
        for row in report["jaxpage"]:
            split = row["time_split_s"]
            steps = ", ".join(
                f"{s['steps']} x {s['tokens']}/{s['row_length']} ({s['mean_ms']:.1f} ms)" for s in row["steps_by_shape"]
            )
            shapes = ", ".join(
                f"{s['tokens']}/{s['row_length']}/{s['slots']} ({s['compile_s']:.1f}s)" for s in row["compiled_shapes"]
            )
            print(
                f"- {report['model']}, jaxpage max_num_batched_tokens {row['max_num_batched_tokens']}: {row['steps']} "
                f"steps (count x tokens/row length: {steps}); of its call: preparing inputs {split['prepare']:.2f}s, "
                f"device steps {split['device_steps']:.2f}s, the rest {split['rest']:.2f}s; the same steps without "
                f"attention {row['steps_without_attention_s']:.2f}s (so at most {row['most_over_st']:.2f}x "
                f"sentence-transformers, were attention, padding and the host free); compiled (tokens/row "
                f"length/input slots): {shapes}"
            )


def main() -> None:
    args = parse_args()
    import jax
    import torch

    log(f"torch threads: {torch.get_num_threads()}; jax devices: {jax.devices()}")
    reports = []
    with tempfile.TemporaryDirectory() as tmp:
        model_root = Path(args.model_dir) if args.model_dir else Path(tmp)
        for name in args.models:
            reports.append(bench_model(name, args, model_root))
    print_table(reports)
    summary = dict(
        num_inputs=args.num_inputs,
        min_tokens=args.min_tokens,
        max_tokens=args.max_tokens,
        seed=args.seed,
        repeats=args.repeats,
        tiny=args.tiny,
        target_ratio=TARGET_RATIO,
        tolerance=TOLERANCE,
        models=reports,
    )
    print(json.dumps(summary))
    if not all(row["embeddings_match"] for report in reports for row in report["jaxpage"]):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
