"""The Triton rows of the scan family's tables, reached through the public functions under the
CPU interpreter (``TRITON_INTERPRET=1``).

* ``method="triton"`` on ``discounted_cumsum``, ``gae``, ``discounted_returns`` and
  ``reinforce_plus_plus_returns`` runs the kernels (a spy counts their calls) and matches
  ``method="reference"`` by the rule of ``tests/tolerances.py``: float32 and float64 within
  twice the serial reference's error against the oracle, bfloat16 within one ulp of the
  float32 reference rounded; with masks, dones, per-row and per-token discounts, discounts 0
  and 1, and NaN beyond a done or a zero decay not leaking.
* The gradient of ``discounted_cumsum(method="triton")`` (the adjoint scan) equals the
  reference's autograd; the estimators' kernels are forward only: ``method="triton"`` under
  autograd is a clear ``ValueError``, as ``"compiled"`` is, and ``auto`` picks chunked.
* ``auto`` picks triton on CUDA tensors only (never while ``torch.compile`` traces): on CPU
  it picks compiled or chunked even under the interpreter.
* Without the interpreter a CPU call to ``"triton"`` raises saying so; without triton it names
  the ``gpu`` extra.
* A kernel that fails to compile (triton's ``CompilationError`` or a compiler pass's plain
  ``RuntimeError`` injected at the launch) warns once, and the chunked row runs that call and
  every later one, for each table and for the log-prob ops (one record); in the scan's
  backward too, which runs outside the tables.
* With ``cp_group=``, the context-parallel row runs its local scans on the kernels.
"""

from __future__ import annotations

import itertools
import types
import warnings

import pytest
import torch
from tests._triton_interp import (  # (sets TRITON_INTERPRET=1 first)
    random_decay,
    seeded,
    triton,  # noqa: F401
)
from tests.oracles import (
    EXTENDED,
    discounted_cumsum_oracle,
    discounted_returns_oracle,
    gae_oracle,
)
from tests.tolerances import assert_half_matches, assert_within_reference

import rlops
import rlops.advantages.triton as adv_triton
import rlops.scan.triton as scan_triton
from rlops import _backends
from rlops.advantages.reinforce import REINFORCE
from rlops.advantages.returns import RETURNS
from rlops.scan import SCAN
from rlops.scan import _dispatch as dispatch
from rlops.scan._dispatch import Case

TABLES = {"scan": SCAN, "returns": RETURNS, "reinforce": REINFORCE}
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def clean_failures(monkeypatch):
    """A process-wide record of failed backends that this test alone sees."""
    monkeypatch.setattr(_backends, "_failed", {})


@pytest.fixture
def kernels(monkeypatch, clean_failures):
    """Counts the calls of the Triton entry points the rows use (they still run)."""
    calls: dict[str, int] = {}

    def spy(module, name):
        original = getattr(module, name)

        def wrapped(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapped)

    spy(scan_triton, "reverse_scan")
    spy(adv_triton, "gae_triton")
    spy(adv_triton, "reinforce_returns_triton")
    return calls


# ------------------------------------------------------------------ discounted_cumsum


def _check_cumsum(name, out, x, a, dim=-1):
    assert out.dtype == x.dtype and out.shape == x.shape, (out.dtype, out.shape)
    if x.dtype == torch.bfloat16:
        a32 = a.float() if isinstance(a, torch.Tensor) else a
        ref32 = rlops.discounted_cumsum(x.float(), a32, dim=dim, method="reference")
        assert_half_matches(name, out, ref32, discounted_cumsum_oracle(x, a, dim))
        return
    extended = EXTENDED and x.dtype == torch.float64
    oracle = discounted_cumsum_oracle(x, a, dim, extended=extended)
    ref = rlops.discounted_cumsum(x, a, dim=dim, method="reference")
    assert_within_reference(name, out, oracle, ref)


CUMSUM_CASES = [
    pytest.param(b, t, kind, d, dt, id=f"{dt}-{kind}-{d}-B{b}-T{t}")
    for (b, t), kind, d, dt in itertools.chain(
        itertools.product(
            [(1, 1), (3, 127), (2, 129), (1, 1000)], ["scalar", "row", "token"], [0.97], ["float32"]
        ),
        itertools.product([(2, 301)], ["row", "token"], [0.97], ["float64", "bfloat16"]),
        itertools.product([(2, 301)], ["scalar", "token"], [0.0, 1.0], ["float32"]),
    )
]


@pytest.mark.parametrize(("b", "t", "kind", "d", "dtype"), CUMSUM_CASES)
def test_discounted_cumsum_triton_matches_reference(kernels, b, t, kind, d, dtype):
    gen = seeded("cumsum", b, t, kind, d, dtype)
    dt = getattr(torch, dtype)
    x = torch.randn(b, t, generator=gen, dtype=torch.float64).to(dt)
    a = random_decay(kind, d, b, t, dt, gen)
    out = rlops.discounted_cumsum(x, a, method="triton")
    assert kernels == {"reverse_scan": 1}
    _check_cumsum(f"{dtype} {kind} d={d} [{b}, {t}]", out, x, a)


def test_discounted_cumsum_triton_along_another_dim(kernels):
    gen = seeded("dim")
    x = torch.randn(129, 3, generator=gen)  # time first
    a = random_decay("token", 0.9, 3, 129, torch.float32, gen).T
    _check_cumsum("dim=0", rlops.discounted_cumsum(x, a, dim=0, method="triton"), x, a, dim=0)
    assert kernels == {"reverse_scan": 1}


def test_discounted_cumsum_nan_beyond_a_zero_decay_does_not_leak(kernels):
    x = torch.randn(2, 300, generator=seeded("nan-cumsum"))
    a = torch.full((2, 300), 0.9)
    a[:, 100] = 0.0
    x[0, 290] = float("nan")
    x[1, 101] = float("inf")
    y = rlops.discounted_cumsum(x, a, method="triton")
    assert torch.isfinite(y[:, :101]).all()
    want = rlops.discounted_cumsum(x[:, :101], a[:, :101], method="reference")
    assert_within_reference(
        "before the cut", y[:, :101], discounted_cumsum_oracle(x[:, :101], a[:, :101]), want
    )


@pytest.mark.parametrize("kind", ["row", "token"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_discounted_cumsum_triton_gradient_matches_reference_autograd(kernels, kind, dtype):
    gen = seeded("grad", kind, dtype)
    dt = getattr(torch, dtype)
    b, t = 3, 301
    x = torch.randn(b, t, generator=gen, dtype=torch.float64).to(dt)
    a = random_decay(kind, 0.9, b, t, dt, gen)
    g = torch.randn(b, t, generator=gen, dtype=torch.float64).to(dt)
    grads = {}
    for method in ("triton", "reference"):
        xm, am = x.clone().requires_grad_(), a.clone().requires_grad_()
        rlops.discounted_cumsum(xm, am, method=method).backward(g)
        grads[method] = (xm.grad, am.grad)
    assert kernels == {"reverse_scan": 1}
    # the adjoint scan against the reference's autograd (the serial loop's chain rule); in
    # float32 both sum the same terms in different orders
    tol = dict(rtol=1e-10, atol=1e-12) if dt == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    for got, want in zip(grads["triton"], grads["reference"], strict=True):
        torch.testing.assert_close(got, want, **tol)


# ------------------------------------------------------------------ GAE and returns
def _indicators(b, t, gen, mask, dones):
    m = (torch.rand(b, t, generator=gen) < 0.7) if mask else None
    d = (torch.rand(b, t, generator=gen) < 0.03) if dones else None
    return m, d


GAE_CASES = [
    pytest.param(b, t, m, d, g, lam, dt, id=f"{dt}-m{int(m)}-d{int(d)}-g{g}-l{lam}-B{b}-T{t}")
    for (b, t), m, d, (g, lam), dt in itertools.chain(
        itertools.product(
            [(1, 1), (3, 127), (2, 129), (1, 1000)],
            [False, True],
            [False, True],
            [(0.99, 0.95)],
            ["float32"],
        ),
        itertools.product(
            [(2, 301)], [True], [True], [(0.0, 0.95), (1.0, 1.0), (0.99, 0.0)], ["float32"]
        ),
        itertools.product([(2, 301)], [True], [True], [(0.99, 0.95)], ["float64", "bfloat16"]),
    )
]


def _check_estimator(name, out, oracle, ref32_or_ref):
    if out.dtype == torch.bfloat16:
        assert_half_matches(name, out, ref32_or_ref, oracle)
    else:
        assert_within_reference(name, out, oracle, ref32_or_ref)


@pytest.mark.parametrize(("b", "t", "mask", "dones", "gamma", "lam", "dtype"), GAE_CASES)
def test_gae_and_returns_triton_match_reference(kernels, b, t, mask, dones, gamma, lam, dtype):
    gen = seeded("gae", b, t, mask, dones, gamma, lam, dtype)
    dt = getattr(torch, dtype)
    r = torch.randn(b, t, generator=gen, dtype=torch.float64).to(dt)
    v = torch.randn(b, t, generator=gen, dtype=torch.float64).to(dt)
    m, d = _indicators(b, t, gen, mask, dones)
    kw = dict(mask=m, dones=d)
    adv, ret = rlops.gae(r, v, gamma=gamma, lam=lam, method="triton", **kw)
    out = rlops.discounted_returns(r, gamma=gamma, method="triton", **kw)
    assert kernels == {"gae_triton": 2}
    assert adv.dtype == ret.dtype == out.dtype == dt
    half = dt == torch.bfloat16
    rr, vv = (r.float(), v.float()) if half else (r, v)  # half: the float32 reference
    ref_adv, ref_ret = rlops.gae(rr, vv, gamma=gamma, lam=lam, method="reference", **kw)
    ref_g = rlops.discounted_returns(rr, gamma=gamma, method="reference", **kw)
    extended = EXTENDED and dt == torch.float64
    o_adv, o_ret = gae_oracle(r, v, gamma, lam, m, d, extended=extended)
    o_g = discounted_returns_oracle(r, gamma, m, d, extended=extended)
    _check_estimator("advantages", adv, o_adv, ref_adv)
    _check_estimator("returns", ret, o_ret, ref_ret)
    _check_estimator("discounted returns", out, o_g, ref_g)


def test_gae_triton_per_row_discounts_and_empty_rows(kernels):
    gen = seeded("rows")
    b, t = 4, 257
    r, v = torch.randn(b, t, generator=gen), torch.randn(b, t, generator=gen)
    m, d = _indicators(b, t, gen, True, True)
    m[1] = False  # a row with no action token
    gamma = torch.tensor([0.9, 0.99, 1.0, 0.0])
    lam = torch.tensor([0.95, 0.5, 1.0, 0.9])
    adv, ret = rlops.gae(r, v, gamma=gamma, lam=lam, mask=m, dones=d, method="triton")
    out = rlops.discounted_returns(r, gamma=gamma, mask=m, dones=d, method="triton")
    assert kernels == {"gae_triton": 2}
    ref_adv, ref_ret = rlops.gae(r, v, gamma=gamma, lam=lam, mask=m, dones=d, method="reference")
    ref_g = rlops.discounted_returns(r, gamma=gamma, mask=m, dones=d, method="reference")
    o_adv, o_ret = gae_oracle(r, v, gamma, lam, m, d)
    assert_within_reference("advantages", adv, o_adv, ref_adv)
    assert_within_reference("returns", ret, o_ret, ref_ret)
    assert_within_reference(
        "discounted returns", out, discounted_returns_oracle(r, gamma, m, d), ref_g
    )
    assert (adv[1] == 0).all() and (ret[1] == 0).all() and (out[1] == 0).all()


def test_gae_triton_nan_beyond_a_done_does_not_leak(kernels):
    gen = seeded("gae-nan")
    r, v = torch.randn(2, 300, generator=gen), torch.randn(2, 300, generator=gen)
    d = torch.zeros(2, 300, dtype=torch.bool)
    d[:, 40] = True
    r[:, 41:] = float("nan")
    v[:, 41:] = float("nan")
    adv, ret = rlops.gae(r, v, gamma=0.99, lam=0.95, dones=d, method="triton")
    out = rlops.discounted_returns(r, gamma=0.99, dones=d, method="triton")
    assert kernels == {"gae_triton": 2}
    head = slice(None), slice(0, 41)
    assert torch.isfinite(adv[head]).all() and torch.isfinite(ret[head]).all()
    assert torch.isfinite(out[head]).all()
    ref_adv, _ = rlops.gae(r[head], v[head], gamma=0.99, lam=0.95, method="reference")
    o_adv, _ = gae_oracle(r[head], v[head], 0.99, 0.95)
    assert_within_reference("advantages before the done", adv[head], o_adv, ref_adv)


# ------------------------------------------------------------------ REINFORCE++
def _rpp_oracle(outcome, kl, m, kl_coef, gamma, extended=False):
    """The definition: the token reward ``-kl_coef * kl`` rounded in the input dtype, the
    outcome added on the row's last action token, discounted returns over action tokens."""
    tok = torch.where(m, -kl_coef * kl, 0.0)
    last = (kl.shape[1] - 1) - m.flip(-1).to(torch.uint8).argmax(-1)
    for row in range(kl.shape[0]):
        if m[row].any():
            tok[row, last[row]] += outcome[row]
    return tok, discounted_returns_oracle(tok, gamma, m, extended=extended)


@pytest.mark.parametrize(
    ("dtype", "gamma"),
    [
        ("float32", 0.99),
        ("float64", 0.9),
        ("float32", 1.0),
        ("float32", 0.0),
        ("float32", "rows"),
        ("bfloat16", 0.99),
    ],
)
def test_reinforce_triton_matches_reference(kernels, dtype, gamma):
    gen = seeded("rpp", dtype, gamma)
    dt = getattr(torch, dtype)
    b, t = 4, 333
    kl = torch.randn(b, t, generator=gen, dtype=torch.float64).to(dt)
    outcome = torch.randn(b, generator=gen, dtype=torch.float64).to(dt)
    m = torch.rand(b, t, generator=gen) < 0.6
    m[1] = False  # no action token: 0s
    m[2, 300:] = False  # the outcome lands well before the row's end
    if gamma == "rows":
        gamma = torch.tensor([0.9, 0.99, 0.0, 1.0])
    out = rlops.reinforce_plus_plus_returns(
        outcome, kl, m, kl_coef=0.05, gamma=gamma, method="triton"
    )
    assert out.dtype == dt
    tok, oracle = _rpp_oracle(outcome, kl, m, 0.05, gamma, EXTENDED and dt == torch.float64)
    if dt == torch.bfloat16:
        # half precision: the two-step form (token rewards rounded, then the returns kernel)
        assert kernels == {"gae_triton": 1}
        ref32 = rlops.discounted_returns(tok.float(), gamma=gamma, mask=m, method="reference")
        assert_half_matches("REINFORCE++ returns", out, ref32, oracle)
    else:
        assert kernels == {"reinforce_returns_triton": 1}
        ref = rlops.reinforce_plus_plus_returns(
            outcome, kl, m, kl_coef=0.05, gamma=gamma, method="reference"
        )
        assert_within_reference("REINFORCE++ returns", out, oracle, ref)
    assert (out[1] == 0).all()


# ------------------------------------------------------------------ choosing
def _case(device=CPU, **kw) -> Case:
    return Case(device, kw.pop("dtype", torch.float32), **kw)


@pytest.mark.parametrize("table", list(TABLES))
def test_auto_picks_triton_on_cuda_tensors(table, clean_failures):
    assert TABLES[table].method("auto", _case(CUDA)) == "triton"
    assert TABLES[table].method("auto", _case(CUDA, dtype=torch.bfloat16)) == "triton"


@pytest.mark.parametrize("table", list(TABLES))
def test_auto_never_picks_triton_while_compiling(table, monkeypatch, clean_failures):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert TABLES[table].method("auto", _case(CUDA)) == "chunked"


def test_under_autograd_only_the_scan_keeps_triton(clean_failures):
    # the scan's Triton row has the adjoint kernels; the estimators' kernels are forward only
    assert SCAN.method("auto", _case(CUDA, needs_grad=True)) == "triton"
    for table in (RETURNS, REINFORCE):
        assert table.method("auto", _case(CUDA, needs_grad=True)) == "chunked"
        with pytest.raises(ValueError, match="no gradient"):
            table.method("triton", _case(CUDA, needs_grad=True))


def test_estimators_refuse_triton_under_autograd():
    r = torch.randn(2, 9, requires_grad=True)
    with pytest.raises(ValueError, match='method="triton" has no gradient'):
        rlops.gae(r, r.detach(), gamma=0.9, lam=0.9, method="triton")
    with pytest.raises(ValueError, match='method="triton" has no gradient'):
        rlops.discounted_returns(r, gamma=0.9, method="triton")
    with pytest.raises(ValueError, match='method="triton" has no gradient'):
        rlops.reinforce_plus_plus_returns(
            torch.ones(2), r, torch.ones(2, 9), kl_coef=0.1, gamma=0.9, method="triton"
        )
    adv, _ = rlops.gae(r, r.detach(), gamma=0.9, lam=0.9)  # auto: chunked, differentiable
    assert adv.requires_grad


def test_auto_on_cpu_stays_off_triton_under_the_interpreter(kernels):
    compiled = "compiled" if dispatch.compiled.available() else "chunked"
    for table in TABLES.values():
        assert table.method("auto", _case()) == compiled
        assert table.method("auto", _case(needs_grad=True)) == "chunked"
    x = torch.randn(2, 50, generator=seeded("auto"))
    m = torch.rand(2, 50, generator=seeded("auto-m")) < 0.5
    rlops.discounted_cumsum(x, 0.9)
    rlops.gae(x, x, gamma=0.9, lam=0.9)
    rlops.discounted_returns(x, gamma=0.9)
    rlops.reinforce_plus_plus_returns(torch.ones(2), x, m, kl_coef=0.1, gamma=0.9)
    assert kernels == {}


def _triton_calls():
    x = torch.ones(2, 5)
    return [
        lambda: rlops.discounted_cumsum(x, 0.9, method="triton"),
        lambda: rlops.gae(x, x, gamma=1.0, lam=1.0, method="triton"),
        lambda: rlops.discounted_returns(x, gamma=1.0, method="triton"),
        lambda: rlops.reinforce_plus_plus_returns(
            torch.ones(2), x, x, kl_coef=0.1, gamma=1.0, method="triton"
        ),
    ]


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    for call in _triton_calls():
        with pytest.raises(ValueError, match=r"CUDA tensors.*TRITON_INTERPRET=1"):
            call()


def test_triton_without_the_package_names_the_extra(monkeypatch):
    monkeypatch.setattr(_backends, "triton_importable", lambda: False)
    for call in _triton_calls():
        with pytest.raises(ValueError, match=r'pip install "rlops\[gpu\]"'):
            call()
    for table in TABLES.values():
        assert table.method("auto", _case(CUDA)) == "chunked"


# ------------------------------------------------------------------ a kernel that cannot build
def _injected(kind: str) -> Exception:
    """A build failure as triton raises it at a kernel's first launch: its own compilation
    error, or the plain RuntimeError of a compiler pass."""
    if kind == "CompilationError":
        from triton.compiler.errors import CompilationError

        return CompilationError(None, None, "injected: no kernel for this device")
    return RuntimeError("PassManager::run failed (injected)")


BUILD_ERRORS = ["CompilationError", "RuntimeError"]


class _Unbuildable:
    """Stands for a ``@triton.jit`` kernel whose launch fails to build on this device."""

    def __init__(self, launches: list, kind: str = "CompilationError"):
        self.launches, self.kind = launches, kind

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(grid)
            raise _injected(self.kind)

        return launch


def _calls(name):
    gen = seeded("fail", name)
    x = torch.randn(2, 301, generator=gen)
    m = torch.rand(2, 301, generator=gen) < 0.7
    if name == "scan":
        return lambda method: rlops.discounted_cumsum(x, 0.9, method=method)
    if name == "returns":
        return lambda method: rlops.gae(x, x.flip(-1), gamma=0.99, lam=0.95, mask=m, method=method)
    return lambda method: rlops.reinforce_plus_plus_returns(
        torch.ones(2), x, m, kl_coef=0.1, gamma=0.99, method=method
    )


@pytest.mark.parametrize("error", BUILD_ERRORS)
@pytest.mark.parametrize("table", list(TABLES))
def test_a_kernel_that_fails_to_compile_warns_once_and_falls_back(
    table, error, monkeypatch, clean_failures
):
    from rlops.logprobs import _options as _method

    launches: list = []
    module, kernel = (
        (scan_triton, "_scan_block") if table == "scan" else (adv_triton, "_estimator_block")
    )
    monkeypatch.setattr(module, kernel, _Unbuildable(launches, error))
    call = _calls(table)
    want = call("chunked")
    with pytest.warns(RuntimeWarning, match=r"(?s)triton backend failed to compile.*injected"):
        got = call("triton")
    assert len(launches) == 1
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert error in dispatch.failed()["triton"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning, and no second launch
        torch.testing.assert_close(call("triton"), want, rtol=0, atol=0)
    assert len(launches) == 1
    for t in TABLES.values():  # set aside for every family: auto on CUDA picks chunked
        assert t.method("auto", _case(CUDA)) == "chunked"
    # one record for every Triton op: the log-prob kernels are set aside too
    assert _method.resolve("auto", types.SimpleNamespace(device=CUDA)) == "chunked"


@pytest.mark.parametrize("error", BUILD_ERRORS)
@pytest.mark.parametrize("decay", ["row", "token"])
def test_a_kernel_that_fails_to_build_in_the_backward_falls_back(
    error, decay, monkeypatch, clean_failures
):
    """The scan's backward runs outside the dispatch: a kernel failing to build there warns
    once, the gradients are the chunked method's, and the rest of the process runs chunked."""
    gen = seeded("backward", error, decay)
    b, t = 2, 301
    x = torch.randn(b, t, generator=gen, dtype=torch.float64)
    a = random_decay(decay, 0.9, b, t, torch.float64, gen)
    g = torch.randn(b, t, generator=gen, dtype=torch.float64)

    def grads(method):
        xs = x.clone().requires_grad_()
        ts = a.clone().requires_grad_()
        y = rlops.discounted_cumsum(xs, ts, method=method)
        if method == "triton":  # the forward ran the kernels; the backward's cannot build
            monkeypatch.setattr(scan_triton, "_scan_block", _Unbuildable(launches, error))
        y.backward(g)
        return y.detach(), xs.grad, ts.grad

    launches: list = []
    want = grads("chunked")
    with pytest.warns(RuntimeWarning, match=r"(?s)triton backend.*backward.*injected"):
        got = grads("triton")
    assert len(launches) == 1 and error in dispatch.failed()["triton"]
    for name, u, w in zip(("y", "x.grad", "a.grad"), got, want, strict=True):
        torch.testing.assert_close(u, w, msg=name)  # float64: both far inside the defaults
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning; the table runs chunked now
        assert SCAN.method("auto", _case(CUDA)) == "chunked"
        xs = x.clone().requires_grad_()
        rlops.discounted_cumsum(xs, a, method="triton").backward(g)
    assert len(launches) == 1


def test_an_interpreter_error_is_a_bug_not_a_build_failure(monkeypatch, clean_failures):
    from triton.runtime.errors import InterpreterError

    def broken(*args, **kwargs):
        raise InterpreterError("a kernel's own error")

    monkeypatch.setattr(scan_triton, "_scan_forward", broken)
    with pytest.raises(InterpreterError):
        rlops.discounted_cumsum(torch.ones(2, 5), 0.9, method="triton")
    assert dispatch.failed() == {}


# ------------------------------------------------------------------ context parallel
def _cp_triton(rank: int, world: int):
    import torch.distributed as dist

    from rlops.distributed import zigzag_shard, zigzag_unshard

    group = dist.group.WORLD
    launched = []
    original = scan_triton.reverse_scan

    def counted(*args, **kwargs):
        launched.append(1)
        return original(*args, **kwargs)

    scan_triton.reverse_scan = counted  # a fresh group of this test alone (fresh=True)
    t_len = 4 * world * 17
    gen = seeded("cp")
    r = torch.randn(2, t_len, generator=gen, dtype=torch.float64)
    v = torch.randn(2, t_len, generator=gen, dtype=torch.float64)
    m = torch.rand(2, t_len, generator=gen) < 0.7
    d = torch.rand(2, t_len, generator=gen) < 0.05
    decay = random_decay("token", 0.95, 2, t_len, torch.float64, gen)

    def shard(x):
        return zigzag_shard(x, cp_size=world, cp_rank=rank)

    def full(y):
        return zigzag_unshard(y, group=group, length=t_len)

    adv, ret = rlops.gae(
        shard(r),
        shard(v),
        gamma=0.99,
        lam=0.95,
        mask=shard(m),
        dones=shard(d),
        method="triton",
        cp_group=group,
    )
    out = {
        "adv": full(adv),
        "ret": full(ret),
        "returns": full(
            rlops.discounted_returns(
                shard(r), gamma=0.9, mask=shard(m), dones=shard(d), method="triton", cp_group=group
            )
        ),
        "rpp": full(
            rlops.reinforce_plus_plus_returns(
                r[:, 0],
                shard(v),
                shard(m),
                kl_coef=0.1,
                gamma=0.95,
                method="triton",
                cp_group=group,
            )
        ),
        "cumsum": full(
            rlops.discounted_cumsum(shard(r), shard(decay), method="triton", cp_group=group)
        ),
        "launched": len(launched),
    }
    return out, (r, v, m, d, decay)


@pytest.mark.distributed
def test_context_parallel_row_runs_the_local_scans_on_triton(monkeypatch):
    from tests._distributed import run_distributed

    results = run_distributed(_cp_triton, 2, timeout=180, fresh=True)
    (out, (r, v, m, d, decay)), (out1, _) = results
    for key in ("adv", "ret", "returns", "rpp", "cumsum"):
        assert torch.equal(out[key], out1[key]), key
    assert out["launched"] >= 5  # the local scans of every call ran on the kernels
    extended = EXTENDED
    o_adv, o_ret = gae_oracle(r, v, 0.99, 0.95, m, d, extended=extended)
    ref_adv, ref_ret = rlops.gae(r, v, gamma=0.99, lam=0.95, mask=m, dones=d, method="reference")
    assert_within_reference("cp advantages", out["adv"], o_adv, ref_adv)
    assert_within_reference("cp returns", out["ret"], o_ret, ref_ret)
    o_g = discounted_returns_oracle(r, 0.9, m, d, extended=extended)
    ref_g = rlops.discounted_returns(r, gamma=0.9, mask=m, dones=d, method="reference")
    assert_within_reference("cp discounted returns", out["returns"], o_g, ref_g)
    o_y = discounted_cumsum_oracle(r, decay, extended=extended)
    ref_y = rlops.discounted_cumsum(r, decay, method="reference")
    assert_within_reference("cp discounted_cumsum", out["cumsum"], o_y, ref_y)
    ref_rpp = rlops.reinforce_plus_plus_returns(
        r[:, 0], v, m, kl_coef=0.1, gamma=0.95, method="reference"
    )
    _, o_rpp = _rpp_oracle(r[:, 0], v, m, 0.1, 0.95, extended)
    assert_within_reference("cp REINFORCE++ returns", out["rpp"], o_rpp, ref_rpp)
