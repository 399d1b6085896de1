"""Clipped value loss."""

from __future__ import annotations

import torch
from typing_extensions import Unpack  # torch's own dependency (typing.Unpack: 3.11+)

from rlops._checks import as_bool_mask, check_2d, check_positive, check_same_shape
from rlops.distributed.collectives import fails_together
from rlops.losses._common import constant
from rlops.losses.aggregation import Aggregation, AggregationOptions

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
    **options: Unpack[AggregationOptions],
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
        **options: the aggregation's normalisers, groups and packing
            (:class:`rlops.losses.AggregationOptions`, as
            :func:`aggregate_loss`): with ``num_tokens``, ``num_seqs`` or ``group`` the
            micro-batch losses sum to the full-batch loss; with ``cp_group`` the ranks'
            losses sum to the whole rows' loss.

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
    aggregation = Aggregation.checked("value_loss", keep, values, agg, options)
    # The values at sampling time and the targets are constants: no gradient into them.
    old_values, returns = constant(old_values), constant(returns)

    v, ret = (aggregation.masked(x) for x in (values, returns))
    loss_mat = (v - ret).square()
    if clip is None:
        hits = torch.zeros((), dtype=torch.int64, device=values.device)
    else:
        old = aggregation.masked(old_values)
        clipped = (torch.clamp(v, old - clip, old + clip) - ret).square()
        hits = ((clipped > loss_mat) & keep).sum()
        loss_mat = torch.maximum(loss_mat, clipped)
    call = aggregation.describe("value_loss", clip=clip)
    return aggregation.reduce(0.5 * loss_mat, call, {"vf_clipfrac": (hits, "tokens")})
