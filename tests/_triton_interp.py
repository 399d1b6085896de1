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

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np
import pytest

triton = pytest.importorskip("triton")

__all__ = ["triton", "vectorised_scan"]


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
        prev = [self.to_tensor(np.roll(x, d, axis=axis), dt)
                for x, dt in zip(data, dtypes, strict=True)]
        cur = [self.to_tensor(x, dt) for x, dt in zip(data, dtypes, strict=True)]
        with np.errstate(all="ignore"):
            out = self.combine_fn.fn(*prev, *cur)
        out = out if isinstance(out, tuple) else (out,)
        keep = (np.arange(n) >= d).reshape([-1 if i == axis else 1 for i in range(data[0].ndim)])
        data = [np.where(keep, np.broadcast_to(o.handle.data, x.shape), x)
                for x, o in zip(data, out, strict=True)]
        d *= 2
    return [self.to_tensor(x, dt) for x, dt in zip(data, dtypes, strict=True)]


try:
    from triton.runtime.interpreter import ScanOps
except ImportError:  # pragma: no cover - a triton without the interpreter's class
    ScanOps = None
if ScanOps is not None and hasattr(ScanOps, "generic_scan"):
    ScanOps.generic_scan = vectorised_scan
