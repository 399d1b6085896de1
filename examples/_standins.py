"""STAND-INS for verl and slime, used only where the real package is not installed.

These modules are *not* verl or slime. They let rlops' examples and the snippets of its docs
run in CI on a machine without either trainer. Each provides only the names those examples and
snippets touch, written as plain Python loops over samples and tokens from the originals'
documented formulas (verl's ``verl/trainer/ppo/core_algos.py`` and
``verl/utils/torch_functional.py``; slime's ``slime/backends/megatron_utils/loss.py`` and
``slime/utils/misc.py``), so that "rlops against verl" still compares rlops with an independent
definition. Anything else raises ``AttributeError`` as for a missing module attribute.

``standin_modules("verl")`` returns the modules by dotted name (for ``sys.modules``, e.g. through
``monkeypatch.setitem`` in a test); ``use_if_absent("verl")`` installs them when ``import verl``
fails and says whether it did. Every stand-in module has ``__standin__ = True``.
"""

from __future__ import annotations

import importlib
import math
import sys
import types
from collections import defaultdict

import torch

__all__ = ["standin_modules", "use_if_absent"]


def _setting(config, key, default=None):
    """``config.key`` or ``config[key]`` (verl's dataclass configs, OmegaConf, dicts)."""
    if isinstance(config, dict):
        return config.get(key, default)
    return getattr(config, key, default)


# --------------------------------------------------------------------------- verl
def masked_whiten(values, mask, shift_mean=True):
    """verl's ``torch_functional.masked_whiten``: mean and unbiased variance over the mask
    (``Σm·x / (Σm + 1e-8)``, times ``n/(n−1)``), then ``(x − mean) / sqrt(var + 1e-8)``."""
    x, m = values.double().tolist(), mask.double().tolist()
    pairs = [(xv, mv) for xr, mr in zip(x, m) for xv, mv in zip(xr, mr)]
    n = sum(mv for _, mv in pairs)
    if n <= 1:
        raise ValueError("verl's masked_var needs at least two selected elements")
    mean = sum(xv * mv for xv, mv in pairs) / (n + 1e-8)
    var = sum((xv - mean) ** 2 * mv for xv, mv in pairs) / (n + 1e-8) * n / (n - 1)
    out = [[(xv - mean) / math.sqrt(var + 1e-8) + (0 if shift_mean else mean) for xv in xr]
           for xr in x]
    return torch.tensor(out, dtype=values.dtype)


def compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam):
    """verl's GAE: per row, backwards over tokens, ``δ_t = r_t + γ·V_next − V_t`` and
    ``A_t = δ_t + γλ·A_next``; on a mask-0 token ``V_next`` and ``A_next`` carry over unchanged
    (observation tokens skipped). ``returns = A + V``, then ``A`` is whitened over the mask."""
    r, v, m = (t.double().tolist() for t in (token_level_rewards, values, response_mask))
    gamma, lam = float(gamma), float(lam)
    adv = []
    for rr, vr, mr in zip(r, v, m):
        next_value, last_adv, row = 0.0, 0.0, [0.0] * len(rr)
        for t in reversed(range(len(rr))):
            delta = rr[t] + gamma * next_value - vr[t]
            if mr[t]:
                next_value, last_adv = vr[t], delta + gamma * lam * last_adv
            row[t] = last_adv
        adv.append(row)
    advantages = torch.tensor(adv, dtype=values.dtype)
    returns = advantages + values
    return masked_whiten(advantages, response_mask), returns


def compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                   norm_adv_by_std_in_grpo=True, config=None):
    """verl's GRPO: score = row sum; within each group of equal ``index``,
    ``(s − mean) / (std + epsilon)`` (unbiased std; a group of one has mean 0, std 1),
    broadcast over the row times the mask. Returns ``(advantages, advantages)``."""
    scores = [sum(row) for row in token_level_rewards.double().tolist()]
    groups = defaultdict(list)
    for i, s in enumerate(scores):
        groups[index[i]].append(s)
    out = []
    for i, s in enumerate(scores):
        g = groups[index[i]]
        mean = sum(g) / len(g) if len(g) > 1 else 0.0
        std = math.sqrt(sum((x - mean) ** 2 for x in g) / (len(g) - 1)) if len(g) > 1 else 1.0
        out.append((s - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else s - mean)
    adv = torch.tensor(out, dtype=token_level_rewards.dtype).unsqueeze(-1) * response_mask
    return adv, adv


def compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask,
                                loss_agg_mode="token-mean", config=None, rollout_is_weights=None):
    """verl's registered ``"vanilla"`` PPO loss, ``token-mean`` only. Per token, with
    ``ρ = exp(clamp(logp − old, ±20))``: ``ℓ = max(−A·ρ, −A·clip(ρ, 1 − low, 1 + high))``, and
    where ``A < 0`` also ``min(ℓ, −A·clip_ratio_c)``; times the IS weight; then
    ``Σ m·ℓ / batch_num_tokens · dp_size`` (``config.global_batch_info``). Metrics as verl's."""
    if loss_agg_mode != "token-mean":
        raise NotImplementedError("the verl stand-in implements loss_agg_mode='token-mean' only")
    clip = _setting(config, "clip_ratio")
    low, high = _setting(config, "clip_ratio_low"), _setting(config, "clip_ratio_high")
    low, high = clip if low is None else low, clip if high is None else high
    c = _setting(config, "clip_ratio_c", 3.0)
    info = _setting(config, "global_batch_info", None) or {}
    lp, old, a, m = (t.double().tolist() for t in (log_prob, old_log_prob, advantages,
                                                   response_mask))
    w = rollout_is_weights.double().tolist() if rollout_is_weights is not None else None
    total = n = clipped = lower = kl = 0.0
    for b in range(len(lp)):
        for t in range(len(lp[b])):
            if not m[b][t]:
                continue
            d = min(max(lp[b][t] - old[b][t], -20.0), 20.0)
            ratio, adv = math.exp(d), a[b][t]
            l1, l2 = -adv * ratio, -adv * min(max(ratio, 1 - low), 1 + high)
            loss = max(l1, l2)
            clipped += l2 > l1
            if adv < 0:
                lower += loss > -adv * c
                loss = min(loss, -adv * c)
            total += loss * (w[b][t] if w is not None else 1.0)
            n, kl = n + 1, kl - d
    num_tokens = info.get("batch_num_tokens", n)
    loss = torch.tensor(total / num_tokens * info.get("dp_size", 1), dtype=log_prob.dtype)
    metrics = {"actor/pg_clipfrac": clipped / (n + 1e-8), "actor/ppo_kl": kl / (n + 1e-8),
               "actor/pg_clipfrac_lower": lower / (n + 1e-8)}
    return loss, metrics


def _verl_modules() -> dict[str, types.ModuleType]:
    core = types.ModuleType("verl.trainer.ppo.core_algos", "STAND-IN for verl's core_algos.")
    core.compute_gae_advantage_return = compute_gae_advantage_return
    core.compute_grpo_outcome_advantage = compute_grpo_outcome_advantage
    core.compute_policy_loss_vanilla = compute_policy_loss_vanilla
    # verl registers its estimators and losses by name at import; so does the stand-in
    core.ADV_ESTIMATOR_REGISTRY = {"gae": compute_gae_advantage_return,
                                   "grpo": compute_grpo_outcome_advantage}
    core.POLICY_LOSS_REGISTRY = {"vanilla": compute_policy_loss_vanilla}

    def get_adv_estimator_fn(name):
        if name not in core.ADV_ESTIMATOR_REGISTRY:
            raise ValueError(f"Unknown advantage estimator simply: {name}")
        return core.ADV_ESTIMATOR_REGISTRY[name]

    def get_policy_loss_fn(name):
        if name not in core.POLICY_LOSS_REGISTRY:
            raise ValueError(f"Unsupported loss mode: {name}. Supported modes are: "
                             f"{list(core.POLICY_LOSS_REGISTRY)}")
        return core.POLICY_LOSS_REGISTRY[name]

    core.get_adv_estimator_fn, core.get_policy_loss_fn = get_adv_estimator_fn, get_policy_loss_fn
    tf = types.ModuleType("verl.utils.torch_functional", "STAND-IN for verl's torch_functional.")
    tf.masked_whiten = masked_whiten
    return _package_tree(core, tf)


# --------------------------------------------------------------------------- slime
def load_function(path):
    """slime's ``utils/misc.load_function``: ``"pkg.module.attr"`` -> that attribute."""
    module_path, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module_path), attr)


def _ratios(train_log_probs, rollout_log_probs):
    train = [x for t in train_log_probs for x in t.double().tolist()]
    rollout = [x for t in rollout_log_probs for x in t.double().tolist()]
    return [math.exp(a - b) for a, b in zip(train, rollout)]


def vanilla_tis_function(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks,
                         **kwargs):
    """slime's TIS, per token of the concatenated samples: ``ρ = exp(train − rollout)``,
    ``w = clamp(ρ, tis_clip_low, tis_clip)``; returns ``(pg_loss·w, loss_masks, metrics)``."""
    rho = _ratios(train_log_probs, rollout_log_probs)
    w = [min(max(r, args.tis_clip_low), args.tis_clip) for r in rho]
    metrics = {"tis": torch.tensor(rho), "tis_clipfrac": torch.tensor([float(a != b) for a, b
                                                                        in zip(w, rho)]),
               "tis_abs": torch.tensor([abs(r - 1) for r in rho])}
    return pg_loss * torch.tensor(w, dtype=pg_loss.dtype), loss_masks, metrics


def icepop_function(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    """slime's IcePop: ``w = ρ`` where ``tis_clip_low <= ρ <= tis_clip``, else 0 (dropped)."""
    rho = _ratios(train_log_probs, rollout_log_probs)
    w = [r if args.tis_clip_low <= r <= args.tis_clip else 0.0 for r in rho]
    metrics = {"tis": torch.tensor(rho), "tis_clipfrac": torch.tensor([float(x == 0.0)
                                                                        for x in w]),
               "tis_abs": torch.tensor([abs(r - 1) for r in rho])}
    return pg_loss * torch.tensor(w, dtype=pg_loss.dtype), loss_masks, metrics


def _slime_modules() -> dict[str, types.ModuleType]:
    misc = types.ModuleType("slime.utils.misc", "STAND-IN for slime's utils/misc.py.")
    misc.load_function = load_function
    loss = types.ModuleType("slime.backends.megatron_utils.loss",
                            "STAND-IN for slime's megatron_utils/loss.py.")
    loss.vanilla_tis_function, loss.icepop_function = vanilla_tis_function, icepop_function
    return _package_tree(misc, loss)


# --------------------------------------------------------------------------- installing
def _package_tree(*leaves: types.ModuleType) -> dict[str, types.ModuleType]:
    """The leaves and every parent package, each parent holding its child as an attribute."""
    mods = {leaf.__name__: leaf for leaf in leaves}
    for leaf in leaves:
        parts = leaf.__name__.split(".")
        for i in range(len(parts) - 1, 0, -1):
            parent = ".".join(parts[:i])
            if parent not in mods:
                mods[parent] = types.ModuleType(parent, f"STAND-IN package {parent}.")
                mods[parent].__path__ = []
            setattr(mods[parent], parts[i], mods[".".join(parts[: i + 1])])
    for mod in mods.values():
        mod.__standin__ = True
    return mods


def standin_modules(package: str) -> dict[str, types.ModuleType]:
    """The stand-in modules of ``package`` (``"verl"`` or ``"slime"``) by dotted name."""
    builders = {"verl": _verl_modules, "slime": _slime_modules}
    if package not in builders:
        raise ValueError(f"no stand-in for {package!r}: only {sorted(builders)}")
    return builders[package]()


def use_if_absent(package: str) -> bool:
    """Install the stand-in of ``package`` into ``sys.modules`` unless the real one imports.

    Returns True when the stand-in is in use (then say so in the output)."""
    try:
        importlib.import_module(package)
    except ImportError:
        sys.modules.update(standin_modules(package))
        return True
    return bool(getattr(sys.modules[package], "__standin__", False))
