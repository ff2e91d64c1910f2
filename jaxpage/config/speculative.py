"""The `speculative_config` engine argument, in vLLM's names.

    {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": M, "prompt_lookup_min": m}
    {"method": "draft_model", "model": SRC, "num_speculative_tokens": k}

`ngram` drafts by prompt lookup (jaxpage.spec_decode.ngram). As in vLLM, a missing prompt_lookup_min or
prompt_lookup_max takes the other's value, and both default to 5. `draft_model` drafts with a smaller model,
loaded from SRC (anything `load_model` takes: an HF directory, a .gguf file, a jaxpage checkpoint), which must
share the target's vocabulary. A "model" without a "method" means draft_model, as in vLLM.

Every key is checked when the config is built; an unknown key is refused by name, never ignored.
Plain data, here below the engine arguments that hold it (jaxpage.spec_decode reads it); no jax: the host
bookkeeping imports this.
"""

from __future__ import annotations

import dataclasses

from jaxpage.validation import check_int, check_path, fail, json_object

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16  # a step verifies k + 1 query rows per sequence: beyond this the verification costs more
MAX_PROMPT_LOOKUP = 64
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's default for both n-gram sizes


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None  # ngram only
    prompt_lookup_max: int | None = None  # ngram only
    model: str | None = None  # draft_model only

    @classmethod
    def from_value(cls, value) -> SpeculativeConfig | None:
        """The config from what a caller gave: None, a SpeculativeConfig, a dict, or a JSON object as a string
        (the CLI's --speculative-config). ValueError naming the key for anything else."""
        field = "engine argument speculative_config"
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict | str):
            fail(field, 'a dict such as {"method": "ngram", "num_speculative_tokens": 3}', value, wrong_type=True)
        value = json_object(field, value)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in value if k not in known)
        if unknown:
            raise ValueError(f"{field} has unknown keys {unknown} (jaxpage reads {sorted(known)})")
        args = dict(value)
        if "method" not in args and args.get("model") is not None:
            args["method"] = "draft_model"
        for key in ("method", "num_speculative_tokens"):
            if key not in args:
                raise ValueError(f"{field} needs {key!r}")
        return cls(**args)

    def __post_init__(self):
        def key(name: str) -> str:
            return f"speculative_config[{name!r}]"

        def put(name: str, value) -> None:
            object.__setattr__(self, name, value)  # frozen: the checked, canonical value

        if not isinstance(self.method, str) or self.method not in METHODS:
            fail(key("method"), " or ".join(repr(m) for m in METHODS), self.method, not isinstance(self.method, str))
        put(
            "num_speculative_tokens",
            check_int(key("num_speculative_tokens"), self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS),
        )
        if self.method == "ngram":
            if self.model is not None:
                fail(key("model"), "left out with method 'ngram' (n-gram lookup uses no model)", self.model)
            low, high = self.prompt_lookup_min, self.prompt_lookup_max
            if low is not None:
                low = check_int(key("prompt_lookup_min"), low, 1, MAX_PROMPT_LOOKUP)
            if high is not None:
                high = check_int(key("prompt_lookup_max"), high, 1, MAX_PROMPT_LOOKUP)
            if low is None:  # as in vLLM: the other size, else the default
                low = DEFAULT_PROMPT_LOOKUP if high is None else high
            if high is None:
                high = low
            if low > high:
                fail(key("prompt_lookup_min"), f"<= prompt_lookup_max ({high})", low)
            put("prompt_lookup_min", low)
            put("prompt_lookup_max", high)
        else:
            if self.model is None:
                fail(key("model"), "the draft model (an HF directory, a .gguf file or a jaxpage checkpoint)", None)
            put("model", check_path(key("model"), self.model))
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    fail(key(name), "left out with method 'draft_model' (it is an n-gram setting)", getattr(self, name))
