"""On ROCm, ``method="auto"`` keeps the chunked path; ``method="triton"`` still runs the kernels.

A ROCm build of torch names its devices ``cuda`` (``torch.version.hip`` set). The kernels build
for gfx942 and gfx950 (``tests/gpu/test_build_targets.py``) but no AMD device has run them,
and their reductions follow wave64 trees (other bits than NVIDIA's): auto picks them on an
NVIDIA build only (docs/gpu.md, "ROCm"). Checked with ``torch.version.hip`` monkeypatched, on
the choice each table of the scan family makes for a CUDA case, and on the log-prob ops'
choice of producer.
"""

from __future__ import annotations

import pytest
import torch
from tests._triton_interp import triton  # noqa: F401  (sets TRITON_INTERPRET=1 first)

from rlops import _backends
from rlops.advantages.reinforce import REINFORCE
from rlops.advantages.returns import RETURNS
from rlops.logprobs import _options as _method
from rlops.scan import SCAN
from rlops.scan._dispatch import Case

TABLES = {"scan": SCAN, "returns": RETURNS, "reinforce": REINFORCE}
CUDA = torch.device("cuda")


@pytest.fixture
def rocm(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)
    monkeypatch.setattr(_backends, "_failed", {})


@pytest.fixture
def nvidia(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(_backends, "_failed", {})


def test_rocm_is_read_from_torch(rocm):
    assert _backends.rocm()
    assert not _backends.auto_triton(CUDA)
    assert not _backends.auto_triton(torch.device("cpu"))


@pytest.mark.parametrize("table", TABLES)
def test_auto_keeps_the_chunked_path_on_rocm(rocm, table):
    case = Case(CUDA, torch.float32)
    assert TABLES[table].method("auto", case) == "chunked"
    assert TABLES[table].method("triton", case) == "triton"  # explicit: the kernels run


@pytest.mark.parametrize("table", TABLES)
def test_auto_picks_triton_on_an_nvidia_build(nvidia, table):
    assert not _backends.rocm() and _backends.auto_triton(CUDA)
    assert TABLES[table].method("auto", Case(CUDA, torch.float32)) == "triton"


class _CudaLogits:
    device = CUDA  # all that the choice of producer reads of the logits


def test_the_logprob_ops_keep_the_chunked_producer_on_rocm(rocm):
    assert _method.resolve("auto", _CudaLogits()) == "chunked"
    assert _method.resolve("triton", _CudaLogits()) == "triton"


def test_the_logprob_ops_pick_triton_on_an_nvidia_build(nvidia):
    assert _method.resolve("auto", _CudaLogits()) == "triton"
