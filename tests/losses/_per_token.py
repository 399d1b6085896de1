"""A per-token loss written one token at a time, in the arithmetic of the references
(:class:`tests.losses._references.Exact` or ``Same``)."""

from __future__ import annotations

__all__ = ["per_token"]


def per_token(term, logp, old, adv, mask, num):
    """``[B][T]``: ``term(log π, log π_old, A)`` (each converted by ``num``) on the action
    tokens, ``num.zero`` elsewhere."""
    c = num.conv
    b, t = logp.shape
    out = [[num.zero for _ in range(t)] for _ in range(b)]
    for i in range(b):
        for j in range(t):
            if mask[i, j]:
                out[i][j] = term(c(logp[i, j]), c(old[i, j]), c(adv[i, j]))
    return out
