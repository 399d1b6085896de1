"""What the three contracts share: the tolerance rule, the calling of the user's function and
the conversion of a check's outcome (or its exception) into a :class:`Check`."""

from __future__ import annotations

import inspect
import math
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from rlops.testing.report import Check, Report

__all__ = [
    "FLOOR_ULPS",
    "Measured",
    "accepts",
    "first",
    "generator",
    "measure",
    "run_check",
    "run_checks",
]

#: the floor of the rule: a few units of the output dtype's precision at each value
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


def accepts(fn: Callable, name: str) -> bool:
    """Whether ``fn`` takes a keyword argument ``name`` (or ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    return any(
        p.kind is p.VAR_KEYWORD or (p.name == name and p.kind is not p.POSITIONAL_ONLY)
        for p in params
    )


@dataclass(frozen=True)
class Measured:
    """The rule applied to one output: ``err`` the largest error against the float64
    definition, ``plain`` the same for the plain computation in the same dtype, ``bound``
    the bound (``2·plain`` plus the floor) of the element nearest to (or furthest past) its
    bound, ``worst`` that element's error, ``ok`` whether every element is within its bound
    (and finite where the definition is)."""

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


def _ulps(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``FLOOR_ULPS`` units of ``dtype``'s precision at each of ``ref``'s values."""
    fi = torch.finfo(dtype)
    return FLOOR_ULPS * fi.eps * ref.abs().clamp_min(fi.tiny)


def measure(
    out: torch.Tensor, ref: torch.Tensor, plain: torch.Tensor, where: torch.Tensor | None = None
) -> Measured:
    """The rule: every element of ``out`` within ``2·max|plain − ref| + FLOOR_ULPS ulps``
    of the float64 definition ``ref`` (ulps of ``out``'s dtype; elements where ``where`` is
    False, or the definition is not finite, are not compared). A non-finite ``out`` where
    the definition is finite is an infinite error."""
    ref = ref.detach().to("cpu", torch.float64)
    o = out.detach().to("cpu", torch.float64)
    p = plain.detach().to("cpu", torch.float64)
    if o.shape != ref.shape:
        raise ValueError(
            f"the function returned shape {tuple(o.shape)}, the definition's is {tuple(ref.shape)}"
        )
    keep = torch.isfinite(ref)
    if where is not None:
        keep &= where.to("cpu").bool()
    if not bool(keep.any()):
        return Measured(0.0, 0.0, 0.0, 0.0, True)
    diff = torch.where(torch.isfinite(o), (o - ref).abs(), math.inf)[keep]
    plain_err = torch.where(torch.isfinite(p), (p - ref).abs(), math.inf)[keep]
    e_plain = float(plain_err.max())
    floor = _ulps(ref[keep], out.dtype if out.is_floating_point() else torch.float32)
    bound = 2 * e_plain + floor
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
    names: Sequence[str],
    explain: Mapping[str, str],
    bodies: Mapping[str, Callable[[], tuple[bool | None, float | None, str]]],
) -> Report:
    """The report of ``contract`` on ``fn``: the checks ``names`` run in that order (each one's
    ``bodies[name]``, explained by ``explain[name]``), titled ``contract(fn, *shown)``."""
    checks = [run_check(name, explain[name], bodies[name]) for name in names]
    return Report(
        f"{contract}({', '.join([getattr(fn, '__qualname__', repr(fn)), *shown])})", checks
    )
