"""Every public function, and the adapters' hot functions, under ``torch.compile``.

Each one is compiled with ``fullgraph=True`` (with Inductor, the default backend, for one case
per family of ops, :data:`INDUCTOR`; through AOTAutograd with the eager backend for the
others), run forward and backward, and compared with eager: both the compiled and the eager
float32 results are measured against an eager float64 run, and the compiled one must be within
the rule of ``tests/tolerances.py`` (at most twice the eager float32 error plus a few ulps).
Outputs that are not floating point (masks, counts) must be equal.

``dynamic=True``: the ``[B, T]`` functions are called at four lengths; after the first call,
three new lengths may cost at most one recompile (Dynamo's frame counters).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from tests.tolerances import assert_within_reference

import rlops
from rlops.compat import slime, verl

pytestmark = pytest.mark.slow


@functools.cache
def compile_inputs(
    b: int, t: int, v: int = 11, h: int = 6, seed: int = 0
) -> dict[str, torch.Tensor]:
    """float64 inputs; masks, dones, ids and targets as integers or booleans."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    mask = torch.rand(b, t, generator=g) > 0.25
    mask[:, 0] = True
    dones = torch.zeros(b, t, dtype=torch.bool)
    dones[0, t // 2] = True
    return {
        "r": rand(b, t),
        "v": rand(b, t),
        "kl": rand(b, t).abs(),
        "x": rand(b, t),
        "logp": -rand(b, t).abs(),
        "old": -rand(b, t).abs(),
        "adv": rand(b, t),
        "decay": torch.rand(b, t, generator=g, dtype=torch.float64),
        "score": rand(b),
        "index": torch.arange(b) // 2,
        "mask": mask,
        "dones": dones,
        "logits": rand(b, t, v) * 2,
        "target": torch.randint(0, v, (b, t), generator=g),
        "hidden": rand(b * t, h),
        "weight": rand(v, h) / 2,
        "bias": rand(v),
    }


# name -> (function of the inputs dict, names of the inputs the backward differentiates)
Case = tuple[Callable[[dict], object], tuple[str, ...]]
CASES: dict[str, Case] = {
    "aggregate_loss": (
        lambda d: rlops.aggregate_loss(d["x"], d["mask"], "seq-mean-token-mean"),
        ("x",),
    ),
    "discounted_cumsum": (lambda d: rlops.discounted_cumsum(d["x"], d["decay"]), ("x",)),
    "discounted_returns": (
        lambda d: rlops.discounted_returns(d["r"], gamma=0.99, mask=d["mask"], dones=d["dones"]),
        ("r",),
    ),
    "distillation_loss": (
        lambda d: rlops.distillation_loss(
            d["logits"],
            *torch.log_softmax(d["logits"].detach().flip(-1), -1).topk(3, -1),
            kind="jsd",
            tail=True,
            temperature=0.8,
        ),
        ("logits",),
    ),
    "linear_distillation_loss": (
        lambda d: rlops.linear_distillation_loss(
            d["hidden"],
            d["weight"],
            torch.log_softmax(d["logits"].detach().reshape(-1, d["logits"].shape[-1]), -1),
            bias=d["bias"],
            kind="reverse_kl",
        ),
        ("hidden", "weight", "bias"),
    ),
    "entropy_loss": (lambda d: rlops.entropy_loss(d["x"], d["mask"], coef=0.01), ("x",)),
    "linear_policy_loss": (
        lambda d: rlops.linear_policy_loss(
            d["hidden"].view(*d["target"].shape, -1),
            d["weight"],
            d["target"],
            d["old"],
            d["adv"],
            d["mask"],
            bias=d["bias"],
            entropy_coef=0.01,
        ),
        ("hidden", "weight", "bias"),
    ),
    "linear_policy_loss on-policy return_logprobs": (
        lambda d: rlops.linear_policy_loss(
            d["hidden"].view(*d["target"].shape, -1),
            d["weight"],
            d["target"],
            None,
            d["adv"],
            d["mask"],
            bias=d["bias"],
            entropy_coef=0.01,
            return_logprobs=True,
        ),
        ("hidden", "weight", "bias"),
    ),
    "gae": (
        lambda d: rlops.gae(d["r"], d["v"], gamma=0.99, lam=0.95, mask=d["mask"], dones=d["dones"]),
        ("r", "v"),
    ),
    "gae returns_lam lam_length_alpha": (
        lambda d: rlops.gae(
            d["r"],
            d["v"],
            gamma=0.99,
            lam=0.95,
            returns_lam=1.0,
            lam_length_alpha=0.05,
            mask=d["mask"],
        ),
        ("r", "v"),
    ),
    "gpg_advantages": (
        lambda d: rlops.gpg_advantages(d["score"], d["index"], d["mask"]),
        ("score",),
    ),
    "grpo_advantages": (
        lambda d: rlops.grpo_advantages(d["score"], d["index"], d["mask"]),
        ("score",),
    ),
    "grpo_passk_advantages": (
        lambda d: rlops.grpo_passk_advantages(d["score"], d["index"], d["mask"]),
        ("score",),
    ),
    "gigpo_advantages": (
        lambda d: rlops.gigpo_advantages(
            d["score"], d["index"], d["x"][:, 0], d["target"][:, 0] % 2, d["mask"]
        ),
        ("score", "x"),
    ),
    "maxrl_advantages": (
        lambda d: rlops.maxrl_advantages(d["score"].abs(), d["index"], d["mask"]),
        ("score",),
    ),
    "overlong_penalty": (
        lambda d: rlops.overlong_penalty(d["kl"].sum(-1) * 10, 300, 100, 0.5),
        ("kl",),
    ),
    "kl_penalty": (lambda d: rlops.kl_penalty(d["logp"], d["old"], "low_var_kl"), ("logp",)),
    "linear_logprobs_and_entropy": (
        lambda d: rlops.linear_logprobs_and_entropy(
            d["hidden"],
            d["weight"],
            d["target"].reshape(-1),
            bias=d["bias"],
            with_sum_pi_squared=True,
        ),
        ("hidden", "weight", "bias"),
    ),
    "logprobs_and_entropy": (
        lambda d: rlops.logprobs_and_entropy(d["logits"], d["target"], with_sum_pi_squared=True),
        ("logits",),
    ),
    "logprobs_and_entropy softcapped": (
        lambda d: rlops.logprobs_and_entropy(
            d["logits"], d["target"], temperature=0.8, logit_scale=1.5, final_logit_softcapping=3.0
        ),
        ("logits",),
    ),
    "linear_logprobs_and_entropy softcapped": (
        lambda d: rlops.linear_logprobs_and_entropy(
            d["hidden"],
            d["weight"],
            d["target"].reshape(-1),
            bias=d["bias"],
            logit_scale=0.5,
            final_logit_softcapping=2.0,
        ),
        ("hidden", "weight", "bias"),
    ),
    "masked_mean": (lambda d: rlops.masked_mean(d["x"], d["mask"]), ("x",)),
    "masked_var": (lambda d: rlops.masked_var(d["x"], d["mask"]), ("x",)),
    "masked_whiten": (lambda d: rlops.masked_whiten(d["x"], d["mask"]), ("x",)),
    "opo_advantages": (
        lambda d: rlops.opo_advantages(d["score"], d["index"], d["mask"]),
        ("score",),
    ),
    "policy_loss": (
        lambda d: rlops.policy_loss(d["logp"], d["old"], d["adv"], d["mask"], dual_clip=3.0),
        ("logp",),
    ),
    "reinforce_plus_plus_baseline_advantages": (
        lambda d: rlops.reinforce_plus_plus_baseline_advantages(d["score"], d["index"], d["mask"]),
        ("score",),
    ),
    "reinforce_plus_plus_returns": (
        lambda d: rlops.reinforce_plus_plus_returns(
            d["score"], d["kl"], d["mask"], kl_coef=0.1, gamma=1.0
        ),
        ("score", "kl"),
    ),
    "remax_advantages": (lambda d: rlops.remax_advantages(d["r"], d["score"], d["mask"]), ("r",)),
    "rloo_advantages": (
        lambda d: rlops.rloo_advantages(d["score"], d["index"], d["mask"]),
        ("score",),
    ),
    "rollout_importance_weights": (
        lambda d: rlops.rollout_importance_weights(
            d["old"], d["logp"], d["mask"], level="sequence", mode="mask", low=0.5
        ),
        (),
    ),
    "rollout_mismatch_metrics": (
        lambda d: rlops.rollout_mismatch_metrics(d["old"], d["logp"], d["mask"]),
        (),
    ),
    "rollout_rejection_mask": (
        lambda d: rlops.rollout_rejection_mask(
            d["old"], d["logp"], d["mask"], {"token_k1": 2.0, "seq_mean_k3": 0.5}
        ),
        (),
    ),
    "value_loss": (
        lambda d: rlops.value_loss(d["v"], d["old"], d["r"], d["mask"], clip=0.2),
        ("v",),
    ),
    "value_loss huber": (
        lambda d: rlops.value_loss(
            d["v"], d["old"], d["r"], d["mask"], clip=0.2, loss="huber", huber_delta=0.5
        ),
        ("v",),
    ),
    "policy_loss ipo": (
        lambda d: rlops.policy_loss(
            d["logp"], d["old"], d["adv"], d["mask"], kind="ipo", ipo_threshold=0.2, kl_tau=0.1
        ),
        ("logp",),
    ),
    "policy_loss topr": (
        lambda d: rlops.policy_loss(
            d["logp"], d["old"], d["adv"], d["mask"], kind="topr", negative_weight=0.5
        ),
        ("logp",),
    ),
    "behavior_importance_weights": (
        lambda d: rlops.behavior_importance_weights(
            d["old"], d["logp"], d["mask"], upper=2.0, level="sequence", agg="max"
        ),
        (),
    ),
    "gdpo_advantages": (
        lambda d: rlops.gdpo_advantages(
            torch.stack([d["score"], d["score"].square()], -1), d["index"], d["mask"]
        ),
        ("score",),
    ),
    "m2po_mask": (lambda d: rlops.m2po_mask(d["old"], d["logp"], d["mask"], threshold=0.5), ()),
    "opsm_mask": (
        lambda d: rlops.opsm_mask(d["logp"], d["old"], d["adv"], d["mask"], delta=0.1),
        (),
    ),
    "optimal_token_baseline_advantages": (
        lambda d: rlops.optimal_token_baseline_advantages(
            d["r"], d["index"], d["mask"], d["logp"], d["decay"], per_action_step=True
        ),
        ("r",),
    ),
    "top_entropy_mask": (lambda d: rlops.top_entropy_mask(d["kl"], d["mask"], rho=0.2), ()),
    # the adapters' hot functions
    "slime.chunked_gae": (lambda d: slime.chunked_gae(d["r"], d["v"], 0.99, 0.95), ("r", "v")),
    "slime.get_reinforce_plus_plus_returns": (
        lambda d: slime.get_reinforce_plus_plus_returns(
            d["score"],
            list(d["kl"]),
            list(d["mask"].to(torch.int64)),
            [d["kl"].shape[1]] * d["kl"].shape[0],
            [d["kl"].shape[1]] * d["kl"].shape[0],
            kl_coef=0.1,
            gamma=1.0,
        ),
        ("kl",),
    ),
    "slime.calculate_log_probs_and_entropy": (
        lambda d: slime.calculate_log_probs_and_entropy(
            d["logits"][0], d["target"][0], None, with_entropy=True
        ),
        ("logits",),
    ),
    "verl.compute_gae_advantage_return": (
        lambda d: verl.compute_gae_advantage_return(
            d["r"], d["v"], d["mask"].to(d["r"].dtype), 0.99, 0.95
        ),
        (),
    ),
    "verl.agg_loss": (
        lambda d: verl.agg_loss(d["x"], d["mask"].to(d["x"].dtype), "seq-mean-token-sum-norm"),
        ("x",),
    ),
}
CASES.update(
    {
        f"verl.{name}": (
            lambda d, fn=fn: fn(
                d["old"],
                d["logp"],
                d["adv"],
                d["mask"].to(d["logp"].dtype),
                "token-mean",
                {
                    "clip_ratio": 0.2,
                    "policy_loss": {
                        "rollout_correction": {"loss_type": "ppo_clip", "rollout_is": "token"}
                    },
                },
            ),
            ("logp",),
        )
        for name, fn in verl.POLICY_LOSS_REGISTRY.items()
    }
)


def _tensors(out: object) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for k in sorted(out) for t in _tensors(out[k])]
    if isinstance(out, (tuple, list)):
        return [t for part in out for t in _tensors(part)]
    return []  # None, Python numbers


def run_case(
    fn: Callable[[dict], object],
    d64: dict,
    grads: tuple[str, ...],
    dtype: torch.dtype,
    compiled: bool,
    backend: str = "inductor",
) -> list[torch.Tensor]:
    """Outputs, then the gradients of a fixed random weighting of the float outputs."""
    d = {
        k: (v.to(dtype, copy=True).requires_grad_(k in grads) if v.is_floating_point() else v)
        for k, v in d64.items()
    }
    outs = _tensors((torch.compile(fn, fullgraph=True, backend=backend) if compiled else fn)(d))
    results = [o.detach() for o in outs]
    live = [o for o in outs if o.requires_grad]
    if grads:
        assert live, "no output carries a gradient"
        g = torch.Generator().manual_seed(1)
        total = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in live)
        results += list(torch.autograd.grad(total, [d[k] for k in grads], allow_unused=True))
    return results


def _compare(name: str, compiled: list, eager: list, eager64: list) -> None:
    assert len(compiled) == len(eager) == len(eager64), name
    for i, (c, e, e64) in enumerate(zip(compiled, eager, eager64, strict=True)):
        what = f"{name} output {i}"
        if e is None:
            assert c is None, what
        elif not e.is_floating_point():
            assert torch.equal(c, e), what
        else:
            assert c.dtype == e.dtype and c.shape == e.shape, what
            assert_within_reference(what, c, e64.double(), e)


@pytest.mark.parametrize("name", sorted(CASES))
def test_fullgraph_forward_and_backward_equal_eager(name):
    """Inductor for the cases in :data:`INDUCTOR`; the others through AOTAutograd with the
    eager backend (``aot_eager``), which captures the same full forward and backward graphs
    (Dynamo's trace, functionalisation, the backward's trace) and skips only Inductor's code
    generation: that is where the time goes (a C++ build per graph), and the cases in
    :data:`INDUCTOR` cover it for every family of ops. ``benchmarks/compile_table.py``
    compiles all of them with Inductor."""
    torch._dynamo.reset()
    fn, grads = CASES[name]
    d64 = compile_inputs(4, 37)
    eager64 = run_case(fn, d64, grads, torch.float64, compiled=False)
    eager = run_case(fn, d64, grads, torch.float32, compiled=False)
    backend = "inductor" if name in INDUCTOR else "aot_eager"
    compiled = run_case(fn, d64, grads, torch.float32, compiled=True, backend=backend)
    _compare(name, compiled, eager, eager64)


# compiled with Inductor at four lengths (the other cases' guards are counted with Dynamo's
# eager backend below: cheaper, and the guards that make a recompile are Dynamo's)
DYNAMIC = [
    "logprobs_and_entropy",
    "policy_loss",
    "aggregate_loss",
    "masked_whiten",
    "discounted_cumsum",
    "gae",
    "reinforce_plus_plus_returns",
]
# compiled with Inductor in the fullgraph test: one case per family of ops (the scan, the
# estimators on it, the losses, the statistics, both log-prob ops)
INDUCTOR = {*DYNAMIC, "linear_logprobs_and_entropy"}


def _count_graphs(name: str, backend: str = "inductor") -> tuple[int, list]:
    """Graphs compiled for four lengths under ``dynamic=True`` (after the first: recompiles),
    and the compiled and eager results per length."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    fn, _ = CASES[name]
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend=backend)
    results = []
    for t in (16, 37, 64, 129):
        d = {
            k: (v.detach().float() if v.is_floating_point() else v)
            for k, v in compile_inputs(4, t).items()
        }
        results.append((t, compiled(d), fn(d)))
        if t == 16:
            first = counters["stats"]["unique_graphs"]
    return counters["stats"]["unique_graphs"] - first, results


@pytest.mark.parametrize("name", sorted(set(CASES) - set(DYNAMIC)))
def test_three_new_lengths_recompile_nothing_under_dynamo(name):
    """Every other case: the scan family is one operator (``rlops::reverse_scan``) whatever the
    length, value checks are skipped while tracing and lengths stay symbolic, so no new length
    recompiles."""
    recompiles, _ = _count_graphs(name, backend="eager")
    assert recompiles == 0, recompiles


@pytest.mark.parametrize("name", DYNAMIC)
def test_three_new_lengths_cost_at_most_one_recompile(name, monkeypatch, tmp_path):
    # a fresh Inductor cache: an entry cached by other code for the same graph may carry that
    # code's shape specialisations, and its guards would be counted here
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    recompiles, results = _count_graphs(name)
    assert recompiles <= 1, recompiles
    for t, c, e in results:
        for a, b in zip(_tensors(c), _tensors(e), strict=True):
            assert a.shape == b.shape, (name, t)
