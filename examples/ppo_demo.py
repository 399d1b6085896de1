"""The training loop of ``rlops demo`` as one flat file: PPO from scratch on a tiny transformer.

The task: the prompt shows a random string of symbols; the policy must write it reversed. The
reward, given once on the last token, is the fraction of positions right (max 1, chance 1/13).
Rollouts are sampled from the policy; GAE, log-probs and entropy, the KL penalty to the initial
policy, whitening and the policy and value losses all come from rlops.

With ``--multi-turn`` the prompt shows the first half only; after the policy answers, the
environment (a "tool") inserts the second half as an observation with mask 0, and the policy
answers again. GAE skips the observation, so the final reward still reaches the first turn.

    python examples/ppo_demo.py                  # about a minute on 2 CPU cores: reward -> 0.95
    python examples/ppo_demo.py --multi-turn
    python examples/ppo_demo.py --small          # a few iterations (what CI runs)
"""

import copy
import sys
import time

import torch

import rlops
from rlops.cli.model import ModelConfig, TinyTransformer, sample

# ----------------------------------------------------------------------------- config
symbols, length = 10, 10  # alphabet and length of the strings to reverse
multi_turn = "--multi-turn" in sys.argv
d_model, n_layers, n_heads = 64, 2, 4
iterations, batch, epochs = 200, 128, 4  # PPO iterations, rollouts each, passes over them
lr, temperature = 1e-3, 1.0
gamma, lam, clip = 1.0, 0.95, 0.2
value_coef, entropy_coef, kl_coef = 0.5, 0.01, 0.01
seed = 0
log_every = 20
if "--small" in sys.argv:
    iterations, batch, log_every = 3, 16, 1
# -------------------------------------------------------------------------------------

torch.set_num_threads(1)  # this model is too small to gain from more threads
torch.manual_seed(seed)
gen = torch.Generator().manual_seed(seed)
BOS, SEP, OBS = symbols, symbols + 1, symbols + 2  # special tokens after the symbols
half = length // 2 if multi_turn else length  # symbols per model turn

policy = TinyTransformer(ModelConfig(
    vocab=symbols + 3,
    context=(half + 2) + (3 * half + 2) if multi_turn else 2 * length + 2,
    d_model=d_model, n_layers=n_layers, n_heads=n_heads,
))  # fmt: skip
reference = copy.deepcopy(policy).requires_grad_(False)  # the KL anchor: the initial policy
opt = torch.optim.Adam(policy.parameters(), lr=lr)


def rollout():
    """A batch of episodes: tokens [B, P + R], prompt length P, action mask [B, R], reward [B]."""
    strings = torch.randint(0, symbols, (batch, length), generator=gen)
    first = strings[:, :half]
    prompt = torch.cat([torch.full((batch, 1), BOS), first, torch.full((batch, 1), SEP)], dim=1)
    seq = sample(policy, prompt, half, temperature=temperature, generator=gen)
    actions, targets, mask = seq[:, -half:], first.flip(1), torch.ones(batch, half)
    if multi_turn:  # the tool answers with the rest of the string, then the second turn
        second = strings[:, half:]
        tool = torch.cat([torch.full((batch, 1), OBS), second, torch.full((batch, 1), SEP)], 1)
        seq = sample(policy, torch.cat([seq, tool], 1), half, temperature=temperature,
                     generator=gen)
        actions = torch.cat([actions, seq[:, -half:]], dim=1)
        targets = torch.cat([targets, second.flip(1)], dim=1)
        mask = torch.cat([mask, torch.zeros(batch, tool.shape[1]), torch.ones(batch, half)], 1)
    return seq, prompt.shape[1], mask, (actions == targets).float().mean(dim=1)


def evaluate(model, seq, p):
    """Log-probs, entropy and values of the response tokens ``seq[:, p:]``, each [B, R]."""
    hidden = model.trunk(seq[:, :-1])[:, p - 1 :]  # position t predicts token t + 1
    logp, entropy = rlops.logprobs_and_entropy(model.logits(hidden), seq[:, p:],
                                               temperature=temperature)
    return logp, entropy, model.values(hidden)


start, curve = time.perf_counter(), []
for it in range(iterations):
    seq, p, mask, score = rollout()
    with torch.no_grad():
        old_logp, _, old_values = evaluate(policy, seq, p)
        ref_logp, _, _ = evaluate(reference, seq, p)
        kl = rlops.kl_penalty(old_logp, ref_logp, "k1")
        rewards = -kl_coef * kl * mask
        rewards[:, -1] += score  # the outcome on the last token (always an action)
        adv, returns = rlops.gae(rewards, old_values, gamma=gamma, lam=lam, mask=mask)
        adv = rlops.masked_whiten(adv, mask)
    for _ in range(epochs):
        logp, entropy, values = evaluate(policy, seq, p)
        pg, pg_metrics = rlops.policy_loss(logp, old_logp, adv, mask, clip_low=clip)
        vf, _ = rlops.value_loss(values, old_values, returns, mask, clip=clip)
        ent = rlops.masked_mean(entropy, mask)
        loss = pg + value_coef * vf - entropy_coef * ent
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
    curve.append(float(score.mean()))
    if it % log_every == 0 or it == iterations - 1:
        print(f"iteration {it:4d}: reward {curve[-1]:.3f}  KL {rlops.masked_mean(kl, mask):.4f}"
              f"  entropy {ent:.3f}  clipped {pg_metrics['pg_clipfrac']:.1%}")

n = max(1, min(10, len(curve) // 4))
print(f"mean reward {sum(curve[:n]) / n:.3f} -> {sum(curve[-n:]) / n:.3f} (first / last {n} "
      f"iterations; chance {1 / (symbols + 3):.3f}) in {time.perf_counter() - start:.1f} s")
