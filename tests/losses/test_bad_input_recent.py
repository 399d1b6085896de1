"""Bad and odd input to the policy-loss kinds and keywords added last: a NaN at an action token
gives a NaN loss (and a NaN gradient there) whatever the kind does with the token, a NaN at a
mask-0 token changes nothing, and every new option or keyword refuses a bad value with a
ValueError / TypeError whose message names it and what it accepts."""

from __future__ import annotations

import math

import pytest
import torch
from tests._bad_input import names

import rlops
from rlops import aggregate_loss, entropy_loss, policy_loss, value_loss
from rlops.losses import POLICY_KINDS

B, T = 3, 5
NEW_KINDS = ("luspo", "vespo", "dppo_tv", "dppo_kl", "dro")
ACTION, MASKED = (0, 1), (1, 4)  # an action token, and a mask-0 token


def batch(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(B, T, generator=g, dtype=dtype) - 0.1
    old = logp + 0.3 * torch.randn(B, T, generator=g, dtype=dtype)  # some ratios clip
    adv = torch.randn(B, T, generator=g, dtype=dtype)
    weights = 0.5 + torch.rand(B, T, generator=g, dtype=dtype)
    mask = torch.ones(B, T)
    mask[MASKED] = 0
    mask[2, 0] = 0
    return logp, old, adv, weights, mask


def run(kind, logp, old, adv, weights, mask, **kw):
    extra = {"generator": torch.Generator().manual_seed(1)} if kind == "clip_cov" else {}
    if kind == "clip_cov":
        extra["clip_cov_ratio"] = 0.2
    return policy_loss(logp, old, adv, mask, kind=kind, rollout_is_weights=weights, **extra, **kw)


INPUTS = ("logp", "old_logp", "advantages", "rollout_is_weights")


def poisoned(which, at):
    logp, old, adv, weights, mask = batch()
    x = dict(zip(INPUTS, (logp, old, adv, weights)))
    x[which] = x[which].clone()
    x[which][at] = math.nan
    logp = x["logp"].clone().requires_grad_(True)
    return logp, x["old_logp"], x["advantages"], x["rollout_is_weights"], mask


# --------------------------------------------------------------------------- NaN semantics
@pytest.mark.parametrize("which", INPUTS)
@pytest.mark.parametrize("kind", POLICY_KINDS)
def test_nan_at_an_action_token_gives_a_nan_loss_and_gradient(kind, which):
    logp, old, adv, w, mask = poisoned(which, ACTION)
    loss, _ = run(kind, logp, old, adv, w, mask)
    assert loss.isnan()
    loss.backward()
    assert logp.grad[ACTION].isnan()  # no optimizer step can take a finite gradient from it


@pytest.mark.parametrize("which", INPUTS)
@pytest.mark.parametrize("kind", POLICY_KINDS)
def test_nan_at_a_masked_token_changes_nothing(kind, which):
    # a mask-0 token is not part of the loss: loss and gradient are those of the clean batch
    logp0, old0, adv0, w0, mask = batch()
    logp0.requires_grad_(True)
    clean, _ = run(kind, logp0, old0, adv0, w0, mask)
    clean.backward()
    logp, old, adv, w, _ = poisoned(which, MASKED)
    loss, _ = run(kind, logp, old, adv, w, mask)
    loss.backward()
    assert torch.equal(loss, clean)
    assert torch.equal(logp.grad, logp0.grad)


@pytest.mark.parametrize("which", ("logp", "old_logp", "advantages"))
@pytest.mark.parametrize("kind", POLICY_KINDS)
def test_nan_stays_on_its_token_or_its_row_in_the_loss_matrix(kind, which):
    # agg=None: NaN at the poisoned token (a per-row kind: on its row's action tokens), never
    # on a mask-0 entry nor on another row
    logp, old, adv, w, mask = poisoned(which, ACTION)
    mat, _ = run(kind, logp, old, adv, w, mask, agg=None)
    assert mat[ACTION].isnan()
    assert torch.equal(mat[mask == 0], torch.zeros_like(mat[mask == 0]))
    assert not mat[1:].isnan().any()


@pytest.mark.parametrize("kind", ("dppo_tv", "dppo_kl"))
@pytest.mark.parametrize("which", ("logp", "old_logp"))
def test_regression_dppo_nan_log_prob_is_not_dropped_by_the_trust_region(kind, which):
    # before: the NaN token compared False with the trust region, was dropped, and the loss
    # was finite (0.07985 on the batch)
    logp, old, adv, _, mask = poisoned(which, ACTION)
    loss, m = policy_loss(logp, old, adv, mask, kind=kind)
    assert loss.isnan()
    assert m["ppo_kl"].isnan()


def test_regression_vespo_nan_old_logp_is_not_mapped_to_zero():
    # before: φ of the row was NaN and nan_to_num made it 0: loss 0.3587, ppo_kl NaN
    logp, old, adv, _, mask = poisoned("old_logp", ACTION)
    loss, m = policy_loss(logp, old, adv, mask, kind="vespo")
    assert loss.isnan()
    assert m["vespo_phi_mean"].isnan()


def test_vespo_overflowing_phi_still_counts_zero():
    # φ = W^k·e^(λ(1 − W)) overflows for a large k and a tiny λ: TRL and Liger count it 0, and
    # so does rlops (finite loss); only a NaN is kept
    logp = torch.zeros(1, 2, dtype=torch.float32, requires_grad=True)
    old = torch.full((1, 2), -8.0)  # W = e^16
    loss, m = policy_loss(
        logp, old, torch.ones(1, 2), torch.ones(1, 2), kind="vespo", k_pos=10.0, lambda_pos=1e-6
    )
    assert torch.isfinite(loss)
    assert m["vespo_phi_mean"] == 0


def test_inf_log_prob_is_not_turned_into_nan():
    # a −inf log-prob (a token the policy now gives probability 0) was finite for ppo before the
    # NaN rule, and still is: the rule is about NaN only
    logp, old, adv, _, mask = batch()
    logp = logp.clone()
    logp[ACTION] = -math.inf
    loss, _ = policy_loss(logp, old, adv, mask, kind="ppo")
    assert torch.isfinite(loss)


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
]


@pytest.mark.parametrize(
    ("kind", "option", "bad", "exc", "words"),
    BAD_OPTIONS,
    ids=[f"{k}-{o}-{v!r}" for k, o, v, _, _ in BAD_OPTIONS],
)
def test_bad_kind_option_raises_naming_it(kind, option, bad, exc, words):
    logp, old, adv, _, mask = batch()
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
    ],
)
def test_option_of_another_kind_raises_listing_the_kinds_options(kind, other):
    logp, old, adv, _, mask = batch()
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
    logp, old, adv, w, mask = batch()
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
IDS = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
LOSSES = {
    "policy_loss": lambda **kw: policy_loss(*_four(), kind="luspo", **kw),
    "aggregate_loss": lambda **kw: aggregate_loss(_four()[0], _four()[3], **kw),
    "entropy_loss": lambda **kw: entropy_loss(-_four()[0], _four()[3], **kw),
    "value_loss": lambda **kw: value_loss(*_four(), **kw),
}


def _four():
    logp, old, adv, _, mask = batch()
    return logp, old, adv, mask


# (keyword arguments, exception, the argument named, words of what it accepts)
BAD_LAYOUT = [
    ({"cp_layout": "diagonal"}, ValueError, "cp_layout", "'zigzag', 'contiguous'"),
    ({"cp_layout": None}, ValueError, "cp_layout", "'zigzag', 'contiguous'"),
    ({"cp_layout": 1}, ValueError, "cp_layout", "'zigzag', 'contiguous'"),
    ({"seq_ids": IDS.float(), "seqs_per_row": 2}, TypeError, "seq_ids", "integer tensor"),
    ({"seq_ids": IDS.bool(), "seqs_per_row": 2}, TypeError, "seq_ids", "integer tensor"),
    ({"seq_ids": IDS.tolist(), "seqs_per_row": 2}, TypeError, "seq_ids", "torch.Tensor"),
    ({"seq_ids": IDS[:, :4], "seqs_per_row": 2}, ValueError, "seq_ids", "[3, 5]"),
    ({"seq_ids": IDS + 2, "seqs_per_row": 2}, ValueError, "seq_ids", "[0, 2)"),
    ({"seq_ids": IDS - 1, "seqs_per_row": 2}, ValueError, "seq_ids", "[0, 2)"),
    ({"seq_ids": IDS}, ValueError, "seqs_per_row", "number of sequence slots"),
    ({"seqs_per_row": 2}, ValueError, "seq_ids", "pass both"),
    ({"seq_ids": IDS, "seqs_per_row": 0}, ValueError, "seqs_per_row", ">= 1"),
    ({"seq_ids": IDS, "seqs_per_row": 2.0}, TypeError, "seqs_per_row", "int"),
    ({"seq_ids": IDS, "seqs_per_row": True}, TypeError, "seqs_per_row", "int"),
    ({"seq_ids": IDS, "seqs_per_row": "2"}, TypeError, "seqs_per_row", "int"),
    ({"cp_group": "world"}, TypeError, "cp_group", "ProcessGroup"),
]


@pytest.mark.parametrize("fn", sorted(LOSSES))
@pytest.mark.parametrize(
    ("kw", "exc", "arg", "words"),
    BAD_LAYOUT,
    ids=[f"{sorted(k.items())[0][0]}-{i}" for i, (k, *_) in enumerate(BAD_LAYOUT)],
)
def test_bad_layout_keyword_raises_naming_it(fn, kw, exc, arg, words):
    with pytest.raises(exc, match=names(arg)) as info:
        LOSSES[fn](**kw)
    assert words in str(info.value)


def test_packed_rows_accept_the_valid_layout():
    # the same keywords with valid values run (the bad-value tests above are not vacuous)
    for fn in LOSSES.values():
        out = fn(seq_ids=IDS, seqs_per_row=2, cp_layout="contiguous")
        loss = out[0] if isinstance(out, tuple) else out
        assert torch.isfinite(loss)
    assert rlops.policy_loss is policy_loss
