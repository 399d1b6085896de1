"""Masked statistics: mean, variance and whitening over the entries of ``x`` where ``mask`` is 1.

Every statistic is built from one triple ``(count, mean, M2)`` computed in two passes (never
``E[x²] − E[x]²``) in units of a power-of-two scale, so finite data gives finite results; with
``group=`` the ranks' triples merge exactly by Chan's formula in one ``all_gather``. Mask-0
entries never reach a result, half precision is accumulated in float32, an empty selection
gives 0, nothing reads a value back to the host (docs/reference/stats.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rlops._checks import as_bool_mask, as_float_tensor, check_nonneg, compute_dtype
from rlops._types import Group
from rlops.distributed.collectives import Call, fails_together, gather
from rlops.distributed.groups import group_rank_size

__all__ = [
    "Moments",
    "masked_mean",
    "masked_moments",
    "masked_var",
    "masked_whiten",
    "merge_moments",
    "weighted_moments",
]


class Moments(NamedTuple):
    """``(count, mean, M2)`` of a selection in units of a power-of-two ``scale`` (true mean
    ``mean·scale``, true M2 ``m2·scale²``): every value below 2, nothing overflows, exact.
    """

    count: torch.Tensor  # type: ignore[assignment]  # a field named like tuple.count, on purpose
    mean: torch.Tensor
    m2: torch.Tensor
    scale: torch.Tensor

    def variance(self, unbiased: bool = True) -> torch.Tensor:
        """``M2 / (n − 1)`` (or ``/ n``) in true units; ``inf`` only if it exceeds the dtype."""
        var_u = self.m2 / ((self.count - 1) if unbiased else self.count).clamp_min(1)
        return var_u * self.scale * self.scale

    def standardize(self, x: torch.Tensor, eps: float, shift_mean: bool = True) -> torch.Tensor:
        """``(x − mean) / sqrt(var + eps)`` (unbiased var) in scaled units: no overflow, finite
        also for ``var + eps = 0``.
        """
        var_u = self.m2 / (self.count - 1).clamp_min(1)
        den = var_u + eps / self.scale / self.scale
        inv = torch.rsqrt(den.clamp_min(torch.finfo(den.dtype).tiny))
        out = (x / self.scale - self.mean) * inv
        return out + self.mean * self.scale if not shift_mean else out


def _pow2_above(maxabs: torch.Tensor) -> torch.Tensor:
    """``2^e`` with ``2^e ≤ maxabs < 2^(e+1)`` (1 for 0): an exact divisor."""
    _, exp = torch.frexp(maxabs)
    return torch.where(maxabs > 0, torch.ldexp(torch.ones_like(maxabs), exp - 1), 1.0)


def _shifted_mean(values: torch.Tensor, weight: torch.Tensor, count: torch.Tensor):
    """``(mean, values − mean)`` over ``weight > 0``, shifted by the largest selected value
    (constant data gives exactly its value and 0 deviations).
    """
    selected = weight > 0
    if values.numel() == 0:
        shift = values.new_zeros(())
    else:
        shift = torch.where(selected, values, -torch.inf).amax()
        shift = torch.where(count > 0, shift, 0.0)
    d = torch.where(selected, values - shift, 0.0)
    mean_d = (weight * d).sum() / count.clamp_min(1)
    return shift + mean_d, torch.where(selected, d - mean_d, 0.0)


def weighted_moments(x: torch.Tensor, weight: torch.Tensor) -> Moments:
    """:class:`Moments` of ``x`` (compute dtype, finite where ``weight > 0``) with integer-valued
    weights (a 0/1 mask or per-row counts): scale, mean, then squared deviations.
    """
    count = weight.sum()
    selected = weight > 0
    if x.numel() == 0:
        maxabs = x.new_zeros(())
    else:
        maxabs = torch.where(selected, x.abs(), 0.0).amax()
    scale = _pow2_above(maxabs)
    mean, dev = _shifted_mean(x / scale, weight, count)
    return Moments(count, mean, (weight * dev.square()).sum(), scale)


def _merge_scaled(m: Moments) -> Moments:
    """Merge ``k`` partial :class:`Moments` (each field ``[k]``) by Chan's formula, in units of the
    largest scale.
    """
    scale = m.scale.amax()
    r = m.scale / scale  # powers of two <= 1: exact
    n = m.count.sum()
    mean, dev = _shifted_mean(m.mean * r, m.count, n)
    m2 = (m.m2 * r * r).sum() + (m.count * dev.square()).sum()
    return Moments(n, mean, m2, scale)


def _merge_over(group: Group, m: Moments, call: Call) -> Moments:
    """Merge this rank's :class:`Moments` with every rank's (one checked ``gather`` of four
    numbers per rank); the other ranks' parts are constants for autograd.
    """
    rank, world = group_rank_size(group)
    if world == 1:
        return m
    local = torch.stack(list(m))
    parts = list(gather(local, group, call).to(local.dtype).unbind(0))
    parts[rank] = local
    merged = torch.stack(parts)
    return _merge_scaled(Moments(*merged.unbind(1)))


def _selected(x: torch.Tensor, mask: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate; return ``x`` in the computation dtype with mask-0 entries zeroed, and the mask."""
    as_float_tensor("x", x)
    keep = as_bool_mask("mask", mask, x.shape, "x", x)
    return torch.where(keep, x.to(compute_dtype(x.dtype)), 0), keep


def masked_moments(
    x: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The local triple ``(count, mean, M2)``, ``M2 = Σ m·(x − mean)²``, of the entries of ``x``
    where ``mask`` is 1; stack and all-gather it, then :func:`merge_moments`.

    Args:
        x: floating tensor, any shape.
        mask: 0/1 tensor of ``x``'s shape.

    Returns:
        Three 0-dim tensors in the compute dtype; ``(0, 0, 0)`` for an empty selection.

    Example:
        >>> import torch
        >>> n, mean, m2 = masked_moments(torch.tensor([1.0, 2.0, 3.0, 100.0]),
        ...                              torch.tensor([1, 1, 1, 0]))
        >>> n.item(), mean.item(), m2.item()
        (3.0, 2.0, 2.0)
    """
    xc, keep = _selected(x, mask)
    m = weighted_moments(xc, keep.to(xc.dtype))
    return m.count, m.mean * m.scale, m.m2 * m.scale * m.scale


def merge_moments(
    count: torch.Tensor, mean: torch.Tensor, m2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge ``k`` partial triples (each ``[k]``) by Chan, Golub & LeVeque's parallel formula
    (1979), exact, and never negative:

        n = Σ_j n_j,    mean = Σ_j n_j·mean_j / n,    M2 = Σ_j M2_j + Σ_j n_j·(mean_j − mean)²

    Returns:
        ``(count, mean, M2)``; empty parts contribute nothing.

    Example:
        >>> import torch
        >>> x = torch.tensor([1.0, 2.0, 3.0, 4.0, 10.0], dtype=torch.float64)
        >>> a, b = masked_moments(x[:2], torch.ones(2)), masked_moments(x[2:], torch.ones(3))
        >>> n, mean, m2 = merge_moments(*(torch.stack(p) for p in zip(a, b)))
        >>> n.item(), mean.item(), round(m2.item() / (n.item() - 1), 12) == x.var().item()
        (5.0, 4.0, True)
    """
    n = count.sum()
    mean_total, dev = _shifted_mean(mean, count, n)
    return n, mean_total, m2.sum() + (count * dev.square()).sum()


# --------------------------------------------------------------------------- public statistics
@fails_together()
def masked_mean(
    x: torch.Tensor,
    mask: torch.Tensor,
    dim: int | tuple[int, ...] | None = None,
    *,
    group: Group = None,
) -> torch.Tensor:
    """Mean of the entries of ``x`` where ``mask`` is 1: ``Σ m·x / Σ m`` (0 for none selected).

    Args:
        x: floating tensor, e.g. ``[B, T]``; differentiable.
        mask: 0/1 tensor of ``x``'s shape.
        dim: dimension(s) to reduce; ``None`` reduces everything.
        group: a process group: the mean over every rank's entries (``dim=None`` only).

    Returns:
        ``x``'s dtype; 0-dim for ``dim=None``, else ``x``'s shape without ``dim``.

    Example:
        >>> import torch
        >>> x = torch.tensor([[1.0, 2.0, 9.0], [4.0, 0.0, 0.0]])
        >>> m = torch.tensor([[1, 1, 0], [1, 0, 0]])
        >>> masked_mean(x, m)
        tensor(2.3333)
        >>> masked_mean(x, m, dim=-1)
        tensor([1.5000, 4.0000])
    """
    xc, keep = _selected(x, mask)
    if group_rank_size(group)[1] > 1:
        if dim is not None:
            raise ValueError("masked_mean with group= reduces everything: pass dim=None")
        m = _merge_over(group, weighted_moments(xc, keep.to(xc.dtype)), Call("masked_mean"))
        return (m.mean * m.scale).to(x.dtype)
    # summed in units of a power of two (exact), so a sum of huge finite values cannot overflow
    scale = _pow2_above(xc.detach().abs().amax()) if xc.numel() else xc.new_ones(())
    if dim is None:
        total, count = (xc / scale).sum(), keep.sum()
    else:
        total, count = (xc / scale).sum(dim=dim), keep.sum(dim=dim)
    count = count.to(xc.dtype)
    return (total / count.clamp_min(1) * scale).to(x.dtype)


@fails_together()
def masked_var(
    x: torch.Tensor,
    mask: torch.Tensor,
    *,
    unbiased: bool = True,
    group: Group = None,
) -> torch.Tensor:
    """Variance of the entries of ``x`` where ``mask`` is 1: ``M2 / (n − 1)`` (``unbiased``, as
    verl and TRL) or ``M2 / n``, the denominator clamped to 1 (one or no entry gives 0).

    Args:
        x: floating tensor, e.g. ``[B, T]``.
        mask: 0/1 tensor of ``x``'s shape.
        unbiased: divide by ``n − 1`` instead of ``n``.
        group: a process group: the variance over every rank's entries.

    Returns:
        0-dim tensor in ``x``'s dtype, never negative.

    Example:
        >>> import torch
        >>> masked_var(torch.tensor([1.0, 2.0, 3.0, 50.0]), torch.tensor([1, 1, 1, 0]))
        tensor(1.)
        >>> masked_var(torch.tensor([7.0, 50.0]), torch.tensor([1, 0]))
        tensor(0.)
    """
    xc, keep = _selected(x, mask)
    call = Call("masked_var", unbiased=bool(unbiased))
    m = _merge_over(group, weighted_moments(xc, keep.to(xc.dtype)), call)
    return m.variance(unbiased).to(x.dtype)


@fails_together()
def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    *,
    shift_mean: bool = True,
    eps: float = 1e-8,
    group: Group = None,
) -> torch.Tensor:
    """Standardise the selected entries of ``x``: ``(x − mean) / sqrt(var + eps)`` (verl's
    ``masked_whiten``, unbiased variance; 0 on constant data, also with ``eps = 0``).

    Args:
        x: floating tensor, e.g. advantages ``[B, T]``.
        mask: 0/1 tensor of ``x``'s shape.
        shift_mean: subtract the mean, or add it back (only the scale changes).
        eps: ``>= 0``, added to the variance.
        group: a process group (e.g. DP×CP): the statistics over every rank's entries.

    Returns:
        ``x``'s shape and dtype, 0 on mask-0 entries.

    Example:
        >>> import torch
        >>> masked_whiten(torch.tensor([1.0, 2.0, 3.0, 50.0]), torch.tensor([1, 1, 1, 0]))
        tensor([-1.,  0.,  1.,  0.])
    """
    eps = check_nonneg("eps", eps)
    xc, keep = _selected(x, mask)
    call = Call("masked_whiten", shift_mean=bool(shift_mean), eps=eps)
    m = _merge_over(group, weighted_moments(xc, keep.to(xc.dtype)), call)
    return torch.where(keep, m.standardize(xc, eps, shift_mean), 0).to(x.dtype)
