"""The draft model of speculative decoding (method "draft_model"): loaded like the target, and refused unless it
speaks the target's tokens.

A draft model proposes token ids that the target verifies, so both must mean the same thing by every id: the same
vocabulary size, the same special tokens (BOS, EOS), and, where both have a tokenizer, the same vocabulary. Its KV
cache is a second page pool with the target's pages and page size, addressed through the same block tables. It
runs only in steps that verify its drafts: first it computes the tokens the target computed since
(DraftModelRunner.catch_up; Sequence.num_draft_computed_tokens counts those it holds), then its proposals
(DraftModelRunner.propose) write into the slots the scheduler reserved for the draft. Steps that do not draft
(prefill, or decoding when the speculation policy says drafting does not pay) cost what they cost without a draft
model.
"""

from __future__ import annotations

from jaxpage.config import ModelConfig
from jaxpage.models.loader import load_model
from jaxpage.sources import DEFAULT_DOWNLOAD, HubDownload


def load_draft_model(
    source: str, dtype: str | None, target: ModelConfig, sharding=None, download: HubDownload = DEFAULT_DOWNLOAD
) -> tuple[ModelConfig, dict]:
    """(config, params) of the draft model at `source` (a path or a Hub id, downloaded as `download` says), placed as
    load_model's `sharding` says; ValueError naming what differs from the target's config (check_draft_tokenizer
    compares the tokenizers)."""
    config, params = load_model(source, dtype=dtype, sharding=sharding, download=download)
    field = f"speculative_config['model'] {source}"
    if config.vocab_size != target.vocab_size:
        raise ValueError(
            f"{field}: its vocabulary has {config.vocab_size} tokens, the target's {target.vocab_size}; a draft model "
            "must use the target's tokenizer"
        )
    for name in ("bos_token_id", "eos_token_ids"):
        if getattr(config, name) != getattr(target, name):
            raise ValueError(
                f"{field}: its special tokens differ from the target's ({name} {getattr(config, name)} against "
                f"{getattr(target, name)}); a draft model must use the target's tokenizer"
            )
    return config, params


def check_draft_tokenizer(source: str, target_tokenizer, download_dir: str | None = None) -> None:
    """ValueError when the draft model at `source` has a tokenizer whose vocabulary is not the target's (a draft
    without a tokenizer passes: its vocabulary size and special tokens were checked)."""
    from jaxpage.errors import ModelLoadError
    from jaxpage.tokenizers.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(source, HubDownload(None, download_dir))
    except ModelLoadError:
        return
    if tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(
            f"speculative_config['model'] {source}: its tokenizer's vocabulary differs from the target's; a draft "
            "model must use the target's tokenizer"
        )
