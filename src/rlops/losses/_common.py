"""Numbers and helpers shared by the loss modules (private to the package)."""

from __future__ import annotations

import torch

__all__ = ["MAX_EXP_ARG", "masked_frac"]

MAX_EXP_ARG = 20.0


def masked_frac(flag: torch.Tensor, keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Fraction of mask-1 tokens where ``flag`` holds (0 when there are none); detached."""
    hits = (flag & keep).sum().to(dtype)
    return (hits / keep.sum().to(dtype).clamp_min(1)).detach()
