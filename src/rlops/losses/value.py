"""Clipped value loss, squared or Huber."""

from __future__ import annotations

import torch
from typing_extensions import Unpack  # torch's own dependency (typing.Unpack: 3.11+)

from rlops._checks import (
    as_bool_mask,
    check_2d,
    check_choice,
    check_finite_positive,
    check_positive,
    check_same_shape,
)
from rlops.distributed.collectives import fails_together
from rlops.losses._common import constant
from rlops.losses.aggregation import Aggregation, AggregationOptions

__all__ = ["value_loss"]

_LOSSES = ("mse", "huber")  # the per-token losses h of value_loss


@fails_together()
def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float | None = None,
    loss: str = "mse",
    huber_delta: float = 10.0,
    agg: str | None = "token-mean",
    **options: Unpack[AggregationOptions],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss ``agg(max(h(V − R), h(V_clip − R)))``, ``V_clip = clamp(V, V_old −
    clip, V_old + clip)``; ``clip=None``: ``agg(h(V − R))``. With ``loss="mse"``, ``h(d) = ½d²``;
    with ``loss="huber"`` (AReaL's ``ppo_critic_loss_fn``, ``loss_fn_type="huber"``), with
    ``δ = huber_delta``::

        h(d) = ½d²            where |d| < δ
               δ·(|d| − δ/2)  elsewhere

    Args:
        values: ``[B, T]`` value predictions being trained (``vpreds``).
        old_values, returns: ``[B, T]`` values at sampling time and targets (constants).
        mask: ``[B, T]`` 0/1 action mask.
        clip: ``None`` or ``> 0`` (verl's ``cliprange_value``, AReaL's ``value_eps_clip``).
        loss: ``"mse"`` or ``"huber"``.
        huber_delta: ``δ > 0``, finite (AReaL's 10); read with ``loss="huber"``.
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
        >>> value_loss(v, old, ret, torch.ones(1, 2), loss="huber", huber_delta=2.0)[0].item()
        2.25
    """
    check_2d("values", values)
    check_same_shape("values", values, old_values=old_values, returns=returns)
    keep = as_bool_mask("mask", mask, values.shape, "values", values)
    if clip is not None:
        clip = check_positive("clip", clip)
    check_choice("loss", loss, _LOSSES)
    delta = check_finite_positive("huber_delta", huber_delta)
    aggregation = Aggregation.checked("value_loss", keep, values, agg, options)
    # The values at sampling time and the targets are constants: no gradient into them.
    old_values, returns = constant(old_values), constant(returns)

    def h(d: torch.Tensor) -> torch.Tensor:
        if loss == "mse":
            return 0.5 * d.square()
        a = d.abs()
        return torch.where(a < delta, 0.5 * d.square(), delta * (a - 0.5 * delta))

    v, ret = (aggregation.masked(x) for x in (values, returns))
    loss_mat = h(v - ret)
    if clip is None:
        hits = torch.zeros((), dtype=torch.int64, device=values.device)
    else:
        old = aggregation.masked(old_values)
        clipped = h(torch.clamp(v, old - clip, old + clip) - ret)
        hits = ((clipped > loss_mat) & keep).sum()
        loss_mat = torch.maximum(loss_mat, clipped)
    huber = delta if loss == "huber" else None  # (the ranks agree on δ only where it is read)
    call = aggregation.describe("value_loss", clip=clip, loss=loss, huber_delta=huber)
    return aggregation.reduce(loss_mat, call, {"vf_clipfrac": (hits, "tokens")})
