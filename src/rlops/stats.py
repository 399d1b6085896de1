"""Masked statistics: mean, variance and whitening over the valid entries of a tensor.

Every statistic is built from one local triple ``(count, mean, M2)`` (``M2`` = sum of squared
deviations from the mean), computed in two passes, never as ``E[x²] − E[x]²`` (which cancels
catastrophically and can go negative on nearly constant data). Triples from several shards merge
exactly with Chan, Golub and LeVeque's parallel formula (:func:`merge_moments`), so a
process-group version needs one all-gather of a few numbers per rank and nothing else.
Internally the triple is held in units of a power-of-two scale (:class:`Moments`): squares
never overflow, so finite data always gives finite statistics (a variance too large for the
dtype is ``inf``; whitening stays finite).

Conventions shared by all functions here:

* ``mask`` has the shape of ``x`` and holds 0/1 (bool, integer or float). Entries with mask 0 never
  reach the result, even when they are NaN or inf.
* Half-precision inputs (bfloat16/float16) are accumulated in float32; results have ``x``'s dtype.
* An empty selection gives mean 0 and variance 0; a single selected element gives variance 0
  (also with ``unbiased=True``, where ``n − 1`` is clamped to 1). Nothing returns NaN or inf for
  finite selected inputs, and nothing reads a value back to the host.
* ``group`` is a ``torch.distributed`` process group (e.g. all DP×CP ranks that share a batch):
  the statistic is then over the selected entries of every rank, from one ``all_gather`` of
  ``(count, mean, M2)`` per rank merged with Chan's formula. Every rank of the group must call;
  ranks holding no selected entry (count 0) join and contribute nothing.
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
    """``(count, mean, M2)`` of a selection, held in units of a power-of-two ``scale``:
    the true mean is ``mean·scale`` and the true M2 is ``m2·scale²``. In those units every
    value is below 2 in magnitude, so nothing overflows however large the (finite) data, and
    scaling by a power of two is exact (constant data still gives ``m2 = 0`` exactly)."""

    count: torch.Tensor  # type: ignore[assignment]  # a field named like tuple.count, on purpose
    mean: torch.Tensor
    m2: torch.Tensor
    scale: torch.Tensor

    def variance(self, unbiased: bool = True) -> torch.Tensor:
        """``M2 / (n − 1)`` (or ``/ n``) in true units; ``inf`` only if it exceeds the dtype."""
        var_u = self.m2 / ((self.count - 1) if unbiased else self.count).clamp_min(1)
        return var_u * self.scale * self.scale

    def standardize(self, x: torch.Tensor, eps: float, shift_mean: bool = True) -> torch.Tensor:
        """``(x − mean) / sqrt(var + eps)`` (unbiased var), computed in scaled units so that
        neither ``x − mean`` nor ``var`` can overflow; finite also for ``var + eps = 0``."""
        var_u = self.m2 / (self.count - 1).clamp_min(1)
        den = var_u + eps / self.scale / self.scale
        inv = torch.rsqrt(den.clamp_min(torch.finfo(den.dtype).tiny))
        out = (x / self.scale - self.mean) * inv
        return out + self.mean * self.scale if not shift_mean else out


def _pow2_above(maxabs: torch.Tensor) -> torch.Tensor:
    """The power of two ``2^e`` with ``2^e ≤ maxabs < 2^(e+1)`` (1 for 0): dividing by it is
    exact, leaves every value in (−2, 2), and the scale itself never overflows."""
    _, exp = torch.frexp(maxabs)
    return torch.where(maxabs > 0, torch.ldexp(torch.ones_like(maxabs), exp - 1), 1.0)


def _shifted_mean(values: torch.Tensor, weight: torch.Tensor, count: torch.Tensor):
    """``(mean, values − mean)`` over ``weight > 0``, from data shifted by the largest selected
    value: constant data gives exactly ``mean = value`` and 0 deviations (an unshifted
    ``Σx / n`` need not round back to ``x``)."""
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
    """:class:`Moments` of ``x`` with integer-valued weights (a 0/1 mask or per-row counts).

    ``x`` must already be in the computation dtype and hold finite values wherever weight > 0.
    Three passes: the largest magnitude (for the power-of-two scale), the mean, then the squared
    deviations from it (never ``E[x²] − E[x]²``).
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
    """Merge ``k`` partial :class:`Moments` (each field ``[k]``) with Chan's formula, in units of
    the largest scale."""
    scale = m.scale.amax()
    r = m.scale / scale  # powers of two <= 1: exact
    n = m.count.sum()
    mean, dev = _shifted_mean(m.mean * r, m.count, n)
    m2 = (m.m2 * r * r).sum() + (m.count * dev.square()).sum()
    return Moments(n, mean, m2, scale)


def _merge_over(group: Group, m: Moments, call: Call) -> Moments:
    """Merge this rank's :class:`Moments` with every other rank's: one collective of four
    float64 numbers per rank (:func:`rlops.distributed.collectives.gather`, which checks that
    every rank makes the same ``call``), then Chan's formula. This rank's own entry stays the
    local one: a backward pass sees this rank's contribution and treats the others as
    constants (group statistics are meant for values without gradient, such as advantages)."""
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
    """The local triple ``(count, mean, M2)`` of the entries of ``x`` where ``mask`` is 1.

    ``M2 = Σ_i m_i (x_i − mean)²`` is computed in a second pass over the data. All three are
    0-dim tensors in the computation dtype (float32 for half inputs); an empty selection gives
    ``(0, 0, 0)``. Stack them (``torch.stack``) to all-gather one ``[3]`` tensor per rank, then
    combine with :func:`merge_moments`.

    Args:
        x: floating tensor, any shape.
        mask: 0/1 tensor of ``x``'s shape.

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
    """Merge ``k`` partial triples (along dim 0, each ``[k]``) into one ``(count, mean, M2)``.

    The exact parallel-variance formula (Chan, Golub & LeVeque, 1979, generalised from two
    parts to ``k``)::

        n = Σ_j n_j        mean = Σ_j n_j·mean_j / n        M2 = Σ_j M2_j + Σ_j n_j (mean_j − mean)²

    Every term is non-negative, so the merged ``M2`` never goes negative. Parts with
    ``n_j = 0`` contribute nothing; all parts empty gives ``(0, 0, 0)``.

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
    """Mean of the entries of ``x`` where ``mask`` is 1, over all of ``x`` or along ``dim``.

    ``mean = Σ m·x / Σ m``; a slice with no selected entry gives 0 (not NaN). Mask-0 entries are
    dropped with ``torch.where`` before summing, so NaN/inf there does not leak into the result
    (or its gradient). Differentiable in ``x``.

    Args:
        x: floating tensor, e.g. ``[B, T]``.
        mask: 0/1 tensor of ``x``'s shape.
        dim: dimension(s) to reduce; ``None`` reduces everything to a 0-dim tensor.
        group: a process group: the mean over every rank's selected entries (``dim=None``
            only); one ``all_gather``.

    Returns:
        ``x``'s dtype; 0-dim for ``dim=None``, else ``x``'s shape without ``dim``
        (``[B]`` for ``dim=-1`` on ``[B, T]``).

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
    """Variance of the entries of ``x`` where ``mask`` is 1 (two-pass, numerically stable).

    ``var = M2 / (n − 1)`` (``unbiased=True``, Bessel's correction, as verl and TRL) or
    ``M2 / n``, with ``M2 = Σ m (x − mean)²``. The denominator is clamped to at least 1, so a
    single selected element or an empty selection gives 0 instead of NaN (verl raises there).
    The result is never negative.

    Args:
        x: floating tensor, e.g. ``[B, T]``.
        mask: 0/1 tensor of ``x``'s shape.
        unbiased: divide by ``n − 1`` instead of ``n``.
        group: a process group: the variance over every rank's selected entries (one
            ``all_gather``).

    Returns:
        0-dim tensor in ``x``'s dtype.

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
    """Standardise the selected entries of ``x``: ``(x − mean) / sqrt(var + eps)``.

    ``mean`` and the unbiased ``var`` are those of :func:`masked_mean` / :func:`masked_var`
    over all selected entries (verl's ``masked_whiten``: ``(x − mean)·rsqrt(var + eps)``).
    With ``shift_mean=False`` the mean is added back (only the scale changes). Entries with
    mask 0 are returned as 0. On constant data ``var = 0`` and the result is 0 (also with
    ``eps = 0``: the inverse scale is then computed from the smallest normal number, and it
    multiplies zeros); one selected element also gives 0.

    Args:
        x: floating tensor, e.g. advantages ``[B, T]``.
        mask: 0/1 tensor of ``x``'s shape.
        shift_mean: subtract the mean (``True``) or keep it.
        eps: added to the variance before the square root; ``>= 0``.
        group: a process group (e.g. DP×CP): mean and variance over every rank's selected
            entries, from one ``all_gather`` of ``(count, mean, M2)``; each rank whitens its own
            entries with them.

    Returns:
        Tensor of ``x``'s shape and dtype.

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
