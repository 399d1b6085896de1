"""slime's estimators (``ppo_utils.py``, ``distributed_utils.py``) and their CP forms."""

from __future__ import annotations

import torch

import rlops
from rlops._checks import as_real, check_2d, check_same_shape, check_unit_interval
from rlops._types import Group
from rlops.compat import _ragged
from rlops.compat._ragged import runs, take_runs
from rlops.compat.slime._cp import check_samples, default_group, local_columns
from rlops.distributed.groups import group_rank_size


def _scores(rewards: object, device: torch.device) -> torch.Tensor:
    """slime's per-sample rewards as a floating tensor ``[B]``."""
    r = torch.as_tensor(rewards, device=device)
    return r if r.is_floating_point() else r.float()


def _batch_gae(rewards, values, gamma, lambd):
    """slime's ``[B, T]`` GAE arguments checked under slime's names, then :func:`rlops.gae`."""
    check_2d("rewards", rewards)
    check_same_shape("rewards", rewards, values=values)
    gamma = check_unit_interval("gamma", gamma)
    lambd = check_unit_interval("lambd", lambd)
    return rlops.gae(rewards, values, gamma=gamma, lam=lambd)


def vanilla_gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lambd: float):
    """GAE (https://arxiv.org/abs/1506.02438) on a padded ``[B, T]`` batch: ``(adv, returns)``.

    Example:
        >>> vanilla_gae(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.5]]), 1.0, 1.0)
        (tensor([[0.5000, 0.5000]]), tensor([[1., 1.]]))
    """
    return _batch_gae(rewards, values, gamma, lambd)


def chunked_gae(
    rewards: torch.Tensor, values: torch.Tensor, gamma: float, lambd: float, chunk_size: int = 128
):
    """:func:`vanilla_gae` (slime's chunked scan); ``chunk_size`` is ignored.

    Example:
        >>> chunked_gae(torch.tensor([[1.0, 1.0]]), torch.zeros(1, 2), 0.5, 1.0)[0]
        tensor([[1.5000, 1.0000]])
    """
    return _batch_gae(rewards, values, gamma, lambd)


def chunked_discounted_returns(
    rewards: torch.Tensor, discount: float, chunk_size: int = 128
) -> torch.Tensor:
    """``G_t = r_t + discount·G_{t+1}`` of a ``[B, T]`` batch; ``chunk_size`` is ignored.

    Example:
        >>> chunked_discounted_returns(torch.tensor([[1.0, 0.0, 2.0]]), 0.5)
        tensor([[1.5000, 1.0000, 2.0000]])
    """
    check_2d("rewards", rewards)
    return rlops.discounted_cumsum(rewards, check_unit_interval("discount", discount))


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
    """GAE over per-sample responses (CP: rlops' CP scan, no all-gather).

    Example:
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
            return _whole_gae(values_list, rewards_list, list(response_lengths), gamma, lambd)
        _, cols, width = local_columns(total_lengths, response_lengths, size, rank)
        lengths = [c.numel() for c in cols]
        dtype = torch.promote_types(values_list[0].dtype, rewards_list[0].dtype)
        v, mask, index = _ragged.place(values_list, cols, width, dtype)
        r, _, _ = _ragged.place(rewards_list, cols, width, dtype)
        adv, ret = rlops.gae(r, v, gamma=gamma, lam=lambd, mask=mask, cp_group=cp_group)
        return _ragged.take(adv, index, lengths), _ragged.take(ret, index, lengths)


def _whole_gae(values_list, rewards_list, lengths, gamma, lambd):
    """:func:`get_advantages_and_returns_batch` without context parallelism."""
    for name, xs in (("values_list", values_list), ("rewards_list", rewards_list)):
        for i, (x, n) in enumerate(zip(xs, lengths)):
            if x.numel() < n:
                raise ValueError(
                    f"{name}[{i}] has {x.numel()} entries, fewer than response_lengths[{i}] = {n}"
                )
    v = _ragged.pad([x[:n] for x, n in zip(values_list, lengths)])
    r = _ragged.pad([x[:n] for x, n in zip(rewards_list, lengths)], v.shape[1])
    # Zero right-padding bootstraps V = 0 after each response: no mask needed.
    adv, ret = rlops.gae(r, v, gamma=gamma, lam=lambd)
    return _ragged.split(adv, lengths), _ragged.split(ret, lengths)


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
    """REINFORCE++ returns per sample (https://arxiv.org/abs/2501.03262), tool tokens skipped.

    Example:
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
    """``rewards[i] − kl_coef·kl[i]`` per token (``loss_masks`` unused, as slime).

    Example:
        >>> kl = [torch.tensor([0.0, 1.0]), torch.tensor([2.0])]
        >>> get_reinforce_plus_plus_baseline_advantages(torch.tensor([1.0, -1.0]), kl, None, 0.5)
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
    """``rewards[i]`` broadcast to the shape of ``kl[i]``.

    Example:
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


def distributed_masked_whiten(
    values: torch.Tensor,
    mask: torch.Tensor,
    process_group: Group = None,
    shift_mean: bool = True,
    epsilon: float = 1e-8,
) -> torch.Tensor:
    """Whiten ``values`` by the mask-1 entries' mean and variance over ``process_group``'s ranks.

    Example:
        >>> distributed_masked_whiten(torch.tensor([1.0, 2.0, 3.0, 9.0]),
        ...                           torch.tensor([1, 1, 1, 0]))
        tensor([-1.,  0.,  1.,  0.])
    """
    group = default_group(process_group, "process_group")
    return rlops.masked_whiten(values, mask, shift_mean=shift_mean, eps=epsilon, group=group)
