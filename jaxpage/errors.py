"""Errors jaxpage raises at its boundaries (files, API, CLI), with messages meant for users."""


class ModelLoadError(ValueError):
    """A model source cannot be loaded: unsupported architecture, missing or malformed file or tensor.

    The message names the file and, where one is at fault, the tensor.
    """
