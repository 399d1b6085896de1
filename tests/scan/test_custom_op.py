"""The scan as the operator ``rlops::reverse_scan`` (what ``torch.compile`` sees of the scan).

Its forward is the scan's table run eagerly; its gradient is registered beside it as the
adjoint scan (forward in time). Checked here against the definition (``scan_reference`` and
autograd through it in float64), at odd lengths, with exact cuts, and with
``torch.library.opcheck`` (the fake implementation, the schema, the autograd registration).
"""

from __future__ import annotations

import pytest
import torch

from rlops.scan._op import _reverse_scan, reverse_scan_op
from rlops.scan.reference import scan_reference


def _inputs(n: int, t: int, per_token: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, t, generator=g, dtype=torch.float64)
    shape = (n, t) if per_token else (n, 1)
    a = torch.rand(*shape, generator=g, dtype=torch.float64)
    return x, a


@pytest.mark.parametrize("t", [1, 2, 127, 128, 129])
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("method", ["auto", "chunked", "reference"])
def test_value_and_gradient_equal_the_definition(t, per_token, method):
    x, a = _inputs(3, t, per_token)
    a[0, 0] = 0.0  # an exact cut (per row: the whole row)
    x_ref, a_ref = x.clone().requires_grad_(), a.clone().requires_grad_()
    y_ref = scan_reference(x_ref, a_ref if per_token and t > 1 else a_ref.expand(3, t))
    w = torch.randn(3, t, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (y_ref * w).sum().backward()

    x_op, a_op = x.clone().requires_grad_(), a.clone().requires_grad_()
    y_op = reverse_scan_op(x_op, a_op, method, None)
    (y_op * w).sum().backward()
    torch.testing.assert_close(y_op, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x_op.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    # the decay's gradient is 0 at an exact cut (as on every path), else the definition's
    expected = a_ref.grad.clone()
    expected[a == 0] = 0.0
    torch.testing.assert_close(a_op.grad, expected, rtol=1e-10, atol=1e-12)


def test_a_cut_keeps_nan_beyond_it_out_of_value_and_gradient():
    x = torch.tensor([[1.0, 2.0, float("nan"), 4.0]], dtype=torch.float64, requires_grad=True)
    a = torch.tensor([[0.5, 0.0, 0.5, 0.5]], dtype=torch.float64)
    y = reverse_scan_op(x, a, "auto", None)
    assert y[0, :2].tolist() == [2.0, 2.0]  # y1 = 2 (cut), y0 = 1 + 0.5·2
    y[0, :2].sum().backward()
    assert x.grad[0].tolist() == [1.0, 1.5, 0.0, 0.0]


def test_a_float_decay_is_one_per_row():
    x = torch.tensor([[1.0, 1.0, 1.0]])
    assert reverse_scan_op(x, 0.5, "chunked", None).tolist() == [[1.75, 1.5, 1.0]]


@pytest.mark.parametrize("per_token", [False, True])
def test_opcheck(per_token):
    x, a = _inputs(2, 37, per_token)
    torch.library.opcheck(_reverse_scan, (x.requires_grad_(), a.requires_grad_(), "chunked", 0))
