"""Inputs of the distillation tests: student logits and a teacher's top-k or full log-probs."""

from __future__ import annotations

import torch

KINDS = ("forward_kl", "reverse_kl", "jsd")


def teacher(
    shape: tuple[int, ...], k: int | None, dtype: torch.dtype = torch.float64, seed: int = 0,
    scale: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """``(teacher_logprobs, teacher_ids)``: a random softmax's top-k in a shuffled order, or
    with ``k=None`` the whole ``[..., V]``."""
    g = torch.Generator().manual_seed(seed + 1)
    logp = torch.log_softmax(torch.randn(shape, generator=g, dtype=torch.float64) * scale, -1)
    if k is None:
        return logp.to(dtype), None
    vals, ids = logp.topk(k, -1)
    perm = torch.randperm(k, generator=g)
    return vals[..., perm].to(dtype), ids[..., perm]


def logits(shape: tuple[int, ...], seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64) * scale
