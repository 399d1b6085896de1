"""``logits_dtype=torch.float32``: bfloat16 operands, float32 logits, never rounded to 16 bits.

Every expected value is the definition in float64 on the *same* bfloat16 operands
(``hidden.double() @ weight.double().T``, then the head's map and the log-softmax over the
support): with float32 logits the log-probs and entropies are within the suite's rule of the
plain float32 reference (and within 2e-5), while the default, whose logits are rounded to
bfloat16, is about 1e-2 away. Gradients are compared with autograd through the float64
definition, within 3x the rounding of that gradient to bfloat16 (the dtype they are returned
in)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from tests._distributed import run_distributed
from tests.tolerances import assert_error_within, max_abs_err
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import rlops
from rlops.compat.trl import GRPOMixin
from rlops.compat.trl._head import _linear_head

H = 64
BF16 = torch.bfloat16
F32 = torch.float32
# The figure asked of float32 logits: log-probs within 2e-5 of the float64 definition.
FIGURE = 2e-5


def _operands(n: int, v: int, seed: int, h: int = H):
    """bfloat16 hidden states and weight whose logits spread like a model's (std ~4)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen).to(BF16)
    weight = (torch.randn(v, h, generator=gen) * 4 / h**0.5).to(BF16)
    target = torch.randint(0, v, (n,), generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(2)]
    return hidden, weight, target, grads


def _sampler_keep(z: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """The sampler's support on ``z`` ``[N, V]``: the logits at or above the k-th largest,
    then on the distribution renormalised over those the smallest prefix (sorted descending)
    whose mass reaches ``top_p``, the crossing token and every tie kept."""
    keep = torch.ones_like(z, dtype=torch.bool)
    if top_k is not None:
        keep = z >= z.topk(top_k, dim=-1).values[:, -1:]
    if top_p is not None:
        p = torch.softmax(z.masked_fill(~keep, float("-inf")), dim=-1)
        ps, order = p.sort(dim=-1, descending=True)
        before = ps.cumsum(dim=-1) - ps  # the mass strictly before each sorted token
        last = (before < top_p).sum(dim=-1, keepdim=True) - 1  # the crossing token
        keep = keep & (z >= z.gather(1, order.gather(1, last)))
    return keep


def _definition(hidden, weight, target, *, keep=None, sampler=None, temperature=1.0,
                scale=1.0, softcap=None, dtype=torch.float64):  # fmt: skip
    """``(logp, entropy)`` from ``x = hidden @ weightᵀ`` in ``dtype``:
    ``z = c·tanh(s·x / c) / τ``, the log-prob renormalised over the support (the target always
    kept), the entropy over every logit. Differentiable in ``hidden`` and ``weight``."""
    x = hidden.to(dtype) @ weight.to(dtype).T
    u = x * scale
    z = (softcap * torch.tanh(u / softcap) if softcap is not None else u) / temperature
    if sampler is not None:
        keep = _sampler_keep(z.detach(), *sampler)
    log_p = torch.log_softmax(z, dim=-1)
    entropy = -(log_p.exp() * log_p).sum(dim=-1)
    if keep is not None:
        keep = keep.scatter(1, target[:, None], True)
        z = z.masked_fill(~keep, float("-inf"))
    logp = torch.log_softmax(z, dim=-1).gather(1, target[:, None])[:, 0]
    return logp, entropy


def _forward_backward(hidden, weight, target, grads, **kw):
    """The linear op's ``(logp, entropy, hidden.grad, weight.grad)``."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, ent = rlops.linear_logprobs_and_entropy(h, w, target, **kw)
    (logp * grads[0] + ent * grads[1]).sum().backward()
    return logp, ent, h.grad, w.grad


def _exact_grads(hidden, weight, target, grads, **kw):
    """The float64 definition's outputs and gradients on the same bfloat16 operands."""
    h = hidden.double().requires_grad_()
    w = weight.double().requires_grad_()
    logp, ent = _definition(h, w, target, **kw)
    (logp * grads[0].double() + ent * grads[1].double()).sum().backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


def _assert_float32_logits(name, out, oracle, ref32):
    """``out`` within the rule of the float32 reference ``ref32`` and within the figure."""
    err = max_abs_err(out, oracle)
    magnitude = float(oracle.abs().max())
    assert_error_within(name, err, max_abs_err(ref32, oracle), F32, magnitude)
    assert err <= FIGURE, f"{name}: {err:.3g} > {FIGURE}"


def _assert_grads(name, got, exact):
    """Each gradient within 3x the rounding of the exact one to bfloat16 (plus 4 ulps)."""
    for part, g, e in zip(("hidden", "weight"), got, exact, strict=True):
        assert g.dtype == BF16
        rounding = max_abs_err(e.to(BF16), e)
        magnitude = float(e.abs().max())
        what = "rounding to bfloat16 of the exact gradient"
        err = max_abs_err(g, e)
        assert_error_within(f"{name} {part}.grad", err, rounding, BF16, magnitude, 3.0, what)


@pytest.mark.parametrize("v", [1000, 4099])
@pytest.mark.parametrize("n", [1, 127, 129])
def test_float32_logits_match_the_float64_definition(n, v):
    hidden, weight, target, grads = _operands(n, v, seed=n * v)
    lp64, ent64, gh, gw = _exact_grads(hidden, weight, target, grads)
    lp32, ent32 = _definition(hidden, weight, target, dtype=F32)  # the plain float32 reference
    logp, ent, h_grad, w_grad = _forward_backward(hidden, weight, target, grads, logits_dtype=F32)
    assert logp.dtype == ent.dtype == F32
    _assert_float32_logits("logp", logp, lp64, lp32)
    _assert_float32_logits("entropy", ent, ent64, ent32)
    _assert_grads("float32 logits", (h_grad, w_grad), (gh, gw))
    # what the option buys: the default rounds the logits to bfloat16, ~1e-2 away
    default, default_ent = rlops.linear_logprobs_and_entropy(hidden, weight, target)
    assert max_abs_err(default, lp64) > 50 * max(max_abs_err(logp, lp64), 1e-7)
    assert max_abs_err(default, lp64) > 1e-3 and max_abs_err(default_ent, ent64) > 1e-3


def test_the_default_is_unchanged():
    """``logits_dtype=None`` (and float32 on float32 inputs) is the call without it, bit for
    bit; the default equals the definition on logits rounded to bfloat16."""
    hidden, weight, target, grads = _operands(129, 4099, seed=3)
    base = _forward_backward(hidden, weight, target, grads)
    for a, b in zip(base, _forward_backward(hidden, weight, target, grads, logits_dtype=None),
                    strict=True):  # fmt: skip
        assert torch.equal(a, b)
    h32, w32 = hidden.float(), weight.float()
    grads32 = [g.clone() for g in grads]
    plain = _forward_backward(h32, w32, target, grads32)
    same = _forward_backward(h32, w32, target, grads32, logits_dtype=F32)
    for a, b in zip(plain, same, strict=True):
        assert torch.equal(a, b)
    rounded = (hidden @ weight.T).double()  # the logits as a bfloat16 output layer makes them
    lp_bf16, ent_bf16 = _definition(rounded, torch.eye(rounded.shape[1]), target)
    assert max_abs_err(base[0], lp_bf16) <= 1e-5 and max_abs_err(base[1], ent_bf16) <= 1e-5


@pytest.mark.parametrize(
    "sampler", [(50, None), (None, 0.9), (40, 0.8)], ids=["top_k", "top_p", "top_k+top_p"]
)
def test_float32_logits_under_the_sampler(sampler):
    hidden, weight, target, grads = _operands(129, 4099, seed=11)
    top_k, top_p = sampler
    exact = _exact_grads(hidden, weight, target, grads, sampler=sampler)
    lp32, ent32 = _definition(hidden, weight, target, sampler=sampler, dtype=F32)
    kw = {"top_k": top_k, "top_p": top_p, "chunk_size": 48}  # several chunks, a partial last
    logp, ent, h_grad, w_grad = _forward_backward(
        hidden, weight, target, grads, logits_dtype=F32, **kw
    )
    _assert_float32_logits("logp", logp, exact[0], lp32)
    _assert_float32_logits("entropy", ent, exact[1], ent32)
    _assert_grads("sampler", (h_grad, w_grad), exact[2:])
    default, _ = rlops.linear_logprobs_and_entropy(hidden, weight, target, **kw)
    assert max_abs_err(default, exact[0]) > 10 * max_abs_err(logp, exact[0])


@pytest.mark.parametrize("form", ["keep_mask", "csr"])
def test_float32_logits_over_a_keep_mask_or_csr_sets(form):
    n, v = 127, 1000
    hidden, weight, target, grads = _operands(n, v, seed=5)
    keep = torch.rand(n, v, generator=torch.Generator().manual_seed(6)) < 0.3
    if form == "keep_mask":
        kw = {"keep_mask": keep}
    else:
        ids = keep.nonzero()[:, 1]
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), keep.sum(1).cumsum(0)])
        kw = {"support_ids": ids, "support_offsets": offsets}
    exact = _exact_grads(hidden, weight, target, grads, keep=keep)
    lp32, ent32 = _definition(hidden, weight, target, keep=keep, dtype=F32)
    logp, ent, h_grad, w_grad = _forward_backward(
        hidden, weight, target, grads, logits_dtype=F32, **kw
    )
    _assert_float32_logits("logp", logp, exact[0], lp32)
    _assert_float32_logits("entropy", ent, exact[1], ent32)
    _assert_grads(form, (h_grad, w_grad), exact[2:])


def test_float32_logits_through_the_heads_map_and_a_row_mask():
    """Scale, softcap and temperature on the float32 logits; masked rows exactly 0."""
    n, v = 129, 4099
    hidden, weight, target, grads = _operands(n, v, seed=9)
    head = {"temperature": 0.7, "scale": 1.5, "softcap": 5.0}
    exact = _exact_grads(hidden, weight, target, grads, **head)
    lp32, ent32 = _definition(hidden, weight, target, dtype=F32, **head)
    kw = {"temperature": 0.7, "logit_scale": 1.5, "final_logit_softcapping": 5.0}
    logp, ent, h_grad, w_grad = _forward_backward(
        hidden, weight, target, grads, logits_dtype=F32, **kw
    )
    _assert_float32_logits("logp", logp, exact[0], lp32)
    _assert_float32_logits("entropy", ent, exact[1], ent32)
    _assert_grads("head", (h_grad, w_grad), exact[2:])
    mask = torch.arange(n) % 3 != 0
    masked, _ = rlops.linear_logprobs_and_entropy(
        hidden, weight, target, logits_dtype=F32, mask=mask, **kw
    )
    assert torch.equal(masked[~mask], torch.zeros(int((~mask).sum())))
    _assert_float32_logits("masked logp", masked[mask], exact[0][mask], lp32[mask])


def test_double_backward_on_float32_logits():
    """``create_graph=True`` recomputes the float32 logits differentiably: the first-order
    gradients within the rule, and a second order through them."""
    hidden, weight, target, grads = _operands(37, 1000, seed=14)
    exact = _exact_grads(hidden, weight, target, grads)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, ent = rlops.linear_logprobs_and_entropy(h, w, target, logits_dtype=F32)
    loss = (logp * grads[0] + ent * grads[1]).sum()
    h_grad, w_grad = torch.autograd.grad(loss, (h, w), create_graph=True)
    _assert_grads("create_graph", (h_grad, w_grad), exact[2:])
    (second,) = torch.autograd.grad(h_grad.float().square().sum(), w)
    assert second.shape == w.shape and bool(second.isfinite().all()) and bool(second.any())


def test_float32_logits_from_float16_operands():
    hidden, weight, target, _ = _operands(129, 4099, seed=13)
    hidden, weight = hidden.half(), weight.half()
    lp64, ent64 = _definition(hidden, weight, target)
    lp32, ent32 = _definition(hidden, weight, target, dtype=F32)
    logp, ent = rlops.linear_logprobs_and_entropy(hidden, weight, target, logits_dtype=F32)
    _assert_float32_logits("logp", logp, lp64, lp32)
    _assert_float32_logits("entropy", ent, ent64, ent32)


def test_float64_logits_from_bfloat16_operands():
    hidden, weight, target, _ = _operands(33, 1000, seed=2)
    logp, ent = rlops.linear_logprobs_and_entropy(
        hidden, weight, target, logits_dtype=torch.float64
    )
    lp64, ent64 = _definition(hidden, weight, target)
    assert logp.dtype == torch.float64
    assert max_abs_err(logp, lp64) <= 1e-12 and max_abs_err(ent, ent64) <= 1e-12


class _LargestWithH(TorchDispatchMode):
    """The most elements of any float32 tensor with a dimension of the hidden size ``h`` that
    an operation makes (a copy of the weight would be one of ``[V, h]``)."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.h, self.largest = h, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype == F32 and self.h in t.shape:
                self.largest = max(self.largest, t.numel())
        return out


def test_no_float32_copy_of_the_weight():
    """The forward never holds the weight in float32: a block of its rows at a time."""
    h, v = 256, 40_000  # a 41 MB float32 copy; blocks of 8 MiB
    hidden, weight, target, _ = _operands(33, v, seed=4, h=h)
    with _LargestWithH(h) as seen:
        rlops.linear_logprobs_and_entropy(hidden, weight, target, logits_dtype=F32)
    assert 0 < seen.largest <= (8 << 20) // 4 < v * h


@pytest.mark.parametrize(
    "bad", [torch.float16, torch.bfloat16, torch.int32, "float32", 32], ids=repr
)
def test_a_bad_logits_dtype_is_a_value_error_naming_it(bad):
    hidden, weight, target, _ = _operands(3, 10, seed=0)
    with pytest.raises(ValueError, match="logits_dtype"):
        rlops.linear_logprobs_and_entropy(hidden, weight, target, logits_dtype=bad)
    with pytest.raises(ValueError, match="logits_dtype"):
        rlops.logprobs_and_entropy(hidden @ weight.T, target, logits_dtype=bad)


def test_on_logits_it_can_only_widen_the_softmax():
    """The op on logits reads logits that exist: float32 changes nothing for bfloat16 logits
    (their softmax is float32 already); float64 runs it in float64."""
    hidden, weight, target, _ = _operands(129, 1000, seed=8)
    logits = hidden @ weight.T
    base = rlops.logprobs_and_entropy(logits, target)
    same = rlops.logprobs_and_entropy(logits, target, logits_dtype=F32)
    assert all(torch.equal(a, b) for a, b in zip(base, same, strict=True))
    logp, ent = rlops.logprobs_and_entropy(logits, target, logits_dtype=torch.float64, top_k=20)
    want, want_ent = _definition(logits, torch.eye(1000), target, sampler=(20, None))
    assert logp.dtype == torch.float64
    assert max_abs_err(logp, want) <= 1e-12 and max_abs_err(ent, want_ent) <= 1e-12


# --------------------------------------------------------------------------- vocabulary-parallel
_TP = {"n": 129, "v": 4099, "seed": 21}
_TP_CASES = {"plain": {}, "top_p": {"top_p": 0.9}}


def _tp_rank(rank: int, world: int) -> dict:
    """This rank's results on its contiguous shard of the weight's rows."""
    hidden, weight, target, grads = _operands(_TP["n"], _TP["v"], _TP["seed"])
    size = -(-_TP["v"] // world)
    rows = slice(rank * size, min((rank + 1) * size, _TP["v"]))
    out = {}
    for name, kw in _TP_CASES.items():
        out[name] = _forward_backward(
            hidden, weight[rows], target, grads, logits_dtype=F32, group=dist.group.WORLD, **kw
        )
    try:  # rank 1 asks for bfloat16 logits: every rank raises, naming the option
        rlops.linear_logprobs_and_entropy(
            hidden, weight[rows], target, logits_dtype=F32 if rank == 0 else None,
            group=dist.group.WORLD,
        )  # fmt: skip
    except ValueError as exc:
        out["mismatch"] = str(exc)
    return out


def test_vocabulary_parallel_float32_logits():
    ranks = run_distributed(_tp_rank, 2, timeout=120)
    hidden, weight, target, grads = _operands(_TP["n"], _TP["v"], _TP["seed"])
    for name, kw in _TP_CASES.items():
        sampler = (None, kw["top_p"]) if kw else None
        exact = _exact_grads(hidden, weight, target, grads, sampler=sampler)
        lp32, ent32 = _definition(hidden, weight, target, sampler=sampler, dtype=F32)
        for r in ranks:  # every rank returns the full results
            _assert_float32_logits(f"{name} logp", r[name][0], exact[0], lp32)
            _assert_float32_logits(f"{name} entropy", r[name][1], exact[1], ent32)
        # the hidden gradient is the sum of the ranks' partial ones (one more rounding)
        h_grad = sum(r[name][2].double() for r in ranks).to(BF16)
        w_grad = torch.cat([r[name][3] for r in ranks])
        _assert_grads(f"tp {name}", (h_grad, w_grad), exact[2:])
    assert all("logits_dtype" in r.get("mismatch", "") for r in ranks)


# --------------------------------------------------------------------------- TRL's float32 head
class _TinyModel(torch.nn.Module):
    """A bfloat16 embedding as the backbone and a bfloat16 output layer."""

    def __init__(self, v: int, h: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Embedding(v, h, dtype=BF16)
        self.lm_head = torch.nn.Linear(h, v, bias=False, dtype=BF16)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(v, h, generator=gen))
            self.lm_head.weight.copy_(torch.randn(v, h, generator=gen) * 4 / h**0.5)
        self.config = SimpleNamespace(get_text_config=SimpleNamespace)  # no scale, no softcap

    def get_output_embeddings(self) -> torch.nn.Linear:
        return self.lm_head

    def forward(self, input_ids, **_):
        return SimpleNamespace(hidden_states=(self.embed(input_ids),))


@pytest.fixture
def spied(monkeypatch):
    """The calls of ``rlops.linear_logprobs_and_entropy``: ``(weight, logits_dtype)``."""
    calls = []
    op = rlops.linear_logprobs_and_entropy

    def spy(hidden, weight, target, **kw):
        calls.append((weight, kw.get("logits_dtype")))
        return op(hidden, weight, target, **kw)

    monkeypatch.setattr(rlops, "linear_logprobs_and_entropy", spy)
    return calls


def test_trl_cast_lm_head_to_fp32_maps_to_float32_logits(spied):
    """The mixin's log-probs under ``cast_lm_head_to_fp32=True`` on a bfloat16 head: float32
    logits from the parameter itself (no float32 copy), within the figure of the definition."""
    v, k = 1000, 6
    model = _TinyModel(v, H)
    trainer = SimpleNamespace(
        _rlops_use_trl=False, _entropy_bonus_enabled=False, temperature=0.9,
        args=SimpleNamespace(cast_lm_head_to_fp32=True),
        accelerator=SimpleNamespace(unwrap_model=lambda m: m, autocast=contextlib.nullcontext),
    )  # fmt: skip
    ids = torch.randint(0, v, (3, 11), generator=torch.Generator().manual_seed(1))
    am = torch.ones_like(ids)
    lp, ent, _ = GRPOMixin._get_per_token_logps_and_entropies(
        trainer, model, ids, am, k, compute_entropy=True
    )
    ((weight, logits_dtype),) = spied
    assert weight is model.lm_head.weight and logits_dtype == F32
    hidden = model.embed(ids)[:, -k - 1 : -1].reshape(-1, H)
    want, want_ent = _definition(hidden, model.lm_head.weight, ids[:, -k:].reshape(-1),
                                 temperature=0.9)  # fmt: skip
    assert max_abs_err(lp.reshape(-1), want) <= FIGURE
    assert max_abs_err(ent.reshape(-1), want_ent) <= FIGURE


def test_trls_fused_head_in_float32_on_a_half_weight(spied):
    """TRL's fused head with ``cast_lm_head_to_fp32`` passes float32 hidden states with
    autocast off: on a bfloat16 weight, float32 logits without a float32 copy of it; under
    autocast, the head in the weight's dtype as before."""
    hidden, weight, target, _ = _operands(37, 1000, seed=12)
    lp, ent, *rest = _linear_head(hidden.float(), weight, None, target, 1.0, 4096,
                                  outputs=("log_probs", "entropy"))  # fmt: skip
    assert spied[-1] == (weight, F32) and rest == [None, None, None]
    want, want_ent = _definition(hidden, weight, target)
    assert max_abs_err(lp, want) <= FIGURE and max_abs_err(ent, want_ent) <= FIGURE
    with torch.autocast("cpu", dtype=BF16):
        _linear_head(hidden.float(), weight, None, target, 1.0, 4096)
    assert spied[-1][1] is None


def test_float32_logits_under_torch_compile():
    """The option traces whole (``fullgraph=True``) and gives eager's values and gradients."""
    hidden, weight, target, grads = _operands(9, 257, seed=11)

    def loss(h, w):
        logp, ent = rlops.linear_logprobs_and_entropy(h, w, target, logits_dtype=F32, top_p=0.9)
        return (logp * grads[0] + ent * grads[1]).sum()

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    torch._dynamo.reset()
    got = torch.compile(loss, backend="aot_eager", fullgraph=True)(h, w)
    g_got = torch.autograd.grad(got, (h, w))
    want = loss(h, w)
    g_want = torch.autograd.grad(want, (h, w))
    torch.testing.assert_close(got, want)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b)
