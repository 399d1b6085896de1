"""The losses' keyword options: one declaration of the aggregation's keywords
(:class:`AggregationOptions`), shared by every loss; a misspelt keyword is a ``TypeError``
naming it, never a silently ignored option."""

from __future__ import annotations

import pytest
import torch

import rlops
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
