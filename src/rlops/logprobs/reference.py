"""The unfused reference: ``log_softmax`` + gather for log-probs, softmax · log_softmax for entropy.

Plain PyTorch on the full vocabulary in one process, materialising every ``[..., V]``
intermediate. It defines the semantics the fused ops must match (tests) and is the baseline they
are measured against (benchmarks). Not exported from :mod:`rlops`.
"""

from __future__ import annotations

import torch

from rlops._checks import compute_dtype

__all__ = ["linear_logprobs_and_entropy_reference", "logprobs_and_entropy_reference"]


def logprobs_and_entropy_reference(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    temperature: float = 1.0,
    keep_mask: torch.Tensor | None = None,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference log-probs and entropy over the full vocabulary ``[..., V]``.

    ``z = logits / temperature`` in float32 (float64 stays float64);
    ``logp = log_softmax(z masked to keep_mask ∪ {target}).gather(target)``;
    ``entropy = −(softmax(z) · log_softmax(z)).sum(−1)`` over the unmasked logits.

    Example:
        >>> import torch
        >>> logp, ent = logprobs_and_entropy_reference(torch.zeros(1, 4), torch.tensor([2]))
        >>> logp, ent
        (tensor([-1.3863]), tensor([1.3863]))
    """
    z = logits.to(compute_dtype(logits.dtype)) / temperature
    idx = target.long().unsqueeze(-1)
    zk = z
    if keep_mask is not None:
        keep = keep_mask.scatter(-1, idx, True)
        zk = z.masked_fill(~keep, float("-inf"))
    logp = torch.log_softmax(zk, dim=-1).gather(-1, idx).squeeze(-1)
    if not with_entropy:
        return logp, None
    log_p = torch.log_softmax(z, dim=-1)
    return logp, -(torch.softmax(z, dim=-1) * log_p).sum(dim=-1)


def linear_logprobs_and_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    temperature: float = 1.0,
    keep_mask: torch.Tensor | None = None,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The reference on materialised logits: ``hidden [N, H] @ weight [V, H]ᵀ`` in their dtype.

    Example:
        >>> import torch
        >>> logp, _ = linear_logprobs_and_entropy_reference(
        ...     torch.ones(1, 2), torch.zeros(3, 2), torch.tensor([0]), with_entropy=False)
        >>> logp
        tensor([-1.0986])
    """
    return logprobs_and_entropy_reference(
        hidden @ weight.T,
        target,
        temperature=temperature,
        keep_mask=keep_mask,
        with_entropy=with_entropy,
    )
