"""Triton under its CPU interpreter for the tests: ``TRITON_INTERPRET=1`` set before triton is
imported, and a faster generic scan.

The interpreter runs ``tl.associative_scan`` with a user combine function one element at a
time in Python (about a millisecond per element for the scan kernels' tuples), which would
make a test at T = 4096 take minutes. :func:`vectorised_scan` runs the *same* combine
function over whole arrays in log2(n) doubling steps (Hillis-Steele), the tree order a GPU's
scan uses rather than the serial one; the kernels' own code is unchanged. It is installed
only where the interpreter has the method it replaces (a newer triton that drops it runs the
slow original).
"""

from __future__ import annotations

import os
import zlib

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

__all__ = ["random_decay", "seeded", "triton", "vectorised_scan"]


def vectorised_scan(self, inputs):
    """Inclusive scan of ``inputs`` (a tuple of interpreter tensors) along ``self.axis`` with
    ``self.combine_fn(earlier_acc..., current...)``, in doubling steps."""
    data = [np.ascontiguousarray(a.handle.data) for a in inputs]
    dtypes = [a.dtype for a in inputs]
    axis = self.axis
    n = data[0].shape[axis]
    d = 1
    while d < n:
        # element i combines with i - d; the first d lanes compute on a wrapped partner and are
        # discarded (block shapes must stay powers of two)
        prev = [
            self.to_tensor(np.roll(x, d, axis=axis), dt) for x, dt in zip(data, dtypes, strict=True)
        ]
        cur = [self.to_tensor(x, dt) for x, dt in zip(data, dtypes, strict=True)]
        with np.errstate(all="ignore"):
            out = self.combine_fn.fn(*prev, *cur)
        out = out if isinstance(out, tuple) else (out,)
        keep = (np.arange(n) >= d).reshape([-1 if i == axis else 1 for i in range(data[0].ndim)])
        data = [
            np.where(keep, np.broadcast_to(o.handle.data, x.shape), x)
            for x, o in zip(data, out, strict=True)
        ]
        d *= 2
    return [self.to_tensor(x, dt) for x, dt in zip(data, dtypes, strict=True)]


try:
    from triton.runtime.interpreter import ScanOps
except ImportError:  # pragma: no cover - a triton without the interpreter's class
    ScanOps = None
if ScanOps is not None and hasattr(ScanOps, "generic_scan"):
    ScanOps.generic_scan = vectorised_scan


def seeded(*key) -> torch.Generator:
    """A generator seeded from ``key`` (the same inputs for the same test case in every run)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def random_decay(kind, d, b, t, dtype, gen):
    """A discount of ``kind``: the float ``d`` ("scalar"), ``d`` scaled per row ``[b, 1]``
    ("row"), or per token ``[b, t]`` ("token": mostly ``d``, some random, 2% exact cuts)."""
    if kind == "scalar":
        return d
    if kind == "row":
        return (d * (1 - 0.1 * torch.rand(b, 1, generator=gen, dtype=torch.float64))).to(dtype)
    a = torch.full((b, t), d, dtype=torch.float64)
    u = torch.rand(b, t, generator=gen, dtype=torch.float64)
    a = torch.where(u < 0.1, d * torch.rand(b, t, generator=gen, dtype=torch.float64), a)
    return torch.where(u < 0.02, 0.0, a).to(dtype)  # exact cuts
