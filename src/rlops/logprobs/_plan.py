"""The plan of one log-prob call on this rank's vocabulary shard: what the chunk engine reads.

One frozen object instead of a dozen positional arguments. The op's preamble
(:func:`rlops.logprobs._engine.prepare`) fixes the call: the tokens, this shard's place in
the vocabulary, the chunk, the compute dtype, the flags, the sampler. Each pass then binds its
tensors with :func:`dataclasses.replace`: the flattened targets and keep mask (forward and
backward), the sampler's per-token threshold, and in the backward the saved statistics and the
upstream gradients. Nothing in a plan is modified; its tensors are only read (but for the
threshold buffer that the forward's chunks fill in one process).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from rlops.logprobs import _shard
from rlops.logprobs._support import Sampler

__all__ = ["Plan"]


@dataclass(frozen=True, kw_only=True)
class Plan:
    """One call of a log-prob op, as this rank's chunk loops run it.

    Fixed for the call:

    - ``rows``: N, the tokens (the rows of the ``[N, V_local]`` logits);
    - ``v_local``, ``start``: this shard's vocabulary size and first id;
    - ``chunk``: tokens per chunk; ``dtype``: the compute dtype (float32, or float64);
      ``device``; ``lead``: the outputs' shape ``[...]``;
    - ``temperature`` (``inv_tau = 1 / temperature``), ``with_entropy``, ``entropy_grad``;
    - ``sum_pi_squared``: the statistics also carry each shard's own ``Σ p²`` of the log-prob
      distribution (the op's third output, ``Σ_v p_v²``);
    - ``masked``: the log-prob is over a support (a keep mask, or the sampler's without
      ``over_support``), so that the statistics carry a second ``(m, s)``;
    - ``sampler``, ``over_support``: the sampler's filters, and whether the entropy too is
      over their support;
    - ``group``, ``world``: the tensor-parallel group and its size (1: one process).

    Bound per pass (None when not bound):

    - ``target`` ``[N]`` int64 and ``keep`` ``[N, V_local]`` bool (None: no keep mask);
    - ``threshold`` ``[N, 1]``: the sampler's support is ``z ≥ threshold``;
    - backward: ``saved``, the per-token statistics of :func:`rlops.logprobs._shard.merge`
      as ``[N, 1]`` columns ``(M, log S)`` of the log-prob distribution then ``(M, log S, H)``
      of the unmasked one (:func:`rlops.logprobs._shard.unpack_saved`), and the upstream
      gradients ``g_logp``, ``g_ent`` ``[N, 1]`` in the compute dtype (None: no gradient).
    """

    rows: int
    v_local: int
    start: int = 0
    chunk: int
    dtype: torch.dtype
    device: torch.device
    lead: tuple[int, ...] = ()
    temperature: float = 1.0
    with_entropy: bool = True
    entropy_grad: bool = True
    sum_pi_squared: bool = False
    masked: bool = False
    sampler: Sampler | None = None
    over_support: bool = False
    group: object = None
    world: int = 1
    target: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    threshold: torch.Tensor | None = None
    saved: tuple[torch.Tensor, ...] = ()
    g_logp: torch.Tensor | None = None
    g_ent: torch.Tensor | None = None

    @property
    def inv_tau(self) -> float:
        return 1.0 / self.temperature

    @property
    def starts(self) -> range:
        """The first token of every chunk (one chunk when ``chunk`` is ``rows`` itself, as under
        ``torch.compile``: no range over a symbolic length, which would specialise it)."""
        if self.chunk is self.rows:
            return range(1)
        return range(0, self.rows, self.chunk)

    def bound(self, target: torch.Tensor, keep: torch.Tensor | None) -> Plan:
        """This plan with the op's ``target`` ``[...]`` and ``keep`` ``[..., V_local]`` bound,
        flattened to ``[N]`` and ``[N, V_local]``."""
        flat_keep = None if keep is None else keep.reshape(-1, self.v_local)
        return replace(self, target=target.reshape(-1), keep=flat_keep)

    def unbound(self) -> Plan:
        """This plan without its tensors (what the backward keeps beside the saved tensors)."""
        return replace(self, target=None, keep=None, sampler=None, threshold=None)

    def tile(self, v0: int, v1: int) -> Plan:
        """The plan of this shard's vocabulary columns ``v0:v1`` (a tile's local gradient)."""
        keep = None if self.keep is None else self.keep[:, v0:v1]
        return replace(self, start=self.start + v0, v_local=v1 - v0, keep=keep)

    def target_index(self, i: int, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``i:j``: ``([C, 1]`` target column in the shard, ``[C, 1]`` bool: in it)."""
        if self.target is None:
            raise RuntimeError("the plan has no target bound")
        return _shard.target_index(self.target[i:j], self.start, self.v_local)

    def keep_rows(self, i: int, j: int) -> torch.Tensor | None:
        """Tokens ``i:j`` of the keep mask, or None."""
        return None if self.keep is None else self.keep[i:j]
