"""Outcome-reward estimators with a baseline from a group of samples (or a greedy rollout):
GRPO / Dr.GRPO, RLOO, REINFORCE++-baseline, ReMax, OPO, GPG, GRPO pass@k, GDPO, the optimal
token baseline and MaxRL, with verl's conventions (``compute_*_outcome_advantage``; edge cases in
docs/reference/group.md): group statistics over every sample of the group, unbiased std, a
group of one with mean 0 and std 1; ``(advantages, returns)`` ``[B, T]`` in the dtype of the
scores, 0 on mask-0 tokens. Groups are found with one sort, reduced with ``index_add``: no
loop, no host read. Group ids from strings: ``numpy.unique(uids, return_inverse=True)[1]``.
"""

from __future__ import annotations

import torch

from rlops._checks import (
    as_bool_mask,
    as_float_tensor,
    as_real_vector,
    check_bool,
    check_ids,
    check_matrix,
    check_nonneg,
    check_per_row,
    check_positive,
    check_same_device,
    compute_dtype,
    shape_error,
    values_checked,
)
from rlops.stats import weighted_moments

__all__ = [
    "gdpo_advantages",
    "gpg_advantages",
    "grpo_advantages",
    "grpo_passk_advantages",
    "maxrl_advantages",
    "opo_advantages",
    "optimal_token_baseline_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "remax_advantages",
    "rloo_advantages",
]


def _dense_group_ids(index: torch.Tensor) -> torch.Tensor:
    """Map any integer ids ``[B]`` to dense ids in ``[0, B)``: sort, mark run starts, cumsum."""
    sorted_ids, order = torch.sort(index)
    starts = torch.ones_like(sorted_ids, dtype=torch.long)
    starts[1:] = (sorted_ids[1:] != sorted_ids[:-1]).long()
    dense = torch.empty_like(starts)
    dense[order] = starts.cumsum(0) - 1
    return dense


def _wide_dtype(device: torch.device) -> torch.dtype:
    """The dtype of the ``[B]`` group statistics: float64 (float32 on MPS, which lacks it)."""
    return torch.float64 if device.type != "mps" else torch.float32


def _group_sum(x: torch.Tensor, gid: torch.Tensor) -> torch.Tensor:
    """Per sample: the sum of ``x`` over its group (``gid`` from ``_dense_group_ids``)."""
    return torch.zeros_like(x).index_add(0, gid, x)[gid]


def _group_max(x: torch.Tensor, gid: torch.Tensor) -> torch.Tensor:
    """Per sample: the largest ``x`` of its group."""
    return torch.zeros_like(x).scatter_reduce(0, gid, x, "amax", include_self=False)[gid]


def _power_of_two_at_or_below(x: torch.Tensor) -> torch.Tensor:
    """``2^k <= x < 2^(k+1)`` for finite ``x >= 0``, read off the exponent bits (exact; no
    ``frexp``, which Inductor's CPU code does not vectorise correctly).
    """
    itype, mantissa = (torch.int64, 52) if x.dtype == torch.float64 else (torch.int32, 23)
    exponent = (x.view(itype) >> mantissa).clamp_min(1)
    return (exponent << mantissa).view(x.dtype)


def _group_moments(
    s: torch.Tensor, gid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sample: ``(n, s − mean, std)`` of its group, in float64 (unbiased std; deviations
    exactly 0 for equal scores; scaled by a power of two before squaring, so nothing overflows).
    """
    x = s.to(_wide_dtype(s.device))
    n = _group_sum(torch.ones_like(x), gid)
    lo = -_group_max(-x, gid)
    hi = _group_max(x, gid)
    mean = _group_sum(x, gid) / n
    centred = torch.where(hi == lo, 0.0, x - mean)
    big = _group_max(centred.abs(), gid)
    big = _power_of_two_at_or_below(big)
    m2_unit = _group_sum((centred / big).square(), gid)
    std = big * torch.sqrt(m2_unit / (n - 1).clamp_min(1))
    return n, centred, std


def _prepare(scores: object, index: object, mask: object) -> torch.Tensor:
    """Validate the three arguments; return the ``[B]`` scores in the computation dtype."""
    scores = as_float_tensor("scores", scores)
    b, t = check_matrix("mask", mask)
    per_token = check_per_row("scores", scores, b, t) == 2
    as_bool_mask("mask", mask, (b, t), "[B, T]")
    check_ids("index", index, (b,), "scores")
    check_same_device("scores", scores, index=index, mask=mask)
    s = scores.to(compute_dtype(scores.dtype))
    return s.sum(-1) if per_token else s


def _standardized(s: torch.Tensor, gid: torch.Tensor, norm_std: bool, eps: float) -> torch.Tensor:
    """GRPO's ``(s − μ) / (σ + eps)`` (``s − μ`` without ``norm_std``) per sample, a group of
    one with ``μ = 0, σ = 1``.
    """
    n, centred, std = _group_moments(s, gid)
    alone = n == 1
    a = torch.where(alone, s.to(centred.dtype), centred)
    if norm_std:
        den = torch.where(alone, 1, std) + eps
        a = a / torch.where(den > 0, den, 1)  # den = 0 only for equal scores and eps = 0: a = 0
    return a


def _broadcast(a: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a[b]`` on the action tokens of row ``b``, 0 elsewhere: one pass over ``[B, T]``."""
    a = a.to(dtype)
    if mask.dtype == torch.bool:  # a select; multiplying by a bool tensor is a slow mixed-dtype op
        return torch.where(mask, a[:, None], 0)
    return (a[:, None] * mask).to(dtype)


def grpo_advantages(
    scores: torch.Tensor,
    index: torch.Tensor,
    mask: torch.Tensor,
    *,
    norm_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantages: each score standardised within its group.

        A_i = (s_i − μ_g) / (σ_g + eps)      (norm_std=True, GRPO)
        A_i =  s_i − μ_g                     (norm_std=False, Dr.GRPO)

    GRPO: https://arxiv.org/abs/2402.03300 — Dr.GRPO: https://arxiv.org/abs/2503.20783

    Args:
        scores: ``[B]`` outcome scores (or ``[B, T]`` token rewards, summed over ``T``).
        index: ``[B]`` integer group id per sample.
        mask: ``[B, T]`` 0/1 action mask.
        norm_std: divide by the group std (GRPO) or not (Dr.GRPO).
        eps: ``>= 0``, added to the std (a group of equal scores gives exactly 0).

    Returns:
        ``(advantages, returns)``, the same ``[B, T]`` tensor.

    Example:
        >>> import torch
        >>> adv, _ = grpo_advantages(torch.tensor([1.0, 0.0, 0.5, 2.0]),
        ...                          torch.tensor([7, 7, 3, 3]), torch.ones(4, 2))
        >>> adv[:, 0]
        tensor([ 0.7071, -0.7071, -0.7071,  0.7071])
    """
    eps = check_nonneg("eps", eps)
    s = _prepare(scores, index, mask)
    adv = _broadcast(_standardized(s, _dense_group_ids(index), norm_std, eps), mask, scores.dtype)
    return adv, adv


def rloo_advantages(
    scores: torch.Tensor, index: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: each score minus the mean of the other samples of its group
    (https://arxiv.org/abs/2402.14740).

        A_i = s_i − (Σ_{j≠i} s_j)/(n − 1) = n/(n − 1)·(s_i − μ_g)      (a group of one: s_i)

    Args:
        scores: ``[B]`` outcome scores (or ``[B, T]`` token rewards, summed over ``T``).
        index: ``[B]`` integer group id per sample.
        mask: ``[B, T]`` 0/1 action mask.

    Returns:
        ``(advantages, returns)``, the same ``[B, T]`` tensor.

    Example:
        >>> import torch
        >>> adv, _ = rloo_advantages(torch.tensor([1.0, 0.0, 2.0, 5.0]),
        ...                          torch.tensor([0, 0, 0, 9]), torch.ones(4, 1))
        >>> adv[:, 0]
        tensor([ 0.0000, -1.5000,  1.5000,  5.0000])
    """
    s = _prepare(scores, index, mask)
    n, centred, _ = _group_moments(s, _dense_group_ids(index))
    a = torch.where(n > 1, n / (n - 1).clamp_min(1) * centred, s.to(centred.dtype))
    adv = _broadcast(a, mask, scores.dtype)
    return adv, adv


def reinforce_plus_plus_baseline_advantages(
    scores: torch.Tensor,
    index: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: the group-centred score ``s_i − μ_g``, whitened over every action
    token of the batch (verl's ``masked_whiten``: mean and unbiased variance, a row weighing as
    many times as it has action tokens). https://arxiv.org/abs/2501.03262

    Args:
        scores: ``[B]`` outcome scores (or ``[B, T]`` token rewards, summed over ``T``).
        index: ``[B]`` integer group id per sample.
        mask: ``[B, T]`` 0/1 action mask.
        eps: ``>= 0``, added to the batch variance.

    Returns:
        ``(advantages, returns)``, the same ``[B, T]`` tensor.

    Example:
        >>> import torch
        >>> adv, _ = reinforce_plus_plus_baseline_advantages(
        ...     torch.tensor([1.0, 0.0, 3.0, 1.0]), torch.tensor([0, 0, 1, 1]), torch.ones(4, 1))
        >>> adv[:, 0]
        tensor([ 0.5477, -0.5477,  1.0954, -1.0954])
    """
    eps = check_nonneg("eps", eps)
    s = _prepare(scores, index, mask)
    n, centred, _ = _group_moments(s, _dense_group_ids(index))
    a = torch.where(n == 1, s.to(centred.dtype), centred)
    a = weighted_moments(a, mask.sum(-1).to(a.dtype)).standardize(a, eps)
    adv = _broadcast(a, mask, scores.dtype)
    return adv, adv


def remax_advantages(
    rewards: torch.Tensor, reward_baselines: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: the undiscounted reward-to-go over action tokens minus the greedy rollout's score,
    ``A_t = Σ_{t' ≥ t} m_{t'}·r_{t'} − b`` (https://arxiv.org/abs/2310.10505).

    Args:
        rewards: ``[B, T]`` token rewards, or ``[B]`` outcome rewards (``G_t = r``).
        reward_baselines: ``[B]`` score of the greedy (argmax) response per sample.
        mask: ``[B, T]`` 0/1 action mask.

    Returns:
        ``(advantages, returns)``, ``[B, T]`` each, 0 where ``mask`` is 0.

    Example:
        >>> import torch
        >>> adv, ret = remax_advantages(torch.tensor([[0.0, 1.0, 0.0, 2.0]]), torch.tensor([1.5]),
        ...                             torch.tensor([[1, 1, 0, 1]]))
        >>> ret, adv
        (tensor([[3., 3., 0., 2.]]), tensor([[1.5000, 1.5000, 0.0000, 0.5000]]))
    """
    as_float_tensor("rewards", rewards)
    as_float_tensor("reward_baselines", reward_baselines)
    b, t = check_matrix("mask", mask)
    keep = as_bool_mask("mask", mask, (b, t), "[B, T]")
    if tuple(reward_baselines.shape) != (b,):
        raise shape_error("reward_baselines", f"[B] = {[b]} like mask", reward_baselines.shape)
    per_token = check_per_row("rewards", rewards, b, t) == 2
    check_same_device("rewards", rewards, reward_baselines=reward_baselines, mask=mask)
    dtype = compute_dtype(rewards.dtype)
    if per_token:
        r = torch.where(keep, rewards.to(dtype), 0)
        ret = torch.where(keep, r.flip(-1).cumsum(-1).flip(-1), 0)
    else:
        ret = torch.where(keep, rewards.to(dtype)[:, None], 0)
    adv = torch.where(keep, ret - reward_baselines.to(dtype)[:, None], 0)
    return adv.to(rewards.dtype), ret.to(rewards.dtype)


def opo_advantages(
    scores: torch.Tensor, index: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO: each score minus its group's length-weighted mean score, ``L_i`` the action tokens
    of sample ``i`` (https://arxiv.org/abs/2505.23585).

        b_g = Σ_{i∈g} L_i·s_i / Σ_{i∈g} L_i,        A_i = s_i − b_g      (a group of one: b = 0)

    Args:
        scores: ``[B]`` outcome scores (or ``[B, T]`` token rewards, summed over ``T``).
        index: ``[B]`` integer group id per sample.
        mask: ``[B, T]`` 0/1 action mask; its row sums are the lengths ``L``.

    Returns:
        ``(advantages, returns)``, the same ``[B, T]`` tensor.

    Example:
        >>> import torch
        >>> mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]]).bool()
        >>> adv, _ = opo_advantages(torch.tensor([1.0, 0.0, 4.0]), torch.tensor([0, 0, 5]), mask)
        >>> adv  # b = (3·1 + 1·0)/4 = 0.75 for the first group; the second is alone
        tensor([[ 0.2500,  0.2500,  0.2500],
                [-0.7500,  0.0000,  0.0000],
                [ 4.0000,  4.0000,  0.0000]])
    """
    s = _prepare(scores, index, mask)
    gid = _dense_group_ids(index)
    n, centred, _ = _group_moments(s, gid)
    length = (mask != 0).sum(-1).to(centred.dtype)
    total = _group_sum(length, gid)
    w = length / torch.where(total > 0, total, 1)
    a = torch.where(n > 1, centred - _group_sum(w * centred, gid), s.to(centred.dtype))
    adv = _broadcast(a, mask, scores.dtype)
    return adv, adv


def gpg_advantages(
    scores: torch.Tensor,
    index: torch.Tensor,
    mask: torch.Tensor,
    *,
    f_norm: float = 1.0,
    alpha: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG: the group-centred score rescaled by the batch's share of samples with signal
    (https://arxiv.org/abs/2504.02546).

        A_i = α·(s_i − μ_g) / f_norm,        α = B / max(M, 1)

    with ``M`` the samples whose score is non-zero, as verl counts them (the paper counts those
    without gradient; α is computed on the device in float64).

    Args:
        scores: ``[B]`` outcome scores (or ``[B, T]`` token rewards, summed over ``T``).
        index: ``[B]`` integer group id per sample.
        mask: ``[B, T]`` 0/1 action mask.
        f_norm: ``> 0``, the divisor ``F_norm``.
        alpha: ``None`` for ``B / max(M, 1)`` (verl ignores its own ``alpha``), or a fixed ``> 0``.

    Returns:
        ``(advantages, returns)``, the same ``[B, T]`` tensor.

    Example:
        >>> import torch
        >>> adv, _ = gpg_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]),
        ...                         torch.tensor([0, 0, 1, 1]), torch.ones(4, 1))
        >>> adv[:, 0]  # one non-zero score in four: α = 4
        tensor([ 2., -2.,  0.,  0.])
    """
    f_norm = check_positive("f_norm", f_norm)
    if alpha is not None:
        alpha = check_positive("alpha", alpha)
    s = _prepare(scores, index, mask)
    n, centred, _ = _group_moments(s, _dense_group_ids(index))
    a = torch.where(n > 1, centred, s.to(centred.dtype))
    if alpha is None:
        valid = torch.count_nonzero(s).to(a.dtype).clamp_min(1)
        a = a * (s.shape[0] / valid)
    else:
        a = a * alpha
    adv = _broadcast(a / f_norm, mask, scores.dtype)
    return adv, adv


def grpo_passk_advantages(
    scores: torch.Tensor,
    index: torch.Tensor,
    mask: torch.Tensor,
    *,
    norm_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO for pass@k: only each group's best sample is credited, by its lead over the second
    best (counted with multiplicity: a tie for the top gives 0). https://arxiv.org/abs/2503.19595

        A_{i*} = (r_max − r_2) / (σ_g + eps)     (norm_std=False: r_max − r_2);  A_i = 0 otherwise

    Args:
        scores: ``[B]`` outcome scores (or ``[B, T]`` token rewards, summed over ``T``).
        index: ``[B]`` integer group id per sample; every group needs 2 samples (checked where
            values are read: CPU, or ``RLOPS_CHECK_VALUES=1``; else such a sample gets 0).
        mask: ``[B, T]`` 0/1 action mask.
        norm_std: divide by the group std (verl's ``norm_adv_by_std_in_grpo``).
        eps: ``>= 0``, added to the std.

    Returns:
        ``(advantages, returns)``, the same ``[B, T]`` tensor.

    Example:
        >>> import torch
        >>> adv, _ = grpo_passk_advantages(torch.tensor([0.0, 3.0, 1.0, 2.0, 2.0, 1.0]),
        ...                                torch.tensor([0, 0, 0, 1, 1, 1]), torch.ones(6, 1),
        ...                                norm_std=False)
        >>> adv[:, 0]  # group 0: 3 − 1 on its best sample; group 1: a tie for the top
        tensor([0., 2., 0., 0., 0., 0.])
    """
    eps = check_nonneg("eps", eps)
    s = _prepare(scores, index, mask)
    gid = _dense_group_ids(index)
    n, _, std = _group_moments(s, gid)
    if values_checked(n) and n.numel() > 0 and bool((n < 2).any()):
        raise ValueError("index: pass@k needs at least 2 samples in every group, got a group of 1")
    x = s.to(n.dtype)
    hi = _group_max(x, gid)
    top = x == hi
    lo = -_group_max(-x, gid)
    second = _group_max(torch.where(top, lo, x), gid)  # = lo when every score ties the top
    lead = torch.where(_group_sum(top.to(x.dtype), gid) == 1, hi - second, 0.0)
    a = torch.where(top & (n > 1), lead, 0.0)
    if norm_std:
        den = std + eps
        a = a / torch.where(den > 0, den, 1)  # den = 0 only for equal scores and eps = 0: a = 0
    adv = _broadcast(a, mask, scores.dtype)
    return adv, adv


def gdpo_advantages(
    scores: torch.Tensor,
    index: torch.Tensor,
    mask: torch.Tensor,
    *,
    weights: torch.Tensor | list[float] | None = None,
    norm_std: bool = True,
    eps: float = 1e-6,
    whiten_eps: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO: each reward component standardised in its group, weighted, summed, then whitened
    over the batch's action tokens (https://arxiv.org/abs/2601.05242).

        a_i = Σ_k w_k · (s_k,i − μ_k,g) / (σ_k,g + eps),     A = (a − mean) / sqrt(var + whiten_eps)

    Args:
        scores: ``[B, K]``, one column per reward component (``[B]``: one component).
        index: ``[B]`` integer group id per sample.
        mask: ``[B, T]`` 0/1 action mask.
        weights: ``[K]`` finite weights (verl's ``gdpo_reward_weights``); default all 1.
        norm_std: a bool: divide each component by its group std.
        eps: ``>= 0``, added to each group std.
        whiten_eps: ``>= 0``, added to the batch variance.

    Returns:
        ``(advantages, returns)``, the same ``[B, T]`` tensor.

    Example:
        >>> import torch
        >>> s = torch.tensor([[1.0, 10.0], [0.0, 0.0], [1.0, 5.0], [0.0, 5.0]])
        >>> adv, _ = gdpo_advantages(s, torch.tensor([0, 0, 1, 1]), torch.ones(4, 1))
        >>> adv[:, 0]   # a 10-point gap counts as much as a 1-point one; a tie counts 0
        tensor([ 1.0954, -1.0954,  0.5477, -0.5477])
    """
    eps = check_nonneg("eps", eps)
    whiten_eps = check_nonneg("whiten_eps", whiten_eps)
    norm_std = check_bool("norm_std", norm_std)
    scores = as_float_tensor("scores", scores)
    b, _ = check_matrix("mask", mask)
    cols = scores[:, None] if scores.dim() == 1 else scores
    if cols.dim() != 2 or cols.shape[0] != b:
        raise shape_error("scores", f"[B, K] with B = {b} like mask", scores.shape)
    k = cols.shape[1]
    if k == 0:
        raise shape_error("scores", "[B, K] with at least one reward column (K >= 1)", scores.shape)
    # the weights: Python numbers where they were given so (they enter the products as
    # numbers: no host-to-device copy per column), else the [K] tensor on the scores' device
    w: list[float] | torch.Tensor = [1.0] * k
    if weights is not None:
        w = as_real_vector("weights", weights, k, "scores")
        if isinstance(weights, torch.Tensor):
            check_same_device("scores", scores, weights=w)
        else:
            w = w.tolist()  # a CPU tensor made from the given numbers: no device involved
    gid = None
    total = None
    for j in range(k):  # a few reward components, never tokens or samples
        s = _prepare(cols[:, j], index, mask)
        gid = _dense_group_ids(index) if gid is None else gid
        a = _standardized(s, gid, norm_std, eps)
        wj = w[j]
        part = (wj.to(a.dtype) if isinstance(wj, torch.Tensor) else wj) * a
        total = part if total is None else total + part
    assert total is not None
    total = weighted_moments(total, mask.sum(-1).to(total.dtype)).standardize(total, whiten_eps)
    adv = _broadcast(total, mask, scores.dtype)
    return adv, adv


def optimal_token_baseline_advantages(
    rewards: torch.Tensor,
    index: torch.Tensor,
    mask: torch.Tensor,
    logp: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    *,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    eps: float = 1e-8,
    per_action_step: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The optimal token baseline (OTB, https://arxiv.org/abs/2602.07078): a baseline per
    position, weighted by the path's accumulated score-function norm; verl's
    ``compute_optimal_token_baseline_advantage`` and, with ``per_action_step``, its multi-turn form.

        w_t = (1 − 2π_t + Σπ²_t)·ρ_t²,   W_t = Σ_{j ≤ t} m_j·w_j,   G_t = Σ_{j ≥ t} m_j·r_j
        B_t = Σ_{i∈g} G_t^i·W_t^i·m_t^i / (Σ_{i∈g} W_t^i·m_t^i + eps),     A_t = G_t − B_t

    Args:
        rewards: ``[B, T]`` token rewards (or ``[B]``: the outcome on the last action token).
        index: ``[B]`` integer group id per sample.
        mask: ``[B, T]`` 0/1 action mask.
        logp: ``[B, T]`` log-probs ``log π_t`` of the sampled tokens.
        sum_pi_squared: ``[B, T]`` ``Σ_v π_v²`` per token (the log-prob ops' output).
        rollout_is_weights: ``[B, T]`` IS weights ρ, or None.
        handle_zero_tail: a group's unique longest sample gets ``B = 0`` past the second longest.
        eps: ``>= 0``, added to each denominator.
        per_action_step: positions by action-token index (TIR) instead of by column.

    Returns:
        ``(advantages, returns)``, ``[B, T]`` each (``returns = G``), 0 where ``mask`` is 0.

    Example:
        >>> import torch
        >>> r = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
        >>> adv, ret = optimal_token_baseline_advantages(
        ...     r, torch.tensor([0, 0]), torch.ones(2, 2), torch.zeros(2, 2) - 0.7,
        ...     torch.full((2, 2), 0.3))
        >>> adv   # equal weights: B_t is the group mean of G_t
        tensor([[ 0.5000,  0.5000],
                [-0.5000, -0.5000]])
    """
    eps = check_nonneg("eps", eps)
    handle_zero_tail = check_bool("handle_zero_tail", handle_zero_tail)
    per_action_step = check_bool("per_action_step", per_action_step)
    as_float_tensor("rewards", rewards)
    b, t = check_matrix("mask", mask)
    keep = as_bool_mask("mask", mask, (b, t), "[B, T]")
    check_ids("index", index, (b,), "rewards")
    per_token = check_per_row("rewards", rewards, b, t) == 2
    for name, x in (
        ("logp", logp),
        ("sum_pi_squared", sum_pi_squared),
        ("rollout_is_weights", rollout_is_weights),
    ):
        if x is not None and tuple(as_float_tensor(name, x).shape) != (b, t):
            raise shape_error(name, f"[B, T] = {[b, t]} like mask", x.shape)
    check_same_device(
        "rewards",
        rewards,
        index=index,
        mask=mask,
        logp=logp,
        sum_pi_squared=sum_pi_squared,
        rollout_is_weights=rollout_is_weights,
    )
    dtype = compute_dtype(rewards.dtype)
    wide = _wide_dtype(keep.device)
    if per_token:
        r = torch.where(keep, rewards.to(wide), 0)
    else:  # the outcome on the row's last action token
        last = torch.where(keep, torch.arange(t, device=keep.device), -1).amax(-1, keepdim=True)
        at_last = (torch.arange(t, device=keep.device) == last) & keep
        r = torch.where(at_last, rewards.to(wide)[:, None], 0)
    g_ret = r.flip(-1).cumsum(-1).flip(-1)
    w = 1 - 2 * torch.exp(logp.detach().to(wide)) + sum_pi_squared.detach().to(wide)
    if rollout_is_weights is not None:
        w = w * rollout_is_weights.detach().to(wide).square()
    big_w = torch.where(keep, w, 0).cumsum(-1)
    length = keep.sum(-1)
    if per_action_step:  # move the k-th action token of each row to column k
        step = torch.where(keep, keep.cumsum(-1) - 1, t)  # mask-0 tokens to a spare column
        comp = torch.zeros(b, t + 1, dtype=wide, device=keep.device)
        g_c = comp.scatter(1, step, g_ret)[:, :t]
        w_c = comp.scatter(1, step, big_w)[:, :t]
        live = torch.arange(t, device=keep.device) < length[:, None]
        counted = length > 0
    else:
        g_c, w_c, live, counted = g_ret, big_w, keep, torch.ones_like(length, dtype=torch.bool)
    gid = _dense_group_ids(index)
    wm = torch.where(live, w_c, 0)
    num = torch.zeros_like(wm).index_add_(0, gid, g_c * wm)[gid]
    den = torch.zeros_like(wm).index_add_(0, gid, wm)[gid] + eps
    base = num / torch.where(den != 0, den, 1)
    n = _group_sum(counted.to(wide), gid)
    base = torch.where((n > 1)[:, None], base, 0)
    if handle_zero_tail:
        lf = torch.where(counted, length.to(wide), -1.0)
        longest = _group_max(lf, gid)
        top = lf == longest
        unique = top & (_group_sum(top.to(wide), gid) == 1) & (n > 1)
        second = _group_max(torch.where(top, -1.0, lf), gid)
        tail = torch.arange(t, device=keep.device)[None, :] >= second[:, None]
        base = torch.where(unique[:, None] & tail, 0, base)
    adv_c = g_c - base
    if per_action_step:
        adv = adv_c.gather(1, step.clamp_max(t - 1))
    else:
        adv = adv_c
    adv = torch.where(keep, adv, 0).to(dtype)
    ret = torch.where(keep, g_ret, 0).to(dtype)
    return adv.to(rewards.dtype), ret.to(rewards.dtype)


def maxrl_advantages(
    scores: torch.Tensor,
    index: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MaxRL: the group-centred score divided by the group mean, not the std, for an unbiased
    gradient of a truncated maximum-likelihood objective (https://arxiv.org/abs/2602.02710).

        A_i = (s_i − μ_g) / (μ_g + eps)   where μ_g > 0,   0 where μ_g ≤ 0      (n_g ≥ 2)
        A_i = s_i                                                          (a group of one)

    For non-negative (canonically 0/1) scores. ``eps=0`` is prime-rl's ``MaxRLAlgorithm``,
    ``1e-6`` SkyRL's ``compute_maxrl_advantage``. Edges: a group of one keeps its score, as
    SkyRL and the paper (REINFORCE at ``n = 1``; prime-rl gives it 0); SkyRL divides also where
    ``μ_g < 0`` (only possible with negative scores), rlops and prime-rl give 0. Rows count
    as SkyRL counts them, each a member of its group whatever its mask; prime-rl leaves rows
    without an action token out of the group, which here is giving them ids of their own.

    Args:
        scores: ``[B]`` outcome scores (or ``[B, T]`` token rewards, summed over ``T``).
        index: ``[B]`` integer group id per sample.
        mask: ``[B, T]`` 0/1 action mask.
        eps: ``>= 0``, added to the group mean.

    Returns:
        ``(advantages, returns)``, the same ``[B, T]`` tensor.

    Example:
        >>> import torch
        >>> adv, _ = maxrl_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]),
        ...                           torch.tensor([0, 0, 0, 0, 1, 1, 2]), torch.ones(7, 1))
        >>> adv[:, 0]  # pass rate 1/4: ±(1 − 1/4)·4; no success: 0; alone: its score
        tensor([ 3., -1., -1., -1.,  0.,  0.,  1.])
    """
    eps = check_nonneg("eps", eps)
    s = _prepare(scores, index, mask)
    gid = _dense_group_ids(index)
    n, centred, _ = _group_moments(s, gid)
    x = s.to(centred.dtype)
    mean = _group_sum(x, gid) / n
    live = mean > 0
    a = centred / torch.where(live, mean + eps, 1)  # a safe divisor: no NaN in either branch
    a = torch.where(n > 1, torch.where(live, a, 0.0), x)
    adv = _broadcast(a, mask, scores.dtype)
    return adv, adv
