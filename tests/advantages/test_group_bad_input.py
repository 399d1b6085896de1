"""Bad and odd input to the group estimators and to the verl adapters of GDPO and the optimal
token baseline: a ValueError / TypeError whose message names the argument and what it accepts,
never a silent result."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from tests._bad_input import names

from rlops import (
    gdpo_advantages,
    gpg_advantages,
    grpo_advantages,
    grpo_passk_advantages,
    opo_advantages,
    optimal_token_baseline_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
    rloo_advantages,
)
from rlops.compat import verl

B, T, K = 4, 3, 3
INDEX = torch.tensor([0, 0, 1, 1])


def test_mean_std_estimators_bad_input_names_the_argument():
    s, idx, m = torch.randn(4), torch.tensor([0, 0, 1, 1]), torch.ones(4, 3)
    with pytest.raises(TypeError, match="scores"):
        grpo_advantages(torch.ones(4, dtype=torch.long), idx, m)
    with pytest.raises(TypeError, match="index"):
        grpo_advantages(s, idx.float(), m)
    with pytest.raises(TypeError, match="index"):
        rloo_advantages(s, [0, 0, 1, 1], m)
    with pytest.raises(ValueError, match="index"):
        rloo_advantages(s, idx[:3], m)
    with pytest.raises(ValueError, match="scores"):
        grpo_advantages(torch.randn(5), idx, m)
    with pytest.raises(ValueError, match="mask"):
        grpo_advantages(s, idx, torch.ones(4))
    with pytest.raises(ValueError, match="mask"):
        reinforce_plus_plus_baseline_advantages(s, idx, torch.full((4, 3), 3.0))
    with pytest.raises(ValueError, match="eps"):
        grpo_advantages(s, idx, m, eps=-1.0)
    with pytest.raises(ValueError, match="eps"):
        reinforce_plus_plus_baseline_advantages(s, idx, m, eps=float("nan"))
    with pytest.raises(ValueError, match="reward_baselines"):
        remax_advantages(torch.randn(4, 3), torch.randn(3), m)
    with pytest.raises(ValueError, match="rewards"):
        remax_advantages(torch.randn(4, 2), torch.randn(4), m)
    with pytest.raises(TypeError, match="reward_baselines"):
        remax_advantages(torch.randn(4, 3), torch.ones(4, dtype=torch.long), m)


@pytest.mark.parametrize("fn", [opo_advantages, gpg_advantages, grpo_passk_advantages])
def test_bad_input_errors_name_the_argument(fn):
    s, idx, m = torch.randn(4), torch.tensor([0, 0, 1, 1]), torch.ones(4, 3)
    with pytest.raises(TypeError, match="scores"):
        fn(torch.ones(4, dtype=torch.long), idx, m)
    with pytest.raises(TypeError, match="index"):
        fn(s, idx.float(), m)
    with pytest.raises(ValueError, match="index"):
        fn(s, idx[:3], m)
    with pytest.raises(ValueError, match="scores"):
        fn(torch.randn(5), idx, m)
    with pytest.raises(ValueError, match="mask"):
        fn(s, idx, torch.full((4, 3), 2.0))
    with pytest.raises(TypeError, match="mask"):
        fn(s, idx, [[1, 1, 1]] * 4)


def test_gpg_and_passk_bad_options_name_them():
    s, idx, m = torch.randn(4), torch.tensor([0, 0, 1, 1]), torch.ones(4, 3)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="f_norm"):
            gpg_advantages(s, idx, m, f_norm=bad)
        with pytest.raises(ValueError, match="alpha"):
            gpg_advantages(s, idx, m, alpha=bad)
    with pytest.raises(TypeError, match="f_norm"):
        gpg_advantages(s, idx, m, f_norm="1")
    with pytest.raises(ValueError, match="eps"):
        grpo_passk_advantages(s, idx, m, eps=-1e-6)


def gdpo_inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(B, K, generator=g), INDEX.clone(), torch.ones(B, T)


def otb_inputs():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(B, T, generator=g)
    logp = -torch.rand(B, T, generator=g) - 0.1
    spp = 0.3 * torch.rand(B, T, generator=g)
    return {
        "rewards": rewards,
        "index": INDEX.clone(),
        "mask": torch.ones(B, T),
        "logp": logp,
        "sum_pi_squared": spp,
    }


# --------------------------------------------------------------------------- GDPO
FINITE = "finite real numbers"
BAD_WEIGHTS = [
    ([1.0, 2.0, math.nan], ValueError, FINITE),  # before: all-NaN advantages, no error
    ([1.0, 2.0, math.inf], ValueError, FINITE),  # before: all-NaN advantages, no error
    ([1.0, -math.inf, 2.0], ValueError, FINITE),
    (torch.tensor([1.0, math.nan, 1.0]), ValueError, FINITE),
    (np.array([1.0, 1.0, math.inf]), ValueError, FINITE),
    ("x", TypeError, FINITE),  # before: TypeError: new(): invalid data type 'str'
    ("123", TypeError, FINITE),
    ({"a": 1.0}, TypeError, FINITE),
    (1.0, TypeError, FINITE),
    ([1.0, "x", 2.0], TypeError, "real number"),
    ([1.0, None, 2.0], TypeError, "real number"),
    ([1.0, True, 2.0], TypeError, "real number"),
    ([[1.0, 1.0, 1.0]], TypeError, "real number"),
    ([1.0, 2.0], ValueError, "[3]"),
    ([1.0] * 4, ValueError, "[3]"),
    ([], ValueError, "[3]"),
    (torch.ones(1, 3), ValueError, "[3]"),
    (torch.ones(4), ValueError, "[3]"),
    (torch.ones(3, dtype=torch.bool), TypeError, "torch.bool"),
    (torch.ones(3, dtype=torch.complex64), TypeError, "complex64"),
    (torch.ones(3, device="meta"), ValueError, "one device"),
]


@pytest.mark.parametrize(
    ("weights", "exc", "words"),
    BAD_WEIGHTS,
    ids=[f"{i}-{type(w).__name__}" for i, (w, *_) in enumerate(BAD_WEIGHTS)],
)
def test_gdpo_bad_weights_raise_naming_them(weights, exc, words):
    scores, index, mask = gdpo_inputs()
    with pytest.raises(exc, match=names("weights")) as info:
        gdpo_advantages(scores, index, mask, weights=weights)
    assert words in str(info.value)


@pytest.mark.parametrize(
    "weights",
    [
        [1.0, 0.5, 2.0],
        (1, 0, -1),
        np.array([1.0, 2.0, 3.0]),
        [np.float32(1.0), np.int64(2), 3.0],
        torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64),
        torch.tensor([1, 2, 3]),
    ],
)
def test_gdpo_accepts_every_form_of_finite_weights(weights):
    # a list, a tuple, numpy, numpy scalars, a float or integer tensor: the same numbers give
    # the same advantages as the float list
    scores, index, mask = gdpo_inputs()
    as_list = [float(w) for w in weights]
    want, _ = gdpo_advantages(scores, index, mask, weights=as_list)
    got, _ = gdpo_advantages(scores, index, mask, weights=weights)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("norm_std", ["yes", "no", 1, 0, None, np.bool_(True), torch.tensor(True)])
def test_gdpo_norm_std_must_be_a_bool(norm_std):
    # before: 'yes' (and 'no', which is truthy) silently ran with norm_std=True
    scores, index, mask = gdpo_inputs()
    with pytest.raises(TypeError, match=r"\bnorm_std must be a bool\b"):
        gdpo_advantages(scores, index, mask, norm_std=norm_std)


@pytest.mark.parametrize("name", ["eps", "whiten_eps"])
@pytest.mark.parametrize(
    ("bad", "exc"),
    [
        (-1e-6, ValueError),
        (math.nan, ValueError),
        (math.inf, ValueError),
        ("x", TypeError),
        (None, TypeError),
    ],
)
def test_gdpo_bad_eps_raises_naming_it(name, bad, exc):
    scores, index, mask = gdpo_inputs()
    with pytest.raises(exc, match=names(name)) as info:
        gdpo_advantages(scores, index, mask, **{name: bad})
    if exc is ValueError:
        assert "finite number >= 0" in str(info.value)


@pytest.mark.parametrize(
    ("arg", "bad", "exc", "words"),
    [
        ("scores", lambda s: s.long(), TypeError, "floating-point"),
        ("scores", lambda s: s.bool(), TypeError, "floating-point"),
        ("scores", lambda s: s[:3], ValueError, "B = 4"),
        ("scores", lambda s: s[None], ValueError, "[B, K]"),
        ("scores", lambda s: s[:, :0], ValueError, "K >= 1"),
        ("scores", lambda s: s.tolist(), TypeError, "torch.Tensor"),
        ("index", lambda i: i.float(), TypeError, "integer tensor"),
        ("index", lambda i: i[:3], ValueError, "[4]"),
        ("index", lambda i: i.tolist(), TypeError, "torch.Tensor"),
        ("mask", lambda m: m * 0.5, ValueError, "only 0 and 1"),
        ("mask", lambda m: m[:, 0], ValueError, "[B, T]"),
        ("mask", lambda m: m[:3], ValueError, "B = 3"),
    ],
)
def test_gdpo_bad_tensors_raise_naming_them(arg, bad, exc, words):
    x = dict(zip(("scores", "index", "mask"), gdpo_inputs()))
    x[arg] = bad(x[arg])
    with pytest.raises(
        exc, match=names(arg) if arg != "mask" or words != "B = 3" else names("scores")
    ) as info:
        gdpo_advantages(x["scores"], x["index"], x["mask"])
    assert words in str(info.value)


# --------------------------------------------------------------------------- OTB
@pytest.mark.parametrize("flag", ["handle_zero_tail", "per_action_step"])
@pytest.mark.parametrize("bad", ["no", "yes", 1, 0, None, np.bool_(False), torch.tensor(True)])
def test_otb_flags_must_be_bools(flag, bad):
    # before: handle_zero_tail='no' ran as True, per_action_step=1 as True
    with pytest.raises(TypeError, match=rf"\b{flag} must be a bool\b"):
        optimal_token_baseline_advantages(**otb_inputs(), **{flag: bad})


@pytest.mark.parametrize(
    ("bad", "exc"),
    [(-1.0, ValueError), (math.nan, ValueError), (math.inf, ValueError), ("x", TypeError)],
)
def test_otb_bad_eps_raises_naming_it(bad, exc):
    with pytest.raises(exc, match=names("eps")):
        optimal_token_baseline_advantages(**otb_inputs(), eps=bad)


FLOAT = "floating-point tensor"
BAD_OTB = [
    ("logp", lambda x: x.long(), TypeError, FLOAT),  # before: accepted
    ("logp", lambda x: x.to(torch.int32), TypeError, FLOAT),
    ("logp", lambda x: x.bool(), TypeError, FLOAT),
    ("logp", lambda x: x.tolist(), TypeError, "torch.Tensor"),
    ("logp", lambda x: x[:, :2], ValueError, "[4, 3]"),
    ("sum_pi_squared", lambda x: x.long(), TypeError, FLOAT),
    ("sum_pi_squared", lambda x: x.to(torch.complex64), TypeError, FLOAT),
    ("sum_pi_squared", lambda x: x[None], ValueError, "[4, 3]"),
    ("sum_pi_squared", lambda x: 0.3, TypeError, "torch.Tensor"),
    ("sum_pi_squared", lambda x: x.to("meta"), ValueError, "one device"),
    ("rewards", lambda x: x.long(), TypeError, FLOAT),
    ("rewards", lambda x: x[:, :2], ValueError, "[B] = [4] or [B, T] = [4, 3]"),
    ("rewards", lambda x: x[:3, 0], ValueError, "[B] = [4] or [B, T] = [4, 3]"),
    ("index", lambda x: x.double(), TypeError, "integer tensor"),
    ("index", lambda x: x[None], ValueError, "[4]"),
    ("mask", lambda x: x * 2, ValueError, "only 0 and 1"),
    ("mask", lambda x: x.to(torch.complex64), TypeError, "0/1"),
]


@pytest.mark.parametrize(
    ("arg", "bad", "exc", "words"), BAD_OTB, ids=[f"{a}-{i}" for i, (a, *_) in enumerate(BAD_OTB)]
)
def test_otb_bad_tensors_raise_naming_them(arg, bad, exc, words):
    x = otb_inputs()
    x[arg] = bad(x[arg])
    with pytest.raises(exc, match=names(arg)) as info:
        optimal_token_baseline_advantages(**x)
    assert words in str(info.value)


@pytest.mark.parametrize(
    ("bad", "exc", "words"),
    [
        (torch.ones(B, T, dtype=torch.long), TypeError, FLOAT),  # before: accepted
        (torch.ones(B, T, dtype=torch.bool), TypeError, FLOAT),
        (torch.ones(B, T - 1), ValueError, "[4, 3]"),
        (torch.ones(B), ValueError, "[4, 3]"),
        ([[1.0] * T] * B, TypeError, "torch.Tensor"),
        (torch.ones(B, T, device="meta"), ValueError, "one device"),
    ],
)
def test_otb_bad_rollout_is_weights_raise_naming_them(bad, exc, words):
    with pytest.raises(exc, match=names("rollout_is_weights")) as info:
        optimal_token_baseline_advantages(**otb_inputs(), rollout_is_weights=bad)
    assert words in str(info.value)


def test_otb_valid_flags_and_weights_run():
    # the valid values of the keywords above give finite advantages (the checks are not vacuous)
    for zero_tail in (True, False):
        for per_step in (True, False):
            adv, ret = optimal_token_baseline_advantages(
                **otb_inputs(),
                rollout_is_weights=torch.full((B, T), 0.5),
                handle_zero_tail=zero_tail,
                per_action_step=per_step,
            )
            assert torch.isfinite(adv).all() and torch.isfinite(ret).all()


# --------------------------------------------------------------------------- verl adapters
def _gdpo_verl(weights, keys=("a", "b")):
    rewards = torch.zeros(B, T)
    batch = {k: np.arange(B, dtype=np.float32) * (i + 1) for i, k in enumerate(keys)}
    config = {"gdpo_reward_keys": list(keys), "gdpo_reward_weights": weights}
    return verl.compute_gdpo_outcome_advantage(
        rewards, torch.ones(B, T), [0, 0, 1, 1], config=config, non_tensor_batch=batch, batch={}
    )


@pytest.mark.parametrize(
    ("weights", "exc", "words"),
    [
        ([1.0, math.nan], ValueError, FINITE),
        ([1.0, math.inf], ValueError, FINITE),
        ("xy", TypeError, "real number"),
        (2.0, TypeError, FINITE),
        ([1.0], ValueError, "[2]"),
        ([1.0, 2.0, 3.0], ValueError, "[2]"),
    ],
)
def test_verl_gdpo_bad_reward_weights_name_verls_option(weights, exc, words):
    # an adapter names its peer's option (config['gdpo_reward_weights']), not rlops's
    with pytest.raises(exc, match=re.escape("config['gdpo_reward_weights']")) as info:
        _gdpo_verl(weights)
    assert words in str(info.value)


def test_verl_gdpo_valid_reward_weights_run():
    adv, _ = _gdpo_verl([1.0, 0.5])
    assert torch.isfinite(adv).all()
    adv2, _ = _gdpo_verl(np.array([1.0, 0.5]))
    torch.testing.assert_close(adv, adv2, rtol=0, atol=0)


@pytest.mark.parametrize(
    "fn",
    [
        verl.compute_optimal_token_baseline_advantage,
        verl.compute_multi_turn_optimal_token_baseline_advantage,
    ],
)
@pytest.mark.parametrize(
    ("kw", "exc", "arg"),
    [
        ({"handle_zero_tail": "no"}, TypeError, "handle_zero_tail"),
        ({"epsilon": -1.0}, ValueError, "epsilon"),
        ({"epsilon": math.nan}, ValueError, "epsilon"),
        (
            {"rollout_is_weights": torch.ones(B, T, dtype=torch.long)},
            TypeError,
            "rollout_is_weights",
        ),
    ],
)
def test_verl_otb_bad_options_raise_naming_them(fn, kw, exc, arg):
    x = otb_inputs()
    with pytest.raises(exc, match=names(arg)):
        fn(x["rewards"], x["mask"], ["p", "p", "q", "q"], x["logp"], x["sum_pi_squared"], **kw)


@pytest.mark.parametrize(
    "fn",
    [
        verl.compute_optimal_token_baseline_advantage,
        verl.compute_multi_turn_optimal_token_baseline_advantage,
    ],
)
def test_verl_otb_integer_old_log_probs_raise_naming_verls_argument(fn):
    x = otb_inputs()
    with pytest.raises(TypeError, match=r"\bold_log_probs must be a floating-point tensor"):
        fn(x["rewards"], x["mask"], ["p", "p", "q", "q"], x["logp"].long(), x["sum_pi_squared"])
