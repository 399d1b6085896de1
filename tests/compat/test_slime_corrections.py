"""slime's CISPO loss, TIS / IcePop corrections and OPSM (``rlops.compat.slime``) against plain
restatements of slime's definitions (per-token and per-sample loops, float64), hand-computed
cases, slime's call forms, and bad input naming slime's arguments."""

from __future__ import annotations

import inspect
import math
from argparse import Namespace

import pytest
import torch

from rlops.compat import slime


def _tokens(n=40, seed=0, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    new = (old + scale * torch.randn(n, generator=g, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    return old, new, adv


# --------------------------------------------------------------------------- CISPO
def ref_cispo(ppo_kl, log_probs, adv, eps_clip, eps_clip_high):
    """slime: −sg(clamp(e^{−ppo_kl}, 1 − eps_clip, 1 + eps_clip_high))·A·log π per token."""
    loss = torch.zeros_like(log_probs)
    frac = torch.zeros_like(adv)
    for t in range(ppo_kl.numel()):
        r = math.exp(-float(ppo_kl[t]))
        c = min(max(r, 1 - eps_clip), 1 + eps_clip_high)
        loss[t] = -c * adv[t] * log_probs[t]
        frac[t] = float(c != r)
    return loss, frac


@pytest.mark.parametrize("eps_clip,eps_clip_high", [(0.2, 0.28), (1.0, 0.2), (5.0, 4.0)])
def test_cispo_matches_slime_formula(eps_clip, eps_clip_high):
    old, new, adv = _tokens(seed=1)
    ppo_kl = old - new.detach()
    loss, frac = slime.compute_cispo_loss(ppo_kl, new, adv, eps_clip, eps_clip_high)
    ref, ref_frac = ref_cispo(ppo_kl, new, adv, eps_clip, eps_clip_high)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(frac, ref_frac)
    g = torch.randn_like(adv)
    torch.testing.assert_close(
        torch.autograd.grad(loss, new, g)[0], torch.autograd.grad(ref, new, g)[0]
    )
    if eps_clip >= 1:  # no lower clip: only ratios above 1 + eps_clip_high are clipped
        r = torch.exp(-ppo_kl)
        assert torch.equal(frac.bool(), r > 1 + eps_clip_high)


def test_cispo_keeps_shape_and_dtype():
    old, new, adv = _tokens(seed=2)
    f32 = [x.detach().float().reshape(5, 8) for x in (old - new, new, adv)]
    loss, frac = slime.compute_cispo_loss(*f32, 0.2, 0.2)
    assert loss.shape == frac.shape == (5, 8) and loss.dtype == frac.dtype == torch.float32


def test_cispo_hand_computed():
    # ratio e^{0.5} = 1.6487 -> 1.2; e^{-1} = 0.3679 -> 0.8; 1 -> 1
    ppo_kl = torch.tensor([-0.5, 1.0, 0.0])
    logp = torch.tensor([-0.5, -2.0, -1.0])
    loss, frac = slime.compute_cispo_loss(ppo_kl, logp, torch.tensor([1.0, -1.0, 2.0]), 0.2, 0.2)
    torch.testing.assert_close(loss, torch.tensor([0.6, -1.6, 2.0]))
    torch.testing.assert_close(frac, torch.tensor([1.0, 1.0, 0.0]))


# --------------------------------------------------------------------------- TIS, IcePop
def _samples(seed=3):
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 1, 9, 3]
    train = [-torch.rand(n, generator=g, dtype=torch.float64) * 2 for n in lengths]
    rollout = [x - 0.6 * torch.randn(x.shape, generator=g, dtype=torch.float64) for x in train]
    pg = torch.randn(sum(lengths), generator=g, dtype=torch.float64)
    masks = [torch.ones(n) for n in lengths]
    return pg, train, rollout, masks


@pytest.mark.parametrize("low", [0.0, 0.5])
@pytest.mark.parametrize("fn", ["vanilla_tis_function", "icepop_function"])
def test_tis_and_icepop_match_slime(fn, low):
    pg, train, rollout, masks = _samples()
    args = Namespace(tis_clip=1.5, tis_clip_low=low)
    out, out_masks, m = getattr(slime, fn)(
        args,
        pg_loss=pg,
        train_log_probs=train,
        rollout_log_probs=rollout,
        loss_masks=masks,
        total_lengths=[9] * 4,
        response_lengths=[1] * 4,
    )
    assert out_masks is masks
    ratios = [math.exp(float(a - b)) for x, y in zip(train, rollout) for a, b in zip(x, y)]
    ref, clip = [], []
    for r in ratios:
        if fn == "vanilla_tis_function":  # slime: clamp(ρ, tis_clip_low, tis_clip)
            w = min(max(r, low), 1.5)
        else:  # slime: ρ inside [tis_clip_low, tis_clip], else 0
            w = r if low <= r <= 1.5 else 0.0
        ref.append(w)
        clip.append(float(w != r))
    torch.testing.assert_close(out, pg * torch.tensor(ref, dtype=torch.float64))
    torch.testing.assert_close(m["tis"], torch.tensor(ratios, dtype=torch.float64))
    torch.testing.assert_close(m["tis_clipfrac"], torch.tensor(clip, dtype=torch.float64))
    torch.testing.assert_close(
        m["tis_abs"], torch.tensor([abs(r - 1) for r in ratios], dtype=torch.float64)
    )
    assert 0 < sum(clip) < len(clip)


def test_tis_hand_computed():
    args = Namespace(tis_clip=2.0, tis_clip_low=0.5)
    train = [torch.tensor([math.log(3.0), math.log(0.25), 0.0])]
    rollout = [torch.zeros(3)]
    out, _, _ = slime.vanilla_tis_function(
        args,
        pg_loss=torch.ones(3),
        train_log_probs=train,
        rollout_log_probs=rollout,
        loss_masks=None,
    )
    torch.testing.assert_close(out, torch.tensor([2.0, 0.5, 1.0]))
    out, _, _ = slime.icepop_function(
        args,
        pg_loss=torch.ones(3),
        train_log_probs=train,
        rollout_log_probs=rollout,
        loss_masks=None,
    )
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, 1.0]))


def test_tis_keeps_the_gradient_of_pg_loss_only():
    pg, train, rollout, masks = _samples(4)
    pg.requires_grad_()
    out, _, m = slime.vanilla_tis_function(
        Namespace(tis_clip=2.0, tis_clip_low=0.0),
        pg_loss=pg,
        train_log_probs=train,
        rollout_log_probs=rollout,
        loss_masks=masks,
    )
    (g,) = torch.autograd.grad(out.sum(), pg)
    torch.testing.assert_close(g, torch.clamp(m["tis"], max=2.0))
    assert not any(v.requires_grad for v in m.values())


# --------------------------------------------------------------------------- OPSM
def ref_opsm(delta, full_new, full_old, adv, masks):
    """slime: per sample kl = Σ m·(old − new) / max(Σ m, 1); tokens with A < 0 of samples with
    kl > delta are masked; clipfrac = Σ_i (masked tokens) / max(Σ m_i, 1)."""
    out, frac = [], 0.0
    for new, old, a, m in zip(full_new, full_old, adv, masks):
        kl = sum(float(m[t]) * float(old[t] - new[t]) for t in range(len(m))) / max(
            float(m.sum()), 1.0
        )
        mask = [1.0 if (float(x) < 0 and kl > delta) else 0.0 for x in a]
        frac += sum(mask) / max(float(m.sum()), 1.0)
        out += [1.0 - x for x in mask]
    return torch.tensor(out), frac


def _opsm_batch(seed=5):
    g = torch.Generator().manual_seed(seed)
    lengths = [6, 3, 8, 1, 5]
    old = [-torch.rand(n, generator=g) * 2 for n in lengths]
    new = [
        x + 0.05 * torch.randn(n, generator=g) - 0.02 * i
        for i, (x, n) in enumerate(zip(old, lengths))
    ]
    masks = [(torch.rand(n, generator=g) > 0.3).float() for n in lengths]
    masks[3] = torch.zeros(1)  # a sample with no loss-mask token
    adv = [torch.randn(n, generator=g) for n in lengths]
    return new, old, adv, masks


@pytest.mark.parametrize("delta", [1e-4, 0.03, 10.0])
def test_opsm_matches_slime(delta):
    new, old, adv, masks = _opsm_batch()
    mask, frac = slime.compute_opsm_mask(Namespace(opsm_delta=delta), new, old, adv, masks)
    ref, ref_frac = ref_opsm(delta, new, old, adv, masks)
    torch.testing.assert_close(mask, ref)
    assert mask.dtype == torch.float32
    assert float(frac) == pytest.approx(ref_frac)
    if delta == 10.0:
        assert bool((mask == 1).all())
    else:
        assert bool((mask == 0).any()) and bool((mask == 1).any())


def test_opsm_weights_hand_computed():
    """slime multiplies by ``loss_masks`` as given: kl = Σ w·(old − new) / max(Σ w, 1)."""
    new = [torch.tensor([-2.0, -1.0]), torch.tensor([-3.0, -1.0])]
    old = [torch.tensor([-1.0, -1.0]), torch.tensor([-1.0, -1.0])]
    adv = [torch.tensor([-1.0, -1.0]), torch.tensor([-1.0, 1.0])]
    # sample 0: (0.5·1 + 1·0) / 1.5 = 1/3 (read as 0/1: 1/2);
    # sample 1: (0.25·2 + 0.25·0) / max(0.5, 1) = 0.5 (the floor of 1, not 0.5, divides)
    w = [torch.tensor([0.5, 1.0]), torch.tensor([0.25, 0.25])]
    mask, frac = slime.compute_opsm_mask(Namespace(opsm_delta=0.4), new, old, adv, w)
    torch.testing.assert_close(mask, torch.tensor([1.0, 1.0, 0.0, 1.0]))  # 1/3 < 0.4 < 0.5
    assert frac.item() == pytest.approx(1 / 1)
    mask, frac = slime.compute_opsm_mask(Namespace(opsm_delta=0.3), new, old, adv, w)
    torch.testing.assert_close(mask, torch.tensor([0.0, 0.0, 0.0, 1.0]))  # both above 0.3
    assert frac.item() == pytest.approx(2 / 1.5 + 1 / 1)
    mask, _ = slime.compute_opsm_mask(Namespace(opsm_delta=0.45), new, old, adv, w)
    torch.testing.assert_close(mask, torch.tensor([1.0, 1.0, 0.0, 1.0]))
    mask, _ = slime.compute_opsm_mask(Namespace(opsm_delta=0.55), new, old, adv, w)
    torch.testing.assert_close(mask, torch.ones(4))  # a true weighted mean (1.0) would mask


@pytest.mark.parametrize("delta", [1e-4, 0.03])
def test_opsm_fractional_weights_match_slime(delta):
    new, old, adv, _ = _opsm_batch(7)
    g = torch.Generator().manual_seed(8)
    masks = [torch.rand(x.numel(), generator=g) * 1.5 for x in new]
    mask, frac = slime.compute_opsm_mask(Namespace(opsm_delta=delta), new, old, adv, masks)
    ref, ref_frac = ref_opsm(delta, new, old, adv, masks)
    torch.testing.assert_close(mask, ref)
    assert float(frac) == pytest.approx(ref_frac)


def test_opsm_uses_local_advantage_pieces():
    """Under context parallelism slime passes whole responses for the KL and this rank's
    pieces of the advantages; the mask follows the advantages' lengths."""
    new, old, adv, masks = _opsm_batch(6)
    pieces = [a[: max(1, a.numel() // 2)] for a in adv]
    mask, _ = slime.compute_opsm_mask(Namespace(opsm_delta=1e-4), new, old, pieces, masks)
    ref, _ = ref_opsm(1e-4, new, old, pieces, masks)
    torch.testing.assert_close(mask, ref)


def test_signatures_are_slimes():
    def names(fn):
        return list(inspect.signature(fn).parameters)

    assert names(slime.compute_cispo_loss) == [
        "ppo_kl",
        "log_probs",
        "advantages",
        "eps_clip",
        "eps_clip_high",
    ]
    assert names(slime.compute_opsm_mask) == [
        "args",
        "full_log_probs",
        "full_old_log_probs",
        "advantages",
        "loss_masks",
    ]
    for fn in (slime.vanilla_tis_function, slime.icepop_function):
        params = inspect.signature(fn).parameters
        assert list(params) == [
            "args",
            "pg_loss",
            "train_log_probs",
            "rollout_log_probs",
            "loss_masks",
            "kwargs",
        ]
        assert all(params[k].kind is inspect.Parameter.KEYWORD_ONLY for k in list(params)[1:5])


_A = Namespace(tis_clip=2.0, tis_clip_low=0.0, opsm_delta=1e-4)
_X = torch.zeros(3)
_L = [torch.zeros(3)]


def _tis(args=_A, pg=_X, train=_L, rollout=_L, fn="vanilla_tis_function"):
    return getattr(slime, fn)(
        args, pg_loss=pg, train_log_probs=train, rollout_log_probs=rollout, loss_masks=None
    )


BAD = [
    (lambda: slime.compute_cispo_loss(_X, torch.zeros(4), _X, 0.2, 0.2), ValueError, "log_probs"),
    (lambda: slime.compute_cispo_loss(_X, _X, torch.zeros(2), 0.2, 0.2), ValueError, "advantages"),
    (lambda: slime.compute_cispo_loss(_X, _X, _X, 0.0, 0.2), ValueError, "eps_clip"),
    (lambda: slime.compute_cispo_loss(_X, _X, _X, 0.2, -0.1), ValueError, "eps_clip_high"),
    (lambda: _tis(args=Namespace(tis_clip=0.0, tis_clip_low=0.0)), ValueError, "tis_clip"),
    (
        lambda: _tis(args=Namespace(tis_clip=1.0, tis_clip_low=2.0), fn="icepop_function"),
        ValueError,
        "tis_clip_low",
    ),
    (lambda: _tis(pg=torch.zeros(4)), ValueError, "pg_loss"),
    (lambda: _tis(rollout=[torch.zeros(2)]), ValueError, "rollout_log_probs"),
    (lambda: _tis(train=torch.zeros(3)), TypeError, "train_log_probs"),
    # 2 samples against 1 with the same 3 tokens in all: the counts are named
    (
        lambda: _tis(train=[torch.zeros(2), torch.zeros(1)]),
        ValueError,
        "train_log_probs has 2, rollout_log_probs has 1",
    ),
    (
        lambda: _tis(rollout=[torch.zeros(2), torch.zeros(1)], fn="icepop_function"),
        ValueError,
        "train_log_probs has 1, rollout_log_probs has 2",
    ),
    # as many samples, same total, different lengths: sample 0 is named
    (
        lambda: _tis(
            train=[torch.zeros(2), torch.zeros(1)],
            rollout=[torch.zeros(1), torch.zeros(2)],
            fn="icepop_function",
        ),
        ValueError,
        r"train_log_probs\[0\] has 2 entries but rollout_log_probs\[0\] has 1",
    ),
    (
        lambda: slime.compute_opsm_mask(_A, _L, _L, _L, [torch.ones(3)] * 2),
        ValueError,
        "loss_masks",
    ),
    (
        lambda: slime.compute_opsm_mask(_A, _L, [torch.zeros(2)], _L, [torch.ones(3)]),
        ValueError,
        "full_old_log_probs",
    ),
    (
        lambda: slime.compute_opsm_mask(Namespace(opsm_delta="x"), _L, _L, _L, [torch.ones(3)]),
        (TypeError, ValueError),
        "opsm_delta",
    ),
]


@pytest.mark.parametrize("i", range(len(BAD)))
def test_bad_input_names_slimes_argument(i):
    call, err, word = BAD[i]
    with pytest.raises(err, match=word):
        call()


# --------------------------------------------------------------------------- deliberate differences
def test_difference_ratios_are_finite_beyond_e20():
    ppo_kl = torch.tensor([-100.0])  # log-ratio 100: slime's e^100 is inf in float32
    loss, frac = slime.compute_cispo_loss(
        ppo_kl, torch.tensor([-1.0]), torch.tensor([1.0]), 0.2, 0.2
    )
    assert torch.isfinite(loss).all() and frac.item() == 1.0
    out, _, m = slime.vanilla_tis_function(
        Namespace(tis_clip=2.0, tis_clip_low=0.0),
        pg_loss=torch.ones(1),
        train_log_probs=[torch.tensor([100.0])],
        rollout_log_probs=[torch.zeros(1)],
        loss_masks=None,
    )
    assert out.item() == 2.0 and m["tis"].item() == pytest.approx(math.exp(20.0), rel=1e-6)


def test_opsm_masks_a_sample_without_loss_tokens_as_slime():
    # slime: kl = 0 / max(0, 1) = 0 > delta = −1 masks the A < 0 tokens of the empty sample;
    # clipfrac 1 / max(0, 1)
    mask, frac = slime.compute_opsm_mask(
        Namespace(opsm_delta=-1.0),
        [torch.zeros(2)],
        [torch.zeros(2)],
        [torch.tensor([-1.0, 1.0])],
        [torch.zeros(2)],
    )
    torch.testing.assert_close(mask, torch.tensor([0.0, 1.0]))
    assert frac.item() == 1.0
