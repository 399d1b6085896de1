"""One GRPO training step, every RL number from rlops.

GRPO advantages -> log-probs straight from the last hidden states and the LM head (the
[tokens, vocab] logits are never built) -> importance weights between the trainer and the
rollout engine -> GSPO loss per micro-batch with the global counts -> backward.

    python examples/grpo_step.py            # 8 prompts x 8 samples, 256 tokens, V = 8192
    python examples/grpo_step.py --small    # the sizes CI runs
"""

import sys

import torch

import rlops

# ----------------------------------------------------------------------------- config
prompts, group = 8, 8  # B = prompts * group responses, GRPO groups of `group`
T, V, H = 256, 8192, 128  # response tokens, vocabulary, hidden size
micro_batches = 4
clip_low, clip_high = 3e-4, 4e-4  # GSPO's sequence-ratio clip
tis_threshold = 2.0  # truncate trainer/engine importance weights at 2
lr = 1e-3
seed = 0
if "--small" in sys.argv:
    prompts, group, T, V, H, micro_batches = 2, 4, 32, 512, 32, 2
# -------------------------------------------------------------------------------------

torch.manual_seed(seed)
B = prompts * group

# The policy: a small body over fixed input features, then the LM head. In a real trainer the
# body is the transformer and `hidden` its final hidden states at the response positions.
body = torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.Tanh())
lm_head = torch.nn.Linear(H, V, bias=False)
params = [*body.parameters(), *lm_head.parameters()]
opt = torch.optim.AdamW(params, lr=lr)
features = torch.randn(B, T, H)

# What the rollout engine hands over: the sampled tokens, its own log-probs of them, an
# outcome score per response (say a verifier's 0/1) and the group (prompt) of each response.
tokens = torch.randint(0, V, (B, T))
lengths = torch.randint(T // 2, T + 1, (B,))
mask = (torch.arange(T) < lengths[:, None]).float()  # right padding is mask 0
scores = torch.randint(0, 2, (B,)).float()
index = torch.arange(prompts).repeat_interleave(group)
with torch.no_grad():  # the trainer's log-probs before the update (old_logp)
    old_logp, _ = rlops.linear_logprobs_and_entropy(
        body(features), lm_head.weight, tokens, with_entropy=False
    )
rollout_logp = old_logp + 0.05 * torch.randn(B, T)  # the engine's numerics differ a little

# 1. GRPO advantages: each score standardised within its group, broadcast over the response
adv, _ = rlops.grpo_advantages(scores, index, mask)

# 2. rollout correction: truncated token-level IS weights pi_trainer / pi_engine (detached)
is_weights, _, is_metrics = rlops.rollout_importance_weights(
    old_logp, rollout_logp, mask, level="token", mode="truncate", threshold=tis_threshold
)

# 3. GSPO over micro-batches. With the global number of sequences passed to every micro-batch,
#    the micro-batch losses (and their gradients) *sum* to the full-batch loss.
num_seqs = (mask.sum(dim=1) > 0).sum()
opt.zero_grad(set_to_none=True)
total = torch.zeros(())
for rows in torch.arange(B).chunk(micro_batches):
    logp, entropy = rlops.linear_logprobs_and_entropy(
        body(features[rows]), lm_head.weight, tokens[rows], entropy_grad=False
    )
    loss, metrics = rlops.policy_loss(
        logp, old_logp[rows], adv[rows], mask[rows], kind="gspo",
        rollout_is_weights=is_weights[rows], agg="seq-mean-token-mean", num_seqs=num_seqs,
        clip_low=clip_low, clip_high=clip_high,
    )  # fmt: skip
    loss.backward()  # gradients accumulate over the micro-batches
    total += loss.detach()

# The same loss in one call over the whole batch: the sum above must equal it.
with torch.no_grad():
    logp, _ = rlops.linear_logprobs_and_entropy(body(features), lm_head.weight, tokens)
    full, _ = rlops.policy_loss(
        logp, old_logp, adv, mask, kind="gspo", rollout_is_weights=is_weights,
        agg="seq-mean-token-mean", clip_low=clip_low, clip_high=clip_high,
    )  # fmt: skip
torch.testing.assert_close(total, full)
grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
opt.step()

print(f"GRPO step: {B} responses ({prompts} prompts x {group}), {int(mask.sum())} action tokens, "
      f"{micro_batches} micro-batches")
print(f"mean score {scores.mean():.3f}, advantage std {adv[mask.bool()].std():.3f}")
print(f"IS weights: mean {is_metrics['rollout_is_mean']:.4f}, truncated "
      f"{is_metrics['rollout_is_ratio_fraction_high']:.2%} of tokens")
print(f"GSPO loss {total:.6f} = full-batch loss {full:.6f}; grad norm {grad_norm:.4f}")
