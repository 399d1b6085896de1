"""What a decay is, stated once for every path: its canonical forms and the exact cut.

A canonical decay is a float, ``[N, 1]`` (one per row) or ``[N, T]`` (one per token). Where a
decay (or a product of decays) is exactly 0 nothing beyond it may reach the result, not even
NaN or inf: the carry is *selected* away before the multiply, never multiplied by 0
(``0 * NaN`` is NaN), and its gradient there is exactly 0.
"""

from __future__ import annotations

from typing import TypeGuard

import torch

__all__ = ["decayed", "is_per_token"]


def is_per_token(decay: float | torch.Tensor, t_len: int) -> TypeGuard[torch.Tensor]:
    """Whether a canonical ``decay`` (a float, ``[N, 1]`` or ``[N, T]``) varies along time."""
    return isinstance(decay, torch.Tensor) and decay.shape[-1] == t_len and t_len > 1


def decayed(a: float | torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``a * y`` with an exact cut where ``a == 0``: ``y`` is selected away there. A float
    ``a`` enters the multiply as a Python number (no tensor is made of it: on an accelerator
    that would be a host-to-device copy)."""
    if not isinstance(a, torch.Tensor):
        return a * y if a != 0 else torch.zeros_like(y)
    return a * torch.where(a == 0, 0.0, y)
