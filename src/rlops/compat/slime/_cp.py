"""slime's context-parallel layout (``cp_utils.py``): zigzag response pieces, group as argument."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlops._checks import as_int, check_choice
from rlops._types import Group
from rlops.compat import _ragged
from rlops.compat._ragged import place_runs, runs, take_runs
from rlops.distributed import zigzag_indices, zigzag_shard, zigzag_unshard
from rlops.distributed.groups import group_rank_size


def default_group(group: Group, name: str) -> Group:
    """slime's group argument: None is the world group (if initialised); one process, none."""
    if group is None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
    return None if group_rank_size(group, name)[1] == 1 else group


def _response_start(total_length: int, response_length: int) -> int:
    """The position of response token 0's log-prob (−1: it has none)."""
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
    """Bool mask ``[T_local]``: True at this rank's zigzag positions that hold a response log-prob.

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
    """Response-aligned ``x`` ``[..., R]`` on this rank's zigzag positions: ``(local, mask)``.

    Example:
        >>> x = torch.tensor([[1.0, 2.0, 3.0]])  # 3 response tokens of a 6-token sequence
        >>> zigzag_shard_response(x, total_length=6, response_length=3, cp_size=2, cp_rank=1)
        (tensor([[1., 2., 3., 0.]]), tensor([ True,  True,  True, False]))
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
    """Inverse of :func:`zigzag_shard_response`: ``[..., R]`` on every rank (one ``all_gather``).

    Example:
        >>> x = torch.tensor([[1.0, 2.0, 3.0]])
        >>> local, _ = zigzag_shard_response(
        ...     x, total_length=6, response_length=3, cp_size=1, cp_rank=0)
        >>> local
        tensor([[0., 0., 1., 2., 3., 0.]])
        >>> zigzag_unshard_response(local, group=None, total_length=6, response_length=3)
        tensor([[1., 2., 3.]])
    """
    start = _response_start(total_length, response_length)
    full = zigzag_unshard(local, group=group, length=total_length)
    out = full[..., max(start, 0) : total_length - 1]
    if start < 0:
        out = F.pad(out, (1, 0))
    return out


def check_length_pair(
    total_length: object,
    response_length: object,
    total_name: str = "total_length",
    response_name: str = "response_length",
) -> tuple[int, int]:
    """Both ints (numpy, 0-dim tensors too) with ``1 <= response_length <= total_length``."""
    total, response = as_int(total_name, total_length), as_int(response_name, response_length)
    if not 1 <= response <= total:
        raise ValueError(
            f"{response_name} must be in [1, {total_name}], got {response} with "
            f"{total_name} = {total}"
        )
    return total, response


def check_lengths(total_lengths: Sequence[int], response_lengths: Sequence[int]) -> None:
    """One pair per sample, each valid (see :func:`check_length_pair`)."""
    _ragged.check_counts(total_lengths=total_lengths, response_lengths=response_lengths)
    for i, (t, r) in enumerate(zip(total_lengths, response_lengths)):
        check_length_pair(t, r, f"total_lengths[{i}]", f"response_lengths[{i}]")


def check_samples(tensor_lists: Sequence[str], **per_sample: Any) -> list[list[torch.Tensor]]:
    """slime's per-sample lists checked under their names; the tensor lists, in order."""
    lists = {name: _ragged.as_1d_list(name, per_sample[name]) for name in tensor_lists}
    _ragged.check_counts(**{**per_sample, **lists})
    check_lengths(per_sample["total_lengths"], per_sample["response_lengths"])
    return [lists[name] for name in tensor_lists]


def held_response_index(
    total_length: int,
    response_length: int,
    cp_size: int,
    cp_rank: int,
    seq_len: int | None = None,
) -> tuple[torch.Tensor, int]:
    """The response indices this rank holds (local order) and how many in chunk 1."""
    total_length, response_length = check_length_pair(total_length, response_length)
    if cp_size == 1:
        return torch.arange(response_length), response_length
    length = total_length if seq_len is None else seq_len
    if length < total_length:
        raise ValueError(f"max_token_len {length} is shorter than total_length {total_length}")
    # Each position of the whole sequence: the response index whose log-prob it holds, and
    # whether it holds one (the response offset is zigzag_shard_response's); then the zigzag
    # shard of that sequence, padded to the format's length.
    ids, held = zigzag_shard_response(
        torch.arange(response_length),
        total_length=total_length,
        response_length=response_length,
        cp_size=1,
        cp_rank=0,
    )
    both = torch.stack([ids, held.long()])[:, :total_length]
    ids, held = zigzag_shard(
        F.pad(both, (0, length - total_length)), cp_size=cp_size, cp_rank=cp_rank
    )
    held = held.bool()
    return ids[held], int(held[: held.numel() // 2].sum())


def local_columns(
    total_lengths: Sequence[int],
    response_lengths: Sequence[int],
    cp_size: int,
    cp_rank: int,
) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """``(held, columns, 2C)``: each sample's held indices and its ``[B, 2C]`` columns."""
    check_lengths(total_lengths, response_lengths)
    chunk = max((-(-t // (2 * cp_size)) for t in total_lengths), default=1)
    held, cols = [], []
    for total, response in zip(total_lengths, response_lengths):
        idx, n_first = held_response_index(total, response, cp_size, cp_rank)
        held.append(idx)
        cols.append(torch.cat([torch.arange(n_first), chunk + torch.arange(idx.numel() - n_first)]))
    return held, cols, 2 * chunk


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group; the backward sums the gradients over the group too."""

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
    """The whole response on every CP rank from the compact pieces (differentiable).

    Example:
        >>> all_gather_with_cp(torch.tensor([1.0, 2.0]), 7, 2)
        tensor([1., 2.])
    """
    check_length_pair(total_length, response_length)
    rank, size = group_rank_size(cp_group, "cp_group")
    if size == 1:
        return tensor
    held, _ = held_response_index(total_length, response_length, size, rank)
    if tensor.shape[0] != held.numel():
        raise ValueError(
            f"tensor holds {tensor.shape[0]} tokens but this rank's piece of a response of "
            f"{response_length} (total {total_length}) has {held.numel()}"
        )
    full = place_runs(tensor, runs(held), response_length)
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
    """This rank's compact piece of a whole-response tensor or list.

    Example:
        >>> slice_log_prob_with_cp([0.1, 0.2, 0.3], 8, 3)
        [0.1, 0.2, 0.3]
    """
    total_length, response_length = check_length_pair(total_length, response_length)
    if len(log_prob) != response_length:
        raise ValueError(f"log_prob has {len(log_prob)} entries, expected {response_length}")
    check_choice("qkv_format", qkv_format, ("thd", "bshd"))
    if qkv_format == "bshd" and max_token_len is None:
        raise ValueError("max_token_len must be given for qkv_format='bshd'")
    rank, size = group_rank_size(cp_group, "cp_group")
    if size == 1:
        return log_prob
    seq_len = max_token_len if qkv_format == "bshd" else None
    held, _ = held_response_index(total_length, response_length, size, rank, seq_len)
    if isinstance(log_prob, list):
        return [log_prob[i] for i in held.tolist()]
    return take_runs(log_prob, runs(held))


def add_outcome_rewards(
    token_level_rewards, rewards, total_lengths, response_lengths, *, cp_group=None
) -> list[torch.Tensor]:
    """Each outcome reward added to the last response token, on the CP rank that holds it.

    Example:
        >>> add_outcome_rewards([torch.zeros(3)], [1.0], [8], [3])
        [tensor([0., 0., 1.])]
    """
    (xs,) = check_samples(
        ("token_level_rewards",),
        token_level_rewards=token_level_rewards,
        rewards=rewards,
        total_lengths=total_lengths,
        response_lengths=response_lengths,
    )
    if not xs:
        return []
    dtype = functools.reduce(torch.promote_types, [x.dtype for x in xs])
    device = xs[0].device
    rank, size = group_rank_size(cp_group, "cp_group")
    # A reward is added as a Python number (rounded to the tokens' dtype first, as slime's
    # tensor of rewards is) or as a one-element slice of rewards already on the device: no
    # index tensor, no copy of host data to the device.
    on_device = isinstance(rewards, torch.Tensor) and rewards.device == device
    if on_device:
        scores: list[Any] = list(rewards.to(dtype).reshape(-1, 1).unbind(0))
    else:
        scores = torch.as_tensor(rewards, device="cpu").to(dtype).reshape(-1).tolist()
    out = []
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
            hit = (held == response_lengths[i] - 1).nonzero()  # (a CPU index: host data)
            local = int(hit[0, 0]) if hit.numel() else -1
        y = x.to(dtype=dtype, copy=True)
        if local >= 0:
            y[local : local + 1] += scores[i]
        out.append(y)
    return out


def response_values(
    logits: torch.Tensor,
    total_lengths: Sequence[int],
    response_lengths: Sequence[int],
    *,
    allgather_cp: bool = False,
    cp_group=None,
) -> list[torch.Tensor]:
    """The value head ``[1, T, 1]`` at each sample's response positions, as slime's."""
    check_lengths(total_lengths, response_lengths)
    for i, (t, r) in enumerate(zip(total_lengths, response_lengths)):
        if r == t:
            raise ValueError(
                f"response_lengths[{i}] = total_lengths[{i}] = {t}: response token 0 has no "
                "value position (the value at position p is read for token p + 1)"
            )
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() != 3 or logits.shape[0] != 1 or logits.shape[2] != 1:
        raise ValueError(
            f"logits must have shape [1, T, 1] (a value head), got {list(logits.shape)}"
        )
    rank, size = group_rank_size(cp_group, "cp_group")
    packed = size == 1 or allgather_cp
    # Each sample's response positions in the layout, on the host: one run packed, one per
    # zigzag chunk with CP (read by slicing: no index tensor on the device).
    spans, counts, base = [], [], 0
    for total, response in zip(total_lengths, response_lengths):
        mask = zigzag_response_mask(
            total, response, cp_size=1 if packed else size, cp_rank=0 if packed else rank
        )
        mask = mask[:total] if packed else mask
        spans.append([(base + a, base + b) for a, b in runs(mask.nonzero().flatten())])
        counts.append(int(mask.sum()))
        base += mask.numel()
    local = logits.shape[1]
    column = logits[0, :, 0]
    if not packed or size == 1:
        end = max((b for s in spans for _, b in s), default=0)
        if end > local:
            raise ValueError(f"logits hold {local} positions but the samples' layout needs {end}")
        return [take_runs(column, s) for s in spans]
    # allgather_cp: this rank's part of the packed sequence is [offset, offset + local): each
    # response's positions there are taken, the others are zeros; one sum over the group, then
    # the pieces are re-sliced to the zigzag layout.
    offset = rank * local
    # (column[:0]: every rank's sum depends on its logits, so every rank joins the backward's
    # all-reduce, holding a response position or not)
    pieces, zeros = [column[:0]], 0
    for a, b in (span for s in spans for span in s):
        lo, hi = max(a, offset), min(b, offset + local)
        if lo >= hi:
            zeros += b - a
            continue
        zeros += lo - a
        if zeros:
            pieces.append(column.new_zeros(zeros))
        pieces.append(column[lo - offset : hi - offset])
        zeros = b - hi
    if zeros:
        pieces.append(column.new_zeros(zeros))
    full = _AllReduceSum.apply(torch.cat(pieces), cp_group)
    out = []
    for piece, total, response in zip(full.split(counts), total_lengths, response_lengths):
        held, _ = held_response_index(total, response, size, rank)
        # a response filling its whole sequence has no position for token 0: held skips it
        out.append(take_runs(piece, runs(held - (response - piece.numel()))))
    return out
