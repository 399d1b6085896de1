"""The policy-loss contract: :func:`check_policy_loss`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlops._checks import check_choice
from rlops._types import EMPTY_ROWS, EmptyRows
from rlops.losses import AGG_MODES, policy_loss
from rlops.testing import _common as common
from rlops.testing.report import Report

__all__ = ["POLICY_LOSS_CHECKS", "check_policy_loss"]

POLICY_LOSS_CHECKS = ("values", "gradients", "constants", "micro_batch_invariance")

_EXPLAIN = {
    "values": "the loss differs from the kind's definition with these clips and this "
    "aggregation (a wrong clip side, empty rows counted, padding not masked), or is not a "
    "0-dim tensor",
    "gradients": "the gradient differs from the definition's (a fused backward written "
    "apart from the forward and drifted, a clip mask missing in the backward)",
    "constants": "old_logp or the advantages carry gradient (e.g. old_logp = logp without "
    ".detach() on-policy): the update differentiates through the fixed policy",
    "micro_batch_invariance": "micro-batch losses do not sum to the full batch's: the "
    "normaliser is the micro-batch's own count where the global one is meant, so the loss "
    "scale follows the micro-batch split",
}

#: the counts each aggregation mode needs to be split into micro-batches exactly
_COUNTS = {
    "token-mean": ("num_tokens",),
    "token-sum": (),
    "seq-mean-token-sum": ("num_seqs",),
    "seq-mean-token-mean": ("num_seqs",),
    "seq-mean-token-sum-norm": ("num_seqs",),
}
#: row lengths of the batch: different lengths, one row with no action token, a full row
_LENGTHS = (48, 31, 0, 17, 1, 40, 25, 9)
#: the micro-batches the rows are split into (the empty row in the first)
_SPLITS = ((0, 3), (3, 5), (5, 8))


def _batch(seed: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """``(logp, old_logp, advantages, mask)`` ``[8, 48]`` float32: ratios spread over the
    clip range and beyond a dual clip, one advantage sign per token, a multi-turn mask (a
    gap of mask 0 inside the first row) and padding that holds arbitrary finite values."""
    g = common.generator(seed)
    b, t = len(_LENGTHS), max(_LENGTHS)
    mask = torch.arange(t)[None] < torch.tensor(_LENGTHS)[:, None]
    mask[0, 10:15] = False  # tool output inside a turn
    old = -3.0 * torch.rand(b, t, generator=g)
    logp = old + 0.3 * torch.randn(b, t, generator=g)
    logp[:, 3::7] += 1.5  # ratios past a dual clip (e^1.5 ≈ 4.5) and far below 1
    logp[:, 5::11] -= 1.5
    adv = torch.randn(b, t, generator=g)
    return tuple(x.to(device) for x in (logp, old, adv, mask))


@dataclass(frozen=True)
class _Setup:
    """One run of the contract: the function, the definition's options, the batch."""

    fn: Callable
    kind: str
    agg: str
    options: dict
    loss_scale_factor: float | None
    empty_rows: EmptyRows
    batch: tuple[torch.Tensor, ...]

    def definition(
        self,
        lp: torch.Tensor,
        dtype: torch.dtype,
        rows: slice = slice(None),
        counts: dict[str, float] | None = None,
        magnitude: bool = False,
    ) -> torch.Tensor:
        """:func:`rlops.policy_loss` in ``dtype`` on rows ``rows``; with ``magnitude``, on the
        advantages' absolute values (every summand of one sign: the magnitude of the sum)."""
        _, old, adv, mask = self.batch
        adv = adv.abs() if magnitude else adv
        extra: dict = {**(counts or {}), **self.options}  # counts and the kind's options
        return policy_loss(
            lp,
            old[rows].to("cpu", dtype),
            adv[rows].to("cpu", dtype),
            mask[rows].cpu(),
            kind=self.kind,
            agg=self.agg,
            loss_scale_factor=self.loss_scale_factor,
            empty_rows=self.empty_rows,
            **extra,
        )[0]

    def call(self, lp, o, a, m, **counts: object) -> torch.Tensor:
        """``fn``'s loss, which must be a 0-dim tensor (nothing is reshaped)."""
        loss = common.first(self.fn(lp, o, a, m, **counts), "the loss")
        if loss.dim() != 0:
            raise ValueError(
                f"the function's loss has shape {list(loss.shape)}, the definition's is [] "
                "(a 0-dim tensor)"
            )
        return loss

    def size(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The magnitude of the loss's summands (see :meth:`definition`)."""
        lp = self.batch[0].to("cpu", dtype)
        return self.definition(lp, dtype, magnitude=True).abs()


def _grad_of(loss: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    if not loss.requires_grad:
        return None
    return torch.autograd.grad(loss, x, allow_unused=True)[0]


def _row_scale(grad: torch.Tensor) -> torch.Tensor:
    """Each row's largest gradient element: the magnitude a sequence-level kind's gradient
    terms combine at."""
    return grad.detach().abs().amax(-1, keepdim=True)


# --------------------------------------------------------------------------- the checks
def _values(s: _Setup):
    logp, old, adv, mask = s.batch
    got = s.call(logp, old, adv, mask)
    ref = s.definition(logp.to("cpu", torch.float64), torch.float64)
    m = common.measure(got, ref, s.definition(logp.cpu(), torch.float32), scale=s.size())
    return m.ok, m.err, f"loss {float(got.detach()):.6g}; {m.text()}"


def _gradients(s: _Setup):
    logp, old, adv, mask = s.batch
    lp = logp.clone().requires_grad_(True)
    got = _grad_of(s.call(lp, old, adv, mask), lp)
    if got is None:
        return False, None, "no gradient reaches logp"
    refs = []
    for dt in (torch.float64, torch.float32):
        x = logp.to("cpu", dt).requires_grad_(True)
        refs.append(torch.autograd.grad(s.definition(x, dt), x)[0])
    m = common.measure(got, refs[0], refs[1], scale=_row_scale(refs[0]))
    return m.ok, m.err, f"dloss/dlogp {m.text()}"


def _constants(s: _Setup):
    logp, old, adv, mask = s.batch
    lp = logp.clone().requires_grad_(True)
    o = old.clone().requires_grad_(True)
    a = adv.clone().requires_grad_(True)
    loss = s.call(lp, o, a, mask)
    parts, worst = [], 0.0
    if loss.requires_grad:
        grads = torch.autograd.grad(loss, (o, a), allow_unused=True)
        for name, gr in zip(("old_logp", "advantages"), grads, strict=True):
            size = 0.0 if gr is None else float(gr.abs().max())
            worst = max(worst, size)
            parts.append(f"|d/d{name}| {size:.2e}")
    lp = logp.clone().requires_grad_(True)
    same = _grad_of(s.call(lp, lp, adv, mask), lp)
    lp2 = logp.clone().requires_grad_(True)
    detached = _grad_of(s.call(lp2, lp2.detach(), adv, mask), lp2)
    if same is not None and detached is not None:
        d = float((same - detached).abs().max())
        parts.append(f"old_logp=logp vs logp.detach(): grad difference {d:.2e}")
        worst = max(worst, d)
    return worst == 0.0, worst, "; ".join(parts)


def _micro_batch_invariance(s: _Setup):
    logp, old, adv, mask = s.batch
    names = _COUNTS[s.agg]
    missing = [n for n in names if not common.accepts(s.fn, n)]
    if missing:
        return (
            None,
            None,
            f"skipped: {s.agg} needs {missing[0]}= (the global count), "
            "which the function does not take",
        )
    keep = mask.cpu()
    seqs = keep.shape[0] if s.empty_rows == "count" else keep.any(-1).sum()
    counts_all = {"num_tokens": float(keep.sum()), "num_seqs": float(seqs)}
    counts = {n: counts_all[n] for n in names}
    lp = logp.clone().requires_grad_(True)
    full = s.call(lp, old, adv, mask)
    full_grad = _grad_of(full, lp)
    pieces = [logp[a:b].clone().requires_grad_(True) for a, b in _SPLITS]
    losses = [
        s.call(p, old[a:b], adv[a:b], mask[a:b], **counts)
        for p, (a, b) in zip(pieces, _SPLITS, strict=True)
    ]
    total = torch.stack([x.to(torch.float64) for x in losses]).sum()
    grads = [_grad_of(x, p) for x, p in zip(losses, pieces, strict=True)]

    x64 = logp.to("cpu", torch.float64).requires_grad_(True)
    ref64 = s.definition(x64, torch.float64)
    (grad64,) = torch.autograd.grad(ref64, x64)
    x32 = logp.cpu().requires_grad_(True)  # the definition split, in float32: the plain
    sum32 = torch.stack(
        [s.definition(x32[a:b], torch.float32, slice(a, b), counts) for a, b in _SPLITS]
    ).sum()
    (grad32,) = torch.autograd.grad(sum32, x32)
    m = common.measure(total.to(torch.float32), ref64, sum32, scale=s.size())
    ok, worst = m.ok, m.err
    text = (
        f"sum of micro-batch losses {float(total.detach()):.6g} (full batch "
        f"{float(full.detach()):.6g}): " + m.text()
    )
    if full_grad is not None and all(gr is not None for gr in grads):
        got = torch.cat([gr for gr in grads if gr is not None])
        mg = common.measure(got, grad64, grad32, scale=_row_scale(grad64))
        ok, worst = ok and mg.ok, max(worst, mg.err)
        text += f"; gradient {mg.text()}"
    else:
        ok = False
        text += "; no gradient reaches logp in a micro-batch"
    return ok, worst, text


_BODIES = {
    "values": _values,
    "gradients": _gradients,
    "constants": _constants,
    "micro_batch_invariance": _micro_batch_invariance,
}


def check_policy_loss(
    fn: Callable,
    *,
    agg: str,
    kind: str = "ppo",
    clip_low: float | None = None,
    clip_high: float | None = None,
    loss_scale_factor: float | None = None,
    empty_rows: EmptyRows = "skip",
    device: str | torch.device = "cpu",
    seed: int = 0,
    **kind_params: object,
) -> Report:
    """Check a policy-loss function against :func:`rlops.policy_loss`.

    ``fn(logp [B, T], old_logp [B, T], advantages [B, T], mask [B, T]) -> loss`` (a 0-dim
    tensor, or a tuple starting with one: ``(loss, metrics)``, verl's 4-tuple). To be checked
    for micro-batch invariance it also takes the global counts as keywords, ``num_tokens=``
    (``token-mean``) or ``num_seqs=`` (the ``seq-mean`` modes), with
    :func:`rlops.aggregate_loss`'s meaning. The definition is :func:`rlops.policy_loss` with
    ``kind``, the clips, ``kind_params`` and ``agg`` in float64; the rule: within
    ``2·e + 4·eps·M`` of it, ``e`` the error of :func:`rlops.policy_loss` in float32 on the
    same inputs, ``M`` the magnitude of the summands (the same loss on ``|advantages|``; for a
    gradient, its row's largest element). The loss must be a 0-dim tensor.

    The batch: 8 rows of lengths 48, 31, 0, 17, 1, 40, 25, 9 (one without an action token),
    a gap of mask 0 inside the first row, ratios ``exp(N(0, 0.3))`` (many clipped) and
    ``e^{±1.5}`` on every 7th / 11th token (past a dual clip of 3),
    per-token advantages, arbitrary finite values on mask-0 tokens.

    Checks (in this order, with these names):

    * ``values``: the loss, within the rule.
    * ``gradients``: ``∂loss/∂logp`` reaches ``logp`` and is within the rule of the
      definition's.
    * ``constants``: no gradient reaches ``old_logp`` or ``advantages`` (given as leaves that
      require grad); and ``old_logp = logp`` (the same tensor, on-policy) gives the gradient
      of ``old_logp = logp.detach()``.
    * ``micro_batch_invariance``: the losses of micro-batches of rows 0–2, 3–4 and 5–7, each
      given the full batch's counts, sum to the full batch's loss, and their gradients are
      the full batch's, within the rule. Skipped when ``fn`` takes no count that ``agg``
      needs.

    Args:
        fn: the function under test.
        agg: the aggregation mode ``fn`` applies (verl's names, see :func:`rlops.aggregate_loss`).
        kind: the policy-loss kind ``fn`` computes (see :func:`rlops.policy_loss`).
        clip_low, clip_high: the clips ``fn`` uses (None: the kind's defaults).
        loss_scale_factor: ``L`` of ``seq-mean-token-sum-norm`` (None: ``T``).
        empty_rows: how ``fn`` counts the row without an action token in the sequence means:
            ``"skip"`` (verl's convention) or ``"count"`` (TRL's ``grpo`` / ``dr_grpo``:
            every row), see :func:`rlops.aggregate_loss`. The global ``num_seqs`` given to the
            micro-batches follows it.
        device: where the inputs are made; the definition runs on the CPU in float64.
        seed: the seed of the inputs.
        **kind_params: further options of the kind (``dual_clip=3.0`` for verl's
            ``clip_ratio_c``).

    Returns:
        a :class:`rlops.testing.Report` with the four checks above.

    Raises:
        ValueError, TypeError: ``agg``, ``kind``, a clip, ``loss_scale_factor``,
            ``empty_rows`` or a ``kind_params`` entry that :func:`rlops.policy_loss` rejects
            (naming it); ``fn``'s signature takes no four tensors; ``fn`` returns something
            other than a tensor or a tuple starting with one.

    Example:
        >>> import rlops
        >>> from rlops.testing import check_policy_loss
        >>> def loss_fn(logp, old_logp, advantages, mask, num_tokens=None):
        ...     return rlops.policy_loss(logp, old_logp, advantages, mask, clip_low=0.2,
        ...                              num_tokens=num_tokens)[0]
        >>> check_policy_loss(loss_fn, agg="token-mean", clip_low=0.2).failed
        []
    """
    check_choice("agg", agg, AGG_MODES)
    check_choice("empty_rows", empty_rows, EMPTY_ROWS)
    dev, s0 = common.check_device(device), common.check_seed(seed)
    sig = common.signature(fn)
    if sig is not None and not common.binds(sig, 0, 0, 0, 0):
        raise TypeError(
            f"check_policy_loss: {common.fn_name(fn)}{sig} takes no (logp, old_logp, advantages, "
            "mask): expected fn(logp, old_logp, advantages, mask[, num_tokens=, num_seqs=])"
        )
    options: dict[str, object] = dict(kind_params)
    if clip_low is not None:
        options["clip_low"] = clip_low
    if clip_high is not None:
        options["clip_high"] = clip_high
    s = _Setup(fn, kind, agg, options, loss_scale_factor, empty_rows, _batch(s0, dev))
    s.size()  # the definition once: a bad kind, clip or option raises here, naming it
    common.preflight(lambda: fn(*s.batch), "the loss")
    shown = [f"agg={agg!r}", f"kind={kind!r}"]
    if empty_rows != "skip":
        shown.append(f"empty_rows={empty_rows!r}")
    bodies = {name: (lambda body=body: body(s)) for name, body in _BODIES.items()}
    return common.run_checks("check_policy_loss", fn, shown, _EXPLAIN, bodies)
