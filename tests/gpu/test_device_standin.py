"""Every public function on a device stand-in: no host read, no host-to-device copy, no
data-dependent shape, no mixed devices on the hot path (DESIGN §14; docs/gpu.md, "Host round
trips").

The stand-in (:mod:`tests.gpu._standin`) holds real values on the host but is, for torch and
rlops, a device other than the CPU, so the code takes its accelerator path; a recorder sees
every aten operation of the call and of its backward. Each case runs four ways: with the Triton
backend routed as on CUDA (the kernels' launches recorded, not run) or set aside the way a
build failure does, and with ``RLOPS_CHECK_VALUES=1`` or without. Without the value checks no
event may happen but the exemptions of :data:`ALLOWED`; with them, host reads are allowed (the
checks read values, by design) and nothing else: no copy of host data to the device, no mixed
devices, no data-dependent shape, the same kernel launches, and bitwise the same outputs as
without: the checks do not change the hot path.

The cases: ``tests/api/test_devices._meta_cases`` for ``rlops.__all__``, the log-prob options
(row mask, sampler scalars and per-token tensors, CSR support sets, Σπ²), every name of
``rlops.compat.slime.__all__``, and TRL's ``grpo_loss`` (every loss type) and
``grpo_advantages``; the context-parallel paths of the slime adapter with a two-rank group
stood in for (:func:`_cp_probe_cases`). The recorder itself is tested on a corpus of known
round trips and known-good code, and the stand-in's values against the CPU's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable, Iterator
from unittest import mock

import pytest
import torch
from tests.api.test_devices import _meta_cases
from tests.gpu import _standin
from tests.gpu._standin import DEVICE, Event, Recorder, StandIn

import rlops
from rlops.compat import slime, trl

F32, BF16 = torch.float32, torch.bfloat16
B, T, V, H = 4, 24, 37, 16

# --------------------------------------------------------------------------- exemptions
#: (case, kind, where) -> why it is allowed: the round trip is the function's contract, not a
#: cost of its hot path. ``case`` is a key of :data:`_INDEX`; ``where`` the innermost
#: src/rlops frame (``file:function``). Host reads under ``RLOPS_CHECK_VALUES=1`` need no entry.
ALLOWED: dict[tuple[str, str, str], str] = {
    (
        "slime.get_log_probs_and_entropy top-p sets",
        "H2D copy",
        "rlops/compat/slime/_logprobs.py:_keep_sets",
    ): "slime's top-p sets come from the rollout as host data (lists per sample): the call's "
    "CSR is built on the host and copied to the device, the ids once and the offsets once",
}


def _allowed(case: str, event: Event) -> bool:
    return (case, event.kind, event.where) in ALLOWED


# --------------------------------------------------------------------------- cases
def _logprob_option_cases(dev: str) -> dict[str, list[Callable]]:
    """The log-prob ops with each option whose hot path differs: row mask, sampler (scalars and
    per-token tensors), CSR support sets, keep mask, Σπ², the entropy over the support."""
    g = torch.Generator().manual_seed(7)
    n = B * 6

    def t(*shape, dtype=F32, grad=False):
        return torch.randn(*shape, generator=g).to(dtype).to(dev).requires_grad_(grad)

    def ids(*shape):
        return torch.randint(0, V, shape, generator=g).to(dev)

    def rows():
        m = torch.rand(n, generator=g) > 0.4
        m[0] = True
        return m.to(dev)

    def csr():
        counts = torch.randint(0, 6, (n,), generator=g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
        return {"support_ids": ids(int(offsets[-1])), "support_offsets": offsets.to(dev)}

    lp, lin = rlops.logprobs_and_entropy, rlops.linear_logprobs_and_entropy
    return {
        "logprobs_and_entropy options": [
            lambda: lp(t(n, V, grad=True), ids(n), mask=rows()),
            lambda: lp(t(n, V, grad=True), ids(n), top_k=5, top_p=0.9, temperature=0.7),
            lambda: lp(t(n, V, grad=True), ids(n), top_p=0.8, min_p=0.05, mask=rows()),
            lambda: lp(
                t(n, V, grad=True),
                ids(n),
                top_k=torch.randint(1, V, (n,), generator=g).to(dev),
                top_p=(torch.rand(n, generator=g) * 0.5 + 0.5).to(dev),
                entropy_over_support=True,
            ),
            lambda: lp(t(n, V, grad=True), ids(n), **csr()),
            lambda: lp(t(n, V, grad=True), ids(n), mask=rows(), **csr()),
            lambda: lp(
                t(n, V, dtype=BF16, grad=True),
                ids(n),
                with_sum_pi_squared=True,
                keep_mask=(torch.rand(n, V, generator=g) > 0.2).to(dev),
                chunk_size=5,
            ),
            lambda: lp(t(n, V, grad=True), ids(n), logit_scale=0.5, final_logit_softcapping=30.0),
        ],
        "linear_logprobs_and_entropy options": [
            lambda: lin(t(n, H, grad=True), t(V, H, grad=True), ids(n), mask=rows(), chunk_size=7),
            lambda: lin(
                t(n, H, grad=True), t(V, H, grad=True), ids(n), bias=t(V, grad=True), top_k=4
            ),
            lambda: lin(t(n, H, grad=True), t(V, H, grad=True), ids(n), mask=rows(), **csr()),
        ],
    }


def _slime_args() -> argparse.Namespace:
    return argparse.Namespace(
        rollout_temperature=1.0,
        log_probs_chunk_size=-1,
        entropy_coef=0.0,
        tis_clip=2.0,
        tis_clip_low=0.5,
        opsm_delta=1e-4,
        value_clip=0.5,
    )


def _slime_cases(dev: str) -> dict[str, list[Callable]]:
    """Every name of ``rlops.compat.slime.__all__`` on per-sample lists as slime passes them."""
    g = torch.Generator().manual_seed(8)
    totals, resps = [30, 24, 18, 12], [20, 16, 10, 6]

    def t(*shape, grad=False):
        return torch.randn(*shape, generator=g).to(dev).requires_grad_(grad)

    def lp(*shape, grad=False):
        return (-torch.rand(*shape, generator=g)).to(dev).requires_grad_(grad)

    def ones(*shape, dtype=F32):
        return torch.ones(*shape, dtype=dtype).to(dev)

    def ids(*shape):
        return torch.randint(0, V, shape, generator=g).to(dev)

    def pieces(fn=t, lengths=resps):
        return [fn(k) for k in lengths]

    def top_p_sets():  # the rollout's sets: host data, per sample
        sets, offsets = [], []
        for r in resps:
            counts = torch.randint(1, 5, (r,), generator=g)
            off = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
            sets.append(torch.randint(0, V, (int(off[-1]),), generator=g))
            offsets.append(off.tolist())
        return sets, offsets

    def log_probs(**kw):
        return slime.get_log_probs_and_entropy(
            t(1, sum(totals), V, grad=True),
            args=_slime_args(),
            total_lengths=totals,
            unconcat_tokens=[ids(k) for k in totals],
            response_lengths=resps,
            **kw,
        )

    n = sum(resps)
    args = _slime_args()
    return {
        "slime.add_outcome_rewards": [
            lambda: slime.add_outcome_rewards(pieces(), t(B), totals, resps),
            lambda: slime.add_outcome_rewards(pieces(), [1.0, 0.0, -1.0, 0.5], totals, resps),
        ],
        "slime.all_gather_with_cp": [lambda: slime.all_gather_with_cp(t(20, grad=True), 30, 20)],
        "slime.calculate_log_probs_and_entropy": [
            lambda: slime.calculate_log_probs_and_entropy(
                t(40, V, grad=True), ids(40), None, with_entropy=True
            ),
            lambda: slime.calculate_log_probs_and_entropy(
                t(40, V, grad=True),
                ids(40),
                None,
                with_entropy=True,
                mask=ones(40, dtype=torch.bool),
                log_prob_keep_ids=ids(80),
                log_prob_keep_offsets=(torch.arange(41) * 2).to(dev),
            ),
        ],
        "slime.chunked_discounted_returns": [
            lambda: slime.chunked_discounted_returns(t(B, T, grad=True), 0.99, chunk_size=8)
        ],
        "slime.chunked_gae": [
            lambda: slime.chunked_gae(t(B, T, grad=True), t(B, T), 0.99, 0.95, chunk_size=8)
        ],
        "slime.compute_approx_kl": [
            lambda kind=kind: slime.compute_approx_kl(lp(n, grad=True), lp(n), kind, t(n).exp())
            for kind in ("k1", "k2", "k3", "low_var_kl")
        ],
        "slime.compute_cispo_loss": [
            lambda: slime.compute_cispo_loss(t(n) * 0.1, lp(n, grad=True), t(n), 0.2, 0.28)
        ],
        "slime.compute_opsm_mask": [
            lambda: slime.compute_opsm_mask(
                args, pieces(lp), pieces(lp), pieces(), [ones(k) for k in resps]
            )
        ],
        "slime.compute_policy_loss": [
            lambda: slime.compute_policy_loss(t(n, grad=True) * 0.1, t(n), 0.2, 0.28, 3.0)
        ],
        "slime.distributed_masked_whiten": [
            lambda: slime.distributed_masked_whiten(t(n, grad=True), ones(n))
        ],
        "slime.get_advantages_and_returns_batch": [
            lambda: slime.get_advantages_and_returns_batch(
                totals, resps, pieces(), pieces(), 0.99, 0.95
            )
        ],
        "slime.get_grpo_returns": [lambda: slime.get_grpo_returns(t(B), pieces())],
        "slime.get_log_probs_and_entropy": [
            lambda: log_probs(with_entropy=True),
            lambda: log_probs(loss_masks=[ones(k) for k in resps]),
        ],
        "slime.get_log_probs_and_entropy top-p sets": [
            lambda: log_probs(**dict(zip(("top_p_token_ids", "top_p_token_offsets"), top_p_sets())))
        ],
        "slime.get_reinforce_plus_plus_baseline_advantages": [
            lambda: slime.get_reinforce_plus_plus_baseline_advantages(
                t(B), pieces(), [ones(k) for k in resps], 0.1
            )
        ],
        "slime.get_reinforce_plus_plus_returns": [
            lambda: slime.get_reinforce_plus_plus_returns(
                t(B),
                pieces(),
                [ones(k, dtype=torch.int64) for k in resps],
                resps,
                totals,
                kl_coef=0.1,
                gamma=1.0,
            )
        ],
        "slime.icepop_function": [
            lambda: slime.icepop_function(
                args,
                pg_loss=t(n, grad=True),
                train_log_probs=pieces(lp),
                rollout_log_probs=pieces(lp),
                loss_masks=None,
            )
        ],
        "slime.slice_log_prob_with_cp": [
            lambda: slime.slice_log_prob_with_cp(t(20, grad=True), 30, 20),
            lambda: slime.slice_log_prob_with_cp([0.5] * 20, 30, 20),
        ],
        "slime.value_loss_function": [
            lambda: slime.value_loss_function(
                args,
                {
                    "values": pieces(),
                    "returns": pieces(),
                    "total_lengths": totals,
                    "response_lengths": resps,
                },
                t(1, sum(totals), 1, grad=True),
                lambda x: x.mean(),
            )
        ],
        "slime.vanilla_gae": [lambda: slime.vanilla_gae(t(B, T), t(B, T), 0.99, 0.95)],
        "slime.vanilla_tis_function": [
            lambda: slime.vanilla_tis_function(
                args,
                pg_loss=t(n, grad=True),
                train_log_probs=pieces(lp),
                rollout_log_probs=pieces(lp),
                loss_masks=[ones(k) for k in resps],
            )
        ],
        "slime.zigzag_response_mask": [
            lambda: slime.zigzag_response_mask(30, 20, cp_size=2, cp_rank=1, device=dev)
        ],
        "slime.zigzag_shard_response": [
            lambda: slime.zigzag_shard_response(
                t(2, 20, grad=True), total_length=30, response_length=20, cp_size=2, cp_rank=1
            )
        ],
        "slime.zigzag_unshard_response": [
            lambda: slime.zigzag_unshard_response(
                t(2, 32, grad=True), group=None, total_length=30, response_length=20
            )
        ],
    }


class _TwoRanks:
    """A context-parallel group of two ranks stood in for: this process is ``rank``; the
    all-reduce of the adapters returns its input (what a rank does with its own part is what
    is recorded)."""

    def __init__(self, rank: int):
        self.rank = rank


@contextlib.contextmanager
def _two_ranks() -> Iterator[None]:
    from rlops.compat.slime import _advantages, _cp

    def rank_size(group, name="group"):
        return (group.rank, 2) if isinstance(group, _TwoRanks) else (0, 1)

    with contextlib.ExitStack() as stack:
        for module in (_cp, _advantages):
            stack.enter_context(mock.patch.object(module, "group_rank_size", rank_size))
        reduce = staticmethod(lambda x, group: x)
        stack.enter_context(mock.patch.object(_cp._AllReduceSum, "apply", reduce))
        yield


def _cp_probe_cases(dev: str) -> dict[str, list[Callable]]:
    """The slime adapter's context-parallel paths, on rank 1 of a stood-in group of two
    (:func:`_two_ranks`): the layout is computed on the host, the tensors stay on the device."""
    from rlops.compat.slime import _cp

    g = torch.Generator().manual_seed(9)
    totals, resps = [30, 24, 18, 13], [20, 16, 10, 12]
    group = _TwoRanks(1)
    held = [_cp.held_response_index(t_, r, 2, 1)[0].numel() for t_, r in zip(totals, resps)]

    def t(*shape, grad=False):
        return torch.randn(*shape, generator=g).to(dev).requires_grad_(grad)

    def per_sample(lengths):
        return [t(k) for k in lengths]

    def values(allgather: bool):
        width = sum(totals) // 2 if allgather else sum(2 * -(-x // 4) for x in totals)
        return slime.value_loss_function(
            _slime_args(),
            {
                "values": per_sample(held),
                "returns": per_sample(held),
                "total_lengths": totals,
                "response_lengths": resps,
            },
            t(1, width, 1, grad=True),
            lambda x: x.mean(),
            cp_group=group,
        )

    def cp_args(allgather: bool):
        a = _slime_args()
        a.allgather_cp = allgather
        return a

    return {
        "CP slime.all_gather_with_cp": [
            lambda: slime.all_gather_with_cp(t(held[0], grad=True), 30, 20, cp_group=group)
        ],
        "CP slime.slice_log_prob_with_cp": [
            lambda: slime.slice_log_prob_with_cp(t(20, grad=True), 30, 20, cp_group=group),
            lambda: slime.slice_log_prob_with_cp(
                t(20, grad=True), 30, 20, "bshd", 40, cp_group=group
            ),
        ],
        "CP slime.add_outcome_rewards": [
            lambda: slime.add_outcome_rewards(per_sample(held), t(B), totals, resps, cp_group=group)
        ],
        "CP slime.value_loss_function": [
            lambda: values(False),
            lambda: slime.value_loss_function(
                cp_args(True),
                {
                    "values": per_sample(held),
                    "returns": per_sample(held),
                    "total_lengths": totals,
                    "response_lengths": resps,
                },
                t(1, sum(totals) // 2, 1, grad=True),
                lambda x: x.mean(),
                cp_group=group,
            ),
        ],
    }


def _trl_cases(dev: str) -> dict[str, list[Callable]]:
    """TRL's ``grpo_loss`` for every loss type (with the KL, the entropy bonus and the
    top-entropy mask) and ``grpo_advantages``."""
    g = torch.Generator().manual_seed(10)

    def t(*shape, grad=False):
        return torch.randn(*shape, generator=g).to(dev).requires_grad_(grad)

    def lp(*shape, grad=False):
        return (-torch.rand(*shape, generator=g)).to(dev).requires_grad_(grad)

    def mask():
        m = torch.rand(B, T, generator=g) > 0.2
        m[-1] = False  # a row without a completion token
        return m.long().to(dev)

    def loss(loss_type, **kw):
        return trl.grpo_loss(
            lp(B, T, grad=True),
            lp(B, T),
            t(B),
            mask(),
            loss_type=loss_type,
            max_completion_length=T,
            **kw,
        )

    return {
        "trl.grpo_loss": [
            lambda lt=lt: loss(lt, beta=0.04, ref_per_token_logps=lp(B, T)) for lt in trl.LOSS_TYPES
        ]
        + [
            lambda: loss(
                "dapo", num_items_in_batch=t(()).abs() + 10, importance_sampling_level="sequence"
            ),
            lambda: loss(
                "grpo",
                entropies=t(B, T, grad=True).abs(),
                top_entropy_quantile=0.5,
                entropy_coef=0.01,
                delta=2.0,
            ),
        ],
        "trl.grpo_advantages": [
            lambda: trl.grpo_advantages(t(8, 2), 4),
            lambda: trl.grpo_advantages(
                t(8, 2), 4, reward_weights=[1.0, 0.5], scale_rewards="batch"
            ),
            lambda: trl.grpo_advantages(
                t(8, 2),
                2,
                reward_weights=torch.tensor([1.0, 0.5]).to(dev),
                multi_objective_aggregation="normalize_then_sum",
            ),
        ],
    }


def _rlops_cases(dev: str) -> dict[str, list[Callable]]:
    return {f"rlops.{k}": v for k, v in _meta_cases(dev).items()}


_FAMILIES = (_rlops_cases, _logprob_option_cases, _slime_cases, _cp_probe_cases, _trl_cases)
#: case name -> (the function making its family's cases, its number of calls)
_INDEX = {
    name: (family, len(calls)) for family in _FAMILIES for name, calls in family("cpu").items()
}
_NAMES = sorted(_INDEX)


def test_cases_cover_every_export():
    names = set(_NAMES)
    assert {f"rlops.{n}" for n in rlops.__all__} <= names
    assert {f"slime.{n}" for n in slime.__all__} <= names
    assert {"trl.grpo_loss", "trl.grpo_advantages"} <= names


# --------------------------------------------------------------------------- running
def _run(name: str, k: int, *, triton: bool, checks: bool) -> _standin.Result:
    with Recorder():  # inputs made inside a recorder are stand-ins (construction: no events)
        call = _INDEX[name][0](DEVICE.type)[name][k]
    context = _two_ranks() if name.startswith("CP ") else contextlib.nullcontext()
    with context:
        return _standin.run(call, triton=triton, checks=checks)


def test_triton_routing_reaches_the_kernels():
    """With Triton routed, the stand-in takes the kernels' path (else the ``triton`` runs below
    would check the chunked path twice): the log-prob, the scan and the estimators launch."""
    pytest.importorskip("triton")
    for name, k in (("rlops.logprobs_and_entropy", 0), ("rlops.discounted_cumsum", 0)):
        launched = {x.kernel for x in _run(name, k, triton=True, checks=False).launches}
        assert launched, f"{name} #{k}: no kernel launched"
    assert _run("rlops.gae", 1, triton=True, checks=False).launches, "rlops.gae #1"
    assert not _run("rlops.gae", 1, triton=False, checks=False).launches


def _elems(outs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [o.elem if isinstance(o, StandIn) else o for o in outs]


@pytest.mark.parametrize("triton", [False, True], ids=["triton-aside", "triton"])
@pytest.mark.parametrize("name", _NAMES)
def test_no_host_round_trip(name, triton):
    if triton:
        pytest.importorskip("triton")
    for k in range(_INDEX[name][1]):
        plain = _run(name, k, triton=triton, checks=False)
        where = f"{name} #{k}"
        bad = [str(e) for e in plain.events if not _allowed(name, e)]
        assert not bad, f"{where}, round trips on the hot path:\n" + "\n".join(bad)
        assert all(isinstance(o, StandIn) for o in plain.outputs), f"{where}: a host output"
        problems = [f"{x.kernel}: {p}" for x in plain.launches for p in x.problems()]
        assert not problems, f"{where}: " + "; ".join(problems)

        checked = _run(name, k, triton=triton, checks=True)
        bad = [
            str(e)
            for e in checked.events
            if e.kind != "host read" and not _allowed(name, e) and e not in plain.events
        ]
        assert not bad, f"{where} with RLOPS_CHECK_VALUES=1:\n" + "\n".join(bad)
        assert checked.launches == plain.launches, f"{where}: the checks changed the kernels"
        got, want = _elems(checked.outputs), _elems(plain.outputs)
        assert len(got) == len(want), where
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape, where
            if not triton:  # (launches stubbed: the kernels' outputs hold no values)
                assert _same(a, b), f"{where}: the checks changed an output"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN where NaN."""
    if not a.is_floating_point():
        return torch.equal(a, b)
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


# --------------------------------------------------------------------------- the checker
_HERE = os.path.dirname(os.path.abspath(__file__))

#: snippet -> the kinds of event it must give (none for the ones a GPU runs without a round
#: trip); ``x`` ``[6]`` float, ``m`` ``[6]`` bool, ``n`` ``[3]`` int64 counts, on the device
_CORPUS: dict[str, tuple[Callable, tuple[str, ...]]] = {
    "item": (lambda x, m, n: x.sum().item(), ("host read",)),
    "bool": (lambda x, m, n: bool((x > 0).any()), ("host read",)),
    "int": (lambda x, m, n: int(x.argmax()), ("host read",)),
    "tolist": (lambda x, m, n: n.tolist(), ("host read",)),
    "cpu": (lambda x, m, n: x.cpu(), ("host read",)),
    "equal": (lambda x, m, n: torch.equal(x, x), ("host read",)),
    "as_tensor of a list": (
        lambda x, m, n: torch.as_tensor([1, 2], device=x.device),
        ("H2D copy",),
    ),
    "tensor of a number": (lambda x, m, n: torch.tensor(0.5, device=x.device), ("H2D copy",)),
    "new_tensor": (lambda x, m, n: x.new_tensor([1.0, 2.0]), ("H2D copy",)),
    "to device": (lambda x, m, n: torch.ones(3).to(x.device), ("H2D copy",)),
    "copy_ from host": (lambda x, m, n: x.clone().copy_(torch.ones(6)), ("H2D copy",)),
    "host operand": (lambda x, m, n: x + torch.ones(6), ("device mismatch",)),
    "host index": (lambda x, m, n: x[torch.tensor([0, 1])], ("device mismatch",)),
    "boolean index": (lambda x, m, n: x[m], ("dynamic shape",)),
    "boolean index_put": (lambda x, m, n: x.clone().__setitem__(m, 0.0), ("dynamic shape",)),
    "nonzero": (lambda x, m, n: m.nonzero(), ("dynamic shape",)),
    "masked_select": (lambda x, m, n: x.masked_select(m), ("dynamic shape",)),
    "unique": (lambda x, m, n: n.unique(), ("dynamic shape",)),
    "repeat_interleave": (lambda x, m, n: torch.repeat_interleave(x[:3], n), ("dynamic shape",)),
    # what a GPU runs without waiting for the host
    "0-dim host operand": (lambda x, m, n: x * torch.tensor(2.0), ()),
    "Python numbers": (lambda x, m, n: torch.where(x > 0, x, 0.5) * 3, ()),
    "factory on the device": (lambda x, m, n: torch.arange(6, device=x.device) + x, ()),
    "repeat_interleave sized": (
        lambda x, m, n: torch.repeat_interleave(x[:3], n, output_size=6),
        (),
    ),
    "masked_fill": (lambda x, m, n: x.masked_fill(m, 0.0), ()),
    "slices and views": (lambda x, m, n: x[1:4].view(3, 1).expand(3, 2).sum(0), ()),
    "device index": (lambda x, m, n: x.index_select(0, torch.arange(2, device=x.device)), ()),
    "backward": (lambda x, m, n: (x.detach().requires_grad_() * 2).sum().backward(), ()),
}


@pytest.mark.parametrize("snippet", sorted(_CORPUS))
def test_the_recorder_reports_each_round_trip_and_nothing_else(snippet):
    """The checker on known-bad and known-good code: no miss, no false alarm."""
    fn, want = _CORPUS[snippet]
    with Recorder():
        x = torch.randn(6).to(DEVICE)
        m = (torch.arange(6) % 2 == 0).to(DEVICE)
        n = torch.tensor([1, 2, 3]).to(DEVICE)
    recorder = Recorder(source=_HERE)  # this file's frames count
    with recorder:
        fn(x, m, n)
    assert tuple(sorted({e.kind for e in recorder.events})) == want, recorder.events


def test_the_stand_in_computes_what_the_cpu_computes():
    """Values are real: a function on the stand-in gives the CPU's result, its gradient too."""
    g = torch.Generator().manual_seed(11)
    r, v = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g, requires_grad=True)
    mask = torch.rand(B, T, generator=g) > 0.2
    with Recorder():
        sv = StandIn(v.detach().clone(), requires_grad=True)
        got = rlops.gae(StandIn(r), sv, gamma=0.99, lam=0.95, mask=StandIn(mask))
        got[0].sum().backward()
    want = rlops.gae(r, v, gamma=0.99, lam=0.95, mask=mask, method="chunked")
    want[0].sum().backward()
    for a, b in zip(got, want, strict=True):
        assert a.device == DEVICE
        assert torch.equal(a.elem, b.detach())
    assert torch.equal(sv.grad.elem, v.grad)
