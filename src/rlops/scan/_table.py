"""The scan family's dispatch table, :data:`SCAN` (a module of its own so that the package and
its operator, ``_op.py``, both import it without a cycle).
"""

from __future__ import annotations

from rlops.scan import compiled
from rlops.scan._dispatch import CHUNKED, COMPILED, REFERENCE, TRITON, Row, Table
from rlops.scan.chunked import scan_chunked
from rlops.scan.reference import scan_reference


def _reference(method, x, decay, chunk_size):
    return scan_reference(x, decay)


def _chunked(method, x, decay, chunk_size):
    return scan_chunked(x, decay, chunk_size)


def _compiled(method, x, decay, chunk_size):
    return compiled.scan_compiled(x, decay)


def _triton(method, x, decay, chunk_size):
    from rlops.scan.triton import reverse_scan  # triton is imported on first use only

    return reverse_scan(x, decay)


SCAN = Table(
    "discounted_cumsum",
    [
        Row((REFERENCE,), _reference, small_ops=True),
        Row((COMPILED,), _compiled),
        Row((TRITON,), _triton),  # every decay (a zero one cuts exactly); autograd
        Row((CHUNKED,), _chunked, small_ops=True),
    ],
)
