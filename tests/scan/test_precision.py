"""The chunked scan keeps float32 matrix products in full precision without touching any
process-wide setting.

With the process set to let float32 products run reduced (TF32 / bfloat16 inside), two threads
run the chunked scan while a third watches every matmul-precision flag: none ever changes, and
the results keep the float32 accuracy rule of ``tests/tolerances.py`` against the float64
oracle. The check does not depend on timing: a correct scan never writes a flag, whatever
the interleaving.
"""

from __future__ import annotations

import threading

import pytest
import torch
from tests.oracles import discounted_cumsum_oracle
from tests.tolerances import assert_within_reference

import rlops

DEVICES = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])


def _flags() -> tuple:
    b = torch.backends
    return (
        b.fp32_precision,
        b.cuda.matmul.fp32_precision,
        b.mkldnn.fp32_precision,
        b.mkldnn.matmul.fp32_precision,
    )


@pytest.fixture
def reduced_precision():
    """The process lets float32 matmuls use TF32 (CUDA) and TF32/bf16 (oneDNN); put back."""
    b = torch.backends
    saved = (b.cuda.matmul.fp32_precision, b.mkldnn.matmul.fp32_precision)
    b.cuda.matmul.fp32_precision = "tf32"
    b.mkldnn.matmul.fp32_precision = "tf32"
    try:
        yield _flags()
    finally:
        b.cuda.matmul.fp32_precision, b.mkldnn.matmul.fp32_precision = saved


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_two_threads_scan_while_the_flags_stay_put(reduced_precision, device):
    g = torch.Generator().manual_seed(3)
    inputs = [
        (torch.randn(3, 1000, generator=g), 0.99),
        (torch.randn(8, 4097, generator=g), torch.rand(8, 1, generator=g)),
    ]
    seen: set = set()
    done = threading.Event()
    results: dict = {}
    errors: list = []

    def watch():
        while not done.is_set():
            seen.add(_flags())
        seen.add(_flags())

    def work(k):
        try:
            x, a = inputs[k]
            x = x.to(device)
            a = a.to(device) if isinstance(a, torch.Tensor) else a
            for _ in range(5):
                results[k] = rlops.discounted_cumsum(x, a, method="chunked").cpu()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    watcher = threading.Thread(target=watch)
    workers = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    watcher.start()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    done.set()
    watcher.join()
    assert not errors, errors
    assert seen == {reduced_precision}, seen
    for k, (x, a) in enumerate(inputs):
        oracle = discounted_cumsum_oracle(x, a)
        ref = rlops.discounted_cumsum(x, a, method="reference")
        assert_within_reference(f"input {k}", results[k], oracle, ref)


def test_default_precision_is_left_alone():
    before = _flags()
    rlops.discounted_cumsum(torch.randn(2, 300), 0.9, method="chunked")
    assert _flags() == before
