"""Drop-in replacements for slime's advantage, KL, loss and log-prob functions, on rlops.

Names, arguments and return values follow slime's ``slime/utils/ppo_utils.py``,
``slime/backends/megatron_utils/cp_utils.py``, ``slime/utils/distributed_utils.py`` and the
critic loss, TIS and IcePop of ``slime/backends/megatron_utils/loss.py`` (signatures as of
slime's main branch in August 2026: the version with ``chunked_discounted_returns`` and the
fused log-prob/entropy). Arguments are checked first and errors name slime's arguments.
Per-sample inputs are lists of 1-D tensors of varying length; each adapter pads them into one
``[B, T_max]`` batch with a mask, makes one rlops call and splits the result back (the only
Python loops run over samples).

Where slime reads Megatron's global state (``mpu.get_context_parallel_*``), the adapter takes the
group as a keyword argument instead: ``cp_group=None`` means no context parallelism. With a CP
group the lists hold this rank's compact response pieces (slime's layout, see
:mod:`rlops.compat._slime_cp`), and the scans exchange one carry per chunk instead of
all-gathering every response and slicing it back.

Deliberate differences from slime are listed in each docstring; in short: REINFORCE++ skips
mask-0 tokens instead of counting them as discount steps; whitening is finite on constant
advantages; log-ratios are clamped before ``exp``; the CP layout is right for every length,
also when a rank holds no response token.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

import rlops
from rlops._checks import (
    as_real,
    check_2d,
    check_positive,
    check_same_shape,
    check_unit_interval,
)
from rlops._types import Group
from rlops.compat import _ragged
from rlops.compat._slime_cp import (
    add_outcome_rewards,
    all_gather_with_cp,
    check_samples,
    local_columns,
    response_values,
    runs,
    slice_log_prob_with_cp,
    take_runs,
    zigzag_response_mask,
    zigzag_shard_response,
    zigzag_unshard_response,
)
from rlops.compat._slime_kinds import (
    compute_cispo_loss,
    compute_opsm_mask,
    icepop_function,
    vanilla_tis_function,
)
from rlops.distributed.groups import group_rank_size

__all__ = [
    "add_outcome_rewards",
    "all_gather_with_cp",
    "calculate_log_probs_and_entropy",
    "chunked_discounted_returns",
    "chunked_gae",
    "compute_approx_kl",
    "compute_cispo_loss",
    "compute_opsm_mask",
    "compute_policy_loss",
    "distributed_masked_whiten",
    "get_advantages_and_returns_batch",
    "get_grpo_returns",
    "get_log_probs_and_entropy",
    "get_reinforce_plus_plus_baseline_advantages",
    "get_reinforce_plus_plus_returns",
    "icepop_function",
    "slice_log_prob_with_cp",
    "value_loss_function",
    "vanilla_gae",
    "vanilla_tis_function",
    "zigzag_response_mask",
    "zigzag_shard_response",
    "zigzag_unshard_response",
]


def _scores(rewards: object, device: torch.device) -> torch.Tensor:
    r = torch.as_tensor(rewards, device=device)
    return r if r.is_floating_point() else r.float()


def _batch_gae(rewards, values, gamma, lambd):
    """slime's ``[B, T]`` GAE arguments checked under slime's names, then :func:`rlops.gae`."""
    check_2d("rewards", rewards)
    check_same_shape("rewards", rewards, values=values)
    gamma = check_unit_interval("gamma", gamma)
    lambd = check_unit_interval("lambd", lambd)
    return rlops.gae(rewards, values, gamma=gamma, lam=lambd)


def _default_group(group: Group, name: str) -> Group:
    """slime's reading of a group argument: ``None`` is the default (world) group once
    torch.distributed is initialised, and a group of one process is no group."""
    if group is None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
    return None if group_rank_size(group, name)[1] == 1 else group


# --------------------------------------------------------------------------- [B, T] estimators
def vanilla_gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lambd: float):
    """GAE on a padded ``[B, T]`` batch: ``(advantages, returns)`` (slime's serial reference).

    ``δ_t = r_t + γ·V_{t+1} − V_t`` with ``V_T = 0``, ``A_t = δ_t + γλ·A_{t+1}``,
    ``returns = A + V``; computed by :func:`rlops.gae`, which runs no Python loop over time.

    Example:
        >>> import torch
        >>> adv, ret = vanilla_gae(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.5]]), 1.0, 1.0)
        >>> adv, ret
        (tensor([[0.5000, 0.5000]]), tensor([[1., 1.]]))
    """
    return _batch_gae(rewards, values, gamma, lambd)


def chunked_gae(
    rewards: torch.Tensor, values: torch.Tensor, gamma: float, lambd: float, chunk_size: int = 128
):
    """GAE on a padded ``[B, T]`` batch, as :func:`vanilla_gae` (slime's chunked-scan version).

    ``chunk_size`` is accepted for compatibility and ignored: rlops picks its own scan (a
    compiled single pass on CPU, a chunked scan with vectorised carries elsewhere), with no
    Python loop over chunks.

    Example:
        >>> import torch
        >>> adv, _ = chunked_gae(torch.tensor([[1.0, 1.0]]), torch.zeros(1, 2), 0.5, 1.0)
        >>> adv
        tensor([[1.5000, 1.0000]])
    """
    return _batch_gae(rewards, values, gamma, lambd)


def chunked_discounted_returns(
    rewards: torch.Tensor, discount: float, chunk_size: int = 128
) -> torch.Tensor:
    """Discounted returns ``G_t = r_t + discount·G_{t+1}`` of a ``[B, T]`` batch.

    ``chunk_size`` is accepted and ignored (see :func:`chunked_gae`).

    Example:
        >>> import torch
        >>> chunked_discounted_returns(torch.tensor([[1.0, 0.0, 2.0]]), 0.5)
        tensor([[1.5000, 1.0000, 2.0000]])
    """
    check_2d("rewards", rewards)
    return rlops.discounted_cumsum(rewards, check_unit_interval("discount", discount))


# --------------------------------------------------------------------------- per-sample lists
def get_advantages_and_returns_batch(
    total_lengths,
    response_lengths,
    values_list,
    rewards_list,
    gamma,
    lambd,
    chunked: bool = True,
    *,
    cp_group: Group = None,
):
    """Batched GAE over per-sample response tensors: ``(advantages_list, returns_list)``.

    Every response token is a step (no loss mask, as in slime). Without ``cp_group`` the lists
    hold whole responses (``values_list[i][:response_lengths[i]]`` is used) and the result has
    ``response_lengths[i]`` entries per sample. With ``cp_group`` they hold this rank's compact
    pieces (slime's CP layout) and so do the results; where slime all-gathers every response and
    slices it back, this runs rlops' CP GAE, which exchanges five numbers per chunk and sample.
    ``chunked`` is accepted and ignored. Computed without gradient, as in slime.

    Difference: the CP layout is right for every length, including samples of which this rank
    holds no response token.

    Example:
        >>> import torch
        >>> adv, ret = get_advantages_and_returns_batch(
        ...     [5, 4], [2, 1], [torch.tensor([0.5, 0.5]), torch.tensor([0.0])],
        ...     [torch.tensor([0.0, 1.0]), torch.tensor([2.0])], 1.0, 1.0)
        >>> adv
        [tensor([0.5000, 0.5000]), tensor([2.])]
    """
    values_list, rewards_list = check_samples(
        ("values_list", "rewards_list"),
        total_lengths=total_lengths,
        response_lengths=response_lengths,
        values_list=values_list,
        rewards_list=rewards_list,
    )
    gamma = check_unit_interval("gamma", gamma)
    lambd = check_unit_interval("lambd", lambd)
    if not values_list:
        return [], []
    rank, size = group_rank_size(cp_group, "cp_group")
    with torch.no_grad():
        if size == 1:
            lengths = list(response_lengths)
            for name, xs in (("values_list", values_list), ("rewards_list", rewards_list)):
                for i, (x, n) in enumerate(zip(xs, lengths)):
                    if x.numel() < n:
                        raise ValueError(
                            f"{name}[{i}] has {x.numel()} entries, fewer than "
                            f"response_lengths[{i}] = {n}"
                        )
            v = _ragged.pad([x[:n] for x, n in zip(values_list, lengths)])
            r = _ragged.pad([x[:n] for x, n in zip(rewards_list, lengths)], v.shape[1])
            # Zero right-padding bootstraps V = 0 after each response: no mask needed.
            adv, ret = rlops.gae(r, v, gamma=gamma, lam=lambd)
            return _ragged.split(adv, lengths), _ragged.split(ret, lengths)
        _, cols, width = local_columns(total_lengths, response_lengths, size, rank)
        lengths = [c.numel() for c in cols]
        dtype = torch.promote_types(values_list[0].dtype, rewards_list[0].dtype)
        v, mask, index = _ragged.place(values_list, cols, width, dtype)
        r, _, _ = _ragged.place(rewards_list, cols, width, dtype)
        adv, ret = rlops.gae(r, v, gamma=gamma, lam=lambd, mask=mask, cp_group=cp_group)
        return _ragged.take(adv, index, lengths), _ragged.take(ret, index, lengths)


def get_reinforce_plus_plus_returns(
    rewards,
    kl,
    loss_masks,
    response_lengths,
    total_lengths,
    kl_coef: float,
    gamma: float | torch.Tensor,
    *,
    cp_group: Group = None,
) -> list[torch.Tensor]:
    """REINFORCE++ returns per sample (https://arxiv.org/abs/2501.03262).

    Token reward ``−kl_coef·kl_t`` on loss-mask-1 tokens plus ``rewards[i]`` on the last of
    them; returns are discounted over the action tokens (:func:`rlops.reinforce_plus_plus_returns`).
    ``kl[i]`` is the whole response, or this rank's compact CP piece with ``cp_group``;
    ``loss_masks[i]`` is always the whole response's mask, as in slime. Returns are shaped like
    ``kl[i]``. With ``cp_group`` one collective of a few numbers per chunk and sample replaces
    slime's all-gather of every KL tensor.

    Differences: a mask-0 token (tool output) is *skipped*, not a discount step: the outcome
    reaches an action before a tool span discounted once per action step (slime discounts once
    per token, tool tokens included), and the return on mask-0 tokens is 0 (slime carries the
    running return through them). With ``gamma = 1`` the action-token values agree (slime versions
    that did not mask the KL also add the KL of mask-0 tokens). A sample with no mask-1 token
    gets zeros (slime asserts). The CP layout is right for every length.

    Example:
        >>> import torch
        >>> get_reinforce_plus_plus_returns(
        ...     torch.tensor([1.0]), [torch.zeros(4)], [torch.tensor([1, 0, 1, 0])], [4], [9],
        ...     kl_coef=0.1, gamma=0.5)
        [tensor([0.5000, 0.0000, 1.0000, 0.0000])]
    """
    kl, loss_masks = check_samples(
        ("kl", "loss_masks"),
        rewards=rewards,
        kl=kl,
        loss_masks=loss_masks,
        response_lengths=response_lengths,
        total_lengths=total_lengths,
    )
    kl_coef = as_real("kl_coef", kl_coef)
    gamma = check_unit_interval("gamma", gamma)
    if not kl:
        return []
    scores = _scores(rewards, kl[0].device)
    rank, size = group_rank_size(cp_group, "cp_group")
    if size == 1:
        for i, (k, m) in enumerate(zip(kl, loss_masks)):
            if k.numel() != m.numel():
                raise ValueError(
                    f"kl[{i}] has {k.numel()} entries but loss_masks[{i}] has {m.numel()}"
                )
        k = _ragged.pad(kl)
        m = _ragged.pad([x.to(k.device) for x in loss_masks], k.shape[1])
        # right padding has mask 0 (m is zero-padded)
        out = rlops.reinforce_plus_plus_returns(scores, k, m != 0, kl_coef=kl_coef, gamma=gamma)
        return _ragged.split(out, [x.numel() for x in kl])
    held, cols, width = local_columns(total_lengths, response_lengths, size, rank)
    local_masks = [take_runs(m.to(kl[0].device), runs(h)) for m, h in zip(loss_masks, held)]
    k, real, index = _ragged.place(kl, cols, width)
    m, _, _ = _ragged.place([x.to(k.dtype) for x in local_masks], cols, width)
    out = rlops.reinforce_plus_plus_returns(
        scores, k, real & (m != 0), kl_coef=kl_coef, gamma=gamma, cp_group=cp_group
    )
    return _ragged.take(out, index, [c.numel() for c in cols])


def get_reinforce_plus_plus_baseline_advantages(rewards, kl, loss_masks, kl_coef: float):
    """Unwhitened REINFORCE++-baseline advantages: ``rewards[i] − kl_coef·kl[i]`` per token.

    ``rewards`` already has the group baseline subtracted (as in slime); whitening comes later
    (:func:`distributed_masked_whiten`). ``loss_masks`` is unused, as in slime (``None`` is
    accepted); given, it must have one entry per sample.

    Example:
        >>> import torch
        >>> kl = [torch.tensor([0.0, 1.0]), torch.tensor([2.0])]
        >>> get_reinforce_plus_plus_baseline_advantages(
        ...     torch.tensor([1.0, -1.0]), kl, [torch.ones(2), torch.ones(1)], 0.5)
        [tensor([1.0000, 0.5000]), tensor([-2.])]
    """
    kl = _ragged.as_1d_list("kl", kl)
    lists = {"rewards": rewards, "kl": kl}
    if loss_masks is not None:
        lists["loss_masks"] = loss_masks
    _ragged.check_counts(**lists)
    kl_coef = as_real("kl_coef", kl_coef)
    if not kl:
        return []
    k = _ragged.pad(kl)
    scores = _scores(rewards, k.device)
    out = scores[:, None] - kl_coef * k
    return _ragged.split(out, [x.numel() for x in kl])


def get_grpo_returns(rewards, kl) -> list[torch.Tensor]:
    """``rewards[i]`` (already group-normalised) broadcast to the shape of ``kl[i]``.

    Example:
        >>> import torch
        >>> get_grpo_returns(torch.tensor([0.5, -0.5]), [torch.zeros(2), torch.zeros(3)])
        [tensor([0.5000, 0.5000]), tensor([-0.5000, -0.5000, -0.5000])]
    """
    kl = _ragged.as_1d_list("kl", kl)
    _ragged.check_counts(rewards=rewards, kl=kl)
    if not kl:
        return []
    scores = _scores(rewards, kl[0].device)
    dtype = torch.promote_types(kl[0].dtype, scores.dtype)
    # each score expanded to its sample's length (host ints: no count on the device, no sync)
    counts = [x.numel() for x in kl]
    flat = torch.cat([s.expand(n) for s, n in zip(scores.unbind(0), counts)]).to(dtype)
    return list(flat.split(counts))


# --------------------------------------------------------------------------- KL, losses, stats
def compute_approx_kl(
    log_probs: torch.Tensor,
    log_probs_base: torch.Tensor,
    kl_loss_type: str,
    importance_ratio: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL estimate (k1, k2, k3, low_var_kl) in float32, optionally IS-weighted.

    With ``d = log_probs − log_probs_base``: k1 ``d``, k2 ``d²/2``, k3 ``e^{−d} − 1 + d``;
    ``importance_ratio`` multiplies the estimate; ``low_var_kl`` is k3, weighted, then clamped
    to ``[−10, 10]``. Computed by :func:`rlops.kl_penalty`.

    Difference: k3's ``e^{−d}`` is evaluated with ``−d ≤ 20`` (``expm1`` form), so it stays
    finite where slime's overflows to inf (``d < −88`` in float32).

    Example:
        >>> import torch
        >>> compute_approx_kl(torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0]), "k3")
        tensor([0.1065, 0.7183])
    """
    if kl_loss_type not in ("k1", "k2", "k3", "low_var_kl"):
        raise ValueError(f"Unknown kl_loss_type: {kl_loss_type}")
    kind = "k3" if kl_loss_type == "low_var_kl" else kl_loss_type
    kl = rlops.kl_penalty(log_probs.float(), log_probs_base.float(), kind)
    if importance_ratio is not None:
        kl = importance_ratio * kl
    if kl_loss_type == "low_var_kl":
        kl = kl.clamp(-10.0, 10.0)
    return kl


def compute_policy_loss(
    ppo_kl: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
):
    """Per-token PPO clipped loss and clip indicator: ``(pg_losses, clipfrac)``.

    ``ratio = exp(−ppo_kl)`` (``ppo_kl = old_log_probs − log_probs``),
    ``ℓ = max(−A·ratio, −A·clip(ratio, 1 − eps_clip, 1 + eps_clip_high))`` and, with
    ``eps_clip_c = c > 1`` (dual-clip), ``min(ℓ, −A·c)`` where ``A < 0``. ``clipfrac`` is 1.0
    where the clipped term is the larger (before dual-clip), as slime. Any shape (slime passes
    the concatenated 1-D tokens); unreduced, slime reduces per sample afterwards.

    Computed by :func:`rlops.policy_loss` with ``agg=None`` (the per-token loss); the clip
    indicator compares it with the unclipped loss (the same call with the clip off).
    ``eps_clip >= 1`` puts the ratio floor at or below 0, where it never binds: no lower clip,
    as in slime.

    Differences: the log-ratio is clamped to at most 20 before ``exp`` (rlops' rule): no inf
    or NaN loss for a token whose probability rose by more than ``e^20``; its gradient is then
    0. ``eps_clip`` and ``eps_clip_high`` must be > 0 (slime accepts 0 and negative values).

    Example:
        >>> import torch
        >>> pg, frac = compute_policy_loss(torch.tensor([0.0, -0.5]), torch.tensor([1.0, 1.0]),
        ...                                0.2, 0.2)
        >>> pg, frac
        (tensor([-1.0000, -1.2000]), tensor([0., 1.]))
    """
    check_same_shape("ppo_kl", ppo_kl, advantages=advantages)
    low = check_positive("eps_clip", eps_clip)
    high = check_positive("eps_clip_high", eps_clip_high)
    if eps_clip_c is not None:
        eps_clip_c = check_positive("eps_clip_c (dual-clip)", eps_clip_c, above=1.0)
    dtype = torch.promote_types(ppo_kl.dtype, advantages.dtype)
    logp = -ppo_kl.to(dtype).reshape(1, -1)  # the log-ratio, against old log-probs of 0
    old, adv = torch.zeros_like(logp), advantages.to(dtype).reshape(1, -1)
    everywhere = torch.ones_like(logp, dtype=torch.bool)

    def per_token(clip_low, clip_high, dual_clip=None):
        loss, _ = rlops.policy_loss(
            logp,
            old,
            adv,
            everywhere,
            clip_low=clip_low,
            clip_high=clip_high,
            dual_clip=dual_clip,
            agg=None,
        )
        return loss

    low = math.inf if low >= 1 else low
    with torch.no_grad():
        unclipped = per_token(math.inf, math.inf)
        clipped = per_token(low, high) if eps_clip_c is not None else None
    loss = per_token(low, high, eps_clip_c)
    clipfrac = torch.gt(loss.detach() if clipped is None else clipped, unclipped)
    shape = ppo_kl.shape
    return loss.reshape(shape).to(dtype), clipfrac.reshape(shape).float()


def value_loss_function(args, batch, logits, sum_of_sample_mean, *, cp_group=None):
    """slime's critic loss (``slime/backends/megatron_utils/loss.py``): ``(loss, metrics)``.

    Reads the value head ``logits`` ``[1, T, 1]`` at each sample's response positions (slime's
    packed layout; with ``cp_group`` the zigzag context-parallel layout, or, with
    ``args.allgather_cp``, the contiguous split re-sliced to it), then per token::

        loss = max((V_clip − R)², (V − R)²)        V_clip = V_old + clip(V − V_old, ±value_clip)
        clipfrac = |V − V_old| > value_clip

    each reduced by ``sum_of_sample_mean`` (slime's per-sample reducer, built from the loss
    masks). Note the scale: no factor 1/2, so this is twice :func:`rlops.value_loss`, which
    computes the per-token term (``agg=None``); and ``clipfrac`` counts every token whose new
    value left the clip range, where verl and :func:`rlops.value_loss` count those where the
    clipped error is the larger. ``batch`` holds ``"values"`` (old values) and ``"returns"``
    as per-sample lists, and ``"total_lengths"``, ``"response_lengths"``. ``metrics`` holds the
    detached ``"value_loss"`` and ``"value_clipfrac"``.

    Example:
        >>> import torch
        >>> from argparse import Namespace
        >>> logits = torch.tensor([1.0, 3.0, 0.0]).reshape(1, 3, 1)  # positions 0, 1 predict
        >>> # response tokens 0, 1 (the last 2 of 3): V = [1, 3]
        >>> batch = {"values": [torch.ones(2)], "returns": [torch.zeros(2)],
        ...          "total_lengths": [3], "response_lengths": [2]}
        >>> loss, metrics = value_loss_function(Namespace(value_clip=0.5), batch, logits,
        ...                                     torch.mean)
        >>> loss, metrics["value_clipfrac"]
        (tensor(5.), tensor(0.5000))
    """
    clip = check_positive("value_clip", args.value_clip)
    per_sample = response_values(
        logits,
        batch["total_lengths"],
        batch["response_lengths"],
        allgather_cp=bool(getattr(args, "allgather_cp", False)),
        cp_group=cp_group,
    )
    values = torch.cat([v.flatten() for v in per_sample])
    old = torch.cat(list(batch["values"]))
    returns = torch.cat(list(batch["returns"]))
    check_same_shape(
        "values read from logits", values, **{'batch["values"]': old, 'batch["returns"]': returns}
    )
    half_squared, _ = rlops.value_loss(
        values[None],
        old[None],
        returns[None],
        torch.ones_like(values[None], dtype=torch.bool),
        clip=clip,
        agg=None,
    )
    clipfrac = ((values - old).abs() > clip).to(values.dtype)
    loss = sum_of_sample_mean(2 * half_squared[0])
    values_clipfrac = sum_of_sample_mean(clipfrac)
    if values.numel() == 0:  # keep the graph connected to the value head, as slime
        loss = loss + 0 * values.sum()
    return loss, {
        "value_loss": loss.clone().detach(),
        "value_clipfrac": values_clipfrac.clone().detach(),
    }


def distributed_masked_whiten(
    values: torch.Tensor,
    mask: torch.Tensor,
    process_group: Group = None,
    shift_mean: bool = True,
    epsilon: float = 1e-8,
) -> torch.Tensor:
    """Whiten ``values`` with the mean and unbiased variance of the mask-1 entries of every
    rank of ``process_group`` (``None``: the default group when torch.distributed is
    initialised, as in slime; one process otherwise).

    Computed by :func:`rlops.masked_whiten` with ``group=``: one all-gather of (count, mean, M2)
    merged exactly (Chan et al.), where slime all-reduces (Σx, Σx², n) and takes
    ``E[x²] − E[x]²``.

    Differences: the variance never goes negative, so constant (or nearly constant)
    advantages whiten to finite values near 0 (the rounding of the mean, scaled by
    ``1/sqrt(epsilon)``) instead of NaN; mask-0 entries are returned as 0 (slime whitens
    them too; no loss reads them); an all-masked batch gives zeros instead of raising;
    ``shift_mean=False`` adds the mean back.

    Example:
        >>> import torch
        >>> distributed_masked_whiten(torch.tensor([1.0, 2.0, 3.0, 9.0]),
        ...                           torch.tensor([1, 1, 1, 0]))
        tensor([-1.,  0.,  1.,  0.])
    """
    group = _default_group(process_group, "process_group")
    return rlops.masked_whiten(values, mask, shift_mean=shift_mean, eps=epsilon, group=group)


# --------------------------------------------------------------------------- log-probs


def calculate_log_probs_and_entropy(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    tp_group,
    with_entropy: bool = False,
    chunk_size: int = -1,
    log_prob_keep_mask: torch.Tensor | None = None,
    with_entropy_grad: bool = True,
    *,
    mask: torch.Tensor | None = None,
    log_prob_keep_ids: torch.Tensor | None = None,
    log_prob_keep_offsets: torch.Tensor | None = None,
    temperature: float = 1.0,
):
    """Log-probs of ``tokens`` and (optionally) the entropy, from vocabulary-parallel logits.

    ``logits`` ``[T, V_local]`` (already divided by the temperature), sharded over ``tp_group``
    by vocabulary; ``tokens`` ``[T]`` global ids. ``tp_group=None`` is the default (world) group
    once torch.distributed is initialised, as in slime (one process otherwise). Returns
    ``(log_prob [T, 1], entropy [T] or None)`` in float32, as slime. ``log_prob_keep_mask``
    (top-p replay) applies to the log-prob only; the target is always kept. ``chunk_size > 0``
    bounds the float32 temporaries to ``[chunk_size, V_local]`` (otherwise rlops picks a
    bound). ``with_entropy_grad=False`` returns a detached entropy.

    Beyond slime's arguments (keyword only):

    - ``mask`` ``[T]`` bool: the rows to compute (slime's response rows, and its loss mask:
      tool-output tokens are 0 there); the other rows cost nothing and give exact zeros (log-prob,
      entropy and gradient);
    - ``log_prob_keep_ids`` ``[nnz]`` and ``log_prob_keep_offsets`` ``[T + 1]`` (int32 or
      int64): the top-p replay's kept sets as CSR, the form slime records them in
      (``rollout_top_p_token_ids`` / ``rollout_top_p_token_offsets``, flattened over the rows):
      row ``t`` keeps the global vocabulary ids ``ids[offsets[t]:offsets[t + 1]]``, the same
      as a ``log_prob_keep_mask`` with those entries True, never built (exclusive with it). A
      row with an empty set keeps only its target, so give every row of ``mask`` its set (slime
      leaves rows without a recorded set all-True; here they are the rows outside ``mask``);
    - ``temperature``: divide the logits by it inside (no scaled copy of ``[T, V_local]``; the
      gradient is with respect to the unscaled logits). slime divides before the call:
      ``temperature=1``.

    Computed by :func:`rlops.logprobs_and_entropy`: one all-gather of a few numbers per token in
    the forward, none in the backward (slime: three all-reduces forward, in-place buffers
    saved for the backward).

    Example:
        >>> import torch
        >>> logp, ent = calculate_log_probs_and_entropy(
        ...     torch.zeros(2, 4), torch.tensor([1, 3]), None, with_entropy=True)
        >>> logp.shape, ent
        (torch.Size([2, 1]), tensor([1.3863, 1.3863]))
        >>> logp, _ = calculate_log_probs_and_entropy(
        ...     torch.zeros(2, 4), torch.tensor([1, 3]), None, mask=torch.tensor([True, False]),
        ...     log_prob_keep_ids=torch.tensor([0, 1]),
        ...     log_prob_keep_offsets=torch.tensor([0, 2, 2]))
        >>> logp[:, 0]
        tensor([-0.6931,  0.0000])
    """
    if logits.size(0) == 0:
        empty = logits.new_zeros((0,), dtype=torch.float32)
        return empty, (empty.clone() if with_entropy else None)
    logp, entropy = rlops.logprobs_and_entropy(
        logits,
        tokens,
        keep_mask=log_prob_keep_mask,
        support_ids=log_prob_keep_ids,
        support_offsets=log_prob_keep_offsets,
        mask=mask,
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_grad=with_entropy_grad,
        group=_default_group(tp_group, "tp_group"),
        chunk_size=chunk_size if chunk_size > 0 else None,
    )
    return logp.unsqueeze(-1), entropy


def _response_rows(total_lengths, response_lengths, n_rows: int) -> tuple[list[int], list[int]]:
    """Each sample's first response row of the packed logits and its response length (slime's
    layout without context parallelism: the logits of row ``t`` predict token ``t + 1``)."""
    starts, lengths, end = [], [], 0
    for i, (total, resp) in enumerate(zip(total_lengths, response_lengths)):
        total, resp = int(total), int(resp)
        if not 0 <= resp < total:
            raise ValueError(
                f"response_lengths[{i}] = {resp} must be in [0, total_lengths[{i}] = {total})"
            )
        end += total
        starts.append(end - resp - 1)
        lengths.append(resp)
    if end > n_rows:
        raise ValueError(f"total_lengths sum to {end}, more than the logits' {n_rows} rows")
    return starts, lengths


def _keep_sets(
    top_p_token_ids,
    top_p_token_offsets,
    starts: list[int],
    lengths: list[int],
    n_rows: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-sample top-p sets (slime's ``rollout_top_p_token_ids`` / ``_offsets``, one
    entry per response token) as one CSR over the ``n_rows`` rows of the packed logits: the
    response rows hold their sets, every other row an empty one."""
    _ragged.check_counts(
        top_p_token_ids=top_p_token_ids,
        top_p_token_offsets=top_p_token_offsets,
        response_lengths=lengths,
    )
    # The sets are the rollout's, host data in slime (lists per sample): the offsets are read
    # and the rows' CSR built on the host, then copied to the device once (offsets given on
    # the device are read back: one copy each). Ids already on the device stay there.
    counts = torch.zeros(n_rows, dtype=torch.int64)
    ids = []
    for i, (sid, off, start, n) in enumerate(
        zip(top_p_token_ids, top_p_token_offsets, starts, lengths)
    ):
        off = torch.as_tensor(off, dtype=torch.int64).reshape(-1).cpu()
        if off.numel() != n + 1:
            raise ValueError(
                f"top_p_token_offsets[{i}] has {off.numel()} entries, expected "
                f"response_lengths[{i}] + 1 = {n + 1}"
            )
        counts[start : start + n] = off.diff()
        sid = torch.as_tensor(sid).reshape(-1)
        ids.append(sid[int(off[0]) : int(off[-1])])
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(device)
    if not ids:
        return torch.zeros(0, dtype=torch.int64, device=device), offsets
    on_host = [x.device.type == "cpu" for x in ids]
    if all(on_host):  # one copy of every sample's set
        return torch.cat(ids).to(device=device, dtype=torch.int64), offsets
    return torch.cat([x.to(device=device, dtype=torch.int64) for x in ids]), offsets


def get_log_probs_and_entropy(
    logits: torch.Tensor,
    *,
    args,
    unconcat_tokens,
    total_lengths,
    response_lengths,
    with_entropy: bool = False,
    non_loss_data: bool = True,
    top_p_token_ids=None,
    top_p_token_offsets=None,
    loss_masks=None,
    tp_group=None,
):
    """Per-sample response log-probs (and entropy) from slime's packed logits, one rlops call
    over every row: ``(torch.empty(0), {"log_probs": [...], "entropy": [...]})`` as slime's
    ``get_log_probs_and_entropy`` (``slime/backends/megatron_utils/loss.py``).

    ``logits`` ``[1, T, V_local]`` float32 (vocabulary-parallel over ``tp_group``, which
    replaces slime's ``mpu`` group); sample ``i`` fills ``total_lengths[i]`` rows, the last
    ``response_lengths[i]`` tokens of ``unconcat_tokens[i]`` its response, predicted by the rows
    before them. ``args``: ``rollout_temperature`` (the logits are divided by it inside, no
    scaled copy), ``log_probs_chunk_size``, ``entropy_coef`` (0: the entropy is detached), as
    slime. ``top_p_token_ids[i]`` / ``top_p_token_offsets[i]``: the rollout's top-p sets of
    sample ``i`` (``offsets`` of ``response_lengths[i] + 1`` entries), passed as CSR
    (:func:`calculate_log_probs_and_entropy`'s ``log_prob_keep_ids``), never as slime's
    ``[T, V_local]`` keep mask; the log-prob is over the set (the target always kept), the
    entropy over the whole vocabulary, as slime.

    The row mask of the call is the response rows: prompt and padding rows cost nothing (slime
    computes every row and slices the responses out). ``loss_masks`` (optional, one response-
    length mask per sample, slime's ``loss_masks``): its 0 tokens (tool outputs) are left out
    too, and their log-prob and entropy are exact zeros, not the values slime computes (slime's
    losses multiply them by the loss mask).

    Differences: no context parallelism (``args.allgather_cp`` must be false and each rank
    holds whole samples); a target outside its top-p set is kept (slime gives ``-inf``).

    Example:
        >>> import torch
        >>> from argparse import Namespace
        >>> args = Namespace(rollout_temperature=1.0, log_probs_chunk_size=-1, entropy_coef=0.0)
        >>> _, res = get_log_probs_and_entropy(
        ...     torch.zeros(1, 3, 4), args=args, unconcat_tokens=[torch.tensor([0, 1, 2])],
        ...     total_lengths=[3], response_lengths=[2], with_entropy=True)
        >>> res["log_probs"], res["entropy"]
        ([tensor([-1.3863, -1.3863])], [tensor([1.3863, 1.3863])])
    """
    if not non_loss_data:
        raise ValueError("non_loss_data must be True, as in slime")
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.size(0) != 1:
        raise ValueError(
            f"logits must be a [1, T, V_local] tensor, got {getattr(logits, 'shape', logits)}"
        )
    if getattr(args, "allgather_cp", False):
        raise ValueError("args.allgather_cp: context parallelism is not supported here")
    tokens_list = _ragged.as_1d_list("unconcat_tokens", unconcat_tokens)
    _ragged.check_counts(
        unconcat_tokens=tokens_list, total_lengths=total_lengths, response_lengths=response_lengths
    )
    if (top_p_token_ids is None) != (top_p_token_offsets is None):
        raise ValueError("top_p_token_ids and top_p_token_offsets go together")
    z = logits.squeeze(0)
    n_rows, device = z.shape[0], z.device
    starts, lengths = _response_rows(total_lengths, response_lengths, n_rows)
    targets = torch.zeros(n_rows, dtype=torch.int64, device=device)
    rows = torch.zeros(n_rows, dtype=torch.bool, device=device)
    for i, (tok, start, n) in enumerate(zip(tokens_list, starts, lengths)):
        if tok.numel() < n:
            raise ValueError(
                f"unconcat_tokens[{i}] has {tok.numel()} tokens, fewer than "
                f"response_lengths[{i}] = {n}"
            )
        targets[start : start + n] = tok[tok.numel() - n :].to(device)
        rows[start : start + n] = True
    if loss_masks is not None:
        masks = _ragged.as_1d_list("loss_masks", loss_masks)
        _ragged.check_counts(loss_masks=masks, response_lengths=lengths)
        for i, (m, start, n) in enumerate(zip(masks, starts, lengths)):
            if m.numel() != n:
                raise ValueError(
                    f"loss_masks[{i}] has {m.numel()} entries but response_lengths[{i}] = {n}"
                )
            rows[start : start + n] &= m.to(device) != 0
    keep = {}
    if top_p_token_ids is not None:
        ids, offsets = _keep_sets(
            top_p_token_ids, top_p_token_offsets, starts, lengths, n_rows, device
        )
        keep = {"log_prob_keep_ids": ids, "log_prob_keep_offsets": offsets}
    chunk = getattr(args, "log_probs_chunk_size", -1)
    logp, ent = calculate_log_probs_and_entropy(
        z,
        targets,
        tp_group,
        with_entropy=with_entropy,
        chunk_size=-1 if chunk is None else int(chunk),
        with_entropy_grad=with_entropy and getattr(args, "entropy_coef", 0.0) != 0,
        mask=rows,
        temperature=float(getattr(args, "rollout_temperature", 1.0)),
        **keep,
    )
    logp = logp.squeeze(-1)
    res = {"log_probs": [logp[s : s + n] for s, n in zip(starts, lengths)]}
    if with_entropy:
        assert ent is not None
        res["entropy"] = [ent[s : s + n] for s, n in zip(starts, lengths)]
    return torch.empty((0,), device=device), res
