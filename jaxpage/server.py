"""Moved to jaxpage.entrypoints.server; this path stays importable (the same module object)."""

import sys

from jaxpage.entrypoints import server as _moved

sys.modules[__name__] = _moved
