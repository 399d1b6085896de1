"""Fused single-pass CPU kernels for GAE, discounted returns and REINFORCE++ returns (numba,
the ``fast`` extra; the kernels are in :mod:`rlops.scan.tiles`).
"""

from __future__ import annotations

import torch

from rlops.advantages._masking import GaeInputs
from rlops.scan.compiled import as_array, bits, output, run_rows

__all__ = ["gae_compiled", "reinforce_returns_compiled"]


def gae_compiled(x: GaeInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused GAE in one pass (with ``values=None``, discounted returns), from a call in
    float32/64 or bfloat16 (read and written as it is, computed in float32; CPU) with float64
    discounts: the carry decays by ``gamma_lam`` in float64, ``gamma`` enters the TD residual
    in the arithmetic dtype. Returns ``(advantages, returns)`` in the call's dtype.
    """
    from rlops.scan import tiles

    rewards, values, mask, dones, cut = x.rewards.contiguous(), x.values, x.mask, x.dones, x.cut
    values = None if values is None else values.contiguous()
    wide = torch.float32 if rewards.dtype == torch.bfloat16 else rewards.dtype
    gamma, gamma_lam = x.rows()
    n, t_len = rewards.shape
    ret = output(rewards)
    adv = ret if values is None else output(rewards)
    if n == 0 or t_len == 0:
        return adv, ret
    init = rewards.new_zeros(n, dtype=wide) if x.end is None else x.end.to(wide).contiguous()
    run_rows(
        tiles.gae,
        n,
        rewards.numel(),
        bits(rewards),
        None if values is None else bits(values),
        as_array(mask, torch.bool),
        as_array(dones, torch.bool),
        as_array(cut if dones is not None else None, wide),
        init.numpy(),
        gamma.expand(n).to(wide).contiguous().numpy(),
        gamma_lam.expand(n).to(torch.float64).contiguous().numpy(),
        None if values is None else bits(adv),
        bits(ret),
        lanes=tiles.WIDTH,
    )
    return adv, ret


def reinforce_returns_compiled(
    kl: torch.Tensor,
    outcome: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    gamma: torch.Tensor,
) -> torch.Tensor:
    """REINFORCE++ returns in one pass from ``kl`` ``[N, T]`` (float32/64, or bfloat16 computed
    in float32, CPU), ``outcome`` ``[N]``, ``mask`` bool and ``gamma`` ``[N]`` float64 with no
    zero; the token reward is rounded in ``kl``'s dtype (in bfloat16 also once more with the
    outcome added), as :func:`rlops.reinforce_plus_plus_returns` builds it.
    """
    from rlops.scan import tiles

    kl = kl.contiguous()
    n, t_len = kl.shape
    ret = output(kl)
    if n == 0 or t_len == 0:
        return ret
    wide = torch.float32 if kl.dtype == torch.bfloat16 else kl.dtype
    run_rows(
        tiles.reinforce,
        n,
        kl.numel(),
        bits(kl),
        outcome.to(kl.dtype).to(wide).contiguous().numpy(),  # the outcome as rounded in kl's dtype
        torch.tensor([-kl_coef], dtype=wide).numpy(),
        as_array(mask, torch.bool),
        gamma.expand(n).to(torch.float64).contiguous().numpy(),
        bits(ret),
        lanes=tiles.WIDTH,
    )
    return ret
