"""What the three contracts share: the tolerance rule, the checking of a contract's options,
the reading of the user's function's signature, and the conversion of a check's outcome (or
its exception) into a :class:`Check`."""

from __future__ import annotations

import inspect
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from rlops._checks import as_int
from rlops.testing.report import Check, Report

#: the floor of the rule: a few units of the output dtype's precision at the magnitude of the
#: terms the definition combines
FLOOR_ULPS = 4


def generator(seed: int) -> torch.Generator:
    """A CPU generator with ``seed`` (inputs are drawn on the CPU, then moved: the same numbers
    on every device)."""
    return torch.Generator().manual_seed(seed)


def first(out: object, name: str) -> torch.Tensor:
    """``out`` itself, or the first element of a tuple / list ``out`` (``(loss, metrics)``,
    ``(advantages, returns)``), checked to be a tensor."""
    if isinstance(out, (tuple, list)) and out:
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise TypeError(
            f"the function must return a tensor (or a tuple starting with one) "
            f"for {name}, got {type(out).__name__}"
        )
    return out


def signature(fn: Callable) -> inspect.Signature | None:
    """``fn``'s signature, or None where it has none to read (some builtins)."""
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def binds(sig: inspect.Signature, *args: object, **kwargs: object) -> bool:
    """Whether a call with these arguments fits ``sig`` (nothing is called)."""
    try:
        sig.bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def accepts(fn: Callable, name: str) -> bool:
    """Whether ``fn`` takes a keyword argument ``name`` (or ``**kwargs``)."""
    sig = signature(fn)
    if sig is None:
        return False
    return any(
        p.kind is p.VAR_KEYWORD or (p.name == name and p.kind is not p.POSITIONAL_ONLY)
        for p in sig.parameters.values()
    )


def fn_name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def check_device(device: object) -> torch.device:
    """``device`` as a :class:`torch.device` that can hold a tensor here (a ``ValueError``
    naming ``device`` otherwise: a misspelt name, CUDA on a machine without it)."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    try:
        dev = torch.device(device)
        torch.empty(1, device=dev)
    except (RuntimeError, AssertionError, ValueError) as e:
        reason = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(f"device={str(device)!r} is not usable here: {reason}") from None
    return dev


def check_seed(seed: object) -> int:
    """A seed: an int >= 0."""
    return as_int("seed", seed, 0, tensor=False)


def preflight(call: Callable[[], object], what: str) -> None:
    """Call the user's function once on small inputs: a result that is not a tensor (or a
    tuple starting with one) is one ``TypeError`` before any check runs. An exception from the
    function is left to the checks, which report it."""
    try:
        out = call()
    except Exception:  # the checks run it again and report what it raised
        return
    first(out, what)


@dataclass(frozen=True)
class Measured:
    """The rule applied to one output: ``err`` the largest error against the float64
    definition, ``plain`` the same for the plain computation in the same dtype, ``bound``
    the bound of the element nearest to (or furthest past) its bound, ``worst`` that
    element's error, ``ok`` whether every element is within its bound (and finite where the
    definition is)."""

    err: float
    plain: float
    bound: float
    worst: float
    ok: bool

    def text(self) -> str:
        """``error E / bound B (plain P)``: the element nearest its bound, and the plain
        computation's largest error; ``max error M`` as well where that is another element."""
        text = f"error {self.worst:.2e} / bound {self.bound:.2e} (plain {self.plain:.2e})"
        return text if self.worst == self.err else f"{text}, max error {self.err:.2e}"


def measure(
    out: torch.Tensor,
    ref: torch.Tensor,
    plain: torch.Tensor,
    where: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> Measured:
    """The rule: every element of ``out`` within

        2·max|plain − ref| + FLOOR_ULPS·eps(dtype)·max(|ref|, scale)

    of the float64 definition ``ref``: ``plain`` the plain computation in ``out``'s dtype,
    ``scale`` (broadcast to ``ref``'s shape) the magnitude of the terms the definition combines
    for each element (a log-prob's largest ``|z|/τ`` and log-normaliser, a loss's summands, an
    advantage's running sum of ``|δ|``). The shapes must be equal: nothing is broadcast.
    Elements where ``where`` is False, or the definition is not finite, are not compared; a
    non-finite ``out`` where the definition is finite is an infinite error."""
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(
            f"the function returned shape {list(out.shape)}, the definition's is {list(ref.shape)}"
        )
    ref = ref.detach().to("cpu", torch.float64)
    o = out.detach().to("cpu", torch.float64)
    p = plain.detach().to("cpu", torch.float64)
    keep = torch.isfinite(ref)
    if where is not None:
        keep &= where.to("cpu").bool()
    if not bool(keep.any()):
        return Measured(0.0, 0.0, 0.0, 0.0, True)
    size = ref.abs()
    if scale is not None:
        size = torch.maximum(size, scale.detach().to("cpu", torch.float64).expand_as(ref))
    diff = torch.where(torch.isfinite(o), (o - ref).abs(), torch.inf)[keep]
    plain_err = torch.where(torch.isfinite(p), (p - ref).abs(), torch.inf)[keep]
    e_plain = float(plain_err.max())
    fi = torch.finfo(out.dtype if out.is_floating_point() else torch.float32)
    bound = 2 * e_plain + FLOOR_ULPS * fi.eps * size[keep].clamp_min(fi.tiny)
    at = int(torch.argmax(diff / bound))  # the element nearest to (or furthest past) its bound
    return Measured(
        float(diff.max()), e_plain, float(bound[at]), float(diff[at]), bool((diff <= bound).all())
    )


def run_check(
    name: str, explanation: str, body: Callable[[], tuple[bool | None, float | None, str]]
) -> Check:
    """Run one check's ``body`` (returning ``(ok, value, figure)``); an exception from the
    user's function fails the check, its figure naming the exception."""
    try:
        ok, value, figure = body()
    except Exception as e:  # the user's function raised: that check fails, the others run
        where = traceback.extract_tb(e.__traceback__)[-1]
        message = (str(e).strip().splitlines() or [""])[0]
        message = message if len(message) <= 160 else message[:157] + "..."
        place = f"{where.filename.rsplit('/', 1)[-1]}:{where.lineno}"
        return Check(
            name, False, None, f"raised {type(e).__name__}: {message} ({place})", explanation
        )
    return Check(name, ok, value, figure, explanation)


def run_checks(
    contract: str,
    fn: Callable,
    shown: Sequence[str],
    explain: Mapping[str, str],
    bodies: Mapping[str, Callable[[], tuple[bool | None, float | None, str]]],
) -> Report:
    """The report of ``contract`` on ``fn``: the checks ``bodies`` run in their order (each
    explained by ``explain[name]``), titled ``contract(fn, *shown)``."""
    checks = [run_check(name, explain[name], body) for name, body in bodies.items()]
    return Report(f"{contract}({', '.join([fn_name(fn), *shown])})", checks)
