"""The plain calls go straight to the compiled kernel once auto has kept that plan
(``Table.kept``): ``rlops.gae`` with float discounts in (0, 1], C-contiguous CPU ``rewards``
and ``values`` of one dtype, an optional C-contiguous bool mask and nothing else;
``rlops.reinforce_plus_plus_returns`` with float ``kl_coef`` and ``gamma``, CPU ``kl``,
``rewards`` of its dtype and a bool ``mask``. Their outputs are the general path's, bit for
bit, and every other call takes the general path, which checks it (errors unchanged)."""

from __future__ import annotations

import pytest
import torch
from tests.tolerances import needs_numba

import rlops
from rlops.advantages import reinforce, returns

pytestmark = needs_numba

INT = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16}


def _spy(monkeypatch, module) -> list:
    """Whether each call asked took the plain lane (True) or the general path (False)."""
    taken: list = []
    plain = module._plain

    def spy(*args):
        out = plain(*args)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(module, "_plain", spy)
    return taken


@pytest.fixture
def lanes(monkeypatch):
    return _spy(monkeypatch, returns)


@pytest.fixture
def rpp_lanes(monkeypatch):
    return _spy(monkeypatch, reinforce)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT[t.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (3, 127), (8, 1040), (11, 4099), (0, 5), (4, 0)])
@pytest.mark.parametrize("masked", [False, True])
def test_the_plain_call_gives_the_general_paths_bits(dtype, shape, masked, lanes, monkeypatch):
    """On fresh inputs of one shape call after call (the kept launch run on other arrays and
    new outputs), at one and two threads, the plain call gives the explicit method's bits."""
    from rlops.advantages import compiled

    monkeypatch.setattr(compiled, "_KEPT", {})
    threads = torch.get_num_threads()
    calls = [(0.99, 0.95, 1), (0.99, 0.95, 1), (0.99, 0.95, 2), (1.0, 1.0, 2), (1e-30, 0.5, 2)]
    for seed, (gamma, lam, n) in enumerate([*calls, (0.99, 0.95, 1)]):
        torch.set_num_threads(n)
        g = torch.Generator().manual_seed(seed + sum(shape))
        r = torch.randn(*shape, generator=g).to(dtype)
        v = torch.randn(*shape, generator=g).to(dtype)
        mask = torch.rand(*shape, generator=g) < 0.7 if masked else None
        try:
            rlops.gae(r, v, gamma=gamma, lam=lam, mask=mask)  # (the plan is made)
            lanes.clear()
            adv, ret = rlops.gae(r, v, gamma=gamma, lam=lam, mask=mask)
            assert lanes == [True]
            # the general path on the same kernel: an explicit method (no plain lane asked)
            want = rlops.gae(r, v, gamma=gamma, lam=lam, mask=mask, method="compiled")
        finally:
            torch.set_num_threads(threads)
        assert lanes == [True]
        assert adv.dtype == ret.dtype == dtype and adv.shape == ret.shape == r.shape
        assert adv.data_ptr() != ret.data_ptr() or r.numel() == 0
        assert torch.equal(_bits(adv), _bits(want[0])) and torch.equal(_bits(ret), _bits(want[1]))
    if 0 not in shape:  # kept: one launch per mask or none, discounts and thread count
        assert len(compiled._KEPT) == 4


def test_kept_launches_are_kept_apart_by_mask_and_shape(lanes, monkeypatch):
    """Calls of one dtype and discounts alternating between a mask and none, and between two
    shapes, each reach the launch made for their own kind."""
    from rlops.advantages import compiled

    monkeypatch.setattr(compiled, "_KEPT", {})
    g = torch.Generator().manual_seed(7)
    for rows, t in [(8, 1040), (3, 1040), (8, 1040), (8, 2080)] * 2:
        r, v = torch.randn(rows, t, generator=g), torch.randn(rows, t, generator=g)
        for mask in (None, torch.rand(rows, t, generator=g) < 0.5, None):
            rlops.gae(r, v, gamma=0.99, lam=0.95, mask=mask)
            lanes.clear()
            got = rlops.gae(r, v, gamma=0.99, lam=0.95, mask=mask)
            want = rlops.gae(r, v, gamma=0.99, lam=0.95, mask=mask, method="compiled")
            assert lanes == [True]
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert len(compiled._KEPT) == 6


def _r(dtype=torch.float32, shape=(3, 40)):
    return torch.randn(*shape, dtype=dtype)


def test_every_other_call_takes_the_general_path(lanes):
    r, v = _r(), _r()
    rlops.gae(r, v, gamma=0.9, lam=0.9)  # the plan is made
    others = [
        dict(gamma=0.9, lam=0.9, method="compiled"),
        dict(gamma=0.9, lam=0.9, chunk_size=16),
        dict(gamma=0.9, lam=0.9, returns_lam=0.5),
        dict(gamma=0.9, lam=0.9, dones=torch.zeros(3, 40, dtype=torch.bool)),
        dict(gamma=0.9, lam=0.9, bootstrap=torch.zeros(3)),
        dict(gamma=0.9, lam=0.9, mask=torch.ones(3, 40)),  # a float mask
        dict(gamma=0.9, lam=0.9, mask=torch.ones(40, 3, dtype=torch.bool).T),  # not contiguous
        dict(gamma=torch.tensor(0.9), lam=0.9),
        dict(gamma=1, lam=0.9),  # an int
        dict(gamma=0.0, lam=0.9),  # zero discounts: the chunked row
        dict(gamma=0.9, lam=0.0),
        dict(gamma=1e-200, lam=1e-200),  # their product 0
    ]
    for kw in others:
        lanes.clear()
        rlops.gae(r, v, **kw)
        assert lanes in ([], [False]), kw
    for args in [
        (r.T.contiguous().T, v),
        (r, v.double()),
        (r.half(), v.half()),
        (r[None], v[None]),
    ]:
        lanes.clear()
        try:
            rlops.gae(*args, gamma=0.9, lam=0.9)
        except ValueError:
            pass  # (the general path's error)
        assert lanes == [False], [a.shape for a in args]
    w = r.clone().requires_grad_()
    lanes.clear()
    adv, _ = rlops.gae(w, v, gamma=0.9, lam=0.9)
    assert lanes == [False] and adv.requires_grad


def test_before_a_plan_or_with_the_backend_set_aside_the_general_path_runs(lanes, monkeypatch):
    from rlops import _backends

    monkeypatch.setattr(returns.RETURNS, "rows", returns.RETURNS.rows)  # (no plan kept yet)
    r, v = _r(torch.float64), _r(torch.float64)
    rlops.gae(r, v, gamma=0.9, lam=0.9)
    rlops.gae(r, v, gamma=0.9, lam=0.9)
    assert lanes == [False, True]
    monkeypatch.setattr(_backends, "_failed", {"compiled": "set aside"})
    lanes.clear()
    rlops.gae(r, v, gamma=0.9, lam=0.9)
    rlops.gae(r, v, gamma=0.9, lam=0.9)
    assert lanes == [False, False]  # the kept plan is chunked's


@pytest.mark.parametrize(
    "kw, error",
    [
        (dict(gamma=1.5, lam=0.9), ValueError),
        (dict(gamma=float("nan"), lam=0.9), ValueError),
        (dict(gamma=0.9, lam=-0.1), ValueError),
        (dict(gamma=0.9, lam=0.9, cp_layout="diagonal"), ValueError),
    ],
)
def test_bad_discounts_and_layouts_still_raise(kw, error, lanes):
    r, v = _r(), _r()
    rlops.gae(r, v, gamma=0.9, lam=0.9)
    with pytest.raises(error):
        rlops.gae(r, v, **kw)


def test_bad_tensors_still_raise_the_general_paths_errors():
    r = _r()
    rlops.gae(r, r, gamma=0.9, lam=0.9)
    with pytest.raises(ValueError, match="values"):
        rlops.gae(r, _r(shape=(3, 41)), gamma=0.9, lam=0.9)
    with pytest.raises(TypeError, match="rewards"):
        rlops.gae(r.int(), r.int(), gamma=0.9, lam=0.9)
    with pytest.raises(ValueError, match="rewards"):
        rlops.gae(r[0], r[0], gamma=0.9, lam=0.9)


# --------------------------------------------------------------------------- REINFORCE++
def _rpp_inputs(dtype, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    kl = (torch.randn(*shape, generator=g) * 0.1).to(dtype)
    outcome = torch.randn(shape[0], generator=g).to(dtype)
    lengths = torch.randint(0, shape[1] + 1, (shape[0], 1), generator=g)
    return outcome, kl, torch.arange(shape[1]) < lengths


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (3, 127), (8, 1040), (11, 4099), (0, 5), (4, 0)])
def test_the_plain_reinforce_call_gives_the_general_paths_bits(
    dtype, shape, rpp_lanes, monkeypatch
):
    """On fresh inputs of one shape call after call (the kept launch run on other arrays), at
    one and two threads, the plain call gives the explicit method's bits."""
    from rlops.advantages import compiled

    monkeypatch.setattr(compiled, "_KEPT", {})
    threads = torch.get_num_threads()
    calls = [(0.1, 0.99, 1), (0.1, 0.99, 1), (0.1, 0.99, 2), (0.0, 1.0, 2), (2.5, 1e-30, 1)]
    for seed, (kl_coef, gamma, n) in enumerate(calls):
        outcome, kl, mask = _rpp_inputs(dtype, shape, seed + sum(shape))
        kw = dict(kl_coef=kl_coef, gamma=gamma)
        torch.set_num_threads(n)
        try:
            rlops.reinforce_plus_plus_returns(outcome, kl, mask, **kw)  # (the plan is made)
            rpp_lanes.clear()
            got = rlops.reinforce_plus_plus_returns(outcome, kl, mask, **kw)
            assert rpp_lanes == [True]
            want = rlops.reinforce_plus_plus_returns(outcome, kl, mask, **kw, method="compiled")
        finally:
            torch.set_num_threads(threads)
        assert rpp_lanes == [True]
        assert got.dtype == dtype and got.shape == kl.shape
        assert torch.equal(_bits(got), _bits(want))
    if 0 not in shape:
        assert len(compiled._KEPT) == 4


def test_every_other_reinforce_call_takes_the_general_path(rpp_lanes):
    outcome, kl, mask = _rpp_inputs(torch.float32, (3, 40))
    rlops.reinforce_plus_plus_returns(outcome, kl, mask, kl_coef=0.1, gamma=0.9)
    others = [
        (outcome, kl, mask.int(), dict(kl_coef=0.1, gamma=0.9)),  # an int mask
        (outcome, kl, mask, dict(kl_coef=0.1, gamma=0.9, method="compiled")),
        (outcome.double(), kl, mask, dict(kl_coef=0.1, gamma=0.9)),  # promoted
        (outcome, kl.T.contiguous().T, mask, dict(kl_coef=0.1, gamma=0.9)),
        (outcome, kl, mask, dict(kl_coef=1, gamma=0.9)),  # an int
        (outcome, kl, mask, dict(kl_coef=0.1, gamma=torch.tensor([0.9] * 3))),
        (outcome, kl, mask, dict(kl_coef=0.1, gamma=0.0)),  # a zero discount
        (outcome, kl.half(), mask, dict(kl_coef=0.1, gamma=0.9)),
    ]
    for args in others:
        rpp_lanes.clear()
        rlops.reinforce_plus_plus_returns(*args[:3], **args[3])
        assert rpp_lanes in ([], [False]), args[3]
    w = kl.clone().requires_grad_()
    rpp_lanes.clear()
    out = rlops.reinforce_plus_plus_returns(outcome, w, mask, kl_coef=0.1, gamma=0.9)
    assert rpp_lanes == [False] and out.requires_grad


@pytest.mark.parametrize(
    "kw, error",
    [
        (dict(kl_coef=-0.1, gamma=0.9), ValueError),
        (dict(kl_coef=float("inf"), gamma=0.9), ValueError),
        (dict(kl_coef=float("nan"), gamma=0.9), ValueError),
        (dict(kl_coef=0.1, gamma=1.5), ValueError),
        (dict(kl_coef=0.1, gamma=0.9, cp_layout="diagonal"), ValueError),
    ],
)
def test_bad_reinforce_arguments_still_raise(kw, error, rpp_lanes):
    outcome, kl, mask = _rpp_inputs(torch.float32, (3, 40))
    rlops.reinforce_plus_plus_returns(outcome, kl, mask, kl_coef=0.1, gamma=0.9)
    with pytest.raises(error):
        rlops.reinforce_plus_plus_returns(outcome, kl, mask, **kw)
    with pytest.raises(ValueError, match="rewards"):
        rlops.reinforce_plus_plus_returns(outcome[:2], kl, mask, kl_coef=0.1, gamma=0.9)
    with pytest.raises(ValueError, match="mask"):
        rlops.reinforce_plus_plus_returns(outcome, kl, mask[:, :5], kl_coef=0.1, gamma=0.9)


def test_a_kernel_failing_to_compile_in_the_plain_lane_falls_back(monkeypatch):
    """A kernel signature first built in the plain lane (here: every build fails) leaves the
    call to the general path, whose dispatch sets the compiled backend aside, warns once and
    runs the chunked row."""
    from numba.core.errors import TypingError

    from rlops import _backends
    from rlops.advantages import compiled

    monkeypatch.setattr(_backends, "_failed", {})
    r, v = _r(), _r()
    outcome, kl, mask = _rpp_inputs(torch.float32, (3, 40))
    rlops.gae(r, v, gamma=0.9, lam=0.9)  # the plans are made
    rlops.reinforce_plus_plus_returns(outcome, kl, mask, kl_coef=0.1, gamma=0.9)

    def broken(*args):
        raise TypingError("cannot compile here")

    for name in ("gae_plain", "gae_kernel", "reinforce_returns_compiled"):
        monkeypatch.setattr(compiled, name, broken)
    with pytest.warns(RuntimeWarning, match="compiled backend failed to compile"):
        adv, ret = rlops.gae(r, v, gamma=0.9, lam=0.9)
        got = rlops.reinforce_plus_plus_returns(outcome, kl, mask, kl_coef=0.1, gamma=0.9)
    want = rlops.gae(r, v, gamma=0.9, lam=0.9, method="chunked")
    assert torch.equal(adv, want[0]) and torch.equal(ret, want[1])
    kw = dict(kl_coef=0.1, gamma=0.9, method="chunked")
    assert torch.equal(got, rlops.reinforce_plus_plus_returns(outcome, kl, mask, **kw))
