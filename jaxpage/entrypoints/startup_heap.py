"""The objects a process holds once its engine has started (jax's, transformers' and the model's: hundreds of
thousands) moved out of the cyclic garbage collector's sight, as vLLM's engine core does: a full collection would
otherwise walk all of them in the middle of a step (166,000 objects with the default model, 0.2 s a collection on this
2-core machine, against a step of milliseconds). For processes that own their engine for
their whole life (`jaxpage serve`, `jaxpage batch`); an object frozen here that later becomes cyclic garbage is
never collected, which is why LLM and LLMEngine, which a program may build many of, do not do it.

The collector then runs once 50,000 new container objects outlive their frees, not 700: a step at batch 1,024 makes
and drops about ten thousand (its scheduled rows, updates, outputs), which at 700 cost about ten collections a step
and 2 ms of its host time here (scripts/bench_host.py: a tenth of the step at that batch); objects that live past a
step are few, and cyclic garbage rarer still, so the collections skipped free almost nothing."""

from __future__ import annotations

import gc

GC_THRESHOLDS = (50_000, 20, 100)  # (the defaults: 700, 10, 10)


def freeze_startup_heap() -> None:
    """Collects what is garbage now, then freezes every object left (gc.freeze), and collects the young generation
    less often (GC_THRESHOLDS)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
