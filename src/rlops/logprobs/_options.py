"""The keyword options of the log-prob ops and of their references, declared once.

:class:`DistributionOptions` say which distribution a token's log-prob and entropy are taken
under (the head's map, the temperature, the support); the references take them and the two
output switches (:class:`ReferenceOptions`); the public ops take them and how to compute
(:class:`LogprobOptions`: the row mask, the CSR support, the group, the chunk).
"""

from __future__ import annotations

from typing import TypedDict

import torch

from rlops._types import Group

__all__ = ["DistributionOptions", "LogprobOptions", "ReferenceOptions"]


class DistributionOptions(TypedDict, total=False):
    """The distribution of each token: ``logit_scale``, ``final_logit_softcapping`` and
    ``temperature`` map the logits; ``keep_mask`` or the sampler's ``top_k`` / ``top_p`` /
    ``min_p`` give the support, over which the entropy runs with ``entropy_over_support``."""

    temperature: float
    logit_scale: float
    final_logit_softcapping: float | None
    keep_mask: torch.Tensor | None
    top_k: int | torch.Tensor | None
    top_p: float | torch.Tensor | None
    min_p: float | torch.Tensor | None
    entropy_over_support: bool


class ReferenceOptions(DistributionOptions, total=False):
    """The references' keyword arguments: the distribution and the two output switches."""

    with_entropy: bool
    with_sum_pi_squared: bool


class LogprobOptions(DistributionOptions, total=False):
    """The keyword options of :func:`rlops.logprobs_and_entropy` and
    :func:`rlops.linear_logprobs_and_entropy`, beside ``with_entropy`` and
    ``with_sum_pi_squared`` (which choose the outputs) and each op's own (``method``,
    ``bias``); each op's docstring says what each one means.

    Defaults: ``temperature=1.0``, ``logit_scale=1.0``, ``entropy_over_support=False``,
    ``entropy_grad=True``, every other one None (no softcap, no support, no row mask, no
    group, the default chunk). A keyword that is none of these is a ``TypeError`` naming it.

    Example:
        >>> import torch
        >>> from rlops.logprobs import LogprobOptions, logprobs_and_entropy
        >>> options: LogprobOptions = {"temperature": 2.0, "top_k": 1}
        >>> logprobs_and_entropy(torch.tensor([[2.0, 0.0]]), torch.tensor([0]), **options)
        (tensor([0.]), tensor([0.5822]))
    """

    support_ids: torch.Tensor | None
    support_offsets: torch.Tensor | None
    mask: torch.Tensor | None
    entropy_grad: bool
    group: Group
    chunk_size: int | None
