"""The installed distribution's version: pyproject.toml is the one source of the version number."""

from __future__ import annotations

import functools


@functools.cache
def installed_version() -> str:
    """The version pyproject.toml gave the installed distribution, read on first use (importlib.metadata alone costs
    more than importing jaxpage)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("jaxpage")
    except PackageNotFoundError:  # imported from a source tree that was never installed
        return "0+unknown"
