"""Why a rollout engine's log-probs differ from the trainer's: :func:`diagnose_mismatch`."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from rlops._checks import (
    as_float_tensor,
    as_int,
    check_finite_positive,
    check_ids,
    check_logit_scale,
    check_softcap,
    check_unit_interval,
    shape_error,
)
from rlops.testing.report import by_name

__all__ = ["MismatchReport", "MismatchRow", "diagnose_mismatch"]

#: a token "differs" past this absolute log-prob difference; a best mean past it explains nothing
BEYOND = 1e-2
#: the first window of largest logits sorted per row for the sampler's support (a chunk whose
#: support fills it is redone with a window four times as wide, up to the vocabulary)
_WINDOW = 1024
#: float64 elements of one ``[rows, V]`` buffer
_CHUNK_ELEMENTS = 1 << 23
_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class MismatchRow:
    """One hypothesis on how the engine computed its log-probs, and how well it fits them.

    Attributes:
        name: the hypothesis (``"temperature, top-p renormalised, bf16 logits"``).
        mean_abs_diff / max_abs_diff: of ``d = trainer − engine`` over the compared tokens.
        kl: the k3 estimator ``exp(d) − 1 − d``, averaged over the compared tokens.
        share_beyond_1e_2: share of the compared tokens with ``|d| > 1e-2``.
        options: the keyword options of rlops' log-prob ops that compute this hypothesis
            (``temperature``, ``top_k`` / ``top_p`` / ``min_p``, ``logit_scale``,
            ``final_logit_softcapping``).
        logits_dtype: the dtype the logits are rounded to before the softmax (float32: not
            rounded), or None where the given logits were already 16-bit.
        shift: 0, or ±1 where ``target[t]`` is scored by logits row ``t ± 1``.
    """

    name: str
    mean_abs_diff: float
    max_abs_diff: float
    kl: float
    share_beyond_1e_2: float
    options: dict[str, object] = field(default_factory=dict)
    logits_dtype: torch.dtype | None = None
    shift: int = 0


@dataclass(frozen=True)
class MismatchReport:
    """The hypotheses of :func:`diagnose_mismatch`, best first, and its verdict."""

    rows: tuple[MismatchRow, ...]
    tokens: int
    verdict: str

    @property
    def best(self) -> MismatchRow:
        """The hypothesis that fits the engine's log-probs best."""
        return self.rows[0]

    @property
    def explained(self) -> bool:
        """Whether the best hypothesis is within ``1e-2`` of the engine on average."""
        return self.rows[0].mean_abs_diff <= BEYOND

    def __iter__(self) -> Iterator[MismatchRow]:
        return iter(self.rows)

    def __getitem__(self, name: str) -> MismatchRow:
        return by_name(self.rows, name, "hypothesis")

    def table(self, shown: int = 12) -> str:
        """The first ``shown`` hypotheses as a table, and the verdict."""
        width = max(len("hypothesis"), *(len(r.name) for r in self.rows[:shown]))
        head = f"{'hypothesis':<{width}}  mean|d|   max|d|    kl (k3)   |d|>1e-2"
        lines = [f"diagnose_mismatch: {self.tokens} tokens, {len(self.rows)} hypotheses", head]
        lines.append("-" * len(head))
        lines += [
            f"{r.name:<{width}}  {r.mean_abs_diff:.2e}  {r.max_abs_diff:.2e}  {r.kl:.2e}  "
            f"{100 * r.share_beyond_1e_2:7.2f}%"
            for r in self.rows[:shown]
        ]
        if len(self.rows) > shown:
            lines.append(f"... {len(self.rows) - shown} more")
        return "\n".join([*lines, f"verdict: {self.verdict}"])

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return "\n" + str(self)


@dataclass(frozen=True)
class _Hypothesis:
    temperature: bool
    renormalised: bool
    rounded: bool
    head: bool
    shift: int


@dataclass(frozen=True)
class _Sampler:
    """The settings given, checked: which axes of the grid exist."""

    temperature: float
    top_k: int | None
    top_p: float | None
    min_p: float | None
    logit_scale: float
    softcap: float | None
    rounding: torch.dtype | None  # None: the logits are already 16-bit

    @property
    def filters(self) -> bool:
        return self.top_k is not None or self.top_p is not None or self.min_p is not None

    @property
    def has_head(self) -> bool:
        return self.logit_scale != 1.0 or self.softcap is not None

    def grid(self) -> list[_Hypothesis]:
        axes = (
            (False, True) if self.temperature != 1.0 else (False,),
            (False, True) if self.filters else (False,),
            (False, True) if self.rounding is not None else (False,),
            (False, True) if self.has_head else (False,),
        )
        return [_Hypothesis(*a, shift=s) for s in (0, 1, -1) for a in itertools.product(*axes)]

    def name(self, h: _Hypothesis) -> str:
        parts = []
        if self.temperature != 1.0:
            parts.append("temperature" if h.temperature else "no temperature")
        if self.filters:
            f = "+".join(
                n
                for n, v in (("top-k", self.top_k), ("top-p", self.top_p), ("min-p", self.min_p))
                if v is not None
            )
            parts.append(f"{f} renormalised" if h.renormalised else f"{f} not renormalised")
        if self.rounding is not None:
            parts.append(f"{_SHORT[self.rounding]} logits" if h.rounded else "float32 logits")
        if self.has_head:
            maps = " and ".join(
                n
                for n, on in (("logit scale", self.logit_scale != 1.0), ("softcap", self.softcap))
                if on
            )
            parts.append(maps if h.head else f"no {maps}")
        if h.shift:
            parts.append(f"shifted {h.shift:+d}")
        return ", ".join(parts) or "plain softmax"

    def options(self, h: _Hypothesis) -> dict[str, object]:
        out: dict[str, object] = {"temperature": self.temperature if h.temperature else 1.0}
        if h.renormalised:
            out.update(
                (k, v)
                for k, v in (("top_k", self.top_k), ("top_p", self.top_p), ("min_p", self.min_p))
                if v is not None
            )
        if h.head and self.logit_scale != 1.0:
            out["logit_scale"] = self.logit_scale
        if h.head and self.softcap is not None:
            out["final_logit_softcapping"] = self.softcap
        return out


# --------------------------------------------------------------------------- the definitions
def _z(
    raw: torch.Tensor, s: _Sampler, h: _Hypothesis, rounded: torch.Tensor | None
) -> torch.Tensor:
    """The hypothesis' scaled logits in float64: rounded (or not), head maps, temperature."""
    x = rounded if h.rounded and rounded is not None else raw
    if h.head and s.logit_scale != 1.0:
        x = x * s.logit_scale
    if h.head and s.softcap is not None:
        x = s.softcap * torch.tanh(x / s.softcap)
    return x / s.temperature if h.temperature else x


def _support_lse(
    zw: torch.Tensor, lse: torch.Tensor, s: _Sampler, partial: bool
) -> tuple[torch.Tensor, ...]:
    """On ``zw`` ``[n, W]``, a row's largest logits in descending order (``lse`` ``[n, 1]``
    its log-normaliser over the whole vocabulary): the log-normaliser over the sampler's
    support (vLLM's order: min-p, top-k, top-p on what the previous kept, as in
    ``rlops.logprobs.reference.sampler_keep_mask``), the smallest kept value, and whether a
    ``partial`` window is too short for the row (its support fills the window)."""
    keep = torch.ones_like(zw, dtype=torch.bool)
    if s.min_p is not None:
        keep &= zw >= zw[:, :1] + math.log(s.min_p)
    if s.top_k is not None:
        keep &= zw >= zw[:, s.top_k - 1 : s.top_k]
    bounded = s.min_p is not None or s.top_k is not None  # else top-p sees every token
    full = torch.zeros_like(keep[:, 0])
    if partial and bounded:
        full |= keep[:, -1]
    if s.top_p is not None:
        masked = zw.masked_fill(~keep, -math.inf)
        norm = torch.logsumexp(masked, dim=-1, keepdim=True) if bounded else lse
        q = torch.exp(masked - norm)  # renormalised over what min-p / top-k kept
        before = torch.cumsum(q, dim=-1) - q  # the mass strictly before each position
        last = (before < s.top_p).sum(dim=-1, keepdim=True) - 1
        keep &= zw >= masked.gather(-1, last.clamp(min=0))
        if partial:
            full |= keep[:, -1]
    kept = torch.logsumexp(zw.masked_fill(~keep, -math.inf), dim=-1)
    smallest = zw.gather(-1, (keep.sum(dim=-1, keepdim=True) - 1).clamp(min=0)).squeeze(-1)
    return kept, smallest, full


def _chunk_logps(
    raw: torch.Tensor, targets: torch.Tensor, s: _Sampler, grid: list[_Hypothesis], window: int
) -> torch.Tensor | None:
    """``[len(grid), n]``: each hypothesis' log-prob of row ``r``'s target for its shift
    (``targets`` ``[3, n]``, one row per shift 0, +1, −1) from ``raw`` ``[n, V]`` float64
    logits; None where the support of a row fills the ``window`` (retry with a wider one)."""
    v = raw.shape[-1]
    idx = raw.topk(window, dim=-1).indices if s.filters else None  # sorted, descending
    rounded = raw.to(s.rounding).double() if s.rounding is not None else None
    out = torch.empty(len(grid), raw.shape[0], dtype=torch.float64, device=raw.device)
    cache: dict[tuple[bool, ...], torch.Tensor] = {}
    for i, h in enumerate(grid):
        key = (h.temperature, h.renormalised, h.rounded, h.head)
        if key not in cache:
            z = _z(raw, s, h, rounded)
            zt = z.gather(-1, targets.T)  # [n, 3]
            lse = torch.logsumexp(z, dim=-1, keepdim=True)
            if h.renormalised and idx is not None:
                kept, smallest, full = _support_lse(z.gather(-1, idx), lse, s, window < v)
                if bool(full.any()):
                    return None
                # the target is always in the support (as in rlops' ops)
                outside = zt < smallest.unsqueeze(-1)
                kept = kept.unsqueeze(-1).expand_as(zt)
                lse = torch.where(outside, torch.logaddexp(kept, zt), kept)
            cache[key] = (zt - lse.expand_as(zt)).T
        out[i] = cache[key][(0, 1, -1).index(h.shift)]
    return out


def _raw_chunk(
    logits: torch.Tensor | None,
    hidden: torch.Tensor | None,
    weight: torch.Tensor | None,
    rows: slice,
) -> torch.Tensor:
    """Rows ``rows`` of the logits in float64 (``hidden @ weight.T`` in float64, the weight
    converted in vocabulary blocks)."""
    if logits is not None:
        return logits[rows].double()
    assert hidden is not None and weight is not None
    h = hidden[rows].double()
    block = max(1, _CHUNK_ELEMENTS // weight.shape[1])
    return torch.cat(
        [h @ weight[i : i + block].double().T for i in range(0, weight.shape[0], block)], dim=-1
    )


# --------------------------------------------------------------------------- inputs
def _check_inputs(
    engine_logprobs: object,
    logits: object,
    target: object,
    mask: object,
    hidden: object,
    weight: object,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """Flattened ``(engine [R], target [R], mask [R], T, V)`` with ``R = B·T`` rows."""
    if (logits is None) == (hidden is None and weight is None):
        raise TypeError(
            "give the logits either as logits [N, V] / [B, T, V] or as hidden [N, H] / "
            "[B, T, H] with weight [V, H], not both and not neither"
        )
    if logits is not None:
        x = as_float_tensor("logits", logits)
        if x.dim() not in (2, 3):
            raise shape_error("logits", "[N, V] or [B, T, V]", x.shape)
        lead, v = tuple(x.shape[:-1]), x.shape[-1]
    else:
        if hidden is None or weight is None:
            raise TypeError("hidden and weight go together: hidden [N, H], weight [V, H]")
        hd, w = as_float_tensor("hidden", hidden), as_float_tensor("weight", weight)
        if hd.dim() not in (2, 3):
            raise shape_error("hidden", "[N, H] or [B, T, H]", hd.shape)
        if w.dim() != 2 or w.shape[1] != hd.shape[-1]:
            raise shape_error("weight", f"[V, H] with H = {hd.shape[-1]} like hidden", w.shape)
        if w.device != hd.device:
            raise ValueError(f"weight is on {w.device} but hidden is on {hd.device}")
        lead, v = tuple(hd.shape[:-1]), w.shape[0]
    if v < 1 or math.prod(lead) < 1:
        raise ValueError(f"the logits must have at least one row and one column, got {[*lead, v]}")
    shape = "[N]" if len(lead) == 1 else "[B, T]"
    t = check_ids("target", target, lead, f"{shape} = {list(lead)}").reshape(-1)
    e = as_float_tensor("engine_logprobs", engine_logprobs)
    if tuple(e.shape) != lead:
        raise shape_error("engine_logprobs", f"{shape} = {list(lead)} like target", e.shape)
    if mask is None:
        m = torch.ones(lead, dtype=torch.bool, device=e.device)
    elif not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    elif tuple(mask.shape) != lead:
        raise shape_error("mask", f"{shape} = {list(lead)} like target", mask.shape)
    elif mask.dtype != torch.bool and bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("mask must hold only 0 and 1 (or be bool)")
    else:
        m = mask.bool()
    m, e = m.reshape(-1).to(e.device), e.reshape(-1).double()
    if not bool(m.any()):
        raise ValueError("mask leaves no token to compare")
    on = e[m]
    if not bool(torch.isfinite(on).all()):
        raise ValueError("engine_logprobs must be finite on the unmasked tokens (got NaN or inf)")
    if bool((on > 0).any()):
        raise ValueError(f"engine_logprobs must be <= 0 (log-probs), got {float(on.max()):.3g}")
    tm = t[m.to(t.device)]
    if bool(((tm < 0) | (tm >= v)).any()):
        raise ValueError(f"target must hold ids in [0, {v}) on the unmasked tokens")
    return e, t, m, lead[-1], v


def _check_sampler(
    temperature: object,
    top_k: object,
    top_p: object,
    min_p: object,
    logit_scale: object,
    final_logit_softcapping: object,
    rounding: object,
    v: int,
    given: torch.dtype | None,
) -> _Sampler:
    """The settings checked; ``given`` the dtype of given logits (16-bit: no rounding axis)."""
    tau = check_finite_positive("temperature", temperature)
    k = None if top_k is None else as_int("top_k", top_k, -1, tensor=False)
    k = None if k is not None and k < 1 else k  # -1 and 0: off, as in vLLM and SGLang
    p = None if top_p is None else float(check_unit_interval("top_p", top_p))
    if p is not None and p <= 0:
        raise ValueError(f"top_p must lie in (0, 1], got {top_p}")
    mp = None if min_p is None else float(check_unit_interval("min_p", min_p))
    if not isinstance(rounding, torch.dtype) or rounding not in _SHORT:
        raise ValueError(f"rounding must be torch.bfloat16 or torch.float16, got {rounding}")
    return _Sampler(
        temperature=tau,
        top_k=None if k is None or k >= v else k,  # k >= V keeps everything
        top_p=None if p == 1.0 else p,
        min_p=mp or None,
        logit_scale=1.0 if logit_scale is None else check_logit_scale(logit_scale),
        softcap=check_softcap(final_logit_softcapping),
        rounding=None if given in _SHORT else rounding,
    )


# --------------------------------------------------------------------------- the verdict
def _advice(s: _Sampler, best: MismatchRow, h: _Hypothesis) -> str:
    """What to set, in rlops and in the engine, to compute what the engine computed."""
    opts = [f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in best.options.items()]
    if s.filters and h.renormalised:
        last = max(i for i, k in enumerate(best.options) if k in ("top_k", "top_p", "min_p"))
        opts[last] += " (the op renormalises over the support)"
    if s.rounding is not None:
        opts.append(
            f"logits_dtype=None on {_SHORT[s.rounding]} operands (logits rounded as the engine's)"
            if h.rounded
            else "logits_dtype=torch.float32 (logits never rounded to 16 bits)"
        )
    text = f"call rlops' log-prob op with {', '.join(opts)}"
    if s.has_head and not h.head:
        text += " (the engine skips the head's logit scale / softcap: check its model config)"
    if h.shift:
        text += (
            f", and score target[t] with logits row t (the engine's target[t] goes with the "
            f"trainer's row t{h.shift:+d}: the logits and the labels are one position off)"
        )
    scaled = h.temperature or s.temperature == 1.0
    whole = not h.renormalised or not s.filters
    engines = []
    if scaled and (h.renormalised or not s.filters):
        engines.append('vLLM with logprobs_mode="processed_logprobs"')
    if scaled and whole:
        engines.append("SGLang by default")
    if not scaled and whole:
        engines += [
            'vLLM by default (logprobs_mode="raw_logprobs")',
            "SGLang with SGLANG_RETURN_ORIGINAL_LOGPROB=1",
        ]
    if engines and (s.temperature != 1.0 or s.filters):
        verb = "return" if len(engines) > 1 else "returns"
        text += f"; {' and '.join(engines)} {verb} these (rlops.compat.vllm / .sglang"
        text += ".logprob_options give each mode's options)"
    return text


def _verdict(s: _Sampler, rows: list[MismatchRow], grid: dict[str, _Hypothesis]) -> str:
    best = rows[0]
    if best.mean_abs_diff > BEYOND:  # what MismatchReport.explained reads
        return (
            f"no hypothesis explains the engine's log-probs (the best, {best.name}, is off by "
            f"{best.mean_abs_diff:.2e} on average): look for what is not modelled here — "
            "batch-variant kernels, weights out of sync with the engine, another model, "
            "tokenizer or chat template, or other sampler settings"
        )
    text = f"the engine's log-probs follow {best.name} (mean |diff| {best.mean_abs_diff:.2e}"
    if len(rows) > 1:
        ratio = rows[1].mean_abs_diff / max(best.mean_abs_diff, 1e-300)
        text += f", {ratio:.3g}x closer than {rows[1].name})"
        if ratio < 2:
            text += f", though {rows[1].name} fits almost as well"
    else:
        text += ")"
    return f"{text}: to match, {_advice(s, best, grid[best.name])}"


# --------------------------------------------------------------------------- the diagnosis
def diagnose_mismatch(
    engine_logprobs: torch.Tensor,
    logits: torch.Tensor | None = None,
    target: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    *,
    hidden: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    logit_scale: float | None = None,
    final_logit_softcapping: float | None = None,
    rounding: torch.dtype | None = None,
) -> MismatchReport:
    """Which semantics explain a rollout engine's log-probs of the sampled tokens.

    From the trainer's logits (``logits``, or ``hidden @ weight.T``), each hypothesis computes
    in float64 ``log p(target)`` as an engine might: the temperature applied or not; the
    sampler's support (top-k / top-p / min-p, in vLLM's order, on the hypothesis' logits)
    renormalised over or not (for a sampled token, not renormalising is the full softmax);
    the logits rounded to ``rounding`` (bf16) before the softmax or not; the head's
    ``logit_scale`` / ``final_logit_softcapping`` applied or not; and ``target[t]`` scored by
    logits row ``t``, ``t + 1`` or ``t − 1`` (shifted ±1). An axis whose setting is not given
    is left out (so is rounding where the given logits are already 16-bit). With
    ``d = trainer − engine`` over the unmasked tokens, each row reports ``mean |d|``,
    ``max |d|``, the k3 KL ``mean(exp(d) − 1 − d)`` and the share of ``|d| > 1e-2``.

    Args:
        engine_logprobs: ``[N]`` or ``[B, T]``: the engine's log-prob of each sampled token.
        logits: ``[N, V]`` or ``[B, T, V]`` (or give ``hidden`` and ``weight``).
        target: ``[N]`` or ``[B, T]`` token ids, the tokens the engine sampled.
        mask: like ``target``, 0/1 or bool: the tokens compared (default: all).
        hidden, weight: ``[N, H]`` or ``[B, T, H]``, and ``[V, H]``: the logits' operands.
        temperature, top_k, top_p, min_p: the sampler's settings (scalars; ``top_k`` -1 or 0,
            ``top_p = 1`` and ``min_p = 0`` are off, as in vLLM).
        logit_scale, final_logit_softcapping: the model head's maps, where it has them.
        rounding: the 16-bit dtype of the engine's logits (default: that of the given
            operands, else ``torch.bfloat16``).

    Returns:
        A :class:`MismatchReport`: ``.rows`` best first, ``.verdict`` in one sentence.

    Example:
        >>> import torch
        >>> logits = torch.randn(64, 100, generator=torch.Generator().manual_seed(0)) * 3
        >>> target = torch.multinomial(torch.softmax(logits / 0.7, -1), 1).squeeze(-1)
        >>> engine = torch.log_softmax(logits.double(), -1).gather(-1, target[:, None])[:, 0]
        >>> report = diagnose_mismatch(engine, logits, target, temperature=0.7)
        >>> report.best.name, report.best.options
        ('no temperature, float32 logits', {'temperature': 1.0})
    """
    if target is None:
        raise TypeError("target is required: the [N] or [B, T] ids the engine sampled")
    e, t, m, length, v = _check_inputs(engine_logprobs, logits, target, mask, hidden, weight)
    ops = [x for x in (logits, hidden, weight) if isinstance(x, torch.Tensor)]
    low = next((x.dtype for x in ops if x.dtype in _SHORT), torch.bfloat16)
    s = _check_sampler(
        temperature,
        top_k,
        top_p,
        min_p,
        logit_scale,
        final_logit_softcapping,
        low if rounding is None else rounding,
        v,
        logits.dtype if logits is not None else None,
    )
    grid = s.grid()
    dev = ops[0].device
    logits = None if logits is None else logits.reshape(-1, v)
    hidden = None if hidden is None else hidden.reshape(-1, hidden.shape[-1])
    e, t, m = e.to(dev), t.to(dev).long(), m.to(dev)
    # for each shift, the (target, engine, mask) of the pair that row r scores: for shift s,
    # row r = t + s scores the pair at t, within one sequence
    pos = torch.arange(e.numel(), device=dev) % length
    targets, engines, valid = [], [], []
    for shift in (0, 1, -1):
        src = torch.arange(e.numel(), device=dev) - shift
        ok = (pos - shift >= 0) & (pos - shift < length)
        src = src.clamp(0, e.numel() - 1)
        valid.append(ok & m[src])
        targets.append(torch.where(valid[-1], t[src], 0))
        engines.append(e[src])
    tg, en, va = torch.stack(targets), torch.stack(engines), torch.stack(valid)
    which = torch.tensor([(0, 1, -1).index(h.shift) for h in grid], device=dev)
    en, va = en[which], va[which]  # [len(grid), R]
    window = min(v, max(_WINDOW, 2 * (s.top_k or 0)))
    step = max(1, _CHUNK_ELEMENTS // v)
    logp = torch.empty(len(grid), e.numel(), dtype=torch.float64, device=dev)
    for start in range(0, e.numel(), step):
        rows = slice(start, start + step)
        raw = _raw_chunk(logits, hidden, weight, rows)
        out, wide = None, window
        while out is None:  # a support that fills the window: a wider one (at most V)
            out = _chunk_logps(raw, tg[:, rows], s, grid, wide)
            wide = min(v, 4 * wide)
        logp[:, rows] = out
    d = torch.where(va, logp - en, 0.0)
    n = va.sum(dim=-1).clamp(min=1).double()
    stats = torch.stack(
        [
            d.abs().sum(-1) / n,
            d.abs().amax(-1),
            torch.where(va, torch.expm1(d) - d, 0.0).sum(-1) / n,
            (d.abs() > BEYOND).sum(-1) / n,
        ],
        dim=-1,
    ).tolist()
    rows_out = [
        MismatchRow(
            s.name(h),
            mean_abs_diff=st[0],
            max_abs_diff=st[1],
            kl=st[2],
            share_beyond_1e_2=st[3],
            options=s.options(h),
            shift=h.shift,
            logits_dtype=None
            if s.rounding is None
            else (s.rounding if h.rounded else torch.float32),
        )
        for h, st, k in zip(grid, stats, va.any(dim=-1).tolist())
        if k  # a shift that leaves no pair to compare (sequences of one token) is no hypothesis
    ]
    rows_out.sort(key=lambda r: r.mean_abs_diff)  # stable: the simpler hypothesis first on ties
    names = {s.name(h): h for h in grid}
    return MismatchReport(tuple(rows_out), int(m.sum()), _verdict(s, rows_out, names))
