"""``diagnose_mismatch``: on engines simulated with each semantics (written from the
definitions of ``rlops.logprobs.reference``, in float64, then with bf16-kernel-sized noise) the
true hypothesis ranks first, at least 10x closer than the runner-up; without noise each
hypothesis of the grid reproduces its definition; bad inputs name the argument."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from rlops.logprobs.reference import logprobs_and_entropy_reference, sampler_keep_mask
from rlops.testing import MismatchReport, diagnose_mismatch

SAMPLER = {"temperature": 0.7, "top_p": 0.9}


def _options(truth: dict, settings: dict) -> dict:
    """The reference's options for a hypothesis ``truth`` under the sampler ``settings``."""
    out = {}
    if truth.get("temperature"):
        out["temperature"] = settings["temperature"]
    if truth.get("renormalised"):
        out.update({k: settings[k] for k in ("top_k", "top_p", "min_p") if k in settings})
    if truth.get("head"):
        out.update(
            {k: settings[k] for k in ("logit_scale", "final_logit_softcapping") if k in settings}
        )
    return out


def _engine(x: torch.Tensor, truth: dict, settings: dict, g: torch.Generator, noise: float):
    """``(engine_logprobs, target)`` ``[B, T]`` of an engine that computes ``truth`` from the
    logits ``x`` ``[B, T, V]`` (float64): rounded to bf16 or not, the head's maps, temperature,
    the support renormalised or not; ``target[t]`` sampled from, and scored by, row
    ``t + shift``; then relative gaussian noise of size ``noise``."""
    b, t, v = x.shape
    if truth.get("rounded"):
        x = x.bfloat16().double()
    x = torch.roll(x, -truth.get("shift", 0), dims=1).reshape(-1, v)
    z = x.clone()  # the sampler's distribution: the settings as given (what it sampled from)
    if "logit_scale" in settings:
        z = z * settings["logit_scale"]
    if "final_logit_softcapping" in settings:
        c = settings["final_logit_softcapping"]
        z = c * torch.tanh(z / c)
    z = z / settings.get("temperature", 1.0)
    filters = {k: settings[k] for k in ("top_k", "top_p", "min_p") if k in settings}
    keep = sampler_keep_mask(z, **filters) if filters else torch.ones_like(z, dtype=torch.bool)
    probs = torch.softmax(z.masked_fill(~keep, -math.inf), dim=-1)
    target = torch.multinomial(probs, 1, generator=g).squeeze(-1)
    opts = _options(truth, settings)
    logp = logprobs_and_entropy_reference(x, target, with_entropy=False, **opts)[0]
    logp = logp * (1 + noise * torch.randn(logp.shape, generator=g, dtype=torch.float64))
    return logp.reshape(b, t), target.reshape(b, t)


def _model(seed: int, b: int = 4, t: int = 64, v: int = 1000, h: int = 64, scale: float = 5.0):
    """bf16 operands of an output layer, logits of standard deviation ``scale``, and the
    logits an engine makes of them: float32 accumulation of the bf16 products (a kernel's)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=g).bfloat16()
    weight = (torch.randn(v, h, generator=g) * scale / h**0.5).bfloat16()
    return g, hidden, weight, (hidden.float() @ weight.float().T).double()


#: (truth, the sampler's settings): each simulated engine
ENGINES = {
    "vllm raw_logprobs": ({}, SAMPLER),
    "vllm processed_logprobs": ({"temperature": True, "renormalised": True}, SAMPLER),
    "temperature only (replay)": ({"temperature": True}, SAMPLER),
    "bf16 logits, processed": (
        {"temperature": True, "renormalised": True, "rounded": True},
        SAMPLER,
    ),
    "bf16 logits, raw": ({"rounded": True}, SAMPLER),
    "top-k + min-p renormalised": (
        {"temperature": True, "renormalised": True},
        {"temperature": 0.8, "top_k": 20, "min_p": 0.05},
    ),
    "softcap applied": (
        {"temperature": True, "renormalised": True, "head": True},
        {**SAMPLER, "final_logit_softcapping": 30.0},
    ),
    "softcap skipped": ({"temperature": True}, {**SAMPLER, "final_logit_softcapping": 30.0}),
    "logit scale applied": ({"head": True}, {"temperature": 0.8, "logit_scale": 2.0}),
    "target shifted +1": ({"temperature": True, "renormalised": True, "shift": 1}, SAMPLER),
    "target shifted -1": ({"temperature": True, "shift": -1}, SAMPLER),
}


def _name(truth: dict, settings: dict) -> str:
    """The hypothesis' name as the report spells it (its documented vocabulary)."""
    parts = []
    if settings.get("temperature", 1.0) != 1.0:
        parts.append("temperature" if truth.get("temperature") else "no temperature")
    f = "+".join(
        n for n, k in (("top-k", "top_k"), ("top-p", "top_p"), ("min-p", "min_p")) if k in settings
    )
    if f:
        parts.append(f"{f} renormalised" if truth.get("renormalised") else f"{f} not renormalised")
    parts.append("bf16 logits" if truth.get("rounded") else "float32 logits")
    maps = " and ".join(
        n
        for n, k in (("logit scale", "logit_scale"), ("softcap", "final_logit_softcapping"))
        if k in settings
    )
    if maps:
        parts.append(maps if truth.get("head") else f"no {maps}")
    if truth.get("shift"):
        parts.append(f"shifted {truth['shift']:+d}")
    return ", ".join(parts)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("engine", list(ENGINES))
def test_the_true_semantics_ranks_first_10x_ahead(engine, seed):
    truth, settings = ENGINES[engine]
    g, hidden, weight, x = _model(seed)
    engine_logprobs, target = _engine(x, truth, settings, g, noise=1e-3)
    report = diagnose_mismatch(
        engine_logprobs, target=target, hidden=hidden, weight=weight, **settings
    )
    assert report.best.name == _name(truth, settings), str(report)
    assert report.rows[1].mean_abs_diff >= 10 * report.best.mean_abs_diff, str(report)
    assert report.explained and report.best.name in report.verdict
    assert report.best.shift == truth.get("shift", 0)
    assert report.best.options == {"temperature": 1.0, **_options(truth, settings)}


@pytest.mark.parametrize(
    "v, scale, settings",
    [
        (300, 4.0, {"temperature": 0.6, "top_k": 7, "top_p": 0.8, "min_p": 0.01}),
        # a flat distribution whose nucleus fills the sorted window: rows sorted in full
        (1500, 0.3, {"temperature": 2.0, "top_p": 0.95, "final_logit_softcapping": 2.0}),
        (129, 3.0, {"top_p": 0.5, "logit_scale": 2.0}),
    ],
)
def test_each_hypothesis_is_its_definition(v, scale, settings):
    """Without noise, the engine computing hypothesis H is matched by H's row to 1e-12."""
    g, hidden, weight, _ = _model(3, b=2, t=9, v=v, h=16, scale=scale)
    x = hidden.double() @ weight.double().T
    temp = [False, True] if settings.get("temperature", 1.0) != 1.0 else [False]
    head = (
        [False, True]
        if any(k in settings for k in ("logit_scale", "final_logit_softcapping"))
        else [False]
    )
    for te, rn, ro, hd, sh in itertools.product(
        temp, [False, True], [False, True], head, [0, 1, -1]
    ):
        truth = {"temperature": te, "renormalised": rn, "rounded": ro, "head": hd, "shift": sh}
        engine_logprobs, target = _engine(x, truth, settings, g, noise=0.0)
        report = diagnose_mismatch(
            engine_logprobs, target=target, hidden=hidden, weight=weight, **settings
        )
        assert report[_name(truth, settings)].mean_abs_diff < 1e-12, (truth, str(report))


def test_logits_form_and_16_bit_logits():
    """Logits ``[N, V]`` work as hidden / weight do; bf16 logits have no rounding axis."""
    g, _, _, x = _model(5, b=1, t=200)
    truth = {"temperature": True, "renormalised": True}
    engine_logprobs, target = _engine(x, truth, SAMPLER, g, noise=1e-3)
    logits = x[0].float()
    report = diagnose_mismatch(engine_logprobs[0], logits, target[0], **SAMPLER)
    assert report.best.name == "temperature, top-p renormalised, float32 logits"
    low = diagnose_mismatch(engine_logprobs[0], logits.bfloat16(), target[0], **SAMPLER)
    assert len(low.rows) == len(report.rows) // 2
    assert low.best.name == "temperature, top-p renormalised" and low.best.logits_dtype is None


def test_the_mask_and_the_report():
    g, hidden, weight, x = _model(6, b=2, t=32)
    engine_logprobs, target = _engine(x, {"temperature": True}, {"temperature": 0.5}, g, 1e-3)
    mask = torch.ones_like(target)
    mask[:, 20:] = 0
    engine_logprobs[:, 20:] = torch.nan  # padding: never read
    target[:, 20:] = -100
    report = diagnose_mismatch(
        engine_logprobs, target=target, mask=mask, hidden=hidden, weight=weight, temperature=0.5
    )
    assert isinstance(report, MismatchReport) and report.tokens == 40
    assert [r.mean_abs_diff for r in report.rows] == sorted(r.mean_abs_diff for r in report.rows)
    assert report.best.name == "temperature, float32 logits"
    text = str(report)
    assert "hypothesis" in text and "kl (k3)" in text and text.endswith(report.verdict)
    assert "temperature=0.5" in report.verdict and "logits_dtype=torch.float32" in report.verdict
    assert report["temperature, bf16 logits"].share_beyond_1e_2 > 0
    with pytest.raises(KeyError, match="no hypothesis named"):
        report["nope"]
    # the k3 estimator, by hand on the best row's numbers: 0 <= kl, about mean(d^2) / 2
    assert 0 <= report.best.kl <= report.best.max_abs_diff**2


def test_an_engine_no_hypothesis_explains():
    g, hidden, weight, x = _model(7, b=1, t=50)
    _, target = _engine(x, {}, {}, g, 0.0)
    engine_logprobs = -torch.rand(1, 50, generator=g, dtype=torch.float64) * 5
    report = diagnose_mismatch(engine_logprobs, target=target, hidden=hidden, weight=weight)
    assert not report.explained and report.verdict.startswith("no hypothesis explains")


_LOGITS = torch.zeros(4, 10)
_TARGET = torch.tensor([1, 2, 3, 4])
_ENGINE = torch.full((4,), -2.0)


@pytest.mark.parametrize(
    "kwargs, error, named",
    [
        ({"engine_logprobs": torch.zeros(3)}, ValueError, "engine_logprobs must have shape"),
        (
            {"engine_logprobs": torch.tensor([-1.0, 0.5, -1.0, -1.0])},
            ValueError,
            "engine_logprobs must be <= 0",
        ),
        (
            {"engine_logprobs": torch.tensor([-1.0, math.nan, -1.0, -1.0])},
            ValueError,
            "engine_logprobs must be finite",
        ),
        (
            {"engine_logprobs": torch.tensor([-1.0, -math.inf, -1.0, -1.0])},
            ValueError,
            "engine_logprobs must be finite",
        ),
        (
            {"engine_logprobs": torch.tensor([-1, -1, -1, -1])},
            TypeError,
            "engine_logprobs must be a floating",
        ),
        ({"temperature": 0.0}, ValueError, "temperature must be > 0"),
        ({"temperature": -1.0}, ValueError, "temperature must be > 0"),
        ({"temperature": math.inf}, ValueError, "temperature must be finite"),
        ({"temperature": math.nan}, ValueError, "temperature must be > 0"),
        ({"top_p": 0.0}, ValueError, "top_p must lie in"),
        ({"top_p": 1.5}, ValueError, "top_p must lie in"),
        ({"top_k": -2}, ValueError, "top_k must be >= -1"),
        ({"min_p": -0.1}, ValueError, "min_p must lie in"),
        ({"final_logit_softcapping": 0.0}, ValueError, "final_logit_softcapping must be > 0"),
        ({"logits": None}, TypeError, "give the logits either as logits"),
        ({"hidden": torch.zeros(4, 3), "weight": torch.zeros(10, 3)}, TypeError, "not both"),
        ({"logits": None, "hidden": torch.zeros(4, 3)}, TypeError, "hidden and weight go together"),
        (
            {"logits": None, "hidden": torch.zeros(4, 3), "weight": torch.zeros(10, 2)},
            ValueError,
            "weight must have shape [V, H] with H = 3",
        ),
        ({"logits": torch.zeros(10)}, ValueError, "logits must have shape [N, V] or [B, T, V]"),
        ({"target": torch.tensor([1, 2, 3])}, ValueError, "target must have shape [4]"),
        ({"target": torch.tensor([1.0, 2, 3, 4])}, TypeError, "target must be an integer"),
        ({"target": torch.tensor([1, 2, 3, 10])}, ValueError, "target must hold ids in [0, 10)"),
        ({"mask": torch.zeros(4)}, ValueError, "mask leaves no token"),
        ({"mask": torch.ones(5)}, ValueError, "mask must have shape [N] = [4]"),
        ({"mask": torch.tensor([0, 1, 2, 1])}, ValueError, "mask must hold only 0 and 1"),
        ({"rounding": torch.float32}, ValueError, "rounding must be torch.bfloat16"),
    ],
)
def test_bad_inputs_name_the_argument(kwargs, error, named):
    args = {"engine_logprobs": _ENGINE, "logits": _LOGITS, "target": _TARGET, **kwargs}
    with pytest.raises(error) as e:
        diagnose_mismatch(**args)
    assert named in str(e.value), str(e.value)


def test_the_engines_off_values_leave_a_filter_out():
    """``top_k`` -1 or 0, ``top_p = 1`` and ``min_p = 0`` are off (vLLM's conventions)."""
    off = diagnose_mismatch(_ENGINE, _LOGITS, _TARGET, top_k=-1, top_p=1.0, min_p=0.0)
    assert len(off.rows) == 6  # float32 / bf16 logits, times three shifts
    assert all("top" not in r.name and "min-p" not in r.name for r in off.rows)
