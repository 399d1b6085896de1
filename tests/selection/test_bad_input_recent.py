"""Bad input to the selection masks and the behaviour importance weights: a ValueError /
TypeError whose message names the argument and what it accepts."""

from __future__ import annotations

import math

import pytest
import torch
from tests._bad_input import names

from rlops.selection import (
    behavior_importance_weights,
    m2po_mask,
    opsm_mask,
    top_entropy_mask,
)

B, T = 3, 5


def tensors():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(B, T, generator=g) - 0.1
    old = -torch.rand(B, T, generator=g) - 0.1
    return logp, old, torch.randn(B, T, generator=g), torch.ones(B, T)


def opsm(**kw):
    logp, old, adv, mask = tensors()
    return opsm_mask(logp, old, adv, mask, **kw)


def m2po(**kw):
    logp, old, _, mask = tensors()
    return m2po_mask(old, logp, mask, **{"threshold": 1.0, **kw})


def top_entropy(**kw):
    return top_entropy_mask(torch.rand(B, T), torch.ones(B, T), **{"rho": 0.5, **kw})


def behaviour(**kw):
    logp, old, _, mask = tensors()
    return behavior_importance_weights(old, logp, mask, **{"upper": 2.0, **kw})


CALLS = {
    "opsm_mask": opsm,
    "m2po_mask": m2po,
    "top_entropy_mask": top_entropy,
    "behavior_importance_weights": behaviour,
}
REAL, ONE_OF, GROUP = "real number", "must be one of", "ProcessGroup or None"
# (function, keyword, bad value, exception, words of what it accepts)
BAD = [
    ("opsm_mask", "delta", math.nan, ValueError, "a number"),
    ("opsm_mask", "delta", "x", TypeError, REAL),
    ("opsm_mask", "delta", None, TypeError, REAL),
    ("opsm_mask", "delta", torch.ones(2), TypeError, "1-dim tensor"),
    ("opsm_mask", "cp_group", 3, TypeError, GROUP),
    ("m2po_mask", "threshold", math.nan, ValueError, "> 0"),
    ("m2po_mask", "threshold", 0.0, ValueError, "> 0"),
    ("m2po_mask", "threshold", -1.0, ValueError, "> 0"),
    ("m2po_mask", "threshold", "x", TypeError, REAL),
    ("m2po_mask", "threshold", None, TypeError, REAL),
    ("m2po_mask", "group", "world", TypeError, GROUP),
    ("top_entropy_mask", "rho", math.nan, ValueError, ">= 0"),
    ("top_entropy_mask", "rho", math.inf, ValueError, "finite"),
    ("top_entropy_mask", "rho", -0.1, ValueError, ">= 0"),
    ("top_entropy_mask", "rho", 1.5, ValueError, "[0, 1]"),
    ("top_entropy_mask", "rho", "x", TypeError, REAL),
    ("top_entropy_mask", "rho", True, TypeError, REAL),
    ("top_entropy_mask", "group", 3, TypeError, GROUP),
    ("behavior_importance_weights", "upper", math.nan, ValueError, "> 0"),
    ("behavior_importance_weights", "upper", 0.0, ValueError, "> 0"),
    ("behavior_importance_weights", "upper", "x", TypeError, REAL),
    ("behavior_importance_weights", "lower", 3.0, ValueError, "<= upper"),
    ("behavior_importance_weights", "lower", -1.0, ValueError, "> 0"),
    ("behavior_importance_weights", "lower", math.nan, ValueError, "> 0"),
    ("behavior_importance_weights", "lower", "x", TypeError, REAL),
    ("behavior_importance_weights", "level", "seq", ValueError, "'token', 'sequence'"),
    ("behavior_importance_weights", "level", None, ValueError, ONE_OF),
    ("behavior_importance_weights", "agg", "median", ValueError, "'sum', 'mean', 'max'"),
    ("behavior_importance_weights", "agg", 1, ValueError, ONE_OF),
    ("behavior_importance_weights", "action", "drop", ValueError, "'mask', 'clamp'"),
    ("behavior_importance_weights", "group", "x", TypeError, GROUP),
    ("behavior_importance_weights", "cp_group", "x", TypeError, GROUP),
]


@pytest.mark.parametrize(
    ("fn", "kw", "bad", "exc", "words"),
    BAD,
    ids=[f"{f}-{k}-{i}" for i, (f, k, *_) in enumerate(BAD)],
)
def test_bad_keyword_raises_naming_it(fn, kw, bad, exc, words):
    with pytest.raises(exc, match=names(kw)) as info:
        CALLS[fn](**{kw: bad})
    assert words in str(info.value)


FLOAT = "floating-point"
# (function, positional name, index in the call, bad tensor, exception, words)
TENSOR_ARGS = {
    "opsm_mask": ("logp", "old_logp", "advantages", "mask"),
    "m2po_mask": ("old_logp", "rollout_logp", "mask"),
    "behavior_importance_weights": ("old_logp", "rollout_logp", "mask"),
    "top_entropy_mask": ("entropy", "mask"),
}
BAD_TENSORS = [
    (lambda x: x.long(), TypeError, FLOAT, False),
    (lambda x: x.bool(), TypeError, FLOAT, False),
    (lambda x: x.to(torch.complex64), TypeError, "", True),
    (lambda x: x[:, :-1], ValueError, "[3, 5]", True),
    (lambda x: x[None], ValueError, "[", True),
    (lambda x: x.tolist(), TypeError, "torch.Tensor", True),
    (lambda x: x * 0.5, ValueError, "only 0 and 1", "mask only"),
]


def _cases():
    for fn, args in TENSOR_ARGS.items():
        for name in args:
            for i, (bad, exc, words, for_mask) in enumerate(BAD_TENSORS):
                if name == "mask" and for_mask is False:
                    continue  # an integer or bool mask is valid
                if name != "mask" and for_mask == "mask only":
                    continue
                yield pytest.param(fn, name, bad, exc, words, id=f"{fn}-{name}-{i}")


@pytest.mark.parametrize(("fn", "name", "bad", "exc", "words"), list(_cases()))
def test_bad_tensor_raises_naming_it(fn, name, bad, exc, words):
    logp, old, adv, mask = tensors()
    values = {
        "logp": logp,
        "old_logp": old,
        "advantages": adv,
        "mask": mask,
        "rollout_logp": logp,
        "entropy": torch.rand(B, T),
    }
    args = [values[a] for a in TENSOR_ARGS[fn]]
    i = TENSOR_ARGS[fn].index(name)
    args[i] = bad(args[i])
    extra = {
        "opsm_mask": {},
        "m2po_mask": {"threshold": 1.0},
        "top_entropy_mask": {"rho": 0.5},
        "behavior_importance_weights": {"upper": 2.0},
    }[fn]
    call = {
        "opsm_mask": opsm_mask,
        "m2po_mask": m2po_mask,
        "top_entropy_mask": top_entropy_mask,
        "behavior_importance_weights": behavior_importance_weights,
    }[fn]
    with pytest.raises(exc, match=names(name)) as info:
        call(*args, **extra)
    assert words in str(info.value)


def test_valid_values_run():
    # the keywords' valid values run: the bad-value tests are not vacuous
    assert opsm(delta=-math.inf)[0].dtype == torch.bool  # a KL estimate may be negative
    assert m2po(threshold=math.inf)[0].all()
    assert top_entropy(rho=1.0)[0].all()
    w, keep, _ = behaviour(lower=0.5, level="sequence", agg="max", action="clamp")
    assert torch.isfinite(w).all() and keep.dtype == torch.bool
