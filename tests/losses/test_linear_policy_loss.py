"""``linear_policy_loss``: the composition's value, gradients and metrics, in one pass.

The expected values are the composition the function documents (``linear_logprobs_and_entropy``,
``policy_loss``, ``entropy_loss``, autograd), whose parts are each tested against their
definitions; in float64 the one pass must equal it to 1e-9 for every kind and aggregation, with
tool spans and an empty row masked; in float32 and bfloat16 both are measured against the
float64 composition and the one pass must be within the project's tolerance rule of it.
"""

from __future__ import annotations

import pytest
import torch
from tests._distributed import run_distributed
from tests.tolerances import assert_error_within, max_abs_err

import rlops
from rlops.logprobs import copy_to_tensor_parallel_region
from rlops.losses import AGG_MODES, ONE_PASS_KINDS, POLICY_KINDS

B, T, H, V = 3, 9, 6, 29


def _batch(dtype=torch.float64, seed=0, b=B, t=T, h=H, v=V):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(v, h, generator=g, dtype=torch.float64) * 0.8).to(dtype)
    bias = torch.randn(v, generator=g, dtype=torch.float64).to(dtype)
    target = torch.randint(0, v, (b, t), generator=g)
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 4
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[0, 2:5] = 0  # a tool span
    mask[1:2] = 0  # an empty row
    mask[2:, -1] = 0
    return hidden, weight, bias, target, old, adv, mask


def _run(batch, one_pass, *, kind="ppo", agg="token-mean", coef=0.01, lp=None, **options):
    hidden, weight, bias, target, old, adv, mask = batch
    h, w, b = (x.clone().requires_grad_() for x in (hidden, weight, bias))
    loss, metrics = rlops.linear_policy_loss(
        h, w, target, old, adv, mask, bias=b, entropy_coef=coef, kind=kind, agg=agg,
        one_pass=one_pass, logprob_options=lp, **options,
    )  # fmt: skip
    loss.backward()
    return [loss.detach(), h.grad, w.grad, b.grad], metrics


def _composition(batch, *, kind="ppo", agg="token-mean", coef=0.01, lp=None, **options):
    """What the function documents, written as a user would."""
    hidden, weight, bias, target, old, adv, mask = batch
    h, w, b = (x.clone().requires_grad_() for x in (hidden, weight, bias))
    logp, ent = rlops.linear_logprobs_and_entropy(h, w, target, bias=b, **(lp or {}))
    loss, metrics = rlops.policy_loss(logp, old, adv, mask, kind=kind, agg=agg, **options)
    loss = loss + rlops.entropy_loss(ent, mask, coef=coef, agg=agg)[0]
    loss.backward()
    return [loss.detach(), h.grad, w.grad, b.grad], metrics


def _assert_equal(got, want, tol):
    (g, gm), (w, wm) = got, want
    for name, x, y in zip(("loss", "hidden", "weight", "bias"), g, w, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape, name
        torch.testing.assert_close(x, y, rtol=0, atol=tol, msg=name)
    assert gm.keys() == wm.keys()
    for k in wm:
        torch.testing.assert_close(gm[k], wm[k], rtol=0, atol=tol, msg=k)


DETERMINISTIC = [k for k in POLICY_KINDS if k != "clip_cov"]  # clip_cov draws at random


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("kind", DETERMINISTIC)
def test_every_kind_and_aggregation_equals_the_composition(kind, agg):
    batch = _batch()
    _assert_equal(
        _run(batch, None, kind=kind, agg=agg), _composition(batch, kind=kind, agg=agg), 1e-9
    )


@pytest.mark.parametrize(
    "lp",
    [
        {"top_k": 5},
        {"top_p": 0.8, "min_p": 0.02},
        {"final_logit_softcapping": 2.0, "logit_scale": 0.5},
        {"chunk_size": 4},
        {"entropy_over_support": True, "top_k": 7},
    ],
    ids=["top_k", "top_p_min_p", "softcap_scale", "chunk_4", "entropy_over_support"],
)
@pytest.mark.parametrize("kind", ["ppo", "cispo", "gspo"])
def test_log_prob_options_apply_as_in_the_op(kind, lp):
    batch = _batch(seed=1)
    _assert_equal(_run(batch, None, kind=kind, lp=lp), _composition(batch, kind=kind, lp=lp), 1e-9)


def test_per_row_temperature_rollout_weights_and_normalisers():
    batch = _batch(seed=2)
    tau = torch.linspace(0.5, 1.5, B, dtype=torch.float64)
    isw = torch.rand(B, T, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    opts = {"rollout_is_weights": isw, "num_tokens": 40, "clip_high": 0.28, "dual_clip": 3.0}
    hidden, weight, bias, target, old, adv, mask = batch
    h, w, b = (x.clone().requires_grad_() for x in (hidden, weight, bias))
    logp, ent = rlops.linear_logprobs_and_entropy(h, w, target, bias=b, temperature=tau)
    want, wm = rlops.policy_loss(logp, old, adv, mask, **opts)
    (want + rlops.entropy_loss(ent, mask, coef=0.05, num_tokens=40)[0]).backward()
    h2, w2, b2 = (x.clone().requires_grad_() for x in (hidden, weight, bias))
    got, gm = rlops.linear_policy_loss(
        h2, w2, target, old, adv, mask, bias=b2, temperature=tau, entropy_coef=0.05,
        one_pass=True, **opts,
    )  # fmt: skip
    got.backward()
    for x, y in ((got, want + rlops.entropy_loss(ent, mask, coef=0.05, num_tokens=40)[0]),
                 (h2.grad, h.grad), (w2.grad, w.grad), (b2.grad, b.grad)):  # fmt: skip
        torch.testing.assert_close(x.detach(), y.detach(), rtol=0, atol=1e-9)
    assert gm.keys() == wm.keys()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 127, 128, 129])
def test_low_precision_within_the_tolerance_rule(dtype, n):
    """Both paths against the float64 composition on the same rounded inputs: the one pass's
    error within the rule of the composition's own."""
    batch = _batch(dtype, seed=n, b=3, t=n, h=16, v=300)
    exact = _composition(tuple(x.double() if x.is_floating_point() else x for x in batch))[0]
    one, composed = _run(batch, True)[0], _composition(batch)[0]
    for name, o, c, e in zip(
        ("loss", "hidden", "weight", "bias"), one, composed, exact, strict=True
    ):
        err, ref = max_abs_err(o.double(), e), max_abs_err(c.double(), e)
        assert_error_within(
            name, err, ref, torch.float32, float(e.abs().max()), what="composition's"
        )


def test_gradcheck_float64():
    batch = _batch(b=2, t=4, h=3, v=7)
    hidden, weight, bias, target, old, adv, mask = batch

    def f(h, w, b):
        return rlops.linear_policy_loss(h, w, target, old, adv, mask, bias=b, entropy_coef=0.1,
                                        one_pass=True)[0]  # fmt: skip

    args = tuple(x.clone().requires_grad_() for x in (hidden, weight, bias))
    assert torch.autograd.gradcheck(f, args)


def test_the_backward_scales_the_gradients():
    batch = _batch()
    hidden, weight, _, target, old, adv, mask = batch
    h = hidden.clone().requires_grad_()
    loss = rlops.linear_policy_loss(h, weight, target, old, adv, mask)[0]
    (3.0 * loss).backward()
    h1 = hidden.clone().requires_grad_()
    rlops.linear_policy_loss(h1, weight, target, old, adv, mask)[0].backward()
    torch.testing.assert_close(h.grad, 3.0 * h1.grad, rtol=1e-12, atol=0)


@pytest.mark.parametrize("kind", sorted(set(POLICY_KINDS) - set(ONE_PASS_KINDS)))
def test_one_pass_demanded_for_a_row_level_kind_raises_naming_it(kind):
    batch = _batch()
    with pytest.raises(ValueError, match=f"kind='{kind}', one_pass=True"):
        _run(batch, True, kind=kind)


def test_sequence_level_cispo_is_not_one_pass():
    with pytest.raises(ValueError, match="level='token'"):
        _run(_batch(), True, kind="cispo", level="sequence")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"logprob_options": {"temperature": 0.5}}, TypeError, "must not set"),
        ({"logprob_options": [1]}, TypeError, "logprob_options must be a mapping"),
        ({"agg": None}, ValueError, "agg=None"),
        ({"entropy_coef": float("nan")}, ValueError, "entropy_coef must be a finite"),
        ({"entropy_coef": "0.1"}, TypeError, "entropy_coef"),
        ({"one_pass": "yes"}, TypeError, "one_pass"),
        ({"kind": "nope"}, ValueError, "kind"),
        ({"one_pass": True, "logprob_options": {"group": object()}}, ValueError, "one process"),
    ],
)
def test_bad_inputs(kwargs, error, match):
    hidden, weight, _, target, old, adv, mask = _batch()
    with pytest.raises(error, match=match):
        rlops.linear_policy_loss(hidden, weight, target, old, adv, mask, **kwargs)


def test_bad_shapes_name_the_argument():
    hidden, weight, _, target, old, adv, mask = _batch()
    with pytest.raises(ValueError, match="target"):
        rlops.linear_policy_loss(hidden, weight, target[:, :-1], old, adv, mask)
    with pytest.raises(ValueError, match="advantages"):
        rlops.linear_policy_loss(hidden, weight, target, old, adv[:, :-1], mask)


# --------------------------------------------------------------------------- tensor parallel
def _tp_worker(rank: int, world_size: int, batch) -> list:
    import torch.distributed as dist

    hidden, weight, bias, target, old, adv, mask = batch
    shard = weight.shape[0] // world_size
    w = weight[rank * shard : (rank + 1) * shard].clone().requires_grad_()
    b = bias[rank * shard : (rank + 1) * shard].clone().requires_grad_()
    h = hidden.clone().requires_grad_()
    loss, _ = rlops.linear_policy_loss(
        copy_to_tensor_parallel_region(h, dist.group.WORLD), w, target, old, adv, mask,
        bias=b, entropy_coef=0.01, logprob_options={"group": dist.group.WORLD},
    )  # fmt: skip
    loss.backward()
    return [loss.detach(), h.grad, w.grad, b.grad]


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_equals_one_process(world):
    batch = _batch(b=2, t=5, h=4, v=8 * world)
    (loss, gh, gw, gb), _ = _run(batch, None)
    results = run_distributed(_tp_worker, world, batch)
    for r, (l_r, gh_r, gw_r, gb_r) in enumerate(results):
        shard = slice(r * 8, (r + 1) * 8)
        torch.testing.assert_close(l_r, loss, rtol=0, atol=1e-12)
        torch.testing.assert_close(gh_r, gh, rtol=0, atol=1e-12)
        torch.testing.assert_close(gw_r, gw[shard], rtol=0, atol=1e-12)
        torch.testing.assert_close(gb_r, gb[shard], rtol=0, atol=1e-12)
