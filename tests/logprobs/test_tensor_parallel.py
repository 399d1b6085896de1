"""Vocabulary-parallel log-probs and entropy on real Gloo groups of 4 and of 2 processes.

Each rank holds a slice of the columns of the same logits (or rows of the same output weight);
its outputs and gradient shard must equal the single-process result on the full vocabulary.
The forward makes one all-gather of 64 numbers per rank (the consistency check of
:mod:`rlops.distributed.collectives`) and one of the statistics; with ``RLOPS_TP_CHECK=0`` only
the latter; the backward none. The same counts with ``with_sum_pi_squared=True`` (one more
column in the statistics' gather) and with an output-layer bias split like the weight.
Ranks that make mismatched calls all raise ``ValueError``
(the harness turns a hang into a timeout error).

Spawning processes is the slow part, so one spawn of 4 processes serves every test here: the
vocabulary sharded over all 4, then over two groups of 2 side by side (ranks {0, 1} and {2, 3}).
"""

from __future__ import annotations

import contextlib
import os
import re
import traceback

import pytest
import torch
import torch.distributed as dist
from tests._distributed import count_collectives, run_distributed

from rlops.logprobs import (
    copy_to_tensor_parallel_region,
    linear_logprobs_and_entropy,
    logprobs_and_entropy,
)

pytestmark = pytest.mark.distributed

N, V, H = 23, 52, 6  # V divisible by 2 and 4; N not a multiple of any chunk size used
TPS = (4, 2)
# Shard sizes that differ (each sums to V): rank r holds the next SIZES[tp][r] ids.
UNEQUAL = {4: (10, 17, 12, 13), 2: (20, 32)}

# name -> (dtype, keyword arguments of logprobs_and_entropy; "mask" adds a keep mask)
CASES = {
    "plain": (torch.float64, {}),
    "masked": (torch.float64, {"mask": True, "temperature": 1.7, "chunk_size": 7}),
    "no entropy": (torch.float64, {"with_entropy": False, "chunk_size": 4}),
    "entropy detached": (torch.float64, {"entropy_grad": False, "mask": True}),
    "float32": (torch.float32, {"temperature": 0.5, "chunk_size": 5}),
    "empty": (torch.float64, {"n": 0}),
    "sum_pi_squared masked": (
        torch.float64,
        {"mask": True, "temperature": 1.3, "chunk_size": 5, "with_sum_pi_squared": True},
    ),
    "sum_pi_squared float32": (torch.float32, {"with_sum_pi_squared": True, "with_entropy": False}),
}
LINEAR_CASES = {
    "linear": (torch.float64, {"temperature": 1.7, "chunk_size": 5}),
    "linear float32": (torch.float32, {"with_entropy": False}),
    "linear masked": (torch.float64, {"mask": True, "chunk_size": 6}),
    "linear entropy detached": (torch.float64, {"mask": True, "entropy_grad": False}),
    # "bias": the output layer's bias, split with the weight's rows
    "linear bias": (
        torch.float64,
        {"bias": True, "with_sum_pi_squared": True, "temperature": 1.7, "chunk_size": 5},
    ),
    "linear bias masked": (torch.float64, {"bias": True, "mask": True, "chunk_size": 6}),
}
# Run again on shards of unequal size, and again with the check off (equal shards).
UNEQUAL_CASES = (
    "masked",
    "no entropy",
    "linear",
    "linear masked",
    "sum_pi_squared masked",
    "linear bias",
)
UNCHECKED_CASES = ("masked", "linear", "linear masked", "sum_pi_squared masked", "linear bias")


def _keep_mask(n: int, target: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    keep = torch.rand(n, V, generator=gen) < 0.3
    keep.scatter_(1, target[:, None], False)  # the op must keep the target itself
    keep[: n // 3, V // 4 :] = False  # rows whose other shards hold nothing kept
    keep[n // 3 : n // 2] = False  # rows that keep only the target
    return keep


def _case(name: str, dtype: torch.dtype, kw: dict):
    kw = dict(kw)
    n = kw.pop("n", N)
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    logits = (torch.randn(n, V, generator=gen) * 4).to(dtype)
    target = torch.randint(0, V, (n,), generator=gen)
    if kw.pop("mask", False):
        kw["keep_mask"] = _keep_mask(n, target, gen)
    grads = [torch.randn(n, generator=gen).to(dtype) for _ in range(2)]
    return logits, target, grads, kw


def _linear_case(name: str, dtype: torch.dtype, kw: dict):
    """``(hidden, weight, bias or None, target, grads, keywords)``."""
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    hidden = torch.randn(N, H, generator=gen).to(dtype)
    weight = torch.randn(V, H, generator=gen).to(dtype)
    target = torch.randint(0, V, (N,), generator=gen)
    kw = dict(kw)
    if kw.pop("mask", False):
        kw["keep_mask"] = _keep_mask(N, target, gen)
    bias = (torch.randn(V, generator=gen) * 2).to(dtype) if kw.pop("bias", False) else None
    grads = [torch.randn(N, generator=gen).to(dtype) for _ in range(2)]
    return hidden, weight, bias, target, grads, kw


def _leaf(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone().requires_grad_()


def _backward(outs, grads):
    """Upstream gradients into (logp, entropy); a third output (Σπ²) has no gradient."""
    assert len(outs) < 3 or not outs[2].requires_grad
    pairs = [
        (o, g) for o, g in zip(outs[:2], grads, strict=True) if o is not None and o.requires_grad
    ]
    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


@contextlib.contextmanager
def _tp_check(value: str):
    """``RLOPS_TP_CHECK=value`` inside the block (in this process)."""
    old = os.environ.get("RLOPS_TP_CHECK")
    os.environ["RLOPS_TP_CHECK"] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ["RLOPS_TP_CHECK"]
        else:
            os.environ["RLOPS_TP_CHECK"] = old


def _columns(r: int, sizes: tuple[int, ...]) -> slice:
    return slice(sum(sizes[:r]), sum(sizes[: r + 1]))


def _run_case(name: str, group, cols: slice) -> dict:
    if name in LINEAR_CASES:
        hidden, weight, bias, target, grads, kw = _linear_case(name, *LINEAR_CASES[name])
        if "keep_mask" in kw:
            kw["keep_mask"] = kw["keep_mask"][:, cols]
        h = hidden.clone().requires_grad_()
        w = weight[cols].clone().requires_grad_()
        b = _leaf(None if bias is None else bias[cols])
        with count_collectives() as fwd:
            outs = linear_logprobs_and_entropy(h, w, target, bias=b, group=group, **kw)
        with count_collectives() as bwd:
            _backward(outs, grads)
        # Through the column-parallel input op, every rank gets the full hidden gradient.
        h_full = hidden.clone().requires_grad_()
        outs_full = linear_logprobs_and_entropy(
            copy_to_tensor_parallel_region(h_full, group), weight[cols], target,
            bias=None if bias is None else bias[cols], group=group, **kw,
        )  # fmt: skip
        with count_collectives() as bwd_layer:
            _backward(outs_full, grads)
        return {
            "outs": outs,
            "grads": [h.grad, w.grad, None if b is None else b.grad],
            "fwd": dict(fwd),
            "bwd": dict(bwd),
            "bwd_layer": dict(bwd_layer),
            "h_full": h_full.grad,
        }
    logits, target, grads, kw = _case(name, *CASES[name])
    if "keep_mask" in kw:
        kw["keep_mask"] = kw["keep_mask"][:, cols]
    x = logits[:, cols].clone().requires_grad_()
    with count_collectives() as fwd:
        outs = logprobs_and_entropy(x, target, group=group, **kw)
    with count_collectives() as bwd:
        _backward(outs, grads)
    return {"outs": outs, "grads": [x.grad], "fwd": dict(fwd), "bwd": dict(bwd)}


def _mismatches(r: int) -> dict:
    """name -> a call in which group rank 1 (only) differs from the others."""
    odd = r == 1
    logits, target, _, _ = _case("plain", torch.float64, {})
    hidden, weight, _, _, _, _ = _linear_case("linear", torch.float64, {})
    x, w = logits[:, :13], weight[:13]  # any shard will do: the check runs first
    keep = torch.ones_like(x, dtype=torch.bool)
    other_target = target.clone()
    other_target[5] = (target[5] + 1) % V

    def fused(x=x, t=target, **kw):
        return lambda group: logprobs_and_entropy(x, t, group=group, **kw)

    def linear(h=hidden, w=w, t=target, b=None, **kw):
        return lambda group: linear_logprobs_and_entropy(h, w, t, bias=b, group=group, **kw)

    return {
        "tokens": fused(x=x[:-1] if odd else x, t=target[:-1] if odd else target),
        "with_entropy": fused(with_entropy=not odd),
        "entropy_grad": fused(entropy_grad=not odd),
        "keep_mask given": fused(keep_mask=keep if odd else None),
        "temperature": fused(temperature=1.5 if odd else 1.0),
        "dtype": fused(x=x.float() if odd else x),
        "target ids": fused(t=other_target if odd else target),
        "operation": linear() if odd else fused(),
        "hidden size": linear(
            h=torch.randn(N, H + odd, dtype=torch.float64),
            w=torch.randn(13, H + odd, dtype=torch.float64),
        ),
        "linear with_entropy": linear(with_entropy=not odd),
        "with_sum_pi_squared": fused(with_sum_pi_squared=odd),
        "bias given": linear(b=torch.zeros(13, dtype=torch.float64) if odd else None),
        "bad keep_mask": fused(keep_mask=keep[:, :-1] if odd else keep),
        "bad temperature": fused(temperature="1" if odd else 1.0),
        "bad hidden": linear(h=hidden.long() if odd else hidden),
    }


def _raised(fn) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as exc:  # the test compares the type and message on every rank
        return type(exc).__name__, str(exc)
    return None


def _double_backward(group, cols: slice) -> tuple[str, str] | None:
    logits, target, _, _ = _case("plain", torch.float64, {})
    x = logits[:, cols].clone().requires_grad_()
    logp, ent = logprobs_and_entropy(x, target, group=group)
    return _raised(lambda: torch.autograd.grad((logp + ent).sum(), x, create_graph=True))


def _attempt(fn):
    """``fn()``, or the traceback if it raised (on every rank alike, the group stays in step):
    one failing part then fails its own test, not the whole spawn."""
    try:
        return fn()
    except Exception:  # reported by the test that reads this part
        return {"failed": traceback.format_exc()}


def _run_tp(group, r: int, tp: int) -> dict:
    equal = (V // tp,) * tp

    def run(names, sizes):
        return {name: _run_case(name, group, _columns(r, sizes)) for name in names}

    with _tp_check("1"):
        res = {
            "checked": _attempt(lambda: run((*CASES, *LINEAR_CASES), equal)),
            "unequal": _attempt(lambda: run(UNEQUAL_CASES, UNEQUAL[tp])),
            "mismatch": {
                name: _raised(lambda fn=fn: fn(group)) for name, fn in _mismatches(r).items()
            },
            "double backward": _double_backward(group, _columns(r, equal)),
            "after": _attempt(lambda: run(("plain",), equal)),
        }  # still in step
    with _tp_check("0"):
        res["unchecked"] = _attempt(lambda: run(UNCHECKED_CASES, equal))
    return res


def _worker(rank: int, world_size: int) -> dict:
    out = {}
    for tp in TPS:
        if tp == world_size:
            group = dist.group.WORLD
        else:  # several tensor-parallel groups side by side: every rank creates every group
            groups = [dist.new_group(list(range(s, s + tp))) for s in range(0, world_size, tp)]
            group = groups[rank // tp]
        out[tp] = _run_tp(group, dist.get_rank(group), tp)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_worker, 4, timeout=180)


@pytest.fixture(scope="module")
def expected() -> dict:
    """Single-process results on the full vocabulary."""
    exp = {}
    for name, (dtype, kw) in CASES.items():
        logits, target, grads, kw = _case(name, dtype, kw)
        x = logits.clone().requires_grad_()
        outs = logprobs_and_entropy(x, target, **kw)
        _backward(outs, grads)
        exp[name] = {"outs": outs, "grads": [x.grad]}
    for name, (dtype, kw) in LINEAR_CASES.items():
        hidden, weight, bias, target, grads, kw = _linear_case(name, dtype, kw)
        h, w, b = hidden.clone().requires_grad_(), weight.clone().requires_grad_(), _leaf(bias)
        outs = linear_logprobs_and_entropy(h, w, target, bias=b, **kw)
        _backward(outs, grads)
        exp[name] = {"outs": outs, "grads": [h.grad, w.grad, None if b is None else b.grad]}
    return exp


def _close(a, b, msg):
    if a is None or b is None:
        assert a is None and b is None, msg
        return
    torch.testing.assert_close(
        a.detach(),
        b.detach(),
        msg=msg,
        **({"rtol": 1e-12, "atol": 1e-12} if a.dtype == torch.float64 else {}),
    )


def _check_values(
    results: list[dict], tp: int, part: str, sizes: tuple[int, ...], expected: dict, n_forward: int
) -> None:
    for rank, per_tp in enumerate(results):
        res, r = per_tp[tp][part], rank % tp
        assert "failed" not in res, f"{part} tp={tp} rank={rank}:\n{res.get('failed')}"
        cols = _columns(r, sizes)
        for name, got in res.items():
            where = f"{part} tp={tp} rank={rank} {name}"
            assert sum(got["fwd"].values()) == n_forward, (where, got["fwd"])
            assert all("gather" in k for k in got["fwd"]), (where, got["fwd"])
            assert got["bwd"] == {}, (where, got["bwd"])
            for k, (a, b) in enumerate(zip(got["outs"], expected[name]["outs"], strict=True)):
                _close(a, b, f"{where} output {k}")
            if name in LINEAR_CASES:
                _close(got["grads"][1], expected[name]["grads"][1][cols], f"{where} grad weight")
                bias_grad = expected[name]["grads"][2]
                _close(got["grads"][2], None if bias_grad is None else bias_grad[cols],
                       f"{where} grad bias")  # fmt: skip
                group_ranks = range(rank - r, rank - r + tp)
                summed = sum(results[q][tp][part][name]["grads"][0] for q in group_ranks)
                _close(summed, expected[name]["grads"][0], f"{where} sum of partial grad hidden")
                _close(got["h_full"], expected[name]["grads"][0], f"{where} reduced grad hidden")
                assert got["bwd_layer"] == {"all_reduce": 1}, (where, got["bwd_layer"])
            else:
                _close(got["grads"][0], expected[name]["grads"][0][:, cols], f"{where} grad")


@pytest.mark.parametrize("tp", TPS)
def test_matches_single_process_with_two_forward_collectives(results, expected, tp):
    """Check on: one gather of the headers, one of the statistics; none in the backward."""
    _check_values(results, tp, "checked", (V // tp,) * tp, expected, n_forward=2)


@pytest.mark.parametrize("tp", TPS)
def test_check_off_leaves_exactly_one_collective(results, expected, tp):
    _check_values(results, tp, "unchecked", (V // tp,) * tp, expected, n_forward=1)


@pytest.mark.parametrize("tp", TPS)
def test_shards_of_unequal_size(results, expected, tp):
    """Rank r holds the ids after the shards of ranks < r, whatever their sizes."""
    _check_values(results, tp, "unequal", UNEQUAL[tp], expected, n_forward=2)


def _expected_mismatch(name: str, tp: int, r: int) -> tuple[str, str]:
    """(exception type, a regex of its message) on group rank ``r`` for :func:`_mismatches`."""

    def per_rank(usual, odd):
        return re.escape(str([odd if q == 1 else usual for q in range(tp)]))

    if name.startswith("bad "):
        arg = name[4:]
        if r == 1:
            return (
                "TypeError" if arg in ("temperature", "hidden") else "ValueError",
                f"^{arg} must ",
            )
        return "ValueError", (
            r"^the ranks of a process group disagree on `argument rejected "
            rf"by the rank's own checks`: {per_rank(None, arg)}"
        )
    field, values = {
        "tokens": ("tokens", per_rank(N, N - 1)),
        "with_entropy": ("with_entropy", per_rank(True, False)),
        "entropy_grad": ("entropy_grad", per_rank(True, False)),
        "keep_mask given": ("keep_mask given", per_rank(False, True)),
        "temperature": ("temperature", per_rank(1.0, 1.5)),
        "dtype": ("dtype", per_rank(torch.float64, torch.float32)),
        "target ids": (r"target ids \(position-weighted checksum\)", r"\["),
        "operation": ("function", per_rank("logprobs_and_entropy", "linear_logprobs_and_entropy")),
        "hidden size": ("hidden size", per_rank(H, H + 1)),
        "linear with_entropy": ("with_entropy", per_rank(True, False)),
        "with_sum_pi_squared": ("with_sum_pi_squared", per_rank(False, True)),
        "bias given": ("bias given", per_rank(False, True)),
    }[name]
    return "ValueError", f"^the ranks of a process group disagree on `{field}`: {values}"


@pytest.mark.parametrize("tp", TPS)
def test_mismatched_calls_raise_value_error_on_every_rank(results, tp):
    for rank, per_tp in enumerate(results):
        r = rank % tp
        for name, got in per_tp[tp]["mismatch"].items():
            kind, pattern = _expected_mismatch(name, tp, r)
            assert got is not None, f"tp={tp} rank={rank} {name}: nothing raised"
            assert got[0] == kind and re.search(pattern, got[1]), (tp, rank, name, got, pattern)
        after = per_tp[tp]["after"]
        assert "failed" not in after, after.get("failed")
        assert sum(after["plain"]["fwd"].values()) == 2  # the group is still in step


@pytest.mark.parametrize("tp", TPS)
def test_double_backward_raises_with_a_group(results, tp):
    for rank, per_tp in enumerate(results):
        kind, msg = per_tp[tp]["double backward"]
        assert kind == "RuntimeError" and "double backward" in msg, (tp, rank, msg)
        assert "not supported with a tensor-parallel group" in msg


def _check_calls_single(group):
    x = torch.randn(5, 8, requires_grad=True)
    with count_collectives() as calls:
        lp, ent = logprobs_and_entropy(x, torch.arange(5), group=group)
        (lp.sum() + ent.sum()).backward()
    return dict(calls)


def test_no_collective_without_group():
    assert _check_calls_single(None) == {}
