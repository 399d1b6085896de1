"""Tensor parallelism of the log-prob ops: the group check's one fixed-size exchange before the
statistics, and the shards' layout it gives.

Every rank describes its call (:class:`Call`: sizes, dtype, flags, the head's map, the
sampler's scalars, and device checksums of the targets, the row mask, the CSR support and each
per-token sampler parameter); one exchange gives every rank the ``[world]`` shard sizes (its
first id, the whole vocabulary) or the same ``ValueError`` naming what disagrees. A rank whose
own checks failed joins it (:func:`fail_together`). ``RLOPS_TP_CHECK=0`` or
``RLOPS_GROUP_CHECK=0`` turns it off (then equal shards): ``docs/design/logprobs.md``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NoReturn, cast

import torch
import torch.distributed as dist

from rlops._types import Group
from rlops.distributed import collectives
from rlops.distributed.groups import group_rank_size
from rlops.logprobs._options import (
    Checked,
    Options,
    check_support_range,
    check_target_range,
)
from rlops.logprobs._support import Sampler

ENV = "RLOPS_TP_CHECK"
_TARGET = "target ids (position-weighted checksum)"
_MASK = "mask (position-weighted checksum)"
_SUPPORT = "support_ids and support_offsets (checksum)"
_PARAMS = ("top_k", "top_p", "min_p")
_TAU = "temperature (per-row checksum)"
# A difference in the key implies one in the values: only the key is reported.
_IMPLIED = {
    "tokens": (_TARGET, _MASK, _SUPPORT, _TAU, *(f"{p} (per-token checksum)" for p in _PARAMS)),
    "temperature": (_TAU,),
    "mask given": (_MASK,),
    "support_ids given": ("support_ids (nnz)", _SUPPORT),
    "support_ids (nnz)": (_SUPPORT,),
    "function": ("hidden size",),
    **{p: (f"{p} (per-token checksum)",) for p in ("top_k", "top_p", "min_p")},
}


def check_enabled() -> bool:
    """Whether the check runs: neither ``RLOPS_TP_CHECK`` nor ``RLOPS_GROUP_CHECK`` is ``0``."""
    return os.environ.get(ENV, "1") != "0" and collectives.check_enabled()


def checksum(values: torch.Tensor) -> torch.Tensor:
    """A 0-dim int64 of a tensor's bits on its device (no host read): ``Σ_t (2t + 1)·bits[t]``
    modulo ``2**64`` (``-0.0`` as ``0.0``). Order-independent sums; a difference at one
    position always shows (odd weights are invertible), and so does a permutation."""
    flat = values.detach().reshape(-1)
    if flat.is_floating_point():
        flat = flat + 0  # -0.0 + 0 is +0.0: equal values, equal bits
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
        flat = flat.view(ints)
    weights = torch.arange(1, 2 * flat.numel() + 1, 2, dtype=torch.int64, device=flat.device)
    return (flat.to(torch.int64) * weights).sum()


@dataclass(frozen=True)
class Call:
    """What one rank was asked to compute: everything that must agree across the group, and
    this rank's shard size ``v_local`` (which need not)."""

    op: str
    v_local: int
    tokens: int
    hidden: int
    dtype: torch.dtype
    with_entropy: bool
    entropy_grad: bool
    masked: bool
    temperature: float | torch.Tensor
    logit_scale: float = 1.0
    softcap: float | None = None
    sampler: Sampler | None = None
    entropy_over_support: bool = False
    sum_pi_squared: bool = False
    bias: bool = False
    row_mask: torch.Tensor | None = None
    support: tuple[torch.Tensor, torch.Tensor] | None = None
    logits_dtype: torch.dtype | None = None

    def described(self, target: torch.Tensor) -> collectives.Call:
        """The group check's description, with the checksums of ``target`` and of the
        sampler's per-token tensors (on their device)."""
        per_row = isinstance(self.temperature, torch.Tensor)
        fields: dict[str, object] = {
            "tokens": self.tokens,
            "hidden size": self.hidden,
            "bias given": self.bias,
            "dtype": self.dtype,
            "logits_dtype": self.logits_dtype,
            "with_entropy": self.with_entropy,
            "entropy_grad": self.entropy_grad,
            "with_sum_pi_squared": self.sum_pi_squared,
            "keep_mask given": self.masked,
            "temperature": "per row" if per_row else self.temperature,
            "logit_scale": self.logit_scale,
            "final_logit_softcapping": self.softcap,
        }
        params = (
            (None, None, None)
            if self.sampler is None
            else (self.sampler.top_k, self.sampler.top_p, self.sampler.min_p)
        )
        for name, p in zip(("top_k", "top_p", "min_p"), params, strict=True):
            if isinstance(p, torch.Tensor):
                fields[name] = "per token"
                fields[f"{name} (per-token checksum)"] = checksum(p)
            else:
                fields[name] = p
        fields["entropy_over_support"] = self.entropy_over_support
        fields["mask given"] = self.row_mask is not None
        if self.row_mask is not None:
            fields[_MASK] = checksum(self.row_mask.to(torch.int8))
        fields["support_ids given"] = self.support is not None
        if self.support is not None:
            ids, offsets = self.support
            fields["support_ids (nnz)"] = ids.numel()
            fields[_SUPPORT] = checksum(ids.long()) + checksum(offsets.long()) * 3
        if isinstance(self.temperature, torch.Tensor):
            fields[_TAU] = checksum(self.temperature)
        fields[_TARGET] = checksum(target)
        return collectives.Call(self.op, implied=_IMPLIED, **fields)


def _fallback_device(group: dist.ProcessGroup) -> torch.device:
    """Where the exchange lives when a rank's own inputs gave no usable device."""
    if "nccl" in str(dist.get_backend(group)).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def fail_together(
    group: dist.ProcessGroup, op: str, error: Exception, device: torch.device | None
) -> NoReturn:
    """Join the exchange as a rank of the op named ``op`` whose local checks raised ``error``,
    then raise it. ``device``: where the exchange goes (the inputs' device), or None."""
    dev = device if device is not None else _fallback_device(group)
    payload = torch.zeros(1, dtype=torch.float64, device=dev)
    collectives.exchange(payload, group, collectives.Call(op), failed=error)
    raise error  # exchange raised it already; for the type checker


def shard_layout(
    group: dist.ProcessGroup, rank: int, call: Call, target: torch.Tensor
) -> tuple[int, int]:
    """Exchange the descriptions; return ``(this shard's first id, full vocabulary size)`` or
    raise the same ``ValueError`` on every rank. ``target``: this rank's ids (the device)."""
    payload = torch.tensor([float(call.v_local)], dtype=torch.float64, device=target.device)
    rows = collectives.exchange(payload, group, call.described(target))
    sizes = [int(row[0]) for row in rows]
    return sum(sizes[:rank]), sum(sizes)


def call_of(op: str, inputs: Checked, options: Options, sampler: Sampler | None) -> Call:
    """What this rank was asked to compute (``sampler``: the checked one)."""
    return Call(
        op=op,
        v_local=inputs.v_local,
        tokens=inputs.target.numel(),
        hidden=inputs.hidden,
        bias=inputs.bias is not None,
        dtype=inputs.x.dtype,
        logits_dtype=inputs.logits_dtype,
        with_entropy=options.with_entropy,
        entropy_grad=options.entropy_grad,
        sum_pi_squared=options.with_sum_pi_squared,
        masked=inputs.keep is not None,
        row_mask=inputs.mask,
        support=inputs.support,
        temperature=inputs.temperature,
        logit_scale=inputs.logit_scale,
        softcap=inputs.softcap,
        sampler=sampler,
        entropy_over_support=options.entropy_over_support,
    )


def vocab_layout(
    call: Call | None,
    target: torch.Tensor,
    sampler: Sampler | None,
    *,
    group: Group,
    rank: int,
    world: int,
    v_local: int,
    support_ids: torch.Tensor | None = None,
) -> tuple[int, Sampler | None]:
    """``(this shard's first id, the sampler for the whole vocabulary)``: from the exchange's
    shard sizes when ``call`` is given, else ``rank * v_local``. Checks the targets (and CSR
    ids) against the whole vocabulary; an int ``top_k`` is capped at it."""
    if call is not None:
        pg = cast(dist.ProcessGroup, group)  # a group of world > 1 ranks (group_rank_size)
        start, vocab = shard_layout(pg, rank, call, target)
    else:
        start, vocab = rank * v_local, world * v_local
    check_target_range(target, vocab)
    if support_ids is not None:
        check_support_range(support_ids, vocab)
    return start, (None if sampler is None else sampler.capped(vocab))


def gather_stats(stats: torch.Tensor, group: Group, world: int) -> torch.Tensor:
    """``[N, k]`` local statistics → ``[world, N, k]``: the forward's one data collective."""
    if world == 1:
        return stats.unsqueeze(0)
    out = stats.new_empty((world * stats.shape[0], stats.shape[1]))
    # Newer torch renames all_gather_into_tensor to all_gather_single and deprecates the old name.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, stats.contiguous(), group=group)
    return out.view(world, stats.shape[0], stats.shape[1])


class _CopyToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if ctx.group is not None and dist.get_world_size(ctx.group) > 1:
            dist.all_reduce(grad, group=ctx.group)
        return grad, None


def copy_to_tensor_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Identity in the forward; all-reduce (sum) of the gradient over ``group`` in the backward.

    The input op of a column-parallel layer: apply it to the replicated hidden states before
    :func:`~rlops.logprobs.linear_logprobs_and_entropy` with a vocabulary-sharded weight,
    unless the framework already does (Megatron's ``copy_to_tensor_model_parallel_region``),
    so that every rank gets the full gradient of ``hidden``. ``group=None``: the identity.

    Example:
        >>> import torch
        >>> x = torch.ones(2, requires_grad=True)
        >>> copy_to_tensor_parallel_region(x).sum().backward()
        >>> x.grad
        tensor([1., 1.])
    """
    group_rank_size(group)
    return _CopyToTensorParallelRegion.apply(x, group)
