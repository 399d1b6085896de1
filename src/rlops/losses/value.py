"""Clipped value loss."""

from __future__ import annotations

import torch

from rlops._checks import as_bool_mask, check_2d, check_positive, check_same_shape, compute_dtype
from rlops._types import CPLayout, EmptyRows, Group
from rlops.distributed.collectives import fails_together
from rlops.losses._checks import check_agg, check_normalisers
from rlops.losses._common import constant
from rlops.losses.aggregation import describe, loss_and_metrics, make_rows

__all__ = ["value_loss"]


@fails_together()
def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float | None = None,
    agg: str | None = "token-mean",
    loss_scale_factor: float | None = None,
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    group: Group = None,
    cp_group: Group = None,
    cp_layout: CPLayout = "zigzag",
    seq_ids: torch.Tensor | None = None,
    seqs_per_row: int | None = None,
    empty_rows: EmptyRows = "skip",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss: ``0.5·agg(max((V − R)², (V_clip − R)²))``.

    ``V_clip = clamp(V, V_old − clip, V_old + clip)`` keeps the new value within ``clip`` of the
    value at sampling time; ``clip=None`` gives the plain ``0.5·agg((V − R)²)``. ``V_old`` and
    ``R`` are constants (detached inside): the gradient flows into ``V`` only.

    Args:
        values: ``[B, T]`` value predictions being trained (``vpreds``).
        old_values: ``[B, T]`` value predictions at sampling time; a constant (detached
            inside).
        returns: ``[B, T]`` regression targets; a constant (detached inside).
        mask: ``[B, T]`` 0/1 action mask.
        clip: ``None`` or ``> 0`` (verl's ``cliprange_value``).
        agg: aggregation mode, see :func:`aggregate_loss`; ``None`` returns the per-token loss
            matrix ``[B, T]`` (0 on mask-0 tokens) instead of a scalar, for callers that
            aggregate themselves.
        loss_scale_factor: see :func:`aggregate_loss`.
        num_tokens: see :func:`aggregate_loss` (global normalisers: with ``num_tokens``,
            ``num_seqs`` or ``group``, the micro-batch losses then sum to the full-batch
            loss).
        num_seqs: see :func:`aggregate_loss`.
        group: see :func:`aggregate_loss`.
        cp_group: see :func:`aggregate_loss` (rows split
            over context-parallel ranks: the ranks' losses sum to the whole rows' loss, each
            rank's gradient is the whole rows' gradient on its tokens).
        cp_layout: see :func:`aggregate_loss`.
        seq_ids: see :func:`aggregate_loss` (packed sequences).
        seqs_per_row: see :func:`aggregate_loss`.
        empty_rows: see :func:`aggregate_loss` (rows without an action token in ``S``).

    Returns:
        ``(loss, metrics)``: a 0-dim loss (float32 for half inputs; the ``[B, T]`` matrix
        ``0.5·max(...)`` with ``agg=None``) and ``vf_clipfrac``, the
        detached fraction of action tokens where the clipped error is the larger (0 when off)
        — of this call's tokens (the whole rows' with ``cp_group``), or of the whole group's
        with ``group=`` (the same collective as the normaliser).

    Example:
        >>> import torch
        >>> v, old, ret = torch.tensor([[1.0, 3.0]]), torch.tensor([[1.0, 1.0]]), torch.zeros(1, 2)
        >>> loss, m = value_loss(v, old, ret, torch.ones(1, 2), clip=0.5)
        >>> loss.item(), m["vf_clipfrac"].item()
        (2.5, 0.0)
    """
    check_2d("values", values)
    check_same_shape("values", values, old_values=old_values, returns=returns)
    keep = as_bool_mask("mask", mask, values.shape, "values", values)
    if clip is not None:
        clip = check_positive("clip", clip)
    loss_scale_factor = check_agg("agg", agg, loss_scale_factor)
    num_tokens, num_seqs = check_normalisers(num_tokens, num_seqs, group, values)
    # The values at sampling time and the targets are constants: no gradient into them.
    old_values, returns = constant(old_values), constant(returns)

    dtype = compute_dtype(values.dtype)
    layout = (group, cp_group, cp_layout, seq_ids, seqs_per_row, empty_rows)
    rows = make_rows(keep, dtype, agg, loss_scale_factor, *layout)
    v, ret = (torch.where(keep, x.to(dtype), 0) for x in (values, returns))
    loss_mat = (v - ret).square()
    if clip is None:
        hits = torch.zeros((), dtype=torch.int64, device=values.device)
    else:
        old = torch.where(keep, old_values.to(dtype), 0)
        clipped = (torch.clamp(v, old - clip, old + clip) - ret).square()
        hits = ((clipped > loss_mat) & keep).sum()
        loss_mat = torch.maximum(loss_mat, clipped)
    call = describe("value_loss", agg, loss_scale_factor, values.shape[-1], rows=rows, clip=clip)
    return loss_and_metrics(
        0.5 * loss_mat,
        rows,
        agg,
        loss_scale_factor,
        dtype,
        num_tokens,
        num_seqs,
        group,
        call,
        {"vf_clipfrac": (hits, "tokens")},
    )
