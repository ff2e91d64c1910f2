"""Moved to jaxpage.entrypoints.distributed; this path stays importable (the same module object)."""

import sys

from jaxpage.entrypoints import distributed as _moved

sys.modules[__name__] = _moved
