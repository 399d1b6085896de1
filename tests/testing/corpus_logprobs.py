"""A corpus for :func:`rlops.testing.check_logprobs`: correct log-prob functions, which must pass
every check, and broken ones, each of which must fail the check it names.

Each entry is a :class:`Case`: the function, the contract's keywords it is checked with, and
(for a broken one) the check it targets. Every broken function's docstring says which check
fails and why. The functions follow the contract's call: ``fn(logits [N, V], target [N],
temperature) -> logp [N]`` or ``(logp [N], entropy [N])``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from trl.trainer.utils import selective_log_softmax

import rlops

__all__ = ["BROKEN", "CORRECT", "Case"]


class Case(NamedTuple):
    """One entry of a corpus: ``fn`` checked with the contract's keywords ``options``;
    ``check`` is the check a broken ``fn`` must fail (None for a correct one);
    ``temperatures`` None where the sweep's temperatures apply, else the only ones to use
    (a function without a temperature parameter is checked at τ = 1 alone)."""

    fn: Callable
    options: dict
    check: str | None = None
    temperatures: tuple[float, ...] | None = None


def _gather(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return x.gather(-1, target.long()[:, None])[:, 0]


def _entropy(lsm: torch.Tensor) -> torch.Tensor:
    """``−Σ p·log p`` from a log-softmax, ``p·log p`` read as 0 where ``p = 0``."""
    p = lsm.exp()
    return -(p * lsm.masked_fill(p == 0, 0.0)).sum(-1)


# --------------------------------------------------------------------------- correct
def linear_op_identity(logits, target, temperature):
    """rlops' linear op fed the given logits exactly: ``hidden = I_N`` ``[N, N]`` and
    ``weight = logitsᵀ`` ``[V, N]``, so ``hidden @ weightᵀ = logits`` (each output one product
    by 1 plus products by 0: exact in any dtype). A ``−inf`` logit would give ``0·(−inf) =
    NaN`` in the other rows' products, so it is fed as ``−1e30`` (whose ``exp`` underflows to
    0 exactly as ``−inf``'s does); the gradient reaches ``logits`` through ``weight``."""
    z = torch.where(torch.isneginf(logits), torch.full_like(logits, -1e30), logits)
    hidden = torch.eye(z.shape[0], dtype=z.dtype, device=z.device)
    return rlops.linear_logprobs_and_entropy(hidden, z.T, target, temperature=temperature)


def rlops_chunked(logits, target, temperature):
    """rlops' op with its chunked method named."""
    return rlops.logprobs_and_entropy(logits, target, temperature=temperature, method="chunked")


def torch_float32(logits, target, temperature):
    """Plain torch in float32: ``log_softmax`` + gather, ``−Σ p·log p`` guarded at ``p = 0``."""
    lsm = torch.log_softmax(logits.float() / temperature, dim=-1)
    return _gather(lsm, target), _entropy(lsm)


def torch_float64(logits, target, temperature):
    """The same in float64, returned as float64: more accurate than the float32 plain."""
    lsm = torch.log_softmax(logits.double() / temperature, dim=-1)
    return _gather(lsm, target), _entropy(lsm)


def verl_formulas(logits, target, temperature):
    """verl's ``logprobs_from_logits_v2`` (gather minus a per-row ``logsumexp``) and
    ``entropy_from_logits`` (``logsumexp(z) − Σ softmax(z)·z``), written in torch on
    ``z = logits.float() / τ`` (verl's actor divides the logits in their own dtype; dividing
    a float32 copy is the precise form). One change: ``softmax(z)·z`` is read as 0 where the
    probability is 0, as ``−inf`` logits need (verl's literal ``0·(−inf)`` is NaN: see
    :func:`verl_entropy_unguarded` among the broken ones)."""
    z = logits.float() / temperature
    lse = torch.stack([torch.logsumexp(row, dim=-1) for row in z])
    logp = _gather(z, target) - lse
    pd = torch.softmax(z, dim=-1)
    entropy = torch.logsumexp(z, dim=-1) - (pd * z.masked_fill(pd == 0, 0.0)).sum(-1)
    return logp, entropy


def chunked_online(logits, target, temperature, tile=128):
    """An online log-sum-exp over vocabulary tiles of 128 (the last tile partial), carrying per
    row the max ``m``, ``s = Σ e^{z−m}`` and ``t = Σ e^{z−m}·(z − m)``; entropy
    ``log s − t/s`` (no cancellation at large logits), every ``0·(−inf)`` guarded."""
    z = logits.float() / temperature
    n = z.shape[0]
    m = z.new_full((n,), -torch.inf)
    s = z.new_zeros(n)
    t = z.new_zeros(n)
    for part in z.split(tile, dim=-1):
        m_new = torch.maximum(m, part.amax(-1))
        safe = torch.where(torch.isfinite(m_new), m_new, 0.0)
        scale = torch.exp(m - safe)
        shift = torch.where(s > 0, m - safe, 0.0)
        e = torch.exp(part - safe[:, None])
        d = torch.where(e > 0, part - safe[:, None], 0.0)
        t = scale * (t + shift * s) + (e * d).sum(-1)
        s = scale * s + e.sum(-1)
        m = m_new
    logp = _gather(z, target) - (m + torch.log(s))
    return logp, torch.log(s) - t / s


def upcast_cross_entropy(logits, target, temperature):
    """For bfloat16 logits: upcast to float32 before anything (the division included), then
    ``−cross_entropy`` for the log-prob and ``softmax · log_softmax`` for the entropy."""
    z = logits.to(torch.float32) / temperature
    logp = -torch.nn.functional.cross_entropy(z, target.long(), reduction="none")
    return logp, _entropy(torch.log_softmax(z, dim=-1))


def no_temperature(logits, target):
    """A function without a temperature parameter (τ = 1 built in): plain float32 torch."""
    lsm = torch.log_softmax(logits.float(), dim=-1)
    return _gather(lsm, target), _entropy(lsm)


CORRECT: dict[str, Case] = {
    "rlops.logprobs_and_entropy": Case(rlops.logprobs_and_entropy, {}),
    "rlops_chunked": Case(rlops_chunked, {}),
    "linear_op_identity": Case(linear_op_identity, {}),
    "torch_float32": Case(torch_float32, {}),
    "torch_float64": Case(torch_float64, {}),
    "verl_formulas": Case(verl_formulas, {}),
    "trl.selective_log_softmax": Case(selective_log_softmax, {}),
    "chunked_online": Case(chunked_online, {}),
    "upcast_cross_entropy": Case(upcast_cross_entropy, {}),
    "no_temperature": Case(no_temperature, {}, temperatures=(1.0,)),
}


# --------------------------------------------------------------------------- broken
def computed_in_bfloat16(logits, target, temperature):
    """values: the whole log-softmax in bfloat16, returned as float32: errors of ~1e-2 where
    float32's plain computation has ~1e-6."""
    lsm = torch.log_softmax((logits.float() / temperature).bfloat16(), dim=-1).float()
    return _gather(lsm, target), _entropy(lsm)


def shape_n_by_1(logits, target, temperature):
    """values: correct numbers in the wrong shape, ``[N, 1]`` instead of ``[N]`` (a caller
    that broadcasts ``[N, 1]`` against ``[N]`` builds an ``[N, N]`` loss)."""
    logp, entropy = torch_float32(logits, target, temperature)
    return logp[:, None], entropy[:, None]


def off_by_one_target(logits, target, temperature):
    """values: the log-prob of the next token id (``target + 1 mod V``), not the target's."""
    lsm = torch.log_softmax(logits.float() / temperature, dim=-1)
    return _gather(lsm, (target.long() + 1) % logits.shape[-1]), _entropy(lsm)


def shifted_rows(logits, target, temperature):
    """values: row i reads row i − 1's logits (the logits shifted one position too far along
    the sequence, against the labels' shift)."""
    return torch_float32(logits.roll(1, dims=0), target, temperature)


def entropy_sign_flipped(logits, target, temperature):
    """values: the entropy returned as ``Σ p·log p`` (negative)."""
    logp, entropy = torch_float32(logits, target, temperature)
    return logp, -entropy


def entropy_in_bits(logits, target, temperature):
    """values: the entropy in bits (log₂) rather than nats."""
    logp, entropy = torch_float32(logits, target, temperature)
    return logp, entropy / torch.log(torch.tensor(2.0))


def topk_mass_not_renormalised(logits, target, temperature, k=50):
    """values: the entropy summed over the top-50 probabilities of the full softmax only,
    the dropped tail's mass neither counted nor renormalised away."""
    lsm = torch.log_softmax(logits.float() / temperature, dim=-1)
    top = lsm.topk(min(k, lsm.shape[-1]), dim=-1).values
    return _gather(lsm, target), _entropy(top)


def float16_accumulation(logits, target, temperature, tile=64):
    """values: ``Σ e^{z−m}`` accumulated tile by tile in a float16 carry (10-bit mantissa)."""
    z = logits.float() / temperature
    m = z.amax(-1)
    s = torch.zeros_like(m, dtype=torch.float16)
    for part in torch.exp(z - m[:, None]).split(tile, dim=-1):
        s = s + part.sum(-1).half()
    return _gather(z, target) - m - torch.log(s.float())


def dropped_tail_tile(logits, target, temperature, tile=256):
    """vocab_tail: an online log-sum-exp over whole tiles only, the partial last tile lost
    (with the row's largest logits there, every log-prob is far off)."""
    z = logits.float() / temperature
    full = z.shape[-1] // tile * tile
    lse = torch.logsumexp(z[:, :full], dim=-1) if full else torch.full_like(z[:, 0], -1e30)
    return _gather(z, target) - lse


def last_entry_dropped(logits, target, temperature):
    """vocab_tail: the normaliser over entries ``0 .. V−2`` (an exclusive upper bound read as
    inclusive): the last entry, the row's largest, is left out."""
    z = logits.float() / temperature
    return _gather(z, target) - torch.logsumexp(z[:, :-1], dim=-1)


def detached(logits, target, temperature):
    """gradients: the result leaves the graph (a kernel that returns no ``grad_fn``)."""
    return torch_float32(logits.detach(), target, temperature)


class _EntropyBackwardMissing(torch.autograd.Function):
    """A fused op whose hand-written backward has the log-prob's term only."""

    @staticmethod
    def forward(ctx, z, target):
        lsm = torch.log_softmax(z, dim=-1)
        ctx.save_for_backward(lsm, target)
        return _gather(lsm, target), _entropy(lsm)

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        lsm, target = ctx.saved_tensors
        onehot = torch.zeros_like(lsm).scatter_(-1, target.long()[:, None], 1.0)
        return g_logp[:, None] * (onehot - lsm.exp()), None


def entropy_backward_missing(logits, target, temperature):
    """gradients: the entropy requires grad but its backward returns the log-prob's term only
    (the ``∂H/∂z`` part forgotten in a fused backward)."""
    return _EntropyBackwardMissing.apply(logits.float() / temperature, target)


def temperature_twice(logits, target, temperature):
    """temperature: the caller divided already, and so does the function (τ²)."""
    return torch_float32(logits / temperature, target, temperature)


def temperature_ignored(logits, target, temperature):
    """temperature: the temperature is accepted and never applied."""
    return torch_float32(logits, target, 1.0)


def temperature_logp_only(logits, target, temperature):
    """temperature: the log-prob at τ, the entropy at τ = 1 (the division done after the
    entropy was taken)."""
    logp, _ = torch_float32(logits, target, temperature)
    _, entropy = torch_float32(logits, target, 1.0)
    return logp, entropy


def batch_max_float32(logits, target, temperature):
    """batch_invariance: one max over the whole batch instead of each row's: beside a row of
    logits of 100, a row's ``e^{z−100}`` is subnormal in float32 and its digits are lost."""
    z = logits.float() / temperature
    m = z.max()
    lse = m + torch.log(torch.exp(z - m).sum(-1))
    lsm = z - lse[:, None]
    return _gather(lsm, target), _entropy(lsm)


def unguarded_entropy(logits, target, temperature):
    """masked_vocab: ``p·log p`` evaluated as ``0·(−inf) = NaN`` at masked entries."""
    lsm = torch.log_softmax(logits.float() / temperature, dim=-1)
    return _gather(lsm, target), -(lsm.exp() * lsm).sum(-1)


def verl_entropy_unguarded(logits, target, temperature):
    """masked_vocab: verl's ``entropy_from_logits`` as written, ``logsumexp(z) − Σ
    softmax(z)·z``: at a ``−inf`` logit ``softmax(z)·z = 0·(−inf) = NaN``."""
    z = logits.float() / temperature
    logp = _gather(z, target) - torch.logsumexp(z, dim=-1)
    pd = torch.softmax(z, dim=-1)
    return logp, torch.logsumexp(z, dim=-1) - (pd * z).sum(-1)


def no_max_subtracted(logits, target, temperature):
    """large_logits: ``log Σ exp(z)`` without subtracting the max: ``exp(1e4) = inf``."""
    z = logits.float() / temperature
    return _gather(z, target) - torch.log(torch.exp(z).sum(-1))


def bfloat16_accumulation(logits, target, temperature, tile=64):
    """low_precision: on bfloat16 logits, the tiles' sums accumulated in bfloat16 (the input
    dtype); exact enough on float32 logits, so only the bfloat16 check sees it."""
    z = logits / temperature
    m = z.max(-1).values
    s = torch.zeros_like(m)
    for part in torch.exp(z - m[:, None]).split(tile, dim=-1):
        s = s + part.sum(-1)
    return (_gather(z, target) - m - torch.log(s)).float()


BROKEN: dict[str, Case] = {
    fn.__name__: Case(fn, {}, check)
    for fn, check in [
        (computed_in_bfloat16, "values"),
        (shape_n_by_1, "values"),
        (off_by_one_target, "values"),
        (shifted_rows, "values"),
        (entropy_sign_flipped, "values"),
        (entropy_in_bits, "values"),
        (topk_mass_not_renormalised, "values"),
        (float16_accumulation, "values"),
        (dropped_tail_tile, "vocab_tail"),
        (last_entry_dropped, "vocab_tail"),
        (detached, "gradients"),
        (entropy_backward_missing, "gradients"),
        (temperature_twice, "temperature"),
        (temperature_ignored, "temperature"),
        (temperature_logp_only, "temperature"),
        (batch_max_float32, "batch_invariance"),
        (unguarded_entropy, "masked_vocab"),
        (verl_entropy_unguarded, "masked_vocab"),
        (no_max_subtracted, "large_logits"),
        (bfloat16_accumulation, "low_precision"),
    ]
}
