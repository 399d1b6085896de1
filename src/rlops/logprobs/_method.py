"""Which producer runs a call of the op on logits: ``method="auto" | "chunked" | "triton"``.

- ``"chunked"``: the torch operations on chunks of rows (any device, double backward).
- ``"triton"``: the Triton kernels (:mod:`rlops.logprobs.triton`) on CUDA tensors, or on CPU
  tensors under the Triton interpreter (``TRITON_INTERPRET=1`` set before triton is imported),
  so that tests and users can reach them without a GPU. Needs the ``gpu`` extra.
- ``"auto"``: Triton on CUDA tensors when triton can be imported, else chunked; chunked on
  ROCm (the kernels build for AMD but have not run on one: see docs/gpu.md) and while
  ``torch.compile`` traces the call (the chunk engine is plain torch there).

A kernel that fails to build on this machine (whatever its first launch raises while it builds:
:class:`rlops._backends.KernelBuildError`) sets the triton backend aside, in the one record that
every Triton op reads (:mod:`rlops._backends`: a scan kernel that failed sets the log-prob
kernels aside too, and the other way round): the call that met the error warns once
(``RuntimeWarning`` naming the error) and finishes on the chunked maths, and every later call,
``"triton"`` included, runs chunked for the rest of the process. Errors of the interpreter (a
kernel's bug, not a build failure) and running out of memory propagate.
"""

from __future__ import annotations

import torch

import rlops._backends as _backends
from rlops._checks import check_choice

__all__ = ["METHODS", "failed", "resolve", "set_failed", "triton_available"]

METHODS = ("auto", "chunked", "triton")


def triton_available() -> bool:
    """Whether triton can be imported."""
    return _backends.triton_importable()


def failed() -> str | None:
    """The error that set the triton backend aside in this process, or None."""
    return _backends.failed("triton")


def resolve(method: object, x: torch.Tensor) -> str:
    """The producer of a call on ``x`` (the logits): ``"chunked"`` or ``"triton"``.

    ``"triton"`` asked where it cannot run raises ValueError saying why; after a build failure
    it runs chunked (module docstring)."""
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
