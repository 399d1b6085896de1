"""A tiny causal transformer with a policy head and a value head, for ``rlops demo | profile``.

Torch only, random initialisation, no downloads. Pre-norm blocks (causal self-attention through
``torch.nn.functional.scaled_dot_product_attention``, then an MLP), learned absolute positions,
a final norm, an output head over the vocabulary (the policy's logits) and a scalar value head.

Sampling recomputes the whole prefix at every step instead of keeping a KV cache: the demo's
sequences are a few dozen tokens long, where one batched forward costs about as much as the
bookkeeping of a cache would, and recomputation lets an environment splice its own tokens
(tool output) into the sequence between two calls without any cache surgery.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ModelConfig", "TinyTransformer", "sample"]


@dataclasses.dataclass
class ModelConfig:
    """Sizes of :class:`TinyTransformer`."""

    vocab: int = 16
    context: int = 32  # longest sequence (prompt + response) the position table covers
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    mlp_ratio: int = 4


class SelfAttention(nn.Module):
    """Multi-head causal self-attention."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.d_model % cfg.n_heads:
            raise ValueError(f"d_model={cfg.d_model} is not a multiple of n_heads={cfg.n_heads}")
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.attn = SelfAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        hidden = cfg.mlp_ratio * cfg.d_model
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, hidden), nn.GELU(), nn.Linear(hidden, cfg.d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """Decoder-only transformer: tokens ``[B, T]`` -> logits ``[B, T, V]`` and values ``[B, T]``.

    Position ``t``'s logits are the policy's distribution over token ``t + 1``, and its value
    is the value of the state in which that token is chosen. The three stages are exposed
    separately (:meth:`trunk`, :meth:`logits`, :meth:`values`) so that they can be timed apart.

    Example:
        >>> import torch
        >>> model = TinyTransformer(ModelConfig(vocab=5, context=8))
        >>> logits, values = model(torch.zeros(2, 3, dtype=torch.long))
        >>> logits.shape, values.shape
        (torch.Size([2, 3, 5]), torch.Size([2, 3]))
        >>> sample(model, torch.zeros(2, 3, dtype=torch.long), 4).shape
        torch.Size([2, 7])
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.value_head = nn.Linear(cfg.d_model, 1)
        self.apply(self._init)
        nn.init.zeros_(self.value_head.weight)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def trunk(self, tokens: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states ``[B, T, d_model]``."""
        t = tokens.shape[1]
        if t > self.cfg.context:
            raise ValueError(f"sequence of {t} tokens exceeds the context of {self.cfg.context}")
        x = self.tok_emb(tokens) + self.pos_emb(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Policy logits ``[B, T, V]`` from hidden states."""
        return self.head(hidden)

    def values(self, hidden: torch.Tensor) -> torch.Tensor:
        """Value estimates ``[B, T]`` from hidden states."""
        return self.value_head(hidden).squeeze(-1)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits [B, T, V], values [B, T])``."""
        hidden = self.trunk(tokens)
        return self.logits(hidden), self.values(hidden)


@torch.no_grad()
def sample(
    model: TinyTransformer,
    tokens: torch.Tensor,
    steps: int,
    *,
    temperature: float = 1.0,
    allowed: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Extend ``tokens [B, P]`` by ``steps`` tokens sampled from the model -> ``[B, P + steps]``.

    Each step samples from ``softmax(logits / temperature)``; ``allowed`` (a bool ``[V]``)
    restricts sampling to a subset of the vocabulary (the others get probability 0, so the
    same mask must be replayed when the log-probs are recomputed).
    """
    for _ in range(steps):
        logits = model.logits(model.trunk(tokens)[:, -1]).float() / temperature
        if allowed is not None:
            logits = logits.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        nxt = torch.multinomial(probs, 1, generator=generator)
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens
