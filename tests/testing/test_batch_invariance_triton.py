"""The Triton log-prob kernels (under the CPU interpreter) pass the contract, with
``batch_invariance`` bitwise: a row's bits do not depend on the other rows, N or padding."""

from __future__ import annotations

import pytest
from tests._triton_interp import triton  # noqa: F401  (sets TRITON_INTERPRET=1 first)

import rlops
from rlops.logprobs import _options as _method
from rlops.testing import check_logprobs

# numpy on the interpreter's masked lanes (exp(-inf), log 0) warns
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def kernels(logits, target, temperature):
    return rlops.logprobs_and_entropy(logits, target, temperature=temperature, method="triton")


def test_the_kernels_pass_the_contract_bitwise():
    report = check_logprobs(kernels, vocab_sizes=(300,), rows=8, bitwise=True)
    assert _method.failed() is None, f"the kernels were set aside: {_method.failed()}"
    assert report, str(report)
    assert report["batch_invariance"].value == 0.0
