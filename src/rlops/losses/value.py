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
    """Clipped value loss ``0.5·agg(max((V − R)², (V_clip − R)²))``, ``V_clip = clamp(V, V_old −
    clip, V_old + clip)``; ``clip=None``: ``0.5·agg((V − R)²)``.

    Args:
        values: ``[B, T]`` value predictions being trained (``vpreds``).
        old_values, returns: ``[B, T]`` values at sampling time and targets (constants).
        mask: ``[B, T]`` 0/1 action mask.
        clip: ``None`` or ``> 0`` (verl's ``cliprange_value``).
        agg: see :func:`aggregate_loss`; ``None`` returns the ``[B, T]`` matrix.
        **options: :class:`rlops.losses.AggregationOptions`.

    Returns:
        ``(loss, metrics)``: the 0-dim loss and ``vf_clipfrac`` (where the clipped error is larger).

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
