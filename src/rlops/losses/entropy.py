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
    """Entropy bonus ``−coef·aggregate_loss(H, mask, agg)``, a term to *add* to the loss.

    ``H [B, T]`` is the per-token entropy of the policy's distribution, e.g. the second output of
    :func:`rlops.logprobs_and_entropy` (with ``entropy_grad=True`` so that its gradient reaches
    the logits). Minimising the sum ``policy loss + entropy_loss`` raises the entropy when
    ``coef > 0`` (exploration; ``coef < 0`` lowers it). This is verl's
    ``policy_loss -= entropy_coeff * agg_loss(entropy, ...)``: with ``coef=entropy_coeff`` and
    the same aggregation mode and normalisers, ``pg_loss + entropy_loss(...)[0]`` is verl's
    policy loss. Per token, the gradient is ``−coef`` times
    the token's aggregation weight (``m/N`` for ``token-mean``), 0 where the mask is 0.

    Args:
        entropy: ``[B, T]`` per-token entropy (nats); NaN or inf at mask-0 entries is ignored.
        mask: ``[B, T]`` 0/1 action mask.
        agg: one of :data:`rlops.losses.AGG_MODES` (verl's ``loss_agg_mode``), see
            :func:`aggregate_loss`.
        coef: the bonus coefficient, a finite number, or a 0-dim floating tensor on the
            device (not read on the host; it may require grad).
        **options: the aggregation's normalisers, groups and packing
            (:class:`rlops.losses.AggregationOptions`, as
            :func:`aggregate_loss`): with ``num_tokens``, ``num_seqs`` or ``group`` the
            micro-batch losses *sum* to the full-batch loss; with ``cp_group`` (rows split
            over context-parallel ranks) the ranks' losses sum to the whole rows' loss, each
            rank's gradient the whole rows' gradient on its tokens.

    Returns:
        ``(loss, metrics)``: the 0-dim loss (float32 for half inputs) and ``entropy``, the
        aggregated entropy ``aggregate_loss(H, mask, agg, ...)``, detached (so
        ``loss = −coef·entropy``). With global normalisers (or ``cp_group``) both are this
        call's *share*: summed over micro-batches and ranks they give the full batch's (as
        verl's ``actor/entropy_loss`` metric, which it sums).

    Example:
        >>> import torch
        >>> h = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
        >>> m = torch.tensor([[1, 1, 1], [1, 0, 0]])
        >>> loss, metrics = entropy_loss(h, m, coef=0.01)
        >>> round(loss.item(), 6), metrics["entropy"].item()
        (-0.025, 2.5)
        >>> loss, metrics = entropy_loss(h, m, agg="seq-mean-token-mean", coef=0.01)
        >>> round(loss.item(), 6), metrics["entropy"].item()
        (-0.03, 3.0)
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
