"""Integer arguments of the adapters (lengths, ``dp_size``): the one check they share.

Generic enough for :mod:`rlops._checks`; kept here while only the adapters need it.
"""

from __future__ import annotations

import operator

import torch

__all__ = ["as_int"]


def as_int(name: str, value: object, minimum: int | None = None) -> int:
    """An integer (Python, numpy, or a 0-dim integer tensor) as an ``int``, ``>= minimum``."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.is_floating_point()):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    try:
        out = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if minimum is not None and out < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {out}")
    return out
