"""The one dispatch of each estimator family (``rlops.scan._dispatch``).

* ``"auto"`` picks compiled on CPU without a gradient (numba installed), chunked under
  autograd, and never numba while ``torch.compile`` traces.
* ``"triton"`` on CPU tensors without the Triton interpreter is a clear ``ValueError``
  (``tests/advantages/test_triton.py`` runs the Triton rows).
* A backend that fails to compile warns once and is replaced by chunked for the rest of the
  process (a failing backend injected into a table).
* Without a gradient, chunked and reference rows run on one single-threaded CPU worker: the
  results do not depend on the caller's thread count; a call made from a worker runs there.
  Under autograd the graph is recorded on the caller's thread (gradients add up in its order).
* The exact cut (``rlops.scan.decay.decayed``): nothing beyond a zero decay leaks, not even
  NaN, and its gradient there is 0.
"""

from __future__ import annotations

import importlib.util
import threading
import warnings

import pytest
import torch
from tests.tolerances import needs_numba

import rlops
from rlops import _backends
from rlops._threads import for_each
from rlops.advantages.reinforce import REINFORCE
from rlops.advantages.returns import RETURNS
from rlops.scan import SCAN
from rlops.scan import _dispatch as dispatch
from rlops.scan._dispatch import CHUNKED, Backend, Case, Row, Table
from rlops.scan.chunked import scan_chunked
from rlops.scan.decay import decayed

TABLES = {"scan": SCAN, "returns": RETURNS, "reinforce": REINFORCE}
CPU = torch.device("cpu")


def _case(**kw) -> Case:
    return Case(kw.pop("device", CPU), kw.pop("dtype", torch.float32), **kw)


@pytest.fixture
def clean_failures(monkeypatch):
    """A process-wide record of failed backends that this test alone sees."""
    monkeypatch.setattr(_backends, "_failed", {})


# --------------------------------------------------------------------------- choosing
@needs_numba
@pytest.mark.parametrize("table", list(TABLES))
def test_auto_picks_compiled_on_cpu_without_a_gradient(table):
    assert TABLES[table].method("auto", _case()) == "compiled"


@pytest.mark.parametrize("table", list(TABLES))
def test_auto_picks_chunked_under_autograd(table):
    assert TABLES[table].method("auto", _case(needs_grad=True)) == "chunked"


@pytest.mark.parametrize("table", list(TABLES))
def test_auto_never_picks_numba_while_compiling(table, monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert TABLES[table].method("auto", _case()) == "chunked"


@pytest.mark.parametrize("table", list(TABLES))
def test_auto_off_cpu_is_chunked(table):
    assert TABLES[table].method("auto", _case(device=torch.device("meta"))) == "chunked"


@pytest.mark.parametrize(
    "call",
    [
        lambda: rlops.discounted_cumsum(torch.ones(2, 5), 0.9, method="triton"),
        lambda: rlops.gae(torch.ones(2, 5), torch.ones(2, 5), gamma=1.0, lam=1.0, method="triton"),
        lambda: rlops.discounted_returns(torch.ones(2, 5), gamma=1.0, method="triton"),
        lambda: rlops.reinforce_plus_plus_returns(
            torch.ones(2),
            torch.ones(2, 5),
            torch.ones(2, 5),
            kl_coef=0.1,
            gamma=1.0,
            method="triton",
        ),
    ],
)
def test_triton_on_cpu_tensors_needs_the_interpreter(call, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="triton"):  # the interpreter, or the gpu extra
        call()


def test_explicit_method_needs_its_backend():
    with pytest.raises(ValueError, match="CPU"):
        SCAN.method("compiled", _case(device=torch.device("meta")))
    with pytest.raises(ValueError, match="method"):
        SCAN.method("fast", _case())


@needs_numba
def test_a_zero_discount_takes_the_chunked_row_of_the_returns():
    # the fused kernels multiply their carries; the chunked scans cut exactly
    assert RETURNS.row("compiled", _case(discounts=(0.9,)))[1] == "compiled"
    assert RETURNS.row("compiled", _case(discounts=(0.0,)))[1] == "chunked"
    rows = torch.tensor([[0.5], [0.0]])
    assert RETURNS.row("compiled", _case(discounts=(rows,)))[1] == "chunked"
    assert REINFORCE.row("compiled", _case(dtype=torch.bfloat16, discounts=(0.9,)))[1] == (
        "compiled"
    )
    assert REINFORCE.row("compiled", _case(dtype=torch.float16, discounts=(0.9,)))[0].run is (
        REINFORCE.row("chunked", _case())[0].run
    )  # float16: the two-step construction, handed the compiled method (bfloat16 has a kernel)
    assert REINFORCE.row("compiled", _case(dtype=torch.bfloat16, discounts=(0.0,)))[0].run is (
        REINFORCE.row("chunked", _case())[0].run
    )


def test_context_parallel_rows_serve_every_method():
    for method in ("reference", "chunked", "compiled"):
        for table in (RETURNS, REINFORCE):
            row, name = table.row(method, _case(cp=True))
            assert name == method and row.run.__name__ == "_context_parallel"


# --------------------------------------------------------------------------- failing backends
class _CannotCompile(RuntimeError):
    pass


def _failing_table(calls: list) -> Table:
    def broken(method, x):
        calls.append(method)
        raise _CannotCompile("no kernel for this device")

    def chunked(method, x):
        calls.append(method)
        return x + 1

    flaky = Backend("triton", compile_errors=lambda: (_CannotCompile,))
    return Table("op", [Row((flaky,), broken), Row((CHUNKED,), chunked)])


def test_auto_picks_triton_on_cuda_only(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # triton can run CPU tensors, for tests
    table = Table("op", [Row((dispatch.TRITON,), lambda m, x: x), Row((CHUNKED,), lambda m, x: x)])
    assert table.method("auto", _case()) == "chunked"
    assert table.method("auto", _case(device=torch.device("cuda"))) in ("triton", "chunked")
    if importlib.util.find_spec("triton") is not None:
        assert table.method("triton", _case()) == "triton"
        assert table.method("auto", _case(device=torch.device("cuda"))) == "triton"


def test_a_backend_that_fails_to_compile_warns_once_and_falls_back(clean_failures):
    calls: list = []
    table = _failing_table(calls)
    x = torch.zeros(3)
    assert table.method("auto", _case()) == "triton"
    with pytest.warns(RuntimeWarning, match="triton backend failed to compile"):
        assert torch.equal(table("auto", _case(), x), x + 1)
    assert calls == ["triton", "chunked"]
    assert "_CannotCompile" in dispatch.failed()["triton"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        for method in ("auto", "triton"):  # an explicit request runs chunked too
            assert torch.equal(table(method, _case(), x), x + 1)
    assert calls == ["triton", "chunked", "chunked", "chunked"]
    assert table.method("auto", _case()) == "chunked"


def test_other_errors_of_a_backend_propagate(clean_failures):
    def wrong(method, x):
        raise IndexError("a bug, not a compile failure")

    flaky = Backend("triton", compile_errors=lambda: (_CannotCompile,))
    table = Table("op", [Row((flaky,), wrong), Row((CHUNKED,), lambda m, x: x)])
    with pytest.raises(IndexError):
        table("auto", _case(), torch.zeros(1))
    assert dispatch.failed() == {}


@needs_numba
def test_numba_failing_to_compile_falls_back_to_chunked(clean_failures, monkeypatch):
    from numba.core.errors import TypingError

    def broken(method, x, decay, chunk_size):
        raise TypingError("cannot compile here")

    rows = [Row(r.backends, broken) if r.backends[0].name == "compiled" else r for r in SCAN.rows]
    monkeypatch.setattr(SCAN, "rows", rows)
    x = torch.randn(3, 100)
    want = rlops.discounted_cumsum(x, 0.9, method="chunked")
    with pytest.warns(RuntimeWarning, match="compiled backend failed to compile"):
        assert torch.equal(rlops.discounted_cumsum(x, 0.9), want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(rlops.discounted_cumsum(x, 0.9, method="compiled"), want)


# --------------------------------------------------------------------------- kept plans
def _recording_table(calls: list) -> Table:
    def run(name):
        def fn(method, x):
            calls.append(name)
            return x

        return fn

    flaky = Backend("triton", compile_errors=lambda: (_CannotCompile,))
    fast = Row((flaky,), run("fast"), when=lambda case: not case.zero_discount())
    return Table("op", [fast, Row((CHUNKED,), run("chunked"))])


def test_auto_on_cpu_keeps_its_plan_per_dtype_grad_and_zero_discount(clean_failures):
    calls: list = []
    table = _recording_table(calls)
    x = torch.zeros(1)
    cases = [
        (_case(discounts=(0.9,)), "fast"),
        (_case(discounts=(0.0,)), "chunked"),  # the row's `when` refuses a zero discount
        (_case(discounts=(torch.tensor([0.5, 0.0]),)), "chunked"),
        (_case(discounts=(torch.tensor([0.5, 0.7]),)), "fast"),
        (_case(needs_grad=True, discounts=(0.9,)), "fast"),  # (this backend has no grad rule)
        (_case(dtype=torch.bfloat16, discounts=(0.9,)), "fast"),
    ]
    for _ in range(2):  # planned, then kept: the same rows
        for case, row in cases:
            table("auto", case, x)
            assert calls[-1] == row, case
            assert table.plan("auto", case)[0] is table.row(table.method("auto", case), case)[0]
    assert len(table._plans) == 4  # (dtype, grad, cp, zero discount, set aside) seen


def test_a_kept_plan_follows_a_backend_set_aside_and_new_rows(clean_failures):
    calls: list = []
    table = _recording_table(calls)
    case, x = _case(discounts=(0.9,)), torch.zeros(1)
    table("auto", case, x)
    with pytest.warns(RuntimeWarning, match="failed to compile"):
        _backends.set_failed("triton", _CannotCompile("gone"), "the triton backend")
    table("auto", case, x)
    assert calls == ["fast", "chunked"]
    table.rows = [Row((CHUNKED,), lambda m, x: calls.append("new rows"))]
    assert table._plans == {}
    table("auto", case, x)
    assert calls[-1] == "new rows"


def test_kept_gives_the_row_of_the_plain_cpu_case_once_planned(clean_failures):
    """``Table.kept(dtype)``: the row auto keeps for a CPU call in ``dtype`` with no gradient,
    no context parallelism and no zero discount, None before such a call, for another dtype
    or case, and after the backend is set aside (then the chunked row, once planned again)."""
    calls: list = []
    table = _recording_table(calls)
    x = torch.zeros(1)
    fast, chunked = table.rows
    assert table.kept(torch.float32) is None
    table("auto", _case(discounts=(0.0,)), x)  # a zero discount: another case
    table("auto", _case(needs_grad=True, discounts=(0.9,)), x)  # a gradient: another case
    assert table.kept(torch.float32) is None
    table("auto", _case(discounts=(0.9,)), x)
    assert table.kept(torch.float32) is fast and table.kept(torch.bfloat16) is None
    with pytest.warns(RuntimeWarning, match="failed to compile"):
        _backends.set_failed("triton", _CannotCompile("gone"), "the triton backend")
    assert table.kept(torch.float32) is None  # not the plan made before
    table("auto", _case(discounts=(0.9,)), x)
    assert table.kept(torch.float32) is chunked


def test_run_kept_runs_only_the_kept_row_and_not_a_build_failure(clean_failures, monkeypatch):
    calls: list = []
    table = _recording_table(calls)
    fast, chunked = table.rows
    x = torch.zeros(1)

    def work(y):
        return ("ran", y)

    def broken(y):
        raise _CannotCompile("not here")

    assert table.run_kept(torch.float32, fast, work, 1) is None  # no plan yet
    table("auto", _case(discounts=(0.9,)), x)
    assert table.run_kept(torch.float32, fast, work, 1) == ("ran", 1)
    assert table.run_kept(torch.float32, chunked, work, 1) is None  # another row
    assert table.run_kept(torch.float64, fast, work, 1) is None  # another dtype
    assert table.run_kept(torch.float32, fast, broken, 1) is None  # the general path's then
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert table.run_kept(torch.float32, fast, work, 1) is None


def test_no_plan_is_kept_off_cpu_while_compiling_or_for_an_explicit_method(
    clean_failures, monkeypatch
):
    calls: list = []
    table = _recording_table(calls)
    x = torch.zeros(1)
    table("auto", _case(device=torch.device("meta"), discounts=(0.9,)), x)
    table("chunked", _case(discounts=(0.9,)), x)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    table("auto", _case(discounts=(0.9,)), x)
    assert table._plans == {} and calls == ["fast", "chunked", "fast"]


# --------------------------------------------------------------------------- the CPU worker
def _single_threaded(fn):
    """``fn()`` run by a worker of the rlops pool (torch single-threaded there), where rlops
    runs its rows itself: the result a single-threaded caller gets."""
    out: dict = {}
    for_each(lambda i: out.setdefault(i, fn()), [0, 1], CPU)
    return out[0]


@pytest.mark.parametrize("decay", ["scalar", "row", "token"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 129), (8, 2048), (5, 4097), (8, 64)])
def test_chunked_results_do_not_depend_on_the_callers_threads(decay, shape):
    g = torch.Generator().manual_seed(shape[1])
    x = torch.randn(*shape, generator=g)
    a = {
        "scalar": 0.97,
        "row": torch.rand(shape[0], 1, generator=g),
        "token": torch.rand(*shape, generator=g),
    }[decay]
    got = rlops.discounted_cumsum(x, a, method="chunked")
    assert torch.equal(got, _single_threaded(lambda: scan_chunked(x, a)))
    r, v = x, x.flip(-1)
    gae = rlops.gae(r, v, gamma=0.99, lam=0.95, method="chunked")
    want = _single_threaded(lambda: rlops.gae(r, v, gamma=0.99, lam=0.95, method="chunked"))
    assert torch.equal(gae[0], want[0]) and torch.equal(gae[1], want[1])


@pytest.mark.parametrize("grad", [False, True])
def test_which_thread_runs_a_row_of_small_operations(grad):
    # under autograd the graph is recorded here: the engine orders the backward by per-thread
    # sequence numbers, and a leaf's gradient contributions add up in that order
    ran_on = []

    def chunked(method, x):
        ran_on.append(threading.get_ident())
        return x

    table = Table("op", [Row((CHUNKED,), chunked, small_ops=True)])
    table("chunked", _case(needs_grad=grad), None)
    table("chunked", _case(device=torch.device("meta"), needs_grad=grad), None)
    here = threading.get_ident()
    worker = not grad and torch.get_num_threads() > 1
    assert (ran_on[0] != here) == worker
    assert ran_on[1] == here  # not a CPU tensor


def test_the_worker_keeps_the_callers_modes():
    x = torch.randn(2, 50, requires_grad=True)
    with torch.no_grad():
        assert rlops.discounted_cumsum(x, 0.9, method="chunked").grad_fn is None
    with torch.inference_mode():
        assert rlops.discounted_cumsum(x.detach(), 0.9, method="chunked").is_inference()
    assert rlops.discounted_cumsum(x, 0.9, method="chunked").requires_grad


def test_a_call_from_a_worker_runs_there():
    x = torch.randn(3, 200)
    out: dict = {}

    def body(i):
        out[i] = rlops.gae(x, x, gamma=0.9, lam=1.0, method="chunked")[0]

    for_each(body, [0, 1, 2], CPU)
    assert all(torch.equal(out[i], out[0]) for i in range(3))


# --------------------------------------------------------------------------- the exact cut
def test_through_cuts_exactly():
    a = torch.tensor([0.5, 0.0, 1.0, 0.0], requires_grad=True)
    y = torch.tensor([2.0, float("nan"), 3.0, float("inf")], requires_grad=True)
    out = decayed(a, y)
    assert out.tolist() == [1.0, 0.0, 3.0, 0.0]
    out.sum().backward()
    assert a.grad.tolist() == [2.0, 0.0, 3.0, 0.0]
    assert y.grad.tolist() == [0.5, 0.0, 1.0, 0.0]
