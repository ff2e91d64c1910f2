"""Pooling models (issue 57): embeddings of tiny random encoders and decoder embedders through LLM.embed against
sentence-transformers and transformers, the packed steps' layout, the pooler configs read from sentence-transformers
files, and refusals."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pooling_models import TEXTS, WORDS
from tiny_models import TINY_FAMILIES

from jaxpage import LLM, PoolingParams
from jaxpage.config.pooler import read_pooler_config
from jaxpage.errors import ModelLoadError
from jaxpage.models.attention import PackedAttention, PackedBatch
from jaxpage.worker.packed_steps import WaitingInputs, input_slots, pack

QWEN3 = next(f for f in TINY_FAMILIES if f.name == "qwen3-qk-norm-head-dim")


@pytest.fixture(scope="module")
def bert_llm(bert_st_dir):
    return LLM(str(bert_st_dir[0]), max_num_seqs=4, max_num_batched_tokens=32)


def test_encoder_embeddings_equal_sentence_transformers(bert_st_dir, bert_llm):
    directory, model = bert_st_dir
    expected = model.encode(TEXTS, convert_to_numpy=True, batch_size=2)
    outputs = bert_llm.embed(TEXTS)
    assert [o.request_id for o in outputs] == sorted({o.request_id for o in outputs}, key=int)
    got = np.array([o.outputs.embedding for o in outputs])
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
    tokenizer = bert_llm.get_tokenizer()
    assert [o.prompt_token_ids for o in outputs] == [tokenizer(t).input_ids for t in TEXTS]
    # several steps ran (a budget of 32 tokens), each packed without padding between inputs
    assert len(bert_llm.engine.runner.compile_seconds) >= 1


def test_token_ids_and_params_per_prompt(bert_st_dir, bert_llm):
    from sentence_transformers import SentenceTransformer

    directory, model = bert_st_dir
    tokenizer = bert_llm.get_tokenizer()
    ids = tokenizer(TEXTS[2]).input_ids
    plain, raw = bert_llm.embed([{"prompt_token_ids": ids}, TEXTS[2]], [None, PoolingParams(normalize=False)])
    expected = model.encode([TEXTS[2]], convert_to_numpy=True, normalize_embeddings=False)[0]
    np.testing.assert_allclose(plain.outputs.embedding, expected / np.linalg.norm(expected), atol=1e-5)
    # without Normalize: the mean pooling itself (the Normalize module is the pipeline's last)
    unnormalized = SentenceTransformer(modules=[model[0], model[1]], device="cpu").encode([TEXTS[2]])[0]
    np.testing.assert_allclose(raw.outputs.embedding, unnormalized, atol=1e-5)


def test_over_long_inputs_are_refused_unless_truncation_is_asked(bert_llm):
    tokenizer = bert_llm.get_tokenizer()
    long_ids = (tokenizer(" ".join(WORDS * 4)).input_ids)[:60]
    with pytest.raises(ValueError, match="60 tokens, more than the model's max_model_len of 48"):
        bert_llm.embed({"prompt_token_ids": long_ids})
    (kept,) = bert_llm.embed({"prompt_token_ids": long_ids}, truncate_prompt_tokens=10)
    assert kept.prompt_token_ids == long_ids[-10:]
    (whole,) = bert_llm.embed({"prompt_token_ids": long_ids}, PoolingParams(truncate_prompt_tokens=-1))
    assert whole.prompt_token_ids == long_ids[-48:]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda llm: llm.embed([]), "no prompts given"),
        (lambda llm: llm.embed(""), "prompt is empty"),
        (lambda llm: llm.embed({"prompt_token_ids": [10**6]}), "not a token id in"),
        (lambda llm: llm.embed("a", PoolingParams(dimensions=8)), "cannot be shortened"),
        (lambda llm: llm.embed("a", "normalize"), "pooling_params must be"),
        (lambda llm: llm.generate("a"), "generate needs a model run by the generate runner"),
        (lambda llm: llm.chat([{"role": "user", "content": "a"}]), "chat needs a model run by the generate runner"),
    ],
)
def test_bad_calls_are_refused_by_name_and_queue_nothing(bert_llm, call, message):
    with pytest.raises(ValueError, match=message):
        call(bert_llm)
    assert not bert_llm.engine.has_unfinished_requests()


def test_pooling_params_are_checked_when_built():
    with pytest.raises(ValueError, match="PoolingParams.dimensions must be an integer"):
        PoolingParams(dimensions=0)
    with pytest.raises(TypeError, match="PoolingParams.normalize"):
        PoolingParams(normalize="yes")
    with pytest.raises(ValueError, match="PoolingParams.truncate_prompt_tokens"):
        PoolingParams(truncate_prompt_tokens=-2)


@pytest.fixture(scope="module")
def qwen3_embedder(tiny_model_path, tmp_path_factory):
    """The tiny Qwen3 model as a decoder embedder (last-token pooling, normalized), as sentence-transformers files
    describe Qwen3-Embedding, with Matryoshka dimensions in its config.json."""
    directory = tmp_path_factory.mktemp("qwen3-embedding")
    shutil.copytree(tiny_model_path(QWEN3), directory, dirs_exist_ok=True)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"matryoshka_dimensions": [16, 32]}))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": 64, "pooling_mode_lasttoken": True, "include_prompt": True}
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return directory


def assert_last_token_embeddings(directory, prompts: list[list[int]]) -> LLM:
    """LLM.embed of the decoder embedder in `directory` equals transformers' AutoModel's last hidden state at each
    prompt's last token, normalized; the LLM, for more checks."""
    import torch
    from transformers import AutoModel

    llm = LLM(str(directory), runner="pooling", skip_tokenizer_init=True, max_num_batched_tokens=32)
    outputs = llm.embed([{"prompt_token_ids": p} for p in prompts])
    reference = AutoModel.from_pretrained(directory, torch_dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            hidden = reference(torch.tensor([prompt])).last_hidden_state[0, -1].numpy()
        np.testing.assert_allclose(output.outputs.embedding, hidden / np.linalg.norm(hidden), atol=1e-5)
    return llm


def test_decoder_embeddings_equal_transformers_last_token(qwen3_embedder):
    import torch
    from transformers import AutoModel

    prompts = [[5, 9, 2, 40], [7], list(range(1, 30)), [3, 3, 3]]
    llm = assert_last_token_embeddings(qwen3_embedder, prompts)
    reference = AutoModel.from_pretrained(qwen3_embedder, torch_dtype=torch.float32).eval()
    (short,) = llm.embed({"prompt_token_ids": prompts[0]}, PoolingParams(dimensions=16))
    with torch.no_grad():
        hidden = reference(torch.tensor([prompts[0]])).last_hidden_state[0, -1, :16].numpy()
    np.testing.assert_allclose(short.outputs.embedding, hidden / np.linalg.norm(hidden), atol=1e-5)
    with pytest.raises(ValueError, match=r"dimensions must be one of \[16, 32\]"):
        llm.embed({"prompt_token_ids": prompts[0]}, PoolingParams(dimensions=20))


def test_a_decoder_embedder_without_its_lm_head_embeds_as_transformers(qwen3_embedder, tmp_path):
    """Qwen3-Embedding-4B and -8B are Qwen3Model checkpoints: untied embeddings declared, no lm_head tensor, names
    without `model.`. An embedder never reads its LM head: such a directory loads, and embeds as transformers does."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(qwen3_embedder, tmp_path, dirs_exist_ok=True)
    assert not json.loads((tmp_path / "config.json").read_text()).get("tie_word_embeddings")
    tensors = load_file(tmp_path / "model.safetensors")
    assert "lm_head.weight" in tensors
    headless = {name.removeprefix("model."): t for name, t in tensors.items() if name != "lm_head.weight"}
    save_file(headless, tmp_path / "model.safetensors")
    assert_last_token_embeddings(tmp_path, [[5, 9, 2, 40], list(range(1, 30))])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 64), min_size=1, max_size=40), st.integers(1, 16), st.sets(st.integers(0, 39)))
def test_packed_steps_hold_each_input_whole_in_one_row_and_take_the_oldest_first(lengths, max_num_seqs, removed):
    waiting = [list(range(100 * i, 100 * i + n)) for i, n in enumerate(lengths)]
    queue = WaitingInputs()
    for tokens in waiting:
        queue.add(tokens, len(tokens))
    queue.remove(lambda tokens: tokens[0] // 100 in removed)
    waiting = [w for w in waiting if w[0] // 100 not in removed]
    assert len(queue) == len(waiting) and sorted(queue) == sorted(waiting)
    while waiting:
        inputs, plan = queue.take(64, max_num_seqs)
        assert inputs[0] is waiting[0]  # the oldest input always goes
        assert plan.row_length == max(16, 1 << (max(map(len, waiting)) - 1).bit_length())  # the longest's row length
        assert len(inputs) == len(plan.rows) <= input_slots(64, plan.row_length, max_num_seqs)
        step = pack(inputs, plan, max_num_seqs)
        assert len(step.token_ids) == plan.num_tokens <= 64 and plan.num_tokens % plan.row_length == 0
        for row in range(plan.num_rows):  # a row's inputs fit it
            assert sum(len(t) for t, r in zip(inputs, plan.rows, strict=True) if r == row) <= plan.row_length
        for i, tokens in enumerate(inputs):
            start, length = step.starts[i], step.lengths[i]
            assert start // plan.row_length == (start + length - 1) // plan.row_length == plan.rows[i]
            assert step.token_ids[start : start + length].tolist() == tokens
            assert step.positions[start : start + length].tolist() == list(range(len(tokens)))
            assert (step.segment_ids[start : start + length] == i).all()
        assert (step.segment_ids >= 0).sum() == sum(map(len, inputs)) and (step.lengths[len(inputs) :] == 0).all()
        rest = [w for w in waiting if not any(w is taken for taken in inputs)]
        assert len(rest) == len(waiting) - len(inputs) == len(queue)
        used = sorted(set(plan.rows))
        assert used == list(range(len(used))) and plan.num_rows == max(1, 1 << (len(used) - 1).bit_length())
        room = [plan.row_length - sum(len(t) for t, r in zip(inputs, plan.rows, strict=True) if r == u) for u in used]
        if len(inputs) < input_slots(64, plan.row_length, max_num_seqs):  # left out only where no row had room
            most_room = plan.row_length if len(used) < 64 // plan.row_length else max(room)
            assert all(len(left) > most_room for left in rest)
        waiting = rest


def test_attention_within_rows_is_attention_over_the_whole_step():
    """PackedAttention of a batch in rows (each sequence whole in one row), all rows in one pass or a row a pass,
    equals the same over one row of every token, both ways and causally (over a row of 64, in blocks of queries), in
    float32; padding queries get zeros."""
    rng = np.random.default_rng(0)
    lengths, row_length = [5, 11, 16, 3, 7, 2], 16  # rows: [5, 11], [16], [3, 7, 2, pad x4]
    segments = np.full(48, -1, np.int32)
    positions = np.zeros(48, np.int32)
    for i, (start, n) in enumerate(zip([0, 5, 16, 32, 35, 42], lengths, strict=True)):
        segments[start : start + n], positions[start : start + n] = i, np.arange(n)
    q = rng.standard_normal((48, 4, 8), np.float32)
    k, v = rng.standard_normal((2, 48, 2, 8), np.float32)
    for causal in (False, True):
        attention = PackedAttention(0.3, causal=causal)
        whole = attention.attend(q, k, v, PackedBatch(positions, segments), None, 0)
        real = segments >= 0
        for scores_per_pass in (None, 4 * row_length**2):
            attention = dataclasses.replace(attention, scores_per_pass=scores_per_pass)
            rows = np.asarray(attention.attend(q, k, v, PackedBatch(positions, segments, row_length), None, 0))
            np.testing.assert_allclose(rows[real], np.asarray(whole)[real], atol=1e-6)
            assert not rows[~real].any()
        # One row of 64 (8 padding tokens, the 48, 8 more): causally, its queries in blocks of 16 (CAUSAL_BLOCKS),
        # which the sequences cross.
        padded = [np.pad(x, [(8, 8)] + [(0, 0)] * (x.ndim - 1), constant_values=fill) for x, fill in
                  ((q, 0), (k, 0), (v, 0), (segments, -1), (positions, 0))]  # fmt: skip
        one_row = attention.attend(*padded[:3], PackedBatch(padded[4], padded[3], 64), None, 0)
        np.testing.assert_allclose(np.asarray(one_row)[8:56][real], np.asarray(whole)[real], atol=1e-6)


def write_st_files(directory, modules: list[str], pooling: dict) -> None:
    kinds = {"T": "sentence_transformers.models.Transformer", "P": "sentence_transformers.models.Pooling"}
    kinds |= {"N": "sentence_transformers.models.Normalize", "D": "sentence_transformers.models.Dense"}
    entries = [{"idx": i, "path": "1_Pooling" if m == "P" else "", "type": kinds[m]} for i, m in enumerate(modules)]
    (directory / "modules.json").write_text(json.dumps(entries))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling))


@pytest.mark.parametrize(
    "modules, pooling, message",
    [
        (
            ["T", "P", "D"],
            {"pooling_mode_cls_token": True},
            "module type .sentence_transformers.models.Dense. is not supported",
        ),
        (["T", "P"], {"pooling_mode_weightedmean_tokens": True}, "pooling mode 'weightedmean' is not supported"),
        (["T", "P"], {"pooling_mode": "mean_sqrt_len_tokens"}, "pooling mode 'mean_sqrt_len_tokens' is not supported"),
        (["T", "P"], {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}, "exactly one pooling mode"),
        (["T", "P"], {"pooling_mode": ["cls", "max"]}, "exactly one pooling mode"),
        (["T", "P"], {"pooling_mode_lasttoken": True, "include_prompt": False}, "include_prompt false"),
        (["T"], {}, "no Pooling module"),
    ],
)
def test_sentence_transformers_files_jaxpage_cannot_follow_are_refused_by_name(tmp_path, modules, pooling, message):
    write_st_files(tmp_path, modules, pooling)
    with pytest.raises(ModelLoadError, match=message):
        read_pooler_config(tmp_path, True, {})


def test_pooler_config_defaults_and_sentence_transformers_prompts(tmp_path):
    assert read_pooler_config(tmp_path, True, {}).pooling_type == "CLS"
    assert read_pooler_config(tmp_path, False, {}).pooling_type == "LAST"
    write_st_files(tmp_path, ["T", "P", "N"], {"pooling_mode_mean_tokens": True})  # (sentence-transformers < 6)
    prompts = {"prompts": {"query": "query: ", "passage": "passage: "}, "default_prompt_name": "query"}
    (tmp_path / "config_sentence_transformers.json").write_text(json.dumps(prompts))
    config = read_pooler_config(tmp_path, True, {})
    assert (config.pooling_type, config.normalize, config.default_prompt_name) == ("MEAN", True, "query")
    assert dict(config.prompts)["query"] == "query: "
    write_st_files(tmp_path, ["T", "P"], {"pooling_mode": "lasttoken"})  # sentence-transformers 6
    assert read_pooler_config(tmp_path, True, {}).pooling_type == "LAST"


def test_cross_encoder_scores_equal_sentence_transformers(bert_classifiers):
    from sentence_transformers import CrossEncoder

    directory = bert_classifiers[1]
    llm = LLM(str(directory), max_num_seqs=4, max_num_batched_tokens=32)
    assert llm.runner == "pooling" and llm.engine.task == "classify"
    query, documents = TEXTS[0], TEXTS[1:]
    expected = CrossEncoder(str(directory), device="cpu").predict([(query, d) for d in documents])
    scores = [o.outputs.score for o in llm.score(query, documents)]
    np.testing.assert_allclose(scores, expected, atol=1e-5, rtol=0)
    assert np.argsort(scores).tolist() == np.argsort(expected).tolist()
    pairwise = [o.outputs.score for o in llm.score(documents, [query] * len(documents))]  # data_1[i] with data_2[i]
    expected = CrossEncoder(str(directory), device="cpu").predict([(d, query) for d in documents])
    np.testing.assert_allclose(pairwise, expected, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="data_1 has 2 texts and data_2 3"):
        llm.score(TEXTS[:2], TEXTS[:3])
    with pytest.raises(ValueError, match="embed needs a model that embeds; this model classifies"):
        llm.embed("a")
    with pytest.raises(ValueError, match="PoolingParams.normalize does not apply to this model, which classifies"):
        llm.classify("a", PoolingParams(normalize=True))


def test_classifier_probabilities_equal_transformers(bert_classifiers):
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    directory = bert_classifiers[3]
    llm = LLM(str(directory), max_num_seqs=4, max_num_batched_tokens=32)
    reference = BertForSequenceClassification.from_pretrained(directory).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    outputs = llm.classify(TEXTS)
    logits_outputs = llm.classify(TEXTS, PoolingParams(activation=False))
    for text, output, raw in zip(TEXTS, outputs, logits_outputs, strict=True):
        with torch.no_grad():
            logits = reference(**tokenizer(text, return_tensors="pt")).logits[0]
        np.testing.assert_allclose(raw.outputs.probs, logits.numpy(), atol=1e-5)
        np.testing.assert_allclose(output.outputs.probs, torch.softmax(logits, -1).numpy(), atol=1e-5)
    with pytest.raises(ValueError, match="scores need a cross-encoder .* this model classifies into 3 labels"):
        llm.score("a", "b")


def test_embedding_model_scores_are_cosine_similarities(bert_st_dir, bert_llm):
    from sentence_transformers import util

    directory, model = bert_st_dir
    scores = [o.outputs.score for o in bert_llm.score(TEXTS[0], TEXTS[1:])]
    embeddings = model.encode(TEXTS, convert_to_tensor=True)
    expected = util.cos_sim(embeddings[:1], embeddings[1:])[0].numpy()
    np.testing.assert_allclose(scores, expected, atol=1e-5)
    with pytest.raises(ValueError, match="classify needs a model that classifies; this model embeds"):
        bert_llm.classify("a")
    with pytest.raises(ValueError, match="PoolingParams.activation does not apply to this model, which embeds"):
        bert_llm.embed("a", PoolingParams(activation=True))


def test_the_default_prompt_goes_before_text_inputs_as_sentence_transformers_puts_it(bert_st_dir, tmp_path):
    from sentence_transformers import SentenceTransformer

    shutil.copytree(bert_st_dir[0], tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config_sentence_transformers.json").read_text())
    config |= {"prompts": {"query": "the sky is ", "document": ""}, "default_prompt_name": "query"}
    (tmp_path / "config_sentence_transformers.json").write_text(json.dumps(config))
    expected = SentenceTransformer(str(tmp_path), device="cpu").encode(TEXTS[:2])
    llm = LLM(str(tmp_path), max_num_batched_tokens=32)
    outputs = llm.embed(TEXTS[:2])
    np.testing.assert_allclose([o.outputs.embedding for o in outputs], expected, atol=1e-5, rtol=0)
    assert outputs[0].prompt_token_ids == llm.get_tokenizer()("the sky is " + TEXTS[0]).input_ids


def test_a_decoders_classification_head_is_refused_by_name(tiny_model_path, tmp_path):
    shutil.copytree(tiny_model_path(QWEN3), tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"architectures": ["Qwen3ForSequenceClassification"]}))
    with pytest.raises(ModelLoadError, match="'Qwen3ForSequenceClassification' .* is not supported"):
        LLM(str(tmp_path))
