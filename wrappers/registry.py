"""Every backend configuration, registered by defining its Entry subclass; no framework imported."""
from .base import REGISTRY, Entry  # noqa: F401
from . import torch, jax, tensorflow, keras  # noqa: F401  (each defines and so registers its entries)

__all__ = ["REGISTRY", "Entry"]
