"""jaxpage's GGUF tokenizer (built without torch) against transformers' own GGUF conversion, the reference.

Four vocabularies: the default model's (SmolLM2: byte-level BPE, pre "smollm") and three written here beside tiny
models, as llama.cpp writes them: byte-level BPE with pre "llama-bpe" (Llama 3 style: no <|endoftext|>, BOS added,
user-defined <think>), byte-level BPE with pre "qwen2" (Qwen2 architecture, so transformers picks Qwen2Tokenizer),
and SentencePiece-style BPE ("llama": byte fallback, scores and no merges, BOS added by default).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import numpy as np
import pytest
from hf_reference import TINY_FAMILIES, make_tiny_hf_model
from test_gguf import write_gguf
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoTokenizer

from jaxpage.errors import ModelLoadError
from jaxpage.tokenizers.gguf_tokenizer import PRE_TOKENIZER_SPLITS, load_gguf_tokenizer
from jaxpage.tokenizers.tokenizer import load_tokenizer

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6  # llama.cpp's token types

TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away into the forest.",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old woodcutter.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    'for (int i = 0; i < 10; ++i) {\n\tprintf("%d\\n", i);\n}',
    "In 2024, 12345 people paid $3.14 each; 1,000,000 more will pay 99.99 in 2025.",
    "Le café est très bon, déjà vu à la façade. Straße, naïve, œuvre.",
    "東京は日本の首都です。北京欢迎你。",
    "I'm sure they've said it's what we'd do, and you'll see.",
]

CORPUS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "trailing space ",
    "   three leading spaces",
    "multiple   spaces    inside     words",
    "tabs\tand\t\ttabs\t",
    "new\nlines\n\n\nand\r\nCRLF\r\n",
    "\n",
    " ",
    "\t \n  \n\t",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    'for (int i = 0; i < 10; ++i) {\n\tprintf("%d\\n", i);  // C\n}',
    "naïve café, déjà vu, Straße, façade, œuvre, ÀÉÎÕÜ, e\u0301 (combining)",
    "東京は日本の首都です。北京欢迎你！서울 특별시. Ελληνικά, русский, العربية, עברית",
    "emoji: 🙂🚀👍🏽 family 👨\u200d👩\u200d👧\u200d👦 flags 🇫🇷🇯🇵",
    "digits 0123456789, numbers 3.14159, 1,000,000, -42, 1e-9, 2024-01-01, x² ½ ① ٣٤٥ ４５",
    "I'm sure they've said it's what we'd do, and you'll see. I'M SURE THEY'VE",
    "specials written in text: <|im_start|>user\nHi<|im_end|> <s>[INST] x [/INST]</s> <think>ok</think>",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><unk> <|endoftext|>",
    "odd unicode: \u00a0nbsp, zero\u200bwidth, \ufeffbom, \u2581 lower one eighth block, <0x41> spelled",
]
CORPUS.append(" ".join(CORPUS[1:]) * 3)  # a long mixed text

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "Quatre."},
        {"role": "user", "content": "And 3+3? 🙂"},
    ],
    [
        {"role": "user", "content": "多少钱？"},
        {"role": "assistant", "content": "  spaced  \n"},
        {"role": "user", "content": "tabs\tand\nnewlines"},
    ],
]

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
INST_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ '<<SYS>>\n' + message['content'] + '\n<</SYS>>\n\n' }}{% elif message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ ' ' + message['content'] + eos_token }}"
    "{% endif %}{% endfor %}"
)


@dataclasses.dataclass(frozen=True)
class VocabSpec:
    """A GGUF tokenizer to write beside a tiny model. Its EOS is token 2: `write_gguf` writes that id."""

    family: str  # the TINY_FAMILIES model written with it (its architecture picks transformers' tokenizer class)
    model: str
    pre: str
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None
    merges: list[str] | None
    token_ids: dict[str, int]  # bos / unk / pad
    add_bos: bool | None  # None: not written
    chat_template: str


def train_bpe(pre_tokenizer, **trainer_kwargs) -> tuple[list[str], list[str]]:
    """(vocabulary in id order, merges as "a b") of a small BPE trained on TRAINING_TEXT."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.train_from_iterator(TRAINING_TEXT * 4, trainers.BpeTrainer(show_progress=False, **trainer_kwargs))
    model = json.loads(tokenizer.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return sorted(model["vocab"], key=model["vocab"].get), merges


def byte_level_spec(family: str, pre: str, added: list[tuple[str, int]], **kwargs) -> VocabSpec:
    split = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    vocab, merges = train_bpe(split, vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokens = [token for token, _ in added] + vocab
    types = [kind for _, kind in added] + [NORMAL] * len(vocab)
    return VocabSpec(family, "gpt2", pre, tokens, types, None, merges, **kwargs)


def sentencepiece_spec() -> VocabSpec:
    """Llama 2 / Mistral layout: <unk> <s> </s>, control tokens, 256 byte tokens, then pieces scored best-first."""
    pieces, _ = train_bpe(pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always"), vocab_size=500)
    added = [("<unk>", UNKNOWN), ("<s>", CONTROL), ("</s>", CONTROL), ("[INST]", CONTROL), ("[/INST]", CONTROL)]
    added += [("<tool>", USER_DEFINED)] + [(f"<0x{b:02X}>", BYTE) for b in range(256)]
    return VocabSpec(
        family="smollm2-tied",
        model="llama",
        pre="default",
        tokens=[token for token, _ in added] + pieces,
        token_types=[kind for _, kind in added] + [NORMAL] * len(pieces),
        scores=[0.0] * len(added) + [-float(rank) for rank in range(len(pieces))],
        merges=None,
        token_ids={"bos": 1, "unk": 0},
        add_bos=None,
        chat_template=INST_TEMPLATE,
    )


VOCAB_SPECS = {
    "llama-bpe": lambda: byte_level_spec(
        "smollm2-tied",
        "llama-bpe",
        [
            ("<|begin_of_text|>", CONTROL),
            ("<|end_of_text|>", CONTROL),
            ("<|eot_id|>", CONTROL),
            ("<|start_header_id|>", CONTROL),
            ("<|end_header_id|>", CONTROL),
            ("<think>", USER_DEFINED),
            ("</think>", USER_DEFINED),
        ],
        token_ids={"bos": 0},
        add_bos=True,
        chat_template=LLAMA3_TEMPLATE,
    ),
    "qwen2": lambda: byte_level_spec(
        "qwen2-qkv-bias",
        "qwen2",
        [
            ("<|endoftext|>", CONTROL),
            ("<|im_start|>", CONTROL),
            ("<|im_end|>", CONTROL),
            ("<tool_call>", USER_DEFINED),
            ("</tool_call>", USER_DEFINED),
            ("<|fim hole|>", CONTROL),  # a control token outside the byte alphabet: a mislabel, kept plain
        ],
        token_ids={"bos": 0, "pad": 0},
        add_bos=False,
        chat_template=CHATML_TEMPLATE,
    ),
    "sentencepiece": sentencepiece_spec,
}

# Added tokens only transformers' conversion has: GPT2Tokenizer's default <|endoftext|>, which a Llama 3 vocabulary
# lacks, gets an id past the vocabulary (and the model's embedding table). jaxpage, like llama.cpp, leaves it text.
REFERENCE_ONLY_TOKENS = {"smollm2": set(), "llama-bpe": {"<|endoftext|>"}, "qwen2": set(), "sentencepiece": set()}


def write_tokenizer_gguf(spec: VocabSpec, path: Path) -> None:
    """A tiny model's GGUF file (see test_gguf.write_gguf) carrying the tokenizer `spec` describes."""

    def add_tokenizer(writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model(spec.model)
        writer.add_tokenizer_pre(spec.pre)
        writer.add_token_list(spec.tokens)
        writer.add_token_types(spec.token_types)
        if spec.scores is not None:
            writer.add_token_scores(spec.scores)
        if spec.merges is not None:
            writer.add_token_merges(spec.merges)
        for name, token_id in spec.token_ids.items():
            getattr(writer, f"add_{name}_token_id")(token_id)
        if spec.add_bos is not None:
            writer.add_add_bos_token(spec.add_bos)
        writer.add_chat_template(spec.chat_template)

    class TokenizerWriter(gguf.GGUFWriter):
        def write_header_to_file(self, *args, **kwargs):
            add_tokenizer(self)  # the header counts the metadata: it must all be in by now
            super().write_header_to_file(*args, **kwargs)

    model = make_tiny_hf_model(next(f for f in TINY_FAMILIES if f.name == spec.family))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFWriter", TokenizerWriter)
        write_gguf(model, path)


@dataclasses.dataclass
class Case:
    path: Path
    size: int  # tokens in the file
    built: object  # load_tokenizer's first call: built from the metadata by jaxpage.tokenizers.gguf_tokenizer
    cached: object  # its second call: read back from the jaxpage cache
    reference: object  # transformers' GGUF conversion
    reference_only: set[str]

    def ours(self, kind: str):
        return self.built if kind == "built" else self.cached


@pytest.fixture(scope="module")
def cases(smollm2_path, tmp_path_factory):
    """cases(name) -> Case, each made once."""
    made: dict[str, Case] = {}

    def get(name: str) -> Case:
        if name not in made:
            if name == "smollm2":
                path = smollm2_path
            else:
                path = tmp_path_factory.mktemp(name) / f"{name}.gguf"
                write_tokenizer_gguf(VOCAB_SPECS[name](), path)
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv("JAXPAGE_CACHE", str(tmp_path_factory.mktemp("cache")))
                built = load_tokenizer(path)
                cached = load_tokenizer(path)
            reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            size = len(gguf.GGUFReader(path, "r").fields["tokenizer.ggml.tokens"].data)
            made[name] = Case(path, size, built, cached, reference, REFERENCE_ONLY_TOKENS[name])
        return made[name]

    return get


NAMES = ["smollm2", "llama-bpe", "qwen2", "sentencepiece"]
KINDS = ["built", "cached"]


def texts_for(case: Case, ours) -> list[str]:
    """CORPUS, plus a text made of every added token of the vocabulary between bits of text."""
    added = sorted(ours.get_added_vocab())
    return [*CORPUS, "".join(f"{token}x {token} y\n{token}" for token in added)]


def comparable(case: Case, text: str) -> bool:
    return not any(token in text for token in case.reference_only)


@pytest.mark.parametrize("name", NAMES)
def test_backend_tokenizer_equals_transformers(cases, name):
    case = cases(name)
    ours, reference = (
        json.loads(case.built.backend_tokenizer.to_str()),
        json.loads(case.reference.backend_tokenizer.to_str()),
    )
    extra = [t for t in reference["added_tokens"] if t["id"] >= case.size]
    assert {t["content"] for t in extra} == case.reference_only
    reference["added_tokens"] = [t for t in reference["added_tokens"] if t["id"] < case.size]
    assert ours == reference
    assert len(case.built) == len(case.cached) == case.size == len(case.reference) - len(extra)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", NAMES)
def test_special_tokens_equal_transformers(cases, name, kind):
    case = cases(name)
    ours, reference = case.ours(kind), case.reference
    assert ours.special_tokens_map == reference.special_tokens_map
    for attribute in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id"):
        assert getattr(ours, attribute) == getattr(reference, attribute), attribute
    if kind == "built":  # transformers 5 saves no add_bos_token: the tokenizer.json post-processor adds BOS
        assert (ours.add_bos_token, ours.add_eos_token) == (reference.add_bos_token, reference.add_eos_token)
    assert ours.all_special_ids == reference.all_special_ids
    assert ours.get_added_vocab() == {t: i for t, i in reference.get_added_vocab().items() if i < case.size}
    assert ours.chat_template == reference.chat_template


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", NAMES)
def test_encode_equals_transformers(cases, name, kind):
    case = cases(name)
    ours = case.ours(kind)
    for text in filter(lambda t: comparable(case, t), texts_for(case, ours)):
        for add_special_tokens in (True, False):
            expected = case.reference(text, add_special_tokens=add_special_tokens).input_ids
            assert ours(text, add_special_tokens=add_special_tokens).input_ids == expected, (text, add_special_tokens)
            assert ours.encode(text, add_special_tokens=add_special_tokens) == expected, text
    batch = [t for t in CORPUS if comparable(case, t)]
    assert ours(batch).input_ids == case.reference(batch).input_ids


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", NAMES)
def test_decode_equals_transformers(cases, name, kind):
    case = cases(name)
    ours, reference = case.ours(kind), case.reference
    rng = np.random.default_rng(0)
    sequences = [reference(text).input_ids for text in texts_for(case, ours) if comparable(case, text)]
    sequences += [rng.integers(0, case.size, length).tolist() for length in (1, 2, 3, 7, 50, 300)]
    sequences += [[*rng.integers(0, case.size, 5).tolist(), *reference.all_special_ids, 0, case.size - 1]]
    for ids in sequences:
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip), ids
        assert ours.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)
    each = [[token_id] for token_id in range(case.size)]  # every token alone
    for skip in (True, False):
        assert ours.batch_decode(each, skip_special_tokens=skip) == reference.batch_decode(
            each, skip_special_tokens=skip
        )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", NAMES)
def test_chat_template_equals_transformers(cases, name, kind):
    case = cases(name)
    ours, reference = case.ours(kind), case.reference
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            args = dict(conversation=messages, add_generation_prompt=add_generation_prompt)
            text = ours.apply_chat_template(**args, tokenize=False)
            assert text == reference.apply_chat_template(**args, tokenize=False)
            ids = ours.apply_chat_template(**args, tokenize=True, return_dict=False)
            assert list(ids) == list(reference.apply_chat_template(**args, tokenize=True, return_dict=False)), text


def test_default_special_token_missing_from_the_vocabulary_stays_text(cases):
    """The one place jaxpage departs from transformers: a Llama 3 vocabulary has no <|endoftext|>, and transformers'
    conversion gives GPT2Tokenizer's default one an id past the model's embedding table. jaxpage reads it as text."""
    case = cases("llama-bpe")
    text = "end<|endoftext|>"
    assert case.reference(text, add_special_tokens=False).input_ids[-1] == case.size
    ids = case.built(text, add_special_tokens=False).input_ids
    assert max(ids) < case.size and case.built.decode(ids) == text


def test_building_and_using_the_default_tokenizer_imports_no_torch(smollm2_path, tmp_path):
    code = textwrap.dedent(
        f"""
        import sys
        from jaxpage.tokenizers.tokenizer import load_tokenizer

        for attempt in ("built", "cached"):
            tokenizer = load_tokenizer({str(smollm2_path)!r})
            ids = tokenizer("Hello, world! 東京 🙂").input_ids
            assert tokenizer.decode(ids) == "Hello, world! 東京 🙂", attempt
            chat = [{{"role": "user", "content": "Hi!"}}]
            ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
            assert tokenizer.decode(ids).endswith("<|im_start|>user\\nHi!<|im_end|>\\n<|im_start|>assistant\\n")
            assert "torch" not in sys.modules, f"torch was imported ({{attempt}})"
        """
    )
    env = {**os.environ, "JAXPAGE_CACHE": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(list((tmp_path / "gguf-tokenizers").iterdir())) == 1


# ----- malformed metadata: ModelLoadError naming the file and the field -----

VALID = {
    "general.architecture": "llama",
    "tokenizer.ggml.model": "gpt2",
    "tokenizer.ggml.tokens": ["a", "b", "ab", "<s>"],
    "tokenizer.ggml.token_type": [NORMAL, NORMAL, NORMAL, CONTROL],
    "tokenizer.ggml.merges": ["a b"],
    "tokenizer.ggml.bos_token_id": 3,
    "tokenizer.ggml.add_bos_token": True,
}


def write_metadata_gguf(path: Path, metadata: dict) -> None:
    """A GGUF file holding only `metadata` (no tensors)."""
    writer = gguf.GGUFWriter(str(path), metadata["general.architecture"])
    for key, value in metadata.items():
        if key == "general.architecture":
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_int32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_minimal_valid_metadata_builds(tmp_path):
    write_metadata_gguf(tmp_path / "ok.gguf", VALID)
    tokenizer = load_gguf_tokenizer(tmp_path / "ok.gguf")
    assert tokenizer("abab<s>b").input_ids == [3, 2, 2, 3, 1]
    assert tokenizer.bos_token == "<s>" and tokenizer.eos_token is None


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"tokenizer.ggml.model": "t5"}, "tokenizer.ggml.model"),
        ({"tokenizer.ggml.model": None}, "tokenizer.ggml.model"),
        ({"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens"),
        ({"tokenizer.ggml.tokens": [1, 2, 3]}, "tokenizer.ggml.tokens"),
        ({"tokenizer.ggml.token_type": [NORMAL]}, "tokenizer.ggml.token_type"),
        ({"tokenizer.ggml.bos_token_id": 4}, "tokenizer.ggml.bos_token_id"),
        ({"tokenizer.ggml.padding_token_id": -1}, "tokenizer.ggml.padding_token_id"),
        ({"tokenizer.ggml.merges": ["a b c"]}, "tokenizer.ggml.merges"),
        ({"tokenizer.ggml.merges": ["a z"]}, "tokenizer.ggml.merges"),
        ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.merges": None}, "tokenizer.ggml.scores"),
        ({"tokenizer.ggml.scores": [0.0, 1.0, 2.0]}, "tokenizer.ggml.scores"),
        ({"tokenizer.ggml.add_bos_token": "yes"}, "tokenizer.ggml.add_bos_token"),
        ({"general.architecture": "gemma", "tokenizer.ggml.model": "llama"}, "architecture 'gemma'"),
    ],
)
def test_malformed_metadata_names_the_file_and_the_field(tmp_path, monkeypatch, change, field):
    monkeypatch.setenv("JAXPAGE_CACHE", str(tmp_path / "cache"))
    metadata = {k: v for k, v in {**VALID, **change}.items() if v is not None}
    path = tmp_path / "bad.gguf"
    write_metadata_gguf(path, metadata)
    with pytest.raises(ModelLoadError, match=field) as error:
        load_tokenizer(path)
    assert str(path) in str(error.value)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="junk.gguf"):
        load_gguf_tokenizer(path)
