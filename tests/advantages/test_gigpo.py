"""GiGPO (``rlops.gigpo_advantages``): against ROLL's own ``compute_discounted_returns``,
``agentic_reward_norm``, ``build_state_group`` and ``compute_response_level_rewards`` (copied
below), against the plain loop of ``rlops.advantages.reference`` and an exact oracle in
float32 / bfloat16 / float64 on odd sizes, by hand, at the edges, and on bad input."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from decimal import Decimal, localcontext
from fractions import Fraction

import numpy as np
import pytest
import torch
from tests._bad_input import names
from tests._losses_util import DTYPES, acc_dtype, assert_within_ref_error, random_mask
from torch import Tensor

import rlops
from rlops.advantages.reference import gigpo_reference


# --------------------------------------------------------------------------- ROLL's data types
# A stand-in for the parts of ROLL's DataProto (roll/distributed/scheduler/protocol.py) and
# TensorDict that the functions below use: a dict of tensors with batch_size and device, a
# dict of numpy arrays, group_by on a non-tensor key (str of the value, groups in order of
# first appearance), concat, reorder, pop.
class _Batch(dict):
    @property
    def batch_size(self):
        return [len(next(iter(self.values())))]

    @property
    def device(self):
        return next(iter(self.values())).device


class DataProto:
    def __init__(self, batch=None, non_tensor_batch=None, meta_info=None):
        self.batch = _Batch(batch or {})
        self.non_tensor_batch = non_tensor_batch or {}
        self.meta_info = meta_info or {}

    @staticmethod
    def from_dict(tensors, non_tensors=None):
        return DataProto(tensors, non_tensors)

    def __len__(self):
        return self.batch.batch_size[0]

    def _select(self, idx):
        idx = np.asarray(idx, dtype=np.int64)
        return DataProto(
            {k: v[torch.from_numpy(idx)] for k, v in self.batch.items()},
            {k: v[idx] for k, v in self.non_tensor_batch.items()},
            dict(self.meta_info),
        )

    def group_by(self, keys):
        groups: dict[str, list[int]] = {}
        for i in range(len(self)):
            groups.setdefault(str(self.non_tensor_batch[keys][i]), []).append(i)
        return {k: self._select(v) for k, v in groups.items()}

    @staticmethod
    def concat(parts):
        out = DataProto(
            {k: torch.cat([p.batch[k] for p in parts]) for k in parts[0].batch},
            {
                k: np.concatenate([p.non_tensor_batch[k] for p in parts])
                for k in parts[0].non_tensor_batch
            },
            dict(parts[0].meta_info),
        )
        return out

    def reorder(self, indices):
        moved = self._select(indices.numpy())
        self.batch, self.non_tensor_batch = moved.batch, moved.non_tensor_batch

    def pop(self, batch_keys):
        return self.batch.pop(batch_keys)


# roll/pipeline/agentic/agentic_config.py: RewardNormalizationConfig's fields and the
# resolution of norm_mean_type / norm_std_type from `method` (__post_init__, without its log).
def _resolve_reward_norm_defaults(method: str, grouping: str) -> dict[str, str | None]:
    normalized_group = (grouping or "").lower()
    if normalized_group == "batch":
        mean_type = "batch"
        std_type = "batch"
    else:
        mean_type = "group"
        std_type = "group"

    if method == "identity":
        return {"norm_mean_type": None, "norm_std_type": None}
    elif method == "mean":
        return {"norm_mean_type": mean_type, "norm_std_type": None}
    elif method in {"mean_std", "asym_clip"}:
        return {"norm_mean_type": mean_type, "norm_std_type": std_type}

    return {"norm_mean_type": None, "norm_std_type": None}


@dataclass
class RewardNormalizationConfig:
    grouping: str = "batch"
    method: str = "identity"
    norm_mean_type: str | None = None
    norm_std_type: str | None = None

    def __post_init__(self):
        defaults = _resolve_reward_norm_defaults(self.method, self.grouping)
        if self.norm_mean_type is None:
            self.norm_mean_type = defaults["norm_mean_type"]
        if self.norm_std_type is None:
            self.norm_std_type = defaults["norm_std_type"]


@dataclass
class AgenticConfig:
    reward_normalization: RewardNormalizationConfig
    adv_estimator: str = "gigpo"
    episode_reward_weight: float = 1.0
    step_reward_weight: float = 1.0
    reward_clip: float | None = None


# --------------------------------------------------------------------------- ROLL's code
# alibaba/ROLL roll/pipeline/agentic/utils.py at commit
# 8eb27cc2dc34c4d1310b169d9b86d339004d811a: compute_discounted_returns, agentic_reward_norm,
# build_state_group and compute_response_level_rewards (its "gigpo" branch) verbatim.
# Adapted: DataProto is the stand-in above; float32 (`.float()`, `np.float32`) is float64, so
# that the comparison measures the formulas, not float32 rounding; the reward-clip metric
# (compute_clip_fraction) is left out, as reward_clip is off. Reformatted by ruff (line
# breaks, `dict` / `X | None` annotations, unused loop names prefixed with `_`).
@torch.no_grad()
def compute_discounted_returns(batch: DataProto, adv_estimator, gamma=1.0) -> DataProto:
    if adv_estimator in ["gigpo", "step_reinforce"]:
        batch.batch["sample_order_placeholder"] = torch.arange(
            batch.batch.batch_size[0], device=batch.batch.device
        )
        batch_group_by_traj: dict[str, DataProto] = batch.group_by(keys="traj_id")
        for _traj_id, traj_batch in batch_group_by_traj.items():
            indices: Tensor = torch.argsort(
                torch.from_numpy(traj_batch.non_tensor_batch["step"].astype(np.int64))
            )
            traj_batch.reorder(indices)
            step_scores = traj_batch.non_tensor_batch["step_scores"].astype(np.float64)
            rewards = torch.as_tensor(step_scores).double()
            discounts = torch.empty_like(rewards)
            running_return = 0.0
            for t in reversed(range(len(rewards))):
                running_return = rewards[t] + gamma * running_return
                discounts[t] = running_return
            traj_batch.batch["step_rewards"] = discounts

        merged = DataProto.concat(list(batch_group_by_traj.values()))
        merged.reorder(indices=torch.argsort(merged.batch["sample_order_placeholder"]))
        merged.pop("sample_order_placeholder")
        return merged
    else:
        return batch


@torch.no_grad()
def agentic_reward_norm(
    batch: DataProto, reward_normalization: RewardNormalizationConfig
) -> torch.Tensor:
    batch.batch["sample_order_placeholder"] = torch.arange(
        batch.batch.batch_size[0], device=batch.batch.device
    )
    grouping = reward_normalization.grouping
    norm_mean_type = reward_normalization.norm_mean_type
    norm_std_type = reward_normalization.norm_std_type

    all_scores = batch.batch["scores"].double()
    batch_mean = None
    batch_std = None
    if norm_mean_type == "batch":
        batch_mean = all_scores.mean()
    if norm_std_type == "batch":
        batch_std = all_scores.std()

    batch_list = []
    batch_grouped: dict[str, DataProto] = {"default": batch}
    if grouping != "batch":
        batch_grouped = batch.group_by(keys=grouping)
    for _group_name, group_batch in batch_grouped.items():
        scores = group_batch.batch["scores"]
        original_dtype = scores.dtype
        scores_float = scores.double()

        if norm_mean_type == "batch":
            reward_mean = batch_mean
        elif norm_mean_type == "group":
            reward_mean = scores_float.mean()
        else:
            reward_mean = 0.0

        if norm_std_type == "batch":
            reward_std = batch_std
        elif norm_std_type == "group":
            reward_std = scores_float.std()
        else:
            reward_std = None

        if reward_std is not None:
            # 处理单个元素或标准差为0的情况，避免除以0
            if scores_float.numel() > 1 and reward_std.abs() > 1e-6:
                normalized_scores = (scores_float - reward_mean) / (reward_std + 1e-6)
            else:
                normalized_scores = torch.zeros_like(scores_float)
        else:
            normalized_scores = scores_float - reward_mean

        normalized_scores = normalized_scores.to(dtype=original_dtype)
        group_batch.batch["grouped_rewards"] = normalized_scores
        batch_list.append(group_batch)

    batch = DataProto.concat(batch_list)
    batch.reorder(indices=torch.argsort(batch.batch["sample_order_placeholder"]))
    batch.pop("sample_order_placeholder")
    return batch.batch.pop("grouped_rewards")


def build_state_group(batch: DataProto) -> DataProto:
    batch.batch["sample_order_placeholder"] = torch.arange(
        batch.batch.batch_size[0], device=batch.batch.device
    )
    batch_group_by_traj_group: dict[str, DataProto] = batch.group_by(keys="traj_group_id")
    merged = []
    for _traj_group_id, traj_group_batch in batch_group_by_traj_group.items():
        batch_group_by_state: dict[str, DataProto] = traj_group_batch.group_by(keys="state_hash")
        for state, state_batch in batch_group_by_state.items():
            state_batch.non_tensor_batch["state_group_id"] = np.array(
                [state] * state_batch.batch.batch_size[0], dtype=object
            )
            merged.append(state_batch)
    state_batch_size = [len(m) for m in merged]
    merged = DataProto.concat(merged)
    merged.reorder(indices=torch.argsort(merged.batch["sample_order_placeholder"]))
    merged.pop("sample_order_placeholder")
    metrics = merged.meta_info.pop("metrics", {})
    metrics["system/state_batch_size/max"] = np.max(state_batch_size)
    metrics["system/state_batch_size/mean"] = np.mean(state_batch_size)
    metrics["system/state_batch_size/min"] = np.min(state_batch_size)
    merged.meta_info["metrics"] = metrics
    return merged


@torch.no_grad()
def compute_response_level_rewards(batch: DataProto, pipeline_config: AgenticConfig) -> DataProto:
    reward_metrics = {}
    if pipeline_config.adv_estimator == "gigpo":
        # ref: https://github.com/langfengQ/verl-agent/blob/e03bd502667c45172e8c093cc506db8438ae8ab5/gigpo/core_gigpo.py#L109
        # step 1
        episode_scores = torch.from_numpy(
            batch.non_tensor_batch["episode_scores"].astype(np.float64)
        )
        scores_to_group = DataProto.from_dict({"scores": episode_scores})
        scores_to_group.non_tensor_batch = batch.non_tensor_batch
        episode_rewards: torch.Tensor = agentic_reward_norm(
            scores_to_group, reward_normalization=pipeline_config.reward_normalization
        )

        # step 2
        batch = build_state_group(batch=batch)

        # step 3
        scores_to_group = DataProto.from_dict({"scores": batch.batch["step_rewards"]})
        scores_to_group.non_tensor_batch = batch.non_tensor_batch
        step_rewards: torch.Tensor = agentic_reward_norm(
            batch=scores_to_group,
            reward_normalization=RewardNormalizationConfig(
                grouping="state_group_id", method=pipeline_config.reward_normalization.method
            ),
        )

        batch.batch["response_level_rewards"] = (
            pipeline_config.episode_reward_weight * episode_rewards
            + pipeline_config.step_reward_weight * step_rewards
        )
        batch.batch["episode_rewards_norm"] = episode_rewards
        batch.batch["step_rewards_norm"] = step_rewards

    return batch, reward_metrics


# --------------------------------------------------------------------------- batches
def _episodes(n_groups: int, seed: int, shared_states: bool, t: int = 11):
    """Steps of episodes as ROLL's StepEnvManager lays them out (one row per step, the
    episode score the sum of its step rewards), rows shuffled: groups of 1..5 episodes of
    1..6 steps, states drawn from a small pool (repeats within a group; across groups only
    with ``shared_states``), some groups of equal episode scores, a ragged mask with empty
    rows. Returns the ROLL batch and the rlops inputs."""
    rng = np.random.default_rng(seed)
    rows = []
    for g in range(n_groups):
        tie = rng.random() < 0.2
        for e in range(int(rng.integers(1, 6))):
            steps = int(rng.integers(1, 7))
            rewards = np.zeros(steps) if tie else rng.choice([0.0, 0.0, 0.5, 1.0], size=steps)
            for k in range(steps):
                state = int(rng.integers(0, 4)) + k
                rows.append((g, f"{g}/{e}", k, float(rewards[k]), float(rewards.sum()), state))
    order = rng.permutation(len(rows))
    rows = [rows[i] for i in order]
    b = len(rows)
    group, traj, step, score, episode, state = (list(c) for c in zip(*rows, strict=True))
    pairs = zip(group, state, strict=True)
    state_hash = [f"s{s}" if shared_states else f"{g}:s{s}" for g, s in pairs]
    proto = DataProto.from_dict(
        {"row": torch.arange(b)},
        {
            "traj_group_id": np.array(group, dtype=object),
            "traj_id": np.array(traj, dtype=object),
            "step": np.array(step, dtype=object),
            "step_scores": np.array(score, dtype=object),
            "episode_scores": np.array(episode, dtype=object),
            "state_hash": np.array(state_hash, dtype=object),
        },
    )
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(b, t, gen)
    mask[torch.rand(b, generator=gen) < 0.1] = 0
    index = torch.tensor(group) * 3 - 7
    anchors = torch.tensor(state)
    return proto, torch.tensor(episode, dtype=torch.float64), index, anchors, mask


def _roll(proto, gamma, method, w_e, w_s):
    batch = compute_discounted_returns(proto, "gigpo", gamma)
    cfg = AgenticConfig(
        RewardNormalizationConfig(grouping="traj_group_id", method=method),
        episode_reward_weight=w_e,
        step_reward_weight=w_s,
    )
    batch, _ = compute_response_level_rewards(batch, cfg)
    assert torch.equal(batch.batch["row"], torch.arange(len(batch)))  # ROLL keeps the order
    return batch.batch["step_rewards"], batch.batch["response_level_rewards"]


WORST: dict[str, float] = {}
# ROLL takes the std of a group of one before it tests the group's size
pytestmark = pytest.mark.filterwarnings("ignore:std.*degrees of freedom:UserWarning")
SETTINGS = [(0.95, "mean_std", 1.0, 1.0), (1.0, "mean", 1.0, 1.0), (0.9, "mean_std", 0.5, 2.0)]


@pytest.mark.parametrize("gamma,method,w_e,w_s", SETTINGS)
@pytest.mark.parametrize("n_groups,seed", [(1, 0), (3, 1), (17, 2), (60, 3)])
def test_matches_roll(n_groups, seed, gamma, method, w_e, w_s):
    """States that repeat within a group only: ROLL's grouping by the hash is rlops's by the
    pair (index, anchor). Step returns from ROLL's compute_discounted_returns."""
    proto, episode, index, anchors, mask = _episodes(n_groups, seed, shared_states=False)
    step_returns, want = _roll(proto, gamma, method, w_e, w_s)
    adv, ret = rlops.gigpo_advantages(
        episode,
        index,
        step_returns,
        anchors,
        mask,
        episode_reward_weight=w_e,
        step_reward_weight=w_s,
        norm_std=method == "mean_std",
    )
    assert ret is adv and adv.dtype == torch.float64
    want = want[:, None] * mask
    diff = float((adv - want).abs().max())
    WORST["roll"] = max(WORST.get("roll", 0.0), diff)
    assert diff <= 1e-12 * max(1.0, float(want.abs().max())), diff


@pytest.mark.parametrize("seed", [4, 5])
def test_roll_groups_states_by_hash_alone(seed):
    """Where one state hash appears in two groups ROLL puts those steps in one group: the
    step part of a second call with a single index then gives ROLL's result."""
    proto, episode, index, anchors, mask = _episodes(12, seed, shared_states=True)
    step_returns, want = _roll(proto, 0.95, "mean_std", 1.0, 1.0)
    ep, _ = rlops.gigpo_advantages(
        episode, index, step_returns, anchors, mask, step_reward_weight=0.0
    )
    st, _ = rlops.gigpo_advantages(
        episode, torch.zeros_like(index), step_returns, anchors, mask, episode_reward_weight=0.0
    )
    want = want[:, None] * mask
    assert float((ep + st - want).abs().max()) <= 1e-12 * float(want.abs().max())
    pair, _ = rlops.gigpo_advantages(episode, index, step_returns, anchors, mask)
    assert not torch.equal(pair, ep + st)  # the pair grouping differs here


def test_step_returns_are_discounted_returns_over_an_episode_layout():
    """The docstring's recipe: rlops.discounted_returns on [episodes, steps] gives ROLL's
    step returns."""
    proto, *_ = _episodes(9, 6, shared_states=False)
    want = compute_discounted_returns(proto, "gigpo", 0.95).batch["step_rewards"]
    traj = proto.non_tensor_batch["traj_id"]
    names_ = sorted(set(traj))
    k = int(max(proto.non_tensor_batch["step"])) + 1
    r = torch.zeros(len(names_), k, dtype=torch.float64)
    present = torch.zeros(len(names_), k, dtype=torch.bool)
    where = [(names_.index(tr), int(s)) for tr, s in zip(traj, proto.non_tensor_batch["step"])]
    for (e, s), v in zip(where, proto.non_tensor_batch["step_scores"], strict=True):
        r[e, s], present[e, s] = float(v), True
    g = rlops.discounted_returns(r, gamma=0.95, mask=present)
    got = torch.stack([g[e, s] for e, s in where])
    torch.testing.assert_close(got, want, rtol=1e-14, atol=0)


# --------------------------------------------------------------------------- the reference
def _exact_normalised(x, keys, norm_std, eps):
    out = [Fraction(0)] * len(x)
    groups = defaultdict(list)
    for i, k in enumerate(keys):
        groups[k].append(i)
    for rows in groups.values():
        if len(rows) == 1:
            continue
        vals = [Fraction(float(x[i])) for i in rows]
        mean = sum(vals, Fraction(0)) / len(rows)
        if not norm_std:
            for i, v in zip(rows, vals, strict=True):
                out[i] = v - mean
            continue
        var = sum(((v - mean) ** 2 for v in vals), Fraction(0)) / (len(rows) - 1)
        with localcontext() as ctx:
            ctx.prec = 50
            std = Fraction((Decimal(var.numerator) / Decimal(var.denominator)).sqrt())
        if std > Fraction(eps):
            for i, v in zip(rows, vals, strict=True):
                out[i] = (v - mean) / (std + Fraction(eps))
    return out


def _exact(episode, index, steps, anchors, mask, norm_std, eps, w_e, w_s):
    ids = index.tolist()
    ep = _exact_normalised(episode, ids, norm_std, eps)
    st = _exact_normalised(steps, list(zip(ids, anchors.tolist())), norm_std, eps)
    a = [Fraction(w_e) * x + Fraction(w_s) * y for x, y in zip(ep, st, strict=True)]
    return torch.tensor([float(v) for v in a], dtype=torch.float64)[:, None] * mask


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b", [1, 127, 128, 129, 1000])
@pytest.mark.parametrize("norm_std", [True, False])
def test_matches_reference_and_exact_oracle(dtype, b, norm_std):
    gen = torch.Generator().manual_seed(b)
    index = torch.randint(0, max(1, b // 6), (b,), generator=gen) * 5 - 11
    anchors = torch.randint(0, 3, (b,), generator=gen)
    episode = torch.randn(b, generator=gen, dtype=torch.float64).to(dtype)
    steps = torch.randn(b, generator=gen, dtype=torch.float64).to(dtype)
    mask = random_mask(b, 9, gen)
    kw = {"norm_std": norm_std, "eps": 1e-6, "episode_reward_weight": 0.7}
    adv, _ = rlops.gigpo_advantages(episode, index, steps, anchors, mask, **kw)
    assert adv.dtype == dtype and adv.shape == mask.shape and (adv[mask == 0] == 0).all()
    acc = acc_dtype(dtype)
    same = gigpo_reference(episode.to(acc), index, steps.to(acc), anchors, mask, **kw).to(dtype)
    exact = _exact(episode, index, steps, anchors, mask, norm_std, 1e-6, 0.7, 1.0)
    assert_within_ref_error(adv, exact, same)


# --------------------------------------------------------------------------- by hand, edges
def test_by_hand():
    """One group of four steps from two episodes; states 7 and 8 each reached twice."""
    episode = torch.tensor([1.0, 1.0, 0.0, 0.0])
    steps = torch.tensor([1.0, 0.5, 0.0, 0.0])
    index, anchors = torch.zeros(4, dtype=torch.long), torch.tensor([7, 8, 7, 8])
    adv, _ = rlops.gigpo_advantages(episode, index, steps, anchors, torch.ones(4, 1))
    s_ep = (1 / 3) ** 0.5  # unbiased std of (1, 1, 0, 0)
    s7, s8 = 0.5**0.5, 0.125**0.5  # of (1, 0) and (0.5, 0)
    want = [
        0.5 / (s_ep + 1e-6) + 0.5 / (s7 + 1e-6),
        0.5 / (s_ep + 1e-6) + 0.25 / (s8 + 1e-6),
        -0.5 / (s_ep + 1e-6) - 0.5 / (s7 + 1e-6),
        -0.5 / (s_ep + 1e-6) - 0.25 / (s8 + 1e-6),
    ]
    torch.testing.assert_close(adv[:, 0], torch.tensor(want))


def test_edges_group_of_one_zero_spread_and_empty_rows():
    episode = torch.tensor([3.0, 2.0, 2.0, 1.0, 5.0])
    steps = torch.tensor([1.0, 4.0, 4.0, 0.0, 2.0])
    index = torch.tensor([0, 1, 1, 1, 2])  # group 2 alone
    anchors = torch.tensor([0, 5, 5, 6, 0])  # (1, 5) twice with equal returns; (1, 6) alone
    mask = torch.ones(5, 3)
    mask[2] = 0  # a row without action tokens still counts in its groups
    adv, _ = rlops.gigpo_advantages(episode, index, steps, anchors, mask, eps=0.0)
    assert adv[0].tolist() == [0.0] * 3 and adv[4].tolist() == [0.0] * 3  # groups of one
    assert adv[2].tolist() == [0.0] * 3
    # group 1's episode scores (2, 2, 1): mean 5/3, std 1/√3; steps: equal pair and a single
    torch.testing.assert_close(adv[1, 0], torch.tensor((1 / 3) * 3**0.5))
    torch.testing.assert_close(adv[3, 0], torch.tensor(-(2 / 3) * 3**0.5))
    tiny = rlops.gigpo_advantages(
        torch.tensor([1.0, 1.0 + 1e-7]),
        torch.tensor([0, 0]),
        torch.zeros(2),
        torch.tensor([0, 1]),
        torch.ones(2, 1),
    )[0]
    assert tiny.abs().max() == 0  # a std <= eps gives 0, as ROLL


def test_weights_scale_each_part_and_meta_tensors_need_no_host_read():
    _, episode, index, anchors, mask = _episodes(5, 7, shared_states=False)
    steps = torch.linspace(-1, 1, len(episode), dtype=torch.float64)
    ep, _ = rlops.gigpo_advantages(episode, index, steps, anchors, mask, step_reward_weight=0.0)
    st, _ = rlops.gigpo_advantages(episode, index, steps, anchors, mask, episode_reward_weight=0.0)
    both, _ = rlops.gigpo_advantages(
        episode, index, steps, anchors, mask, episode_reward_weight=0.5, step_reward_weight=2.0
    )
    torch.testing.assert_close(both, 0.5 * ep + 2.0 * st, rtol=1e-15, atol=1e-15)
    meta = torch.empty(8, device="meta")
    ids = torch.empty(8, dtype=torch.long, device="meta")
    adv, _ = rlops.gigpo_advantages(meta, ids, meta, ids, torch.empty(8, 5, device="meta"))
    assert adv.shape == (8, 5) and adv.device.type == "meta"


def test_empty_batch():
    z, ids = torch.zeros(0), torch.zeros(0, dtype=torch.long)
    assert rlops.gigpo_advantages(z, ids, z, ids, torch.ones(0, 3))[0].shape == (0, 3)


# --------------------------------------------------------------------------- bad input
def test_bad_input_names_the_argument():
    s, idx, m = torch.rand(4), torch.tensor([0, 0, 1, 1]), torch.ones(4, 3)
    call = rlops.gigpo_advantages
    with pytest.raises(TypeError, match=names("episode_scores")):
        call(idx, idx, s, idx, m)
    with pytest.raises(ValueError, match=names("episode_scores")):
        call(torch.rand(5), idx, s, idx, m)
    with pytest.raises(TypeError, match=names("step_rewards")):
        call(s, idx, idx, idx, m)
    with pytest.raises(ValueError, match=names("step_rewards")):
        call(s, idx, torch.rand(4, 3), idx, m)
    with pytest.raises(TypeError, match=names("index")):
        call(s, s, s, idx, m)
    with pytest.raises(TypeError, match=names("anchor_ids")):
        call(s, idx, s, s, m)
    with pytest.raises(ValueError, match=names("anchor_ids")):
        call(s, idx, s, idx[:3], m)
    with pytest.raises(ValueError, match=names("mask")):
        call(s, idx, s, idx, torch.ones(4))
    with pytest.raises(ValueError, match=names("mask")):
        call(s, idx, s, idx, torch.full((4, 3), 2.0))
    for name in ("eps", "episode_reward_weight", "step_reward_weight"):
        for bad in (-1.0, float("nan"), float("inf")):
            with pytest.raises(ValueError, match=names(name)):
                call(s, idx, s, idx, m, **{name: bad})
    with pytest.raises(TypeError, match=names("norm_std")):
        call(s, idx, s, idx, m, norm_std=1)
