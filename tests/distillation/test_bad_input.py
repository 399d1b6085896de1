"""Bad inputs of the distillation ops raise a clear error naming the argument."""

from __future__ import annotations

import math

import pytest
import torch
from tests._bad_input import names

from rlops import distillation_loss, linear_distillation_loss

N, V, K = 4, 10, 3


def _inputs():
    z = torch.randn(N, V)
    logp = torch.log_softmax(torch.randn(N, V), -1)
    a, ids = logp.topk(K, -1)
    return z, a, ids


def _repeated():
    z, a, ids = _inputs()
    ids = ids.clone()
    ids[1, 2] = ids[1, 0]
    return (z, a, ids), {}


def _mass_over_one():
    z, _, ids = _inputs()
    return (z, torch.full((N, K), math.log(0.4)), ids), {}


def _positive():
    z, a, ids = _inputs()
    a = a.clone()
    a[0, 0] = 0.5
    return (z, a, ids), {}


def _nan():
    z, a, ids = _inputs()
    a = a.clone()
    a[2, 1] = float("nan")
    return (z, a, ids), {}


def _ids(fill):
    z, a, ids = _inputs()
    ids = ids.clone()
    ids[3, 1] = fill
    return (z, a, ids), {}


def _k_over_v():
    z = torch.randn(N, 2)
    return (z, torch.full((N, 3), -2.0), torch.tensor([[0, 1, 2]] * N)), {}


def _with(**kw):
    z, a, ids = _inputs()
    return (z, a, ids), kw


def _shapes(which):
    z, a, ids = _inputs()
    if which == "logprobs":
        return (z, a[:, :2], ids), {}
    if which == "ids":
        return (z, a[:2], ids[:2]), {}
    if which == "full":
        return (z, torch.log_softmax(torch.randn(N, V + 1), -1), None), {}
    return (z[0], a[0], ids[0]), {}


BAD = {
    "id out of range": (lambda: _ids(V), ValueError, "teacher_ids"),
    "negative id": (lambda: _ids(-1), ValueError, "teacher_ids"),
    "repeated id": (_repeated, ValueError, "teacher_ids"),
    "float ids": (
        lambda: ((_inputs()[0], _inputs()[1], _inputs()[2].float()), {}),
        TypeError,
        "teacher_ids",
    ),
    "log-prob > 0": (_positive, ValueError, "teacher_logprobs"),
    "NaN log-prob": (_nan, ValueError, "teacher_logprobs"),
    "top-k mass > 1": (_mass_over_one, ValueError, "teacher_logprobs"),
    "k > V": (_k_over_v, ValueError, "teacher_ids"),
    "logprobs vs ids": (lambda: _shapes("logprobs"), ValueError, "teacher_logprobs"),
    "ids vs logits": (lambda: _shapes("ids"), ValueError, "teacher_ids"),
    "full teacher vs logits": (lambda: _shapes("full"), ValueError, "teacher_logprobs"),
    "1-d logits": (lambda: _shapes("1d"), ValueError, "logits"),
    "beta > 1": (lambda: _with(beta=1.5), ValueError, "beta"),
    "beta < 0": (lambda: _with(beta=-0.1), ValueError, "beta"),
    "unknown kind": (lambda: _with(kind="kl"), ValueError, "kind"),
    "tail without ids": (
        lambda: ((_inputs()[0], torch.log_softmax(torch.randn(N, V), -1), None), {"tail": True}),
        ValueError,
        "tail",
    ),
    "temperature 0": (lambda: _with(temperature=0.0), ValueError, "temperature"),
    "clamp NaN": (lambda: _with(log_prob_min_clamp=float("nan")), ValueError, "log_prob_min_clamp"),
    "tail not a bool": (lambda: _with(tail=1), TypeError, "tail"),
    "group not a group": (lambda: _with(group=3), TypeError, "group"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_names_the_argument(case):
    make, error, arg = BAD[case]
    args, kw = make()
    with pytest.raises(error, match=names(arg)):
        distillation_loss(*args, **kw)


@pytest.mark.parametrize(
    "case", ["id out of range", "repeated id", "unknown kind", "top-k mass > 1"]
)
def test_linear_op_checks_the_same(case):
    make, error, arg = BAD[case]
    (_z, a, ids), kw = make()
    w = torch.randn(V, 5)
    with pytest.raises(error, match=names(arg)):
        linear_distillation_loss(torch.randn(N, 5), w, a, ids, **kw)


@pytest.mark.parametrize(
    ("kw", "arg"),
    [
        ({"weight": torch.randn(V, 6)}, "weight"),
        ({"weight": torch.randn(V, 5, dtype=torch.float64)}, "weight"),
        ({"bias": torch.randn(V + 1)}, "bias"),
        ({"hidden": torch.randn(5)}, "hidden"),
    ],
)
def test_linear_head_shapes(kw, arg):
    _, a, ids = _inputs()
    args = {"hidden": torch.randn(N, 5), "weight": torch.randn(V, 5), "bias": None, **kw}
    with pytest.raises((ValueError, TypeError), match=names(arg)):
        linear_distillation_loss(args["hidden"], args["weight"], a, ids, bias=args["bias"])
