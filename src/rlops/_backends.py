"""What the ops' compiled backends share: the one record of the backends that could not be
built in this process, and how a Triton kernel is launched.

**The record.** A backend (``"triton"``, ``"compiled"``) whose kernel cannot be built on this
machine is set aside once, for every op family of the process (the scan, the estimators, the
log-prob ops): :func:`set_failed` warns once (``RuntimeWarning`` naming the error) and
:func:`failed` reports it, so every later call runs the chunked method.

**Launching Triton.** :func:`launch` runs a kernel under its tensors' device
(``torch.cuda.device``: a launch goes to that device's current stream, not to whichever
device is current) and turns whatever the first launch raises while it builds the kernel —
triton's compilation, resource and assembler errors, and the plain ``RuntimeError`` its
compiler passes raise (``PassManager::run failed``) — into :class:`KernelBuildError`, the one
error the callers catch. Not the interpreter's errors (a kernel's own bug, which must surface)
nor running out of device memory (a property of the call, not of the machine).

Launch arguments are device tensors and Python numbers only (scalars as kernel arguments or
``torch.full`` fills): no host-to-device copy, so no stream synchronisation and nothing that
breaks CUDA-graph capture.

**ROCm.** A ROCm build of torch (``torch.version.hip`` set) names its devices ``cuda`` too.
The kernels build for AMD's gfx942 and gfx950 (``tests/gpu/test_build_targets.py``) but have
never run on an AMD device, and their reductions follow wave64 trees, so their bits are not
NVIDIA's: :func:`auto_triton` keeps ``method="auto"`` on the chunked path there, while an
explicit ``method="triton"`` runs them (docs/gpu.md, "ROCm").
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch

_lock = threading.Lock()
_failed: dict[str, str] = {}  # backend name -> the error that set it aside (set once, kept)


class KernelBuildError(RuntimeError):
    """A kernel could not be built (or loaded) on this machine; ``__cause__`` is triton's."""


def failed(backend: str) -> str | None:
    """The error that set ``backend`` aside in this process, or None."""
    return _failed.get(backend)


def failed_names() -> tuple[str, ...]:
    """The names of the backends set aside in this process (what a dispatch depends on)."""
    return tuple(_failed)


def failures() -> dict[str, str]:
    """Every backend set aside in this process, with the error that did it."""
    return dict(_failed)


def set_failed(backend: str, error: BaseException, what: str, *, stacklevel: int = 2) -> None:
    """Set ``backend`` aside for the rest of the process; the first caller warns, naming
    ``what`` failed and the error (the cause of a :class:`KernelBuildError`)."""
    cause = error.__cause__ if isinstance(error, KernelBuildError) and error.__cause__ else error
    reason = f"{type(cause).__name__}: {cause}"
    with _lock:
        first = backend not in _failed
        if first:
            _failed[backend] = reason
    if first:
        warnings.warn(
            f"rlops: {what} failed to compile on this machine ({reason[:300]}); using the "
            "chunked method for the rest of the process",
            RuntimeWarning,
            stacklevel=stacklevel + 1,
        )


def triton_importable() -> bool:
    """Whether triton can be imported (asked at each call: cheap once it is imported)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def rocm() -> bool:
    """Whether this torch is a ROCm build (its ``cuda`` devices are AMD GPUs)."""
    return getattr(torch.version, "hip", None) is not None


def auto_triton(device: torch.device) -> bool:
    """Whether ``method="auto"`` may pick the Triton kernels for tensors on ``device``: CUDA
    devices of an NVIDIA build of torch; not a ROCm build's (module docstring)."""
    return device.type == "cuda" and not rocm()


def warp_size() -> int:
    """Threads per warp of the target triton compiles for (64 on AMD's wave64 GPUs), from its
    active driver; 32 where no driver is active (the interpreter on a machine without one)."""
    from triton.runtime.driver import driver

    try:
        return int(driver.active.get_current_target().warp_size)
    except RuntimeError:  # no GPU driver: the interpreter, where warps mean nothing
        return 32


def interpreted() -> bool:
    """Whether Triton runs CPU tensors (its interpreter, ``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def is_build_error(error: BaseException) -> bool:
    """Whether ``error``, raised by a kernel's launch, means the kernel cannot be built here
    (module docstring): triton's own errors and plain ``RuntimeError``; not the
    interpreter's, not running out of memory."""
    if isinstance(error, torch.OutOfMemoryError) or not isinstance(error, Exception):
        return False
    import triton
    from triton.runtime import errors

    interpreter = getattr(errors, "InterpreterError", None)  # absent from an older triton
    if interpreter is not None and isinstance(error, interpreter):
        return False
    from triton.compiler.errors import CompilationError

    own: type = getattr(getattr(triton, "errors", None), "TritonError", CompilationError)
    return isinstance(error, (own, RuntimeError))


@contextlib.contextmanager
def device_guard(t: torch.Tensor) -> Iterator[None]:
    """Make ``t``'s CUDA device current (a no-op for CPU tensors under the interpreter)."""
    if t.device.type == "cuda":
        with torch.cuda.device(t.device):
            yield
    else:
        yield


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> Any:
    """``kernel[grid](*args, **meta)`` under the device of ``args[0]`` (a tensor); a build
    failure raises :class:`KernelBuildError` from triton's error."""
    with device_guard(args[0]):
        try:
            return kernel[grid](*args, **meta)
        except Exception as e:
            if is_build_error(e):
                raise KernelBuildError(f"{type(e).__name__}: {e}") from e
            raise
