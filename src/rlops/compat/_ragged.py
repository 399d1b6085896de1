"""Per-sample lists of 1-D tensors <-> one padded ``[B, T_max]`` batch.

The only Python loops here run over samples (to read lengths and to cut views), never over
tokens: the data goes in with one ``pad_sequence`` (or one indexed scatter for the
context-parallel layout) and comes back as row views (or one indexed gather).
"""

from __future__ import annotations

from collections.abc import Sequence, Sized

import torch
from torch.nn.utils.rnn import pad_sequence

__all__ = ["as_1d_list", "check_counts", "pad", "place", "split", "take"]


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
    """Each argument has one entry per sample (the same length); returns that length.

    ``zip`` would silently drop the extra entries of a longer list; this names them instead.
    """
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


def place(
    xs: list[torch.Tensor], cols: list[torch.Tensor], width: int, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Scatter ``xs[b]`` to columns ``cols[b]`` of row ``b`` of a zero ``[B, width]`` batch.

    Returns ``(batch, mask, index)``; ``index`` (rows, cols) reads the pieces back in order with
    :func:`take`.
    """
    for i, (x, c) in enumerate(zip(xs, cols)):
        if x.numel() != c.numel():
            raise ValueError(
                f"sample {i} holds {x.numel()} tokens on this rank, but its lengths give "
                f"{c.numel()} (a list entry that is not this rank's piece of the response?)"
            )
    device = xs[0].device if xs else torch.device("cpu")
    dtype = dtype or (xs[0].dtype if xs else torch.float32)
    rows = torch.repeat_interleave(
        torch.arange(len(xs), device=device),
        torch.as_tensor([x.numel() for x in xs], dtype=torch.long, device=device),
    )
    col = torch.cat(cols).to(device) if cols else torch.zeros(0, dtype=torch.long, device=device)
    batch = torch.zeros(len(xs), width, dtype=dtype, device=device)
    mask = torch.zeros(len(xs), width, dtype=torch.bool, device=device)
    if xs:
        batch[rows, col] = torch.cat(xs).to(dtype)
        mask[rows, col] = True
    return batch, mask, (rows, col)


def take(
    batch: torch.Tensor, index: tuple[torch.Tensor, torch.Tensor], lengths: Sequence[int]
) -> list[torch.Tensor]:
    """Inverse of :func:`place`: the placed entries of each row, as a list of 1-D tensors."""
    return list(batch[index].split(list(lengths)))
