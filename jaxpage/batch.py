"""Moved to jaxpage.entrypoints.batch; this path stays importable (the same module object)."""

import sys

from jaxpage.entrypoints import batch as _moved

sys.modules[__name__] = _moved
