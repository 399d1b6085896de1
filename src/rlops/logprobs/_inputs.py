"""Argument checks, process-group facts and the default chunk size shared by the log-prob ops."""

from __future__ import annotations

import math

import torch

from rlops._checks import as_float_tensor, shape_error, values_checked

__all__ = [
    "check_flags",
    "check_keep_mask",
    "check_logits",
    "check_target",
    "check_target_range",
    "check_temperature",
    "default_chunk",
]

# Bytes of one ``[chunk, V_local]`` float32 temporary when ``chunk_size`` is None. On CPU a
# chunk that stays in cache makes every pass over it cheap (measured fastest at 1-4 MiB); on
# accelerators bigger chunks amortise kernel launches while keeping temporaries bounded.
_CHUNK_BYTES_CPU = 4 << 20
_CHUNK_BYTES_DEVICE = 128 << 20
# The fused linear op re-reads the weight once per chunk, so it wants taller chunks on CPU.
_LINEAR_CHUNK_BYTES_CPU = 32 << 20


def default_chunk(
    n_tokens: int, v_local: int, device: torch.device, *, linear: bool = False
) -> int:
    """Tokens per chunk so that a ``[chunk, v_local]`` float32 buffer stays near the budget."""
    if device.type == "cpu":
        budget = _LINEAR_CHUNK_BYTES_CPU if linear else _CHUNK_BYTES_CPU
    else:
        budget = _CHUNK_BYTES_DEVICE
    return max(1, min(max(n_tokens, 1), budget // (4 * max(v_local, 1))))


def check_logits(name: str, x: object, ndim: int | None = None) -> torch.Tensor:
    x = as_float_tensor(name, x)
    if x.is_complex():
        raise TypeError(f"{name} must be a real floating-point tensor, got {x.dtype}")
    if ndim is not None and x.dim() != ndim:
        raise shape_error(name, "[N, H]" if ndim == 2 else f"{ndim} dims", x.shape)
    if x.dim() < 1:
        raise shape_error(name, "[..., V_local]", x.shape)
    return x


def check_target(target: object, shape: torch.Size, expected: str) -> torch.Tensor:
    """An integer tensor of ``shape`` (its values: :func:`check_target_range`), as int64."""
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype == torch.bool or target.is_floating_point() or target.is_complex():
        raise TypeError(f"target must be an integer tensor of vocabulary ids, got {target.dtype}")
    if tuple(target.shape) != tuple(shape):
        raise shape_error("target", expected, target.shape)
    return target.long()


def check_target_range(target: torch.Tensor, vocab: int) -> None:
    """Every id lies in ``[0, vocab)`` (read on CPU only, see :func:`values_checked`)."""
    if values_checked(target) and target.numel() > 0:
        lo, hi = torch.aminmax(target)
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"target must hold vocabulary ids in [0, {vocab}) (the full vocabulary: "
                f"the sum of V_local over the group), got {bad}"
            )


def check_temperature(temperature: object) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a float, got {type(temperature).__name__}")
    t = float(temperature)
    if not (t > 0 and math.isfinite(t)):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    return t


def check_keep_mask(keep_mask: object, logits: torch.Tensor) -> torch.Tensor | None:
    if keep_mask is None:
        return None
    if not isinstance(keep_mask, torch.Tensor):
        raise TypeError(f"keep_mask must be a bool tensor or None, got {type(keep_mask).__name__}")
    if keep_mask.dtype != torch.bool:
        raise TypeError(f"keep_mask must be a bool tensor, got {keep_mask.dtype}")
    if keep_mask.shape != logits.shape:
        raise shape_error(
            "keep_mask", f"[..., V_local] like logits {list(logits.shape)}", keep_mask.shape
        )
    return keep_mask


def check_flags(**flags: object) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
