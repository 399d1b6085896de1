"""A per-row ``temperature`` tensor in both log-prob ops: ``[N]`` for ``[N, V]`` logits (``[N, H]``
hidden), ``[B]`` for ``[B, T, V]`` (each row's value for all its ``T`` tokens).

Expected values come from the definition in float64: ``z = x / τ_row``,
``logp = log_softmax(z over the support ∪ {target})[target]``, the entropy of
``softmax(z)``; top-k keeps the ``k`` largest ``z``, top-p the shortest prefix of ``z`` sorted
down whose mass reaches ``p``. Several chunks (``chunk_size``), a row mask, the softcap's
map, gradients (gradcheck), a constant tensor against the float, 2 real Gloo ranks of a
vocabulary-sharded group, ``torch.compile`` and the errors (the Triton kernels':
``test_triton_temperature.py``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from tests._distributed import run_distributed

from rlops.logprobs import linear_logprobs_and_entropy, logprobs_and_entropy
from rlops.logprobs.reference import logprobs_and_entropy_reference

V = 1000
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-5}


def _taus(n: int, gen: torch.Generator, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return (torch.rand(n, generator=gen, dtype=torch.float64) * 1.8 + 0.2).to(dtype)


def _support(z: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """``[N, V]`` bool: the tokens top-k / top-p keep on ``z`` (float64, no ties)."""
    zs, order = z.sort(dim=-1, descending=True)
    keep = torch.ones_like(zs, dtype=torch.bool)
    if top_k is not None:
        keep &= torch.arange(z.shape[-1]) < top_k
    if top_p is not None:
        p = torch.softmax(zs.masked_fill(~keep, float("-inf")), dim=-1)
        before = p.cumsum(dim=-1) - p  # the mass of the tokens above each one
        keep &= before < top_p
    return torch.zeros_like(keep).scatter(-1, order, keep)


def _definition(x, target, tau, *, top_k=None, top_p=None, scale=1.0, cap=None):
    """``(logp, entropy)`` in float64 of logits ``x`` ``[..., V]`` with per-row ``tau``."""
    x = x.double() * scale
    if cap is not None:
        x = cap * torch.tanh(x / cap)
    lead = x.shape[:-1]
    z = (x / tau.double().reshape(lead[0], *[1] * len(lead))).reshape(-1, x.shape[-1])
    y = target.reshape(-1, 1)
    zk = z
    if top_k is not None or top_p is not None:
        keep = _support(z, top_k, top_p).scatter(-1, y, True)
        zk = z.masked_fill(~keep, float("-inf"))
    logp = torch.log_softmax(zk, dim=-1).gather(-1, y).squeeze(-1)
    ent = -(torch.softmax(z, dim=-1) * torch.log_softmax(z, dim=-1)).sum(-1)
    return logp.reshape(lead), ent.reshape(lead)


def _close(got, want, dtype):
    torch.testing.assert_close(got.double(), want, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("n", [1, 127, 129])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("chunk_size", [None, 16])
def test_logits_match_the_definition(n, dtype, chunk_size):
    gen = torch.Generator().manual_seed(n)
    x = (torch.randn(n, V, generator=gen, dtype=torch.float64) * 3).to(dtype)
    y = torch.randint(0, V, (n,), generator=gen)
    tau = _taus(n, gen, dtype)
    logp, ent = logprobs_and_entropy(x, y, temperature=tau, chunk_size=chunk_size)
    want = _definition(x, y, tau)
    _close(logp, want[0], dtype)
    _close(ent, want[1], dtype)


@pytest.mark.parametrize("n", [1, 127, 129])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_linear_matches_the_definition(n, dtype):
    gen = torch.Generator().manual_seed(n + 1)
    h = torch.randn(n, 16, generator=gen, dtype=torch.float64).to(dtype)
    w = torch.randn(V, 16, generator=gen, dtype=torch.float64).to(dtype)
    y = torch.randint(0, V, (n,), generator=gen)
    tau = _taus(n, gen)
    logp, ent = linear_logprobs_and_entropy(h, w, y, temperature=tau, chunk_size=32)
    want = _definition(torch.nn.functional.linear(h, w), y, tau)  # the logits in h's dtype
    _close(logp, want[0], dtype)
    _close(ent, want[1], dtype)


def test_btv_inputs_take_one_temperature_per_row():
    gen = torch.Generator().manual_seed(3)
    b, t = 3, 5
    x = torch.randn(b, t, V, generator=gen, dtype=torch.float64) * 2
    h = torch.randn(b, t, 8, generator=gen, dtype=torch.float64)
    w = torch.randn(V, 8, generator=gen, dtype=torch.float64)
    y = torch.randint(0, V, (b, t), generator=gen)
    tau = torch.tensor([0.5, 1.0, 3.0], dtype=torch.float64)
    logp, ent = logprobs_and_entropy(x, y, temperature=tau, chunk_size=4)
    want = _definition(x, y, tau)
    _close(logp, want[0], torch.float64)
    _close(ent, want[1], torch.float64)
    for row in range(b):  # row b is the float path at τ_b
        float_row = logprobs_and_entropy(x[row], y[row], temperature=float(tau[row]))
        _close(logp[row], float_row[0].double(), torch.float64)
    logp, ent = linear_logprobs_and_entropy(h, w, y, temperature=tau, chunk_size=4)
    want = _definition(h @ w.T, y, tau)
    _close(logp, want[0], torch.float64)
    _close(ent, want[1], torch.float64)


def test_reference_takes_per_row_temperatures():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 50, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 50, (2, 3), generator=gen)
    tau = torch.tensor([0.3, 2.5], dtype=torch.float64)
    got = logprobs_and_entropy_reference(x, y, temperature=tau, top_k=7)
    want = _definition(x, y, tau, top_k=7)
    _close(got[0], want[0], torch.float64)
    _close(got[1], want[1], torch.float64)


@pytest.mark.parametrize("sampler", [{"top_k": 50}, {"top_p": 0.9}, {"top_k": 300, "top_p": 0.5}])
def test_sampler_thresholds_on_the_tempered_logits(sampler):
    gen = torch.Generator().manual_seed(5)
    n = 129
    x = torch.randn(n, V, generator=gen, dtype=torch.float64) * 3
    h = torch.randn(n, 8, generator=gen, dtype=torch.float64)
    w = torch.randn(V, 8, generator=gen, dtype=torch.float64)
    y = torch.randint(0, V, (n,), generator=gen)
    tau = _taus(n, gen)
    got = logprobs_and_entropy(x, y, temperature=tau, chunk_size=16, **sampler)
    want = _definition(x, y, tau, **sampler)
    _close(got[0], want[0], torch.float64)
    _close(got[1], want[1], torch.float64)
    got = linear_logprobs_and_entropy(h, w, y, temperature=tau, chunk_size=16, **sampler)
    _close(got[0], _definition(h @ w.T, y, tau, **sampler)[0], torch.float64)


def test_scale_softcap_and_row_mask():
    gen = torch.Generator().manual_seed(6)
    n = 127
    x = torch.randn(n, V, generator=gen, dtype=torch.float64) * 10
    y = torch.randint(0, V, (n,), generator=gen)
    mask = torch.rand(n, generator=gen) < 0.6
    tau = _taus(n, gen)
    kw = {"logit_scale": 0.5, "final_logit_softcapping": 4.0}
    logp, ent = logprobs_and_entropy(x, y, temperature=tau, mask=mask, chunk_size=16, **kw)
    want = _definition(x, y, tau, scale=0.5, cap=4.0)
    _close(logp[mask], want[0][mask], torch.float64)
    _close(ent[mask], want[1][mask], torch.float64)
    assert (logp[~mask] == 0).all() and (ent[~mask] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_constant_tensor_is_the_float(dtype):
    gen = torch.Generator().manual_seed(8)
    n = 129
    x = (torch.randn(n, V, generator=gen, dtype=torch.float64) * 3).to(dtype)
    y = torch.randint(0, V, (n,), generator=gen)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 0}
    results = []
    for tau in (0.7, torch.full((n,), 0.7, dtype=dtype)):
        xg = x.clone().requires_grad_()
        logp, ent = logprobs_and_entropy(xg, y, temperature=tau, top_k=20, chunk_size=32)
        (logp.sum() + ent.sum()).backward()
        results.append((logp, ent, xg.grad))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, **tol)


def test_gradcheck_both_ops():
    gen = torch.Generator().manual_seed(9)
    n, v, hdim = 6, 7, 3
    x = torch.randn(n, v, generator=gen, dtype=torch.float64, requires_grad=True)
    h = torch.randn(2, 3, hdim, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(v, hdim, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, v, (n,), generator=gen)
    mask = torch.tensor([True, False, True, True, False, True])
    tau = _taus(n, gen)

    def logits_op(x):
        return logprobs_and_entropy(x, y, temperature=tau, mask=mask, chunk_size=2, top_k=4)

    def linear_op(h, w):
        return linear_logprobs_and_entropy(
            h, w, y.reshape(2, 3), temperature=tau[:2], chunk_size=2, final_logit_softcapping=2.0
        )

    assert torch.autograd.gradcheck(logits_op, (x,))
    assert torch.autograd.gradgradcheck(lambda x: logprobs_and_entropy(x, y, temperature=tau), (x,))
    assert torch.autograd.gradcheck(linear_op, (h, w))


def test_under_torch_compile():
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(12, 33, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 33, (12,), generator=gen)
    tau = _taus(12, gen)

    def loss(x, tau):
        logp, ent = logprobs_and_entropy(x, y, temperature=tau, top_k=5)
        return logp.sum() + 0.1 * ent.sum()

    torch._dynamo.reset()
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    got = compiled(x, tau)
    (g_got,) = torch.autograd.grad(got, x)
    want = loss(x, tau)
    (g_want,) = torch.autograd.grad(want, x)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(g_got, g_want)


@pytest.mark.parametrize(
    ("tau", "error", "match"),
    [
        (torch.ones(5), ValueError, r"temperature.*\[N\]"),
        (torch.ones(6, 1), ValueError, r"temperature.*\[N\]"),
        (torch.ones(()), ValueError, r"temperature.*\[N\]"),
        (torch.ones(6, dtype=torch.int64), TypeError, r"temperature.*floating"),
        (torch.tensor([1.0, 1, 1, 0, 1, 1]), ValueError, r"temperature.*> 0"),
        (torch.tensor([1.0, 1, 1, -2, 1, 1]), ValueError, r"temperature.*> 0"),
        (torch.tensor([1.0, float("nan"), 1, 1, 1, 1]), ValueError, r"temperature.*finite"),
        (torch.tensor([1.0, float("inf"), 1, 1, 1, 1]), ValueError, r"temperature.*finite"),
    ],
)
def test_bad_temperatures(tau, error, match):
    x, y = torch.randn(6, 5), torch.zeros(6, dtype=torch.long)
    with pytest.raises(error, match=match):
        logprobs_and_entropy(x, y, temperature=tau)
    with pytest.raises(error, match=match):
        linear_logprobs_and_entropy(torch.randn(6, 3), torch.randn(5, 3), y, temperature=tau)


def test_btv_error_names_b():
    x, y = torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"temperature.*\[B\].*\[2\]"):
        logprobs_and_entropy(x, y, temperature=torch.ones(6))


# --------------------------------------------------------------------------- 2 Gloo ranks
N_TP, V_TP, SHARDS = 19, 40, (15, 25)


def _tp_data():
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(N_TP, V_TP, generator=gen, dtype=torch.float64) * 3
    h = torch.randn(N_TP, 6, generator=gen, dtype=torch.float64)
    w = torch.randn(V_TP, 6, generator=gen, dtype=torch.float64)
    y = torch.randint(0, V_TP, (N_TP,), generator=gen)
    return x, h, w, y, _taus(N_TP, gen)


def _tp_worker(rank: int, world: int) -> dict:
    x, h, w, y, tau = _tp_data()
    cols = slice(0, SHARDS[0]) if rank == 0 else slice(SHARDS[0], V_TP)
    group = dist.group.WORLD
    xr = x[:, cols].clone().requires_grad_()
    out = logprobs_and_entropy(xr, y, temperature=tau, group=group, top_p=0.8, chunk_size=8)
    (out[0].sum() + out[1].sum()).backward()
    lin = linear_logprobs_and_entropy(h, w[cols], y, temperature=tau, group=group, chunk_size=8)
    bad = tau.clone()
    if rank == 1:
        bad[3] = bad[3] * 2
    try:
        logprobs_and_entropy(xr.detach(), y, temperature=bad, group=group)
        error = ""
    except ValueError as exc:
        error = str(exc)
    return {"out": [o.detach() for o in out], "grad": xr.grad, "lin": lin, "error": error}


@pytest.mark.distributed
def test_tensor_parallel_two_ranks():
    ranks = run_distributed(_tp_worker, 2, timeout=120)
    x, h, w, y, tau = _tp_data()
    xg = x.clone().requires_grad_()
    single = logprobs_and_entropy(xg, y, temperature=tau, top_p=0.8)
    (single[0].sum() + single[1].sum()).backward()
    assert xg.grad is not None
    want = _definition(x, y, tau, top_p=0.8)
    want_lin = _definition(h @ w.T, y, tau)
    for rank, r in enumerate(ranks):
        _close(r["out"][0], want[0], torch.float64)
        _close(r["out"][1], want[1], torch.float64)
        _close(r["lin"][0], want_lin[0], torch.float64)
        _close(r["lin"][1], want_lin[1], torch.float64)
        cols = slice(0, SHARDS[0]) if rank == 0 else slice(SHARDS[0], V_TP)
        torch.testing.assert_close(r["grad"], xg.grad[:, cols])
        assert "temperature" in r["error"], r["error"]
