"""The bare-install smoke test: every name in ``rlops.__all__`` on small inputs, from outside
the repository, in an install of torch and rlops only (no numpy, no numba).

``.ci/run`` runs it in a fresh venv with no extras; ``tests/package/test_bare_install.py`` runs
it in the development environment with numpy and numba made unimportable. Run it as
``python tests/package/bare_install_smoke.py`` (it is not a test module: importing it runs
nothing).
"""

import sys

import torch

import rlops
import rlops.testing


def main() -> None:
    assert "numpy" not in sys.modules, "import rlops imported numpy"
    B, T, V, H = 3, 10, 7, 4
    g = torch.Generator().manual_seed(0)
    r, v, kl, x = (torch.randn(B, T, generator=g) for _ in range(4))
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[:, 3:5] = False
    dones = torch.zeros(B, T, dtype=torch.bool)
    dones[0, 6] = True
    score, index = torch.randn(B, generator=g), torch.tensor([0, 0, 1])
    logits = torch.randn(B, T, V, generator=g, requires_grad=True)
    target = torch.randint(0, V, (B, T), generator=g)
    hidden, weight = torch.randn(B * T, H, generator=g), torch.randn(V, H, generator=g)
    calls = {
        "aggregate_loss": lambda: rlops.aggregate_loss(x, mask, "seq-mean-token-mean"),
        "discounted_cumsum": lambda: rlops.discounted_cumsum(x, torch.rand(B, T, generator=g)),
        "discounted_returns": lambda: rlops.discounted_returns(
            r, gamma=0.99, mask=mask, dones=dones
        ),
        "behavior_importance_weights": lambda: rlops.behavior_importance_weights(
            -r.abs(), -v.abs(), mask, upper=2.0, level="sequence", agg="max", action="clamp"
        ),
        "entropy_loss": lambda: rlops.entropy_loss(x, mask, coef=0.01),
        "distillation_loss": lambda: rlops.distillation_loss(
            logits, *torch.log_softmax(logits.detach() * 0.5, -1).topk(2, -1), tail=True
        ),
        "linear_distillation_loss": lambda: rlops.linear_distillation_loss(
            hidden, weight, torch.log_softmax(torch.randn(B * T, V, generator=g), -1)
        ),
        "gdpo_advantages": lambda: rlops.gdpo_advantages(
            torch.stack([score, -score], -1), index, mask
        ),
        "gigpo_advantages": lambda: rlops.gigpo_advantages(
            score, index, x[:, 0], torch.tensor([0, 1, 0]), mask
        ),
        "gpg_advantages": lambda: rlops.gpg_advantages(score, index, mask),
        "maxrl_advantages": lambda: rlops.maxrl_advantages(score.abs(), index, mask),
        "overlong_penalty": lambda: rlops.overlong_penalty(mask.sum(-1), 8, 4),
        "grpo_passk_advantages": lambda: rlops.grpo_passk_advantages(
            score, torch.zeros(B, dtype=torch.long), mask
        ),
        "opo_advantages": lambda: rlops.opo_advantages(score, index, mask),
        "gae": lambda: rlops.gae(r, v, gamma=0.99, lam=0.95, mask=mask, dones=dones),
        "grpo_advantages": lambda: rlops.grpo_advantages(score, index, mask),
        "kl_penalty": lambda: rlops.kl_penalty(r, v, "low_var_kl"),
        "linear_logprobs_and_entropy": lambda: rlops.linear_logprobs_and_entropy(
            hidden, weight, target.reshape(-1)
        ),
        "linear_policy_loss": lambda: rlops.linear_policy_loss(
            hidden.view(B, T, H), weight, target, -r.abs(), x, mask, entropy_coef=0.01
        ),
        "logprobs_and_entropy": lambda: rlops.logprobs_and_entropy(logits, target),
        "m2po_mask": lambda: rlops.m2po_mask(-r.abs(), -v.abs(), mask, threshold=0.5),
        "masked_mean": lambda: rlops.masked_mean(x, mask),
        "masked_var": lambda: rlops.masked_var(x, mask),
        "masked_whiten": lambda: rlops.masked_whiten(x, mask),
        "opsm_mask": lambda: rlops.opsm_mask(-r.abs(), -v.abs(), x, mask, delta=0.1),
        "optimal_token_baseline_advantages": lambda: rlops.optimal_token_baseline_advantages(
            r, index, mask, -v.abs(), torch.rand(B, T, generator=g), per_action_step=True
        ),
        "policy_loss": lambda: rlops.policy_loss(r, v, x, mask, dual_clip=3.0),
        "reinforce_plus_plus_baseline_advantages": lambda: (
            rlops.reinforce_plus_plus_baseline_advantages(score, index, mask)
        ),
        "reinforce_plus_plus_returns": lambda: rlops.reinforce_plus_plus_returns(
            score, kl, mask, kl_coef=0.1, gamma=1.0
        ),
        "remax_advantages": lambda: rlops.remax_advantages(r, score, mask),
        "rloo_advantages": lambda: rlops.rloo_advantages(score, index, mask),
        "rollout_importance_weights": lambda: rlops.rollout_importance_weights(
            -r.abs(), -v.abs(), mask, level="sequence", mode="mask", low=0.5
        ),
        "rollout_mismatch_metrics": lambda: rlops.rollout_mismatch_metrics(
            -r.abs(), -v.abs(), mask
        ),
        "rollout_rejection_mask": lambda: rlops.rollout_rejection_mask(
            -r.abs(), -v.abs(), mask, {"token_k1": 2.0, "seq_mean_k3": 0.5}
        ),
        "top_entropy_mask": lambda: rlops.top_entropy_mask(v.abs(), mask, rho=0.2),
        "value_loss": lambda: rlops.value_loss(v, r, x, mask, clip=0.2),
    }
    assert sorted(calls) == sorted(rlops.__all__), set(calls) ^ set(rlops.__all__)

    def tensors(out):
        if isinstance(out, torch.Tensor):
            return [out]
        if isinstance(out, dict):
            return list(out.values())
        return [t for part in out for t in tensors(part)]

    for name, call in calls.items():
        for t in tensors(call()):
            assert bool(torch.isfinite(t).all()), name
    lp, ent = rlops.logprobs_and_entropy(logits, target)
    (lp.sum() + ent.sum()).backward()
    assert bool(torch.isfinite(logits.grad).all())
    try:
        rlops.gae(r, v, gamma=0.99, lam=0.95, method="compiled")
    except ValueError as e:
        assert "numba" in str(e), e
    else:
        raise AssertionError('method="compiled" ran without numba')

    # the numerics contract runs on torch alone too
    def loss(logp, old_logp, advantages, mask):
        return rlops.policy_loss(logp, old_logp, advantages, mask)[0]

    report = rlops.testing.check_policy_loss(loss, agg="token-mean")
    assert report.ok, str(report)
    assert "numpy" not in sys.modules and "numba" not in sys.modules
    print(
        f"bare install: {len(calls)} public functions ran, outputs finite "
        f"(torch {torch.__version__}, no numpy, no numba)"
    )


if __name__ == "__main__":
    main()
