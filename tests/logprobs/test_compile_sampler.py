"""Every option of both log-prob ops under ``torch.compile(fullgraph=True)``, forward and
backward, equal to eager.

The options are grouped so that each compile covers several (compiling is the slow part):
top-p (once refused: a ``cumsum(..., out=)`` into a non-contiguous slice), top-k with min-p,
per-token top-k and top-p, ``keep_mask``, CSR support sets, a row ``mask``, Σπ², the bias and the
temperature. ``backend="aot_eager"`` traces the backward too, without Inductor (Inductor itself
is tests/api/test_compile.py's). ``dynamic=True`` with a row mask: a new number of valid rows
costs no recompile (the compiled path never reads it).
"""

from __future__ import annotations

import pytest
import torch

from rlops.logprobs import linear_logprobs_and_entropy, logprobs_and_entropy

pytestmark = pytest.mark.slow

N, V, H = 10, 17, 4


def _data(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0, 1, 1, 3, 5, 6, 6, 8, 9, 9, 12])
    return {
        "logits": torch.randn(N, V, generator=g, dtype=torch.float64) * 2,
        "hidden": torch.randn(N, H, generator=g, dtype=torch.float64),
        "weight": torch.randn(V, H, generator=g, dtype=torch.float64),
        "bias": torch.randn(V, generator=g, dtype=torch.float64),
        "target": torch.randint(0, V, (N,), generator=g),
        "mask": torch.rand(N, generator=g) < 0.6,
        "keep": torch.rand(N, V, generator=g) < 0.5,
        "ids": torch.randint(0, V, (12,), generator=g),
        "offsets": offsets,
        "k": torch.randint(1, V, (N,), generator=g),
        "p": torch.rand(N, generator=g, dtype=torch.float64) * 0.5 + 0.5,
    }


GROUPS = {
    "top_p, mask, temperature, sum_pi_squared": lambda d: {
        "top_p": 0.8,
        "mask": d["mask"],
        "temperature": 0.7,
        "with_sum_pi_squared": True,
    },
    "top_k, min_p, over support": lambda d: {
        "top_k": 4,
        "min_p": 0.05,
        "entropy_over_support": True,
    },
    "per-token top_k and top_p": lambda d: {"top_k": d["k"], "top_p": d["p"]},
    "keep_mask, mask": lambda d: {"keep_mask": d["keep"], "mask": d["mask"]},
    "csr, mask, sum_pi_squared": lambda d: {
        "support_ids": d["ids"],
        "support_offsets": d["offsets"],
        "mask": d["mask"],
        "with_sum_pi_squared": True,
    },
}


def _run(fn, leaves):
    xs = [x.clone().requires_grad_() for x in leaves]
    outs = fn(*xs)
    (outs[0].sum() + 0.5 * outs[1].sum()).backward()
    return [o.detach() for o in outs], [x.grad for x in xs]


def _compare(fn, leaves):
    torch._dynamo.reset()
    got = _run(torch.compile(fn, fullgraph=True, backend="aot_eager"), leaves)
    want = _run(fn, leaves)
    for a, b in zip(got[0] + got[1], want[0] + want[1], strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", list(GROUPS))
def test_logits_op_compiles_with_each_option(name):
    d = _data()
    kw = GROUPS[name](d)
    _compare(lambda x: logprobs_and_entropy(x, d["target"], **kw), [d["logits"]])


@pytest.mark.parametrize("name", list(GROUPS))
def test_linear_op_compiles_with_each_option_and_a_bias(name):
    d = _data(1)
    kw = GROUPS[name](d)
    _compare(
        lambda h, w, b: linear_logprobs_and_entropy(h, w, d["target"], bias=b, **kw),
        [d["hidden"], d["weight"], d["bias"]],
    )


def test_no_recompile_when_the_number_of_valid_rows_changes():
    from torch._dynamo.utils import counters

    d = _data(2)
    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(
        lambda x, t, m: logprobs_and_entropy(x, t, mask=m),
        fullgraph=True,
        dynamic=True,
        backend="aot_eager",
    )
    for valid in (3, 7, 1, 9):
        mask = torch.zeros(N, dtype=torch.bool)
        mask[:valid] = True
        logp, ent = f(d["logits"], d["target"], mask)
        want = logprobs_and_entropy(d["logits"], d["target"], mask=mask)
        torch.testing.assert_close(logp, want[0])
        torch.testing.assert_close(ent, want[1])
    assert counters["stats"]["unique_graphs"] == 1
