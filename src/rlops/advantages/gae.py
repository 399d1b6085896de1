"""GAE and discounted returns on the discounted reverse scan.

Both take ``[B, T]`` tensors and share the semantics of ``mask`` and ``dones``
(:mod:`rlops.advantages.masking`):

* ``mask`` (1 = action token): tokens with mask 0 (prompt padding, tool output, observations)
  are *skipped*, not treated as a reset. On every action token the result equals the
  estimator run on the row's compacted, action-only sequence; outputs are 0 on mask-0 tokens
  and rewards placed on mask-0 tokens are ignored. Right padding is simply mask 0.
* ``dones`` (``dones[t] = True``: token t ends its sequence): nothing flows from t+1 into t
  or earlier, for packed rows holding several sequences; not even NaN or inf. A done on a
  mask-0 token cuts too.

Methods: ``"reference"`` (:mod:`rlops.advantages.reference`, the loop), ``"compiled"``
(:mod:`rlops.advantages.compiled`, fused numba kernels), ``"chunked"`` (scans built from
:mod:`rlops.advantages.masking`), and with ``cp_group=`` the carry-only forms of
:mod:`rlops.advantages.context_parallel`.
"""

from __future__ import annotations

import torch

from rlops._checks import (
    as_float_tensor,
    check_2d,
    check_chunk_size,
    check_indicator,
    check_same_device,
    compute_dtype,
    per_row_discount,
    shape_error,
)
from rlops.advantages import compiled
from rlops.advantages.masking import as_rows, next_action_value, td_residual, token_decay
from rlops.advantages.reference import gae_reference
from rlops.scan import resolve_method, scan

__all__ = ["discounted_returns", "gae"]


def indicators(shape, ref, mask, dones):
    """Check the optional ``mask`` and ``dones`` of ``rewards`` ``ref``; return them as bool."""
    check_indicator("mask", mask, shape)
    check_indicator("dones", dones, shape)
    check_same_device("rewards", ref, mask=mask, dones=dones)
    mask = None if mask is None else mask.bool()
    dones = None if dones is None else dones.bool()
    return mask, dones


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
    cp_group: object | None = None,
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
        cp_group: a context-parallel process group: all inputs are then this rank's zigzag
            shards ``[B, T_local]`` (:func:`rlops.distributed.zigzag_shard`) and so are the
            outputs; one ``all_gather`` of five numbers per chunk and row, independent of T.

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
    rewards = check_2d("rewards", rewards)
    values = as_float_tensor("values", values)
    if values.shape != rewards.shape:
        raise shape_error("values", f"[B, T] like rewards {list(rewards.shape)}", values.shape)
    check_same_device("rewards", rewards, values=values)
    check_chunk_size(chunk_size)
    b = rewards.shape[0]
    gamma_ = per_row_discount("gamma", gamma, b, rewards)
    lam_ = per_row_discount("lam", lam, b, rewards)
    mask, dones = indicators(rewards.shape, rewards, mask, dones)
    method = resolve_method(method, rewards, values, gamma_, lam_)

    out_dtype = torch.promote_types(rewards.dtype, values.dtype)
    dtype = compute_dtype(out_dtype)
    r, v = rewards.to(dtype), values.to(dtype)
    gl = gamma_ * lam_
    if cp_group is not None:
        from rlops.advantages.context_parallel import cp_gae

        g_rows = as_rows(gamma_, b, dtype, r.device)
        gl_rows = as_rows(gl, b, dtype, r.device)
        adv, ret = cp_gae(r, v, mask, dones, g_rows, gl_rows, cp_group, method, chunk_size)
        return adv.to(out_dtype), ret.to(out_dtype)
    if method == "compiled" and compiled.has_zero(gamma_, gl):
        method = "chunked"  # a zero discount is an exact cut there; the kernels multiply
    if method in ("reference", "compiled"):
        rows_dtype = dtype if method == "reference" else torch.float64  # see gae_compiled
        g_rows = as_rows(gamma_, b, rows_dtype, r.device)
        gl_rows = as_rows(gl, b, rows_dtype, r.device)
        run = gae_reference if method == "reference" else compiled.gae_compiled
        adv, ret = run(r, v, mask, dones, g_rows, gl_rows)
        return adv.to(out_dtype), ret.to(out_dtype)

    if isinstance(gamma_, torch.Tensor):
        gamma_ = gamma_.to(dtype)
    if isinstance(gl, torch.Tensor):
        gl = gl.to(dtype)
    nxt = next_action_value(v, mask, dones, method, chunk_size)
    delta = td_residual(r, v, nxt, gamma_, mask)
    adv = scan(delta, token_decay(gl, mask, dones, r), method, chunk_size)
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
    cp_group: object | None = None,
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
        cp_group: a context-parallel process group; inputs and output are this rank's zigzag
            shards, as in :func:`gae`.

    Returns:
        ``[B, T]`` returns in the dtype of ``rewards``.

    Example:
        >>> import torch, rlops
        >>> r = torch.tensor([[1.0, 5.0, 1.0]])
        >>> rlops.discounted_returns(r, gamma=0.5, mask=torch.tensor([[1, 0, 1]]))
        tensor([[1.5000, 0.0000, 1.0000]])
    """
    rewards = check_2d("rewards", rewards)
    check_chunk_size(chunk_size)
    b = rewards.shape[0]
    gamma_ = per_row_discount("gamma", gamma, b, rewards)
    mask, dones = indicators(rewards.shape, rewards, mask, dones)
    method = resolve_method(method, rewards, gamma_)
    dtype = compute_dtype(rewards.dtype)
    r = rewards.to(dtype)
    if method == "compiled" and compiled.has_zero(gamma_):
        method = "chunked"  # a zero discount is an exact cut there; the kernels multiply
    if cp_group is None and method in ("reference", "compiled"):
        g_rows = as_rows(gamma_, b, dtype if method == "reference" else torch.float64, r.device)
        run = gae_reference if method == "reference" else compiled.gae_compiled
        return run(r, None, mask, dones, g_rows, g_rows)[1].to(rewards.dtype)
    if isinstance(gamma_, torch.Tensor):
        gamma_ = gamma_.to(dtype)
    x = r if mask is None else torch.where(mask, r, 0.0)
    decay = token_decay(gamma_, mask, dones, r)
    if cp_group is not None:
        from rlops.advantages.context_parallel import cp_scan

        out = cp_scan(x, decay, cp_group, method, chunk_size, params=(gamma_, None))
    else:
        out = scan(x, decay, method, chunk_size)
    if mask is not None:
        out = torch.where(mask, out, 0.0)
    return out.to(rewards.dtype)
