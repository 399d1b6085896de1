"""The keyword options of the log-prob ops and their checks, declared once.

:class:`DistributionOptions` say which distribution a token's log-prob and entropy are taken
under; the references take them and the two output switches (:class:`ReferenceOptions`); the
public ops take them and how to compute (:class:`LogprobOptions`). :func:`checked` is this
rank's own argument checks of either op; :func:`resolve` chooses the op on logits' producer
(``method=``), which a kernel's build failure sets aside for the process (:func:`set_failed`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict, cast

import torch

import rlops._backends as _backends
from rlops._checks import (
    as_float_tensor,
    check_choice,
    check_chunk_size,
    check_logit_scale,
    check_same_device,
    check_softcap,
    compute_dtype,
    is_finite,
    is_nan,
    shape_error,
    values_checked,
)
from rlops._types import Group
from rlops.logprobs._support import Sampler, TopK, TopP

# Bytes of one ``[chunk, V_local]`` float32 temporary when ``chunk_size`` is None: on CPU a
# chunk that stays in cache (measured fastest at 1-4 MiB; the linear op re-reads the weight
# per chunk, so it wants taller ones); on accelerators bigger chunks amortise the launches.
_CHUNK_BYTES_CPU = 4 << 20
_CHUNK_BYTES_DEVICE = 128 << 20
_LINEAR_CHUNK_BYTES_CPU = 32 << 20
# Every matmul of the linear op's logits has a multiple of this many rows (batch invariance).
ROW_ALIGN = 16


class DistributionOptions(TypedDict, total=False):
    """The distribution of each token: ``logit_scale``, ``final_logit_softcapping`` and
    ``temperature`` map the logits; ``keep_mask`` or the sampler's ``top_k`` / ``top_p`` /
    ``min_p`` give the support, over which the entropy runs with ``entropy_over_support``."""

    temperature: float | torch.Tensor
    logit_scale: float
    final_logit_softcapping: float | None
    keep_mask: torch.Tensor | None
    top_k: int | torch.Tensor | None
    top_p: float | torch.Tensor | None
    min_p: float | torch.Tensor | None
    entropy_over_support: bool


class ReferenceOptions(DistributionOptions, total=False):
    """The references' keyword arguments: the distribution and the two output switches."""

    with_entropy: bool
    with_sum_pi_squared: bool


class LogprobOptions(DistributionOptions, total=False):
    """The keyword options of :func:`rlops.logprobs_and_entropy` and
    :func:`rlops.linear_logprobs_and_entropy`, beside ``with_entropy`` and
    ``with_sum_pi_squared`` (which choose the outputs) and each op's own (``method``,
    ``bias``); what each one means: ``docs/design/logprobs.md`` (Options).

    Defaults: ``temperature=1.0``, ``logit_scale=1.0``, ``entropy_over_support=False``,
    ``entropy_grad=True``, every other one None (no softcap, no support, no row mask, no
    group, the default chunk). A keyword that is none of these is a ``TypeError`` naming it.

    Example:
        >>> import torch
        >>> from rlops.logprobs import LogprobOptions, logprobs_and_entropy
        >>> options: LogprobOptions = {"temperature": 2.0, "top_k": 1}
        >>> logprobs_and_entropy(torch.tensor([[2.0, 0.0]]), torch.tensor([0]), **options)
        (tensor([0.]), tensor([0.5822]))
    """

    support_ids: torch.Tensor | None
    support_offsets: torch.Tensor | None
    mask: torch.Tensor | None
    entropy_grad: bool
    group: Group
    chunk_size: int | None
    logits_dtype: torch.dtype | None


@dataclass(frozen=True, kw_only=True)
class Options:
    """The keyword arguments of a public log-prob op, as the caller gave them (unchecked)."""

    temperature: float | torch.Tensor = 1.0
    logit_scale: float = 1.0
    final_logit_softcapping: float | None = None
    keep_mask: torch.Tensor | None = None
    support_ids: torch.Tensor | None = None
    support_offsets: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    top_k: int | torch.Tensor | None = None
    top_p: float | torch.Tensor | None = None
    min_p: float | torch.Tensor | None = None
    entropy_over_support: bool = False
    with_entropy: bool = True
    entropy_grad: bool = True
    with_sum_pi_squared: bool = False
    group: Group = None
    chunk_size: int | None = None
    logits_dtype: torch.dtype | None = None

    @classmethod
    def given(
        cls, op: str, options: LogprobOptions, *, with_entropy: bool, with_sum_pi_squared: bool
    ) -> Options:
        """The options of a call of ``op``; an unknown keyword is a ``TypeError`` naming it."""
        unknown = sorted(set(options) - set(LogprobOptions.__annotations__))
        if unknown:
            raise TypeError(
                f"{op}() got unexpected keyword argument(s) {unknown}; its options are "
                f"{sorted(LogprobOptions.__annotations__)}"
            )
        return cls(**options, with_entropy=with_entropy, with_sum_pi_squared=with_sum_pi_squared)


@dataclass(frozen=True, kw_only=True)
class Checked:
    """One op's inputs after this rank's checks: ``x`` (``logits`` or ``hidden``, named
    ``name``), the linear op's ``weight``, ``bias`` and ``hidden`` size (0 for logits), the
    int64 ``target``, the chunk, the row ``mask``, the CSR ``support``, the head's map, the
    producer ``method`` (``"chunked"`` or ``"triton"``), the checked ``sampler`` and
    ``logits_dtype`` (:func:`check_logits_dtype`: None unless it widens the inputs'); a
    per-row ``temperature`` is ``[N]`` per token, in the compute dtype."""

    name: str
    x: torch.Tensor
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    target: torch.Tensor
    keep: torch.Tensor | None
    temperature: float | torch.Tensor
    v_local: int
    chunk: int | None
    hidden: int = 0
    mask: torch.Tensor | None = None
    support: tuple[torch.Tensor, torch.Tensor] | None = None
    logit_scale: float = 1.0
    softcap: float | None = None
    method: str = "chunked"
    sampler: Sampler | None = None
    logits_dtype: torch.dtype | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The call's compute dtype: the statistics', the outputs' and the scaled logits'."""
        return compute_dtype(self.x.dtype) if self.logits_dtype is None else self.logits_dtype


METHODS = ("auto", "chunked", "triton")


def triton_available() -> bool:
    """Whether triton can be imported."""
    return _backends.triton_importable()


def failed() -> str | None:
    """The error that set the triton backend aside in this process, or None."""
    return _backends.failed("triton")


def resolve(method: object, x: torch.Tensor) -> str:
    """The producer of a call on the logits ``x``: ``"chunked"`` or ``"triton"``; ``"triton"``
    where it cannot run raises ValueError saying why (after a build failure: chunked)."""
    check_choice("method", method, METHODS)
    if method == "chunked":
        return "chunked"
    if method == "auto":
        usable = (
            _backends.auto_triton(x.device)
            and failed() is None
            and not torch.compiler.is_compiling()
            and triton_available()
        )
        return "triton" if usable else "chunked"
    if not triton_available():
        raise ValueError(
            'method="triton" needs the triton package: pip install "rlops[gpu]" '
            '(or use method="chunked")'
        )
    if x.device.type == "cpu" and not _backends.interpreted():
        raise ValueError(
            'method="triton" runs on CUDA tensors; on CPU tensors only under the Triton '
            "interpreter (TRITON_INTERPRET=1 set before triton is imported). Got CPU logits: "
            'use method="chunked" (or "auto")'
        )
    if x.device.type not in ("cuda", "cpu"):
        raise ValueError(f'method="triton" runs on CUDA tensors, got device {x.device}')
    return "chunked" if failed() is not None else "triton"


def set_failed(error: BaseException) -> None:
    """Set the triton backend aside for the rest of the process; warn once (the first caller)."""
    _backends.set_failed("triton", error, "the triton backend (a log-prob kernel)", stacklevel=3)


def checked(
    name: str, x: object, target: object, options: Options, *, weight: object = None,
    bias: object = None, method: object = None,
) -> Checked:  # fmt: skip
    """This rank's own argument checks of the op on ``name``: ``"logits"`` (with its
    ``method``), or ``"hidden"`` with the output layer's ``weight`` and ``bias``."""
    x = check_logits(name, x)
    linear = name == "hidden"
    if linear:
        weight, bias = _checked_layer(x, weight, bias)
        v_local = weight.shape[0]
    else:
        v_local = x.shape[-1]
        if v_local == 0:
            raise ValueError("logits must have a non-empty vocabulary dimension, got [..., 0]")
    logit_scale = check_logit_scale(options.logit_scale)
    softcap = check_softcap(options.final_logit_softcapping)
    check_flags(
        with_entropy=options.with_entropy,
        entropy_grad=options.entropy_grad,
        with_sum_pi_squared=options.with_sum_pi_squared,
    )
    check_chunk_size(options.chunk_size)
    logits_dtype = check_logits_dtype(options.logits_dtype, x.dtype)
    lead = x.shape[:-1]
    temperature = check_temperature(options.temperature, lead, name)
    target = check_target(target, lead, name)
    like = "hidden @ weight.T" if linear else "logits"
    keep_mask = check_keep_mask(options.keep_mask, (*lead, v_local), like)
    mask = check_row_mask(options.mask, lead, f"{name}[..., 0]")
    support = check_support(options.support_ids, options.support_offsets, target.numel())
    s_ids, s_offsets = (None, None) if support is None else support
    layer = {"weight": weight, "bias": bias} if linear else {}
    per_row = {"temperature": temperature} if isinstance(temperature, torch.Tensor) else {}
    check_same_device(
        name, x, **layer, target=target, keep_mask=keep_mask, mask=mask, support_ids=s_ids,
        support_offsets=s_offsets, **per_row,
    )  # fmt: skip
    chunk = options.chunk_size
    if chunk is None:
        chunk = default_chunk(target.numel(), v_local, x.device, linear=linear)
    chosen = "chunked"
    if not linear:  # a rank's bad method joins the group check
        chosen = resolve(method, x)
        wider = logits_dtype not in (None, compute_dtype(x.dtype))  # float64 from half logits
        if chosen == "triton" and (logit_scale != 1.0 or softcap is not None or wider):
            chosen = "chunked"  # the kernels have no scale, softcap or float64 upcast: torch
    if isinstance(temperature, torch.Tensor):  # per token, in the compute dtype
        wide = compute_dtype(x.dtype) if logits_dtype is None else logits_dtype
        temperature = _per_token(temperature, lead, wide)
    return Checked(
        name=name,
        x=x,
        weight=cast(torch.Tensor, weight) if linear else None,
        bias=cast("torch.Tensor | None", bias),
        target=target,
        keep=keep_mask,
        temperature=temperature,
        logit_scale=logit_scale,
        softcap=softcap,
        v_local=v_local,
        chunk=chunk,
        hidden=cast(torch.Tensor, weight).shape[1] if linear else 0,
        mask=mask,
        support=support,
        method=chosen,
        sampler=checked_sampler(name, x, options, keep_mask, logits_dtype),
        logits_dtype=logits_dtype,
    )


def _checked_layer(
    hidden: torch.Tensor, weight: object, bias: object
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The linear op's ``weight`` ``[V_local, H]`` and ``bias`` ``[V_local]`` (or None), in
    ``hidden``'s dtype."""
    weight = check_logits("weight", weight)
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight must have hidden's dtype {hidden.dtype}, got {weight.dtype}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:
        raise shape_error(
            "weight", f"[V_local, H] with V_local >= 1 and H = {hidden.shape[-1]}", weight.shape
        )
    if bias is None:
        return weight, None
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if bias.dtype != hidden.dtype:
        raise TypeError(f"bias must have hidden's dtype {hidden.dtype}, got {bias.dtype}")
    if tuple(bias.shape) != (weight.shape[0],):
        raise shape_error("bias", f"[V_local] like weight's rows [{weight.shape[0]}]",
                          bias.shape)  # fmt: skip
    return weight, bias


def checked_sampler(
    name: str, ref: torch.Tensor, options: Options, keep_mask: torch.Tensor | None,
    logits_dtype: torch.dtype | None = None,
) -> Sampler | None:  # fmt: skip
    """The sampler filters of ``options`` as a :class:`Sampler`, or None when none is given;
    ``ref`` ``[..., X]``: the tensor whose leading dims are the tokens (named ``name``);
    ``logits_dtype``: the checked one (the per-token parameters' dtype when it widens)."""
    over = options.entropy_over_support
    check_flags(entropy_over_support=over)
    sampler = check_sampler(
        options.top_k, options.top_p, options.min_p, ref, name, logits_dtype=logits_dtype
    )
    if keep_mask is not None and options.support_ids is not None:
        raise ValueError(
            "keep_mask and support_ids / support_offsets are exclusive: give the support "
            "either as a dense mask or as CSR sets"
        )
    if sampler is None:
        if over:
            raise ValueError("entropy_over_support=True needs top_k, top_p or min_p")
        return None
    if keep_mask is not None or options.support_ids is not None:
        given = "keep_mask" if keep_mask is not None else "support_ids / support_offsets"
        raise ValueError(
            f"{given} and top_k / top_p / min_p are exclusive: give the sampler's support "
            "either as a mask or CSR sets, or as its parameters"
        )
    params = {"top_k": sampler.top_k, "top_p": sampler.top_p, "min_p": sampler.min_p}
    check_same_device(name, ref, **{n: p for n, p in params.items() if p is not None})
    return sampler


def default_chunk(
    n_tokens: int, v_local: int, device: torch.device, *, linear: bool = False
) -> int | None:
    """Tokens per chunk so that a ``[chunk, v_local]`` float32 buffer stays near the budget
    (``linear``: a multiple of :data:`ROW_ALIGN` rows where it holds more). While
    ``torch.compile`` traces, None: one chunk of every token (no recompile per length)."""
    if torch.compiler.is_compiling():
        return None
    if device.type == "cpu":
        budget = _LINEAR_CHUNK_BYTES_CPU if linear else _CHUNK_BYTES_CPU
    else:
        budget = _CHUNK_BYTES_DEVICE
    chunk = max(1, min(max(n_tokens, 1), budget // (4 * max(v_local, 1))))
    if not linear or chunk < ROW_ALIGN or chunk >= n_tokens:
        return chunk
    return chunk // ROW_ALIGN * ROW_ALIGN


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


_LOGITS_DTYPES = (torch.float32, torch.float64)


def check_logits_dtype(logits_dtype: object, dtype: torch.dtype) -> torch.dtype | None:
    """``logits_dtype`` (None, float32 or float64) for inputs of ``dtype``: None where it
    changes nothing (None, or no wider than ``dtype``), else the wider dtype the logits are
    made and read in."""
    if logits_dtype is None:
        return None
    if not isinstance(logits_dtype, torch.dtype) or logits_dtype not in _LOGITS_DTYPES:
        raise ValueError(
            f"logits_dtype must be None (the inputs' dtype), torch.float32 or torch.float64, "
            f"got {logits_dtype!r}"
        )
    return logits_dtype if logits_dtype.itemsize > dtype.itemsize else None


def check_temperature(
    temperature: object, lead: tuple[int, ...] = (), name: str = "logits"
) -> float | torch.Tensor:
    """A float ``> 0``, or a floating tensor of one temperature per row of ``name``'s first
    dim (``lead``: its leading shape), finite and ``> 0`` (read where
    :func:`values_checked`)."""
    if isinstance(temperature, torch.Tensor):
        return _temperature_rows(temperature, lead, name)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(
            f"temperature must be a float or a floating tensor, got {type(temperature).__name__}"
        )
    t = float(temperature)
    if not (t > 0 and is_finite(t)):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    return t


def _temperature_rows(tau: torch.Tensor, lead: tuple[int, ...], name: str) -> torch.Tensor:
    """A per-row temperature: ``[N]`` for ``[N, V]`` (``[B]`` for ``[B, T, V]``), detached."""
    rows = "[N] (one per row)" if len(lead) <= 1 else "[B] (one per row of [B, T])"
    expected = f"{rows} like {name}'s first dim {list(lead[:1])}"
    if not tau.is_floating_point():
        raise TypeError(f"temperature must be a float or a floating tensor {rows}, got {tau.dtype}")
    if len(lead) == 0 or tuple(tau.shape) != tuple(lead[:1]):
        raise shape_error("temperature", expected, tau.shape)
    if values_checked(tau) and tau.numel() > 0:
        if not bool((tau.isfinite() & (tau > 0)).all()):
            bad = tau[~(tau.isfinite() & (tau > 0))][0].item()
            raise ValueError(f"temperature must hold finite numbers > 0, got {bad}")
    return tau.detach()


def _per_token(tau: torch.Tensor, lead: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``[lead[0]]`` per-row temperatures as ``[N]`` per token (row-major over ``lead``)."""
    rest = [1] * (len(lead) - 1)
    return tau.to(dtype).reshape(lead[0], *rest).expand(lead).reshape(-1)


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
    top_k: object, top_p: object, min_p: object, logits: torch.Tensor, like: str = "logits",
    *, logits_dtype: torch.dtype | None = None,
) -> Sampler | None:  # fmt: skip
    """The sampler's filters, checked, as a :class:`Sampler` of numbers or flat ``[N]`` tensors
    (int64; the compute dtype, or ``logits_dtype``), or None: ``top_k ≥ 1``, ``top_p`` in
    ``(0, 1]``, ``min_p`` in ``[0, 1]`` (a tensor's values on CPU only)."""
    if top_k is None and top_p is None and min_p is None:
        return None
    lead = logits.shape[:-1]
    dtype = compute_dtype(logits.dtype) if logits_dtype is None else logits_dtype
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
