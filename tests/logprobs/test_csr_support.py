"""CSR support sets (``support_ids``, ``support_offsets``): exactly ``keep_mask`` with those
entries True (the target always kept), on both ops, never an ``[N, V]`` mask.

The expected values come from the definition: the same call with the dense ``keep_mask`` built
from the same sets, row by row in Python. Rows of 1 to 512 ids, an empty set (then only the
target is kept: ``logp = 0``), duplicate ids (a set: the same as once), ids on both sides of a
vocabulary shard boundary under tensor parallelism, and every bad input.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from tests._distributed import count_collectives, run_distributed

from rlops.logprobs import _support, linear_logprobs_and_entropy, logprobs_and_entropy

V, H = 600, 4


@pytest.fixture(params=["host", "device"])
def path(request, monkeypatch):
    """CPU reads the offsets to find each chunk's entries; elsewhere every entry is tested
    against the chunk (no host read), forced here."""
    if request.param == "device":
        monkeypatch.setattr(_support, "values_checked", lambda t: False)
    return request.param


def _sets(sizes, gen, vocab=V):
    return [torch.randperm(vocab, generator=gen)[:k] for k in sizes]


def _csr(sets, dtype=torch.int64):
    lengths = torch.tensor([len(s) for s in sets], dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    ids = torch.cat(sets) if sets else torch.zeros(0, dtype=torch.int64)
    return ids.to(dtype), offsets.to(dtype)


def _dense(sets, vocab=V):
    keep = torch.zeros(len(sets), vocab, dtype=torch.bool)
    for row, ids in enumerate(sets):
        for v in ids.tolist():
            keep[row, v] = True
    return keep


def _both(fn, leaves, kw_csr, kw_dense, grads):
    res = []
    for kw in (kw_csr, kw_dense):
        xs = [x.detach().clone().requires_grad_() for x in leaves]
        outs = fn(*xs, **kw)
        torch.autograd.backward(list(outs[:2]), grads)
        res.append(([o.detach() for o in outs], [x.grad for x in xs]))
    return res


SIZES = [1, 2, 20, 512, 0, 7, 1, 300, 3]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("chunk_size", [None, 4])
def test_equals_the_dense_keep_mask(dtype, index_dtype, chunk_size, path):
    g = torch.Generator().manual_seed(0)
    n = len(SIZES)
    sets = _sets(SIZES, g)
    ids, offsets = _csr(sets, index_dtype)
    logits = (torch.randn(n, V, generator=g) * 3).to(dtype)
    target = torch.randint(0, V, (n,), generator=g)
    grads = [
        torch.randn(n, generator=g).to(torch.float64 if dtype == torch.float64 else torch.float32)
        for _ in range(2)
    ]
    common = {"chunk_size": chunk_size, "with_sum_pi_squared": True, "temperature": 0.9}
    (a, ga), (b, gb) = _both(
        lambda x, **k: logprobs_and_entropy(x, target, **k),
        [logits],
        {**common, "support_ids": ids, "support_offsets": offsets},
        {**common, "keep_mask": _dense(sets)},
        grads,
    )
    for p, q in zip(a + ga, b + gb, strict=True):
        assert torch.equal(p, q)
    hidden = torch.randn(n, H, generator=g).to(dtype)
    weight = torch.randn(V, H, generator=g).to(dtype)
    bias = torch.randn(V, generator=g).to(dtype)
    (a, ga), (b, gb) = _both(
        lambda h, w, bb, **k: linear_logprobs_and_entropy(h, w, target, bias=bb, **k),
        [hidden, weight, bias],
        {**common, "support_ids": ids, "support_offsets": offsets},
        {**common, "keep_mask": _dense(sets)},
        grads,
    )
    for p, q in zip(a + ga, b + gb, strict=True):
        assert torch.equal(p, q)


def test_empty_sets_keep_only_the_target_and_duplicates_count_once(path):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, V, generator=g, dtype=torch.float64)
    target = torch.tensor([5, 6, 7, 8])
    ids = torch.tensor([3, 3, 9, 6, 6, 6, 2])  # row 0 empty; rows 1-3 with duplicates
    offsets = torch.tensor([0, 0, 3, 6, 7])
    logp = logprobs_and_entropy(logits, target, support_ids=ids, support_offsets=offsets)[0]
    assert logp[0] == 0.0  # the support is {target}: log 1
    z = logits[1]
    want = z[6] - torch.logsumexp(z[[3, 9, 6]], 0)  # {3, 9} and the target 6, each once
    torch.testing.assert_close(logp[1], want, rtol=0, atol=1e-15)
    z = logits[2]  # {6, 6, 6} with the target 7: {6, 7}
    torch.testing.assert_close(logp[2], z[7] - torch.logsumexp(z[[6, 7]], 0), rtol=0, atol=1e-15)
    dedup = torch.tensor([3, 9, 6, 2])  # the same sets without the repeats
    want = logprobs_and_entropy(
        logits, target, support_ids=dedup, support_offsets=torch.tensor([0, 0, 2, 3, 4])
    )[0]
    assert torch.equal(logp, want)


def test_with_a_row_mask(path):
    g = torch.Generator().manual_seed(2)
    n = 12
    sets = _sets([3, 0, 512, 1, 5, 9, 2, 2, 40, 1, 0, 6], g)
    ids, offsets = _csr(sets)
    logits = torch.randn(n, V, generator=g, dtype=torch.float64)
    target = torch.randint(0, V, (n,), generator=g)
    mask = torch.rand(n, generator=g) < 0.5
    a = logprobs_and_entropy(logits, target, support_ids=ids, support_offsets=offsets, mask=mask)
    b = logprobs_and_entropy(logits, target, keep_mask=_dense(sets), mask=mask)
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p, q)


def test_no_dense_mask_is_built():
    """Peak memory: the CSR call never holds an ``[N, V]`` bool (its temporaries are a
    chunk's); a dense mask is ``N·V`` bytes."""
    n, v = 256, 4096
    g = torch.Generator().manual_seed(3)
    sets = _sets([20] * n, g, v)
    ids, offsets = _csr(sets)
    logits = torch.randn(n, v, generator=g)
    target = torch.randint(0, v, (n,), generator=g)
    seen = []

    class Watch(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dtype == torch.bool:
                seen.append(out.numel())
            return out

    with Watch():
        logprobs_and_entropy(
            logits, target, support_ids=ids, support_offsets=offsets, chunk_size=16
        )
    assert seen and max(seen) <= 16 * v + 1


@pytest.mark.parametrize(
    "kw, err, words",
    [
        (
            {"support_ids": torch.tensor([0.0]), "support_offsets": torch.tensor([0, 1, 1])},
            TypeError,
            "support_ids must be an int32 or int64",
        ),
        (
            {"support_ids": torch.tensor([1]), "support_offsets": torch.tensor([0.0, 1.0, 1.0])},
            TypeError,
            "support_offsets must be an int32 or int64",
        ),
        (
            {"support_ids": [1], "support_offsets": torch.tensor([0, 1, 1])},
            TypeError,
            "support_ids must be an int32/int64 tensor",
        ),
        ({"support_ids": torch.tensor([1])}, ValueError, "support_ids needs support_offsets"),
        (
            {"support_offsets": torch.tensor([0, 1, 1])},
            ValueError,
            "support_offsets needs support_ids",
        ),
        (
            {"support_ids": torch.tensor([1]), "support_offsets": torch.tensor([0, 1])},
            ValueError,
            r"support_offsets.*\[N \+ 1\]",
        ),
        (
            {"support_ids": torch.tensor([[1]]), "support_offsets": torch.tensor([0, 1, 1])},
            ValueError,
            r"support_ids.*\[nnz\]",
        ),
        (
            {"support_ids": torch.tensor([1, 2]), "support_offsets": torch.tensor([1, 1, 2])},
            ValueError,
            "support_offsets must start at 0",
        ),
        (
            {"support_ids": torch.tensor([1, 2]), "support_offsets": torch.tensor([0, 1, 1])},
            ValueError,
            "support_offsets must end at nnz",
        ),
        (
            {"support_ids": torch.tensor([1, 2]), "support_offsets": torch.tensor([0, 2, 2])},
            None,
            None,
        ),
        (
            {"support_ids": torch.tensor([1, 2, 3]), "support_offsets": torch.tensor([0, 3, 2])},
            ValueError,
            "support_offsets must end at nnz",
        ),
        (
            {"support_ids": torch.tensor([1, 2]), "support_offsets": torch.tensor([0, 3, 2])},
            ValueError,
            "support_offsets must be non-decreasing",
        ),
        (
            {"support_ids": torch.tensor([1, 10]), "support_offsets": torch.tensor([0, 1, 2])},
            ValueError,
            r"support_ids must hold vocabulary ids in \[0, 10\)",
        ),
        (
            {"support_ids": torch.tensor([-1, 2]), "support_offsets": torch.tensor([0, 1, 2])},
            ValueError,
            r"support_ids must hold vocabulary ids in \[0, 10\)",
        ),
        (
            {
                "support_ids": torch.tensor([1]),
                "support_offsets": torch.tensor([0, 1, 1]),
                "keep_mask": torch.ones(2, 10, dtype=torch.bool),
            },
            ValueError,
            "exclusive",
        ),
        (
            {
                "support_ids": torch.tensor([1]),
                "support_offsets": torch.tensor([0, 1, 1]),
                "top_k": 2,
            },
            ValueError,
            "exclusive",
        ),
        (
            {
                "support_ids": torch.tensor([1]),
                "support_offsets": torch.tensor([0, 1, 1]),
                "top_p": 0.5,
            },
            ValueError,
            "exclusive",
        ),
        (
            {
                "support_ids": torch.tensor([1]),
                "support_offsets": torch.tensor([0, 1, 1]),
                "min_p": 0.5,
            },
            ValueError,
            "exclusive",
        ),
    ],
)
def test_bad_input(kw, err, words):
    logits, target = torch.randn(2, 10), torch.tensor([0, 1])
    hidden, weight = torch.randn(2, H), torch.randn(10, H)
    if err is None:  # a valid support (one row with both ids, one empty)
        logprobs_and_entropy(logits, target, **kw)
        return
    with pytest.raises(err, match=words):
        logprobs_and_entropy(logits, target, **kw)
    if "keep_mask" in kw:
        kw = {**kw, "keep_mask": torch.ones(2, 10, dtype=torch.bool)}
    with pytest.raises(err, match=words):
        linear_logprobs_and_entropy(hidden, weight, target, **kw)


# --------------------------------------------------------------------------- tensor parallel
N_TP, V_TP = 6, 40


def _tp_case():
    g = torch.Generator().manual_seed(4)
    # ids on both sides of the boundary at 20 (two shards of 20), an empty set, one id
    sets = [
        torch.tensor([18, 19, 20, 21]),
        torch.tensor([], dtype=torch.int64),
        torch.tensor([0, 39]),
        torch.tensor([25]),
        torch.tensor([1, 2, 3]),
        torch.arange(0, 40, 3),
    ]
    logits = torch.randn(N_TP, V_TP, generator=g, dtype=torch.float64) * 2
    target = torch.tensor([19, 20, 5, 30, 22, 10])
    grads = [torch.randn(N_TP, generator=g, dtype=torch.float64) for _ in range(2)]
    return sets, logits, target, grads


def _tp_worker(rank: int, world: int) -> dict:
    sets, logits, target, grads = _tp_case()
    ids, offsets = _csr(sets)
    cols = slice(rank * V_TP // world, (rank + 1) * V_TP // world)
    x = logits[:, cols].clone().requires_grad_()
    with count_collectives() as calls:
        res = logprobs_and_entropy(
            x, target, support_ids=ids, support_offsets=offsets, group=dist.group.WORLD
        )
    torch.autograd.backward(list(res), grads)
    return {"out": [r.detach() for r in res], "grad": x.grad, "calls": sum(calls.values())}


@pytest.mark.distributed
def test_tensor_parallel_each_rank_reads_the_ids_of_its_shard():
    results = run_distributed(_tp_worker, 2)
    sets, logits, target, grads = _tp_case()
    x = logits.clone().requires_grad_()
    ref = logprobs_and_entropy(x, target, keep_mask=_dense(sets, V_TP))
    torch.autograd.backward(list(ref), grads)
    for rank, res in enumerate(results):
        for o, r in zip(res["out"], ref, strict=True):
            torch.testing.assert_close(o, r.detach())
        cols = slice(rank * V_TP // 2, (rank + 1) * V_TP // 2)
        torch.testing.assert_close(res["grad"], x.grad[:, cols])
        assert res["calls"] == 2  # the consistency check and the statistics
