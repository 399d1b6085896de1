"""``rlops demo``: PPO from scratch on a task with an exact reward, every RL number from rlops.

The task: the prompt shows a random string of symbols; the policy must write it reversed.
The reward, given once on the last token, is the fraction of positions written correctly
(maximum 1; chance level is one over the vocabulary size, 1/13 by default). Rollouts are
sampled from the policy itself. GAE (:func:`rlops.gae`), log-probs and entropy
(:func:`rlops.logprobs_and_entropy`), the KL penalty to the initial policy
(:func:`rlops.kl_penalty`), advantage whitening and the policy and value losses all come from
rlops.

``--multi-turn``: the prompt shows only the first half of the string; after the policy has
answered it, the environment (a "tool") inserts an observation -- a marker, the second half,
a separator -- and the policy answers again. Observation tokens are part of the response but
are not actions (mask 0): they are not sampled, not trained on, and GAE skips them, so the
outcome reward on the last token still reaches the first turn's tokens.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import time

import torch

import rlops
from rlops.cli.display import Progress, say, wrap
from rlops.cli.model import ModelConfig, TinyTransformer, sample
from rlops.measure import options
from rlops.measure.timing import torch_threads

__all__ = ["DemoConfig", "add_arguments", "run", "train"]


@dataclasses.dataclass
class DemoConfig:
    """Every knob of the demo (the defaults finish in about 2 minutes on 2 CPU cores)."""

    # task
    symbols: int = 10  # alphabet of the strings to reverse
    length: int = 10  # symbols per string (multi-turn: two halves, so it must be even)
    multi_turn: bool = False
    # model
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    # PPO
    iterations: int = 200
    batch: int = 128  # rollouts per iteration
    epochs: int = 4  # optimisation passes over each batch
    lr: float = 1e-3
    temperature: float = 1.0
    gamma: float = 1.0
    lam: float = 0.95
    clip: float = 0.2
    value_coef: float = 0.5
    entropy_coef: float = 0.01
    kl_coef: float = 0.01  # k1 KL to the initial policy, subtracted from the per-token reward
    seed: int = 0
    threads: int = 1  # torch intra-op threads: this model is too small to gain from more


# --------------------------------------------------------------------------- the task
def special_tokens(cfg: DemoConfig) -> tuple[int, int, int]:
    """Ids of BOS (prompt start), SEP (end of a string to reverse) and OBS (tool output)."""
    return cfg.symbols, cfg.symbols + 1, cfg.symbols + 2


def rollout(policy, cfg: DemoConfig, gen: torch.Generator):
    """Sample one batch of episodes.

    Returns ``(tokens [B, P + R], prompt_len P, mask [B, R], reward [B])``: the whole
    sequences, the action mask over the response (0 on tool output) and the task reward.
    """
    bos, sep, obs = special_tokens(cfg)
    b = cfg.batch
    half = cfg.length // 2 if cfg.multi_turn else cfg.length
    strings = torch.randint(0, cfg.symbols, (b, cfg.length), generator=gen)
    first = strings[:, :half]
    prompt = torch.cat([torch.full((b, 1), bos), first, torch.full((b, 1), sep)], dim=1)
    seq = sample(policy, prompt, half, temperature=cfg.temperature, generator=gen)
    actions, targets = seq[:, -half:], first.flip(1)
    mask = torch.ones(b, half)
    if cfg.multi_turn:  # the environment answers with the rest of the string, then turn two
        second = strings[:, half:]
        tool = torch.cat([torch.full((b, 1), obs), second, torch.full((b, 1), sep)], dim=1)
        seq = sample(
            policy, torch.cat([seq, tool], dim=1), half, temperature=cfg.temperature, generator=gen
        )
        actions = torch.cat([actions, seq[:, -half:]], dim=1)
        targets = torch.cat([targets, second.flip(1)], dim=1)
        mask = torch.cat([mask, torch.zeros(b, tool.shape[1]), torch.ones(b, half)], dim=1)
    reward = (actions == targets).float().mean(dim=1)
    return seq, prompt.shape[1], mask, reward


def model_config(cfg: DemoConfig) -> ModelConfig:
    """The policy's sizes: the vocabulary holds the symbols and the three special tokens."""
    half = cfg.length // 2
    prompt_len = half + 2 if cfg.multi_turn else cfg.length + 2
    response_len = 3 * half + 2 if cfg.multi_turn else cfg.length  # turn, tool output, turn
    return ModelConfig(
        vocab=cfg.symbols + 3,
        context=prompt_len + response_len,
        d_model=cfg.d_model,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
    )


# --------------------------------------------------------------------------- PPO
def evaluate(model, seq: torch.Tensor, p: int, cfg: DemoConfig):
    """Log-probs, entropy and values of the response tokens ``seq[:, p:]``, each ``[B, R]``."""
    hidden = model.trunk(seq[:, :-1])[:, p - 1 :]
    logp, entropy = rlops.logprobs_and_entropy(
        model.logits(hidden), seq[:, p:], temperature=cfg.temperature
    )
    return logp, entropy, model.values(hidden)


def train(cfg: DemoConfig, on_iteration=None) -> dict:
    """Train a fresh policy with PPO; returns ``{"reward_curve", "max_reward", "seconds"}``.

    ``on_iteration(i, stats)`` is called after every iteration with the logged numbers.
    """
    check_config(cfg)
    with torch_threads(cfg.threads):
        return _train(cfg, on_iteration)


def _train(cfg: DemoConfig, on_iteration) -> dict:
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    policy = TinyTransformer(model_config(cfg))
    reference = copy.deepcopy(policy).requires_grad_(False)
    opt = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
    curve = []
    start = time.perf_counter()
    for it in range(cfg.iterations):
        seq, p, mask, score = rollout(policy, cfg, gen)
        with torch.no_grad():
            old_logp, _, old_values = evaluate(policy, seq, p, cfg)
            ref_logp, _, _ = evaluate(reference, seq, p, cfg)
            kl = rlops.kl_penalty(old_logp, ref_logp, "k1")
            rewards = -cfg.kl_coef * kl * mask
            rewards[:, -1] += score  # outcome reward on the last token (always an action)
            adv, returns = rlops.gae(rewards, old_values, gamma=cfg.gamma, lam=cfg.lam, mask=mask)
            adv = rlops.masked_whiten(adv, mask)
        for _ in range(cfg.epochs):
            logp, entropy, values = evaluate(policy, seq, p, cfg)
            pg, pg_metrics = rlops.policy_loss(logp, old_logp, adv, mask, clip_low=cfg.clip)
            vf, _ = rlops.value_loss(values, old_values, returns, mask, clip=cfg.clip)
            ent = rlops.masked_mean(entropy, mask)
            loss = pg + cfg.value_coef * vf - cfg.entropy_coef * ent
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            opt.step()
        stats = {
            "reward": score.mean(),
            "kl": rlops.masked_mean(kl, mask),
            "entropy": ent.detach(),
            "clipfrac": pg_metrics["pg_clipfrac"],
        }
        stats = {k: float(v) for k, v in stats.items()}  # one sync per iteration, for logging
        curve.append(stats["reward"])
        if on_iteration is not None:
            on_iteration(it, stats)
    return {"reward_curve": curve, "max_reward": 1.0, "seconds": time.perf_counter() - start}


# --------------------------------------------------------------------------- command line
def chance_reward(cfg: DemoConfig) -> float:
    """Expected reward of the initial, near-uniform policy: one token in ``vocab`` is right."""
    return 1.0 / (cfg.symbols + 3)


def check_config(cfg: DemoConfig) -> None:
    """Raise ``ValueError`` for a configuration the task cannot be built from."""
    if cfg.symbols < 2:
        raise ValueError(f"--symbols must be at least 2, got {cfg.symbols}")
    if cfg.multi_turn and (cfg.length < 2 or cfg.length % 2):
        raise ValueError(f"--multi-turn needs an even --length >= 2, got {cfg.length}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``rlops demo``'s options, on its parser ``p``."""
    d = DemoConfig()
    for name, text in (
        ("iterations", "PPO iterations"),
        ("batch", "rollouts per iteration"),
        ("epochs", "optimisation passes over each batch"),
        ("length", "symbols per string"),
        ("symbols", "alphabet size"),
    ):
        default = getattr(d, name)
        p.add_argument(
            f"--{name}",
            metavar="N",
            type=options.positive_int,
            default=default,
            help=f"{text} (default {default})",
        )
    p.add_argument(
        "--multi-turn",
        action="store_true",
        help="the second half of the string arrives as tool output (mask 0) after the first answer",
    )
    p.add_argument("--seed", type=int, default=d.seed, help=f"(default {d.seed})")
    options.add_outputs(
        p, json="write the reward curve as JSON", plot="save the reward curve as a PNG"
    )


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    """The :class:`DemoConfig` for parsed ``rlops demo`` options: each option sets the field of
    its name; the fields without an option keep their defaults."""
    given = (f.name for f in dataclasses.fields(DemoConfig) if hasattr(args, f.name))
    return DemoConfig(**{name: getattr(args, name) for name in given})


def summary(result: dict, cfg: DemoConfig, target: float = 0.8) -> str:
    """Plain-words summary: reward at the start and at the end, when the target was reached."""
    curve = result["reward_curve"]
    n = max(1, min(10, len(curve) // 4))
    start, end = sum(curve[:n]) / n, sum(curve[-n:]) / n
    goal = target * result["max_reward"]
    reached = next((i for i, r in enumerate(curve) if r >= goal), None)
    when = (
        f"first reached at iteration {reached + 1}"
        if reached is not None
        else "not reached (try more --iterations)"
    )
    return (
        f"mean reward {start:.3f} -> {end:.3f} (mean of the first / last {n} iterations; "
        f"max {result['max_reward']:.0f}, chance {chance_reward(cfg):.3f}) in {len(curve)} "
        f"iterations, {result['seconds']:.1f} s. Target {goal:.2f}: {when}."
    )


def save_plot(result: dict, cfg: DemoConfig, path: str) -> None:
    """Save the reward curve (mean reward per iteration) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = result["reward_curve"]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot(range(1, len(curve) + 1), curve, label="mean reward")
    ax.axhline(result["max_reward"], color="grey", lw=0.8, ls="--", label="max")
    ax.axhline(0.8 * result["max_reward"], color="tab:green", lw=0.8, ls="-.", label="target")
    ax.axhline(chance_reward(cfg), color="grey", lw=0.8, ls=":", label="chance")
    ax.set_xlabel("PPO iteration")
    ax.set_ylabel("reward")
    turns = ", multi-turn (tool output masked)" if cfg.multi_turn else ""
    ax.set_title(f"PPO: reverse {cfg.length} symbols (alphabet {cfg.symbols}){turns}", fontsize=10)
    ax.set_ylim(0, 1.05 * result["max_reward"])
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)  # beside the curve
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """``rlops demo``: train, print a summary, optionally save the plot and the JSON."""
    cfg = config_from_args(args)
    try:
        check_config(cfg)
    except ValueError as err:
        print(f"rlops demo: error: {err}", file=sys.stderr)
        return 2
    mode = "multi-turn: the second half arrives as tool output" if cfg.multi_turn else "one turn"
    say(
        f"PPO on a tiny transformer: reverse strings of {cfg.length} symbols out of "
        f"{cfg.symbols} ({mode}); {cfg.iterations} iterations of {cfg.batch} rollouts."
    )
    with Progress(cfg.iterations, "PPO", keep=True) as progress:
        result = train(
            cfg,
            lambda i, s: progress.update(
                f"reward {s['reward']:.3f}  KL {s['kl']:.3f}  entropy {s['entropy']:.3f}"
            ),
        )
    say(*wrap(summary(result, cfg)))
    if args.plot:
        save_plot(result, cfg, args.plot)
        say(f"reward curve saved to {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        say(f"reward curve written to {args.json}")
    return 0
