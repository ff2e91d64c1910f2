"""Moved to jaxpage.engine.llm_engine; this path stays importable (the same module object)."""

import sys

from jaxpage.engine import llm_engine as _moved

sys.modules[__name__] = _moved
