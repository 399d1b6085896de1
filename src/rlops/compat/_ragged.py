"""Per-sample lists of 1-D tensors <-> one padded ``[B, T_max]`` batch (loops over samples only)."""

from __future__ import annotations

from collections.abc import Sequence, Sized

import torch
from torch.nn.utils.rnn import pad_sequence


def as_1d_list(name: str, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Check that ``xs`` is a sequence of 1-D tensors; return it as a list."""
    if isinstance(xs, torch.Tensor):
        raise TypeError(f"{name} must be a list of 1-D tensors (one per sample), got a tensor")
    out = list(xs)
    for i, x in enumerate(out):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 1:
            raise ValueError(f"{name}[{i}] must be 1-D, got shape {list(x.shape)}")
    return out


def check_counts(**per_sample: Sized) -> int:
    """Each argument has one entry per sample (``zip`` would drop extras); that count."""
    counts = {name: len(x) for name, x in per_sample.items()}
    if len(set(counts.values())) > 1:
        detail = ", ".join(f"{name} has {n}" for name, n in counts.items())
        raise ValueError(f"expected one entry per sample in each list: {detail}")
    return next(iter(counts.values()), 0)


def pad(xs: list[torch.Tensor], t_max: int | None = None) -> torch.Tensor:
    """Right-pad 1-D tensors with zeros into ``[B, T_max]`` (at least ``t_max`` wide)."""
    padded = pad_sequence(xs, batch_first=True)
    if t_max is not None and padded.shape[1] < t_max:
        padded = torch.nn.functional.pad(padded, (0, t_max - padded.shape[1]))
    return padded


def split(padded: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    """Inverse of :func:`pad`: the first ``lengths[b]`` entries of each row, as views."""
    return [row[:n] for row, n in zip(padded, lengths)]


# The layout is computed on the host (CPU index tensors from Python ints); the data stays on
# the device. An index tensor moved to the device would be a host-to-device copy per call, so
# the layout's indices, a few contiguous runs (one per zigzag chunk), cut the data by slicing.
Runs = list[tuple[int, int]]


def runs(index: torch.Tensor) -> Runs:
    """The contiguous increasing runs of a CPU int64 ``index``, as ``(start, stop)`` pairs."""
    if index.numel() == 0:
        return []
    cut = ((index[1:] != index[:-1] + 1).nonzero().flatten() + 1).tolist()
    bounds = [0, *cut, index.numel()]
    first = index[bounds[:-1]].tolist()
    return [(a, a + (j - i)) for a, i, j in zip(first, bounds[:-1], bounds[1:])]


def take_runs(x: torch.Tensor, spans: Runs) -> torch.Tensor:
    """``x`` at the indices of ``spans`` along dim 0 (``index_select`` by slicing)."""
    return torch.cat([x[a:b] for a, b in spans]) if spans else x[:0].clone()


def place_runs(x: torch.Tensor, spans: Runs, size: int) -> torch.Tensor:
    """A zero ``[size, ...]`` tensor holding ``x``'s rows at ``spans``; differentiable."""
    pieces, at, read = [x[:0]], 0, 0  # (x[:0]: the result depends on x even with no run)
    for a, b in spans:
        if a < at:
            raise ValueError(f"place_runs needs increasing disjoint runs, got {spans}")
        if a > at:
            pieces.append(x.new_zeros((a - at, *x.shape[1:])))
        pieces.append(x[read : read + b - a])
        at, read = b, read + b - a
    if at < size:
        pieces.append(x.new_zeros((size - at, *x.shape[1:])))
    return torch.cat(pieces)


def place(
    xs: list[torch.Tensor], cols: list[torch.Tensor], width: int, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, list[Runs]]:
    """``xs[b]`` at columns ``cols[b]`` of a zero ``[B, width]`` batch: ``(batch, mask, runs)``."""
    for i, (x, c) in enumerate(zip(xs, cols)):
        if x.numel() != c.numel():
            raise ValueError(
                f"sample {i} holds {x.numel()} tokens on this rank, but its lengths give "
                f"{c.numel()} (a list entry that is not this rank's piece of the response?)"
            )
    device = xs[0].device if xs else torch.device("cpu")
    dtype = dtype or (xs[0].dtype if xs else torch.float32)
    index = [runs(c) for c in cols]
    if not xs:
        empty = torch.zeros(0, width, dtype=dtype, device=device)
        return empty, empty.bool(), index
    batch = torch.stack([place_runs(x.to(dtype), r, width) for x, r in zip(xs, index)])
    ones = torch.ones(max(x.numel() for x in xs), dtype=torch.bool, device=device)
    mask = torch.stack([place_runs(ones[: x.numel()], r, width) for x, r in zip(xs, index)])
    return batch, mask, index


def take(batch: torch.Tensor, index: list[Runs], lengths: Sequence[int]) -> list[torch.Tensor]:
    """Inverse of :func:`place`: the placed entries of each row, as a list of 1-D tensors."""
    out = [take_runs(row, r) for row, r in zip(batch, index)]
    for i, (x, n) in enumerate(zip(out, lengths)):
        if x.numel() != n:
            raise ValueError(f"row {i} holds {x.numel()} placed entries, expected {n}")
    return out
