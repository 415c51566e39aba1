"""Losses: MSE alignment; each next-token term against torch's own functions; the chunked stage-3 loss against a
direct full-logits computation (values and gradients), its KL convention, and its memory (live tensor bytes counted
through a dispatch mode)."""

from __future__ import annotations

import weakref
from types import SimpleNamespace
from typing import Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from harness.losses import (ALIGNMENT_LOSSES, TOKEN_LOSSES, ChunkedLoss, CrossEntropy, ForwardKL, ReverseKL,
                            alignment_l2, alignment_mse, distill_loss, head_matmuls, lm_loss, token_losses)
from harness.losses.kl_ce import ce_kl_rows_torch


def direct_distill(
    hs: Tensor, ht: Tensor, ws: Tensor, wt: Tensor, labels: Tensor, *, ce_weight: float, kl_weight: float,
    temperature: float, loss_mask: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The stage-3 loss written out: full [B, T, V] fp32 logits, shift, log_softmax, sum p (log p - log q)."""
    s = (hs.float() @ ws.float().T)[:, :-1]
    t = (ht.float() @ wt.float().T)[:, :-1]
    y = labels[:, 1:]
    keep = y != -100
    if loss_mask is not None:
        keep &= loss_mask[:, 1:].bool()
    ce = F.cross_entropy(s[keep], y[keep], reduction="sum") / keep.sum()
    log_q = F.log_softmax(s / temperature, dim=-1)
    log_p = F.log_softmax(t / temperature, dim=-1)
    kl_tok = (log_p.exp() * (log_p - log_q)).sum(-1)
    kl = kl_tok[keep].sum() / keep.sum() * temperature**2
    return ce_weight * ce + kl_weight * kl, ce, kl


def make_inputs(b=2, t=9, cs=16, ct=12, v=37, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(b, t, cs, generator=g).to(dtype).requires_grad_()
    ht = torch.randn(b, t, ct, generator=g).to(dtype)
    ws = (torch.randn(v, cs, generator=g) / cs**0.5).to(dtype).requires_grad_()
    wt = (torch.randn(v, ct, generator=g) / ct**0.5).to(dtype)
    labels = torch.randint(0, v, (b, t), generator=g)
    labels[0, 4] = labels[-1, 7] = -100
    return hs, ht, ws, wt, labels


def _grads(loss: Tensor, *tensors: Tensor) -> tuple[Tensor, ...]:
    return torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("chunk", [1, 5, 7, 64])  # 14 predicted tokens: 7 divides, 5 does not, 64 > n
@pytest.mark.parametrize("tau", [1.0, 2.0])
def test_chunked_equals_direct_values_and_grads(chunk, tau):
    hs, ht, ws, wt, labels = make_inputs()
    kw = dict(ce_weight=0.7, kl_weight=1.3, temperature=tau)
    out = distill_loss(hs, ht, ws, wt, labels, chunk_tokens=chunk, **kw)
    ref_total, ref_ce, ref_kl = direct_distill(hs, ht, ws, wt, labels, **kw)
    assert out.tokens == 14  # 2 x 8 predicted positions, minus the 2 ignored targets
    torch.testing.assert_close(out.ce, ref_ce.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.kl, ref_kl.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.total.detach(), ref_total.detach(), rtol=1e-5, atol=1e-6)
    assert not out.ce.requires_grad and not out.kl.requires_grad
    for got, want in zip(_grads(out.total, hs, ws), _grads(ref_total, hs, ws)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("weights", [(1.0, 0.0), (0.0, 1.0)])
def test_each_term_alone(weights):
    hs, ht, ws, wt, labels = make_inputs(seed=1)
    kw = dict(ce_weight=weights[0], kl_weight=weights[1], temperature=2.0)
    out = distill_loss(hs, ht, ws, wt, labels, chunk_tokens=4, **kw)
    ref_total, _, _ = direct_distill(hs, ht, ws, wt, labels, **kw)
    torch.testing.assert_close(out.total.detach(), ref_total.detach(), rtol=1e-5, atol=1e-6)
    for got, want in zip(_grads(out.total, hs, ws), _grads(ref_total, hs, ws)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_loss_mask_equals_ignored_labels_and_matches_direct():
    hs, ht, ws, wt, labels = make_inputs(seed=2)
    mask = torch.ones_like(labels, dtype=torch.bool)
    mask[:, :5] = False  # e.g. a prompt: its tokens are not targets
    kw = dict(ce_weight=1.0, kl_weight=1.0, temperature=1.0)
    masked = distill_loss(hs, ht, ws, wt, labels, loss_mask=mask, chunk_tokens=3, **kw)
    as_labels = distill_loss(hs, ht, ws, wt, labels.masked_fill(~mask, -100), chunk_tokens=3, **kw)
    ref_total, ref_ce, ref_kl = direct_distill(hs, ht, ws, wt, labels, loss_mask=mask, **kw)
    assert masked.tokens == as_labels.tokens == 7  # targets at positions 5..8, minus labels[1, 7] = -100
    torch.testing.assert_close(masked.total, as_labels.total)
    torch.testing.assert_close(masked.kl, ref_kl.detach(), rtol=1e-5, atol=1e-6)
    for got, want in zip(_grads(masked.total, hs, ws), _grads(ref_total, hs, ws)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("tau", [1.0, 2.0])
def test_kl_zero_for_identical_models_positive_otherwise(tau):
    hs, _, ws, _, labels = make_inputs(ct=16)
    same = distill_loss(hs, hs.detach(), ws, ws.detach(), labels, ce_weight=1, kl_weight=1, temperature=tau)
    assert abs(same.kl.item()) < 1e-6
    other = distill_loss(hs, hs.detach() * 1.5, ws, ws.detach(), labels, ce_weight=1, kl_weight=1,
                         temperature=tau)
    assert other.kl.item() > 1e-3


def test_kl_is_averaged_per_token_and_scaled_by_tau_squared():
    hs, ht, ws, wt, labels = make_inputs(b=1, t=12)
    labels[0, 0] = -100  # so position T-1 of the doubled row (which predicts labels[0, 0]) is ignored too
    kw = dict(ce_weight=1.0, kl_weight=1.0, chunk_tokens=5)
    once = distill_loss(hs, ht, ws, wt, labels, temperature=2.0, **kw)
    twice = distill_loss(torch.cat([hs, hs], 1), torch.cat([ht, ht], 1), ws, wt, torch.cat([labels, labels], 1),
                         temperature=2.0, **kw)
    assert twice.tokens == 2 * once.tokens
    torch.testing.assert_close(twice.kl, once.kl)
    torch.testing.assert_close(twice.ce, once.ce)
    # tau^2 times the per-token KL of the softened distributions, as written in the direct version
    s, t = (hs @ ws.T)[0, :-1] / 2, (ht @ wt.T)[0, :-1] / 2
    keep = labels[0, 1:] != -100
    per_token = F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(once.kl, 4 * per_token[keep].mean().detach(), rtol=1e-5, atol=1e-6)


def test_bf16_inputs_and_vocab_blocks_match_fp32(monkeypatch):
    monkeypatch.setattr(head_matmuls, "VOCAB_BLOCK", 8)  # 37 rows: blocks of 8 with a remainder of 5
    hs, ht, ws, wt, labels = make_inputs(seed=3, dtype=torch.bfloat16)
    kw = dict(ce_weight=1.0, kl_weight=1.0, temperature=2.0)
    out = distill_loss(hs, ht, ws, wt, labels, chunk_tokens=4, **kw)
    ref_total, _, _ = direct_distill(hs, ht, ws, wt, labels, **kw)  # fp32 math on the same bf16 values
    torch.testing.assert_close(out.total.detach(), ref_total.detach(), rtol=1e-5, atol=1e-6)
    g_hs, g_ws = _grads(out.total, hs, ws)
    r_hs, r_ws = _grads(ref_total, hs, ws)
    assert g_hs.dtype == g_ws.dtype == torch.bfloat16
    torch.testing.assert_close(g_hs.float(), r_hs.float(), rtol=1e-2, atol=1e-4)
    torch.testing.assert_close(g_ws.float(), r_ws.float(), rtol=1e-2, atol=1e-4)


def test_grad_output_scales_and_frozen_or_no_grad_cases():
    hs, ht, ws, wt, labels = make_inputs(seed=4)
    kw = dict(ce_weight=1.0, kl_weight=0.5, temperature=1.0, chunk_tokens=6)
    g1 = _grads(distill_loss(hs, ht, ws, wt, labels, **kw).total, hs, ws)
    g3 = _grads(distill_loss(hs, ht, ws, wt, labels, **kw).total / 3, hs, ws)
    for a, b in zip(g1, g3):
        torch.testing.assert_close(b, a / 3)
    frozen_head = distill_loss(hs, ht, ws.detach(), wt, labels, **kw)
    torch.testing.assert_close(_grads(frozen_head.total, hs)[0], g1[0])
    with torch.no_grad():
        out = distill_loss(hs, ht, ws, wt, labels, **kw)
    assert not out.total.requires_grad


def test_no_counted_token_gives_zero():
    hs, ht, ws, wt, labels = make_inputs()
    out = distill_loss(hs, ht, ws, wt, torch.full_like(labels, -100), ce_weight=1, kl_weight=1, temperature=1)
    assert out.tokens == 0 and out.total.item() == 0.0
    assert all(g.abs().sum() == 0 for g in _grads(out.total, hs, ws))


def test_rejects_mismatched_shapes():
    hs, ht, ws, wt, labels = make_inputs()
    with pytest.raises(ValueError, match="heads"):
        distill_loss(hs, ht, ws, wt[:-1], labels, ce_weight=1, kl_weight=1, temperature=1)
    with pytest.raises(ValueError, match="labels"):
        distill_loss(hs, ht, ws, wt, labels[:, :-1], ce_weight=1, kl_weight=1, temperature=1)


def test_alignment_l2_is_the_mean_per_token_norm_not_squared():
    pred = torch.zeros(2, 2, 2)
    target = torch.tensor([[[3.0, 4.0], [0.0, 1.0]], [[6.0, 8.0], [0.0, 0.0]]])
    assert alignment_l2(pred, target).item() == pytest.approx((5 + 1 + 10 + 0) / 4)
    assert alignment_l2(pred.bfloat16(), target.bfloat16()).dtype == torch.float32
    with pytest.raises(ValueError, match="differ"):
        alignment_l2(pred, target[:, :1])


def test_alignment_losses_are_the_configs_choices():
    from harness.config import ALIGN_LOSSES
    assert tuple(ALIGNMENT_LOSSES) == ALIGN_LOSSES


def test_alignment_mse_is_fp32_mean_over_everything():
    g = torch.Generator().manual_seed(0)
    pred, target = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)
    torch.testing.assert_close(alignment_mse(pred, target), ((pred - target) ** 2).mean())
    low = alignment_mse(pred.bfloat16(), target.bfloat16())
    assert low.dtype == torch.float32
    torch.testing.assert_close(low, ((pred.bfloat16().float() - target.bfloat16().float()) ** 2).mean())
    with pytest.raises(ValueError):
        alignment_mse(pred, target[:, :1])  # no silent broadcasting


# ------------------------------------------------------------------ the terms one by one


def chunk_logits(c=6, v=11, seed=5) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    s, t = 3 * torch.randn(c, v, generator=g), 3 * torch.randn(c, v, generator=g)
    return s, t, torch.randint(0, v, (c,), generator=g)


def direct_term(name: str, s: Tensor, t: Tensor, y: Tensor, tau: float) -> Tensor:
    """A term on each row, written out with torch's own functions (autograd gives its gradient)."""
    if name == "ce":
        return F.cross_entropy(s, y, reduction="none")
    log_q, log_p = F.log_softmax(s / tau, -1), F.log_softmax(t / tau, -1)
    if name == "reverse_kl":
        return F.kl_div(log_p, log_q, log_target=True, reduction="none").sum(-1) * tau**2  # sum q (log q - log p)
    return F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1) * tau**2  # sum p (log p - log q)


@pytest.mark.parametrize("name,tau", [("ce", 1.0), ("kl", 1.0), ("kl", 2.0), ("kl", 0.5), ("reverse_kl", 1.0),
                                      ("reverse_kl", 2.0), ("reverse_kl", 0.5)])
def test_each_token_term_gives_the_direct_rows_and_gradient_and_leaves_its_inputs(name, tau):
    s, t, y = chunk_logits()
    term = TOKEN_LOSSES[name](weight=0.3, temperature=tau)
    s_in, t_in = s.clone(), t.clone()
    total, grad = term.chunk(s_in, t_in, y, need_grad=True)
    assert torch.equal(s_in, s) and torch.equal(t_in, t)  # several terms read one chunk
    s_ref = s.clone().requires_grad_()
    ref = direct_term(name, s_ref, t, y, tau)
    torch.testing.assert_close(total, ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, torch.autograd.grad(ref.sum(), s_ref)[0], rtol=1e-5, atol=1e-6)  # unweighted
    assert term.chunk(s, t, y, need_grad=False)[1] is None


@pytest.mark.parametrize("tau", [1.0, 2.0])
def test_the_fused_pass_is_ce_plus_kl_term_by_term(tau):
    s, t, y = chunk_logits(seed=6)
    ce_sum, ce_g = CrossEntropy().chunk(s, t, y, True)
    kl_sum, kl_g = ForwardKL(temperature=tau).chunk(s, t, y, True)
    fused_ce, fused_kl, fused_g = ce_kl_rows_torch(s.clone(), t.clone(), y, tau, 0.7, 1.3, True)
    torch.testing.assert_close(fused_ce, ce_sum)
    torch.testing.assert_close(fused_kl, kl_sum)
    torch.testing.assert_close(fused_g, 0.7 * ce_g + 1.3 * kl_g)


@pytest.mark.parametrize("tau", [1.0, 2.0])
def test_reverse_kl_through_hidden_states_equals_the_direct_computation(tau):
    """reverse_kl + ce runs term by term; the logs still get ce and kl (at temperature 1: there is no kl term)."""
    hs, ht, ws, wt, labels = make_inputs(seed=7)
    out = ChunkedLoss([ReverseKL(0.8, tau), CrossEntropy(0.3)], chunk_tokens=5)(hs, ws, labels, ht, wt)
    s, t = (hs @ ws.T)[:, :-1], (ht @ wt.T)[:, :-1]
    keep = labels[:, 1:] != -100
    reverse = direct_term("reverse_kl", s[keep], t[keep], labels[:, 1:][keep], tau).sum() / keep.sum()
    _, ref_ce, ref_kl = direct_distill(hs, ht, ws, wt, labels, ce_weight=1, kl_weight=1, temperature=1.0)
    ref_total = 0.8 * reverse + 0.3 * ref_ce
    torch.testing.assert_close(out.total.detach(), ref_total.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.ce, ref_ce.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.kl, ref_kl.detach(), rtol=1e-5, atol=1e-6)
    assert reverse.item() > 1e-3 and abs(reverse.item() - ref_kl.item()) > 1e-3  # not the forward KL
    for got, want in zip(_grads(out.total, hs, ws), _grads(ref_total, hs, ws)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_term_by_term_equals_the_fused_pass():
    """A weight-0 reverse_kl beside kl and ce sends them term by term: the same loss as the fused pass."""
    hs, ht, ws, wt, labels = make_inputs(seed=8)
    fused = distill_loss(hs, ht, ws, wt, labels, ce_weight=0.7, kl_weight=1.3, temperature=2.0, chunk_tokens=4)
    terms = [ForwardKL(1.3, 2.0), CrossEntropy(0.7), ReverseKL(0.0, 2.0)]
    assert not ChunkedLoss(terms).fused
    each = ChunkedLoss(terms, chunk_tokens=4)(hs, ws, labels, ht, wt)
    assert list(each.terms) == ["kl", "ce", "reverse_kl"] and list(fused.terms) == ["kl", "ce"]
    for got, want in [(each.total, fused.total), (each.ce, fused.ce), (each.kl, fused.kl)]:
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6)
    for got, want in zip(_grads(each.total, hs, ws), _grads(fused.total, hs, ws)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_losses_are_a_mapping_of_every_measured_term():
    """LossTerms: `total` with the gradient, each term's detached per-token mean by name (the trained terms in their
    order, then ce and kl for the logs; kl only with a teacher), `stacked` in the order of `names`."""
    hs, ht, ws, wt, labels = make_inputs(seed=9)
    out = ChunkedLoss([ReverseKL(0.5, 2.0), ForwardKL(0.5)])(hs, ws, labels, ht, wt)
    assert out.names() == ("loss", "reverse_kl", "kl", "ce") and out.total.requires_grad
    assert not any(v.requires_grad for v in out.terms.values()) and out.reverse_kl is out.terms["reverse_kl"]
    torch.testing.assert_close(out.stacked(), torch.stack([out.total.detach(), *out.terms.values()]))
    torch.testing.assert_close(out.total.detach(), 0.5 * out.reverse_kl + 0.5 * out.kl)
    sft = lm_loss(hs, ws, labels)
    assert list(sft.terms) == ["ce"] and torch.equal(sft.total.detach(), sft.ce)  # no teacher: no kl
    with pytest.raises(AttributeError, match="no loss term 'jsd'"):
        sft.jsd


def test_a_registered_term_is_computed_and_reported_by_name():
    """register_token_loss adds a kind of term: ChunkedLoss runs it term by term and reports it under its name."""
    from harness.losses import register_token_loss
    from harness.losses.chunked import TOKEN_LOSSES as registry

    class HalfCE(CrossEntropy):
        name = "half_ce"

        def chunk(self, s, t, y, need_grad):
            total, grad = super().chunk(s, t, y, need_grad)
            return total / 2, None if grad is None else grad / 2

    assert register_token_loss(HalfCE) is HalfCE
    try:
        hs, ht, ws, wt, labels = make_inputs(seed=10)
        out = ChunkedLoss(token_losses([SimpleNamespace(name="half_ce", weight=1.0, temperature=1.0)]))(
            hs, ws, labels, ht, wt)
        assert list(out.terms) == ["half_ce", "ce", "kl"]
        torch.testing.assert_close(out.half_ce, out.ce / 2)
        with pytest.raises(ValueError, match="'half_ce' is registered already"):
            register_token_loss(type("Other", (HalfCE,), {}))
    finally:
        registry.pop("half_ce")


def test_terms_are_checked():
    hs, ht, ws, wt, labels = make_inputs()
    with pytest.raises(ValueError, match=r"each once; got \['ce', 'ce'\]"):
        ChunkedLoss([CrossEntropy(), CrossEntropy()])
    with pytest.raises(ValueError, match=r"\['kl'\] need the teacher"):
        ChunkedLoss([ForwardKL(), CrossEntropy()])(hs, ws, labels)
    with pytest.raises(ValueError, match="temperature 1"):
        CrossEntropy(temperature=2.0)
    with pytest.raises(ValueError, match="weight=-1"):
        ForwardKL(weight=-1.0)
    with pytest.raises(ValueError, match="'jsd' is not one of \\['ce', 'kl'"):
        token_losses([SimpleNamespace(name="jsd", weight=1.0, temperature=1.0)])
    made = token_losses([SimpleNamespace(name="kl", weight=2.0, temperature=3.0)])
    assert isinstance(made[0], ForwardKL) and (made[0].weight, made[0].temperature) == (2.0, 3.0)


# ------------------------------------------------------------------ memory


class LiveBytes(TorchDispatchMode):
    """Peak bytes of tensor storages allocated by ops run inside the mode (autograd's included) while they
    are alive. Outputs that alias an input (views, in-place ops) allocate nothing and are not counted.
    Deterministic: storages are freed by reference counting, seen through weakref finalizers."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: dict[int, weakref.finalize] = {}

    def _free(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._seen.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, Tensor):
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in inputs or key in self._seen:
                continue
            self._seen[key] = weakref.finalize(storage, self._free, key, nbytes)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        return out


def peak_bytes(fn: Callable[[], None]) -> int:
    mode = LiveBytes()
    with mode:
        fn()
    return mode.peak


def test_peak_memory_is_per_chunk_not_per_batch():
    b, t, c, v, chunk = 2, 512, 32, 4096, 64
    hs, ht, ws, wt, labels = make_inputs(b=b, t=t, cs=c, ct=c, v=v)
    kw = dict(ce_weight=1.0, kl_weight=1.0, temperature=2.0)
    logits_bytes = b * t * v * 4  # 16 MiB: one fp32 [B*T, V] tensor

    def chunked(hs=hs, ht=ht, labels=labels):
        distill_loss(hs, ht, ws, wt, labels, chunk_tokens=chunk, **kw).total.backward()

    def direct():
        direct_distill(hs, ht, ws, wt, labels, **kw)[0].backward()

    p_direct, p_chunk = peak_bytes(direct), peak_bytes(chunked)
    # longer input: only [n, C]-sized terms may grow, by far less than one more [n, V] logits tensor
    hs2, ht2 = torch.cat([hs, hs], 1).detach().requires_grad_(), torch.cat([ht, ht], 1)
    p_chunk_2t = peak_bytes(lambda: chunked(hs2, ht2, torch.cat([labels, labels], 1)))
    print(f"logits {logits_bytes / 2**20:.1f} MiB; peak direct {p_direct / 2**20:.1f} MiB, chunked "
          f"{p_chunk / 2**20:.1f} MiB, chunked at 2T {p_chunk_2t / 2**20:.1f} MiB")
    assert p_direct > 4 * logits_bytes
    per_chunk = chunk * v * 4
    assert p_chunk < 6 * per_chunk + 2 * v * c * 4 + 16 * b * t * c * 4
    assert p_chunk < p_direct / 10
    assert p_chunk_2t - p_chunk < 16 * b * t * c * 4 < logits_bytes / 4


def test_tf32_setting_is_set_inside_and_restored():
    from harness.losses import tf32_matmuls

    before = torch.backends.cuda.matmul.allow_tf32
    for enabled in (True, False):
        with tf32_matmuls(enabled):
            assert torch.backends.cuda.matmul.allow_tf32 is enabled
        assert torch.backends.cuda.matmul.allow_tf32 is before
    with pytest.raises(RuntimeError), tf32_matmuls(not before):
        raise RuntimeError("restored on errors too")
    assert torch.backends.cuda.matmul.allow_tf32 is before


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_repeated_ngrams_are_the_ngrams_seen_before_in_the_row(n):
    from harness.losses.token_weights import copy_token_weights, repeated_ngrams

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 6, (3, 40), generator=g)  # a small vocabulary: many repeats
    ids[2, :20] = ids[2, 20:]  # a copied half
    ids[1, 5] = 70_000  # ids past a 16-bit vocabulary
    got = repeated_ngrams(ids, n)
    for r in range(ids.shape[0]):
        row = ids[r].tolist()
        grams = [tuple(row[j - n + 1:j + 1]) for j in range(len(row))]
        want = [j >= n - 1 and grams[j] in grams[n - 1:j] for j in range(len(row))]
        assert got[r].tolist() == want
    assert got[2, 20 + n - 1:].all()  # every n-gram of the copy after its first n - 1 tokens was seen before
    weights = copy_token_weights(ids, 3.0, n)
    assert set(weights[got].tolist()) == {3.0} and set(weights[~got].tolist()) == {1.0}


@pytest.mark.parametrize("terms", [("kl", "ce"), ("kl", "ce", "reverse_kl")])  # fused pass; term by term
def test_token_weights_weight_the_total_and_leave_the_reported_means(terms):
    """total = sum_i w_i sum_k weight_k term_k(i) / n, written out with torch's own functions; the reported terms are
    the unweighted means; all-ones weights give exactly the unweighted loss."""
    hs, ht, ws, wt, labels = make_inputs(seed=12)
    weights = {"kl": 0.8, "ce": 0.5, "reverse_kl": 0.3}
    loss = ChunkedLoss([TOKEN_LOSSES[name](weights[name], 2.0 if name != "ce" else 1.0) for name in terms],
                       chunk_tokens=5)
    w = 1 + torch.rand(labels.shape, generator=torch.Generator().manual_seed(1)) * 3
    got = loss(hs, ws, labels, ht, wt, token_weight=w)
    gh, gw = _grads(got.total, hs, ws)

    keep = labels[:, 1:] != -100
    s, t = (hs[:, :-1] @ ws.T)[keep], (ht[:, :-1] @ wt.T)[keep]
    y, row_w, n = labels[:, 1:][keep], w[:, 1:][keep], int(keep.sum())
    per_row = {"ce": F.cross_entropy(s, y, reduction="none"),
               "kl": 4 * (F.softmax(t / 2, -1) * (F.log_softmax(t / 2, -1) - F.log_softmax(s / 2, -1))).sum(-1),
               "reverse_kl": 4 * (F.softmax(s / 2, -1) * (F.log_softmax(s / 2, -1) - F.log_softmax(t / 2, -1))).sum(-1)}
    want = sum(weights[name] * (row_w * per_row[name]).sum() / n for name in terms)
    torch.testing.assert_close(got.total, want, rtol=1e-5, atol=1e-6)
    for name in terms:
        torch.testing.assert_close(got.terms[name], per_row[name].mean().detach(), rtol=1e-5, atol=1e-6)
    for a, b in zip((gh, gw), _grads(want, hs, ws)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)

    plain, ones = loss(hs, ws, labels, ht, wt), loss(hs, ws, labels, ht, wt, token_weight=torch.ones_like(w))
    assert torch.equal(plain.total, ones.total) and torch.equal(plain.stacked(), ones.stacked())
