"""Tiny random pooling models for the tests (tests/test_pooling*.py), built with transformers and
sentence-transformers (torch): a BERT sentence-transformers model and BERT sequence classifiers, over a tiny WordPiece
vocabulary. conftest.py's session fixtures `bert_st_dir` and `bert_classifiers` build each once."""

from __future__ import annotations

WORDS = "the a of and to in is on for with that this cat dog runs fast slow red blue green sky sea tree".split()
TEXTS = [
    "the cat runs fast",
    "a dog",
    "the blue sky and the green sea with a red tree on the sea",
    "is",
    "the dog and the cat run in the sky for that tree",
]


def tiny_bert_tokenizer(directory):
    """A BERT WordPiece tokenizer of a tiny vocabulary (special tokens, WORDS, letters), its vocab.txt in directory."""
    from transformers import BertTokenizer

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    (directory / "vocab.txt").write_text("\n".join(specials + WORDS + letters + [f"##{c}" for c in letters]) + "\n")
    tokenizer = BertTokenizer.from_pretrained(directory)  # (transformers 5 reads vocab_file= as no vocabulary)
    assert tokenizer("the cat").input_ids == [2, 5, 5 + WORDS.index("cat"), 3]  # words, not [UNK]s
    return tokenizer


def tiny_bert_config(tokenizer, **extra):
    """A 2-layer BERT of hidden size 32 over the tokenizer's vocabulary (transformers' BertConfig)."""
    from transformers import BertConfig

    sizes = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37)
    return BertConfig(vocab_size=len(tokenizer), max_position_embeddings=64, **sizes, **extra)


def build_bert_st_dir(base):
    """A tiny random BERT saved as a sentence-transformers model (mean pooling, then Normalize), and that model."""
    import torch
    from sentence_transformers import SentenceTransformer, models
    from transformers import BertModel

    tokenizer = tiny_bert_tokenizer(base)
    torch.manual_seed(0)
    config = tiny_bert_config(tokenizer)
    BertModel(config).eval().save_pretrained(base / "hf", safe_serialization=True)
    tokenizer.save_pretrained(base / "hf")
    word = models.Transformer(str(base / "hf"), max_seq_length=48)
    pooling = models.Pooling(config.hidden_size, pooling_mode="mean")
    model = SentenceTransformer(modules=[word, pooling, models.Normalize()], device="cpu")
    model.save(str(base / "st"))
    return base / "st", model


def build_bert_classifiers(base):
    """Tiny random BertForSequenceClassification models with the tiny vocabulary's tokenizer: {num_labels: dir}."""
    import torch
    from transformers import BertForSequenceClassification

    tokenizer = tiny_bert_tokenizer(base)
    directories = {}
    for num_labels in (1, 3):
        torch.manual_seed(num_labels)
        config = tiny_bert_config(tokenizer, num_labels=num_labels)
        directory = base / f"labels-{num_labels}"
        BertForSequenceClassification(config).eval().save_pretrained(directory, safe_serialization=True)
        tokenizer.save_pretrained(directory)
        directories[num_labels] = directory
    return directories
