"""Advantage and return estimators on the discounted reverse scan.

All take ``[B, T]`` tensors and share the semantics of ``mask`` and ``dones``:

* ``mask`` (1 = action token): tokens with mask 0 (prompt padding, tool output, observations)
  are *skipped*, not treated as a reset. On every action token the result equals the
  estimator run on the row's compacted, action-only sequence; outputs are 0 on mask-0 tokens
  and rewards placed on mask-0 tokens are ignored. Right padding is simply mask 0.
* ``dones`` (``dones[t] = True``: token t ends its sequence): nothing flows from t+1 into t
  or earlier, for packed rows holding several sequences. A done on a mask-0 token cuts too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlops._checks import (
    as_float_tensor,
    check_chunk_size,
    check_indicator,
    check_same_device,
    check_unit_interval,
    compute_dtype,
    shape_error,
)
from rlops.advantages_reference import gae_reference
from rlops.scan import compiled, resolve_method, scan

__all__ = ["discounted_returns", "gae", "reinforce_plus_plus_returns"]


def _rewards(name: str, x: object) -> torch.Tensor:
    x = as_float_tensor(name, x)
    if x.dim() != 2:
        raise shape_error(name, "[B, T]", x.shape)
    return x


def _per_row(name: str, value: float | torch.Tensor, b: int, ref: torch.Tensor):
    """A discount given as a float or a ``[B]`` tensor -> float, or ``[B, 1]`` tensor."""
    check_unit_interval(name, value)
    if not isinstance(value, torch.Tensor):
        return float(value)
    check_same_device("rewards", ref, **{name: value})
    if value.dim() == 0:
        return value.reshape(1, 1).expand(b, 1)
    if tuple(value.shape) not in ((b,), (b, 1)):
        raise shape_error(name, f"[B] = [{b}] (one per row), or a float", value.shape)
    return value.reshape(b, 1)


def _indicators(shape, ref, mask, dones):
    check_indicator("mask", mask, shape)
    check_indicator("dones", dones, shape)
    check_same_device("rewards", ref, mask=mask, dones=dones)
    mask = None if mask is None else mask.bool()
    dones = None if dones is None else dones.bool()
    return mask, dones


def _as_rows(value: float | torch.Tensor, b: int, dtype, device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.reshape(b).to(dtype)
    return torch.full((b,), value, dtype=dtype, device=device)


def _next_action_value(values, mask, dones, method, chunk_size):
    """``V`` at the next action token of the same sequence (0 past the last one)."""
    keep = None if dones is None else ~dones
    if mask is None:
        nxt = F.pad(values[:, 1:], (0, 1))
    else:
        # z[t] = V at the first action token at or after t (a pass-through scan: exact)
        pass_through = ~mask if keep is None else ~mask & keep
        z = scan(torch.where(mask, values, 0.0), pass_through.to(values.dtype), method, chunk_size)
        nxt = F.pad(z[:, 1:], (0, 1))
    return nxt if keep is None else torch.where(keep, nxt, 0.0)


def _token_decay(discount, mask, dones, like: torch.Tensor):
    """Per-token decay: ``discount`` on action tokens, 1 (pass through) on the others,
    0 where a sequence ends; a float or ``[B, 1]`` when neither mask nor dones is given."""
    if mask is None and dones is None:
        return discount
    a = torch.as_tensor(discount, dtype=like.dtype, device=like.device).expand_as(like)
    if mask is not None:
        a = torch.where(mask, a, 1.0)
    if dones is not None:
        a = torch.where(dones, 0.0, a)
    return a


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    *,
    gamma: float | torch.Tensor,
    lam: float | torch.Tensor,
    mask: torch.Tensor | None = None,
    dones: torch.Tensor | None = None,
    method: str = "auto",
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al., 2016, https://arxiv.org/abs/1506.02438).

        delta[t] = r[t] + gamma * V[next(t)] - V[t]
        A[t]     = delta[t] + gamma * lam * A[next(t)]
        returns  = V + A

    where ``next(t)`` is the next action token of the same sequence; past the last one
    ``V = 0`` and ``A = 0`` (no bootstrap). Without ``mask`` and ``dones``, ``next(t) = t+1``.

    Args:
        rewards: ``[B, T]`` per-token rewards (floating). Rewards on mask-0 tokens are ignored.
        values: ``[B, T]`` value estimates.
        gamma, lam: floats in [0, 1], or per-row tensors ``[B]`` (e.g. length-adaptive lambda).
        mask: optional ``[B, T]`` bool or 0/1, 1 = action token; mask-0 tokens are skipped,
            not reset (see the module docstring).
        dones: optional ``[B, T]`` bool or 0/1; ``dones[t]`` ends a sequence at token t.
        method: ``"auto"``, ``"reference"``, ``"chunked"`` or ``"compiled"``.
        chunk_size: chunk length for ``"chunked"``.

    Returns:
        ``(advantages, returns)``, both ``[B, T]`` in the promoted dtype of ``rewards`` and
        ``values``, 0 on mask-0 tokens. Half-precision inputs are accumulated in float32.

    Example:
        >>> import torch, rlops
        >>> r = torch.tensor([[0.0, 0.0, 1.0]])
        >>> v = torch.tensor([[0.5, 0.5, 0.5]])
        >>> adv, ret = rlops.gae(r, v, gamma=1.0, lam=1.0)
        >>> adv
        tensor([[0.5000, 0.5000, 0.5000]])
        >>> m = torch.tensor([[1, 0, 1]])  # token 1 is a tool output: skipped, not a reset
        >>> rlops.gae(r, v, gamma=0.5, lam=1.0, mask=m)[0]
        tensor([[0.0000, 0.0000, 0.5000]])
    """
    rewards = _rewards("rewards", rewards)
    values = as_float_tensor("values", values)
    if values.shape != rewards.shape:
        raise shape_error("values", f"[B, T] like rewards {list(rewards.shape)}", values.shape)
    check_same_device("rewards", rewards, values=values)
    check_chunk_size(chunk_size)
    b = rewards.shape[0]
    gamma_ = _per_row("gamma", gamma, b, rewards)
    lam_ = _per_row("lam", lam, b, rewards)
    mask, dones = _indicators(rewards.shape, rewards, mask, dones)
    method = resolve_method(method, rewards, values)

    out_dtype = torch.promote_types(rewards.dtype, values.dtype)
    dtype = compute_dtype(out_dtype)
    r, v = rewards.to(dtype), values.to(dtype)
    gl = gamma_ * lam_
    if method in ("reference", "compiled"):
        g_rows = _as_rows(gamma_, b, dtype, r.device)
        gl_rows = _as_rows(gl, b, dtype, r.device)
        run = gae_reference if method == "reference" else compiled.gae_compiled
        adv, ret = run(r, v, mask, dones, g_rows, gl_rows)
        return adv.to(out_dtype), ret.to(out_dtype)

    if isinstance(gamma_, torch.Tensor):
        gamma_ = gamma_.to(dtype)
    if isinstance(gl, torch.Tensor):
        gl = gl.to(dtype)
    nxt = _next_action_value(v, mask, dones, method, chunk_size)
    delta = r + gamma_ * nxt - v
    if mask is not None:
        delta = torch.where(mask, delta, 0.0)
    adv = scan(delta, _token_decay(gl, mask, dones, r), method, chunk_size)
    ret = v + adv
    if mask is not None:
        adv = torch.where(mask, adv, 0.0)
        ret = torch.where(mask, ret, 0.0)
    return adv.to(out_dtype), ret.to(out_dtype)


def discounted_returns(
    rewards: torch.Tensor,
    *,
    gamma: float | torch.Tensor,
    mask: torch.Tensor | None = None,
    dones: torch.Tensor | None = None,
    method: str = "auto",
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Discounted returns (reward-to-go) over action tokens.

        G[t] = r[t] + gamma * G[next(t)]

    with ``next(t)`` the next action token of the same sequence (``G = 0`` past the last).
    ``mask`` and ``dones`` as in :func:`gae`: mask-0 tokens are skipped (their rewards ignored,
    output 0), a done ends a sequence.

    Args:
        rewards: ``[B, T]`` floating.
        gamma: a float in [0, 1] or a per-row tensor ``[B]``.
        mask, dones: optional ``[B, T]`` bool or 0/1.
        method: ``"auto"``, ``"reference"``, ``"chunked"`` or ``"compiled"``.
        chunk_size: chunk length for ``"chunked"``.

    Returns:
        ``[B, T]`` returns in the dtype of ``rewards``.

    Example:
        >>> import torch, rlops
        >>> r = torch.tensor([[1.0, 5.0, 1.0]])
        >>> rlops.discounted_returns(r, gamma=0.5, mask=torch.tensor([[1, 0, 1]]))
        tensor([[1.5000, 0.0000, 1.0000]])
    """
    rewards = _rewards("rewards", rewards)
    check_chunk_size(chunk_size)
    b = rewards.shape[0]
    gamma_ = _per_row("gamma", gamma, b, rewards)
    mask, dones = _indicators(rewards.shape, rewards, mask, dones)
    method = resolve_method(method, rewards)
    dtype = compute_dtype(rewards.dtype)
    r = rewards.to(dtype)
    if method in ("reference", "compiled"):
        g_rows = _as_rows(gamma_, b, dtype, r.device)
        run = gae_reference if method == "reference" else compiled.gae_compiled
        return run(r, None, mask, dones, g_rows, g_rows)[1].to(rewards.dtype)
    if isinstance(gamma_, torch.Tensor):
        gamma_ = gamma_.to(dtype)
    x = r if mask is None else torch.where(mask, r, 0.0)
    out = scan(x, _token_decay(gamma_, mask, dones, r), method, chunk_size)
    if mask is not None:
        out = torch.where(mask, out, 0.0)
    return out.to(rewards.dtype)


def reinforce_plus_plus_returns(
    rewards: torch.Tensor,
    kl: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_coef: float,
    gamma: float | torch.Tensor,
    method: str = "auto",
) -> torch.Tensor:
    """REINFORCE++ token returns (Hu, 2025, https://arxiv.org/abs/2501.03262).

    The token reward is ``-kl_coef * kl[t]`` on action tokens, plus the outcome score
    ``rewards[b]`` on the row's last action token; the returns are the discounted returns of
    that reward over action tokens, with mask-0 tokens (tool output, observations) *skipped*:
    the outcome reaches every earlier action, discounted once per action step.

    Args:
        rewards: ``[B]`` outcome scores (floating).
        kl: ``[B, T]`` per-token KL estimates (e.g. from :func:`rlops.kl_penalty`).
        mask: ``[B, T]`` bool or 0/1, 1 = action token. A row with no action token gives 0s.
        kl_coef: the KL coefficient (>= 0).
        gamma: a float in [0, 1] or a per-row tensor ``[B]``.
        method: as in :func:`discounted_returns`.

    Returns:
        ``[B, T]`` returns in the promoted dtype of ``rewards`` and ``kl``, 0 on mask-0 tokens.

    Example:
        >>> import torch, rlops
        >>> kl = torch.zeros(1, 4)
        >>> m = torch.tensor([[1, 0, 1, 0]])
        >>> rlops.reinforce_plus_plus_returns(torch.tensor([1.0]), kl, m, kl_coef=0.1, gamma=0.5)
        tensor([[0.5000, 0.0000, 1.0000, 0.0000]])
    """
    kl = _rewards("kl", kl)
    rewards = as_float_tensor("rewards", rewards)
    b, t_len = kl.shape
    if tuple(rewards.shape) != (b,):
        raise shape_error("rewards", f"[B] = [{b}] (one outcome score per row)", rewards.shape)
    check_same_device("kl", kl, rewards=rewards)
    if mask is None:
        raise TypeError("mask must be a [B, T] tensor (1 = action token), got None")
    mask, _ = _indicators(kl.shape, kl, mask, None)
    if isinstance(kl_coef, bool) or not isinstance(kl_coef, (int, float)) or not kl_coef >= 0:
        raise ValueError(f"kl_coef must be a float >= 0, got {kl_coef!r}")
    dtype = torch.promote_types(rewards.dtype, kl.dtype)
    token_rewards = torch.where(mask, -kl_coef * kl.to(dtype), 0.0)
    if t_len > 0:
        # the last action token of each row: T-1 - (first action index in the flipped row)
        last = (t_len - 1) - mask.flip(-1).to(torch.uint8).argmax(-1, keepdim=True)
        outcome = torch.where(mask.any(-1), rewards.to(dtype), 0.0).unsqueeze(-1)
        token_rewards = token_rewards.scatter_add(1, last, outcome)
    return discounted_returns(token_rewards, gamma=gamma, mask=mask, method=method)
