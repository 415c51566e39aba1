"""Next-token losses from final hidden states, a chunk of predicted tokens at a time: `ChunkedLoss`, the weighted
sum of `TokenLoss` terms that stage 3 (`distill_loss`: CE + KL) and SFT (`lm_loss`: CE alone) train on.

Nothing builds fp32 logits for the whole batch: the loss takes the final (post-norm) hidden states and the heads'
weights, and computes logits, losses and the logits' gradient for `chunk_tokens` predicted tokens at a time (a
custom autograd function that produces the gradient in the forward pass, as Liger's and fla's fused linear losses
do, so nothing is recomputed in backward). When the terms are `ce` and `kl`, one fused pass computes both
(kl_ce.py; a Triton kernel on CUDA); any other set of terms runs term by term, each on the same chunk's logits.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from harness import loss_kernel
from harness.losses.base import IGNORE_INDEX, TokenLoss
from harness.losses.ce import CrossEntropy
from harness.losses.head_matmuls import add_weight_grad, grad_input, logits, loss_matmuls
from harness.losses.kl import ForwardKL, ReverseKL
from harness.losses.kl_ce import ce_kl_rows

TOKEN_LOSSES: dict[str, type[TokenLoss]] = {cls.name: cls for cls in (ForwardKL, ReverseKL, CrossEntropy)}
FUSED = frozenset({"ce", "kl"})  # the terms kl_ce.ce_kl_rows computes in one pass


def register_token_loss(cls: type[TokenLoss]) -> type[TokenLoss]:
    """Add a kind of term to TOKEN_LOSSES under its `name` (usable as a class decorator). `ChunkedLoss` computes it
    term by term, and the training loop logs it under that name (metrics.jsonl, TensorBoard, `val_<name>`). A job
    config names a term only once its name is also in `harness.config_choices.DistillLoss`."""
    if TOKEN_LOSSES.get(cls.name, cls) is not cls:
        raise ValueError(f"a token loss named '{cls.name}' is registered already ({TOKEN_LOSSES[cls.name].__name__})")
    TOKEN_LOSSES[cls.name] = cls
    return cls


def token_losses(specs: Iterable[Any]) -> list[TokenLoss]:
    """The terms of config entries that have a name, a weight and a temperature (stages.distill.losses)."""
    terms = []
    for spec in specs:
        if spec.name not in TOKEN_LOSSES:
            raise ValueError(f"token loss '{spec.name}' is not one of {sorted(TOKEN_LOSSES)}")
        terms.append(TOKEN_LOSSES[spec.name](spec.weight, spec.temperature))
    return terms


def kl_and_ce(ce_weight: float, kl_weight: float, temperature: float) -> list[TokenLoss]:
    """Stage 3's two terms: kl_weight * tau^2 KL(teacher || student) at tau = temperature, plus ce_weight * CE."""
    return [ForwardKL(kl_weight, temperature), CrossEntropy(ce_weight)]


class LossTerms(NamedTuple):
    """What a next-token loss returns. `total` (the weighted sum of the trained terms) carries the gradient; `terms`
    maps each measured term's name to its per-token mean (detached fp32 scalars: every trained term, and ce and kl
    for the logs where they are not trained, kl only with a teacher); `tokens` is the number of predicted tokens
    they average over (for token-weighted averaging across ranks or micro-batches). `losses.ce` reads
    `losses.terms["ce"]`. A NamedTuple, so that torch's pytree (DDP's and FSDP's output hooks) finds `total`."""

    total: Tensor
    terms: dict[str, Tensor]
    tokens: int

    def __getattr__(self, name: str) -> Tensor:
        try:
            return self.terms[name]
        except KeyError:
            raise AttributeError(f"no loss term '{name}' (measured: {', '.join(self.terms)})") from None

    def names(self) -> tuple[str, ...]:
        """'loss' (the total), then the terms' names: the order of `stacked`."""
        return ("loss", *self.terms)

    def stacked(self) -> Tensor:
        """[total, *terms] as one detached fp32 vector on their device (one tensor to reduce and read at once)."""
        return torch.stack([self.total.detach(), *self.terms.values()])


class ChunkedLoss:
    """total = sum_k weight_k * term_k over `terms`, each term averaged over the predicted tokens.

    Called as loss(hidden, head_weight, labels, teacher_hidden=None, teacher_head_weight=None, loss_mask=None):
    hidden [B, T, Cs] and teacher_hidden [B, T, Ct] are final hidden states (after the final norm);
    head_weight [V, Cs] and teacher_head_weight [V, Ct] the heads (no bias; under ZeRO-3 the caller gathers
    them). labels: [B, T] token ids, IGNORE_INDEX (-100) where no loss is wanted. loss_mask: optional [B, T]
    bool/0-1, aligned with labels: True where the token is a training target (e.g. assistant tokens for SFT).
    The teacher is needed when a term reads it.

    Position t predicts token t+1 (labels are shifted inside). A position counts when its target
    labels[:, t+1] is not -100 and loss_mask[:, t+1] is set; every term uses that same set of n tokens (so
    the last position of a row, which has no target, is in none) and is averaged over it. Gradients flow to
    hidden and head_weight (when they require grad), never to the teacher; n = 0 gives zeros. The gradient is
    computed during the forward call whenever one is needed, so evaluate under torch.no_grad() to skip that work.

    token_weight: optional [B, T] float, aligned with labels: the weight of each target token in the trained total
    (stages.distill.copy_weight: `copy_token_weights`); the total is then sum_k weight_k * sum_i w_i term_k(i) / n,
    and the reported terms stay the unweighted means (comparable with an unweighted run's). None: every token 1.

    Returns LossTerms: the terms' per-token means by name (`measured_names`: the configured terms, then ce and kl
    where they are not among them, measured for the logs, kl at temperature 1; kl only with a teacher).
    """

    def __init__(self, terms: Sequence[TokenLoss], chunk_tokens: int = 512):
        names = [term.name for term in terms]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"a chunked loss needs one or more terms, each once; got {names}")
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
        self.terms, self.chunk_tokens = tuple(terms), int(chunk_tokens)
        self.fused = set(names) <= FUSED
        by_name = {term.name: term for term in terms}
        ce, kl = by_name.get("ce"), by_name.get("kl")
        # (ce_weight, kl_weight, tau) of the fused pass, which measures both terms whatever their weights
        self.fused_weights = (ce.weight if ce else 0.0, kl.weight if kl else 0.0, kl.temperature if kl else 1.0)
        # term by term: the terms, then any of ce and kl the logs need beside them, at weight 0
        self.measured = self.terms + tuple(cls(0.0) for cls in (CrossEntropy, ForwardKL) if cls.name not in names)

    def measured_names(self, teacher: bool) -> tuple[str, ...]:
        """The names of the terms a call reports, in order: the configured terms, then ce and kl where they are not
        among them; those that read the teacher only with one."""
        return tuple(term.name for term in self.measured if teacher or not term.needs_teacher)

    def __call__(
        self, hidden: Tensor, head_weight: Tensor, labels: Tensor, teacher_hidden: Optional[Tensor] = None,
        teacher_head_weight: Optional[Tensor] = None, loss_mask: Optional[Tensor] = None,
        token_weight: Optional[Tensor] = None,
    ) -> LossTerms:
        _check_shapes(hidden, head_weight, labels, loss_mask, teacher_hidden, teacher_head_weight)
        readers = [term.name for term in self.terms if term.needs_teacher]
        if teacher_hidden is None and readers:
            raise ValueError(f"loss term(s) {readers} need the teacher's hidden states and head")
        targets = labels[:, 1:]
        keep = targets != IGNORE_INDEX
        if loss_mask is not None:
            keep = keep & loss_mask[:, 1:].bool()
        # Gathering the counted positions first ([n, C], small next to [n, V]) skips ignored ones entirely.
        xs = hidden[:, :-1][keep]
        xt = wt = None
        if teacher_hidden is not None:
            with torch.no_grad():
                xt = teacher_hidden[:, :-1][keep]
            wt = teacher_head_weight.detach()
        y = targets[keep]
        w = None if token_weight is None else token_weight[:, 1:][keep].float()
        need_dx = torch.is_grad_enabled() and xs.requires_grad
        need_dw = torch.is_grad_enabled() and head_weight.requires_grad
        names = self.measured_names(teacher_hidden is not None)
        total, values = _ChunkedTerms.apply(xs, head_weight, xt, wt, y, w, self, names, need_dx, need_dw)
        return LossTerms(total, dict(zip(names, values.unbind(0))), int(y.numel()))

    def rows(
        self, xs: Tensor, ws: Tensor, xt: Optional[Tensor], wt: Optional[Tensor], y: Tensor, w: Optional[Tensor],
        names: Sequence[str], need_dx: bool, need_dw: bool,
    ) -> tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
        """Over the selected rows (weighted by w [n] in the total, None: 1), a chunk at a time: (total, the per-token
        means of the terms `names` as one fp32 vector, d total/d xs [n, Cs], d total/d ws [V, Cs]), gradients in
        fp32."""
        n = xs.shape[0]
        denom = max(n, 1)
        measured = ("ce", "kl", *(t.name for t in self.terms))
        sums = {name: xs.new_zeros((), dtype=torch.float32) for name in measured}
        trained = sums if w is None else {name: xs.new_zeros((), dtype=torch.float32) for name in measured}
        dx = torch.empty_like(xs, dtype=torch.float32) if need_dx else None
        dw = torch.zeros_like(ws, dtype=torch.float32) if need_dw else None
        grad_dtype = self._grad_dtype(xs, ws)
        for lo in range(0, n, self.chunk_tokens):
            hi = min(lo + self.chunk_tokens, n)
            s, t = logits(xs[lo:hi], ws), (None if xt is None else logits(xt[lo:hi], wt))
            w_chunk = None if w is None else w[lo:hi]
            chunk_rows, g = self._chunk(s, t, y[lo:hi], w_chunk, denom, need_dx or need_dw, grad_dtype)
            del s, t
            for name, value in chunk_rows.items():
                sums[name] += value.sum()
                if w_chunk is not None:
                    trained[name] += (value * w_chunk).sum()
            if dx is not None:
                dx[lo:hi] = grad_input(g, ws)
            if dw is not None:
                add_weight_grad(dw, g, xs[lo:hi])
        means = {name: value / denom for name, value in sums.items()}
        total = sum(term.weight * trained[term.name] / denom for term in self.terms)
        return total, torch.stack([means[name] for name in names]), dx, dw

    def _grad_dtype(self, xs: Tensor, ws: Tensor) -> torch.dtype:
        """bf16 hidden states and head on CUDA, fused pass: the logits' gradient is rounded once to bf16, so that
        both gradient matmuls run on bf16 tensor cores (TF32 on the fp32 gradient took half of the fused loss's
        time). Elsewhere it stays fp32."""
        low = self.fused and xs.dtype in (torch.bfloat16, torch.float16) and ws.dtype == xs.dtype
        return xs.dtype if low and loss_kernel.available(xs) else torch.float32

    def _chunk(self, s: Tensor, t: Optional[Tensor], y: Tensor, w: Optional[Tensor], denom: int, need_grad: bool,
               grad_dtype: torch.dtype) -> tuple[dict[str, Tensor], Optional[Tensor]]:
        """Each measured term on each row of one chunk ([c], unweighted), and d total / d s with the rows weighted
        by w (s, t may be overwritten)."""
        if self.fused:
            ce_w, kl_w, tau = self.fused_weights
            ce, kl, g = ce_kl_rows(s, t, y, tau, ce_w / denom, kl_w / denom, need_grad, grad_dtype, w)
            return {"ce": ce, "kl": kl}, g
        rows, g = {}, None
        for term in self.measured:
            if t is None and term.needs_teacher:
                continue
            rows[term.name], term_g = term.chunk(s, t, y, need_grad and term.weight != 0)
            if term_g is not None:
                g = term_g.mul_(term.weight / denom) if g is None else g.add_(term_g, alpha=term.weight / denom)
        if need_grad and g is None:
            g = torch.zeros_like(s)
        if g is not None and w is not None:
            g.mul_(w[:, None])
        return rows, g


class _ChunkedTerms(torch.autograd.Function):
    """Rows already selected: xs [n, Cs], xt [n, Ct] (None: no teacher), y [n], w [n] (None: 1). Returns (total,
    the means of the terms `names` as one fp32 vector, not differentiable)."""

    @staticmethod
    def forward(ctx, xs, ws, xt, wt, y, w, loss: ChunkedLoss, names, need_dx, need_dw):
        # Autocast would run the fp32 logit matmuls in bf16.
        with torch.autocast(device_type=xs.device.type, enabled=False), loss_matmuls(xs):
            total, values, dx, dw = loss.rows(xs, ws, xt, wt, y, w, names, need_dx, need_dw)
        ctx.grads = (dx, dw)
        ctx.dtypes = (xs.dtype, ws.dtype)
        ctx.mark_non_differentiable(values)
        return total, values

    @staticmethod
    def backward(ctx, g_total, _g_values):
        dx, dw = ctx.grads
        ctx.grads = None
        # Computed for d(total) = 1 and kept in fp32 so that a scaled g_total (1/grad_accum) is exact.
        g = g_total.float()
        dx = None if dx is None else dx.mul_(g).to(ctx.dtypes[0])
        dw = None if dw is None else dw.mul_(g).to(ctx.dtypes[1])
        return dx, dw, None, None, None, None, None, None, None, None


def distill_loss(
    student_hidden: Tensor,
    teacher_hidden: Tensor,
    lm_head_weight_s: Tensor,
    lm_head_weight_t: Tensor,
    labels: Tensor,
    *,
    ce_weight: float,
    kl_weight: float,
    temperature: float,
    chunk_tokens: int = 512,
    loss_mask: Optional[Tensor] = None,
) -> LossTerms:
    """Stage-3 loss from final hidden states: next-token CE plus tau^2-scaled KL(teacher || student), a
    `ChunkedLoss` of the terms `kl_and_ce(ce_weight, kl_weight, temperature)` (the arguments as in `ChunkedLoss`).

    terms["ce"] = mean CE at temperature 1; terms["kl"] = tau^2 * mean sum_v p_t (log p_t - log p_s), softmaxes at
    tau; total = ce_weight * ce + kl_weight * kl.

    Logits, softmaxes and the logits' gradient are fp32 and exist for chunk_tokens rows at a time. Peak
    extra memory is about 5 * chunk_tokens * V * 4 bytes (chunk buffers) + V * Cs * 4 (fp32 weight-gradient
    accumulator) + ~12 * n * C bytes (gathered rows, fp32 input gradient); bf16 heads are upcast
    VOCAB_BLOCK rows at a time. Measured on CPU at V=49152, C=2048, chunk 512, n=1023, fwd+bwd: 0.93 GB.
    On CUDA, bf16 hidden states and heads give their logits by a bf16 matmul with fp32 accumulation and output
    (no upcast; the same values as the fp32 matmul of the upcast operands); `harness.loss_kernel` computes
    the losses and the logits' gradient in fp32 and rounds that gradient once to bf16 (~4e-3 relative per
    element, as Liger's and fla's fused losses keep it), so that both gradient matmuls run on bf16 tensor cores
    with fp32 accumulation and output. Plain fp32 matmuls made this loss 23% of a 135M stage-3 step on an H200;
    TF32 ones on an fp32 gradient still half of it (docs/BENCHMARKS.md). Where the kernel does not run (no
    Triton, fp32 inputs, CPU) the gradient stays fp32 and its matmuls are fp32 (TF32 on a GPU).
    """
    loss = ChunkedLoss(kl_and_ce(ce_weight, kl_weight, temperature), chunk_tokens)
    return loss(student_hidden, lm_head_weight_s, labels, teacher_hidden, lm_head_weight_t, loss_mask)


def lm_loss(
    hidden: Tensor,
    lm_head_weight: Tensor,
    labels: Tensor,
    *,
    chunk_tokens: int = 512,
    loss_mask: Optional[Tensor] = None,
) -> LossTerms:
    """Next-token CE alone (SFT), a `ChunkedLoss` of one `ce` term: no teacher, no whole-batch fp32 logits.

    hidden: [B, T, C] final (post-norm) hidden states; lm_head_weight: [V, C]; labels: [B, T] with -100 where
    no loss is wanted (for SFT: everything but the assistant tokens, and padding); loss_mask as in
    `ChunkedLoss`. Returns LossTerms with total = terms["ce"] = the mean CE over the n counted tokens (the only
    term: no teacher, no kl) and tokens = n.
    """
    return ChunkedLoss([CrossEntropy(1.0)], chunk_tokens)(hidden, lm_head_weight, labels, loss_mask=loss_mask)


def _check_shapes(hs: Tensor, ws: Tensor, labels: Tensor, mask: Optional[Tensor], ht: Optional[Tensor],
                  wt: Optional[Tensor]) -> None:
    if (ht is None) != (wt is None):
        raise ValueError("a teacher needs both its hidden states and its head weight")
    for who, h, w in [("student", hs, ws)] + ([("teacher", ht, wt)] if ht is not None else []):
        if h.dim() != 3 or h.shape[:2] != labels.shape:
            raise ValueError(f"{who} hidden states must be [B, T, C] and labels [B, T]; got {tuple(h.shape)} and "
                             f"labels {tuple(labels.shape)}")
        if w.dim() != 2 or w.shape[1] != h.shape[2]:
            raise ValueError(f"the {who}'s head {tuple(w.shape)} must be [V, C] with C = its hidden width {h.shape[2]}")
    if wt is not None and wt.shape[0] != ws.shape[0]:
        raise ValueError(f"the heads must share one vocabulary; got {tuple(ws.shape)} (student) and {tuple(wt.shape)} "
                         "(teacher)")
    if mask is not None and mask.shape != labels.shape:
        raise ValueError(f"loss_mask {tuple(mask.shape)} must match labels {tuple(labels.shape)}")
