"""``linear_policy_loss``'s ``return_logprobs`` and on-policy ``old_logp=None``.

Expected values: the log-probs and entropies are ``log_softmax`` of the logits written out in
float64; on-policy (the ratio's denominator the detached log-probs themselves, ratio 1) a
token's loss is ``−A`` by hand for ppo, and the value and gradients are the documented
composition with ``old_logp = logp.detach()`` written as a user would.
"""

from __future__ import annotations

import pytest
import torch
from tests.tolerances import assert_within_reference

import rlops
from rlops.losses import ONE_PASS_KINDS

H, V = 6, 29


def _batch(b=3, t=9, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, H, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(V, H, generator=g, dtype=torch.float64) * 0.8).to(dtype)
    bias = torch.randn(V, generator=g, dtype=torch.float64).to(dtype)
    target = torch.randint(0, V, (b, t), generator=g)
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = (torch.rand(b, t, generator=g) < 0.8).long()
    mask[0] = 0  # an empty row
    if b * t > 1:
        mask.view(-1)[-1] = 1
    return hidden, weight, bias, target, adv, mask


def _definition(hidden, weight, bias, target):
    """``log p_y`` and ``H`` from ``log_softmax`` of the float64 logits."""
    z = hidden.double() @ weight.double().T + bias.double()
    logsm = torch.log_softmax(z, -1)
    return logsm.gather(-1, target[..., None])[..., 0], -(logsm.exp() * logsm).sum(-1)


def _grads(batch, old, one_pass, kind="ppo", coef=0.01, **options):
    hidden, weight, bias, target, adv, mask = batch
    h, w, b = (x.clone().requires_grad_() for x in (hidden, weight, bias))
    loss, metrics = rlops.linear_policy_loss(
        h, w, target, old, adv, mask, bias=b, entropy_coef=coef, kind=kind, one_pass=one_pass,
        return_logprobs=True, **options,
    )  # fmt: skip
    loss.backward()
    return [loss.detach(), h.grad, w.grad, b.grad], metrics


def _on_policy_composition(batch, kind="ppo", coef=0.01, **options):
    """The documented composition with ``old_logp = logp.detach()``."""
    hidden, weight, bias, target, adv, mask = batch
    h, w, b = (x.clone().requires_grad_() for x in (hidden, weight, bias))
    logp, ent = rlops.linear_logprobs_and_entropy(h, w, target, bias=b)
    loss = rlops.policy_loss(logp, logp.detach(), adv, mask, kind=kind, **options)[0]
    loss = loss + rlops.entropy_loss(ent, mask, coef=coef)[0]
    loss.backward()
    return [loss.detach(), h.grad, w.grad, b.grad]


@pytest.mark.parametrize("one_pass", [None, False])
def test_return_logprobs_are_the_log_softmax(one_pass):
    batch = _batch()
    old = -torch.rand(3, 9, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    _, metrics = _grads(batch, old, one_pass)
    lp, ent = _definition(*batch[:4])
    torch.testing.assert_close(metrics["logp"], lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(metrics["entropy"], ent, rtol=0, atol=1e-12)
    assert not metrics["logp"].requires_grad and not metrics["entropy"].requires_grad


def test_default_return_is_unchanged():
    hidden, weight, _, target, adv, mask = _batch()
    old = torch.zeros_like(adv)
    got = rlops.linear_policy_loss(hidden, weight, target, old, adv, mask)
    asked = rlops.linear_policy_loss(hidden, weight, target, old, adv, mask, return_logprobs=True)
    assert len(got) == 2 and "logp" not in got[1] and "entropy" not in got[1]
    assert set(asked[1]) == set(got[1]) | {"logp", "entropy"}
    assert torch.equal(got[0], asked[0])


@pytest.mark.parametrize("one_pass", [None, False])
def test_on_policy_ppo_loss_is_minus_the_advantage(one_pass):
    batch = _batch(seed=2)
    (loss, *_), metrics = _grads(batch, None, one_pass, coef=0.0)
    adv, mask = batch[4], batch[5].double()
    assert loss.item() == pytest.approx(float(-(adv * mask).sum() / mask.sum()), abs=1e-12)
    assert metrics["ppo_kl"].item() == 0.0


@pytest.mark.parametrize("size", [(1, 1), (1, 127), (2, 64), (3, 43), (8, 125)])
@pytest.mark.parametrize("kind", ONE_PASS_KINDS)
def test_on_policy_equals_the_composition(kind, size):
    batch = _batch(*size, seed=3)
    options = {"level": "token"} if kind in ("cispo", "sapo") else {}
    want = _on_policy_composition(batch, kind=kind, **options)
    for one_pass in (None, False):
        got, _ = _grads(batch, None, one_pass, kind=kind, **options)
        for name, x, y in zip(("loss", "hidden", "weight", "bias"), got, want, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-9, msg=f"{one_pass} {name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_policy_low_precision_within_the_rule(dtype):
    batch64 = _batch(4, 33, seed=4)
    oracle = _on_policy_composition(batch64)
    low = tuple(x.to(dtype) if x.is_floating_point() and x is not batch64[4] else x
                for x in batch64)  # fmt: skip
    got, _ = _grads(low, None, None)
    ref = _on_policy_composition(low)
    for name, x, y, o in zip(("loss", "hidden", "weight", "bias"), got, ref, oracle, strict=True):
        assert_within_reference(f"{dtype} {name}", x.float(), o, y.float())


def test_bad_inputs_name_the_argument():
    hidden, weight, _, target, adv, mask = _batch()
    with pytest.raises(TypeError, match="return_logprobs"):
        rlops.linear_policy_loss(hidden, weight, target, None, adv, mask, return_logprobs="yes")
    with pytest.raises(ValueError, match="advantages"):
        rlops.linear_policy_loss(hidden, weight, target, None, adv[0], mask)
    with pytest.raises(ValueError, match=r"target must be .* like advantages"):
        rlops.linear_policy_loss(hidden, weight, target[:, :-1], None, adv, mask)
    with pytest.raises(ValueError, match="mask"):
        rlops.linear_policy_loss(hidden, weight, target, None, adv, mask[:, :-1])
