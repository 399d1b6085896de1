"""The losses' keyword options: one declaration of the aggregation's keywords
(:class:`AggregationOptions`), shared by every loss; a misspelt keyword is a ``TypeError``
naming it, never a silently ignored option; a bad kind option, tensor input or layout keyword
is a ``ValueError`` / ``TypeError`` whose message names it and what it accepts."""

from __future__ import annotations

import math

import pytest
import torch
from tests._bad_input import names
from tests._losses_util import BAD_LAYOUT, BAD_LAYOUT_IDS, LAYOUT_IDS, make_inputs, small_batch

import rlops
from rlops import aggregate_loss, entropy_loss, policy_loss, value_loss
from rlops.losses._checks import KIND_OPTIONS
from rlops.losses.aggregation import AggregationOptions
from rlops.losses.policy import PolicyLossOptions

_X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
_M = torch.tensor([[1, 1, 0], [1, 1, 1]])


def _calls():
    return {
        "aggregate_loss": lambda **kw: rlops.aggregate_loss(_X, _M, **kw),
        "entropy_loss": lambda **kw: rlops.entropy_loss(_X, _M, **kw),
        "value_loss": lambda **kw: rlops.value_loss(_X, _X, _X * 0, _M, **kw),
        "policy_loss": lambda **kw: rlops.policy_loss(-_X, -_X, _X, _M, **kw),
    }


@pytest.mark.parametrize("name", sorted(_calls()))
def test_misspelt_keyword_is_a_type_error_naming_it(name):
    with pytest.raises(TypeError, match="num_token"):
        _calls()[name](num_token=5)


@pytest.mark.parametrize("name", sorted(_calls()))
def test_every_aggregation_keyword_is_taken(name):
    """Each key of AggregationOptions reaches the aggregation: num_tokens = 10 halves the
    token-mean of the call's own 5 tokens (value_loss: 0.5·(V − 0)², policy_loss: −A)."""
    own = _calls()[name]()
    own = own[0] if isinstance(own, tuple) else own
    given = _calls()[name](num_tokens=10)
    given = given[0] if isinstance(given, tuple) else given
    torch.testing.assert_close(given, own / 2)


def test_aggregation_keywords_by_hand():
    """The five action tokens [1, 2, 4, 5, 6] by hand: the token sum 18, the two rows' sums
    3 and 15 (mean 9), divided by L = 4 with loss_scale_factor."""
    assert rlops.aggregate_loss(_X, _M, "token-sum").item() == 18.0
    assert rlops.aggregate_loss(_X, _M, "seq-mean-token-sum").item() == 9.0
    norm = rlops.aggregate_loss(_X, _M, "seq-mean-token-sum-norm", loss_scale_factor=4.0)
    assert norm.item() == 9.0 / 4
    assert rlops.aggregate_loss(_X, _M, "seq-mean-token-sum", num_seqs=3).item() == 6.0


def test_policy_options_declare_every_kind_option():
    """PolicyLossOptions (the typed keywords of policy_loss) holds the aggregation's keys and
    every kind's options, and nothing else."""
    kind_keys = set().union(*(set(spec) for spec in KIND_OPTIONS.values()))
    declared = set(PolicyLossOptions.__annotations__)
    assert declared == kind_keys | set(AggregationOptions.__annotations__)


def test_a_kind_option_is_not_an_aggregation_option():
    with pytest.raises(TypeError, match="clip_low"):
        rlops.aggregate_loss(_X, _M, clip_low=0.2)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="tau_pos"):
        rlops.policy_loss(-_X, -_X, _X, _M, kind="ppo", tau_pos=1.0)


NEW_KINDS = ("luspo", "vespo", "dppo_tv", "dppo_kl", "dro")
INPUTS = ("logp", "old_logp", "advantages", "rollout_is_weights")


# --------------------------------------------------------------------------- kind options
REAL = "real number"
# (kind, option, bad value, exception, words the message must hold besides the option's name)
BAD_OPTIONS = [
    ("luspo", "clip_low", "x", TypeError, REAL),
    ("luspo", "clip_low", math.nan, ValueError, "> 0"),
    ("luspo", "clip_low", -0.1, ValueError, "> 0"),
    ("luspo", "clip_low", 0.0, ValueError, "> 0"),
    ("luspo", "clip_low", 1.5, ValueError, "< 1"),
    ("luspo", "clip_low", None, TypeError, REAL),
    ("luspo", "clip_high", "x", TypeError, REAL),
    ("luspo", "clip_high", math.nan, ValueError, "> 0"),
    ("luspo", "clip_high", -math.inf, ValueError, "> 0"),
    ("luspo", "clip_high", torch.ones(2), TypeError, "1-dim tensor"),
    ("vespo", "k_pos", "x", TypeError, REAL),
    ("vespo", "k_pos", math.nan, ValueError, "number"),
    ("vespo", "k_pos", math.inf, ValueError, "finite"),
    ("vespo", "k_neg", -math.inf, ValueError, "finite"),
    ("vespo", "k_neg", True, TypeError, REAL),
    ("vespo", "lambda_pos", 0.0, ValueError, "> 0"),
    ("vespo", "lambda_pos", math.inf, ValueError, "finite"),
    ("vespo", "lambda_neg", -2.0, ValueError, "> 0"),
    ("vespo", "lambda_neg", math.nan, ValueError, "> 0"),
    ("vespo", "lambda_neg", [2.0], TypeError, REAL),
    ("dppo_tv", "clip_low", "x", TypeError, REAL),
    ("dppo_tv", "clip_low", 0.0, ValueError, "> 0"),
    ("dppo_tv", "clip_high", math.nan, ValueError, "> 0"),
    ("dppo_tv", "clip_ratio_c", -1.0, ValueError, "> 0"),
    ("dppo_tv", "clip_ratio_c", None, TypeError, REAL),
    ("dppo_kl", "clip_low", -0.2, ValueError, "> 0"),
    ("dppo_kl", "clip_high", "x", TypeError, REAL),
    ("dppo_kl", "clip_ratio_c", math.nan, ValueError, "> 0"),
    ("dppo_kl", "clip_ratio_c", torch.ones(3), TypeError, "1-dim tensor"),
    ("dro", "dro_beta", "x", TypeError, REAL),
    ("dro", "dro_beta", -1.0, ValueError, ">= 0"),
    ("dro", "dro_beta", math.nan, ValueError, ">= 0"),
    ("dro", "dro_beta", math.inf, ValueError, "finite"),
    ("cispo", "level", "seq", ValueError, "'token', 'sequence'"),
    ("cispo", "level", None, ValueError, "'token', 'sequence'"),
    ("sapo", "level", 1, ValueError, "'token', 'sequence'"),
    ("sapo", "level", "Sequence", ValueError, "'token', 'sequence'"),
    ("gspo", "dual_clip", 1.0, ValueError, "> 1"),
    ("gspo", "dual_clip", 0.5, ValueError, "> 1"),
    ("gspo", "dual_clip", math.nan, ValueError, "> 1"),
    ("gspo", "dual_clip", "3", TypeError, REAL),
    ("ipo", "ipo_threshold", -0.1, ValueError, ">= 0"),
    ("ipo", "ipo_threshold", math.nan, ValueError, ">= 0"),
    ("ipo", "ipo_threshold", None, TypeError, REAL),
    ("ipo", "adv_tau", -1.0, ValueError, ">= 0"),
    ("ipo", "adv_tau", math.inf, ValueError, "finite"),
    ("ipo", "kl_tau", "x", TypeError, REAL),
    ("ipo", "kl_tau", torch.ones(2), TypeError, "1-dim tensor"),
    ("topr", "positive_weight", -1.0, ValueError, ">= 0"),
    ("topr", "positive_weight", math.nan, ValueError, ">= 0"),
    ("topr", "positive_weight", "1", TypeError, REAL),
    ("topr", "negative_weight", math.inf, ValueError, "finite"),
    ("topr", "negative_weight", None, TypeError, REAL),
]


@pytest.mark.parametrize(
    ("kind", "option", "bad", "exc", "words"),
    BAD_OPTIONS,
    ids=[f"{k}-{o}-{v!r}" for k, o, v, _, _ in BAD_OPTIONS],
)
def test_bad_kind_option_raises_naming_it(kind, option, bad, exc, words):
    logp, old, adv, _, mask = small_batch()
    with pytest.raises(exc, match=names(option)) as info:
        policy_loss(logp, old, adv, mask, kind=kind, **{option: bad})
    assert words in str(info.value)


@pytest.mark.parametrize(
    ("kind", "other"),
    [
        ("luspo", "dual_clip"),
        ("vespo", "clip_low"),
        ("dppo_tv", "level"),
        ("dppo_kl", "tau_pos"),
        ("dro", "clip_ratio_c"),
        ("ppo", "level"),
        ("ipo", "clip_low"),
        ("topr", "clip_high"),
        ("ppo", "ipo_threshold"),
    ],
)
def test_option_of_another_kind_raises_listing_the_kinds_options(kind, other):
    logp, old, adv, _, mask = small_batch()
    with pytest.raises(TypeError, match=rf"unknown option\(s\) \['{other}'\].*its options are"):
        policy_loss(logp, old, adv, mask, kind=kind, **{other: 1.5})


@pytest.mark.parametrize("kind", NEW_KINDS)
@pytest.mark.parametrize(
    ("name", "bad", "exc", "words"),
    [
        ("logp", lambda x: x.long(), TypeError, "floating-point"),
        ("old_logp", lambda x: x.to(torch.int32), TypeError, "floating-point"),
        ("advantages", lambda x: x.bool(), TypeError, "floating-point"),
        ("rollout_is_weights", lambda x: x.long(), TypeError, "floating-point"),
        ("rollout_is_weights", lambda x: x[:, :-1], ValueError, "[3, 5]"),
        ("old_logp", lambda x: x[None], ValueError, "[3, 5]"),
        ("advantages", lambda x: x.tolist(), TypeError, "torch.Tensor"),
    ],
)
def test_bad_tensor_input_to_a_new_kind_raises_naming_it(kind, name, bad, exc, words):
    logp, old, adv, w, mask = small_batch()
    x = dict(zip(INPUTS, (logp, old, adv, w)))
    x[name] = bad(x[name])
    with pytest.raises(exc, match=names(name)) as info:
        policy_loss(
            x["logp"],
            x["old_logp"],
            x["advantages"],
            mask,
            kind=kind,
            rollout_is_weights=x["rollout_is_weights"],
        )
    assert words in str(info.value)


# --------------------------------------------------------------------------- layout keywords
def _four():
    logp, old, adv, _, mask = small_batch()
    return logp, old, adv, mask


LOSSES = {
    "policy_loss": lambda **kw: policy_loss(*_four(), kind="luspo", **kw),
    "aggregate_loss": lambda **kw: aggregate_loss(_four()[0], _four()[3], **kw),
    "entropy_loss": lambda **kw: entropy_loss(-_four()[0], _four()[3], **kw),
    "value_loss": lambda **kw: value_loss(*_four(), **kw),
}


@pytest.mark.parametrize("fn", sorted(LOSSES))
@pytest.mark.parametrize(("kw", "exc", "arg", "words"), BAD_LAYOUT, ids=BAD_LAYOUT_IDS)
def test_bad_layout_keyword_raises_naming_it(fn, kw, exc, arg, words):
    """The same list as the rollout correction's (tests/corrections/)."""
    with pytest.raises(exc, match=names(arg)) as info:
        LOSSES[fn](**kw)
    assert words in str(info.value)


def test_packed_rows_accept_the_valid_layout():
    # the same keywords with valid values run (the bad-value tests above are not vacuous)
    for fn in LOSSES.values():
        out = fn(seq_ids=LAYOUT_IDS, seqs_per_row=2, cp_layout="contiguous")
        loss = out[0] if isinstance(out, tuple) else out
        assert torch.isfinite(loss)
    assert rlops.policy_loss is policy_loss


# --------------------------------------------------------------------------- bad calls
#: ``(function, keywords, exception, pattern of the message)``: a bad kind, option, weight or
#: normaliser names itself (the options' ranges in full: BAD_OPTIONS above)
BAD_CALLS = [
    ("policy_loss", {"kind": "grpo"}, ValueError, "kind"),
    ("policy_loss", {"kind": "cispo", "dual_clip": 3.0}, TypeError, "dual_clip"),
    ("policy_loss", {"kind": "sapo", "clip_low": 0.2}, TypeError, "clip_low"),
    ("policy_loss", {"tau_pos": 1.0}, TypeError, "tau"),
    (
        "policy_loss",
        {"kind": "clip_cov", "clip_cov_lb": 5.0, "clip_cov_ub": 1.0},
        ValueError,
        "clip_cov_lb",
    ),
    ("policy_loss", {"kind": "clip_cov", "clip_cov_lb": math.nan}, ValueError, "clip_cov_lb"),
    ("policy_loss", {"kind": "clip_cov", "clip_cov_ub": None}, TypeError, "clip_cov_ub"),
    ("policy_loss", {"kind": "gspo", "clip_low": None}, TypeError, "clip_low"),
    *(
        ("policy_loss", {"kind": kind, name: bad}, ValueError, name)
        for bad in (0.0, -1.0, 1.5)
        for kind, name in (("clip_cov", "clip_cov_ratio"), ("kl_cov", "kl_cov_ratio"))
    ),
    *(
        ("policy_loss", {"kind": "sapo", "tau_neg": bad}, ValueError, "tau_neg")
        for bad in (0.0, -1.0, math.inf, math.nan)
    ),
    ("policy_loss", {"kind": "kl_cov", "ppo_kl_coef": -1.0}, ValueError, "ppo_kl_coef"),
    *(
        ("policy_loss", {"kind": kind, "clip_low": 1.0}, ValueError, "clip_low")
        for kind in ("gspo", "cispo", "clip_cov", "luspo")
    ),
    ("policy_loss", {"kind": "geo_mean", "clip_high": 0.0}, ValueError, "clip_high"),
    ("policy_loss", {"kind": "clip_cov", "generator": 3}, TypeError, "generator"),
    ("policy_loss", {"kind": "cispo", "level": "row"}, ValueError, "level"),
    ("policy_loss", {"kind": "sapo", "level": "row"}, ValueError, "level"),
    ("policy_loss", {"kind": "gspo", "level": "sequence"}, TypeError, "level"),
    ("policy_loss", {"kind": "gspo", "dual_clip": 1.0}, ValueError, "dual_clip"),
    ("policy_loss", {"kind": "vespo", "lambda_neg": 0.0}, ValueError, "lambda_neg"),
    ("policy_loss", {"kind": "vespo", "k_pos": math.inf}, ValueError, "k_pos"),
    ("policy_loss", {"kind": "dppo_tv", "clip_ratio_c": 0.0}, ValueError, "clip_ratio_c"),
    ("policy_loss", {"kind": "dppo_kl", "clip_high": -1.0}, ValueError, "clip_high"),
    ("policy_loss", {"kind": "dro", "dro_beta": -0.1}, ValueError, "dro_beta"),
    ("policy_loss", {"kind": "luspo", "tau_pos": 1.0}, TypeError, "tau_pos"),
    ("policy_loss", {"rollout_is_weights": torch.ones(2, 1)}, ValueError, "rollout_is_weights"),
    ("policy_loss", {"rollout_is_weights": torch.ones(3, 2)}, ValueError, "rollout_is_weights"),
    (
        "policy_loss",
        {"rollout_is_weights": torch.ones(2, 3, dtype=torch.long)},
        TypeError,
        "rollout_is_weights",
    ),
    ("policy_loss", {"num_tokens": -1}, ValueError, "num_tokens"),
    ("aggregate_loss", {"num_seqs": torch.ones(2)}, ValueError, "num_seqs"),
    ("value_loss", {"num_tokens": "10"}, TypeError, "num_tokens"),
    ("aggregate_loss", {"group": "world"}, TypeError, "group"),
]


@pytest.mark.parametrize(
    ("fn", "kw", "exc", "pattern"),
    BAD_CALLS,
    ids=[f"{fn}-{'-'.join(f'{k}={v!r}' for k, v in kw.items())}" for fn, kw, _, _ in BAD_CALLS],
)
def test_bad_call_raises_naming_it(fn, kw, exc, pattern):
    lp, old, adv, m = make_inputs(torch.float32, 0, b=2, t=3)
    calls = {
        "policy_loss": lambda: rlops.policy_loss(lp, old, adv, m, **kw),
        "aggregate_loss": lambda: rlops.aggregate_loss(lp, m, **kw),
        "value_loss": lambda: rlops.value_loss(lp, old, adv, m, **kw),
    }
    with pytest.raises(exc, match=pattern):
        calls[fn]()
