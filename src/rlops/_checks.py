"""Input validation shared by every public function: the one place where arguments are checked.

Errors name the argument and what was expected. Checks on tensor *values* (a discount in
[0, 1], a 0/1 mask) need to read the data; on CPU that costs one cheap reduction and no device
synchronisation, so they always run there. On accelerators they would stall the stream, so they
run only when ``RLOPS_CHECK_VALUES=1`` is set in the environment.

Scalar parameters (``gamma``, ``eps``, clip ranges, ...) accept Python numbers, numpy scalars
(``np.float32`` as verl passes them) and 0-dim tensors (read once, on the host).
"""

from __future__ import annotations

import numbers
import operator
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import SupportsIndex, cast, overload

import torch


def shape_error(name: str, expected: str, got: Sequence[int]) -> ValueError:
    """The one shape-error message: ``<name> must have shape <expected>, got [..]``."""
    return ValueError(f"{name} must have shape {expected}, got {list(got)}")


def values_checked(t: torch.Tensor) -> bool:
    """Whether checks that read ``t``'s values run: always on CPU, opt-in elsewhere, and never
    while ``torch.compile`` traces (a value read would break the graph; shape, dtype and
    argument checks still run)."""
    if torch.compiler.is_compiling():
        return False
    return t.device.type == "cpu" or os.environ.get("RLOPS_CHECK_VALUES", "0") == "1"


def read_value(t: torch.Tensor) -> float | None:
    """A 0-dim tensor's value where checks read values (see :func:`values_checked`); None
    elsewhere (no host synchronisation) and on the meta device (no value to read)."""
    if t.device.type == "meta" or not values_checked(t):
        return None
    return float(t)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype we accumulate in: float32 for half types, else the input's own."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without the call where ``t`` has it already: a no-op ``.to`` is still a
    dispatch, tens of microseconds when the caches are cold (after a large operation)."""
    return t if t.dtype == dtype else t.to(dtype)


# --------------------------------------------------------------------------- tensors
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


def as_tensor(name: str, x: object, min_dim: int = 1) -> torch.Tensor:
    """Any tensor with at least ``min_dim`` dimensions (e.g. a sequence dimension)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dimension(s), got {x.dim()}")
    return x


def check_2d(name: str, x: object) -> torch.Tensor:
    """A floating ``[B, T]`` tensor."""
    x = as_float_tensor(name, x)
    if x.dim() != 2:
        raise shape_error(name, "[B, T]", x.shape)
    return x


def check_matrix(name: str, x: object) -> tuple[int, int]:
    """A ``[B, T]`` tensor of any dtype (its values are checked elsewhere); returns ``(B, T)``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise shape_error(name, "[B, T]", x.shape)
    return x.shape[0], x.shape[1]


def check_per_row(name: str, x: torch.Tensor, b: int, t: int, like: str = "mask") -> int:
    """A tensor of shape ``[B]`` (one value per row) or ``[B, T]`` (per token); returns its
    number of dimensions."""
    if tuple(x.shape) not in ((b,), (b, t)):
        raise shape_error(name, f"[B] = {[b]} or [B, T] = {[b, t]} like {like}", x.shape)
    return x.dim()


def check_ids(name: str, x: object, shape: Sequence[int], like: str) -> torch.Tensor:
    """An integer tensor of ids (e.g. one group id per row) of exactly ``shape``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor of ids, got {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        raise shape_error(name, f"{list(shape)} like {like}", x.shape)
    return x


def check_same_shape(ref_name: str, ref: torch.Tensor, **others: object) -> None:
    """Each of ``others`` is a floating tensor of ``ref``'s shape, on ``ref``'s device."""
    for name, t in others.items():
        t = as_float_tensor(name, t)
        if t.shape != ref.shape:
            raise shape_error(name, f"{list(ref.shape)} like {ref_name}", t.shape)
    check_same_device(ref_name, ref, **others)


def check_same_device(ref_name: str, ref: torch.Tensor, **others: object) -> None:
    for name, t in others.items():
        if isinstance(t, torch.Tensor) and t.device != ref.device:
            raise ValueError(
                f"{name} is on {t.device} but {ref_name} is on {ref.device}; "
                "all tensors must be on one device"
            )


def check_indicator(name: str, t: object, shape: Sequence[int], like: str = "rewards") -> None:
    """A 0/1 indicator tensor (``mask``, ``dones``) or None: bool, integer or floating 0/1, of
    exactly ``shape`` (the shape of argument ``like``)."""
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.is_complex():
        raise TypeError(f"{name} must be bool, integer or floating 0/1, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise shape_error(name, f"{list(shape)} like {like}", t.shape)
    if t.dtype != torch.bool and values_checked(t) and t.numel() > 0:
        if t.is_floating_point():
            bad = bool((t * (1 - t)).any())  # nonzero unless 0 or 1 (NaN and inf too)
        else:
            lo, hi = torch.aminmax(t)
            bad = bool(lo < 0) or bool(hi > 1)
        if bad:
            raise ValueError(f"{name} must hold only 0 and 1 (or be bool)")


def as_bool_mask(
    name: str, mask: object, shape: Sequence[int], like: str, ref: torch.Tensor | None = None
) -> torch.Tensor:
    """A required 0/1 ``mask`` of exactly ``shape`` (on ``ref``'s device), returned as bool.

    Its values are read once (on CPU, see the module docstring); a bool mask needs no such pass.
    """
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    check_indicator(name, mask, shape, like)
    if ref is not None:
        check_same_device(like, ref, **{name: mask})
    return mask if mask.dtype == torch.bool else mask != 0


# --------------------------------------------------------------------------- scalars
def is_nan(v: float) -> bool:
    """``math.isnan`` as a comparison: Dynamo folds it on a constant (with ``dynamic=True`` it
    does not fold ``math.isnan``, which then breaks a ``fullgraph`` trace)."""
    return v != v


def is_finite(v: float) -> bool:
    """``math.isfinite`` as arithmetic (``inf − inf`` and NaN are not 0): see :func:`is_nan`."""
    return v - v == 0


def as_real(name: str, value: object) -> float:
    """A real number as a float: Python and numpy numbers, or a 0-dim real tensor."""
    if type(value) is float:  # (first: the ABC's check costs microseconds, caches cold)
        return value
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex():
        if value.dtype != torch.bool:
            return float(value)
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    kind = f"a {value.dim()}-dim tensor" if isinstance(value, torch.Tensor) else type(value)
    raise TypeError(f"{name} must be a real number, got {getattr(kind, '__name__', kind)}")


def check_positive(name: str, value: object, *, above: float = 0.0) -> float:
    """A real number ``> above``; ``inf`` is allowed (e.g. no clipping)."""
    v = as_real(name, value)
    if is_nan(v) or v <= above:
        raise ValueError(f"{name} must be > {above:g}, got {value}")
    return v


def check_nonneg(name: str, value: object) -> float:
    """A finite real number >= 0 (``eps``)."""
    v = as_real(name, value)
    if not (is_finite(v) and v >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    return v


def check_finite_positive(name: str, value: object) -> float:
    """A finite real number ``> 0``."""
    v = check_positive(name, value)
    if not is_finite(v):
        raise ValueError(f"{name} must be finite, got {value}")
    return v


def check_fraction(name: str, value: object) -> float:
    """A fraction in ``(0, 1]`` (e.g. of the action tokens)."""
    v = check_positive(name, value)
    if v > 1:
        raise ValueError(f"{name} must be in (0, 1] (a fraction of the tokens), got {value}")
    return v


def check_real(name: str, value: object) -> float:
    """A real number that is not NaN (``±inf`` allowed)."""
    v = as_real(name, value)
    if is_nan(v):
        raise ValueError(f"{name} must be a number, got nan")
    return v


def check_bounds(name: str, high: object, low_name: str, low: object) -> tuple[float | None, float]:
    """Bounds ``0 < low <= high`` (``high`` may be ``inf``; ``low=None``: no lower bound),
    returned as ``(low, high)`` floats."""
    hi = check_positive(name, high)
    if low is None:
        return None, hi
    lo = check_positive(low_name, low)
    if lo > hi:
        raise ValueError(f"{low_name} must be <= {name}, got {low_name}={lo:g} > {name}={hi:g}")
    return lo, hi


def as_int(name: str, value: object, minimum: int | None = None, *, tensor: bool = True) -> int:
    """An integer (Python, numpy, or, where ``tensor``, a 0-dim integer tensor, read on the
    host) as an ``int``, ``>= minimum``."""
    if isinstance(value, bool) or (
        isinstance(value, torch.Tensor) and (value.is_floating_point() or not tensor)
    ):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    try:  # a TypeError is the check
        # while torch.compile traces, a length it keeps symbolic stays so (index() would fix
        # its value: a recompile per length)
        symbolic = torch.compiler.is_compiling() and isinstance(value, int)
        out = cast(int, value) if symbolic else operator.index(cast(SupportsIndex, value))
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if minimum is not None and out < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {out}")
    return out


def check_bool(name: str, value: object) -> bool:
    """A Python ``bool`` (not 0/1, not a tensor: a flag decides what is computed)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_generator(name: str, value: object) -> torch.Generator | None:
    """A ``torch.Generator`` or None."""
    if value is not None and not isinstance(value, torch.Generator):
        raise TypeError(f"{name} must be a torch.Generator or None, got {type(value).__name__}")
    return value


@overload
def as_real_or_tensor(name: str, value: torch.Tensor) -> torch.Tensor: ...
@overload
def as_real_or_tensor(name: str, value: object) -> float | torch.Tensor: ...
def as_real_or_tensor(name: str, value: object) -> float | torch.Tensor:
    """A real number as a float, or a 0-dim real tensor, detached and not read (it may live on
    an accelerator: reading it would synchronise)."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise shape_error(name, "[] (a number)", value.shape)
        if value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name} must be a real tensor, got {value.dtype}")
        return value.detach()
    return as_real(name, value)


def as_real_vector(name: str, value: object, size: int, like: str) -> torch.Tensor:
    """``size`` finite real numbers (one per column of ``like``): a sequence of numbers (numpy
    scalars too) or a 1-dim real tensor. A sequence is returned as a float64 CPU tensor; a
    tensor detached, on its own device, its values checked where :func:`values_checked` reads
    them."""
    what = f"{size} finite real numbers (one per column of {like})"
    if isinstance(value, torch.Tensor):
        if value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name} must be {what}, got a {value.dtype} tensor")
        if tuple(value.shape) != (size,):
            raise shape_error(name, f"[{size}] (one per column of {like})", value.shape)
        if values_checked(value) and value.device.type != "meta" and size > 0:
            if not bool(torch.isfinite(value).all()):
                raise ValueError(f"{name} must be {what}, got {value.tolist()}")
        return value.detach()
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise TypeError(
            f"{name} must be {what} (a sequence or a [{size}] tensor), got {type(value).__name__}"
        )
    items = [as_real(f"{name}[{i}]", v) for i, v in enumerate(value)]
    if len(items) != size:
        raise shape_error(name, f"[{size}] (one per column of {like})", [len(items)])
    if not all(is_finite(v) for v in items):
        raise ValueError(f"{name} must be {what}, got {items}")
    return torch.tensor(items, dtype=torch.float64)


def check_count(
    name: str, value: object, ref: torch.Tensor | None = None
) -> float | torch.Tensor | None:
    """A count (of tokens, of rows): None, a finite number ``>= 0``, or a 0-dim real tensor
    (kept on its device, detached; its value is checked only where :func:`read_value` reads
    it). ``ref``: the tensor the count normalises, if known; a count on the meta device is
    refused unless ``ref`` is there too (it holds no value)."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        return check_nonneg(name, value)
    value = as_real_or_tensor(name, value)
    if value.device.type == "meta" and ref is not None and ref.device.type != "meta":
        raise ValueError(
            f"{name} is a tensor on the meta device, which holds no value, but the loss "
            f"inputs are on {ref.device}: pass the count as a number or a tensor on "
            f"{ref.device}"
        )
    v = read_value(value)
    if v is not None and not (is_finite(v) and v >= 0):
        raise ValueError(f"{name} must be a finite count >= 0, got {v}")
    return value


def check_unit_interval(name: str, value: object) -> float | torch.Tensor:
    """A number or a real tensor with every entry in [0, 1] (NaN is rejected).

    Returns a float for a number (numpy scalars included), else the tensor unchanged."""
    if isinstance(value, torch.Tensor):
        if value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name} must be a real floating tensor, got {value.dtype}")
        if values_checked(value) and value.numel() > 0:
            v = value.double()
            bad = (v < 0) | (v > 1) | v.isnan()
            if bool(bad.any()):
                raise ValueError(f"{name} must lie in [0, 1], got a value {v[bad][0].item()}")
        return value
    if type(value) is not float and (  # (a float first: the ABC's check costs microseconds)
        isinstance(value, bool) or not isinstance(value, numbers.Real)
    ):
        raise TypeError(f"{name} must be a float or a tensor, got {type(value).__name__}")
    if not 0.0 <= float(value) <= 1.0:  # also False for NaN
        raise ValueError(f"{name} must lie in [0, 1], got {value}")
    return float(value)


def per_row_discount(name: str, value: object, b: int, ref: torch.Tensor) -> float | torch.Tensor:
    """A discount in [0, 1] given as a number or a ``[B]`` (or ``[B, 1]``) tensor: returned as
    a float, or a ``[B, 1]`` tensor on ``ref``'s device. A 0-dim tensor is read as a number
    (one host read), so it gives exactly what the same Python float gives."""
    value = check_unit_interval(name, value)
    if not isinstance(value, torch.Tensor):
        return value
    if value.dim() == 0:
        return as_real(name, value)
    check_same_device("rewards", ref, **{name: value})
    if tuple(value.shape) not in ((b,), (b, 1)):
        raise shape_error(name, f"[B] = [{b}] (one per row), or a float", value.shape)
    return value.reshape(b, 1)


def check_choice(name: str, value: object, choices: Sequence[object]) -> str:
    """``value`` must be one of ``choices`` (a method, mode or kind name)."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value


def check_chunk_size(chunk_size: object) -> None:
    if chunk_size is None:
        return
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral):
        raise TypeError(f"chunk_size must be an int or None, got {type(chunk_size).__name__}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def check_dim(dim: object, ndim: int) -> int:
    """A valid dimension index of a tensor with ``ndim`` dims, returned non-negative."""
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    d = int(dim)
    if not -ndim <= d < ndim:
        raise ValueError(f"dim must be in [{-ndim}, {ndim - 1}] for x of {ndim} dims, got {dim}")
    return d % ndim


def _integral(name: str, v: object) -> int:
    """An integer that is not a bool (Python or numpy), as an ``int``."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    return int(v)


def check_cp_rank(cp_size: object, cp_rank: object) -> None:
    """A context-parallel world size >= 1 and a rank in [0, cp_size)."""
    size = _integral("cp_size", cp_size)
    rank = _integral("cp_rank", cp_rank)
    if size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if not 0 <= rank < size:
        raise ValueError(f"cp_rank must be in [0, {size - 1}], got {cp_rank}")


def check_logit_scale(value: object) -> float:
    """A finite ``logit_scale > 0`` as a float (TypeError / ValueError naming it)."""
    return check_finite_positive("logit_scale", value)


def check_softcap(value: object) -> float | None:
    """None (off), or a finite ``final_logit_softcapping > 0`` as a float."""
    return None if value is None else check_finite_positive("final_logit_softcapping", value)
