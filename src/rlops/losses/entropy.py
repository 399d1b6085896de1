"""Entropy bonus: the aggregated per-token entropy, negated and scaled, to add to the loss."""

from __future__ import annotations

import torch
from typing_extensions import Unpack  # torch's own dependency (typing.Unpack: 3.11+)

from rlops._checks import as_bool_mask, check_2d
from rlops.distributed.collectives import fails_together
from rlops.losses._checks import check_coef
from rlops.losses.aggregation import Aggregation, AggregationOptions

__all__ = ["entropy_loss"]


@fails_together()
def entropy_loss(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    *,
    agg: str = "token-mean",
    coef: float | torch.Tensor = 1.0,
    **options: Unpack[AggregationOptions],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Entropy bonus ``−coef·aggregate_loss(H, mask, agg)``, a term to *add* to the loss (verl's
    ``policy_loss -= entropy_coeff * agg_loss(entropy, ...)``); ``coef > 0`` raises the entropy.

    Args:
        entropy, mask: ``[B, T]`` per-token entropy (e.g. of :func:`rlops.logprobs_and_entropy`)
            and 0/1 action mask.
        agg: one of :data:`rlops.losses.AGG_MODES`, see :func:`aggregate_loss`.
        coef: a finite number, or a 0-dim floating tensor on the device (not read on the host).
        **options: :class:`rlops.losses.AggregationOptions`.

    Returns:
        ``(loss, metrics)``: the 0-dim loss and ``entropy``, the aggregated ``H`` (detached).

    Example:
        >>> import torch
        >>> h = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
        >>> loss, metrics = entropy_loss(h, torch.tensor([[1, 1, 1], [1, 0, 0]]), coef=0.01)
        >>> round(loss.item(), 6), metrics["entropy"].item()
        (-0.025, 2.5)
    """
    check_2d("entropy", entropy)
    keep = as_bool_mask("mask", mask, entropy.shape, "entropy", entropy)
    aggregation = Aggregation.checked("entropy_loss", keep, entropy, agg, options, optional=False)
    coef = check_coef(coef, entropy)
    call = aggregation.describe("entropy_loss")
    agg_entropy = aggregation.reduce(aggregation.masked(entropy), call)[0]
    if isinstance(coef, torch.Tensor):
        coef = coef.to(agg_entropy.dtype)
    return -coef * agg_entropy, {"entropy": agg_entropy.detach()}
