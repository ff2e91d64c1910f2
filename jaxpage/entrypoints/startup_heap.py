"""The objects a process holds once its engine has started (jax's, transformers' and the model's: hundreds of
thousands) moved out of the cyclic garbage collector's sight, as vLLM's engine core does: a full collection would
otherwise walk all of them in the middle of a step (166,000 objects with the default model, 0.2 s a collection on this
2-core machine, against a step of milliseconds). For processes that own their engine for
their whole life (`jaxpage serve`, `jaxpage batch`); an object frozen here that later becomes cyclic garbage is
never collected, which is why LLM and LLMEngine, which a program may build many of, do not do it."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collects what is garbage now, then freezes every object left (gc.freeze)."""
    gc.collect()
    gc.freeze()
