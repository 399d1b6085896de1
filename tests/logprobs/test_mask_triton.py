"""``mask=`` with ``method="triton"`` (the kernels under the interpreter): the outputs and the
gradient equal the chunked method's, exact zeros on the masked rows, whatever those logits hold.
"""

from __future__ import annotations

import pytest
import torch
from tests._triton_interp import triton  # noqa: F401  (sets TRITON_INTERPRET=1 first)

from rlops.logprobs import logprobs_and_entropy

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.mark.parametrize(
    "kw", [{}, {"keep_mask": True, "with_sum_pi_squared": True}, {"top_p": 0.8, "temperature": 0.7}]
)
def test_triton_with_a_mask_equals_the_chunked_method(kw):
    g = torch.Generator().manual_seed(0)
    n, v = 37, 300
    logits = torch.randn(n, v, generator=g) * 3
    target = torch.randint(0, v, (n,), generator=g)
    mask = torch.rand(n, generator=g) < 0.3
    logits[~mask] = float("nan")  # masked rows may hold anything
    kw = dict(kw)
    if kw.get("keep_mask") is True:
        kw["keep_mask"] = torch.rand(n, v, generator=g) < 0.5
    grads = [torch.randn(n, generator=g) for _ in range(2)]
    res = []
    for method in ("triton", "chunked"):
        x = logits.clone().requires_grad_()
        outs = logprobs_and_entropy(x, target, mask=mask, method=method, **kw)
        torch.autograd.backward(list(outs[:2]), grads)
        res.append(([o.detach() for o in outs], x.grad))
    (a, ga), (b, gb) = res
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(p, q)
        assert torch.equal(p[~mask], torch.zeros_like(p[~mask]))
    torch.testing.assert_close(ga, gb)
    assert torch.equal(ga[~mask], torch.zeros_like(ga[~mask]))
