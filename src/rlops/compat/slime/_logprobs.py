"""slime's log-probs (``ppo_utils.py``, ``megatron_utils/loss.py``)."""

from __future__ import annotations

import torch

import rlops
from rlops.compat import _ragged
from rlops.compat.slime._cp import default_group


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
    """Log-probs ``[T, 1]`` (and entropy ``[T]``) from vocabulary-parallel logits ``[T, V_local]``.

    Example:
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
        group=default_group(tp_group, "tp_group"),
        chunk_size=chunk_size if chunk_size > 0 else None,
    )
    return logp.unsqueeze(-1), entropy


def _response_rows(total_lengths, response_lengths, n_rows: int) -> tuple[list[int], list[int]]:
    """Each sample's first response row in the packed logits and its length."""
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
    """slime's per-sample top-p sets as one CSR over the packed rows (built on the host)."""
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
    """Per-sample response log-probs (and entropy) from slime's packed logits, in one call.

    Example:
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
    targets, rows = _targets_and_rows(tokens_list, loss_masks, starts, lengths, n_rows, device)
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


def _targets_and_rows(tokens_list, loss_masks, starts, lengths, n_rows, device):
    """The packed rows' targets and the rows to compute (responses, loss mask 1)."""
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
    return targets, rows
