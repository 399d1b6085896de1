"""The contracts' options and how they read the user's function: a bad option is one
``ValueError`` / ``TypeError`` naming it before the function is called; the temperature and the
estimator's arguments reach the function as its signature takes them, and a signature that fits
no form is one ``TypeError`` naming the expected one; shapes are enforced (nothing reshaped); a
result that is not a tensor is one ``TypeError``; float64 is judged at float64's precision."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable

import pytest
import torch

import rlops
from rlops.testing import check_advantages, check_logprobs, check_policy_loss

SMALL = {"vocab_sizes": (100,), "rows": 8}  # check_logprobs: quick inputs
QUICK = {"long_length": 2048}  # check_advantages: quick inputs
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is usable here")


def counted(fn: Callable) -> tuple[Callable, list[tuple[tuple, dict]]]:
    """``fn`` behind a wrapper with ``fn``'s signature that records each call's arguments."""
    calls: list[tuple[tuple, dict]] = []

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        calls.append((args, kwargs))
        return fn(*args, **kwargs)

    return wrapper, calls


def _gather(lp: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return lp.gather(-1, target.long()[:, None])[:, 0]


def logp_fn(logits, target, temperature):
    """A correct log-prob and entropy in float32 (torch's log_softmax)."""
    lp = torch.log_softmax(logits.float() / temperature, dim=-1)
    p = lp.exp()
    return _gather(lp, target), -(p * lp.masked_fill(p == 0, 0.0)).sum(-1)


def loss_fn(logp, old_logp, advantages, mask, num_tokens=None):
    return rlops.policy_loss(logp, old_logp, advantages, mask, num_tokens=num_tokens)


def gae_fn(rewards, values, mask, gamma, lam):
    return rlops.gae(rewards, values, gamma=gamma, lam=lam, mask=mask)


# --------------------------------------------------------------------------- options
#: contract -> (the contract, a correct function, its required options)
CONTRACTS: dict[str, tuple[Callable, Callable, dict]] = {
    "logprobs": (check_logprobs, logp_fn, SMALL),
    "loss": (check_policy_loss, loss_fn, {"agg": "token-mean"}),
    "advantages": (check_advantages, gae_fn, QUICK),
}

#: (contract, options, the argument the error must name)
BAD_OPTIONS = [
    ("logprobs", {"rows": 0}, "rows"),
    ("logprobs", {"rows": -3}, "rows"),
    ("logprobs", {"rows": 1.5}, "rows"),
    ("logprobs", {"rows": True}, "rows"),
    ("logprobs", {"vocab_sizes": ()}, "vocab_sizes"),
    ("logprobs", {"vocab_sizes": (0,)}, "vocab_sizes"),
    ("logprobs", {"vocab_sizes": (1,)}, "vocab_sizes"),
    ("logprobs", {"vocab_sizes": "1000"}, "vocab_sizes"),
    ("logprobs", {"vocab_sizes": 1000}, "vocab_sizes"),
    ("logprobs", {"temperature": 0}, "temperature"),
    ("logprobs", {"temperature": -1}, "temperature"),
    ("logprobs", {"temperature": math.nan}, "temperature"),
    ("logprobs", {"temperature": math.inf}, "temperature"),
    ("logprobs", {"temperature": True}, "temperature"),
    ("logprobs", {"dtypes": (torch.int64,)}, "dtypes"),
    ("logprobs", {"dtypes": ()}, "dtypes"),
    ("logprobs", {"dtypes": torch.float32}, "dtypes"),
    ("logprobs", {"bitwise": 1}, "bitwise"),
    ("logprobs", {"device": "nope"}, "device"),
    ("logprobs", {"seed": -1}, "seed"),
    ("logprobs", {"seed": 1.5}, "seed"),
    ("loss", {"agg": "bogus"}, "agg"),
    ("loss", {"kind": "bogus"}, "kind"),
    ("loss", {"clip_low": -0.5}, "clip_low"),
    ("loss", {"clip_high": math.nan}, "clip_high"),
    # rlops.policy_loss documents dual_clip for gspo as None or > 1
    ("loss", {"kind": "gspo", "dual_clip": 0.5}, "dual_clip"),
    ("loss", {"bogus": 1}, "bogus"),  # no kind takes it
    ("loss", {"loss_scale_factor": 0}, "loss_scale_factor"),
    ("loss", {"empty_rows": "bogus"}, "empty_rows"),
    ("loss", {"device": "nope"}, "device"),
    ("loss", {"seed": -1}, "seed"),
    ("advantages", {"estimator": "bogus"}, "estimator"),
    ("advantages", {"gamma": math.nan}, "gamma"),
    ("advantages", {"gamma": 1.5}, "gamma"),
    ("advantages", {"lam": -0.1}, "lam"),
    ("advantages", {"long_length": 0}, "long_length"),
    ("advantages", {"long_length": -1}, "long_length"),
    ("advantages", {"device": "nope"}, "device"),
    ("advantages", {"seed": -1}, "seed"),
]
OPTION_CASES = [
    pytest.param(c, o, n, id=f"{c}-{n}={next(iter(o.values()))!r}") for c, o, n in BAD_OPTIONS
] + [
    pytest.param(c, {"device": "cuda"}, "device", id=f"{c}-device='cuda'", marks=NO_CUDA)
    for c in CONTRACTS
]


@pytest.mark.parametrize("contract, options, name", OPTION_CASES)
def test_a_bad_option_raises_naming_it_before_the_function_is_called(contract, options, name):
    check, fn, base = CONTRACTS[contract]
    fn, calls = counted(fn)
    with pytest.raises((ValueError, TypeError), match=re.escape(name)):
        check(fn, **{**base, **options})
    assert calls == []  # options are checked before the preflight call and every check


# --------------------------------------------------------------------------- the function's form
def test_a_function_without_temperature_is_checked_at_one_and_its_check_skipped():
    def two_args(logits, target):
        return logp_fn(logits, target, 1.0)

    report = check_logprobs(two_args, **SMALL)
    assert report.ok, report
    assert report["temperature"].ok is None
    assert "skipped" in report["temperature"].figure
    assert "temperature" in report.title
    fn, calls = counted(two_args)
    with pytest.raises(ValueError, match="temperature"):
        check_logprobs(fn, temperature=0.7, **SMALL)
    assert calls == []


def _keyword_only(logits, target, *, temperature):
    return logp_fn(logits, target, temperature)


def _var_keyword(logits, target, **kwargs):
    return logp_fn(logits, target, kwargs["temperature"])


def _positional_tau(logits, target, tau):
    return logp_fn(logits, target, tau)


@pytest.mark.parametrize(
    "fn, by",
    [
        (_keyword_only, "keyword"),
        (_var_keyword, "keyword"),
        (rlops.logprobs_and_entropy, "keyword"),
        (_positional_tau, "position"),
    ],
    ids=["keyword-only", "kwargs", "rlops.logprobs_and_entropy", "positional-tau"],
)
def test_the_temperature_reaches_the_function_as_it_takes_it(fn, by):
    fn, calls = counted(fn)
    report = check_logprobs(fn, temperature=0.7, **SMALL)
    assert report.ok, report
    assert report["temperature"].ok is True
    if by == "keyword":
        assert all(len(a) == 2 and set(k) == {"temperature"} for a, k in calls)
        received = {k["temperature"] for _, k in calls}
    else:
        assert all(len(a) == 3 and not k for a, k in calls)
        received = {a[2] for a, _ in calls}
    # the contract's temperature, and 0.5 and 2 of the temperature check
    assert received == {0.7, 0.5, 2.0}


def _one_arg(logits):
    return logits[:, 0]


def _four_required(a, b, c, d):
    return a[:, 0]


@pytest.mark.parametrize("fn", [_one_arg, _four_required], ids=lambda f: f.__name__)
def test_a_log_prob_signature_that_fits_no_form_raises_naming_the_forms(fn):
    fn, calls = counted(fn)
    with pytest.raises(TypeError, match=r"fn\(logits.*target"):
        check_logprobs(fn, **SMALL)
    assert calls == []


@pytest.mark.parametrize(
    "fn, options",
    [(rlops.gae, {}), (rlops.discounted_returns, {"estimator": "returns"})],
    ids=["gae", "discounted_returns"],
)
def test_rlops_estimators_pass_as_they_are(fn, options):
    report = check_advantages(fn, **options, **QUICK)
    assert report.ok, report


def test_a_positional_estimator_is_called_positionally():
    fn, calls = counted(gae_fn)
    report = check_advantages(fn, **QUICK)
    assert report.ok, report
    assert calls and all(len(a) == 5 and not k for a, k in calls)
    assert report["dones"].ok is None  # it takes no dones=


def test_an_estimator_signature_that_fits_no_form_raises_naming_the_form():
    def rewards_only(rewards):
        return rewards

    fn, calls = counted(rewards_only)
    with pytest.raises(TypeError, match=re.escape("(rewards, values, mask, gamma, lam)")):
        check_advantages(fn, **QUICK)
    assert calls == []


def test_a_loss_of_fewer_than_four_tensors_raises():
    def three(logp, old_logp, advantages):
        return (logp - old_logp).sum()

    fn, calls = counted(three)
    with pytest.raises(TypeError):
        check_policy_loss(fn, agg="token-mean")
    assert calls == []


# --------------------------------------------------------------------------- shapes
def _logp_column(logits, target, temperature):
    return logp_fn(logits, target, temperature)[0][:, None]


def _entropy_column(logits, target, temperature):
    logp, ent = logp_fn(logits, target, temperature)
    return logp, ent[:, None]


@pytest.mark.parametrize("fn", [_logp_column, _entropy_column], ids=lambda f: f.__name__)
def test_a_log_prob_or_entropy_of_shape_n_by_1_fails_values(fn):
    report = check_logprobs(fn, **SMALL)
    assert report["values"].ok is False
    figure = report["values"].figure
    assert "[8, 1]" in figure and "[8]" in figure, figure


def test_a_loss_of_shape_1_fails_values():
    def loss_1(logp, old_logp, advantages, mask, num_tokens=None):
        return loss_fn(logp, old_logp, advantages, mask, num_tokens)[0].reshape(1)

    report = check_policy_loss(loss_1, agg="token-mean")
    assert report["values"].ok is False
    figure = report["values"].figure
    assert "[1]" in figure and "[]" in figure, figure


@pytest.mark.parametrize(
    "reshape",
    [lambda a: a[..., None], lambda a: a.transpose(0, 1)],
    ids=["B-T-1", "T-B"],
)
def test_advantages_of_another_shape_fail_values(reshape):
    def shaped(rewards, values, mask, gamma, lam):
        return reshape(gae_fn(rewards, values, mask, gamma, lam)[0])

    report = check_advantages(shaped, **QUICK)
    assert report["values"].ok is False
    assert "[4, 256]" in report["values"].figure  # the values check's rows: 4 of 256 tokens


# --------------------------------------------------------------------------- non-tensor results
def _result(kind: str, n: int) -> object:
    if kind == "none":
        return None
    if kind == "list":
        return [0.5] * n
    np = pytest.importorskip("numpy")
    return np.zeros(n)


@pytest.mark.parametrize("kind", ["none", "list", "numpy"])
@pytest.mark.parametrize("contract", list(CONTRACTS))
def test_a_result_that_is_not_a_tensor_is_one_type_error(contract, kind):
    _result(kind, 1)  # skips here if numpy is missing
    check, _, base = CONTRACTS[contract]

    def lp(logits, target, temperature):
        return _result(kind, logits.shape[0])

    def loss(logp, old_logp, advantages, mask, num_tokens=None):
        return _result(kind, 1)

    def adv(rewards, values, mask, gamma, lam):
        return _result(kind, rewards.numel())

    fn = {"logprobs": lp, "loss": loss, "advantages": adv}[contract]
    with pytest.raises(TypeError):
        check(fn, **base)


# --------------------------------------------------------------------------- float64
def test_float64_logits_pass_at_small_sizes():
    report = check_logprobs(rlops.logprobs_and_entropy, dtypes=(torch.float64,), **SMALL)
    assert report.ok, report


def test_float64_logits_pass_at_the_defaults():
    report = check_logprobs(rlops.logprobs_and_entropy, dtypes=(torch.float64,))
    assert report.ok, report


def test_float64_computed_in_float32_fails_values():
    def secretly_float32(logits, target, temperature):
        lp = torch.log_softmax(logits.float() / temperature, dim=-1)
        return _gather(lp, target).double()

    report = check_logprobs(secretly_float32, dtypes=(torch.float64,), **SMALL)
    assert report["values"].ok is False, report
