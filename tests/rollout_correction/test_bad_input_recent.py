"""Bad input to the rollout-correction keywords added last (``cp_layout=``, packed ``seq_ids=``
and ``seqs_per_row=``, ``cp_group=``) on the three rollout-correction functions: a ValueError /
TypeError whose message names the argument and what it accepts."""

from __future__ import annotations

import pytest
import torch
from tests._bad_input import names

from rlops import rollout_importance_weights, rollout_mismatch_metrics, rollout_rejection_mask

B, T = 3, 5
IDS = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1], [0, 0, 0, 0, 0]])


def inputs():
    g = torch.Generator().manual_seed(0)
    return (
        -torch.rand(B, T, generator=g) - 0.1,
        -torch.rand(B, T, generator=g) - 0.1,
        torch.ones(B, T),
    )


CALLS = {
    "rollout_importance_weights": lambda **kw: rollout_importance_weights(*inputs(), **kw),
    "rollout_rejection_mask": lambda **kw: rollout_rejection_mask(
        *inputs(), {"token_k1": (0.5, 2.0)}, **kw
    ),
    "rollout_mismatch_metrics": lambda **kw: rollout_mismatch_metrics(*inputs(), **kw),
}
LAYOUT = "'zigzag', 'contiguous'"
BAD = [
    ({"cp_layout": "diagonal"}, ValueError, "cp_layout", LAYOUT),
    ({"cp_layout": None}, ValueError, "cp_layout", LAYOUT),
    ({"cp_layout": 2}, ValueError, "cp_layout", LAYOUT),
    ({"seq_ids": IDS.float(), "seqs_per_row": 2}, TypeError, "seq_ids", "integer tensor"),
    ({"seq_ids": IDS.bool(), "seqs_per_row": 2}, TypeError, "seq_ids", "integer tensor"),
    ({"seq_ids": IDS.tolist(), "seqs_per_row": 2}, TypeError, "seq_ids", "torch.Tensor"),
    ({"seq_ids": IDS[:, :4], "seqs_per_row": 2}, ValueError, "seq_ids", "[3, 5]"),
    ({"seq_ids": IDS[0], "seqs_per_row": 2}, ValueError, "seq_ids", "[3, 5]"),
    ({"seq_ids": IDS + 3, "seqs_per_row": 2}, ValueError, "seq_ids", "[0, 2)"),
    ({"seq_ids": IDS - 1, "seqs_per_row": 2}, ValueError, "seq_ids", "[0, 2)"),
    ({"seq_ids": IDS}, ValueError, "seqs_per_row", "number of sequence slots"),
    ({"seqs_per_row": 2}, ValueError, "seq_ids", "pass both"),
    ({"seq_ids": IDS, "seqs_per_row": 0}, ValueError, "seqs_per_row", ">= 1"),
    ({"seq_ids": IDS, "seqs_per_row": -2}, ValueError, "seqs_per_row", ">= 1"),
    ({"seq_ids": IDS, "seqs_per_row": 2.0}, TypeError, "seqs_per_row", "int"),
    ({"seq_ids": IDS, "seqs_per_row": "2"}, TypeError, "seqs_per_row", "int"),
    ({"seq_ids": IDS, "seqs_per_row": False}, TypeError, "seqs_per_row", "int"),
    ({"cp_group": "world"}, TypeError, "cp_group", "ProcessGroup or None"),
    ({"cp_group": 1}, TypeError, "cp_group", "ProcessGroup or None"),
]


@pytest.mark.parametrize("fn", sorted(CALLS))
@pytest.mark.parametrize(
    ("kw", "exc", "arg", "words"), BAD, ids=[f"{'+'.join(k)}-{i}" for i, (k, *_) in enumerate(BAD)]
)
def test_bad_layout_keyword_raises_naming_it(fn, kw, exc, arg, words):
    with pytest.raises(exc, match=names(arg)) as info:
        CALLS[fn](**kw)
    assert words in str(info.value)


@pytest.mark.parametrize("fn", sorted(CALLS))
def test_valid_layout_runs(fn):
    out = CALLS[fn](seq_ids=IDS, seqs_per_row=2, cp_layout="contiguous")
    assert out is not None
