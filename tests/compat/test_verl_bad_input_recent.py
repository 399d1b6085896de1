"""Bad input to the verl adapters added last (the dppo_tv / dppo_kl / bypass_mode losses,
compute_is_metrics, compute_rs_metrics): a ValueError / TypeError naming verl's option or
argument and what it accepts."""

from __future__ import annotations

import math
import re

import pytest
import torch
from tests._bad_input import names

from rlops.compat import verl

B, T = 3, 4


def tensors():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(B, T, generator=g) - 0.1
    old = -torch.rand(B, T, generator=g) - 0.1
    return old, logp, torch.randn(B, T, generator=g), torch.ones(B, T)


def bypass(**rc):
    config = {"clip_ratio": 0.2, "policy_loss": {"rollout_correction": rc}}
    return verl.compute_policy_loss_bypass_mode(*tensors(), config=config)


BAD_BYPASS = [
    (
        {"loss_type": "pg"},
        ValueError,
        "config.policy_loss.rollout_correction.loss_type",
        "'ppo_clip', 'reinforce'",
    ),
    (
        {"loss_type": None},
        ValueError,
        "config.policy_loss.rollout_correction.loss_type",
        "'ppo_clip', 'reinforce'",
    ),
    ({"rollout_is": "tokens"}, ValueError, "rollout_is", "'token', 'sequence'"),
    (
        {"rollout_is": "token", "rollout_is_threshold": math.nan},
        ValueError,
        "rollout_is_threshold",
        "positive",
    ),
    (
        {"rollout_is": "token", "rollout_is_threshold": -2.0},
        ValueError,
        "rollout_is_threshold",
        "positive",
    ),
    (
        {"rollout_is": "token", "rollout_is_batch_normalize": "yes"},
        TypeError,
        "rollout_is_batch_normalize",
        "bool",
    ),
    ({"rollout_rs": "token_k1"}, ValueError, "rollout_rs_threshold", "must be given"),
    (
        {"rollout_rs": "token_k1", "rollout_rs_threshold": math.nan},
        ValueError,
        "rollout_rs_threshold",
        "positive",
    ),
]


@pytest.mark.parametrize(
    ("rc", "exc", "arg", "words"), BAD_BYPASS, ids=[f"{i}" for i in range(len(BAD_BYPASS))]
)
def test_bypass_mode_bad_rollout_correction_option_names_it(rc, exc, arg, words):
    with pytest.raises(exc, match=names(arg)) as info:
        bypass(**rc)
    assert words in str(info.value)


def test_bypass_mode_without_its_config_names_it():
    with pytest.raises(ValueError, match=names("config")):
        verl.compute_policy_loss_bypass_mode(*tensors())
    with pytest.raises(ValueError, match=re.escape("config.policy_loss.rollout_correction")):
        verl.compute_policy_loss_bypass_mode(*tensors(), config={"clip_ratio": 0.2})


def test_bypass_mode_integer_log_prob_names_it():
    old, logp, adv, mask = tensors()
    with pytest.raises(TypeError, match=r"\blog_prob must be a floating-point tensor"):
        verl.compute_policy_loss_bypass_mode(
            old, logp.long(), adv, mask, config={"policy_loss": {"rollout_correction": {}}}
        )


@pytest.mark.parametrize("fn", [verl.compute_policy_loss_dppo_tv, verl.compute_policy_loss_dppo_kl])
@pytest.mark.parametrize(
    ("config", "exc", "arg", "words"),
    [
        ({"clip_ratio": "x"}, TypeError, "config.clip_ratio", "real number"),
        ({"clip_ratio": math.nan}, ValueError, "config.clip_ratio", "> 0"),
        ({"clip_ratio": 0.2, "clip_ratio_low": -1.0}, ValueError, "config.clip_ratio_low", "> 0"),
        ({"clip_ratio": 0.2, "clip_ratio_high": 0.0}, ValueError, "config.clip_ratio_high", "> 0"),
        ({"clip_ratio": 0.2, "clip_ratio_c": math.nan}, ValueError, "config.clip_ratio_c", "> 0"),
        (
            {"clip_ratio": 0.2, "clip_ratio_c": None},
            TypeError,
            "config.clip_ratio_c",
            "real number",
        ),
    ],
)
def test_dppo_bad_config_names_verls_option(fn, config, exc, arg, words):
    with pytest.raises(exc, match=names(arg)) as info:
        fn(*tensors(), config=config)
    assert words in str(info.value)


def is_metrics(**kw):
    old, logp, _, mask = tensors()
    w = (logp - old).exp()
    args = {
        "rollout_is_weights": w.clamp(max=2.0),
        "raw_rollout_is_weights": w,
        "log_ratio_for_metrics": logp - old,
        "response_mask": mask,
        "rollout_is": "token",
        "rollout_is_threshold": 2.0,
        **kw,
    }
    return verl.compute_is_metrics(**args)


@pytest.mark.parametrize(
    ("kw", "exc", "arg", "words"),
    [
        ({"rollout_is": "tokens"}, ValueError, "rollout_is", "'token', 'sequence'"),
        ({"rollout_is": None}, ValueError, "rollout_is", "'token', 'sequence'"),
        ({"rollout_is_threshold": math.nan}, ValueError, "rollout_is_threshold", "> 0"),
        ({"rollout_is_threshold": "2"}, TypeError, "rollout_is_threshold", "real number"),
        ({"rollout_is_threshold_lower": -0.5}, ValueError, "rollout_is_threshold_lower", "> 0"),
        (
            {"rollout_is_weights": torch.ones(B, T, dtype=torch.long)},
            TypeError,
            "rollout_is_weights",
            "floating-point",
        ),
        (
            {"raw_rollout_is_weights": torch.ones(B, T, dtype=torch.long)},
            TypeError,
            "raw_rollout_is_weights",
            "floating-point",
        ),
        (
            {"raw_rollout_is_weights": torch.ones(B, T - 1)},
            ValueError,
            "raw_rollout_is_weights",
            "[3, 4]",
        ),
        (
            {"log_ratio_for_metrics": torch.zeros(B, T, dtype=torch.long)},
            TypeError,
            "log_ratio_for_metrics",
            "floating-point",
        ),
        ({"response_mask": torch.full((B, T), 0.5)}, ValueError, "response_mask", "only 0 and 1"),
    ],
)
def test_compute_is_metrics_bad_argument_names_it(kw, exc, arg, words):
    with pytest.raises(exc, match=names(arg)) as info:
        is_metrics(**kw)
    assert words in str(info.value)


def rs_metrics(**kw):
    old, logp, _, mask = tensors()
    args = {
        "option_name": "token_k1",
        "rs_statistic": logp - old,
        "response_mask": mask,
        "seq_valid_mask": torch.ones(B, dtype=torch.bool),
        "level": "token",
        "per_sequence_values": None,
        "rollout_rs_threshold": 1.0,
        "rollout_rs_threshold_lower": 0.1,
        "apply_lower_threshold": True,
        **kw,
    }
    option_name = args.pop("option_name")
    rs, mask, valid = (
        args.pop("rs_statistic"),
        args.pop("response_mask"),
        args.pop("seq_valid_mask"),
    )
    return verl.compute_rs_metrics(option_name, rs, mask, valid, **args)


@pytest.mark.parametrize(
    ("kw", "exc", "arg", "words"),
    [
        ({"option_name": 3}, TypeError, "option_name", "str"),
        ({"level": "row"}, ValueError, "level", "'token', 'sequence'"),
        ({"rollout_rs_threshold": math.nan}, ValueError, "rollout_rs_threshold", "a number"),
        ({"rollout_rs_threshold": "x"}, TypeError, "rollout_rs_threshold", "real number"),
        (
            {"rollout_rs_threshold_lower": math.nan},
            ValueError,
            "rollout_rs_threshold_lower",
            "a number",
        ),
        (
            {"rollout_rs_threshold_lower": None},
            TypeError,
            "rollout_rs_threshold_lower",
            "real number",
        ),
        ({"apply_lower_threshold": "no"}, TypeError, "apply_lower_threshold", "bool"),
        ({"apply_lower_threshold": 1}, TypeError, "apply_lower_threshold", "bool"),
        (
            {"seq_valid_mask": torch.ones(B + 1, dtype=torch.bool)},
            ValueError,
            "seq_valid_mask",
            "[3]",
        ),
        ({"seq_valid_mask": torch.full((B,), 0.5)}, ValueError, "seq_valid_mask", "only 0 and 1"),
        ({"per_sequence_values": torch.ones(B, 2)}, ValueError, "per_sequence_values", "[bs]"),
        (
            {"per_sequence_values": torch.ones(B, dtype=torch.long)},
            TypeError,
            "per_sequence_values",
            "floating-point",
        ),
        (
            {"rs_statistic": torch.ones(B, T, dtype=torch.long)},
            TypeError,
            "rs_statistic",
            "floating-point",
        ),
    ],
)
def test_compute_rs_metrics_bad_argument_names_it(kw, exc, arg, words):
    with pytest.raises(exc, match=names(arg)) as info:
        rs_metrics(**kw)
    assert words in str(info.value)


def test_valid_values_run():
    assert math.isfinite(bypass(rollout_is="token", loss_type="reinforce")[0].item())
    assert math.isfinite(
        is_metrics(rollout_is="sequence", log_ratio_for_metrics=torch.zeros(B))["rollout_is_mean"]
    )
    m = rs_metrics(level="sequence", per_sequence_values=torch.zeros(B, 1))
    assert math.isfinite(m["rollout_rs_token_k1_mean"])
