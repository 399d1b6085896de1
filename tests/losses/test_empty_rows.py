"""``empty_rows``: how rows without an action token count in the sequence means.

``"skip"`` (the default, verl's convention): ``S`` is the number of rows with an action token.
``"count"`` (TRL's ``grpo`` / ``dr_grpo``): ``S = B``, every row of the global batch. The
expected values are the definitions written out on hand-made rows."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from tests._distributed import count_collectives, run_distributed

import rlops
from rlops.distributed import cp_shard

SEQ_MODES = ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# two rows with action tokens (3 and 1 of them), two without
LOSS = torch.tensor(
    [[1.0, 2.0, 3.0, 0.5], [4.0, 9.0, 9.0, 9.0], [7.0, 7.0, 7.0, 7.0], [5.0, 5.0, 5.0, 5.0]],
    dtype=torch.float64,
)
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
ROW_SUMS, ROW_MEANS = (6.0, 4.0), (2.0, 4.0)  # the rows with action tokens, by hand


def _by_hand(mode: str, s: int) -> float:
    if mode == "seq-mean-token-sum":
        return sum(ROW_SUMS) / s
    if mode == "seq-mean-token-mean":
        return sum(ROW_MEANS) / s
    return sum(ROW_SUMS) / 4 / s  # L = T = 4


@pytest.mark.parametrize("mode", SEQ_MODES)
def test_skip_divides_by_the_rows_with_an_action_token_and_count_by_every_row(mode):
    skip = rlops.aggregate_loss(LOSS, MASK, mode)
    count = rlops.aggregate_loss(LOSS, MASK, mode, empty_rows="count")
    assert skip.item() == pytest.approx(_by_hand(mode, 2), rel=1e-15)
    assert count.item() == pytest.approx(_by_hand(mode, 4), rel=1e-15)


@pytest.mark.parametrize("mode", ["token-mean", "token-sum"])
def test_token_modes_do_not_depend_on_it(mode):
    assert torch.equal(
        rlops.aggregate_loss(LOSS, MASK, mode, empty_rows="count"),
        rlops.aggregate_loss(LOSS, MASK, mode),
    )


def test_given_num_seqs_is_s_itself():
    got = rlops.aggregate_loss(LOSS, MASK, "seq-mean-token-sum", num_seqs=8, empty_rows="count")
    assert got.item() == pytest.approx(sum(ROW_SUMS) / 8, rel=1e-15)


def test_empty_batch_gives_zero():
    z = torch.zeros(3, 4, dtype=torch.float64)
    assert rlops.aggregate_loss(z, z, "seq-mean-token-mean", empty_rows="count").item() == 0.0
    none = torch.zeros(0, 4, dtype=torch.float64)
    assert rlops.aggregate_loss(none, none, "seq-mean-token-sum", empty_rows="count").item() == 0


def test_gradient_is_one_over_every_row():
    x = LOSS.clone().requires_grad_(True)
    rlops.aggregate_loss(x, MASK, "seq-mean-token-sum", empty_rows="count").backward()
    torch.testing.assert_close(x.grad, MASK.double() / 4, rtol=0, atol=0)


def test_the_losses_take_it():
    """policy_loss (PPO at ratio 1: −A per token), value_loss and entropy_loss, by hand."""
    adv = torch.full((4, 4), 2.0, dtype=torch.float64)
    lp = torch.zeros(4, 4, dtype=torch.float64)
    kw = dict(agg="seq-mean-token-mean", empty_rows="count")
    loss, _ = rlops.policy_loss(lp, lp, adv, MASK, **kw)
    assert loss.item() == pytest.approx(-2.0 * 2 / 4)  # two rows of mean −2, over 4 rows
    v, _ = rlops.value_loss(lp + 1, lp, lp, MASK, **kw)
    assert v.item() == pytest.approx(0.5 * 2 / 4)
    e, _ = rlops.entropy_loss(lp + 3, MASK, **kw)
    assert e.item() == pytest.approx(-3.0 * 2 / 4)


def test_bad_values():
    with pytest.raises(ValueError, match="empty_rows must be one of"):
        rlops.aggregate_loss(LOSS, MASK, "seq-mean-token-sum", empty_rows="all")
    with pytest.raises(ValueError, match=r"empty_rows='count'.*seq_ids.*num_seqs"):
        rlops.aggregate_loss(
            LOSS,
            MASK,
            "seq-mean-token-sum",
            seq_ids=torch.zeros(4, 4, dtype=torch.long),
            seqs_per_row=1,
            empty_rows="count",
        )
    with pytest.raises(ValueError, match="empty_rows must be one of"):
        rlops.policy_loss(LOSS, LOSS, LOSS, MASK, empty_rows=None)


def _on_ranks(rank: int, world: int, mode: str) -> dict:
    w = dist.group.WORLD
    out = {}
    # data parallel: rank 0 holds rows 0 and 2, rank 1 rows 1 and 3
    rows = [0, 2] if rank == 0 else [1, 3]
    x = LOSS[rows].clone().requires_grad_(True)
    with count_collectives() as calls:
        out["dp"] = rlops.aggregate_loss(x, MASK[rows], mode, group=w, empty_rows="count")
    out["dp calls"] = dict(calls)
    out["dp"].backward()
    out["dp grad"] = x.grad
    # context parallel: both ranks hold pieces of all four rows
    piece = lambda t: cp_shard(t, cp_size=world, cp_rank=rank, layout="contiguous")  # noqa: E731
    out["cp"] = rlops.aggregate_loss(
        piece(LOSS),
        piece(MASK),
        mode,
        loss_scale_factor=4.0,
        cp_group=w,
        cp_layout="contiguous",
        empty_rows="count",
    )
    return out


@pytest.mark.distributed
def test_two_gloo_ranks_sum_to_the_whole_batch():
    """Over ``group`` (data parallel) and ``cp_group``: the ranks' shares sum to the whole
    batch's loss with S = 4, in one collective for the data-parallel call."""
    for mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        ranks = run_distributed(_on_ranks, 2, mode, timeout=120)
        want = _by_hand(mode, 4)
        assert sum(r["dp"].item() for r in ranks) == pytest.approx(want, rel=1e-15)
        assert sum(r["cp"].item() for r in ranks) == pytest.approx(want, rel=1e-15)
        assert all(r["dp calls"] == {"all_gather": 1} for r in ranks)
        if mode == "seq-mean-token-sum":  # each action token's weight is 1/S
            for rank, rows in ((0, [0, 2]), (1, [1, 3])):
                torch.testing.assert_close(ranks[rank]["dp grad"], MASK[rows].double() / 4)


def test_compiles_with_fullgraph_at_two_batch_sizes():
    """``empty_rows="count"`` under ``torch.compile(fullgraph=True, dynamic=True)``: the value
    and the gradient equal the eager call's, by hand-computed S = B."""

    def fn(x, m):
        return rlops.aggregate_loss(x, m, "seq-mean-token-sum", empty_rows="count")

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=True)
    for b in (4, 6):
        x = torch.arange(b * 3, dtype=torch.float64).reshape(b, 3).requires_grad_(True)
        m = torch.zeros(b, 3, dtype=torch.bool)
        m[0, :2] = True  # one row with action tokens, b - 1 without
        got = compiled(x, m)
        assert got.item() == pytest.approx((0.0 + 1.0) / b, rel=1e-15)
        got.backward()
        torch.testing.assert_close(x.grad, m.double() / b, rtol=0, atol=0)
