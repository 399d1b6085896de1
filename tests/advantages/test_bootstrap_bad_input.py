"""Bad input to ``bootstrap=``, ``truncated=`` and ``cp_layout=`` of ``gae`` and
``discounted_returns``: a ValueError / TypeError whose message names the argument and what it
accepts."""

from __future__ import annotations

import math

import pytest
import torch
from tests._bad_input import names

from rlops import discounted_returns, gae

B, T = 3, 6


def call(fn, **kw):
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(B, T, generator=g)
    if fn == "gae":
        return gae(rewards, torch.randn(B, T, generator=g), gamma=0.9, lam=0.95, **kw)
    return discounted_returns(rewards, gamma=0.9, **kw)


BT = torch.ones(B, T)
CUT = torch.zeros(B, T, dtype=torch.bool)
FLOAT = "floating-point tensor"
# (keywords, exception, the argument named, words of what it accepts)
BAD = [
    ({"bootstrap": torch.ones(B, dtype=torch.long)}, TypeError, "bootstrap", FLOAT),
    ({"bootstrap": torch.ones(B, dtype=torch.bool)}, TypeError, "bootstrap", FLOAT),
    ({"bootstrap": torch.ones(B, dtype=torch.complex64)}, TypeError, "bootstrap", FLOAT),
    ({"bootstrap": torch.ones(B + 1)}, ValueError, "bootstrap", "[B] = [3]"),
    ({"bootstrap": torch.ones(B, 1)}, ValueError, "bootstrap", "[B, T] = [3, 6]"),
    ({"bootstrap": torch.tensor(1.0)}, ValueError, "bootstrap", "[B] = [3]"),
    ({"bootstrap": [1.0] * B}, TypeError, "bootstrap", "torch.Tensor or None"),
    ({"bootstrap": 1.0}, TypeError, "bootstrap", "torch.Tensor or None"),
    ({"bootstrap": torch.ones(B, device="meta")}, ValueError, "bootstrap", "one device"),
    ({"bootstrap": BT}, ValueError, "truncated", "needs truncated="),
    ({"truncated": CUT}, ValueError, "truncated", "needs bootstrap="),
    ({"bootstrap": torch.ones(B), "truncated": CUT}, ValueError, "truncated", "[B, T]"),
    (
        {"bootstrap": BT, "truncated": torch.full((B, T), 0.5)},
        ValueError,
        "truncated",
        "only 0 and 1",
    ),
    (
        {"bootstrap": BT, "truncated": torch.full((B, T), math.nan)},
        ValueError,
        "truncated",
        "only 0 and 1",
    ),
    (
        {"bootstrap": BT, "truncated": 2 * torch.ones(B, T, dtype=torch.long)},
        ValueError,
        "truncated",
        "only 0 and 1",
    ),
    ({"bootstrap": BT, "truncated": CUT[:, :-1]}, ValueError, "truncated", "[3, 6]"),
    ({"bootstrap": BT, "truncated": CUT.to(torch.complex64)}, TypeError, "truncated", "0/1"),
    ({"bootstrap": BT, "truncated": CUT.tolist()}, TypeError, "truncated", "torch.Tensor"),
    ({"bootstrap": BT.long(), "truncated": CUT}, TypeError, "bootstrap", FLOAT),
    ({"cp_layout": "diagonal"}, ValueError, "cp_layout", "'zigzag', 'contiguous'"),
    ({"cp_layout": None}, ValueError, "cp_layout", "'zigzag', 'contiguous'"),
    ({"cp_layout": 0}, ValueError, "cp_layout", "'zigzag', 'contiguous'"),
    ({"cp_layout": "Zigzag"}, ValueError, "cp_layout", "'zigzag', 'contiguous'"),
]


@pytest.mark.parametrize("fn", ["gae", "discounted_returns"])
@pytest.mark.parametrize(
    ("kw", "exc", "arg", "words"), BAD, ids=[f"{'+'.join(k)}-{i}" for i, (k, *_) in enumerate(BAD)]
)
def test_bad_bootstrap_truncated_or_layout_raises_naming_it(fn, kw, exc, arg, words):
    with pytest.raises(exc, match=names(arg)) as info:
        call(fn, **kw)
    assert words in str(info.value)


@pytest.mark.parametrize("fn", ["gae", "discounted_returns"])
def test_nan_bootstrap_reaches_its_row_and_no_other(fn):
    # a NaN bootstrap is data, not an error: it reaches its own row (through a nonzero
    # discount) and no other
    boot = torch.tensor([0.0, math.nan, 1.0])
    out = call(fn, bootstrap=boot)
    ret = out[1] if isinstance(out, tuple) else out
    assert ret[1].isnan().all()
    assert torch.isfinite(ret[[0, 2]]).all()


@pytest.mark.parametrize("fn", ["gae", "discounted_returns"])
def test_valid_values_run(fn):
    for kw in (
        {"bootstrap": torch.ones(B)},
        {"bootstrap": BT, "truncated": CUT | True},
        {"bootstrap": BT, "truncated": torch.zeros(B, T, dtype=torch.long)},
        {"cp_layout": "contiguous"},
    ):
        out = call(fn, **kw)
        ret = out[1] if isinstance(out, tuple) else out
        assert torch.isfinite(ret).all()
