"""Truncated rows bootstrap on the Triton kernels (``method="triton"`` under the CPU
interpreter, ``TRITON_INTERPRET=1``): ``rlops.gae`` and ``rlops.discounted_returns`` with
``bootstrap=`` (``[B]``, or ``[B, T]`` with ``truncated=``) against the compacted-sequence
oracle with the bootstrap written plainly, by the rule of ``tests/tolerances.py``; several
blocks of time per row (the row's end value is the carry entering the last block)."""

from __future__ import annotations

import itertools

import pytest
import torch
from tests._triton_interp import (  # (sets TRITON_INTERPRET=1 first)
    seeded,
    triton,  # noqa: F401
)
from tests.oracles import (
    EXTENDED,
    discounted_returns_bootstrap_oracle,
    gae_bootstrap_oracle,
)
from tests.tolerances import assert_half_matches, assert_within_reference

import rlops
import rlops.advantages.triton as adv_triton
from rlops import _backends


@pytest.fixture
def kernels(monkeypatch):
    """Counts the calls of the Triton estimator kernel (it still runs)."""
    monkeypatch.setattr(_backends, "_failed", {})
    calls = {"gae_triton": 0}
    original = adv_triton.gae_triton

    def wrapped(*args, **kwargs):
        calls["gae_triton"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(adv_triton, "gae_triton", wrapped)
    return calls


def _inputs(b, t, form, dt, gen):
    r = torch.randn(b, t, generator=gen, dtype=torch.float64).to(dt)
    v = torch.randn(b, t, generator=gen, dtype=torch.float64).to(dt)
    m = torch.rand(b, t, generator=gen) < 0.7
    d = torch.rand(b, t, generator=gen) < 0.03
    if form == "row":
        return r, v, m, d, (3 * torch.randn(b, generator=gen, dtype=torch.float64)).to(dt), None
    tr = torch.rand(b, t, generator=gen) < 0.04
    tr[0, -1] = True
    boot = 3 * torch.randn(b, t, generator=gen, dtype=torch.float64)
    boot[~tr] = float("nan")  # never read
    return r, v, m, d, boot.to(dt), tr


CASES = [
    pytest.param(b, t, form, g, lam, dt, id=f"{dt}-{form}-g{g}-l{lam}-B{b}-T{t}")
    for (b, t), form, (g, lam), dt in itertools.chain(
        itertools.product(
            [(1, 1), (3, 127), (2, 128), (2, 129), (1, 1000)],
            ["row", "token"],
            [(0.99, 0.95)],
            ["float32"],
        ),
        itertools.product([(2, 301)], ["row", "token"], [(0.0, 0.0), (1.0, 1.0)], ["float32"]),
        itertools.product([(2, 301)], ["row", "token"], [(0.99, 0.95)], ["float64", "bfloat16"]),
    )
]


def _check(name, out, oracle, ref):
    if out.dtype == torch.bfloat16:
        assert_half_matches(name, out, ref, oracle)
    else:
        assert_within_reference(name, out, oracle, ref)


@pytest.mark.parametrize(("b", "t", "form", "gamma", "lam", "dtype"), CASES)
def test_bootstrap_triton_matches_oracle(kernels, b, t, form, gamma, lam, dtype):
    gen = seeded("bootstrap", b, t, form, gamma, lam, dtype)
    dt = getattr(torch, dtype)
    r, v, m, d, boot, tr = _inputs(b, t, form, dt, gen)
    kw = dict(mask=m, dones=d, truncated=tr)
    adv, ret = rlops.gae(r, v, gamma=gamma, lam=lam, bootstrap=boot, method="triton", **kw)
    g = rlops.discounted_returns(r, gamma=gamma, bootstrap=boot, method="triton", **kw)
    assert kernels == {"gae_triton": 2}
    assert adv.dtype == ret.dtype == g.dtype == dt
    half = dt == torch.bfloat16
    rr, vv, bb = (r.float(), v.float(), boot.float()) if half else (r, v, boot)
    ref_adv, ref_ret = rlops.gae(rr, vv, gamma=gamma, lam=lam, bootstrap=bb,
                                 method="reference", **kw)  # fmt: skip
    ref_g = rlops.discounted_returns(rr, gamma=gamma, bootstrap=bb, method="reference", **kw)
    extended = EXTENDED and dt == torch.float64
    o_adv, o_ret = gae_bootstrap_oracle(r, v, gamma, lam, m, d, boot, tr, extended=extended)
    o_g = discounted_returns_bootstrap_oracle(r, gamma, m, d, boot, tr, extended=extended)
    _check("advantages", adv, o_adv, ref_adv)
    _check("returns", ret, o_ret, ref_ret)
    _check("discounted returns", g, o_g, ref_g)


@pytest.mark.parametrize("form", ["row", "token"])
def test_bootstrap_enters_the_last_of_many_blocks(form):
    """Small blocks: the row's end value crosses every block boundary through the carries."""
    from rlops.advantages._masking import GaeInputs, bootstrap_inputs
    from rlops.advantages.triton import gae_triton

    gen = seeded("blocks", form)
    r, v, m, d, boot, tr = _inputs(3, 100, form, torch.float64, gen)
    ends, cut, end = bootstrap_inputs(boot, tr, r, d, torch.float64)
    g = torch.tensor([0.99, 1.0, 0.5], dtype=torch.float64)
    gl = g * 0.9
    adv, ret = gae_triton(GaeInputs(r, v, m, ends, g, gl, cut, end), block_t=16)
    o_adv, o_ret = gae_bootstrap_oracle(r, v, g, 0.9, m, d, boot, tr)
    torch.testing.assert_close(adv, o_adv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, o_ret, rtol=1e-12, atol=1e-12)
    out, _ = gae_triton(GaeInputs(r, None, m, ends, g, g, cut, end), block_t=16)
    o_g = discounted_returns_bootstrap_oracle(r, g, m, d, boot, tr)
    torch.testing.assert_close(out, o_g, rtol=1e-12, atol=1e-12)
