"""Probes of a token mixer's work on a layer input: its output, its pairwise scores and its effective mixing
weights (o_t = sum_s A_ts v_s), for the teacher's softmax attention (AttentionProbe) and for a student mixer on its
PyTorch reference path (MixerProbe). `harness transfer` compares the two (harness.transfer), the copy probe reads
induction scores from them (harness.eval.copy), and stage 1's matrix-orientation term fits one to the other
(harness.stages.align.mixing_loss)."""

from __future__ import annotations

import inspect
import math
from typing import Optional, Protocol

import torch
from torch import nn

from harness.layouts import layer_rope, softcap
from harness.mixers import Mixer
from harness.mixers.ops import apply_rope


class Probe(Protocol):
    """What the report measures of a token mixer on input x `[B, T, hidden]` at positions `[B, T]`."""

    def output(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The mixer's output `[B, T, hidden]` (what stage 1 compares with the teacher's o_proj output)."""

    def scores(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Pairwise scores `[B, H, T(query), T(key)]`; only the causal part is read."""

    def mixing(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Effective mixing weights `[B, H, T, T]`: per head, o_t = sum_s A_ts v_s."""


class AttentionProbe:
    """The teacher's own softmax attention (an attention module of a family harness.teacher_families names, or a
    student's kept SoftmaxAttention, and the model's rotary embedding), read as the module computes it: its scale
    (`scaling`), its q/k norms, its score soft-capping (`attn_logit_softcapping`, Gemma 2), RoPE of its layer's kind
    (Gemma 3's rotary takes the layer type; a student's LayerRotary gives every layer's) or none (SmolLM3's
    `use_rope` 0). Full causal attention: a teacher's sliding window is not applied."""

    def __init__(self, attn: nn.Module, rotary: nn.Module, num_heads: int, num_kv_heads: int, head_dim: int):
        self.attn, self.rotary = attn, rotary
        self.heads, self.kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scaling = getattr(attn, "scaling", head_dim ** -0.5)
        self.softcap = getattr(attn, "attn_logit_softcapping", None)

    @classmethod
    def of_teacher(cls, model: nn.Module, layer: int) -> "AttentionProbe":
        c = model.config
        heads = c.num_attention_heads
        return cls(model.model.layers[layer].self_attn, model.model.rotary_emb, heads,
                   getattr(c, "num_key_value_heads", None) or heads, getattr(c, "head_dim", None) or c.hidden_size // heads)

    def _rope(self, x, positions):
        """The attention's (cos, sin) at `positions`, or None where its layer has no RoPE."""
        a = self.attn
        if not getattr(a, "use_rope", True):  # SmolLM3's layers without RoPE
            return None
        layer_type = getattr(a, "layer_type", None)
        if layer_type is not None and "layer_type" in inspect.signature(self.rotary.forward).parameters:
            return self.rotary(x, positions, layer_type)  # Gemma 3: one rotary per layer type
        return layer_rope(self.rotary(x, positions), getattr(a, "layer_idx", 0))

    def _qkv(self, x, positions, rope: bool = True):
        """q, k, v `[B, T, heads, head_dim]` (k and v repeated over the query heads), with the layer's RoPE unless
        `rope` is False (what a mixer with `rope: false` reads)."""
        a, n_rep = self.attn, self.heads // self.kv_heads
        split = lambda t: t.unflatten(-1, (-1, self.head_dim))  # noqa: E731
        q, k, v = split(a.q_proj(x)), split(a.k_proj(x)), split(a.v_proj(x))
        if hasattr(a, "q_norm"):  # Qwen3, Gemma 3: per-head RMSNorm of q and k before RoPE
            q, k = a.q_norm(q), a.k_norm(k)
        rope = self._rope(x, positions) if rope else None
        if rope is not None:
            q, k = apply_rope(q, k, *rope)
        return q, k.repeat_interleave(n_rep, dim=2), v.repeat_interleave(n_rep, dim=2)  # transformers' repeat_kv

    def scores(self, x, positions):
        q, k, _ = self._qkv(x, positions)
        return softcap(torch.einsum("bthd,bshd->bhts", q.float(), k.float()) * self.scaling, self.softcap)

    def mixing(self, x, positions):
        s = self.scores(x, positions)
        causal = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        return s.masked_fill(~causal, -math.inf).softmax(-1)

    def output(self, x, positions):
        _, _, v = self._qkv(x, positions)
        o = torch.einsum("bhts,bshd->bthd", self.mixing(x, positions), v.float())
        return self.attn.o_proj(o.flatten(2).to(x.dtype))


class MixerProbe:
    """A student mixer, on its PyTorch reference path (the oracle of its kernels)."""

    def __init__(self, mixer: Mixer, rotary: Optional[nn.Module] = None):
        if mixer.options.rope and rotary is None:
            raise ValueError(f"{mixer.name} uses rope: pass the student's rotary embedding")
        self.mixer, self.rotary = mixer, rotary

    def _rope(self, x, positions):
        """What the mixer reads as position_embeddings: the student's rotary at `positions` ((cos, sin), or a
        LayerRope of every layer's), or None for a mixer without RoPE."""
        return self.rotary(x, positions) if self.mixer.options.rope else None

    def _qkv(self, x, positions):
        q, k, v, _ = self.mixer.project_qkv(x, None, False)
        rope = layer_rope(self._rope(x, positions), self.mixer.layer_idx)  # None on a layer without RoPE
        if rope is not None:
            q, k = apply_rope(q, k, *rope)
        return q, k, v

    def output(self, x, positions):
        y, _ = self.mixer(x, position_embeddings=self._rope(x, positions))
        return y

    def scores(self, x, positions):
        q, k, _ = self._qkv(x, positions)
        q, k = self.mixer.score_features(q, k)
        return torch.einsum("bthd,bshd->bhts", q.float(), k.float())

    def mixing(self, x, positions):
        """A `[B, H, T, T]`. With several values per token (DeltaProduct's steps `[B, T, n, H, D]`) each of them is
        the token's one-hot: A_ts is the weight of token s summed over its steps."""
        q, k, v = self._qkv(x, positions)
        length = v.shape[1]
        onehot = torch.eye(length, device=x.device).view(1, length, *(1,) * (v.dim() - 3), length)
        onehot = onehot.expand(*v.shape[:-1], length)
        o, _ = self.mixer._mix(x, q, k, onehot, None, "reference")  # value s = e_s: o_t = row t of A
        return o.float().permute(0, 2, 1, 3)
