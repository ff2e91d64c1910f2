"""PoolingParams: how one input of a pooling model is turned into its output, in vLLM's names and meanings."""

from __future__ import annotations

import dataclasses

from jaxpage.validation import INT32_MAX, check_bool, check_int, is_int


@dataclasses.dataclass
class PoolingParams:
    """dimensions: cut each embedding to its first `dimensions` values before normalizing it (Matryoshka models only:
    the engine refuses it by name for others; None: the whole embedding). normalize: make each embedding unit length
    (None: as the model's sentence-transformers files say; without them, True). truncate_prompt_tokens: keep only
    the input's last this many tokens (-1: as many as the model takes; None: an over-long input is refused with its
    token count). activation: a classifier's probabilities (softmax over its labels; a sigmoid for one label or
    multi-label models) rather than its logits (None: True). dimensions and normalize apply to embedding models and
    activation to classifiers: the engine refuses each by name for the other kind. Checked when built and again when
    the request is added."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    activation: bool | None = None

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        if self.dimensions is not None:
            self.dimensions = check_int("PoolingParams.dimensions", self.dimensions, 1, INT32_MAX)
        if self.normalize is not None:
            self.normalize = check_bool("PoolingParams.normalize", self.normalize)
        if self.activation is not None:
            self.activation = check_bool("PoolingParams.activation", self.activation)
        if self.truncate_prompt_tokens is not None:
            value = self.truncate_prompt_tokens
            if not (is_int(value) and value == -1):
                value = check_int("PoolingParams.truncate_prompt_tokens", value, 1, INT32_MAX)
            self.truncate_prompt_tokens = int(value)
