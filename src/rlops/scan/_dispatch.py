"""One dispatch per op family: which implementation runs a call, decided in one place
(docs/design/scan.md).

A family keeps one :class:`Table` of :class:`Row` s, each serving some :class:`Backend` s; a
call is described by a :class:`Case`. ``"auto"`` takes the first backend of
:data:`PREFERENCE` that can run the case (an explicit method that cannot is a ``ValueError``
saying why); the first row serving it whose ``when`` accepts the case runs, else the chunked
row. A backend that fails to compile is set aside for the process (:mod:`rlops._backends`).
On CPU, ``small_ops`` rows run on one single-threaded worker of :mod:`rlops._threads` when no
gradient is needed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

import rlops._backends as _backends
from rlops._checks import check_choice
from rlops._threads import pool
from rlops.scan import compiled

METHODS = ("auto", "reference", "chunked", "compiled", "triton")
PREFERENCE = ("triton", "compiled", "chunked")  # what "auto" tries, in order


@dataclasses.dataclass(slots=True)
class Case:
    """What decides the implementation of one call (not changed once made).

    ``discounts`` are the per-row discounts (floats or CPU/device tensors); they are only read
    by :meth:`zero_discount`, which a row asks for on CPU (no device synchronisation). Not a
    frozen dataclass: its ``__init__`` sets each field through ``object.__setattr__``, 3 us
    more a call when the caches are cold."""

    device: torch.device
    dtype: torch.dtype
    needs_grad: bool = False
    cp: bool = False
    discounts: tuple = ()

    def zero_discount(self) -> bool:
        """Whether a discount is exactly 0 (a host read of CPU tensors)."""
        for d in self.discounts:  # (a loop: a generator costs microseconds more, caches cold)
            if bool((d == 0).any()) if isinstance(d, torch.Tensor) else d == 0:
                return True
        return False


def needs_grad(*objs: object) -> bool:
    """Whether autograd is on and a tensor among ``objs`` requires grad."""
    if not torch.is_grad_enabled():
        return False
    for t in objs:  # (a loop: a generator costs microseconds more, caches cold)
        if isinstance(t, torch.Tensor) and t.requires_grad:
            return True
    return False


def case_of(
    x: torch.Tensor, *inputs: object, dtype=None, cp: bool = False, discounts: tuple = ()
) -> Case:
    """The :class:`Case` of a call on ``x`` (and the other ``inputs``, for the gradient)."""
    return Case(x.device, dtype or x.dtype, needs_grad(x, *inputs), cp, discounts)


def _no_requirement(case: Case) -> str | None:
    return None


def _no_errors() -> tuple[type[BaseException], ...]:
    return ()


def _anywhere(case: Case) -> bool:
    return True


def _auto_triton(case: Case) -> bool:
    return _backends.auto_triton(case.device)


@dataclasses.dataclass(frozen=True)
class Backend:
    """A way to run ops: what it needs, and which of its errors mean "cannot compile here"."""

    name: str
    requires: Callable[[Case], str | None] = _no_requirement  # why it cannot run, or None
    traceable: bool = True  # torch.compile can trace it
    compile_errors: Callable[[], tuple[type[BaseException], ...]] = _no_errors
    auto: Callable[[Case], bool] = _anywhere  # where "auto" may pick it


def _compiled_requires(case: Case) -> str | None:
    if not compiled.available():
        return (
            'method="compiled" needs numba: pip install numba (in a clone of rlops: '
            'pip install -e ".[fast]"), or use method="chunked"'
        )
    if case.device.type != "cpu":
        return f'method="compiled" runs on CPU tensors, got device {case.device}'
    if case.needs_grad:
        return (
            'method="compiled" has no gradient, but an input requires grad: use '
            'method="chunked" (or "auto", which picks it under autograd), or detach the inputs'
        )
    return None


def _numba_errors() -> tuple[type[BaseException], ...]:
    from numba.core.errors import NumbaError

    return (NumbaError,)


def _triton_requires(case: Case) -> str | None:
    if not _backends.triton_importable():
        return (
            'method="triton" needs the triton package: pip install "rlops[gpu]" '
            '(or use method="chunked")'
        )
    if case.device.type == "cpu":
        if not _backends.interpreted():
            return (
                'method="triton" runs on CUDA tensors; on CPU tensors only under the Triton '
                "interpreter (TRITON_INTERPRET=1 set before triton is imported). Got CPU "
                'tensors: use method="chunked" (or "auto")'
            )
    elif case.device.type != "cuda":
        return f'method="triton" runs on CUDA tensors, got device {case.device}'
    return None


def _triton_forward_requires(case: Case) -> str | None:
    reason = _triton_requires(case)
    if reason is None and case.needs_grad:
        return (
            'method="triton" has no gradient for this function (its kernels are forward '
            'only), but an input requires grad: use method="chunked" (or "auto", which picks '
            "it under autograd), or detach the inputs"
        )
    return reason


def _triton_errors() -> tuple[type[BaseException], ...]:
    # what every launch raises for "this kernel cannot be built here" (rlops._backends.launch)
    return (_backends.KernelBuildError,)


REFERENCE = Backend("reference")
CHUNKED = Backend("chunked")
COMPILED = Backend("compiled", _compiled_requires, traceable=False, compile_errors=_numba_errors)
# auto picks triton on NVIDIA's CUDA devices only (not ROCm's): under TRITON_INTERPRET=1 it runs
# CPU tensors, for tests. Not traced by torch.compile (the kernels are not custom ops).
TRITON = Backend(
    "triton", _triton_requires, traceable=False, compile_errors=_triton_errors, auto=_auto_triton
)
# the same backend where the kernels are forward only: refused under autograd, as compiled
TRITON_FORWARD = Backend(
    "triton",
    _triton_forward_requires,
    traceable=False,
    compile_errors=_triton_errors,
    auto=_auto_triton,
)


def _always(case: Case) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class Row:
    """One implementation of a family: ``run(method, *args)`` for the ``backends`` it serves,
    on the calls ``when`` accepts. ``small_ops``: made of many small torch operations (on CPU
    it runs on one single-threaded worker, see the module docstring). ``when`` reads the
    case's ``dtype``, ``needs_grad``, ``cp`` and ``zero_discount()`` only: a table keeps the
    row it picked for ``"auto"`` on CPU by those (:meth:`Table.plan`)."""

    backends: tuple[Backend, ...]
    run: Callable[..., Any]
    when: Callable[[Case], bool] = _always
    small_ops: bool = False


class Table:
    """The dispatch of one op family (``op`` names it in messages)."""

    def __init__(self, op: str, rows: Sequence[Row]):
        self.op = op
        self.rows = rows

    @property
    def rows(self) -> tuple[Row, ...]:
        return self._rows

    @rows.setter
    def rows(self, rows: Sequence[Row]) -> None:
        self._rows = tuple(rows)
        self._plans: dict[tuple, tuple[Row, str, Backend]] = {}  # (plan)
        # by backend name: the first backend of that name, and the rows serving it in order
        # (looked up on every call: a loop over the rows cost microseconds, caches cold)
        self._backends: dict[str, Backend] = {}
        self._serving: dict[str, list[Row]] = {}
        for row in self._rows:
            for backend in row.backends:
                self._backends.setdefault(backend.name, backend)
                self._serving.setdefault(backend.name, []).append(row)

    def _backend(self, name: str) -> Backend | None:
        return self._backends.get(name)

    def method(self, method: str, case: Case) -> str:
        """The concrete method of a call: ``"auto"`` resolved, an explicit one checked."""
        check_choice("method", method, METHODS)
        if method == "auto":
            compiling = torch.compiler.is_compiling()
            for name in PREFERENCE:
                backend = self._backend(name)
                if (
                    backend is not None
                    and backend.auto(case)
                    and _backends.failed(name) is None
                    and (backend.traceable or not compiling)
                    and backend.requires(case) is None
                ):
                    return name
            return "chunked"
        backend = self._backend(method)
        if backend is None:
            raise ValueError(
                f'method="{method}": {method} backend not available for {self.op} '
                '(use "auto", "chunked", "compiled" or "reference")'
            )
        reason = backend.requires(case)
        if reason is not None:
            raise ValueError(reason)
        return method

    def row(self, method: str, case: Case) -> tuple[Row, str]:
        """The row that runs a concrete ``method`` on ``case``, and the method it runs with
        (``"chunked"`` where the backend has no row for the case)."""
        for name in (method, "chunked"):
            for row in self._serving.get(name, ()):
                if row.when(case):
                    return row, name
        raise LookupError(f"{self.op}: no chunked row")  # every table has one

    def plan(self, method: str, case: Case) -> tuple[Row, str, Backend]:
        """The row that runs a call, the method it runs with and its backend: ``method``
        resolved (:meth:`method`), chunked for a backend set aside, the row (:meth:`row`).
        For ``"auto"`` on CPU outside ``torch.compile`` the plan is kept per dtype, gradient,
        context parallelism, zero discount and the backends set aside (what the backends'
        requirements and the rows' ``when`` read on CPU): 10-11 us a call less when the
        caches are cold."""
        key = None
        if method == "auto" and case.device.type == "cpu" and not torch.compiler.is_compiling():
            key = _plan_key(case.dtype, case.needs_grad, case.cp, case.zero_discount())
            kept = self._plans.get(key)
            if kept is not None:
                return kept
        name = self.method(method, case)
        if _backends.failed(name) is not None:
            name = "chunked"
        row, name = self.row(name, case)
        backend = self._backend(name)
        assert backend is not None
        if key is not None:
            self._plans[key] = (row, name, backend)
        return row, name, backend

    def kept(self, dtype: torch.dtype) -> Row | None:
        """The row :meth:`plan` keeps for ``"auto"`` on a CPU call in ``dtype`` without a
        gradient, context parallelism or a zero discount, with the backends set aside now;
        None until a call has made that plan. (A caller that knows its call is such a one may
        run the row's work itself: the plain GAE call, :func:`rlops.gae`.)"""
        kept = self._plans.get(_plan_key(dtype, False, False, False))
        return None if kept is None else kept[0]

    def run_kept(self, dtype: torch.dtype, row: Row, fn: Callable, *args: Any) -> Any:
        """``fn(*args)`` where :meth:`kept` gives ``row`` for ``dtype``, outside
        ``torch.compile``: a plain call's own way to the row's work, its caller having checked
        that the call is such a case. None where it is not kept, or where ``fn`` fails to
        build (one of the row's backend's compile errors: the general path's dispatch then
        sets the backend aside and falls back)."""
        if torch.compiler.is_compiling() or self.kept(dtype) is not row:
            return None
        try:
            return fn(*args)
        except row.backends[0].compile_errors():
            return None

    def __call__(self, method: str, case: Case, *args: Any) -> Any:
        """Run the call: resolve ``method``, pick the row (:meth:`plan`), run it (on a CPU
        worker when it is made of small operations); a backend that fails to compile falls
        back to chunked."""
        row, method, backend = self.plan(method, case)
        try:
            return _execute(row, method, case, args)
        except backend.compile_errors() as e:
            _fail(backend, e)
            return _execute(*self.row("chunked", case), case, args)


def _plan_key(dtype: torch.dtype, needs_grad: bool, cp: bool, zero_discount: bool) -> tuple:
    # what a kept plan is kept by (Table.plan): what the backends' requirements and the rows'
    # `when` read on CPU, and the backends set aside
    return (dtype, needs_grad, cp, zero_discount, _backends.failed_names())


def _fail(backend: Backend, error: BaseException) -> None:
    _backends.set_failed(backend.name, error, f"the {backend.name} backend", stacklevel=4)


def failed() -> dict[str, str]:
    """The backends set aside in this process, with the error that did it."""
    return _backends.failures()


def _execute(row: Row, method: str, case: Case, args: tuple) -> Any:
    if (
        not row.small_ops
        or torch.compiler.is_compiling()  # traced into the graph, threads cannot be
        or case.device.type != "cpu"
        or case.needs_grad  # the graph stays on the caller's thread (module docstring)
    ):
        return row.run(method, *args)
    threads = torch.get_num_threads()
    if threads <= 1:  # a worker of the pool, or a single-threaded caller
        return row.run(method, *args)
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def run() -> Any:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return row.run(method, *args)

    return pool(threads).submit(run).result()
