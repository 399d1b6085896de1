"""VAPO's decoupled and length-adaptive λ in ``rlops.gae`` (``returns_lam``,
``lam_length_alpha``): against NeMo-RL's own ``GeneralizedAdvantageEstimator`` (copied below),
the plain GAE oracle, by hand, in float32 / bfloat16, under autograd and under context
parallelism on real Gloo groups.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from tests._bad_input import names
from tests._distributed import count_collectives, run_distributed
from tests.oracles import EXTENDED, gae_oracle
from tests.tolerances import (
    ALL_METHODS,
    assert_half_matches,
    assert_within_reference,
    for_each_method,
)

import rlops
from rlops.distributed import cp_shard, cp_unshard


# --------------------------------------------------------------------------- the peer's code
# NVIDIA-NeMo/RL nemo_rl/algorithms/advantage_estimator.py, GeneralizedAdvantageEstimator, at
# commit 00925dd1e44b816b5cb6afa27d23d7bd7af2b957: the method bodies verbatim. Adapted: the
# config is passed as arguments (GAEConfig's fields); compute_advantage takes the token-level
# rewards directly (its _build_token_level_rewards places a scalar score and the KL, not under
# test) and its optional whitening (normalize_advantages) is off; the fast path's print is
# dropped; `.float()` of the response lengths is `.to(values.dtype)`, so that the float64
# comparison measures the formula rather than NeMo-RL's float32 rounding of λ.
class NeMoGAE:
    def __init__(
        self,
        gae_lambda=0.95,
        gae_gamma=1.0,
        gae_lambda_value=None,
        gae_lambda_policy=None,
        length_adaptive_alpha=0.0,
    ):
        self.gae_lambda = gae_lambda
        self.gae_gamma = gae_gamma
        self.gae_lambda_value = gae_lambda_value
        self.gae_lambda_policy = gae_lambda_policy
        self.length_adaptive_alpha = length_adaptive_alpha

    def _resolve_lambda_policy(self, mask, dtype):
        if self.length_adaptive_alpha > 0:
            resp_lens = mask.sum(dim=1).to(dtype)  # [batch_size]
            lam = 1.0 - 1.0 / (self.length_adaptive_alpha * resp_lens).clamp(min=1.0)
            return lam.clamp(min=0.0, max=1.0)
        if self.gae_lambda_policy is not None:
            return self.gae_lambda_policy
        return self.gae_lambda

    def _resolve_lambda_value(self):
        if self.gae_lambda_value is not None:
            return self.gae_lambda_value
        return self.gae_lambda

    def compute_advantage(self, token_level_rewards, mask, values):
        lam_value = self._resolve_lambda_value()
        lam_policy = self._resolve_lambda_policy(mask, values.dtype)
        need_decouple = (
            self.gae_lambda_value is not None
            or self.gae_lambda_policy is not None
            or self.length_adaptive_alpha > 0
        )
        if need_decouple:
            _, returns = self._compute_gae(token_level_rewards, values, mask, gae_lambda=lam_value)
            advantages, _ = self._compute_gae(
                token_level_rewards, values, mask, gae_lambda=lam_policy
            )
        else:
            advantages, returns = self._compute_gae(token_level_rewards, values, mask)
        advantages = torch.masked_fill(advantages, ~(mask.bool()), 0)
        return advantages, returns

    def _compute_gae(self, token_level_rewards, values, mask, gae_lambda=None):
        lam = gae_lambda if gae_lambda is not None else self.gae_lambda
        gen_len = token_level_rewards.shape[-1]
        if (
            self.gae_gamma == 1.0
            and not isinstance(lam, torch.Tensor)
            and lam == 1.0
            and bool(((mask == 0) | (mask == 1)).all())
        ):
            masked_rewards = token_level_rewards * mask
            reward_to_go = (
                masked_rewards.to(torch.promote_types(masked_rewards.dtype, values.dtype))
                .flip(-1)
                .cumsum(-1)
                .flip(-1)
            )
            indices = torch.arange(gen_len, device=values.device)
            next_valid = torch.where(mask.bool(), indices, gen_len)
            next_valid = next_valid.flip(-1).cummin(-1).values.flip(-1)
            padded_values = torch.nn.functional.pad(values, (0, 1))
            advantages = reward_to_go - padded_values.gather(-1, next_valid)
            return advantages, advantages + values

        next_values = torch.zeros(values.shape[0], device=values.device, dtype=values.dtype)
        last_gae_lam = torch.zeros_like(next_values)
        advantages_reversed = []
        for t in reversed(range(gen_len)):
            delta = token_level_rewards[:, t] + self.gae_gamma * next_values - values[:, t]
            new_gae_lam = delta + self.gae_gamma * lam * last_gae_lam
            m = mask[:, t]
            next_values = values[:, t] * m + (1 - m) * next_values
            last_gae_lam = new_gae_lam * m + (1 - m) * last_gae_lam
            advantages_reversed.append(last_gae_lam)
        advantages = torch.stack(advantages_reversed[::-1], dim=1)
        returns = advantages + values
        return advantages, returns


# --------------------------------------------------------------------------- batches
def _batch(b: int, t: int, seed: int, dtype=torch.float64):
    """Rewards, values and a ragged mask: a full row, right padding, interior mask-0 spans,
    an empty row (row 1), very short rows (so that α·L < 1)."""
    rng = np.random.default_rng(seed)
    r = torch.from_numpy(rng.standard_normal((b, t))).to(dtype)
    v = torch.from_numpy(rng.standard_normal((b, t))).to(dtype)
    mask = torch.from_numpy(rng.random((b, t)) > 0.3)
    lengths = torch.from_numpy(rng.integers(0, t + 1, size=b))
    mask &= torch.arange(t) < lengths[:, None]
    mask[0] = True
    if b > 1:
        mask[1] = False
    if b > 2:
        mask[2] = False
        mask[2, : min(t, 3)] = True
    return r, v, mask


# NeMo-RL's GAEConfig -> rlops.gae's keywords
CONFIGS = {
    "length-adaptive, returns with gae_lambda": (
        {"gae_lambda": 0.95, "length_adaptive_alpha": 0.05},
        {"lam": 0.95, "lam_length_alpha": 0.05},
    ),
    "VAPO: length-adaptive, value lambda 1": (
        {"gae_lambda": 0.9, "gae_lambda_value": 1.0, "length_adaptive_alpha": 0.05},
        {"lam": 0.9, "returns_lam": 1.0, "lam_length_alpha": 0.05},
    ),
    "length-adaptive, large alpha": (
        {"gae_lambda": 0.95, "gae_lambda_value": 0.8, "length_adaptive_alpha": 0.7},
        {"lam": 0.95, "returns_lam": 0.8, "lam_length_alpha": 0.7},
    ),
    "decoupled fixed lambdas": (
        {"gae_lambda": 0.5, "gae_lambda_value": 1.0, "gae_lambda_policy": 0.95},
        {"lam": 0.95, "returns_lam": 1.0},
    ),
    "value lambda only": (
        {"gae_lambda": 0.95, "gae_lambda_value": 0.9},
        {"lam": 0.95, "returns_lam": 0.9},
    ),
    "standard": ({"gae_lambda": 1.0}, {"lam": 1.0}),
}
SIZES = [(1, 1), (4, 7), (5, 127), (3, 128), (6, 129), (2, 1000)]
WORST: dict[str, float] = {}


@pytest.mark.parametrize("gamma", [1.0, 0.99])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize(("b", "t"), SIZES)
def test_matches_nemo_rl(config, gamma, b, t):
    """Advantages everywhere and returns on action tokens equal NeMo-RL's (whose returns
    off the mask carry the next action's advantage; rlops's are 0 there)."""
    nemo_cfg, ours = CONFIGS[config]
    r, v, mask = _batch(b, t, seed=b * 1000 + t)
    peer = NeMoGAE(gae_gamma=gamma, **nemo_cfg)
    want_adv, want_ret = peer.compute_advantage(r * mask, mask.double(), v)

    def check(method):
        adv, ret = rlops.gae(r, v, gamma=gamma, mask=mask, method=method, **ours)
        d_adv = (adv - want_adv).abs().max().item()
        d_ret = torch.where(mask, ret - want_ret, 0).abs().max().item()
        WORST[config] = max(WORST.get(config, 0.0), d_adv, d_ret)
        scale = 1e-12 * max(1.0, want_adv.abs().max().item(), want_ret.abs().max().item())
        assert d_adv <= scale and d_ret <= scale, (d_adv, d_ret)
        assert torch.equal(ret[~mask], torch.zeros_like(ret[~mask]))

    for_each_method(check)


def _lengths_lam(alpha, mask):
    """VAPO's λ per row, written from the definition in Python floats."""
    return torch.tensor(
        [1 - 1 / max(alpha * int(n), 1.0) for n in mask.sum(-1)], dtype=torch.float64
    )


def test_length_adaptive_lam_by_hand():
    """Rows of 0, 1, 3 and 40 action tokens with α = 0.05: λ = 0, 0, 0, 1 − 1/2."""
    mask = torch.zeros(4, 40, dtype=torch.bool)
    mask[1, 5] = True
    mask[2, [0, 7, 9]] = True
    mask[3] = True
    r, v = torch.randn(4, 40, dtype=torch.float64), torch.randn(4, 40, dtype=torch.float64)
    lam = torch.tensor([0.0, 0.0, 0.0, 0.5], dtype=torch.float64)
    assert torch.equal(_lengths_lam(0.05, mask), lam)
    want_adv = gae_oracle(r, v, 0.9, lam, mask)[0]
    want_ret = gae_oracle(r, v, 0.9, 0.8, mask)[1]
    adv, ret = rlops.gae(r, v, gamma=0.9, lam=0.8, lam_length_alpha=0.05, mask=mask)
    torch.testing.assert_close(adv, want_adv, rtol=0, atol=1e-13)
    torch.testing.assert_close(ret, want_ret, rtol=0, atol=1e-13)
    # without a mask every row has T action tokens
    adv, _ = rlops.gae(r, v, gamma=0.9, lam=0.8, lam_length_alpha=0.05)
    torch.testing.assert_close(adv, gae_oracle(r, v, 0.9, 0.5)[0], rtol=0, atol=1e-13)


@pytest.mark.parametrize("per_row", [False, True])
def test_two_lambdas_are_two_gaes(per_row):
    """The advantages are GAE's with ``lam``, the returns GAE's with ``returns_lam``: on every
    method, per-row λ and γ too."""
    b, t = 5, 129
    r, v, mask = _batch(b, t, seed=7)
    gamma = torch.linspace(0.9, 1.0, b, dtype=torch.float64) if per_row else 0.99
    lam = torch.linspace(0.0, 1.0, b, dtype=torch.float64) if per_row else 0.9
    returns_lam = torch.linspace(1.0, 0.5, b, dtype=torch.float64) if per_row else 1.0

    def check(method):
        adv, ret = rlops.gae(
            r, v, gamma=gamma, lam=lam, returns_lam=returns_lam, mask=mask, method=method
        )
        want_adv = rlops.gae(r, v, gamma=gamma, lam=lam, mask=mask, method=method)[0]
        want_ret = rlops.gae(r, v, gamma=gamma, lam=returns_lam, mask=mask, method=method)[1]
        # the same scans on more rows: equal within the kernels' row-wise rounding
        torch.testing.assert_close(adv, want_adv, rtol=0, atol=1e-13)
        torch.testing.assert_close(ret, want_ret, rtol=0, atol=1e-13)

    for_each_method(check)


@pytest.mark.parametrize(("b", "t"), [(1, 1), (3, 127), (3, 128), (4, 129), (3, 1000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_within_the_reference_rule(b, t, dtype):
    """float32: within twice the serial float32 reference's error of the extended oracle;
    bfloat16: the float32 result rounded, within one bfloat16 ulp."""
    r64, v64, mask = _batch(b, t, seed=11 * t + b)
    r, v = r64.to(dtype), v64.to(dtype)
    kw = {"gamma": 0.99, "lam": 0.95, "returns_lam": 1.0, "lam_length_alpha": 0.05, "mask": mask}
    lam = _lengths_lam(0.05, mask)
    want_adv = gae_oracle(r, v, 0.99, lam, mask, extended=EXTENDED)[0]
    want_ret = gae_oracle(r, v, 0.99, 1.0, mask, extended=EXTENDED)[1]
    full = r.float(), v.float()
    ref_adv, ref_ret = rlops.gae(*full, method="reference", **kw)
    for method in ALL_METHODS:
        adv, ret = rlops.gae(r, v, method=method, **kw)
        assert adv.dtype == ret.dtype == dtype
        if dtype == torch.float32:
            assert_within_reference(f"{method} advantages", adv, want_adv, ref_adv)
            assert_within_reference(f"{method} returns", ret, want_ret, ref_ret)
        else:
            f_adv, f_ret = rlops.gae(*full, method=method, **kw)
            assert_half_matches(f"{method} advantages", adv, f_adv, want_adv)
            assert_half_matches(f"{method} returns", ret, f_ret, want_ret)


def test_gradients():
    """gradcheck in float64 through both scans (rewards and values)."""
    r, v, mask = _batch(3, 9, seed=3)
    r.requires_grad_(True)
    v.requires_grad_(True)

    def fn(r, v):
        return rlops.gae(
            r, v, gamma=0.9, lam=0.7, returns_lam=1.0, lam_length_alpha=0.5, mask=mask,
            method="chunked",
        )  # fmt: skip

    assert torch.autograd.gradcheck(fn, (r, v))


def test_packed_rows_are_refused():
    r, v = torch.randn(2, 6), torch.randn(2, 6)
    dones = torch.zeros(2, 6, dtype=torch.bool)
    with pytest.raises(ValueError, match=names("lam_length_alpha")):
        rlops.gae(r, v, gamma=1.0, lam=1.0, lam_length_alpha=0.05, dones=dones)
    cut = torch.zeros(2, 6, dtype=torch.bool)
    with pytest.raises(ValueError, match="truncated"):
        rlops.gae(
            r, v, gamma=1.0, lam=1.0, lam_length_alpha=0.05, bootstrap=r, truncated=cut
        )  # fmt: skip
    # the row's end value ([B] bootstrap) is one sequence per row: fine
    rlops.gae(r, v, gamma=1.0, lam=1.0, lam_length_alpha=0.05, bootstrap=torch.ones(2))


@pytest.mark.parametrize(
    ("kwargs", "error", "arg"),
    [
        ({"lam_length_alpha": 0.0}, ValueError, "lam_length_alpha"),
        ({"lam_length_alpha": -0.05}, ValueError, "lam_length_alpha"),
        ({"lam_length_alpha": float("nan")}, ValueError, "lam_length_alpha"),
        ({"lam_length_alpha": float("inf")}, ValueError, "lam_length_alpha"),
        ({"lam_length_alpha": "0.05"}, TypeError, "lam_length_alpha"),
        ({"lam_length_alpha": torch.ones(2)}, TypeError, "lam_length_alpha"),
        ({"returns_lam": 1.5}, ValueError, "returns_lam"),
        ({"returns_lam": float("nan")}, ValueError, "returns_lam"),
        ({"returns_lam": "1"}, TypeError, "returns_lam"),
        ({"returns_lam": torch.ones(3)}, ValueError, "returns_lam"),
        ({"returns_lam": torch.full((2,), 2.0)}, ValueError, "returns_lam"),
    ],
)
def test_bad_input(kwargs, error, arg):
    r, v = torch.randn(2, 5), torch.randn(2, 5)
    with pytest.raises(error, match=names(arg)):
        rlops.gae(r, v, gamma=1.0, lam=0.95, **kwargs)


# --------------------------------------------------------------------------- context parallel
def _cp_work(rank: int, world: int, layout: str):
    group = dist.group.WORLD
    out = {}
    for t in (5, 12, 36, 132):
        r, v, mask = _batch(5, t, seed=t)
        kw = {"gamma": 0.99, "lam": 0.9, "mask": mask}
        cases = {
            "vapo": {"returns_lam": 1.0, "lam_length_alpha": 0.05},
            "large alpha": {"lam_length_alpha": 0.6},
            "returns_lam": {"returns_lam": torch.linspace(0.5, 1.0, 5, dtype=torch.float64)},
            "no mask": {"lam_length_alpha": 0.05, "mask": None},
        }
        for name, extra in cases.items():
            if name == "no mask" and t % 12:  # padding to whole chunks would count as actions
                continue
            args = {**kw, **extra}
            want = rlops.gae(r, v, **args)

            def shard(x):
                return cp_shard(x, cp_size=world, cp_rank=rank, layout=layout)

            m = args.pop("mask")
            sharded = None if m is None else shard(m)
            with count_collectives() as calls:
                got = rlops.gae(shard(r), shard(v), mask=sharded, cp_group=group, cp_layout=layout,
                                **args)  # fmt: skip
            full = [cp_unshard(x, group=group, length=t, layout=layout) for x in got]
            diff = max((a - b).abs().max().item() for a, b in zip(full, want, strict=True))
            out[name, t] = (diff, dict(calls))
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_context_parallel_matches_one_process(layout):
    """Each rank's shards equal the whole batch's result; the collectives do not grow with T:
    the two λ share the scan's one checked gather (two ``all_gather`` where the stacked rows'
    summaries pass the first exchange), the length count adds one of whole-row counts."""
    for world in (2, 3):
        if layout == "zigzag" and world == 3:
            continue
        ranks = run_distributed(_cp_work, world, layout)
        for res in ranks:
            counts: dict[str, set] = {}
            for (name, t), (diff, calls) in res.items():
                assert diff <= 1e-12, (world, name, t, diff)
                counts.setdefault(name, set()).add(sum(calls.values()))
            assert all(len(c) == 1 and max(c) <= 3 for c in counts.values()), counts


def _cp_mismatch(rank: int, world: int):
    r, v, mask = _batch(3, 8, seed=1)
    shard = lambda x: cp_shard(x, cp_size=world, cp_rank=rank)  # noqa: E731
    try:
        alpha = 0.05 if rank == 0 else 0.1
        rlops.gae(shard(r), shard(v), gamma=1.0, lam=0.9, mask=shard(mask),
                  lam_length_alpha=alpha, cp_group=dist.group.WORLD)  # fmt: skip
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.distributed
def test_context_parallel_alpha_must_agree():
    msgs = run_distributed(_cp_mismatch, 2)
    assert msgs[0] is not None and msgs[0] == msgs[1]
    assert "lam_length_alpha" in msgs[0], msgs[0]
