"""Input validation shared by every public function.

Errors name the argument and what was expected. Checks on tensor *values* (a discount in
[0, 1], a 0/1 mask) need to read the data; on CPU that costs one cheap reduction and no device
synchronisation, so they always run there. On accelerators they would stall the stream, so they
run only when ``RLOPS_CHECK_VALUES=1`` is set in the environment.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

__all__ = [
    "as_float_tensor",
    "check_chunk_size",
    "check_indicator",
    "check_method",
    "check_same_device",
    "check_shape",
    "check_unit_interval",
    "compute_dtype",
    "shape_error",
    "values_checked",
]


def shape_error(name: str, expected: str, got: Sequence[int]) -> ValueError:
    """The one shape-error message: ``<name> must have shape <expected>, got [..]``."""
    return ValueError(f"{name} must have shape {expected}, got {list(got)}")


def values_checked(t: torch.Tensor) -> bool:
    """Whether checks that read ``t``'s values run (always on CPU; opt-in elsewhere)."""
    return t.device.type == "cpu" or os.environ.get("RLOPS_CHECK_VALUES", "0") == "1"


def as_float_tensor(name: str, x: object) -> torch.Tensor:
    """Return ``x`` if it is a floating-point tensor, else raise ``TypeError`` naming ``name``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(
            f"{name} must be a floating-point tensor (float16/bfloat16/float32/float64), "
            f"got {x.dtype}"
        )
    return x


def check_shape(name: str, t: torch.Tensor, shape: Sequence[int], expected: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise shape_error(name, expected, t.shape)


def check_same_device(ref_name: str, ref: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            raise ValueError(
                f"{name} is on {t.device} but {ref_name} is on {ref.device}; "
                "all tensors must be on one device"
            )


def check_unit_interval(name: str, value: float | torch.Tensor) -> None:
    """Raise ``ValueError`` unless every entry of ``value`` lies in [0, 1] (NaN is rejected)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
        raise TypeError(f"{name} must be a float or a tensor, got {type(value).__name__}")
    if isinstance(value, torch.Tensor):
        if value.is_complex():
            raise TypeError(f"{name} must be a real tensor, got {value.dtype}")
        if values_checked(value) and value.numel() > 0:
            v = value.double()
            if bool(((v < 0) | (v > 1) | v.isnan()).any()):
                bad = v[(v < 0) | (v > 1) | v.isnan()][0].item()
                raise ValueError(f"{name} must lie in [0, 1], got a value {bad}")
        return
    if not 0.0 <= float(value) <= 1.0:  # also False for NaN
        raise ValueError(f"{name} must lie in [0, 1], got {value}")


def check_indicator(name: str, t: torch.Tensor | None, shape: Sequence[int]) -> None:
    """A 0/1 indicator tensor (``mask``, ``dones``): bool, integer or floating, of ``shape``."""
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.is_complex():
        raise TypeError(f"{name} must be bool, integer or floating 0/1, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise shape_error(name, "[B, T] like rewards " + str(list(shape)), t.shape)
    if t.dtype != torch.bool and values_checked(t) and t.numel() > 0:
        if t.is_floating_point():
            bad = bool((t * (1 - t)).any())  # nonzero unless 0 or 1 (NaN and inf too)
        else:
            lo, hi = torch.aminmax(t)
            bad = bool(lo < 0) or bool(hi > 1)
        if bad:
            raise ValueError(f"{name} must hold only 0 and 1 (or be bool)")


def check_method(method: str, allowed: Sequence[str]) -> None:
    if method not in allowed:
        raise ValueError(f"method must be one of {list(allowed)}, got {method!r}")


def check_chunk_size(chunk_size: int | None) -> None:
    if chunk_size is None:
        return
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size must be an int or None, got {type(chunk_size).__name__}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype we accumulate in: float32 for half types, else the input's own."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
