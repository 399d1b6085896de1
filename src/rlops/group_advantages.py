"""Outcome-reward estimators with a baseline from a group of samples (or a greedy rollout).

GRPO, Dr.GRPO, GRPO pass@k, RLOO, OPO, GPG, GDPO, REINFORCE++-baseline and ReMax turn one
scalar score per response into a per-token advantage; the optimal token baseline (OTB) gives
each position its own group baseline. Responses to the same prompt share a group id
in ``index``: any integers, not necessarily contiguous or sorted. Groups are found with one
sort (no ``torch.unique``, whose output size forces a device synchronisation) and reduced with
``index_add``: no Python loop over samples or groups, no host read-back (except the check
that pass@k groups have two samples, which reads values only where ``_checks`` does).

Conventions (verl's, so results match ``compute_*_outcome_advantage`` there):

* ``scores`` may be ``[B]`` or token-level rewards ``[B, T]``, which are summed over ``T``.
* The group statistics use every sample of the group, also one whose row has no action token.
* The group std is the unbiased one (Bessel's correction, ``torch.std``'s default).
* A group of one sample has no baseline: its mean is taken as 0 (and its std as 1).
* Advantages are the per-sample value broadcast over ``T`` and 0 on mask-0 tokens; the
  estimators return ``(advantages, returns)`` and, as in verl, both are the same tensor.
* Half-precision scores are reduced in float32; outputs have the dtype of ``scores``.
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
    """``2^k <= x < 2^(k+1)`` for finite ``x >= 0`` (the smallest normal number for 0 and
    subnormals), read off the exponent bits: exact, and no ``frexp`` (which Inductor's CPU
    code generation does not vectorise correctly)."""
    itype, mantissa = (torch.int64, 52) if x.dtype == torch.float64 else (torch.int32, 23)
    exponent = (x.view(itype) >> mantissa).clamp_min(1)
    return (exponent << mantissa).view(x.dtype)


def _group_moments(
    s: torch.Tensor, gid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sample: ``(n, s − mean, std)`` of its group (unbiased std; 0 for a group of one).

    ``[B]`` numbers only, so they are computed in float64 whatever the scores' dtype: a plain
    two-pass mean and deviation, at least as accurate as a per-group loop in the scores'
    dtype. A group whose scores are all equal gets deviations of exactly 0. The deviations are
    divided by the power of two at or below the group's largest one before squaring, so no
    finite score overflows, and the scaling rounds nothing (a power of two).
    ``gid`` are the dense group ids of ``_dense_group_ids``.
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
    """Per sample: GRPO's score standardised within its group, ``(s − μ) / (σ + eps)`` (or
    ``s − μ`` without ``norm_std``), a group of one with ``μ = 0, σ = 1``; in ``_wide_dtype``."""
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

    For sample ``i`` in group ``g`` with ``n_g`` samples, mean ``μ_g`` and unbiased std ``σ_g``::

        A_i = (s_i − μ_g) / (σ_g + eps)      (norm_std=True, GRPO)
        A_i =  s_i − μ_g                     (norm_std=False, Dr.GRPO)

    A group of one has ``μ = 0, σ = 1`` (verl), so its advantage is ``s_i / (1 + eps)`` (or
    ``s_i``). A group of equal scores gives exactly 0 (also with ``eps = 0``). ``eps`` is added
    to the std, not the variance.

    GRPO: https://arxiv.org/abs/2402.03300 — Dr.GRPO: https://arxiv.org/abs/2503.20783

    Args:
        scores: ``[B]`` outcome scores (or ``[B, T]`` token rewards, summed over ``T``).
        index: ``[B]`` integer group id per sample (e.g. the prompt id). From string ids:
            ``torch.as_tensor(numpy.unique(uids, return_inverse=True)[1])``.
        mask: ``[B, T]`` 0/1 action mask (``response_mask``).
        norm_std: divide by the group std (GRPO) or not (Dr.GRPO).
        eps: ``>= 0``, added to the std.

    Returns:
        ``(advantages, returns)``, both the same ``[B, T]`` tensor, 0 where ``mask`` is 0.

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
    """RLOO advantages: each score minus the mean of the *other* samples of its group.

    ``A_i = s_i − (Σ_{j≠i} s_j)/(n − 1) = n/(n − 1)·(s_i − μ_g)`` for a group of ``n ≥ 2``
    (computed in the centred right-hand form). A group of one keeps its score: ``A_i = s_i``
    (verl). https://arxiv.org/abs/2402.14740

    Args:
        scores: ``[B]`` outcome scores (or ``[B, T]`` token rewards, summed over ``T``).
        index: ``[B]`` integer group id per sample.
        mask: ``[B, T]`` 0/1 action mask.

    Returns:
        ``(advantages, returns)``, both the same ``[B, T]`` tensor, 0 where ``mask`` is 0.

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
    """REINFORCE++-baseline: subtract the group mean, then whiten over all action tokens.

    ``a_i = s_i − μ_g`` (a group of one keeps ``s_i``), broadcast to the action tokens, then
    ``A = (a − mean) / sqrt(var + eps)`` with the mean and unbiased variance taken over every
    mask-1 token of the batch (verl's ``masked_whiten``; a row weighs as many times as it has
    action tokens). Computed from per-row token counts in ``O(B)`` rather than over ``[B, T]``;
    equal to :func:`rlops.stats.masked_whiten` of the broadcast values.
    https://arxiv.org/abs/2501.03262

    Args:
        scores: ``[B]`` outcome scores (or ``[B, T]`` token rewards, summed over ``T``).
        index: ``[B]`` integer group id per sample.
        mask: ``[B, T]`` 0/1 action mask.
        eps: ``>= 0``, added to the batch variance.

    Returns:
        ``(advantages, returns)``, both the same ``[B, T]`` tensor, 0 where ``mask`` is 0.

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
    """ReMax: reward-to-go minus the reward of a greedy rollout of the same prompt.

    ``G_t = Σ_{t' ≥ t} m_{t'}·r_{t'}`` (undiscounted; mask-0 tokens pass the sum through and
    get 0) and ``A_t = G_t − b`` on action tokens, with ``b`` the greedy response's score.
    With ``[B]`` outcome rewards (the reward on the last action token) ``G_t = r`` on every
    action token. https://arxiv.org/abs/2310.10505

    Args:
        rewards: ``[B, T]`` token rewards, or ``[B]`` outcome rewards.
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
    """OPO advantages: each score minus the length-weighted mean score of its group.

    With ``L_i`` the number of action tokens of sample ``i`` (its row of ``mask``), the
    optimal baseline for a sequence-level reward (OPO) is, for a group ``g`` of ``n ≥ 2``::

        b_g = Σ_{i∈g} L_i·s_i / Σ_{i∈g} L_i,        A_i = s_i − b_g

    A group of one has ``b = 0`` (verl), so ``A_i = s_i``. Computed as
    ``(s_i − μ_g) − Σ_i w_i·(s_i − μ_g)`` with ``w_i = L_i / Σ L`` (the same number, centred
    first, so a group of equal scores gives exactly 0). A group of ``n ≥ 2`` samples without
    any action token has no baseline to weigh; its advantages are all on mask-0 tokens, so 0.
    https://arxiv.org/abs/2505.23585

    Args:
        scores: ``[B]`` outcome scores (or ``[B, T]`` token rewards, summed over ``T``).
        index: ``[B]`` integer group id per sample.
        mask: ``[B, T]`` 0/1 action mask; its row sums are the lengths ``L``.

    Returns:
        ``(advantages, returns)``, both the same ``[B, T]`` tensor, 0 where ``mask`` is 0.

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
    """GPG advantages: the group-centred score, rescaled by the batch's fraction of valid samples.

    For sample ``i`` in group ``g`` with mean ``μ_g``, in a batch of ``B`` samples::

        A_i = α·(s_i − μ_g) / f_norm,        α = B / max(M, 1)

    where ``M`` is the number of samples whose score is non-zero, as verl counts them
    (``compute_gpg_outcome_advantage``). The paper's correction ``α = B / (B − M')`` counts
    instead the ``M'`` samples that carry no gradient; either way samples without signal dilute
    the batch mean of the loss, and ``α`` undoes it. A group of one has ``μ = 0`` (verl), so
    ``A_i = α·s_i / f_norm``. ``α`` is computed on the device in float64 (no host read; verl's
    is a float32 tensor, so results differ there in the 8th digit).
    https://arxiv.org/abs/2504.02546

    Args:
        scores: ``[B]`` outcome scores (or ``[B, T]`` token rewards, summed over ``T``).
        index: ``[B]`` integer group id per sample.
        mask: ``[B, T]`` 0/1 action mask.
        f_norm: ``> 0``, the divisor ``F_norm`` (1 in verl and the paper's default).
        alpha: ``None`` for ``B / max(M, 1)`` as above (verl's behaviour, which ignores its own
            ``alpha`` argument), or a fixed ``> 0`` factor.

    Returns:
        ``(advantages, returns)``, both the same ``[B, T]`` tensor, 0 where ``mask`` is 0.

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
    """GRPO for pass@k: only the best sample of each group is credited, by its lead.

    In a group ``g`` of ``n ≥ 2`` samples with largest score ``r_max`` (held by sample ``i*``)
    and second-largest ``r_2`` (counted with multiplicity: a tie for the top gives
    ``r_2 = r_max``) and unbiased std ``σ_g``::

        A_{i*} = (r_max − r_2) / (σ_g + eps)     (norm_std=True; r_max − r_2 without)
        A_i    = 0                               for every other sample

    The pass@k reward of the group is its best score, and ``r_max − r_2`` is what the best
    sample adds to it (verl's ``compute_grpo_passk_outcome_advantage``). A tie for the top
    gives the whole group 0. verl rejects a group of one; so does this function where the
    values are read (CPU, or ``RLOPS_CHECK_VALUES=1``), and elsewhere such a sample gets 0.
    https://arxiv.org/abs/2503.19595

    Args:
        scores: ``[B]`` outcome scores (or ``[B, T]`` token rewards, summed over ``T``).
        index: ``[B]`` integer group id per sample; every group needs at least 2 samples.
        mask: ``[B, T]`` 0/1 action mask.
        norm_std: divide by the group std (verl's ``norm_adv_by_std_in_grpo``).
        eps: ``>= 0``, added to the std.

    Returns:
        ``(advantages, returns)``, both the same ``[B, T]`` tensor, 0 where ``mask`` is 0.

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
    """GDPO: each reward standardised within its group on its own, then summed and whitened.

    GDPO (https://arxiv.org/abs/2601.05242) normalises every reward component ``k`` in its
    group before the components are combined, so that a reward of large spread does not drown
    the others (GRPO standardises their sum)::

        A_k,i = (s_k,i − μ_k,g) / (σ_k,g + eps)        per component, as GRPO (group of one:
                                                        μ = 0, σ = 1; norm_std=False: no σ)
        a_i   = Σ_k w_k · A_k,i
        A     = (a − mean) / sqrt(var + whiten_eps)     over the batch's action tokens

    The last step is verl's ``masked_whiten`` (``compute_gdpo_outcome_advantage``): the mean
    and unbiased variance over every mask-1 token, each row weighing as many times as it has
    action tokens. A batch with at most one action token gives 0.

    Args:
        scores: ``[B, K]`` one column per reward component (a ``[B]`` tensor is one component).
        index: ``[B]`` integer group id per sample.
        mask: ``[B, T]`` 0/1 action mask.
        weights: ``[K]`` finite weights, one per component (verl's ``gdpo_reward_weights``): a
            sequence of numbers or a 1-dim real tensor; default all 1.
        norm_std: a bool: divide each component by its group std (verl's
            ``norm_adv_by_std_in_grpo``).
        eps: ``>= 0``, added to each group std.
        whiten_eps: ``>= 0``, added to the batch variance.

    Returns:
        ``(advantages, returns)``, both the same ``[B, T]`` tensor, 0 where ``mask`` is 0.

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
    """The optimal token baseline (OTB): a baseline per position, weighted by the path's
    accumulated score variance; ``per_action_step=True`` is its TIR (multi-turn) form.

    OTB (https://arxiv.org/abs/2602.07078; verl's ``compute_optimal_token_baseline_advantage``
    and ``compute_multi_turn_optimal_token_baseline_advantage``). With ``π_t = exp(logp_t)``
    and ``Σπ²_t`` the sum over the vocabulary of the squared probabilities (the log-prob ops'
    Σπ² output), the squared norm of the score function of the sampled token is
    ``‖s_t‖² = 1 − 2π_t + Σπ²_t``; with ``G_t`` the undiscounted reward-to-go over the action
    tokens and ``ρ_t`` optional rollout IS weights::

        w_t = (1 − 2π_t + Σπ²_t) · ρ_t²          W_t = Σ_{j ≤ t} m_j·w_j
        B_t = Σ_{i∈g} G_t^i·W_t^i·m_t^i / (Σ_{i∈g} W_t^i·m_t^i + eps)     A_t = G_t − B_t

    the sums over the group's samples alive at position ``t``. A group of one has ``B = 0``.
    ``handle_zero_tail``: the group's unique longest sample gets ``B = 0`` beyond the second
    longest length (there it would be its own baseline). Positions are the columns of the row
    (OTB), or with ``per_action_step`` the action-token index (the k-th action token of every
    sample is compared with the k-th of the others: tool and observation spans skipped, TIR's
    form; samples without action tokens are then not counted in the group).

    Args:
        rewards: ``[B, T]`` token rewards (or ``[B]``: the outcome on the last action token).
        index: ``[B]`` integer group id per sample.
        mask: ``[B, T]`` 0/1 action mask.
        logp: ``[B, T]`` floating log-probs of the sampled tokens (verl's ``old_log_probs``).
        sum_pi_squared: ``[B, T]`` floating Σ_v π_v² per token.
        rollout_is_weights: ``[B, T]`` floating IS weights ρ, or None.
        handle_zero_tail: a bool: zero the baseline of a group's unique longest sample past
            the second longest.
        eps: ``>= 0``, added to each denominator.
        per_action_step: a bool: positions by action-token index (TIR) instead of by column.

    Returns:
        ``(advantages, returns)``, ``[B, T]`` each (``returns`` = ``G``), 0 where ``mask`` is 0.

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
