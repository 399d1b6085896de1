"""One PPO step with a critic on multi-turn responses, every RL number from rlops.

Each response is the model's first turn, a tool's output, the model's second turn, then
padding. Tool output and padding have mask 0: no loss reads them and GAE skips them, so the
outcome reward on the last action token still reaches the first turn. The reward also carries
a KL penalty to a reference policy, whose coefficient an adaptive controller steers.

    python examples/ppo_step.py            # 32 responses of up to 224 tokens, V = 4096
    python examples/ppo_step.py --small    # the sizes CI runs
"""

import copy
import sys

import torch

import rlops
from rlops.kl_controllers import AdaptiveKLController

# ----------------------------------------------------------------------------- config
B, P, V, H = 32, 16, 4096, 64  # responses, prompt tokens, vocabulary, hidden size
turn, tool = 96, 32  # at most `turn` tokens per model turn; `tool` tokens of tool output
gamma, lam = 1.0, 0.95
clip_low, clip_high, dual_clip = 0.2, 0.28, 3.0
value_clip, value_coef, entropy_coef = 0.2, 0.5, 0.01
kl_ctrl = {"init_kl_coef": 0.05, "target_kl": 0.02, "horizon": 10000}  # verl's names
epochs, lr, seed = 2, 1e-3, 0
if "--small" in sys.argv:
    B, P, V, H, turn, tool = 4, 4, 256, 16, 12, 4
# -------------------------------------------------------------------------------------

torch.manual_seed(seed)
T = 2 * turn + tool  # response length


class PolicyCritic(torch.nn.Module):
    """Policy and critic on one small body (in a real trainer: a transformer, or two)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(V, H)
        self.body = torch.nn.GRU(H, H, batch_first=True)
        self.lm_head = torch.nn.Linear(H, V, bias=False)
        self.value_head = torch.nn.Linear(H, 1)

    def forward(self, seq):
        """``seq`` [B, P + T] -> logits [B, T, V] and values [B, T] at the response tokens."""
        h, _ = self.body(self.emb(seq[:, :-1]))
        h = h[:, P - 1 :]  # position t predicts token t + 1
        return self.lm_head(h), self.value_head(h).squeeze(-1)


model = PolicyCritic()
reference = copy.deepcopy(model).requires_grad_(False)
with torch.no_grad():  # as if the policy had already moved away from its reference
    for p in model.parameters():
        p.add_(0.02 * torch.randn_like(p))
opt = torch.optim.AdamW(model.parameters(), lr=lr)
kl_ctl = AdaptiveKLController(**kl_ctrl)

# A multi-turn rollout: turn 1 (n1 tokens), tool output (mask 0), turn 2 (n2 tokens), padding.
n1 = torch.randint(turn // 2, turn + 1, (B,))
n2 = torch.randint(1, turn + 1, (B,))
pos = torch.arange(T)
turn1 = pos < n1[:, None]
turn2 = (pos >= (n1 + tool)[:, None]) & (pos < (n1 + tool + n2)[:, None])
mask = (turn1 | turn2).float()
seq = torch.randint(0, V, (B, P + T))  # prompt + sampled turns + the tool's tokens
last = n1 + tool + n2 - 1  # each row's last action token
score = torch.rand(B)  # the outcome, e.g. from a reward model

with torch.no_grad():  # everything the loss holds fixed: old log-probs, values, advantages
    logits, old_values = model(seq)
    old_logp, _ = rlops.logprobs_and_entropy(logits, seq[:, P:], with_entropy=False)
    ref_logp, _ = rlops.logprobs_and_entropy(reference(seq)[0], seq[:, P:], with_entropy=False)
    kl = rlops.kl_penalty(old_logp, ref_logp, "k3")  # >= 0 per token
    rewards = -kl_ctl.value * kl * mask
    rewards[torch.arange(B), last] += score  # the outcome on the last action token
    adv, returns = rlops.gae(rewards, old_values, gamma=gamma, lam=lam, mask=mask)
    adv = rlops.masked_whiten(adv, mask)
assert not adv[mask == 0].any() and not returns[mask == 0].any()  # tool output, padding: 0

print(f"PPO on {B} two-turn responses: {int(mask.sum())} action tokens, "
      f"{int((1 - mask).sum())} tool/padding tokens (mask 0)")
for epoch in range(epochs):
    logits, values = model(seq)
    logp, entropy = rlops.logprobs_and_entropy(logits, seq[:, P:])
    pg, pg_m = rlops.policy_loss(
        logp, old_logp, adv, mask, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip
    )
    vf, vf_m = rlops.value_loss(values, old_values, returns, mask, clip=value_clip)
    ent, ent_m = rlops.entropy_loss(entropy, mask, coef=entropy_coef)
    loss = pg + value_coef * vf + ent
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    print(f"epoch {epoch}: policy {pg:.4f} (clipped {pg_m['pg_clipfrac']:.1%}), "
          f"value {vf:.4f} (clipped {vf_m['vf_clipfrac']:.1%}), entropy {ent_m['entropy']:.3f}")

beta = kl_ctl.value
kl_ctl.update(rlops.masked_mean(kl, mask), n_steps=B)  # a number: the controller builds no graph
print(f"KL {rlops.masked_mean(kl, mask):.4f} (target {kl_ctrl['target_kl']}): "
      f"coefficient {beta:.5f} -> {kl_ctl.value:.5f}")
