"""``rlops.compat.verl.compute_forward_kl_topk`` against verl's own function, copied verbatim
below, and the cases of verl's CPU test ``tests/workers/test_distillation_topk_symmetry_on_cpu.py``
(commit 1c65ce38573dd83108d58f2b337961bdf398901f) that this function's version answers."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from rlops.compat.verl import compute_forward_kl_topk

# ---------------------------------------------------------------------------------------------
# verl-project/verl, verl/trainer/distillation/fsdp/losses.py at commit
# 072cf9bdc57fc57453845e8cb69278ee847832e0 (Apache-2.0), verbatim but for the imports (no
# Ulysses group here: world size 1) and the docstrings, shortened.
DistillationConfig = DistillationLossConfig = object


def get_ulysses_sequence_parallel_world_size():
    return 1


def slice_input_tensor(t, dim):  # pragma: no cover - world size 1
    return t


def _chunked_topk_log_probs(
    logits: torch.Tensor,
    topk_ids: torch.Tensor,
    chunk_size: int = 4096,
) -> torch.Tensor:
    """Compute log_softmax(logits).gather(topk_ids) without materializing [B, T, V]."""
    B, T, V = logits.shape
    K = topk_ids.shape[-1]
    flat_logits = logits.reshape(-1, V)  # [N, V]
    flat_topk = topk_ids.reshape(-1, K)  # [N, K]
    N = flat_logits.shape[0]

    # Edge case: empty input (e.g. fully-padded micro-batch).
    if N == 0:
        return torch.empty((B, T, K), dtype=logits.dtype, device=logits.device)

    out = torch.empty((N, K), dtype=logits.dtype, device=logits.device)
    for s in range(0, N, chunk_size):
        e = min(s + chunk_size, N)
        chunk_logits_fp32 = flat_logits[s:e].float()
        log_z = torch.logsumexp(chunk_logits_fp32, dim=-1, keepdim=True)  # [c, 1]
        chunk_topk_logits = torch.gather(chunk_logits_fp32, dim=-1, index=flat_topk[s:e])
        out[s:e] = (chunk_topk_logits - log_z).to(logits.dtype)
    return out.reshape(B, T, K)


def kl_divergence(log_q: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    """Compute KL divergence between two distributions given their log probabilities."""
    log_p = log_p.float()
    log_q = log_q.float()
    p = log_p.exp()
    kld = p * (log_p - log_q)
    return kld.sum(dim=-1)


def verl_compute_forward_kl_topk(
    student_logits: torch.Tensor,
    teacher_topk_log_probs: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    config: DistillationConfig,
    data_format: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Compute forward KL distillation loss using top-k log probabilities."""
    assert teacher_topk_log_probs.is_nested and teacher_topk_ids.is_nested
    teacher_topk_log_probs = teacher_topk_log_probs.values().unsqueeze(0)  # (1, total_nnz, topk)
    teacher_topk_ids = teacher_topk_ids.values().unsqueeze(0)  # (1, total_nnz, topk)

    # 1. split across sp groups (bsz, seqlen, topk) => (bsz, seqlen/sp_size, topk)
    if get_ulysses_sequence_parallel_world_size() > 1:
        teacher_topk_log_probs = slice_input_tensor(teacher_topk_log_probs, dim=1)
        teacher_topk_ids = slice_input_tensor(teacher_topk_ids, dim=1)
    assert (
        teacher_topk_log_probs.shape[:2] == teacher_topk_ids.shape[:2] == student_logits.shape[:2]
    )

    # 2. compute token-wise KL divergence across sp groups
    student_topk_ids = torch.topk(student_logits, k=teacher_topk_ids.shape[-1], dim=-1).indices
    student_topk_log_probs = _chunked_topk_log_probs(
        student_logits, teacher_topk_ids, chunk_size=4096
    )
    student_mass = student_topk_log_probs.exp().sum(dim=-1)
    teacher_mass = teacher_topk_log_probs.exp().sum(dim=-1)
    loss_config: DistillationLossConfig = config.distillation_loss
    if loss_config.log_prob_min_clamp is not None:
        student_topk_log_probs = student_topk_log_probs.clamp_min(loss_config.log_prob_min_clamp)
        teacher_topk_log_probs = teacher_topk_log_probs.clamp_min(loss_config.log_prob_min_clamp)
    distillation_losses = kl_divergence(log_q=student_topk_log_probs, log_p=teacher_topk_log_probs)

    overlap_mask = (teacher_topk_ids.unsqueeze(-1) == student_topk_ids.unsqueeze(-2)).any(dim=-1)
    overlap_count = overlap_mask.sum(dim=-1)
    token_kl = teacher_topk_log_probs.exp() * (teacher_topk_log_probs - student_topk_log_probs)
    overlap_token_advantage_sum = (-token_kl * overlap_mask).sum(dim=-1)
    overlap_token_advantage = overlap_token_advantage_sum / overlap_count.clamp_min(1)
    overlap_token_advantage = torch.where(
        overlap_count > 0, overlap_token_advantage, torch.zeros_like(overlap_token_advantage)
    )

    return {
        "distillation_losses": distillation_losses,
        "student_mass": student_mass,
        "teacher_mass": teacher_mass,
        "overlap_count": overlap_count,
        "overlap_token_advantage": overlap_token_advantage,
    }


# ---------------------------------------------------------------------------------------------

KEYS = (
    "distillation_losses",
    "student_mass",
    "teacher_mass",
    "overlap_count",
    "overlap_token_advantage",
)


def _nested(rows, dtype):
    lengths = torch.tensor([len(r) for r in rows])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    values = (
        torch.cat([torch.as_tensor(r, dtype=dtype) for r in rows])
        if rows
        else torch.zeros(0, 1, dtype=dtype)
    )
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets)


def _batch(lengths, v, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    nnz = sum(lengths)
    logits = (torch.randn(1, nnz, v, generator=g, dtype=torch.float64) * 3).to(dtype)
    t = torch.log_softmax(torch.randn(nnz, v, generator=g, dtype=torch.float64) * 3, -1)
    vals, ids = t.topk(k, -1)
    perm = torch.randperm(k, generator=g)
    vals, ids = vals[:, perm].to(dtype), ids[:, perm]
    cuts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    lp = _nested([vals[a:b] for a, b in itertools.pairwise(cuts)], dtype)
    ii = _nested([ids[a:b] for a, b in itertools.pairwise(cuts)], torch.int64)
    return logits, lp, ii


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("clamp", [None, -3.0])
@pytest.mark.parametrize(
    ("lengths", "v", "k"), [([5, 1, 9], 37, 4), ([1], 8, 8), ([3, 0, 4], 129, 16)]
)
def test_matches_verl(dtype, clamp, lengths, v, k):
    logits, lp, ids = _batch(lengths, v, k, dtype, seed=len(lengths) + v)
    cfg = SimpleNamespace(distillation_loss=SimpleNamespace(log_prob_min_clamp=clamp))
    want = verl_compute_forward_kl_topk(logits, lp, ids, cfg, "thd")
    got = compute_forward_kl_topk(logits, lp, ids, cfg, "thd")
    assert set(got) == set(KEYS)
    for key in KEYS:
        assert got[key].shape == want[key].shape and got[key].dtype == want[key].dtype, key
        if key == "overlap_count":
            assert torch.equal(got[key], want[key])
        else:
            # verl computes the student's log-probs and the KL in float32 whatever the dtype
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)


def test_gradient_matches_verl():
    logits, lp, ids = _batch([6, 7], 50, 5, torch.float64, seed=7)
    cfg = SimpleNamespace(distillation_loss=SimpleNamespace(log_prob_min_clamp=-4.0))
    grads = []
    for fn in (verl_compute_forward_kl_topk, compute_forward_kl_topk):
        z = logits.clone().requires_grad_()
        fn(z, lp, ids, cfg, "thd")["distillation_losses"].sum().backward()
        grads.append(z.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)  # verl: float32


def _nested_from_rows(rows):
    values = torch.tensor(rows)
    offsets = torch.tensor([0, len(rows)], dtype=torch.int64)
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets)


def test_verl_cpu_test_overlap_metrics():
    """verl's ``test_forward_kl_topk_emits_overlap_metrics``, as written there."""
    logits = torch.tensor(
        [
            [0.0, 9.0, 8.0, 1.0, 0.0, 0.0],
            [8.0, 7.0, 0.0, 0.0, 9.0, 0.0],
            [9.0, 8.0, 7.0, 0.0, 0.0, 0.0],
        ],
        dtype=torch.float32,
    ).unsqueeze(0)
    teacher_ids = _nested_from_rows([[1, 2], [4, 5], [3, 4]]).to(torch.int64)
    teacher_logprobs = _nested_from_rows(
        [
            [torch.log(torch.tensor(0.7)), torch.log(torch.tensor(0.2))],
            [torch.log(torch.tensor(0.6)), torch.log(torch.tensor(0.3))],
            [torch.log(torch.tensor(0.5)), torch.log(torch.tensor(0.4))],
        ]
    ).to(torch.float32)
    config = SimpleNamespace(distillation_loss=SimpleNamespace(log_prob_min_clamp=None))
    output = compute_forward_kl_topk(
        student_logits=logits,
        teacher_topk_log_probs=teacher_logprobs,
        teacher_topk_ids=teacher_ids,
        config=config,
        data_format="thd",
    )
    torch.testing.assert_close(output["overlap_count"], torch.tensor([[2, 1, 0]]))
    student_log_probs = torch.log_softmax(logits, dim=-1)
    gathered_student = torch.gather(
        student_log_probs, dim=-1, index=teacher_ids.values().unsqueeze(0)
    )
    teacher_log_probs = teacher_logprobs.values().unsqueeze(0)
    token_adv = -(teacher_log_probs.exp() * (teacher_log_probs - gathered_student))
    expected_ota = torch.tensor(
        [[token_adv[0, 0].mean(), token_adv[0, 1, 0], 0.0]],
        dtype=output["overlap_token_advantage"].dtype,
    )
    torch.testing.assert_close(output["overlap_token_advantage"], expected_ota)


def test_bad_data_format_names_it():
    logits, lp, ids = _batch([2], 6, 2, torch.float32, seed=0)
    with pytest.raises(ValueError, match="data_format"):
        compute_forward_kl_topk(logits, lp, ids, SimpleNamespace(distillation_loss=None), "sbhd")


def test_bfloat16_logits_closer_to_float64_than_verl():
    """verl rounds the student's top-k log-probs to bfloat16 before the KL; rlops keeps them in
    float32: both near verl's own result, and rlops nearer the float64 value."""
    logits, lp, ids = _batch([40, 17], 300, 16, torch.float32, seed=5)
    cfg = SimpleNamespace(distillation_loss=SimpleNamespace(log_prob_min_clamp=None))
    half = logits.to(torch.bfloat16)
    want = verl_compute_forward_kl_topk(half, lp, ids, cfg, "thd")["distillation_losses"]
    got = compute_forward_kl_topk(half, lp, ids, cfg, "thd")["distillation_losses"]
    exact = (
        lp.values().double().exp()
        * (lp.values().double() - torch.log_softmax(half.double(), -1)[0].gather(-1, ids.values()))
    ).sum(-1)[None]  # the definition, float64
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0.05)
    assert (got.double() - exact).abs().max() <= (want.double() - exact).abs().max()
