"""Argument checks, process-group facts and the default chunk size shared by the log-prob ops."""

from __future__ import annotations

from typing import cast

import torch

from rlops._checks import (
    as_float_tensor,
    compute_dtype,
    is_finite,
    is_nan,
    shape_error,
    values_checked,
)
from rlops.logprobs._support import Sampler, TopK, TopP

__all__ = [
    "check_flags",
    "check_keep_mask",
    "check_logits",
    "check_row_mask",
    "check_sampler",
    "check_support",
    "check_support_range",
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
) -> int | None:
    """Tokens per chunk so that a ``[chunk, v_local]`` float32 buffer stays near the budget.

    While ``torch.compile`` traces: None, one chunk of every token, so that the graph does not
    depend on how many chunks a length makes (no recompile per length under ``dynamic=True``);
    an explicit ``chunk_size`` still bounds the chunks there.
    """
    if torch.compiler.is_compiling():
        return None
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


def check_target(target: object, shape: tuple[int, ...], like: str) -> torch.Tensor:
    """An integer tensor of ``shape``, the leading shape of ``like`` (its values:
    :func:`check_target_range`), as int64. The message is built only on failure (under
    ``torch.compile`` the shape may be symbolic)."""
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype == torch.bool or target.is_floating_point() or target.is_complex():
        raise TypeError(f"target must be an integer tensor of vocabulary ids, got {target.dtype}")
    if tuple(target.shape) != tuple(shape):
        raise shape_error("target", f"[...] like {like}[..., 0] {list(shape)}", target.shape)
    return target.long()


def check_target_range(target: torch.Tensor, vocab: int) -> None:
    """Every id lies in ``[0, vocab)`` (read on CPU only, see :func:`values_checked`)."""
    if values_checked(target) and target.numel() > 0:
        lo, hi = (int(v) for v in torch.aminmax(target))
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
    if not (t > 0 and is_finite(t)):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    return t


def _bool_tensor(
    name: str, value: object, shape: tuple[int, ...], dtype_hint: str, expected: str
) -> torch.Tensor | None:
    """None, or ``value`` as a bool tensor of ``shape``; else the error naming ``name`` (with
    ``dtype_hint`` after "bool tensor" for a wrong dtype, ``expected`` for a wrong shape)."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a bool tensor or None, got {type(value).__name__}")
    if value.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor{dtype_hint}, got {value.dtype}")
    if tuple(value.shape) != tuple(shape):
        raise shape_error(name, expected, value.shape)
    return value


def check_keep_mask(
    keep_mask: object, shape: tuple[int, ...], like: str = "logits"
) -> torch.Tensor | None:
    """None, or a bool tensor of the logits' ``shape`` (``like`` names them in the error)."""
    expected = f"[..., V_local] like {like} {list(shape)}"
    return _bool_tensor("keep_mask", keep_mask, shape, "", expected)


def check_row_mask(mask: object, shape: tuple[int, ...], like: str) -> torch.Tensor | None:
    """None, or a bool tensor ``[...]`` of the target's ``shape`` (the rows the loss reads)."""
    expected = f"[...] like target {list(shape)} ({like})"
    return _bool_tensor("mask", mask, shape, " [...] like target", expected)


_INDEX_DTYPES = (torch.int32, torch.int64)


def check_support(ids: object, offsets: object, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """None, or a CSR support ``(support_ids [nnz], support_offsets [n + 1])``, int32/int64:
    both given, 1-D, and (values, on CPU: :func:`values_checked`) offsets non-decreasing from 0
    to ``nnz``. The ids' range is :func:`check_support_range`'s, once the vocabulary is known."""
    if ids is None and offsets is None:
        return None
    if ids is None or offsets is None:
        given, missing = ("support_ids", "support_offsets")[:: 1 if ids is not None else -1]
        raise ValueError(f"{given} needs {missing}: a CSR support is the two together")
    for name, t in (("support_ids", ids), ("support_offsets", offsets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be an int32/int64 tensor, got {type(t).__name__}")
        if t.dtype not in _INDEX_DTYPES:
            raise TypeError(f"{name} must be an int32 or int64 tensor, got {t.dtype}")
    assert isinstance(ids, torch.Tensor) and isinstance(offsets, torch.Tensor)
    if ids.dim() != 1:
        raise shape_error("support_ids", "[nnz]", ids.shape)
    if tuple(offsets.shape) != (n + 1,):
        raise shape_error("support_offsets", f"[N + 1] = [{n + 1}] (N = target.numel())",
                          offsets.shape)  # fmt: skip
    if values_checked(offsets):
        o = offsets.long()
        first, last = int(o[0]), int(o[-1])
        if first != 0:
            raise ValueError(f"support_offsets must start at 0, got {first}")
        if last != ids.numel():
            raise ValueError(
                f"support_offsets must end at nnz = support_ids.numel() = {ids.numel()}, got {last}"
            )
        if n > 0 and bool((o[1:] < o[:-1]).any()):
            at = int((o[1:] < o[:-1]).nonzero()[0, 0])
            raise ValueError(
                f"support_offsets must be non-decreasing, got {int(o[at])} then "
                f"{int(o[at + 1])} at {at}"
            )
    return ids, offsets


def check_support_range(ids: torch.Tensor, vocab: int) -> None:
    """Every CSR id lies in ``[0, vocab)`` (read on CPU only, see :func:`values_checked`)."""
    if values_checked(ids) and ids.numel() > 0:
        lo, hi = (int(v) for v in torch.aminmax(ids))
        if lo < 0 or hi >= vocab:
            raise ValueError(
                f"support_ids must hold vocabulary ids in [0, {vocab}) (the full vocabulary), "
                f"got {lo if lo < 0 else hi}"
            )


def check_flags(**flags: object) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def _check_sampler_tensor(
    name: str, t: torch.Tensor, lead: torch.Size, integer: bool, dtype: torch.dtype, like: str
) -> torch.Tensor:
    if integer and (t.dtype == torch.bool or t.is_floating_point() or t.is_complex()):
        raise TypeError(f"{name} must be an int or an integer tensor, got {t.dtype}")
    if not integer and not t.is_floating_point():
        raise TypeError(f"{name} must be a float or a floating-point tensor, got {t.dtype}")
    if tuple(t.shape) != tuple(lead):
        raise shape_error(name, f"[...] like {like}[..., 0] {list(lead)}", t.shape)
    return t.reshape(-1).to(torch.long if integer else dtype)


def check_sampler(
    top_k: object, top_p: object, min_p: object, logits: torch.Tensor, like: str = "logits"
) -> Sampler | None:
    """The sampler's filters, checked: a :class:`Sampler` of Python numbers or flattened ``[N]``
    tensors (int64; the compute dtype), or None when all three are None.

    ``top_k`` ``≥ 1``; ``top_p`` in ``(0, 1]``; ``min_p`` in ``[0, 1]``. A tensor's values are
    checked on CPU only (:func:`values_checked`); a scalar's always.
    """
    if top_k is None and top_p is None and min_p is None:
        return None
    lead = logits.shape[:-1]
    dtype = compute_dtype(logits.dtype)
    out: list[int | float | torch.Tensor | None] = []
    for name, x in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
        integer = name == "top_k"
        if x is None:
            out.append(None)
            continue
        if isinstance(x, torch.Tensor):
            t = _check_sampler_tensor(name, x, lead, integer, dtype, like)
            if values_checked(t) and t.numel() > 0:
                lo, hi = (int(v) if integer else float(v) for v in torch.aminmax(t))
                bad = bool(t.isnan().any().item()) if not integer else False
                _check_sampler_range(name, lo, hi, bad)
            out.append(t)
            continue
        if isinstance(x, bool) or not isinstance(x, (int, float) if not integer else int):
            kind = "an int" if integer else "a float"
            raise TypeError(f"{name} must be {kind}, a tensor or None, got {type(x).__name__}")
        value = int(x) if integer else float(x)
        _check_sampler_range(name, value, value, is_nan(value) if not integer else False)
        out.append(value)
    k, p, m = out  # top_k: an int or int64; top_p, min_p: floats or the compute dtype
    return Sampler(cast(TopK, k), cast(TopP, p), cast(TopP, m))


def _check_sampler_range(name: str, lo: float, hi: float, nan: bool) -> None:
    if name == "top_k":
        if lo < 1:
            raise ValueError(f"top_k must be >= 1 (V or more keeps every token), got {lo}")
    elif name == "top_p":
        if nan or lo <= 0 or hi > 1:
            bad = "nan" if nan else (lo if lo <= 0 else hi)
            raise ValueError(f"top_p must lie in (0, 1] (1 keeps every token), got {bad}")
    elif nan or lo < 0 or hi > 1:
        bad = "nan" if nan else (lo if lo < 0 else hi)
        raise ValueError(f"min_p must lie in [0, 1] (0 keeps every token), got {bad}")
