"""``mask=`` on both log-prob ops: the rows where it is False cost nothing and are exact zeros.

Expected values come from the definition of a row mask: a masked call equals the same call on
the valid rows alone (``x[mask]``, ``target[mask]``: the tokens that exist for the loss),
scattered back, with exact zeros elsewhere, and the gradient of a masked row is zero (nothing
reaches ``weight.grad`` / ``bias.grad`` from it). Both of the engine's paths are checked: the
valid rows compacted (the host reads their number: CPU) and every row computed with the masked
ones zeroed (no host read: accelerators, ``torch.compile``), the latter forced here by making
the engine treat the tensors as unreadable. Under tensor parallelism the mask is part of the
consistency check and the forward keeps its one collective for the statistics.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from tests._distributed import count_collectives, run_distributed

from rlops.logprobs import _engine, linear_logprobs_and_entropy, logprobs_and_entropy

V, H = 33, 5
SIZES = (1, 127, 129, 1000)
OPTIONS = {
    "plain": {},
    "temperature": {"temperature": 0.7},
    "top_k": {"top_k": 4},
    "top_p": {"top_p": 0.8},
    "min_p": {"min_p": 0.2},
    "keep_mask": {"keep_mask": True},
    "sum_pi_squared": {"with_sum_pi_squared": True, "temperature": 1.3},
    "top_p per token": {"top_p": True, "entropy_over_support": True},
}


@pytest.fixture(params=["compacted", "every row"])
def path(request, monkeypatch):
    """The compacted path (CPU) or the no-host-read path of accelerators and compile."""
    if request.param == "every row":
        monkeypatch.setattr(_engine, "values_checked", lambda t: False)
    return request.param


def _inputs(n: int, dtype: torch.dtype, opts: dict, seed: int = 0):
    g = torch.Generator().manual_seed(seed + n)
    logits = (torch.randn(n, V, generator=g) * 3).to(dtype)
    target = torch.randint(0, V, (n,), generator=g)
    mask = torch.rand(n, generator=g) < 0.3
    if n > 1:
        mask[0], mask[-1] = True, False
    kw = dict(opts)
    if kw.get("keep_mask") is True:
        kw["keep_mask"] = torch.rand(n, V, generator=g) < 0.4
    if kw.get("top_p") is True:
        kw["top_p"] = torch.rand(n, generator=g, dtype=torch.float64).to(dtype) * 0.6 + 0.4
    grads = [torch.randn(n, generator=g, dtype=torch.float64) for _ in range(2)]
    return logits, target, mask, kw, grads


def _rows(kw: dict, mask: torch.Tensor) -> dict:
    """The keyword arguments of the call on the valid rows alone."""
    return {k: (v[mask] if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}


def _run(fn, leaves, args, kw, grads):
    leaves = [x.detach().clone().requires_grad_() for x in leaves]
    outs = fn(*leaves, *args, **kw)
    pairs = [
        (o, gr.to(o.dtype))
        for o, gr in zip(outs[:2], grads, strict=True)
        if o is not None and o.requires_grad
    ]
    torch.autograd.backward([o for o, _ in pairs], [gr for _, gr in pairs])
    return [o.detach() for o in outs if o is not None], [x.grad for x in leaves]


def _check_logits_op(logits, target, mask, kw, grads):
    outs, (gx,) = _run(logprobs_and_entropy, [logits], [target], {**kw, "mask": mask}, grads)
    ref, (gr,) = _run(
        logprobs_and_entropy,
        [logits[mask]],
        [target[mask]],
        _rows(kw, mask),
        [gd[mask] for gd in grads],
    )
    for o, r in zip(outs, ref, strict=True):
        torch.testing.assert_close(o[mask], r, rtol=0, atol=0)
        assert torch.equal(o[~mask], torch.zeros_like(o[~mask]))
    torch.testing.assert_close(gx[mask], gr, rtol=0, atol=0)
    assert torch.equal(gx[~mask], torch.zeros_like(gx[~mask]))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name", list(OPTIONS))
def test_logits_op_equals_the_call_on_the_valid_rows(n, name):
    _check_logits_op(*_inputs(n, torch.float64, OPTIONS[name]))


@pytest.mark.parametrize("name", list(OPTIONS))
def test_logits_op_every_row_path(name, monkeypatch):
    monkeypatch.setattr(_engine, "values_checked", lambda t: False)
    _check_logits_op(*_inputs(129, torch.float64, OPTIONS[name], seed=3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("name", ["plain", "top_p", "keep_mask", "sum_pi_squared"])
def test_logits_op_dtypes(dtype, name):
    _check_logits_op(*_inputs(129, dtype, OPTIONS[name], seed=1))


def _linear_inputs(n, dtype, opts, bias, seed=0):
    _logits, target, mask, kw, grads = _inputs(n, dtype, opts, seed)
    g = torch.Generator().manual_seed(seed + 7)
    hidden = torch.randn(n, H, generator=g).to(dtype)
    weight = torch.randn(V, H, generator=g).to(dtype)
    b = torch.randn(V, generator=g).to(dtype) if bias else None
    return hidden, weight, b, target, mask, kw, grads


def _linear(target):
    def fn(h, w, b=None, **kw):
        return linear_logprobs_and_entropy(h, w, target, bias=b, **kw)

    return fn


def _check_linear_op(hidden, weight, b, target, mask, kw, grads, chunk_size=None):
    kw = {**kw, "chunk_size": chunk_size}
    tail = [b] if b is not None else []
    outs, got = _run(_linear(target), [hidden, weight, *tail], [], {**kw, "mask": mask}, grads)
    ref, want = _run(
        _linear(target[mask]),
        [hidden[mask], weight, *tail],
        [],
        _rows(kw, mask),
        [gd[mask] for gd in grads],
    )
    for o, r in zip(outs, ref, strict=True):
        torch.testing.assert_close(o[mask], r, rtol=0, atol=0)
        assert torch.equal(o[~mask], torch.zeros_like(o[~mask]))
    torch.testing.assert_close(got[0][mask], want[0], rtol=0, atol=0)
    assert torch.equal(got[0][~mask], torch.zeros_like(got[0][~mask]))
    for a, w in zip(got[1:], want[1:], strict=True):  # weight, bias: the valid rows only
        torch.testing.assert_close(a, w, rtol=0, atol=0)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name", ["plain", "temperature", "top_p", "keep_mask", "sum_pi_squared"])
def test_linear_op_equals_the_call_on_the_valid_rows(n, name):
    _check_linear_op(*_linear_inputs(n, torch.float64, OPTIONS[name], bias=True), chunk_size=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("name", ["plain", "top_k", "min_p", "keep_mask"])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_op_dtypes_and_bias(dtype, name, bias):
    _check_linear_op(*_linear_inputs(129, dtype, OPTIONS[name], bias=bias, seed=2))


def _check_linear_every_row(hidden, weight, b, target, mask, kw, grads):
    """The no-host-read path computes every row: equal to the unmasked call on the valid rows
    (the same chunks), zero elsewhere."""
    gm = [torch.where(mask, gd, 0.0) for gd in grads]
    outs, got = _run(_linear(target), [hidden, weight, b], [], {**kw, "mask": mask}, grads)
    ref, want = _run(_linear(target), [hidden, weight, b], [], kw, gm)
    for o, r in zip(outs, ref, strict=True):
        assert torch.equal(o[mask], r[mask]) and torch.equal(o[~mask], torch.zeros_like(r[~mask]))
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a, w, rtol=0, atol=0)
    assert torch.equal(got[0][~mask], torch.zeros_like(got[0][~mask]))


@pytest.mark.parametrize("name", ["plain", "top_p", "keep_mask", "sum_pi_squared"])
def test_linear_op_every_row_path(name, monkeypatch):
    monkeypatch.setattr(_engine, "values_checked", lambda t: False)
    _check_linear_every_row(*_linear_inputs(129, torch.float64, OPTIONS[name], bias=True))


@pytest.mark.parametrize("valid", [False, True])
def test_all_masked_and_none_masked(valid, path):
    logits, target, _, _, grads = _inputs(40, torch.float64, {})
    mask = torch.full((40,), valid)
    outs, (gx,) = _run(
        logprobs_and_entropy, [logits], [target], {"mask": mask, "with_sum_pi_squared": True}, grads
    )
    ref, (gr,) = _run(
        logprobs_and_entropy, [logits], [target], {"with_sum_pi_squared": True}, grads
    )
    for o, r in zip(outs, ref, strict=True):
        assert torch.equal(o, r if valid else torch.zeros_like(r))
    assert torch.equal(gx, gr if valid else torch.zeros_like(gr))
    hidden, weight, b, target, _, _, grads = _linear_inputs(40, torch.float64, {}, bias=True)
    outs, got = _run(_linear(target), [hidden, weight, b], [], {"mask": mask}, grads)
    ref, want = _run(_linear(target), [hidden, weight, b], [], {}, grads)
    for o, r in zip(outs, ref, strict=True):
        assert torch.equal(o, r if valid else torch.zeros_like(r))
    for a, w in zip(got, want, strict=True):
        if valid:
            torch.testing.assert_close(a, w)
        else:
            assert torch.equal(a, torch.zeros_like(w))


def test_masked_rows_that_are_not_finite_stay_exact_zeros(path):
    """Tool output rows may hold anything: NaN or inf logits in a masked row reach nothing."""
    logits, target, mask, _, grads = _inputs(50, torch.float32, {})
    bad = logits.clone()
    bad[~mask] = float("nan")
    bad[~mask, 0] = float("inf")
    outs, (gx,) = _run(logprobs_and_entropy, [bad], [target], {"mask": mask}, grads)
    ref, (gr,) = _run(logprobs_and_entropy, [logits], [target], {"mask": mask}, grads)
    for o, r in zip(outs, ref, strict=True):
        assert torch.equal(o, r)
    assert torch.equal(gx, gr)


def test_leading_shape_and_no_gradient_into_masked_rows():
    """``[B, T]`` targets with a ``[B, T]`` mask; outputs ``[B, T]``."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 7, V, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, V, (3, 7), generator=g)
    mask = torch.rand(3, 7, generator=g) < 0.5
    logp, ent = logprobs_and_entropy(logits, target, mask=mask)
    assert logp.shape == (3, 7) and ent.shape == (3, 7)
    (logp.sum() + ent.sum()).backward()
    assert logits.grad is not None
    assert torch.equal(logits.grad[~mask], torch.zeros_like(logits.grad[~mask]))


@pytest.mark.parametrize("name", ["plain", "top_p", "keep_mask"])
def test_gradcheck(name, path):
    logits, target, mask, kw, _ = _inputs(9, torch.float64, OPTIONS[name], seed=5)
    x = logits.clone().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda z: logprobs_and_entropy(z, target, mask=mask, chunk_size=4, **kw),
        (x,),
        fast_mode=True,
    )
    hidden, weight, b, target, mask, kw, _ = _linear_inputs(
        9, torch.float64, OPTIONS[name], bias=True, seed=5
    )
    leaves = tuple(t.clone().requires_grad_() for t in (hidden, weight, b))
    assert torch.autograd.gradcheck(
        lambda h, w, bb: linear_logprobs_and_entropy(
            h, w, target, bias=bb, mask=mask, chunk_size=4, **kw
        ),
        leaves,
        fast_mode=True,
    )


def test_double_backward_with_a_mask():
    logits, target, mask, _, _ = _inputs(9, torch.float64, {}, seed=6)
    x = logits.clone().requires_grad_()
    assert torch.autograd.gradgradcheck(
        lambda z: logprobs_and_entropy(z, target, mask=mask, chunk_size=4), (x,), fast_mode=True
    )


@pytest.mark.parametrize(
    "bad, err, words",
    [
        (torch.ones(4, dtype=torch.int64), TypeError, "mask must be a bool tensor"),
        (torch.ones(5, dtype=torch.bool), ValueError, "mask"),
        ([True] * 4, TypeError, "mask must be a bool tensor or None"),
    ],
)
def test_bad_mask(bad, err, words):
    logits, target = torch.randn(4, V), torch.zeros(4, dtype=torch.long)
    with pytest.raises(err, match=words):
        logprobs_and_entropy(logits, target, mask=bad)
    with pytest.raises(err, match=words):
        linear_logprobs_and_entropy(torch.randn(4, H), torch.randn(V, H), target, mask=bad)


# --------------------------------------------------------------------------- tensor parallel
N_TP = 23


def _tp_inputs():
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(N_TP, V + 1, generator=g, dtype=torch.float64) * 3  # V + 1 = 34
    target = torch.randint(0, V + 1, (N_TP,), generator=g)
    mask = torch.rand(N_TP, generator=g) < 0.3
    hidden = torch.randn(N_TP, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V + 1, H, generator=g, dtype=torch.float64)
    grads = [torch.randn(N_TP, generator=g, dtype=torch.float64) for _ in range(2)]
    return logits, target, mask, hidden, weight, grads


def _tp_worker(rank: int, world: int) -> dict:
    logits, target, mask, hidden, weight, grads = _tp_inputs()
    cols = slice(rank * (V + 1) // world, (rank + 1) * (V + 1) // world)
    out: dict = {}
    for kw in ({}, {"top_p": 0.8}, {"with_sum_pi_squared": True}):
        x = logits[:, cols].clone().requires_grad_()
        with count_collectives() as fwd:
            res = logprobs_and_entropy(x, target, mask=mask, group=dist.group.WORLD, **kw)
        with count_collectives() as bwd:
            torch.autograd.backward(list(res[:2]), grads)
        out[f"logits {kw}"] = (
            [r.detach() for r in res],
            x.grad,
            sum(fwd.values()),
            sum(bwd.values()),
        )
    h = hidden.clone().requires_grad_()
    w = weight[cols].clone().requires_grad_()
    with count_collectives() as fwd:
        res = linear_logprobs_and_entropy(h, w, target, mask=mask, group=dist.group.WORLD)
    torch.autograd.backward(list(res), grads)
    out["linear"] = ([r.detach() for r in res], (h.grad, w.grad), sum(fwd.values()), 0)
    try:  # rank 1's mask differs from rank 0's: every rank raises, naming the mask
        other = mask.clone()
        other[0] ^= rank == 1
        logprobs_and_entropy(logits[:, cols], target, mask=other, group=dist.group.WORLD)
        out["mismatch"] = "no error"
    except ValueError as e:
        out["mismatch"] = str(e)
    return out


@pytest.mark.distributed
def test_tensor_parallel_two_ranks_one_collective_for_the_statistics():
    results = run_distributed(_tp_worker, 2)
    logits, target, mask, hidden, weight, grads = _tp_inputs()
    for kw in ({}, {"top_p": 0.8}, {"with_sum_pi_squared": True}):
        x = logits.clone().requires_grad_()
        ref = logprobs_and_entropy(x, target, mask=mask, **kw)
        torch.autograd.backward(list(ref[:2]), grads)
        for rank, res in enumerate(results):
            outs, gx, n_fwd, n_bwd = res[f"logits {kw}"]
            for o, r in zip(outs, ref, strict=True):
                torch.testing.assert_close(o, r.detach())
                assert torch.equal(o[~mask], torch.zeros_like(o[~mask]))
            cols = slice(rank * 34 // 2, (rank + 1) * 34 // 2)
            torch.testing.assert_close(gx, x.grad[:, cols])
            # the check and the statistics (top-p: + the max and the radix select's 8 rounds)
            assert n_fwd == (2 if "top_p" not in kw else 11), (kw, n_fwd)  # float64: 8 rounds
            assert n_bwd == 0
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    ref = linear_logprobs_and_entropy(h, w, target, mask=mask)
    torch.autograd.backward(list(ref), grads)
    for rank, res in enumerate(results):
        outs, (gh, gw), n_fwd, _ = res["linear"]
        for o, r in zip(outs, ref, strict=True):
            torch.testing.assert_close(o, r.detach())
        cols = slice(rank * 34 // 2, (rank + 1) * 34 // 2)
        torch.testing.assert_close(gw, w.grad[cols])
        assert torch.equal(gh[~mask], torch.zeros_like(gh[~mask]))
        assert n_fwd == 2
        assert "mask" in res["mismatch"], res["mismatch"]
