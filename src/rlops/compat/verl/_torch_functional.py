"""verl's torch utilities (``verl/utils/torch_functional.py``): whitening, log-probs, entropy."""

from __future__ import annotations

import torch

import rlops


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True):
    """Whiten over the mask-1 entries (unbiased variance; ``ValueError`` below two, as verl).

    Example:
        >>> masked_whiten(torch.tensor([1.0, 2.0, 3.0, 50.0]), torch.tensor([1, 1, 1, 0]))
        tensor([-1.,  0.,  1.,  0.])
    """
    out = rlops.masked_whiten(values, mask, shift_mean=shift_mean, eps=1e-8)  # checks inputs
    selected = int(torch.count_nonzero(mask))
    if selected == 0:
        raise ValueError("mask selects no entry: at least one element of mask has to be 1")
    if selected == 1:
        raise ValueError(
            "mask selects a single entry: its unbiased variance divides by zero; at least two "
            "elements of mask have to be 1"
        )
    return out


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, inplace_backward=True):
    """``log softmax(logits)[labels]``, fused and chunked, float32 out.

    Example:
        >>> logprobs_from_logits(torch.tensor([[[0.0, 0.0], [2.0, 0.0]]]), torch.tensor([[1, 0]]))
        tensor([[-0.6931, -0.1269]])
    """
    return rlops.logprobs_and_entropy(logits, labels, with_entropy=False)[0]


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the last dimension, fused, chunked, float32 out.

    Example:
        >>> entropy_from_logits(torch.zeros(2, 4))
        tensor([1.3863, 1.3863])
    """
    target = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return rlops.logprobs_and_entropy(logits, target, with_entropy=True)[1]
