"""Which producer runs a call of the op on logits: ``method="auto" | "chunked" | "triton"``.

- ``"chunked"``: the torch operations on chunks of rows (any device, double backward).
- ``"triton"``: the Triton kernels (:mod:`rlops.logprobs.triton`) on CUDA tensors, or on CPU
  tensors under the Triton interpreter (``TRITON_INTERPRET=1`` set before triton is imported),
  so that tests and users can reach them without a GPU. Needs the ``gpu`` extra.
- ``"auto"``: Triton on CUDA tensors when triton can be imported, else chunked; chunked while
  ``torch.compile`` traces the call (the chunk engine is plain torch there).

A kernel that fails to build on this machine (a Triton compilation, resource or assembler error)
is set aside: the call that met the error warns once (``RuntimeWarning`` naming the error) and
finishes on the chunked maths, and every later call, ``"triton"`` included, runs chunked for the
rest of the process. Errors of the interpreter (a kernel's bug, not a build failure) and running
out of memory propagate.
"""

from __future__ import annotations

import os
import threading
import warnings

import torch

from rlops._checks import check_choice

__all__ = [
    "METHODS",
    "build_errors",
    "failed",
    "is_build_error",
    "resolve",
    "set_failed",
    "triton_available",
]

METHODS = ("auto", "chunked", "triton")

_lock = threading.Lock()
_failed: str | None = None  # why the kernels could not be built here (set once, kept)


def triton_available() -> bool:
    """Whether triton can be imported."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def failed() -> str | None:
    """The error that set the kernels aside in this process, or None."""
    return _failed


def resolve(method: object, x: torch.Tensor) -> str:
    """The producer of a call on ``x`` (the logits): ``"chunked"`` or ``"triton"``.

    ``"triton"`` asked where it cannot run raises ValueError saying why; after a build failure
    it runs chunked (module docstring)."""
    check_choice("method", method, METHODS)
    if method == "chunked":
        return "chunked"
    if method == "auto":
        usable = (
            x.device.type == "cuda"
            and _failed is None
            and not torch.compiler.is_compiling()
            and triton_available()
        )
        return "triton" if usable else "chunked"
    if not triton_available():
        raise ValueError(
            'method="triton" needs the triton package: pip install "rlops[gpu]" '
            '(or use method="chunked")'
        )
    if x.device.type == "cpu" and not _interpreted():
        raise ValueError(
            'method="triton" runs on CUDA tensors; on CPU tensors only under the Triton '
            "interpreter (TRITON_INTERPRET=1 set before triton is imported). Got CPU logits: "
            'use method="chunked" (or "auto")'
        )
    if x.device.type not in ("cuda", "cpu"):
        raise ValueError(f'method="triton" runs on CUDA tensors, got device {x.device}')
    return "chunked" if _failed is not None else "triton"


def build_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean "this kernel cannot be built here": triton's own errors
    (compilation, out of resources, the assembler) and the RuntimeError its compiler passes
    raise. The interpreter's errors are filtered out by :func:`is_build_error`."""
    from triton.compiler.errors import CompilationError

    try:
        from triton.errors import TritonError
    except ImportError:  # pragma: no cover - an older triton
        return (CompilationError, RuntimeError)
    return (TritonError, RuntimeError)


def is_build_error(error: BaseException) -> bool:
    """Whether ``error``, raised around a kernel launch, is a build failure: not the
    interpreter's report of a kernel's own error (a bug, which must surface), nor running out
    of device memory (a property of the call, not of the machine)."""
    if isinstance(error, torch.OutOfMemoryError):
        return False
    try:
        from triton.runtime.errors import InterpreterError
    except ImportError:  # pragma: no cover - a triton without the interpreter's class
        return True
    return not isinstance(error, InterpreterError)


def set_failed(error: BaseException) -> None:
    """Set the kernels aside for the rest of the process; warn once (the first caller)."""
    global _failed
    with _lock:
        first = _failed is None
        if first:
            _failed = f"{type(error).__name__}: {error}"
    if first:
        warnings.warn(
            "rlops: the Triton log-prob kernel failed to build on this machine "
            f"({type(error).__name__}: {str(error)[:300]}); using the chunked method for the "
            "rest of the process",
            RuntimeWarning,
            stacklevel=2,
        )
