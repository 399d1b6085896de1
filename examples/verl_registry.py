"""Plug rlops into verl's registries: verl then computes GRPO advantages and its policy losses
with rlops, looked up by name as its trainer does, with no edit to verl's code.

Runs against verl where it is installed, else against the stand-in of examples/_standins.py
(plain-loop restatements of verl's GRPO and "vanilla" PPO loss; it says so when it is used).

    python examples/verl_registry.py [--small]
"""

import sys

import _standins  # the stand-in for verl, used only where verl is not installed
import numpy as np
import torch

standin = _standins.use_if_absent("verl")
from verl.trainer.ppo import core_algos  # noqa: E402

from rlops.compat import verl as rlops_verl  # noqa: E402

# ----------------------------------------------------------------------------- config
prompts, group, T = 16, 8, 256  # GRPO groups of `group` responses of T tokens
actor = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}
seed = 0
if "--small" in sys.argv:
    prompts, group, T = 3, 4, 16
# -------------------------------------------------------------------------------------


class ActorConfig(dict):
    """verl reads its actor config both as ``config.key`` and ``config.get(key)``."""

    __getattr__ = dict.__getitem__


# verl's own functions, kept to compare with (looked up before registering rlops)
verl_grpo = core_algos.get_adv_estimator_fn("grpo")
verl_ppo = core_algos.get_policy_loss_fn("vanilla")

# Register once, before training starts, in every process that computes them.
core_algos.ADV_ESTIMATOR_REGISTRY.update({
    "grpo": rlops_verl.compute_grpo_outcome_advantage,
    "rloo": rlops_verl.compute_rloo_outcome_advantage,
    "reinforce_plus_plus": rlops_verl.compute_reinforce_plus_plus_outcome_advantage,
    "reinforce_plus_plus_baseline":
        rlops_verl.compute_reinforce_plus_plus_baseline_outcome_advantage,
    "remax": rlops_verl.compute_remax_outcome_advantage,
})  # fmt: skip
core_algos.POLICY_LOSS_REGISTRY.update(rlops_verl.POLICY_LOSS_REGISTRY)

# A batch as verl's DataProto holds it: token-level rewards (the score on the last response
# token), the response mask, and the uid of each response's prompt (strings, as verl's).
torch.manual_seed(seed)
B = prompts * group
lengths = torch.randint(1, T + 1, (B,))
response_mask = (torch.arange(T) < lengths[:, None]).float()
token_level_rewards = torch.zeros(B, T)
token_level_rewards[torch.arange(B), lengths - 1] = torch.randint(0, 2, (B,)).float()
uid = np.array([f"prompt-{i // group}" for i in range(B)], dtype=object)
old_log_prob = -torch.rand(B, T)
log_prob = (old_log_prob + 0.3 * torch.randn(B, T)).requires_grad_()
actor["global_batch_info"] = {"dp_size": 1, "batch_num_tokens": int(response_mask.sum()),
                              "global_batch_size": B}
config = ActorConfig(actor)

# ray_trainer.compute_advantage: the estimator by name
adv_fn = core_algos.get_adv_estimator_fn("grpo")
advantages, returns = adv_fn(token_level_rewards=token_level_rewards,
                             response_mask=response_mask, index=uid)
ref_adv, _ = verl_grpo(token_level_rewards=token_level_rewards, response_mask=response_mask,
                       index=uid)
torch.testing.assert_close(advantages, ref_adv)

# dp_actor.update_policy: the policy loss by name (actor.policy_loss.loss_mode)
loss_fn = core_algos.get_policy_loss_fn("vanilla")
pg_loss, metrics = loss_fn(old_log_prob, log_prob, advantages, response_mask,
                           loss_agg_mode="token-mean", config=config)
ref_loss, ref_metrics = verl_ppo(old_log_prob, log_prob.detach(), advantages, response_mask,
                                 loss_agg_mode="token-mean", config=config)
torch.testing.assert_close(pg_loss.detach(), ref_loss)
for key, value in ref_metrics.items():
    assert abs(metrics[key] - value) < 1e-6, (key, metrics[key], value)
pg_loss.backward()

gspo_loss, _ = core_algos.get_policy_loss_fn("gspo")(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=config
)

print(f"verl: {'STAND-IN (verl is not installed)' if standin else 'installed'}; "
      f"{len(rlops_verl.POLICY_LOSS_REGISTRY)} policy losses and 5 estimators now from rlops")
print(f"grpo by name: {B} responses in {prompts} groups, matches verl's "
      f"(max |A| {advantages.abs().max():.3f})")
print(f"vanilla by name: loss {pg_loss:.5f} = verl's {ref_loss:.5f}, "
      f"clipfrac {metrics['actor/pg_clipfrac']:.3f}, grad norm {log_prob.grad.norm():.4f}")
print(f"gspo by name: loss {gspo_loss:.5f}")
