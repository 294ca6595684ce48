"""The model layer: configs, decoder layers, the forward context and the loader, and
the model-family seam (``family.py``) with the built-in families registered."""

from graphcp.model import families  # noqa: F401  (registers the built-in families)
