"""On-policy distillation as RL: the sampled token's ``−(log π_s − log π_t)`` as a reward, fed
to ``policy_loss``. In expectation over the student's own samples its policy gradient is the
gradient of the reverse KL (``distillation_loss(kind="reverse_kl")`` on the full teacher)."""

from __future__ import annotations

import torch

import rlops


def test_reward_policy_gradient_is_the_reverse_kl_gradient_in_expectation():
    """Every vocabulary id as the sampled token, weighted by the student's probability: the
    exact expectation of the REINFORCE gradient (γ = 0, ratio 1)."""
    g = torch.Generator().manual_seed(0)
    v = 13
    z = torch.randn(v, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(v, generator=g, dtype=torch.float64), -1)
    logits = z.expand(1, v, v)  # position t samples token t, from the same logits
    tokens = torch.arange(v).unsqueeze(0)
    mask = torch.ones(1, v, dtype=torch.bool)
    logp, _ = rlops.logprobs_and_entropy(logits, tokens, with_entropy=False)
    reward = -(logp.detach() - teacher[tokens])
    adv = rlops.discounted_returns(reward, gamma=0.0, mask=mask)
    loss_mat, _ = rlops.policy_loss(logp, logp.detach(), adv, mask, agg=None)
    weights = torch.softmax(z.detach(), -1).unsqueeze(0)  # the student's sampling probabilities
    (loss_mat * weights).sum().backward()
    pg = z.grad.clone()
    z.grad = None
    kl, _ = rlops.distillation_loss(z.unsqueeze(0), teacher.unsqueeze(0), kind="reverse_kl")
    kl.sum().backward()
    torch.testing.assert_close(pg, z.grad, rtol=1e-12, atol=1e-14)


def test_discounted_reward_is_the_return_to_go():
    """γ = 1: each token's advantage is the sum of the rewards from it to the end."""
    r = torch.tensor([[0.5, -1.0, 2.0, 0.25]], dtype=torch.float64)
    mask = torch.ones_like(r, dtype=torch.bool)
    adv = rlops.discounted_returns(r, gamma=1.0, mask=mask)
    torch.testing.assert_close(adv, torch.tensor([[1.75, 1.25, 2.25, 0.25]], dtype=torch.float64))
