"""Aggregation of a per-token loss matrix into a scalar, layout-invariant with a global
normaliser."""

from __future__ import annotations

import math

import torch

from rlops._checks import (
    as_bool_mask,
    check_2d,
    compute_dtype,
    read_value,
    values_checked,
)
from rlops.distributed.collectives import Call, check_enabled, gather
from rlops.losses._checks import AGG_MODES, check_agg, check_normalisers

__all__ = ["AGG_MODES", "aggregate", "aggregate_loss", "batch_sums", "describe", "loss_and_metrics"]


# --------------------------------------------------------------------------- normalisers
def describe(op: str, agg: str | None, loss_scale_factor: float | None, t: int,
             implied: dict | None = None, **fields: object) -> Call:
    """What a call on a group must agree on: the function, its aggregation mode, the
    normaliser ``L`` of ``seq-mean-token-sum-norm`` (``loss_scale_factor``, else ``T``: the same
    on every micro-batch) and the function's own ``fields``."""
    norm = None
    if agg == "seq-mean-token-sum-norm":
        norm = loss_scale_factor if loss_scale_factor is not None else float(t)
    return Call(op, implied=implied, agg=agg, **{"loss_scale_factor (or T)": norm}, **fields)


def batch_sums(
    keep: torch.Tensor, sums: dict[str, torch.Tensor], group: object, call: Call
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``(tokens, rows, sums)``: this call's action tokens, rows with an action token and the
    given (detached) sums, as float64 (counts exact to 2^53) — summed over ``group`` (in rank
    order) from one collective that also checks that every rank makes the same ``call``."""
    vec = torch.stack([
        keep.sum().to(torch.float64),
        (keep.sum(-1) > 0).sum().to(torch.float64),
        *(v.detach().to(torch.float64) for v in sums.values()),
    ])
    if group is not None:
        vec = gather(vec, group, call).sum(0)
    return vec[0], vec[1], dict(zip(sums, vec[2:], strict=True))


def _needs_count(mode: str | None) -> bool:
    return mode is not None and mode != "token-sum"


def _denominator(
    keep: torch.Tensor,
    mode: str | None,
    dtype: torch.dtype,
    num_tokens: float | torch.Tensor | None,
    num_seqs: float | torch.Tensor | None,
    counts: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """The denominator of ``mode``: from ``counts`` (the group's ``(tokens, rows)``), else
    ``num_tokens`` / ``num_seqs``, else None (this call's own count).

    A given count of 0 is 1 when this call has no action token (its loss is 0 and so is its
    gradient: a rank with nothing to do in data parallelism) and a ``ValueError`` when it has
    one, where the values are read (see ``read_value``); where they are not, the count is used
    as it is, so that a 0 with action tokens (or a negative count: NaN) gives a non-finite
    loss rather than a silently rescaled one."""
    if not _needs_count(mode):
        return None
    token_mode = mode == "token-mean"
    if counts is not None:  # a group sum: 0 only when no rank has an action token
        return counts[0 if token_mode else 1].to(dtype).clamp_min(1)
    name, value = ("num_tokens", num_tokens) if token_mode else ("num_seqs", num_seqs)
    if value is None:
        return None
    n = torch.as_tensor(value, dtype=dtype, device=keep.device)
    known = value if isinstance(value, float) else read_value(value)
    if known is not None and known > 0:
        return n
    if known == 0 and keep.device.type != "meta" and values_checked(keep):
        if bool(keep.any()):
            raise ValueError(
                f"{name} is 0 but this call has action tokens (mask 1): give the global "
                f"count of the batch, at least this call's own ({name} = 0 is only for a "
                "call without action tokens, whose loss is then 0)"
            )
        return torch.ones_like(n)
    n = torch.where(n < 0, math.nan, n)
    return torch.where((n == 0) & ~keep.any(), 1, n)


# --------------------------------------------------------------------------- aggregation
def _aggregate(
    x: torch.Tensor,
    keep: torch.Tensor,
    mode: str | None,
    loss_scale_factor: float | None,
    denom: torch.Tensor | None = None,
) -> torch.Tensor:
    """``mode`` reduction of ``x``, which must already be 0 where ``keep`` is False;
    ``mode=None`` returns ``x`` itself (the per-token matrix). ``denom`` is the global
    normaliser (tokens for token-mean, sequences for the seq-mean modes; see
    ``_denominator``), None for this call's own count."""
    if mode is None:
        return x
    if mode == "token-sum":
        return x.sum()
    if mode == "token-mean":
        n = keep.sum().to(x.dtype).clamp_min(1) if denom is None else denom
        return x.sum() / n
    tokens = keep.sum(-1).to(x.dtype)
    seq = x.sum(-1)
    if mode == "seq-mean-token-mean":
        seq = seq / tokens.clamp_min(1)
    n = (tokens > 0).sum().to(x.dtype).clamp_min(1) if denom is None else denom
    out = seq.sum() / n
    if mode == "seq-mean-token-sum-norm":
        out = out / (x.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return out


def loss_and_metrics(
    loss_mat: torch.Tensor,
    keep: torch.Tensor,
    agg: str | None,
    loss_scale_factor: float | None,
    dtype: torch.dtype,
    num_tokens: float | torch.Tensor | None,
    num_seqs: float | torch.Tensor | None,
    group: object,
    call: Call,
    metric_sums: dict[str, tuple[torch.Tensor, str]],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``agg`` of ``loss_mat`` and the metrics: ``metric_sums`` maps a name to ``(sum, per)``
    with ``per`` "tokens" or "rows"; the metric is the sum over the action tokens (or the rows
    with one) of this call, or of the whole ``group`` — counts, normaliser and metrics in one
    collective (which checks that every rank makes the same ``call``). Arguments checked."""
    tokens, rows, sums = batch_sums(keep, {k: v for k, (v, _) in metric_sums.items()}, group,
                                    call)
    counts = (tokens, rows) if group is not None else None
    denom = _denominator(keep, agg, dtype, num_tokens, num_seqs, counts)
    metrics = {
        k: (sums[k] / (tokens if per == "tokens" else rows).clamp_min(1)).to(dtype)
        for k, (_, per) in metric_sums.items()
    }
    return _aggregate(loss_mat, keep, agg, loss_scale_factor, denom), metrics


def aggregate(
    loss_mat: torch.Tensor,
    keep: torch.Tensor,
    mode: str,
    loss_scale_factor: float | None,
    num_tokens: float | torch.Tensor | None,
    num_seqs: float | torch.Tensor | None,
    group: object,
    call: Call,
) -> torch.Tensor:
    """:func:`aggregate_loss` on checked arguments (``keep``: the bool mask), for the package's
    public functions that check their own; ``call`` describes the public call."""
    dtype = compute_dtype(loss_mat.dtype)
    x = torch.where(keep, loss_mat.to(dtype), 0)
    counts = None
    if group is not None and (_needs_count(mode) or check_enabled()):
        counts = batch_sums(keep, {}, group, call)[:2]
    denom = _denominator(keep, mode, dtype, num_tokens, num_seqs, counts)
    return _aggregate(x, keep, mode, loss_scale_factor, denom)


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    loss_scale_factor: float | None = None,
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    group: object = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar, with verl's ``loss_agg_mode`` names.

    With ``m`` the mask, ``n_b = Σ_t m[b,t]``, ``N`` the number of action tokens and ``S`` the
    number of rows with ``n_b > 0``::

        token-mean               Σ_{b,t} m·ℓ / N
        token-sum                Σ_{b,t} m·ℓ
        seq-mean-token-sum       (1/S) Σ_b Σ_t m·ℓ
        seq-mean-token-mean      (1/S) Σ_b (Σ_t m·ℓ) / n_b
        seq-mean-token-sum-norm  (1/S) Σ_b Σ_t m·ℓ / L      (Dr.GRPO; L = loss_scale_factor or T)

    **Layout invariance.** By default ``N`` and ``S`` are this call's own counts. Pass the counts
    of the whole global batch — ``num_tokens=N`` (token-mean) and ``num_seqs=S`` (the seq-mean
    modes), or ``group=`` when each rank of a process group holds one micro-batch (then ``N``
    and ``S`` are summed over the group in one ``all_gather``) — and each call returns its
    micro-batch's *share*: the losses of all micro-batches on all ranks **sum** to the loss of
    the full batch, and so do their gradients::

        Σ_micro-batches Σ_ranks aggregate_loss(ℓ_i, m_i, mode, num_tokens=N, num_seqs=S)
            == aggregate_loss(ℓ, m, mode)

    So sum the micro-batch losses (or accumulate their gradients) and *sum* gradients over
    ranks. verl's convention differs by a factor: its ``agg_loss`` multiplies each rank's share
    by ``dp_size`` because DDP/FSDP *average* gradients over data-parallel ranks
    (``rlops.compat.verl.agg_loss`` keeps that). ``token-sum`` needs no normaliser and
    ``seq-mean-token-sum-norm`` needs the same ``L`` on every micro-batch (pass
    ``loss_scale_factor`` when ``T`` varies). Counts may be 0-dim tensors on the device (they
    are not read on the host). A count of 0 gives 0 on a call without action tokens and is an
    error on one with action tokens (never silently taken as 1).

    ``seq-mean-token-sum-norm`` is Dr.GRPO's objective (https://arxiv.org/abs/2503.20783):
    the mean over sequences of each sequence's token *sum*, divided by a constant ``L`` instead
    of each sequence's own length (verl's definition since February 2026; earlier releases
    divided the plain token sum by ``L``). Rows with no action token are left out of the
    sequence means (as current verl); an empty batch gives 0.

    Args:
        loss_mat: ``[B, T]`` per-token loss.
        mask: ``[B, T]`` 0/1 action mask.
        mode: one of :data:`AGG_MODES`.
        loss_scale_factor: ``L`` for ``seq-mean-token-sum-norm`` (``> 0``); ignored otherwise.
        num_tokens: action tokens of the global batch, for ``token-mean``: a finite number
            ``>= 0`` or a 0-dim tensor (a constant: detached). 0 is for a call without action
            tokens (its loss is 0, with gradient 0: a rank with nothing to do still joins);
            with action tokens it raises ``ValueError``. Negative, NaN or infinite counts raise
            ``ValueError`` when given as a number or a CPU tensor; a tensor on an accelerator
            is not read (no host synchronisation, unless ``RLOPS_CHECK_VALUES=1``): there such a
            count gives a non-finite loss instead (``x/0``, NaN). A tensor on the meta device
            raises ``ValueError`` unless the loss is on the meta device too.
        num_seqs: rows with an action token in the global batch, for the seq-mean modes; the
            same rules as ``num_tokens``.
        group: a data-parallel process group with one micro-batch of whole rows per rank,
            instead of the two counts (under context parallelism, where a row is split over
            ranks, pass the counts).

    Returns:
        0-dim tensor, float32 for half inputs, else ``loss_mat``'s dtype. Differentiable.

    Example:
        >>> import torch
        >>> loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
        >>> m = torch.tensor([[1, 1, 1], [1, 0, 0]])
        >>> [round(aggregate_loss(loss, m, mode).item(), 4) for mode in AGG_MODES]
        [2.5, 10.0, 5.0, 3.0, 1.6667]
        >>> halves = [aggregate_loss(loss[i:i + 1], m[i:i + 1], num_tokens=4) for i in (0, 1)]
        >>> sum(halves).item()
        2.5
    """
    check_2d("loss_mat", loss_mat)
    keep = as_bool_mask("mask", mask, loss_mat.shape, "loss_mat", loss_mat)
    loss_scale_factor = check_agg("mode", mode, loss_scale_factor, optional=False)
    num_tokens, num_seqs = check_normalisers(num_tokens, num_seqs, group, loss_mat)
    call = describe("aggregate_loss", mode, loss_scale_factor, loss_mat.shape[-1])
    return aggregate(loss_mat, keep, mode, loss_scale_factor, num_tokens, num_seqs, group, call)
