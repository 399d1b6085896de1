"""Every public function on every available device, and the proof that none reads a value
back to the host.

**Devices.** The ``device`` fixture yields ``cpu`` and, where ``torch.cuda.is_available()``,
``cuda``: a GPU machine runs the same checks. On each device the scan, the estimators, the
group estimators, the losses, the statistics and the log-prob ops run in float32 and must
agree with the float64 result on CPU, within the measured budget of ``tests/tolerances.py``:
at most twice the error of a float32 CPU computation (the serial reference for the scan and
the estimators, the same function for the rest) plus a few ulps.

**No host synchronisation.** A function that reads a tensor's value on the host (``.item()``,
``.tolist()``, ``bool(t)``, ``float(t)``) stalls an accelerator's stream once per call. Every
name in ``rlops.__all__`` is run, forward and backward, on ``meta`` tensors, which have shapes
and dtypes but no values: any such read raises there. Output shapes and dtypes must equal those
of the same call on CPU. ``torch.compile(fullgraph=True)`` would prove the same (a host read
is a graph break) but compiling each function takes tens of seconds on two CPU cores; meta
runs the whole set in about a second.

What is exempt, and why:

* Checks that read values (a discount in [0, 1], a 0/1 mask, target ids in range) run on CPU
  tensors only, or everywhere with ``RLOPS_CHECK_VALUES=1`` (``rlops._checks``); the meta run
  unsets it, and :func:`test_value_checks_are_the_only_host_reads` shows that setting it makes
  those same calls read values.
* Scalar parameters given as 0-dim tensors (``gamma``, ``lam``, ``clip_low``, ``eps``,
  ``kl_coef``, ...) are read once on the host by design, so that they give exactly what the
  same Python float gives; per-row ``gamma`` and ``lam`` (``[B]`` or ``[B, 1]``) stay on the
  device (tested here).
* ``cp_group=`` / ``group=`` forms: collectives do not run on meta tensors, and their
  consistency checks read the gathered metadata on purpose (``RLOPS_CP_CHECK=0`` and
  ``RLOPS_TP_CHECK=0`` turn them off).
* ``method="compiled"`` runs on CPU only; on any other device it raises ``ValueError``.
"""

from __future__ import annotations

import pytest
import torch
from tests.tolerances import ALL_METHODS, assert_within_reference, max_abs_err, needs_numba

import rlops

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
F32, F64 = torch.float32, torch.float64


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


def _methods(device: torch.device) -> list[str]:
    return ALL_METHODS if device.type == "cpu" else [m for m in ALL_METHODS if m != "compiled"]


# --------------------------------------------------------------------------- inputs
B, T, V, H = 4, 150, 37, 16


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    """One float64 CPU batch with interior tool spans, right padding and episode ends."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=F64)

    mask = torch.rand(B, T, generator=g) > 0.15
    mask[:, 40:55] = False  # a tool span
    mask[1, 120:] = False  # right padding
    dones = torch.rand(B, T, generator=g) > 0.97
    logp = -torch.rand(B, T, generator=g, dtype=F64) * 3
    return {
        "r": randn(B, T),
        "v": randn(B, T),
        "x": randn(B, T),
        "a": 0.8 + 0.2 * torch.rand(B, T, generator=g, dtype=F64),
        "a_row": 0.9 + 0.1 * torch.rand(B, 1, generator=g, dtype=F64),
        "gamma_row": 0.95 + 0.05 * torch.rand(B, generator=g, dtype=F64),
        "mask": mask,
        "dones": dones,
        "outcome": randn(B),
        "kl": randn(B, T).abs() * 0.1,
        "index": torch.tensor([5, 5, 2, 5]),
        "logp": logp,
        "old_logp": logp + 0.3 * randn(B, T),
        "adv": randn(B, T),
        "logits": randn(B, 8, V) * 3,
        "target": torch.randint(0, V, (B, 8), generator=g),
        "keep": torch.rand(B, 8, V, generator=g) > 0.3,
        "hidden": randn(B * 8, H),
        "weight": randn(V, H) * 0.5,
    }


def _on(inputs: dict, device, dtype) -> dict:
    """The batch on ``device`` with floating tensors in ``dtype``."""
    return {
        k: t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
        for k, t in inputs.items()
    }


def _flat(out) -> list[torch.Tensor]:
    """Every tensor of a result (tuples, dicts of metrics), in a fixed order."""
    if out is None:
        return []
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [out[k] for k in sorted(out)]
    return [t for part in out for t in _flat(part)]


def _agree(name: str, got, oracle, refs) -> None:
    """Each output within 2x the float32 reference's error of the float64 oracle (+ ulps);
    of several references the one with the larger error sets the budget."""
    got, oracle = _flat(got), _flat(oracle)
    refs = [_flat(r) for r in refs]
    assert len(got) == len(oracle), name
    for k, (g, o) in enumerate(zip(got, oracle, strict=True)):
        ref = max((r[k] for r in refs), key=lambda r: max_abs_err(r, o))
        assert g.dtype == ref.dtype, (name, k, g.dtype, ref.dtype)
        assert_within_reference(f"{name}[{k}]", g.cpu(), o, ref)


# --------------------------------------------------------------------------- scan, estimators
def _scan_calls(d: dict, method: str) -> dict:
    """Name -> zero-argument call on the batch ``d`` with ``method``."""
    return {
        "cumsum scalar": lambda: rlops.discounted_cumsum(d["x"], 0.97, method=method),
        "cumsum per-row": lambda: rlops.discounted_cumsum(d["x"], d["a_row"], method=method),
        "cumsum per-token": lambda: rlops.discounted_cumsum(d["x"], d["a"], method=method),
        "gae": lambda: rlops.gae(
            d["r"], d["v"], gamma=0.99, lam=0.95, mask=d["mask"], dones=d["dones"], method=method
        ),
        "gae per-row": lambda: rlops.gae(
            d["r"], d["v"], gamma=d["gamma_row"], lam=0.9, method=method
        ),
        "discounted_returns": lambda: rlops.discounted_returns(
            d["r"], gamma=0.99, mask=d["mask"], dones=d["dones"], method=method
        ),
        "reinforce_plus_plus_returns": lambda: rlops.reinforce_plus_plus_returns(
            d["outcome"], d["kl"], d["mask"], kl_coef=0.05, gamma=0.99, method=method
        ),
    }


def test_scan_and_estimators_agree_with_cpu_float64(device):
    base = _inputs(1)
    oracle = {k: f() for k, f in _scan_calls(base, "reference").items()}
    cpu32 = _on(base, "cpu", F32)
    ref32 = {k: f() for k, f in _scan_calls(cpu32, "reference").items()}
    dev32 = _on(base, device, F32)
    for method in _methods(device):
        for name, call in _scan_calls(dev32, method).items():
            out = call()
            assert all(t.device.type == device.type for t in _flat(out)), name
            _agree(f"{name} ({method}, {device})", out, oracle[name], [ref32[name]])


# --------------------------------------------------------------------------- the other functions
def _other_calls(d: dict) -> dict:
    """Name -> zero-argument call of every non-scan public function on the batch ``d``."""
    calls = {
        "grpo_advantages": lambda: rlops.grpo_advantages(d["outcome"], d["index"], d["mask"]),
        "rloo_advantages": lambda: rlops.rloo_advantages(d["outcome"], d["index"], d["mask"]),
        "reinforce_plus_plus_baseline_advantages": lambda: (
            rlops.reinforce_plus_plus_baseline_advantages(d["outcome"], d["index"], d["mask"])
        ),
        "remax_advantages": lambda: rlops.remax_advantages(d["r"], d["outcome"], d["mask"]),
        "policy_loss": lambda: rlops.policy_loss(
            d["logp"], d["old_logp"], d["adv"], d["mask"], clip_high=0.28, dual_clip=3.0
        ),
        "policy_loss per-token": lambda: rlops.policy_loss(
            d["logp"], d["old_logp"], d["adv"], d["mask"], agg=None
        ),
        "value_loss": lambda: rlops.value_loss(d["v"], d["r"], d["x"], d["mask"], clip=0.5),
        "masked_mean": lambda: rlops.masked_mean(d["x"], d["mask"]),
        "masked_mean dim": lambda: rlops.masked_mean(d["x"], d["mask"], dim=-1),
        "masked_var": lambda: rlops.masked_var(d["x"], d["mask"]),
        "masked_whiten": lambda: rlops.masked_whiten(d["x"], d["mask"]),
        "logprobs_and_entropy": lambda: rlops.logprobs_and_entropy(d["logits"], d["target"]),
        "logprobs_and_entropy tempered, top-p": lambda: rlops.logprobs_and_entropy(
            d["logits"], d["target"], temperature=0.7, keep_mask=d["keep"] | _target_kept(d)
        ),
        "linear_logprobs_and_entropy": lambda: rlops.linear_logprobs_and_entropy(
            d["hidden"], d["weight"], d["target"].reshape(-1)
        ),
    }
    for kind in ("k1", "abs", "k2", "k3", "low_var_kl"):
        calls[f"kl_penalty {kind}"] = lambda kind=kind: rlops.kl_penalty(
            d["logp"], d["old_logp"], kind
        )
    for mode in rlops.losses.AGG_MODES:
        calls[f"aggregate_loss {mode}"] = lambda mode=mode: rlops.aggregate_loss(
            d["x"], d["mask"], mode
        )
    return calls


def _target_kept(d: dict) -> torch.Tensor:
    """A keep mask that holds the target of every token."""
    return torch.nn.functional.one_hot(d["target"], V).bool()


def _plain_logprobs(logits, target, temperature=1.0, keep=None):
    """The definition: log-softmax of the (kept) logits at the target; softmax entropy of all."""
    z = logits / temperature
    zk = z if keep is None else z.masked_fill(~keep, float("-inf"))
    logp = torch.log_softmax(zk, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    p = torch.softmax(z, -1)
    return logp, -(p * torch.log_softmax(z, -1)).sum(-1)


def _oracles(base: dict) -> dict:
    """The float64 CPU results, the log-probs from their definition."""
    out = {k: f() for k, f in _other_calls(base).items()}
    keep = base["keep"] | _target_kept(base)
    out["logprobs_and_entropy"] = _plain_logprobs(base["logits"], base["target"])
    out["logprobs_and_entropy tempered, top-p"] = _plain_logprobs(
        base["logits"], base["target"], 0.7, keep
    )
    out["linear_logprobs_and_entropy"] = _plain_logprobs(
        base["hidden"] @ base["weight"].T, base["target"].reshape(-1)
    )
    return out


def test_losses_stats_group_and_logprobs_agree_with_cpu_float64(device):
    base = _inputs(2)
    oracle = _oracles(base)
    cpu32 = _on(base, "cpu", F32)
    same32 = {k: f() for k, f in _other_calls(cpu32).items()}
    plain32 = _oracles(cpu32)  # the definitions in float32, a second reference
    for name, call in _other_calls(_on(base, device, F32)).items():
        out = call()
        assert all(t.device.type == device.type for t in _flat(out)), name
        _agree(f"{name} ({device})", out, oracle[name], [same32[name], plain32[name]])


def test_logprob_gradients_agree_with_cpu_float64(device):
    """The fused ops' own backward (recomputed softmax, chunk by chunk) on each device."""
    base = _inputs(3)

    def grads(d, fused: bool):
        logits = d["logits"].clone().requires_grad_(True)
        hidden = d["hidden"].clone().requires_grad_(True)
        weight = d["weight"].clone().requires_grad_(True)
        target = d["target"]
        if fused:
            lp, ent = rlops.logprobs_and_entropy(logits, target, chunk_size=5)
            lp2, ent2 = rlops.linear_logprobs_and_entropy(
                hidden, weight, target.reshape(-1), chunk_size=7
            )
        else:
            lp, ent = _plain_logprobs(logits, target)
            lp2, ent2 = _plain_logprobs(hidden @ weight.T, target.reshape(-1))
        w = torch.linspace(-1, 1, lp.numel(), dtype=lp.dtype, device=lp.device).view_as(lp)
        loss = (w * lp).sum() + (w.flip(-1) * ent).sum()
        loss = loss + (w.reshape(-1) * lp2).sum() + 0.5 * ent2.sum()
        loss.backward()
        return [logits.grad, hidden.grad, weight.grad]

    oracle = grads(base, fused=False)
    cpu32 = _on(base, "cpu", F32)
    refs = [grads(cpu32, fused=True), grads(cpu32, fused=False)]
    _agree(
        f"log-prob gradients ({device})", grads(_on(base, device, F32), fused=True), oracle, refs
    )


# --------------------------------------------------------------------------- meta: no host read
def _meta_cases(dev: str) -> dict[str, list]:
    """For each public name, calls on tensors of ``dev`` (values don't matter on meta)."""
    g = torch.Generator().manual_seed(4)

    def t(*shape, dtype=F32, grad=False):
        x = torch.randn(*shape, generator=g, dtype=F64).to(dtype).to(dev)
        return x.requires_grad_(grad)

    def ones(*shape, dtype=torch.bool):
        return torch.ones(*shape, dtype=dtype).to(dev)

    def ids(*shape, high=V):
        return torch.randint(0, high, shape, generator=g).to(dev)

    unit = (torch.rand(B, T, generator=g, dtype=F64) * 0.5 + 0.5).to(dev)
    m, m_float, d = ones(B, T), ones(B, T, dtype=F32), ones(B, T).logical_not()
    return {
        "discounted_cumsum": [
            lambda: rlops.discounted_cumsum(t(B, T, grad=True), 0.9),
            lambda: rlops.discounted_cumsum(t(B, T, grad=True), unit.float()),
            lambda: rlops.discounted_cumsum(t(B, T), unit[:, :1].float(), method="chunked"),
            lambda: rlops.discounted_cumsum(t(T, B, dtype=torch.bfloat16), 0.9, dim=0),
            lambda: rlops.discounted_cumsum(t(B, 9), 0.5, method="reference"),
        ],
        "gae": [
            lambda: rlops.gae(
                t(B, T, grad=True), t(B, T, grad=True), gamma=0.99, lam=0.95, mask=m, dones=d
            ),
            lambda: rlops.gae(
                t(B, T), t(B, T), gamma=unit[:, 0].float(), lam=unit[:, 1:2].float(), mask=m_float
            ),
            lambda: rlops.gae(
                t(B, T, dtype=torch.float16), t(B, T), gamma=1.0, lam=1.0, method="chunked"
            ),
            lambda: rlops.gae(
                t(B, 9), t(B, 9), gamma=0.9, lam=0.9, mask=m[:, :9], method="reference"
            ),
        ],
        "discounted_returns": [
            lambda: rlops.discounted_returns(t(B, T, grad=True), gamma=0.99, mask=m, dones=d),
            lambda: rlops.discounted_returns(t(B, T), gamma=unit[:, 0].float()),
        ],
        "reinforce_plus_plus_returns": [
            lambda: rlops.reinforce_plus_plus_returns(
                t(B, grad=True), t(B, T, grad=True), m, kl_coef=0.1, gamma=1.0
            ),
            lambda: rlops.reinforce_plus_plus_returns(
                t(B), t(B, T), m_float, kl_coef=0.1, gamma=unit[:, 0].float()
            ),
        ],
        "grpo_advantages": [
            lambda: rlops.grpo_advantages(t(B, grad=True), ids(B, high=2), m),
            lambda: rlops.grpo_advantages(t(B, T), ids(B, high=2), m_float, norm_std=False),
        ],
        "rloo_advantages": [lambda: rlops.rloo_advantages(t(B, grad=True), ids(B, high=2), m)],
        "reinforce_plus_plus_baseline_advantages": [
            lambda: rlops.reinforce_plus_plus_baseline_advantages(
                t(B, grad=True), ids(B, high=2), m
            ),
        ],
        "remax_advantages": [
            lambda: rlops.remax_advantages(t(B, T, grad=True), t(B), m),
            lambda: rlops.remax_advantages(t(B), t(B), m_float),
        ],
        "kl_penalty": [
            lambda kind=kind: rlops.kl_penalty(t(B, T, grad=True), t(B, T), kind)
            for kind in rlops.losses.KL_KINDS
        ],
        "policy_loss": [
            lambda: rlops.policy_loss(t(B, T, grad=True), t(B, T), t(B, T), m, dual_clip=3.0),
            lambda: rlops.policy_loss(
                t(B, T, dtype=torch.bfloat16, grad=True),
                t(B, T, dtype=torch.bfloat16),
                t(B, T),
                m_float,
                agg="seq-mean-token-sum-norm",
            ),
        ],
        "value_loss": [
            lambda: rlops.value_loss(t(B, T, grad=True), t(B, T), t(B, T), m, clip=0.2),
            lambda: rlops.value_loss(t(B, T, grad=True), t(B, T), t(B, T), m_float, agg=None),
        ],
        "aggregate_loss": [
            lambda mode=mode: rlops.aggregate_loss(t(B, T, grad=True), m, mode)
            for mode in rlops.losses.AGG_MODES
        ],
        "masked_mean": [
            lambda: rlops.masked_mean(t(B, T, grad=True), m),
            lambda: rlops.masked_mean(t(B, T, grad=True), m_float, dim=-1),
        ],
        "masked_var": [lambda: rlops.masked_var(t(B, T, grad=True), m, unbiased=False)],
        "masked_whiten": [
            lambda: rlops.masked_whiten(t(B, T, grad=True), m),
            lambda: rlops.masked_whiten(t(B, T), m_float, shift_mean=False, eps=0.0),
        ],
        "logprobs_and_entropy": [
            lambda: rlops.logprobs_and_entropy(t(B, 8, V, grad=True), ids(B, 8)),
            lambda: rlops.logprobs_and_entropy(
                t(B, 8, V, dtype=torch.bfloat16, grad=True),
                ids(B, 8),
                temperature=0.7,
                keep_mask=ones(B, 8, V),
                chunk_size=3,
            ),
            lambda: rlops.logprobs_and_entropy(
                t(B, 8, V, grad=True), ids(B, 8), with_entropy=False
            ),
        ],
        "linear_logprobs_and_entropy": [
            lambda: rlops.linear_logprobs_and_entropy(
                t(B * 8, H, grad=True), t(V, H, grad=True), ids(B * 8), chunk_size=5
            ),
        ],
        "linear_policy_loss": [
            lambda: rlops.linear_policy_loss(
                t(B, 8, H, grad=True),
                t(V, H, grad=True),
                ids(B, 8),
                t(B, 8),
                t(B, 8),
                m[:, :8],
                entropy_coef=0.01,
                logprob_options={"chunk_size": 5},
            ),
            lambda: rlops.linear_policy_loss(
                t(B, 8, H, grad=True),
                t(V, H, grad=True),
                ids(B, 8),
                t(B, 8),
                t(B, 8),
                m_float[:, :8],
                kind="gspo",
                agg="seq-mean-token-mean",
            ),
        ],
        "distillation_loss": [
            lambda: rlops.distillation_loss(
                t(B, 8, V, grad=True),
                -t(B, 8, 3).abs() - 2,
                ids(B, 8, 3, high=1) + torch.arange(3).to(dev),
                kind="jsd",
                tail=True,
            ),
        ],
        "linear_distillation_loss": [
            lambda: rlops.linear_distillation_loss(
                t(B * 8, H, grad=True),
                t(V, H, grad=True),
                torch.log_softmax(t(B * 8, V), -1),
                kind="reverse_kl",
            ),
        ],
        "maxrl_advantages": [
            lambda: rlops.maxrl_advantages(t(B, grad=True), ids(B, high=2), m),
        ],
        "gigpo_advantages": [
            lambda: rlops.gigpo_advantages(t(B), ids(B, high=2), t(B), ids(B, high=2), m),
        ],
        "overlong_penalty": [
            lambda: rlops.overlong_penalty(ids(B, high=T), T - 4, 8),
        ],
        "entropy_loss": [
            lambda: rlops.entropy_loss(t(B, T, grad=True), m, coef=0.01),
            lambda: rlops.entropy_loss(
                t(B, T, grad=True), m_float, agg="seq-mean-token-mean", num_tokens=10, num_seqs=B
            ),
        ],
        "opo_advantages": [
            lambda: rlops.opo_advantages(t(B), ids(B, high=2), m),
        ],
        "gpg_advantages": [
            lambda: rlops.gpg_advantages(t(B), ids(B, high=2), m),
        ],
        "grpo_passk_advantages": [
            lambda: rlops.grpo_passk_advantages(
                t(B), (torch.arange(B) // 2).clamp(max=(B - 2) // 2).to(dev), m
            ),
        ],
        "rollout_importance_weights": [
            lambda: rlops.rollout_importance_weights(t(B, T), t(B, T), m),
            lambda: rlops.rollout_importance_weights(
                t(B, T),
                t(B, T, dtype=torch.bfloat16),
                m_float,
                level="sequence",
                mode="mask",
                low=0.5,
                batch_normalize=True,
            ),
        ],
        "rollout_rejection_mask": [
            lambda: rlops.rollout_rejection_mask(
                t(B, T), t(B, T), m, {"token_k1": 2.0, "seq_mean_k3": 0.01}
            ),
        ],
        "rollout_mismatch_metrics": [
            lambda: rlops.rollout_mismatch_metrics(t(B, T), t(B, T), m),
        ],
        "gdpo_advantages": [
            lambda: rlops.gdpo_advantages(t(B, 3, grad=True), ids(B, high=2), m),
        ],
        "optimal_token_baseline_advantages": [
            lambda: rlops.optimal_token_baseline_advantages(
                t(B, T, grad=True), ids(B, high=2), m, t(B, T), unit.float()
            ),
            lambda: rlops.optimal_token_baseline_advantages(
                t(B),
                ids(B, high=2),
                m_float,
                t(B, T),
                unit.float(),
                rollout_is_weights=unit,
                per_action_step=True,
            ),
        ],
        "opsm_mask": [lambda: rlops.opsm_mask(t(B, T), t(B, T), t(B, T), m, delta=0.01)],
        "m2po_mask": [
            lambda: rlops.m2po_mask(t(B, T), t(B, T), m, threshold=0.5),
            lambda: rlops.m2po_mask(t(B, T, dtype=F64), t(B, T), m_float, threshold=0.5),
        ],
        "top_entropy_mask": [
            lambda: rlops.top_entropy_mask(t(B, T), m, rho=0.2),
            lambda: rlops.top_entropy_mask(t(B, T, dtype=torch.bfloat16), m_float, rho=0.5),
        ],
        "behavior_importance_weights": [
            lambda agg=agg, action=action: rlops.behavior_importance_weights(
                t(B, T), t(B, T), m, upper=2.0, lower=0.5, level="sequence", agg=agg, action=action
            )
            for agg in ("sum", "mean", "max")
            for action in ("mask", "clamp")
        ],
    }


def test_meta_cases_cover_every_export():
    assert sorted(_meta_cases("cpu")) == sorted(rlops.__all__)


def _run_with_backward(call) -> list[torch.Tensor]:
    outs = _flat(call())
    loss = sum(o.float().sum() for o in outs if o.requires_grad)
    if isinstance(loss, torch.Tensor):
        loss.backward()
    return outs


@pytest.mark.parametrize("name", sorted(rlops.__all__))
def test_runs_on_meta_without_reading_values(name, monkeypatch):
    monkeypatch.delenv("RLOPS_CHECK_VALUES", raising=False)
    cpu_cases = _meta_cases("cpu")[name]
    meta_cases = _meta_cases("meta")[name]
    for k, (on_cpu, on_meta) in enumerate(zip(cpu_cases, meta_cases, strict=True)):
        want = _run_with_backward(on_cpu)
        got = _run_with_backward(on_meta)
        assert [(o.shape, o.dtype) for o in got] == [(o.shape, o.dtype) for o in want], (
            f"{name} case {k}"
        )
        assert all(o.device.type == "meta" for o in got), f"{name} case {k}"


def test_value_checks_are_the_only_host_reads(monkeypatch):
    """With ``RLOPS_CHECK_VALUES=1`` the value checks run on any device: on meta they then
    fail (a tensor read), which shows the meta run above would catch a host read."""
    monkeypatch.setenv("RLOPS_CHECK_VALUES", "1")
    x = torch.empty(B, T, device="meta")
    with pytest.raises(RuntimeError, match="meta"):
        rlops.discounted_cumsum(x, torch.empty(B, T, device="meta"))
    with pytest.raises(RuntimeError, match="meta"):
        rlops.gae(x, x, gamma=torch.empty(B, device="meta"), lam=0.9)
    with pytest.raises(RuntimeError, match="meta"):
        rlops.logprobs_and_entropy(
            torch.empty(3, V, device="meta"), torch.empty(3, dtype=torch.long, device="meta")
        )
    # without it, the same calls run
    monkeypatch.setenv("RLOPS_CHECK_VALUES", "0")
    rlops.discounted_cumsum(x, torch.empty(B, T, device="meta"))
    rlops.gae(x, x, gamma=torch.empty(B, device="meta"), lam=0.9)


@needs_numba
def test_compiled_runs_on_cpu_only():
    x = torch.empty(B, T, device="meta")
    with pytest.raises(ValueError, match="CPU"):
        rlops.discounted_cumsum(x, 0.9, method="compiled")
    with pytest.raises(ValueError, match="CPU"):
        rlops.gae(x, x, gamma=0.9, lam=0.9, method="compiled")


def test_auto_does_not_pick_compiled_off_cpu():
    x = torch.empty(B, T, device="meta")
    assert rlops.gae(x, x, gamma=0.9, lam=0.9)[0].device.type == "meta"  # "auto": chunked
