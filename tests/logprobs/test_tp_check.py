"""The tensor-parallel consistency check of the log-prob ops on the sampler's per-token tensors
(2 real Gloo ranks), and the checksum it compares.

Per-token ``top_k``, ``top_p`` and ``min_p`` are compared by a checksum of their bits: ranks
holding different values (one position is enough) raise the same ``ValueError`` naming the
argument, before any collective whose size depends on them; ranks holding the same values get
bit for bit what they get with the check off, with one collective more (the check's).
``RLOPS_TP_CHECK=0`` and ``RLOPS_GROUP_CHECK=0`` each turn the check off.
"""

from __future__ import annotations

import contextlib
import os
import re

import pytest
import torch
import torch.distributed as dist
from tests._distributed import count_collectives, run_distributed

from rlops.distributed import collectives
from rlops.logprobs import _tensor_parallel as _tp
from rlops.logprobs import linear_logprobs_and_entropy, logprobs_and_entropy

N, V, H = 19, 40, 5
SIZES = (15, 25)  # unequal shards: the check gives each rank its offset


@contextlib.contextmanager
def _env(**values: str):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _data():
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(N, V, generator=gen, dtype=torch.float64) * 3
    target = torch.randint(0, V, (N,), generator=gen)
    top_k = torch.randint(1, V + 5, (N,), generator=gen)
    top_p = torch.rand(N, generator=gen, dtype=torch.float64) * 0.7 + 0.3
    min_p = torch.rand(N, generator=gen, dtype=torch.float64) * 0.2
    return logits, target, {"top_k": top_k, "top_p": top_p, "min_p": min_p}


def _nudged(t: torch.Tensor, i: int) -> torch.Tensor:
    """``t`` with one position moved to the next representable value (the next int)."""
    out = t.clone()
    out[i] = out[i] + 1 if not t.is_floating_point() else torch.nextafter(out[i], out[i] + 1)
    return out


def _cols(rank: int) -> slice:
    return slice(sum(SIZES[:rank]), sum(SIZES[: rank + 1]))


def _mismatches(rank: int) -> dict:
    """name -> keyword arguments of ``logprobs_and_entropy`` where rank 1 differs."""
    _, _, per_token = _data()
    odd = rank == 1
    out = {}
    for name, t in per_token.items():
        out[f"{name} per token"] = {name: _nudged(t, 11) if odd else t}
        out[f"{name} per token, order"] = {name: t.flip(0) if odd else t}
        out[f"{name} per token or scalar"] = {name: t if odd else t[0].item()}
    out["top_k given on one rank"] = {"top_k": per_token["top_k"]} if odd else {}
    out["top_p per token beside a matching top_k"] = {
        "top_k": per_token["top_k"],
        "top_p": _nudged(per_token["top_p"], 0) if odd else per_token["top_p"],
    }
    return out


def _raised(fn) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as exc:  # the test compares the type and message on both ranks
        return type(exc).__name__, str(exc)
    return None


def _forward(x, target, group, kw, linear_w=None):
    with count_collectives() as calls:
        if linear_w is None:
            outs = logprobs_and_entropy(x, target, group=group, **kw)
        else:
            outs = linear_logprobs_and_entropy(x, linear_w, target, group=group, **kw)
    return [o.detach() for o in outs], sum(calls.values())


def _worker(rank: int, world: int) -> dict:
    group = dist.group.WORLD
    logits, target, per_token = _data()
    cols = _cols(rank)
    x = logits[:, cols].contiguous()
    res: dict = {"mismatch": {}, "same": {}}
    for name, kw in _mismatches(rank).items():
        res["mismatch"][name] = _raised(
            lambda kw=kw: logprobs_and_entropy(x, target, group=group, **kw)
        )
    # Matching per-token calls: the check changes no bit and adds exactly one collective.
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(N, H, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64)
    calls = {
        "top_k": ({"top_k": per_token["top_k"]}, None),
        "top_p": ({"top_p": per_token["top_p"]}, None),
        "all three": (per_token, None),
        "all three, float32": (
            {k: v.float() if v.is_floating_point() else v for k, v in per_token.items()},
            None,
        ),
        "linear, top_p and min_p": (
            {"top_p": per_token["top_p"], "min_p": per_token["min_p"]},
            weight[cols],
        ),
    }
    equal = slice(rank * V // 2, (rank + 1) * V // 2)  # equal shards for the unchecked runs
    for name, (kw, w) in calls.items():
        xx = hidden if w is not None else (x.float() if "float32" in name else x)
        xe = (
            hidden
            if w is not None
            else (logits[:, equal].float() if "float32" in name else logits[:, equal])
        )
        we = None if w is None else weight[equal]
        got = {
            "checked": _forward(xx, target, group, kw, w),
            "checked, equal shards": _forward(xe, target, group, kw, we),
        }
        with _env(RLOPS_TP_CHECK="0"):
            got["RLOPS_TP_CHECK=0"] = _forward(xe, target, group, kw, we)
        with _env(RLOPS_GROUP_CHECK="0"):
            got["RLOPS_GROUP_CHECK=0"] = _forward(xe, target, group, kw, we)
        res["same"][name] = got
    # Off, a mismatch is not seen: every rank returns (the wrong answer the check prevents).
    with _env(RLOPS_TP_CHECK="0"):
        res["unchecked mismatch"] = _raised(
            lambda: logprobs_and_entropy(
                logits[:, equal], target, group=group, **_mismatches(rank)["top_p per token"]
            )
        )
    res["after"] = _forward(x, target, group, {"top_p": per_token["top_p"]})[1]
    return res


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_worker, 2, timeout=120)


@pytest.mark.distributed
def test_per_token_sampler_mismatch_raises_the_same_error_on_both_ranks(results):
    names = results[0]["mismatch"].keys()
    assert len(names) == 11
    for name in names:
        got = [res["mismatch"][name] for res in results]
        assert got[0] is not None, (name, got)
        assert got[0] == got[1], (name, got)  # the same error on both ranks
        kind, msg = got[0]
        assert kind == "ValueError", (name, msg)
        assert msg.startswith("the ranks of a process group disagree on "), (name, msg)
        arg = name.split()[0]
        if "scalar" in name or "one rank" in name:  # the scalar or None is named, not the sum
            assert re.search(rf"`{arg}`: \[[^]]*'per token'\]", msg), (name, msg)
            assert "checksum" not in msg, (name, msg)
        else:
            assert f"`{arg} (per-token checksum)`: [" in msg, (name, msg)


@pytest.mark.distributed
def test_matching_per_token_calls_change_no_bit_and_count_collectives(results):
    for rank, res in enumerate(results):
        for name, got in res["same"].items():
            outs_c, n_c = got["checked, equal shards"]
            for off in ("RLOPS_TP_CHECK=0", "RLOPS_GROUP_CHECK=0"):
                outs_u, n_u = got[off]
                assert n_c == n_u + 1, (rank, name, off, n_c, n_u)
                for a, b in zip(outs_c, outs_u, strict=True):
                    assert torch.equal(a, b), (rank, name, off)
            outs, n = got["checked"]  # unequal shards: the same numbers, to rounding
            assert n == n_c, (rank, name)
            for a, b in zip(outs, outs_c, strict=True):
                torch.testing.assert_close(
                    a,
                    b,
                    rtol=1e-12 if a.dtype == torch.float64 else 1e-5,
                    atol=1e-12 if a.dtype == torch.float64 else 1e-5,
                )
        assert res["unchecked mismatch"] is None
        assert res["after"] == results[0]["same"]["top_p"]["checked"][1]  # still in step


def test_checksum_is_exact_and_sees_one_position():
    gen = torch.Generator().manual_seed(0)
    for t in (
        torch.rand(1000, generator=gen, dtype=torch.float64),
        torch.rand(129, generator=gen).float(),
        torch.rand(127, generator=gen).bfloat16(),
        torch.randint(1, 10**9, (128,), generator=gen),
    ):
        c = _tp.checksum(t)
        assert c.dim() == 0 and c.dtype == torch.int64
        # the definition: Σ (2i + 1)·bits[i] modulo 2**64, in Python integers
        bits = t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])
        want = sum((2 * i + 1) * int(b) for i, b in enumerate(bits.tolist())) % 2**64
        assert int(c) % 2**64 == want
        for i in (0, 1, t.numel() - 1):
            assert _tp.checksum(_nudged(t, i)) != c, (t.dtype, i)
        assert _tp.checksum(t.flip(0)) != c  # same values, other positions
    assert _tp.checksum(torch.tensor([0.0, 0.5])) == _tp.checksum(torch.tensor([-0.0, 0.5]))
    assert _tp.checksum(torch.zeros(0)) == 0


def test_check_enabled_follows_both_variables():
    for tp, grp, on in (("1", "1", True), ("0", "1", False), ("1", "0", False)):
        with _env(RLOPS_TP_CHECK=tp, RLOPS_GROUP_CHECK=grp):
            assert _tp.check_enabled() is on
            assert collectives.check_enabled() is (grp != "0")
