"""A device stand-in for the GPU hot-path tests: tensors that hold real values on the host but
are, for torch's autograd and for rlops, on a device that is not the CPU; and a recorder of
every host round trip the code under test makes with them.

**The stand-in.** A :class:`StandIn` is a wrapper tensor (``_make_wrapper_subclass``) around a
plain CPU tensor, on :data:`DEVICE`. Every operation on it runs on the CPU tensors inside and
its results are wrapped again, so the code takes the path it takes on an accelerator
(``values_checked`` is False unless ``RLOPS_CHECK_VALUES=1``; the chunk engine does not
compact rows; ``for_each`` runs serially) while the values stay real: value checks see real
data, a branch on a value goes where it would go, and outputs can be compared. Factories aimed
at the device (``torch.zeros(..., device=x.device)``) make a stand-in. Uninitialised memory
(``torch.empty`` on the device) is NaN-filled, so an element never written shows up.

**The device** is ``lazy`` (torch's lazy-tensor device type): its device guard is built into
every torch (autograd needs one), nothing in rlops or in torch's composite operations treats it
specially, and the Python dispatch runs before its backend, which never runs. ``meta``, the
fallback where a torch cannot run autograd on ``lazy``, is treated specially by both: rlops
skips the value checks of a meta tensor (it holds no value), and torch makes
``torch.tensor(data, device="meta")`` without a copy (no values: an error here, not an event)
and refuses ``repeat_interleave`` without ``output_size`` on meta before any dispatch.

**The recorder** (:class:`Recorder`, a ``TorchDispatchMode``) sees every aten operation of the
call, forward and backward, and records, with the innermost frame under ``src/rlops``:

- ``host read``: ``_local_scalar_dense`` (``.item()``, ``bool(t)``, ``int(t)``,
  ``float(t)``), ``equal``, ``is_nonzero`` of a stand-in, and a copy of one to the host
  (``.cpu()``, ``.tolist()``);
- ``H2D copy``: host data copied to the device (``_to_copy`` / ``copy_`` from a CPU tensor,
  ``torch.as_tensor(list, device=...)``, ``torch.tensor(x, device=...)``), any size;
- ``dynamic shape``: an output whose shape depends on the values (``nonzero``,
  ``masked_select``, ``unique``, ``bincount``, a boolean-mask index or index-put,
  ``repeat_interleave`` without ``output_size``): the host waits for the count;
- ``device mismatch``: one operation given a stand-in and a CPU tensor of one or more
  dimensions (a real GPU raises, or copies the CPU operand). A 0-dim CPU tensor is allowed:
  torch reads it on the host as a number (a wrapped scalar), as it does a Python number.

Events of the forward with no ``src/rlops`` frame are the test's own input construction and
are not recorded; in the backward they are autograd's formulas on rlops's graph and are.

**Triton.** :func:`cuda_dispatch` makes rlops's dispatch decide for the stand-in as it decides
for a CUDA tensor (the scan/estimator tables and the log-prob method see a CUDA case) and
replaces each kernel launch by a record (kernel, grid, the devices of its tensor arguments):
the host code around the kernels runs, the kernels do not (their outputs stay NaN).
:func:`triton_aside` sets the Triton backend aside the way a build failure does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

import rlops

__all__ = [
    "DEVICE",
    "Event",
    "Launch",
    "Recorder",
    "StandIn",
    "cuda_dispatch",
    "flat",
    "run",
    "triton_aside",
]


def _autograd_runs_on(device: str) -> bool:
    """Whether a wrapper tensor on ``device`` goes through a forward and a backward. First
    whether torch has a device guard for it (without one, autograd aborts the process): asking
    for a stream then fails saying torch is not linked with that device."""
    try:
        torch.Stream(device=device)
    except RuntimeError as e:
        if "not linked" in str(e):
            return False

    class Probe(torch.Tensor):
        __torch_function__ = torch._C._disabled_torch_function_impl

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            def unwrap(x):
                return x.elem if isinstance(x, Probe) else x

            out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
            return tree_map(lambda o: wrap(o) if isinstance(o, torch.Tensor) else o, out)

    def wrap(elem, grad=False):
        out = torch.Tensor._make_wrapper_subclass(
            Probe, elem.shape, dtype=elem.dtype, device=device, requires_grad=grad
        )
        out.elem = elem
        return out

    try:
        x = wrap(torch.ones(2), grad=True)
        (x * x).sum().backward()
        return x.grad is not None and x.grad.device.type == device
    except Exception:  # any failure: the device cannot stand in
        return False


DEVICE = torch.device("lazy" if _autograd_runs_on("lazy") else "meta")
_SRC = os.path.dirname(os.path.abspath(rlops.__file__))
aten = torch.ops.aten

# outputs whose size is a count of the values: the host reads that count
_DYNAMIC = {
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten._unique.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.bincount.default,
}
_INDEX = {
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
}
_READS = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default}
_EMPTY = {
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.empty_like.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
}


class StandIn(torch.Tensor):
    """A tensor on :data:`DEVICE` holding the CPU tensor ``elem`` (module docstring)."""

    elem: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, elem: torch.Tensor, requires_grad: bool = False) -> StandIn:
        assert type(elem) is torch.Tensor and elem.device.type == "cpu", type(elem)
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.shape,
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            layout=elem.layout,
            device=DEVICE,
            requires_grad=requires_grad,
        )
        out.elem = elem
        return out

    def __repr__(self) -> str:  # not the tensor printer: that reads every value
        return f"StandIn(shape={list(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # outside a Recorder (inputs built or results read by the test): run, record nothing
        return _apply(func, args, kwargs or {}, None)


@dataclasses.dataclass(frozen=True)
class Event:
    """One host round trip: ``kind`` (module docstring), the aten ``op``, ``where`` (the
    innermost ``src/rlops`` frame as ``file.py:function``, or ``(autograd)``) and the
    ``phase`` (``forward`` or ``backward``)."""

    kind: str
    op: str
    where: str
    phase: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.op} @ {self.where} ({self.phase})"


def _frame(source: str) -> str | None:
    """``file:function`` of the innermost frame under ``source`` (relative to its parent)."""
    for fr in reversed(traceback.extract_stack()):
        if fr.filename.startswith(source):
            rel = os.path.relpath(fr.filename, os.path.dirname(source)).replace(os.sep, "/")
            return f"{rel}:{fr.name}"
    return None


def _is_device(d: object) -> bool:
    return d is not None and torch.device(d).type == DEVICE.type  # type: ignore[arg-type]


def _to_host_device(x: object) -> object:
    if isinstance(x, torch.device) and x.type == DEVICE.type:
        return torch.device("cpu")
    return x


def _unwrap(x: object) -> object:
    return x.elem if isinstance(x, StandIn) else _to_host_device(x)


def _classify(func, args, kwargs) -> tuple[str, ...]:
    """The kinds of event an operation is (module docstring)."""
    leaves = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    host = [a for a in leaves if not isinstance(a, StandIn)]
    if func in (aten._to_copy.default, aten.copy_.default):
        src = args[0] if func is aten._to_copy.default else args[1]
        if func is aten._to_copy.default:
            to_device = _is_device(
                kwargs.get("device", DEVICE if isinstance(src, StandIn) else "cpu")
            )
        else:
            to_device = isinstance(args[0], StandIn)
        if isinstance(src, StandIn) and not to_device:
            return ("host read",)  # the device's data copied to the host
        if not isinstance(src, StandIn) and to_device:
            return ("H2D copy",)
        return ()
    kinds = []
    if func in _READS:
        kinds.append("host read")
    if func in _DYNAMIC:
        kinds.append("dynamic shape")
    if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
        kinds.append("dynamic shape")
    if func in _INDEX and any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]
    ):
        kinds.append("dynamic shape")
    if any(a.dim() > 0 for a in host):
        kinds.append("device mismatch")
    return tuple(kinds)


def _apply(func, args, kwargs, recorder: Recorder | None):
    leaves = tree_leaves((args, kwargs))
    ours = any(isinstance(a, StandIn) for a in leaves)
    if not ours and not _is_device(kwargs.get("device")):
        return func(*args, **kwargs)  # host-only work (the CPU tensors of the code or the test)
    for a in leaves:
        if isinstance(a, torch.Tensor) and not isinstance(a, StandIn) and a.device.type != "cpu":
            raise RuntimeError(f"{func}: a {a.device} tensor without values reached the stand-in")
    if recorder is not None:
        for kind in _classify(func, args, kwargs):
            recorder.record(kind, str(func))
    out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
    if func is aten._to_copy.default and not _is_device(
        kwargs.get("device", DEVICE if ours else "cpu")
    ):
        return out  # a copy to the host is a host tensor
    if func is aten.copy_.default and not isinstance(args[0], StandIn):
        return args[0]
    if func in _EMPTY and out.is_floating_point():
        out.fill_(math.nan)
    inputs = {id(a.elem): a for a in leaves if isinstance(a, StandIn)}

    def wrap(o: object) -> object:
        if not isinstance(o, torch.Tensor):
            return o
        if id(o) in inputs:  # an in-place operation returns its (wrapped) input
            return inputs[id(o)]
        return StandIn(o)

    return tree_map(wrap, out)


class _BeforeDispatch(TorchFunctionMode):
    """What torch does before its dispatch, so that the recorder never sees it as an operation:
    ``torch.tensor`` / ``as_tensor`` / ``asarray`` / ``Tensor.new_tensor`` of host data (Python
    numbers, lists, CPU tensors) aimed at the device, an ``H2D copy`` here (a stand-in of the
    data made on the host); ``Tensor.tolist`` of a stand-in, a ``host read``; its
    ``Tensor.numpy``, refused as torch refuses a CUDA tensor's."""

    _MAKERS: ClassVar = (torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor)

    def __init__(self, recorder: Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.tolist, torch.Tensor.numpy) and isinstance(args[0], StandIn):
            if func is torch.Tensor.numpy:
                raise TypeError(f"can't convert {DEVICE.type} device type tensor to numpy")
            self.recorder.record("host read", "tolist")
            return args[0].elem.tolist()
        if func not in self._MAKERS:
            return func(*args, **kwargs)
        method = func is torch.Tensor.new_tensor
        data = args[1] if method else (args[0] if args else kwargs.get("data", kwargs.get("obj")))
        device = kwargs.get("device", args[0].device if method else None)
        if isinstance(data, torch.Tensor) and device is None and not method:
            device = data.device
        if not _is_device(device) or any(isinstance(a, StandIn) for a in tree_leaves(data)):
            return func(*args, **kwargs)
        self.recorder.record("H2D copy", func.__name__)
        grad = kwargs.pop("requires_grad", False)
        kwargs["device"] = torch.device("cpu")
        if method:
            kwargs.setdefault("dtype", args[0].dtype)
            out = torch.as_tensor(data, **kwargs)
        else:
            out = func(*args, **kwargs)
        # (a copy, as the device's tensor is: never the caller's host tensor itself)
        return StandIn(out.clone() if out is data else out, requires_grad=grad)


class Recorder(TorchDispatchMode):
    """Records the host round trips of the code run under it (module docstring)."""

    def __init__(self, source: str = _SRC) -> None:
        super().__init__()
        self.events: list[Event] = []
        self.phase = "forward"
        self.source = source  # the code whose events count (default: src/rlops)
        self._before = _BeforeDispatch(self)

    def __enter__(self):
        self._before.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._before.__exit__(*exc)

    def record(self, kind: str, op: str) -> None:
        where = _frame(self.source)
        if where is None:
            if self.phase == "forward":
                return  # the test's own input construction
            where = "(autograd)"
        self.events.append(Event(kind, op, where, self.phase))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _apply(func, args, kwargs or {}, self)


# --------------------------------------------------------------------------- Triton
@dataclasses.dataclass(frozen=True)
class Launch:
    """A kernel launch: its name, grid, and the device types of its tensor arguments."""

    kernel: str
    grid: tuple
    devices: tuple[str, ...]

    def problems(self) -> list[str]:
        bad = [f"grid entry {g!r} is not an int" for g in self.grid if type(g) is not int]
        if self.devices != (DEVICE.type,):
            bad.append(f"tensor arguments on {self.devices}")
        return bad


class _CudaLike:
    """What the log-prob method resolution reads of the logits: a CUDA device."""

    device = torch.device("cuda")


@contextlib.contextmanager
def cuda_dispatch(launches: list[Launch]) -> Iterator[None]:
    """rlops's dispatch decides for stand-in tensors as for CUDA tensors; each kernel launch
    is appended to ``launches`` instead of run (module docstring)."""
    from rlops import _backends
    from rlops.logprobs import _options as _method
    from rlops.scan import _dispatch as dispatch

    table_method, resolve = dispatch.Table.method, _method.resolve

    def method(self, name, case):
        if case.device.type == DEVICE.type:
            case = dataclasses.replace(case, device=torch.device("cuda"))
        return table_method(self, name, case)

    def resolve_as_cuda(name, x):
        return resolve(name, _CudaLike() if x.device.type == DEVICE.type else x)

    def launch(kernel, grid, *args, **meta):
        devices = tuple(sorted({a.device.type for a in args if isinstance(a, torch.Tensor)}))
        name = getattr(kernel, "__name__", None) or getattr(kernel.fn, "__name__", str(kernel))
        launches.append(Launch(name, tuple(grid), devices))

    launch._standin = True  # type: ignore[attr-defined]
    real = _backends.launch
    while getattr(real, "_standin", False):  # (not expected: contexts do not nest)
        real = real.__wrapped__
    launch.__wrapped__ = real  # type: ignore[attr-defined]

    def users():  # every rlops module holding the launcher (imported during a call too)
        for m in list(sys.modules.values()):
            if getattr(m, "__name__", "").startswith("rlops"):
                f = getattr(m, "launch", None)
                if f is real or getattr(f, "_standin", False):
                    yield m

    dispatch.Table.method = method  # type: ignore[method-assign]
    _method.resolve = resolve_as_cuda
    for m in users():
        m.launch = launch
    try:
        yield
    finally:
        dispatch.Table.method = table_method  # type: ignore[method-assign]
        _method.resolve = resolve
        for m in users():
            m.launch = real


@contextlib.contextmanager
def triton_aside() -> Iterator[None]:
    """The Triton backend set aside for the process, as a build failure does."""
    from rlops import _backends

    before = _backends._failed.get("triton")
    _backends._failed["triton"] = "set aside by the device stand-in test"
    try:
        yield
    finally:
        if before is None:
            _backends._failed.pop("triton", None)
        else:
            _backends._failed["triton"] = before


# --------------------------------------------------------------------------- running a case
def flat(out: object) -> list[torch.Tensor]:
    """Every tensor of a result (tuples, lists, dicts of metrics), in a fixed order."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for k in sorted(out, key=str) for t in flat(out[k])]
    if isinstance(out, (tuple, list)):
        return [t for part in out for t in flat(part)]
    return []


@dataclasses.dataclass
class Result:
    """A case's outputs, events and launches; ``backward``: whether a backward ran."""

    outputs: list[torch.Tensor]
    events: list[Event]
    launches: list[Launch]
    backward: bool


def run(call: Callable[[], Any], *, triton: bool, checks: bool) -> Result:
    """``call()`` under a :class:`Recorder`, then the backward of every output that requires
    grad (the sum of each); ``triton``: Triton routed as on CUDA (else set aside);
    ``checks``: ``RLOPS_CHECK_VALUES=1``. Exceptions propagate."""
    launches: list[Launch] = []
    recorder = Recorder()
    env = os.environ.get("RLOPS_CHECK_VALUES")
    os.environ["RLOPS_CHECK_VALUES"] = "1" if checks else "0"
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(cuda_dispatch(launches))
            if not triton:
                stack.enter_context(triton_aside())
            with recorder:
                outs = flat(call())
                live = [o for o in outs if o.requires_grad and o.is_floating_point()]
                if live:
                    recorder.phase = "backward"
                    sum(o.float().sum() for o in live).backward()  # type: ignore[union-attr]
    finally:
        if env is None:
            os.environ.pop("RLOPS_CHECK_VALUES", None)
        else:
            os.environ["RLOPS_CHECK_VALUES"] = env
    return Result(outs, recorder.events, launches, bool(live))
