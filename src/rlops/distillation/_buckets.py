"""The divergences over buckets: each bucket's term ``f(a, b)`` of the teacher's log-prob ``a``
and the student's ``b``, and ``∂f/∂b`` (the backward's weights); the teacher's tail."""

from __future__ import annotations

import math

import torch

KINDS = ("forward_kl", "reverse_kl", "jsd")


def terms(
    kind: str, a: torch.Tensor, b: torch.Tensor, beta: float, clamp: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(f, ∂f/∂b)`` elementwise; ``0·log 0 = 0``. With ``clamp``, both log-probs are clamped
    from below first and ``∂f/∂b`` is 0 where ``b`` is below the clamp (``clamp_min``)."""
    below = None
    if clamp is not None:
        below = b < clamp
        a, b = a.clamp_min(clamp), b.clamp_min(clamp)
    zero = a.new_zeros(())
    if kind == "forward_kl":
        p = a.exp()
        f = torch.where(p > 0, p * (a - b), zero)
        g = -p
    elif kind == "reverse_kl":
        q = b.exp()
        f = torch.where(q > 0, q * (b - a), zero)
        g = torch.where(q > 0, f + q, zero)
    else:  # jsd: ∂/∂b of the mixture's terms cancels, leaving (1 − β)·q·(b − log m)
        lb = math.log(beta) if beta > 0 else -math.inf
        lc = math.log1p(-beta) if beta < 1 else -math.inf
        lm = torch.logaddexp(a + lb, b + lc)
        p, q = a.exp(), b.exp()
        ft = torch.where(p > 0, p * (a - lm), zero)
        fs = torch.where(q > 0, q * (b - lm), zero)
        f = beta * ft + (1 - beta) * fs
        g = (1 - beta) * fs
    if below is not None:
        g = g.masked_fill(below, 0.0)
    return f, g


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 − eˣ)`` for ``x ≤ 0`` (``-inf`` at and above 0), accurate on both sides of
    ``−ln 2`` (Mächler, 2012)."""
    x = x.clamp_max(0.0)
    near = x > -math.log(2.0)
    return torch.where(
        near, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(torch.where(near, -1.0, x)))
    )
