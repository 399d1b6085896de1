"""Megatron's load-balanced ("zigzag") context-parallel layout.

A sequence padded to a multiple of ``2 * cp`` is cut into ``2 * cp`` equal chunks; rank ``r``
holds chunks ``r`` and ``2*cp - 1 - r``, concatenated in that order. Causal attention then
costs every rank the same, and a reverse scan needs from the other ranks only one carry per
chunk (see :mod:`rlops.advantages.context_parallel`).

Trainers also use a *response-offset* form: the tokens are prompt + response (``total``
tokens, the last ``response`` of them generated), and per-token log-probs are shifted by one
(position ``p`` holds the log-prob of token ``p + 1``), so response token ``i`` sits at
position ``total - response - 1 + i``. :func:`zigzag_shard_response` places response-aligned
tensors at those positions of the zigzag layout (zeros elsewhere) and returns the matching
``mask``; a rank may hold any part of the response, or none of it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlops._checks import as_tensor, check_cp_rank, check_dim
from rlops.distributed.groups import group_rank_size

__all__ = [
    "zigzag_indices",
    "zigzag_response_mask",
    "zigzag_shard",
    "zigzag_shard_response",
    "zigzag_unshard",
    "zigzag_unshard_response",
]


def _padded(length: int, cp_size: int) -> int:
    return -(-length // (2 * cp_size)) * (2 * cp_size)


def zigzag_indices(
    length: int, *, cp_size: int, cp_rank: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Positions of the padded sequence that rank ``cp_rank`` holds, in its local order.

    The sequence of ``length`` tokens is padded to a multiple of ``2 * cp_size``; the result
    has ``padded / cp_size`` entries, some ``>= length`` (padding).

    Example:
        >>> zigzag_indices(8, cp_size=2, cp_rank=0)
        tensor([0, 1, 6, 7])
    """
    check_cp_rank(cp_size, cp_rank)
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    chunk = _padded(length, cp_size) // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    second_start = (2 * cp_size - 1 - cp_rank) * chunk
    second = torch.arange(second_start, second_start + chunk, device=device)
    return torch.cat([first, second])


def zigzag_shard(x: torch.Tensor, *, cp_size: int, cp_rank: int, dim: int = -1) -> torch.Tensor:
    """This rank's zigzag shard of ``x`` along ``dim`` (padded with zeros to ``2 * cp_size``).

    Args:
        x: the full tensor, e.g. ``[B, T]``.
        cp_size: the context-parallel world size.
        cp_rank: this rank.
        dim: the sequence dimension.

    Returns:
        ``x`` restricted to chunks ``cp_rank`` and ``2*cp_size - 1 - cp_rank``: ``[B, T_pad /
        cp_size]`` for ``dim=-1``.

    Example:
        >>> zigzag_shard(torch.arange(6), cp_size=2, cp_rank=1)
        tensor([2, 3, 4, 5])
    """
    check_cp_rank(cp_size, cp_rank)
    x = as_tensor("x", x)
    x = x.movedim(check_dim(dim, x.dim()), -1)
    t_len = x.shape[-1]
    pad = _padded(t_len, cp_size) - t_len
    if pad:
        x = F.pad(x, (0, pad))
    idx = zigzag_indices(t_len, cp_size=cp_size, cp_rank=cp_rank, device=x.device)
    return x.index_select(-1, idx).movedim(-1, dim)


def zigzag_unshard(
    local: torch.Tensor, *, group: dist.ProcessGroup | None, length: int, dim: int = -1
) -> torch.Tensor:
    """Reassemble the full tensor from every rank's zigzag shard (one ``all_gather``).

    Args:
        local: this rank's shard (as returned by :func:`zigzag_shard`).
        group: the context-parallel process group (None: one process).
        length: the unpadded sequence length to return.
        dim: the sequence dimension.

    Returns:
        The full tensor with ``length`` entries along ``dim``, on every rank.
    """
    cp_size = group_rank_size(group)[1]
    local = as_tensor("local", local)
    local = local.movedim(check_dim(dim, local.dim()), -1).contiguous()
    if local.shape[-1] % 2:
        raise ValueError(f"local must hold two equal chunks along dim, got {local.shape[-1]}")
    if cp_size == 1:
        parts = [local]
    else:
        parts = [torch.empty_like(local) for _ in range(cp_size)]
        dist.all_gather(parts, local, group=group)
    padded = local.shape[-1] * cp_size
    if length > padded:
        raise ValueError(f"length {length} exceeds the {padded} positions the shards hold")
    full = local.new_empty((*local.shape[:-1], padded))
    for rank, part in enumerate(parts):
        idx = zigzag_indices(padded, cp_size=cp_size, cp_rank=rank, device=local.device)
        full[..., idx] = part
    return full[..., :length].movedim(-1, dim)


def _response_start(total_length: int, response_length: int) -> int:
    if not 1 <= response_length < total_length + 1:
        raise ValueError(
            f"response_length must be in [1, total_length], got {response_length} "
            f"with total_length {total_length}"
        )
    return total_length - response_length - 1


def zigzag_response_mask(
    total_length: int,
    response_length: int,
    *,
    cp_size: int,
    cp_rank: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Bool mask over this rank's zigzag positions: True where a response log-prob sits.

    Response token ``i`` (``0 <= i < response_length``) has its log-prob at position
    ``total_length - response_length - 1 + i`` (the logits at position ``p`` predict token
    ``p + 1``). With a response that fills the whole sequence the first token has no
    log-prob position; it is then dropped.

    Example:
        >>> zigzag_response_mask(6, 3, cp_size=2, cp_rank=0)  # positions 0, 1 | 6, 7 (pad)
        tensor([False, False, False, False])
        >>> zigzag_response_mask(6, 3, cp_size=2, cp_rank=1)  # positions 2, 3 | 4, 5
        tensor([ True,  True,  True, False])
    """
    start = _response_start(total_length, response_length)
    pos = zigzag_indices(total_length, cp_size=cp_size, cp_rank=cp_rank, device=device)
    return (pos >= max(start, 0)) & (pos < total_length - 1)


def zigzag_shard_response(
    x: torch.Tensor,
    *,
    total_length: int,
    response_length: int,
    cp_size: int,
    cp_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Place response-aligned ``x`` ``[..., R]`` on this rank's zigzag positions.

    Returns ``(local, mask)``: ``local`` ``[..., T_local]`` holds ``x[..., i]`` at the position
    of response token ``i`` and 0 elsewhere; ``mask`` ``[T_local]`` marks those positions.
    Run the estimators on ``local`` with ``mask`` (and ``cp_group``): prompt and padding
    positions are skipped.
    """
    if x.shape[-1] != response_length:
        raise ValueError(
            f"x must have response_length = {response_length} entries in its last dim, "
            f"got {x.shape[-1]}"
        )
    start = _response_start(total_length, response_length)
    pos = zigzag_indices(total_length, cp_size=cp_size, cp_rank=cp_rank, device=x.device)
    mask = zigzag_response_mask(
        total_length, response_length, cp_size=cp_size, cp_rank=cp_rank, device=x.device
    )
    idx = (pos - start).clamp(0, response_length - 1)
    local = torch.where(mask, x.index_select(-1, idx), 0)
    return local, mask


def zigzag_unshard_response(
    local: torch.Tensor,
    *,
    group: dist.ProcessGroup | None,
    total_length: int,
    response_length: int,
) -> torch.Tensor:
    """Inverse of :func:`zigzag_shard_response`: the response-aligned ``[..., R]`` on every
    rank (one ``all_gather``). A first response token without a log-prob position is 0."""
    start = _response_start(total_length, response_length)
    full = zigzag_unshard(local, group=group, length=total_length)
    out = full[..., max(start, 0) : total_length - 1]
    if start < 0:
        out = F.pad(out, (1, 0))
    return out
