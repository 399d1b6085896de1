"""Per-sample lists of 1-D tensors <-> one padded ``[B, T_max]`` batch with a mask.

The only Python loops here run over samples (to read lengths and to place pieces), never over
tokens; the data moves in one ``pad_sequence`` / one boolean gather each way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

__all__ = ["as_1d_list", "lengths_mask", "pad", "place", "split", "take"]


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


def lengths_mask(lengths: Sequence[int], t_max: int, device: torch.device) -> torch.Tensor:
    """Bool ``[B, t_max]``: True on the first ``lengths[b]`` entries of row ``b``."""
    n = torch.as_tensor(list(lengths), dtype=torch.long, device=device)
    return torch.arange(t_max, device=device) < n[:, None]


def pad(xs: list[torch.Tensor], t_max: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad 1-D tensors with zeros into ``[B, T_max]``; return ``(padded, mask)``."""
    lengths = [x.numel() for x in xs]
    padded = pad_sequence(xs, batch_first=True)
    width = max(lengths, default=0) if t_max is None else t_max
    if padded.shape[1] < width:
        padded = torch.nn.functional.pad(padded, (0, width - padded.shape[1]))
    return padded, lengths_mask(lengths, width, padded.device)


def split(padded: torch.Tensor, mask: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    """Inverse of :func:`pad`: the mask-1 entries of each row, as a list of 1-D tensors."""
    return list(padded[mask].split(list(lengths)))


def place(
    xs: list[torch.Tensor], cols: list[torch.Tensor], width: int, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Scatter ``xs[b]`` to columns ``cols[b]`` of row ``b`` of a zero ``[B, width]`` batch.

    Returns ``(batch, mask, index)``; ``index`` (rows, cols) reads the pieces back in order with
    :func:`take`.
    """
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
