"""Context-parallel layouts (:mod:`rlops.distributed`): a rank's shard is whole chunks side by
side, so a reverse scan needs one carry per chunk from the others; the row's last chunk ends
one rank's shard (:func:`holds_row_end`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlops._checks import as_tensor, check_choice, check_cp_rank, check_dim
from rlops._types import CPLayout, Group
from rlops.distributed.groups import group_rank_size

# the public names (re-exported by rlops.distributed); check_cp_layout, rank_chunks and
# holds_row_end serve the context-parallel scans
__all__ = [
    "CP_LAYOUTS",
    "contiguous_indices",
    "contiguous_shard",
    "contiguous_unshard",
    "cp_indices",
    "cp_shard",
    "cp_unshard",
    "zigzag_indices",
    "zigzag_shard",
    "zigzag_unshard",
]

#: the context-parallel layouts, in the order of the ``cp_layout=`` documentation
CP_LAYOUTS = ("zigzag", "contiguous")


def check_cp_layout(layout: object) -> str:
    """``layout`` must be one of :data:`CP_LAYOUTS` (``ValueError`` naming ``cp_layout``)."""
    return check_choice("cp_layout", layout, CP_LAYOUTS)


def rank_chunks(layout: CPLayout, cp_size: int, cp_rank: int) -> tuple[int, ...]:
    """The global chunk indices rank ``cp_rank`` holds, in its local order; the sequence has
    ``2 * cp_size`` chunks in zigzag, ``cp_size`` in contiguous.

    Example:
        >>> rank_chunks("zigzag", 2, 0), rank_chunks("contiguous", 2, 0)
        ((0, 3), (0,))
    """
    check_cp_layout(layout)
    check_cp_rank(cp_size, cp_rank)
    if layout == "zigzag":
        return (cp_rank, 2 * cp_size - 1 - cp_rank)
    return (cp_rank,)


def holds_row_end(layout: CPLayout, cp_size: int, cp_rank: int) -> bool:
    """Whether rank ``cp_rank``'s shard ends with the sequence's last (padded) position."""
    chunks = rank_chunks(layout, cp_size, cp_rank)
    return chunks[-1] == (2 * cp_size if layout == "zigzag" else cp_size) - 1


def contiguous_indices(
    length: int, *, cp_size: int, cp_rank: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Positions of the padded sequence that rank ``cp_rank`` holds in the contiguous layout.

    The sequence of ``length`` tokens is padded to a multiple of ``cp_size``; the result has
    ``padded / cp_size`` entries, some ``>= length`` (padding) on the last ranks.

    Example:
        >>> contiguous_indices(5, cp_size=2, cp_rank=1)
        tensor([3, 4, 5])
    """
    check_cp_rank(cp_size, cp_rank)
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    chunk = -(-length // cp_size)
    return torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)


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
    chunk = _padded(length, cp_size, "zigzag") // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    second_start = (2 * cp_size - 1 - cp_rank) * chunk
    second = torch.arange(second_start, second_start + chunk, device=device)
    return torch.cat([first, second])


def cp_indices(
    length: int,
    *,
    cp_size: int,
    cp_rank: int,
    layout: CPLayout = "zigzag",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Positions of the padded sequence that rank ``cp_rank`` holds in ``layout``, in its
    local order (:func:`rlops.distributed.zigzag_indices` or :func:`contiguous_indices`)."""
    check_cp_layout(layout)
    if layout == "zigzag":
        return zigzag_indices(length, cp_size=cp_size, cp_rank=cp_rank, device=device)
    return contiguous_indices(length, cp_size=cp_size, cp_rank=cp_rank, device=device)


def _padded(length: int, cp_size: int, layout: str) -> int:
    unit = 2 * cp_size if layout == "zigzag" else cp_size
    return -(-length // unit) * unit


def cp_shard(
    x: torch.Tensor, *, cp_size: int, cp_rank: int, layout: CPLayout = "zigzag", dim: int = -1
) -> torch.Tensor:
    """This rank's shard of ``x`` along ``dim`` in ``layout``, padded with zeros at the end of
    the sequence to whole chunks.

    Example:
        >>> cp_shard(torch.arange(8), cp_size=2, cp_rank=0, layout="contiguous")
        tensor([0, 1, 2, 3])
        >>> cp_shard(torch.arange(8), cp_size=2, cp_rank=0)  # zigzag: chunks 0 and 3
        tensor([0, 1, 6, 7])
    """
    check_cp_layout(layout)
    check_cp_rank(cp_size, cp_rank)
    x = as_tensor("x", x)
    x = x.movedim(check_dim(dim, x.dim()), -1)
    t_len = x.shape[-1]
    pad = _padded(t_len, cp_size, layout) - t_len
    if pad:
        x = F.pad(x, (0, pad))
    idx = cp_indices(t_len, cp_size=cp_size, cp_rank=cp_rank, layout=layout, device=x.device)
    return x.index_select(-1, idx).movedim(-1, dim)


def zigzag_shard(x: torch.Tensor, *, cp_size: int, cp_rank: int, dim: int = -1) -> torch.Tensor:
    """This rank's zigzag shard of ``x`` along ``dim`` (:func:`cp_shard`): chunks ``cp_rank``
    and ``2*cp_size - 1 - cp_rank`` of the sequence padded with zeros to ``2 * cp_size`` chunks,
    ``[B, T_pad / cp_size]`` for ``x`` ``[B, T]``.

    Example:
        >>> zigzag_shard(torch.arange(6), cp_size=2, cp_rank=1)
        tensor([2, 3, 4, 5])
    """
    return cp_shard(x, cp_size=cp_size, cp_rank=cp_rank, layout="zigzag", dim=dim)


def contiguous_shard(x: torch.Tensor, *, cp_size: int, cp_rank: int, dim: int = -1):
    """This rank's contiguous shard of ``x`` along ``dim`` (:func:`cp_shard`)."""
    return cp_shard(x, cp_size=cp_size, cp_rank=cp_rank, layout="contiguous", dim=dim)


def cp_unshard(
    local: torch.Tensor,
    *,
    group: Group,
    length: int,
    layout: CPLayout = "zigzag",
    dim: int = -1,
) -> torch.Tensor:
    """Reassemble the full tensor from every rank's shard in ``layout`` (one ``all_gather``).

    Args:
        local: this rank's shard (as returned by :func:`cp_shard`).
        group: the context-parallel process group (None: one process).
        length: the unpadded sequence length to return.
        layout: ``"zigzag"`` or ``"contiguous"``.
        dim: the sequence dimension.

    Returns:
        The full tensor with ``length`` entries along ``dim``, on every rank.
    """
    check_cp_layout(layout)
    cp_size = group_rank_size(group)[1]
    local = as_tensor("local", local)
    local = local.movedim(check_dim(dim, local.dim()), -1).contiguous()
    if layout == "zigzag" and local.shape[-1] % 2:
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
        idx = cp_indices(padded, cp_size=cp_size, cp_rank=rank, layout=layout, device=local.device)
        full[..., idx] = part
    return full[..., :length].movedim(-1, dim)


def zigzag_unshard(
    local: torch.Tensor, *, group: Group, length: int, dim: int = -1
) -> torch.Tensor:
    """Reassemble the full tensor from every rank's zigzag shard (:func:`cp_unshard`)."""
    return cp_unshard(local, group=group, length=length, layout="zigzag", dim=dim)


def contiguous_unshard(
    local: torch.Tensor, *, group: Group, length: int, dim: int = -1
) -> torch.Tensor:
    """Reassemble the full tensor from every rank's contiguous shard (:func:`cp_unshard`)."""
    return cp_unshard(local, group=group, length=length, layout="contiguous", dim=dim)
