"""StructuredOutputsParams -> llguidance grammars and matchers, for one tokenizer.

llguidance (https://github.com/guidance-ai/llguidance) is the backend: a pure Rust library with abi3 wheels and no
torch, which llama.cpp and sglang-jax use too. A grammar is compiled once per distinct spec (cached by its text) into
a pristine matcher; every sequence that uses it gets a copy (`LLMatcher.deep_copy`, microseconds), advanced by the
scheduler as its tokens commit. Compiling happens where a request is prepared (LLMEngine.prepare_request, the
caller's thread), never in the engine loop: a slow schema does not stall anyone's step.

The llguidance tokenizer (the model's vocabulary as byte strings, about 0.6 s to build for 49k tokens) is built on
the first structured request.
"""

from __future__ import annotations

import collections
import json
import threading

from jaxpage.sampling_params import StructuredOutputsParams

# JSON as compact as llama.cpp writes it: no free whitespace (a small model given free whitespace may emit newlines
# forever), ", " and ": " between items and keys and values.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256  # distinct specs kept compiled


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) of a spec; not yet checked."""
    import llguidance

    kind = spec.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else spec.json
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        alternatives = " | ".join(json.dumps(c) for c in spec.choice)  # Lark string literals, JSON-escaped
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    from llguidance.gbnf_to_lark import any_to_lark  # GBNF (llama.cpp's, with ::=) becomes Lark; Lark stays

    return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec.grammar))


class GrammarCompiler:
    """Matchers for StructuredOutputsParams over one model's vocabulary. Thread-safe: requests may be prepared on
    several threads."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        """tokenizer: the engine's (a transformers fast tokenizer); vocab_size: the model's (masks cover every row
        of its LM head); eos_token_ids: the tokens that end a sequence, which a matcher allows where its grammar
        accepts."""
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer = None
        self._cache: collections.OrderedDict[tuple[str, str], object] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # distinct specs compiled (cache misses)

    @property
    def tokenizer(self):
        """The llguidance tokenizer (built on first use)."""
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(
                        self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids
                    )
                except ValueError as e:  # llguidance takes fast (Rust) tokenizers only
                    raise ValueError(f"structured outputs need a fast tokenizer: {e}") from None
            return self._tokenizer

    def matcher(self, spec: StructuredOutputsParams):
        """A fresh llguidance.LLMatcher for `spec` (compiled once per distinct spec). ValueError naming the field
        when it does not compile."""
        import llguidance

        key = spec.key()
        tokenizer = self.tokenizer
        with self._lock:
            pristine = self._cache.get(key)
            if pristine is not None:
                self._cache.move_to_end(key)
                return pristine.deep_copy()
        field = f"SamplingParams.structured_outputs.{spec.kind}"
        try:
            grammar = grammar_text(spec)
        except Exception as e:  # llguidance's front ends raise ValueError, GBNF's converter plain Exception
            raise ValueError(f"{field} does not compile: {e}") from None
        pristine = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if pristine.is_error():
            raise ValueError(f"{field} does not compile: {pristine.get_error().strip()}")
        with self._lock:
            self._cache[key] = pristine
            self.num_compiled += 1
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return pristine.deep_copy()
