"""slime's context-parallel layout of per-sample response tensors, with the group as an argument.

slime packs every sample (prompt + response, ``total_length`` tokens) in Megatron's zigzag
layout: the sample is cut into ``2·cp`` chunks of ``ceil(total_length / 2cp)`` positions and
rank ``r`` holds chunks ``r`` and ``2cp − 1 − r``. Per-token log-probs are shifted by one
(position ``p`` predicts token ``p + 1``), so response token ``i`` lives at position
``total_length − response_length − 1 + i``. A rank's per-sample list entry is the *compact*
concatenation of the response tokens falling in its first chunk, then in its second: any part
of the response, or none of it.

Here that layout is computed from :func:`rlops.distributed.zigzag_indices` for every length (no
special cases), and turned into one ``[B, 2C]`` zigzag batch (``C`` = the largest chunk of the
batch, the same on every rank) that rlops' carry-exchanging CP scans accept: each sample's
pieces sit at the start of their chunk's half-row, followed by mask-0 padding that the scans
pass through.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from rlops.compat import _ragged
from rlops.distributed import zigzag_indices
from rlops.distributed.groups import group_rank_size

__all__ = [
    "add_outcome_rewards",
    "all_gather_with_cp",
    "cp_rank_size",
    "held_response_index",
    "local_columns",
    "slice_log_prob_with_cp",
]


def cp_rank_size(group: object) -> tuple[int, int]:
    """``(rank, size)`` of ``group``; ``(0, 1)`` for ``None`` (no context parallelism)."""
    return group_rank_size(group, "cp_group")


def _check_lengths(total_length: int, response_length: int) -> None:
    for name, v in (("total_length", total_length), ("response_length", response_length)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if not 1 <= response_length <= total_length:
        raise ValueError(
            f"response_length must be in [1, total_length], got {response_length} with "
            f"total_length {total_length}"
        )


def held_response_index(
    total_length: int,
    response_length: int,
    cp_size: int,
    cp_rank: int,
    seq_len: int | None = None,
) -> tuple[torch.Tensor, int]:
    """Response indices whose log-prob this rank holds, in its local order, and how many of
    them fall in its first chunk. CPU ``int64``.

    ``seq_len`` sets the chunk size for the padded ``bshd`` format (``ceil(seq_len / 2cp)``);
    ``None`` is the packed ``thd`` format (``ceil(total_length / 2cp)``). With a response that
    fills the whole sequence, response token 0 has no log-prob position and no rank holds it.
    """
    _check_lengths(total_length, response_length)
    if cp_size == 1:
        return torch.arange(response_length), response_length
    length = total_length if seq_len is None else seq_len
    if length < total_length:
        raise ValueError(f"max_seq_len {length} is shorter than total_length {total_length}")
    pos = zigzag_indices(length, cp_size=cp_size, cp_rank=cp_rank)
    start = total_length - response_length - 1  # position of response token 0 (-1: none)
    keep = (pos >= max(start, 0)) & (pos < total_length - 1)
    n_first = int(keep[: pos.numel() // 2].sum())
    return pos[keep] - start, n_first


def local_columns(
    total_lengths: Sequence[int],
    response_lengths: Sequence[int],
    cp_size: int,
    cp_rank: int,
) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """For each sample: the response indices this rank holds, and the columns of a ``[B, 2C]``
    zigzag row where its pieces go (first chunk from column 0, second from column ``C``).

    Returns ``(held, columns, 2C)``; ``C`` depends only on ``total_lengths``, so every rank
    builds rows of the same width.
    """
    if len(total_lengths) != len(response_lengths):
        raise ValueError(
            f"total_lengths and response_lengths must have one entry per sample, got "
            f"{len(total_lengths)} and {len(response_lengths)}"
        )
    chunk = max((-(-t // (2 * cp_size)) for t in total_lengths), default=1)
    held, cols = [], []
    for total, response in zip(total_lengths, response_lengths):
        idx, n_first = held_response_index(total, response, cp_size, cp_rank)
        held.append(idx)
        cols.append(torch.cat([torch.arange(n_first), chunk + torch.arange(idx.numel() - n_first)]))
    return held, cols, 2 * chunk


# --------------------------------------------------------------------------- slime's helpers
class _AllReduceSum(torch.autograd.Function):
    """Sum over the group; the backward sums the upstream gradients over the group too (every
    rank's loss reads the reduced tensor)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        g = grad.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


def all_gather_with_cp(
    tensor: torch.Tensor, total_length: int, response_length: int, *, cp_group=None
) -> torch.Tensor:
    """The whole response ``[response_length, ...]`` on every CP rank, from each rank's
    compact piece (slime's layout). Differentiable: a zero-filled scatter, then an all-reduce
    whose backward all-reduces the gradient, as slime's. ``cp_group=None``: returns ``tensor``.

    A response token without a log-prob position (a response that fills the whole sequence)
    is 0. Prefer the estimators' ``cp_group=`` over gathering: they exchange carries only.

    Example:
        >>> import torch
        >>> all_gather_with_cp(torch.tensor([1.0, 2.0]), 7, 2)
        tensor([1., 2.])
    """
    rank, size = cp_rank_size(cp_group)
    if size == 1:
        return tensor
    held, _ = held_response_index(total_length, response_length, size, rank)
    if tensor.shape[0] != held.numel():
        raise ValueError(
            f"tensor holds {tensor.shape[0]} tokens but this rank's piece of a response of "
            f"{response_length} (total {total_length}) has {held.numel()}"
        )
    full = tensor.new_zeros((response_length, *tensor.shape[1:]))
    full = full.index_put((held.to(tensor.device),), tensor)
    return _AllReduceSum.apply(full, cp_group)


def slice_log_prob_with_cp(
    log_prob,
    total_length: int,
    response_length: int,
    qkv_format: str = "thd",
    max_token_len: int | None = None,
    *,
    cp_group=None,
):
    """This rank's compact piece of a whole-response tensor (or list), slime's CP layout.

    ``qkv_format="bshd"`` sizes the zigzag chunks from ``max_token_len`` instead of
    ``total_length``. ``cp_group=None``: returns ``log_prob``.

    Example:
        >>> slice_log_prob_with_cp([0.1, 0.2, 0.3], 8, 3)
        [0.1, 0.2, 0.3]
    """
    if len(log_prob) != response_length:
        raise ValueError(f"log_prob has {len(log_prob)} entries, expected {response_length}")
    rank, size = cp_rank_size(cp_group)
    if size == 1:
        return log_prob
    if qkv_format not in ("thd", "bshd"):
        raise ValueError(f"qkv_format must be 'thd' or 'bshd', got {qkv_format!r}")
    if qkv_format == "bshd" and max_token_len is None:
        raise ValueError("max_token_len must be given for qkv_format='bshd'")
    seq_len = max_token_len if qkv_format == "bshd" else None
    held, _ = held_response_index(total_length, response_length, size, rank, seq_len)
    if isinstance(log_prob, list):
        return [log_prob[i] for i in held.tolist()]
    return log_prob.index_select(0, held.to(log_prob.device))


def add_outcome_rewards(
    token_level_rewards, rewards, total_lengths, response_lengths, *, cp_group=None
) -> list[torch.Tensor]:
    """Add each outcome reward to the last response token, wherever a CP rank holds it.

    Replaces the lines of slime's PPO branch ``if cp_rank == 0: token_level_rewards[-1] +=
    reward``, which assume that rank 0's last local token is the last response token. In the
    zigzag layout that holds only when the sequence's last chunk contains it: otherwise (a short
    response, a total length that leaves the last chunk to padding) the reward goes to a wrong
    token on rank 0 and is lost, or rank 0 holds no response token and the indexing raises. Here
    the rank holding response token ``response_lengths[i] − 1`` adds it, at its local index.
    Without ``cp_group`` this is ``token_level_rewards[i][-1] += rewards[i]``. Returns new
    tensors.

    Example:
        >>> import torch
        >>> add_outcome_rewards([torch.zeros(3)], [1.0], [8], [3])
        [tensor([0., 0., 1.])]
    """
    xs = _ragged.as_1d_list("token_level_rewards", token_level_rewards)
    if not xs:
        return []
    flat = torch.cat(xs)
    scores = torch.as_tensor(rewards, device=flat.device).to(flat.dtype)
    rank, size = cp_rank_size(cp_group)
    offsets = [0]
    for x in xs:
        offsets.append(offsets[-1] + x.numel())
    where, which = [], []
    for i, x in enumerate(xs):
        if size == 1:
            local = x.numel() - 1
        else:
            held, _ = held_response_index(total_lengths[i], response_lengths[i], size, rank)
            if held.numel() != x.numel():
                raise ValueError(
                    f"token_level_rewards[{i}] has {x.numel()} entries but this "
                    f"rank holds {held.numel()} of that response"
                )
            hit = (held == response_lengths[i] - 1).nonzero()
            local = int(hit[0, 0]) if hit.numel() else -1
        if local >= 0:
            where.append(offsets[i] + local)
            which.append(i)
    if where:
        idx = torch.as_tensor(where, device=flat.device)
        flat = flat.index_add(0, idx, scores[torch.as_tensor(which, device=flat.device)])
    return list(flat.split([x.numel() for x in xs]))
