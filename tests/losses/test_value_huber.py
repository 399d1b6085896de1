"""``value_loss(loss="huber")`` (and ``loss="mse"``) against AReaL's own ``ppo_critic_loss_fn``
(copied below), against the formula one token at a time (40-digit and same-dtype), by hand,
its gradient, its arguments' checks, and under ``group=`` / ``cp_group=``."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist
from tests._bad_input import names
from tests._distributed import run_distributed
from tests._losses_util import DTYPES, acc_dtype, assert_within_ref_error, random_mask
from tests.losses._per_token import per_token
from tests.losses._references import F64, Exact, Same, as_tensor
from tests.losses._two_ranks import assert_group_and_cp_equal_the_whole_batch

import rlops


# --------------------------------------------------------------------------- AReaL's code
# areal-project/AReaL, areal/utils/functional/functional.py at commit
# cbff54d645d2cd8ee1f1c358a82f3f473588433d (the same three functions in inclusionAI/AReaL at
# 4aef98d8d818af55b43621aaadba047ae10f4e77). Copied verbatim (up to ruff format); adapted only
# in the data structures: its float32 asserts are left out (compared here in float64), and
# ``delta`` of the Huber loss is an argument (AReaL fixes it at 10.0 in the same line).
def _huber_loss(x: torch.Tensor, y: torch.Tensor, delta: float):
    diff = torch.abs(x - y)
    return torch.where(diff < delta, 0.5 * diff**2, delta * (diff - 0.5 * delta))


def _mse_loss(x: torch.Tensor, y: torch.Tensor):
    return 0.5 * (x - y) ** 2


def ppo_critic_loss_fn(
    value: torch.FloatTensor,
    old_value: torch.FloatTensor,
    target_value: torch.FloatTensor,
    value_eps_clip: float,
    loss_mask: torch.Tensor | None = None,
    loss_fn_type: str = "mse",
    delta: float = 10.0,
) -> tuple[torch.Tensor, dict]:
    if loss_fn_type == "huber":
        loss_fn = functools.partial(_huber_loss, delta=delta)
    elif loss_fn_type == "mse":
        loss_fn = _mse_loss
    else:
        raise NotImplementedError(f"Unknown loss fn type: {loss_fn_type}")

    if target_value.is_inference():
        target_value = target_value.clone()  # clone a inference tensor

    value_loss_original = loss_fn(value, target_value)

    value_clipped = old_value + (value - old_value).clamp(-value_eps_clip, value_eps_clip)

    value_loss_clipped = loss_fn(value_clipped, target_value)

    value_loss = torch.max(value_loss_original, value_loss_clipped)

    with torch.no_grad():
        clip_mask = value_loss_clipped.detach() > value_loss_original.detach()
        if loss_mask is not None:
            clip_mask.logical_and_(loss_mask)

        stat = dict(clip_mask=clip_mask, loss=value_loss.detach())

    if loss_mask is not None:
        value_loss = torch.where(loss_mask, value_loss, 0).sum() / loss_mask.count_nonzero()
    else:
        value_loss = value_loss.mean()

    return value_loss, stat


# --------------------------------------------------------------------------- the batches
def critic_batch(seed, b=7, t=31, scale=12.0, dtype=F64):
    """Values, old values and returns whose errors straddle δ = 10 (scale 12), a ragged mask
    with an empty row 0 and interior 0-spans."""
    g = torch.Generator().manual_seed(seed)
    ret = scale * torch.randn(b, t, generator=g, dtype=F64)
    old = ret + scale * torch.randn(b, t, generator=g, dtype=F64)
    v = old + 0.5 * scale * torch.randn(b, t, generator=g, dtype=F64)
    mask = random_mask(b, t, g).bool()
    return v.to(dtype), old.to(dtype), ret.to(dtype), mask


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    ("loss", "delta", "clip"),
    [("huber", 10.0, 5.0), ("huber", 3.0, 0.5), ("mse", 10.0, 5.0)],
    ids=["huber-areal", "huber-3", "mse"],
)
def test_areal_ppo_critic_loss_fn(seed, loss, delta, clip):
    """Loss (AReaL: the masked mean), gradient, per-token loss (its ``stat["loss"]``) and the
    clipped share (its ``clip_mask``) equal AReaL's."""
    v, old, ret, mask = critic_batch(seed)
    x = v.clone().requires_grad_(True)
    theirs, stat = ppo_critic_loss_fn(x, old, ret, clip, mask, loss_fn_type=loss, delta=delta)
    (tg,) = torch.autograd.grad(theirs, x)
    y = v.clone().requires_grad_(True)
    ours, m = rlops.value_loss(y, old, ret, mask, clip=clip, loss=loss, huber_delta=delta)
    (og,) = torch.autograd.grad(ours, y)
    torch.testing.assert_close(ours, theirs.detach(), rtol=1e-14, atol=0)
    torch.testing.assert_close(og, tg, rtol=1e-14, atol=0)
    mat, _ = rlops.value_loss(v, old, ret, mask, clip=clip, loss=loss, huber_delta=delta, agg=None)
    torch.testing.assert_close(mat, torch.where(mask, stat["loss"], 0), rtol=1e-15, atol=0)
    frac = stat["clip_mask"].sum().to(F64) / mask.sum()  # AReaL's count, rlops' share
    assert 0 < frac < 1
    torch.testing.assert_close(m["vf_clipfrac"], frac, rtol=1e-15, atol=0)
    if loss == "huber":  # both branches of h are taken
        d = (v - ret).abs()[mask]
        assert (d < delta).any() and (d >= delta).any()
    worst = max(float((ours - theirs).detach().abs()), float((og - tg).abs().max()))
    print(f"AReaL ppo_critic_loss_fn {loss} δ={delta}, seed {seed}: largest |diff| {worst:.2e}")


# --------------------------------------------------------------------------- the definition
def definition(v, old, ret, mask, num, clip, loss="huber", delta=10.0):
    """``[B][T]``: ``max(h(V − R), h(V_clip − R))`` per token (``h(V − R)`` without a clip),
    ``h(d) = ½d²`` below δ in size, ``δ(|d| − δ/2)`` above (mse: ½d² everywhere)."""
    c = num.conv

    def h(d):
        if loss == "mse" or abs(d) < c(delta):
            return d * d / 2
        return c(delta) * (abs(d) - c(delta) / 2)

    def term(vi, o, r):
        out = h(vi - r)
        if clip is not None:
            out = max(out, h(min(max(vi, o - c(clip)), o + c(clip)) - r))
        return out

    return per_token(term, v, old, ret, mask, num)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 127, 128, 129, 1000])
def test_matches_the_definition(t, dtype):
    v, old, ret, mask = critic_batch(t, b=3, t=t, dtype=dtype)
    mask[1, 0] = True
    v = torch.where(mask, v, torch.tensor(math.nan, dtype=dtype))  # mask-0 entries never read
    for clip in (None, 4.0):
        mat, _ = rlops.value_loss(v, old, ret, mask, clip=clip, loss="huber", agg=None)
        exact = as_tensor(definition(v, old, ret, mask, Exact, clip))
        same = as_tensor(definition(v, old, ret, mask, Same(acc_dtype(dtype)), clip))
        assert mat.dtype == acc_dtype(dtype) and mat.shape == v.shape
        assert_within_ref_error(mat, exact, same)


def test_hand_computed():
    """R = 0, V_old = 0, V = [1, 3, −12], clip 2, δ = 2: unclipped h = [½, 2·(3 − 1), 2·(12 − 1)]
    = [0.5, 4, 22]; V_clip = [1, 2, −2]: h = [0.5, 2, 2]; the max: [0.5, 4, 22], none clipped.
    With V_old = [0, 0, −20]: V_clip = −18 → h = 34 > 22, clipped."""
    v = torch.tensor([[1.0, 3.0, -12.0]], dtype=F64)
    ret = torch.zeros(1, 3, dtype=F64)
    mat, m = rlops.value_loss(
        v, ret, ret, torch.ones(1, 3), clip=2.0, loss="huber", huber_delta=2.0, agg=None
    )
    assert mat.tolist() == [[0.5, 4.0, 22.0]] and m["vf_clipfrac"] == 0
    old = torch.tensor([[0.0, 0.0, -20.0]], dtype=F64)
    loss, m = rlops.value_loss(
        v, old, ret, torch.ones(1, 3), clip=2.0, loss="huber", huber_delta=2.0
    )
    assert loss.item() == (0.5 + 4.0 + 34.0) / 3 and m["vf_clipfrac"].item() == 1 / 3


def test_identities():
    """δ beyond every error: huber is mse; mse is the old default (½·squared error)."""
    v, old, ret, mask = critic_batch(3)
    for clip in (None, 2.0):
        mse, _ = rlops.value_loss(v, old, ret, mask, clip=clip, agg=None)
        huge, _ = rlops.value_loss(
            v, old, ret, mask, clip=clip, loss="huber", huber_delta=1e6, agg=None
        )
        assert torch.equal(mse, huge)
        same, _ = rlops.value_loss(v, old, ret, mask, clip=clip, loss="mse", agg=None)
        assert torch.equal(mse, same)


# --------------------------------------------------------------------------- gradients
def test_the_formulas_gradient():
    """∂h/∂V = clamp(V − R, −δ, δ) where the unclipped term is the max, and the clipped
    term's where it is larger (0 where V_clip is clamped)."""
    v, old, ret, mask = critic_batch(4)
    x = v.clone().requires_grad_(True)
    loss, _ = rlops.value_loss(x, old, ret, mask, clip=5.0, loss="huber", agg="token-sum")
    (g,) = torch.autograd.grad(loss, x)
    d = v - ret
    vc = torch.clamp(v, old - 5.0, old + 5.0)

    def h(e):
        return torch.where(e.abs() < 10, 0.5 * e * e, 10 * (e.abs() - 5))

    clipped = h(vc - ret) > h(d)
    inside = (v > old - 5.0) & (v < old + 5.0)
    want = torch.where(clipped, torch.where(inside, (vc - ret).clamp(-10, 10), 0), d.clamp(-10, 10))
    torch.testing.assert_close(g, torch.where(mask, want, 0), rtol=1e-15, atol=0)


@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_gradcheck(agg, clip):
    v, old, ret, _ = critic_batch(9, b=3, t=5, scale=3.0)
    m = torch.tensor([[1, 1, 0, 1, 1], [0, 0, 0, 0, 0], [1, 0, 1, 1, 0]]).bool()
    d = (v - ret).abs()[m]
    assert (d < 2.0).any() and (d > 2.0).any()

    def f(x):
        return rlops.value_loss(x, old, ret, m, clip=clip, loss="huber", huber_delta=2.0, agg=agg)[
            0
        ]

    assert torch.autograd.gradcheck(f, (v.clone().requires_grad_(True),))


# --------------------------------------------------------------------------- bad arguments
BAD = [
    ("loss", "l1", ValueError, "'mse', 'huber'"),
    ("loss", None, ValueError, "'mse', 'huber'"),
    ("loss", "Huber", ValueError, "'mse', 'huber'"),
    ("huber_delta", 0.0, ValueError, "> 0"),
    ("huber_delta", -1.0, ValueError, "> 0"),
    ("huber_delta", math.nan, ValueError, "> 0"),
    ("huber_delta", math.inf, ValueError, "finite"),
    ("huber_delta", "10", TypeError, "real number"),
]


@pytest.mark.parametrize(
    ("arg", "bad", "exc", "words"), BAD, ids=[f"{a}-{v!r}" for a, v, *_ in BAD]
)
def test_bad_argument_raises_naming_it(arg, bad, exc, words):
    v, old, ret, mask = critic_batch(0, b=2, t=3)
    kw = {"loss": "huber", arg: bad}
    with pytest.raises(exc, match=names(arg)) as info:
        rlops.value_loss(v, old, ret, mask, **kw)
    assert words in str(info.value)


# --------------------------------------------------------------------------- groups
def _huber(v, old, ret, mask, **kw):
    return rlops.value_loss(v, old, ret, mask, clip=3.0, loss="huber", huber_delta=4.0, **kw)


def test_group_and_cp_group_equal_the_whole_batch():
    """Two Gloo ranks, ``group=`` and ``cp_group=`` (zigzag layout): the whole batch's."""
    assert_group_and_cp_equal_the_whole_batch(_huber, critic_batch(6, b=6, t=19), ("vf_clipfrac",))


def test_ranks_must_agree_on_the_loss():
    """The group's consistency check covers ``loss`` and ``huber_delta``."""
    ranks = run_distributed(_disagree, 2, timeout=120)
    assert all("huber_delta" in msg for msg in ranks), ranks


def _disagree(rank, world_size):
    v, old, ret, mask = critic_batch(1, b=2, t=5)
    try:
        rlops.value_loss(
            v, old, ret, mask, loss="huber", huber_delta=1.0 + rank, group=dist.group.WORLD
        )
    except ValueError as e:
        return str(e)
    return ""
