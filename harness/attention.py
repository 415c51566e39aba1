"""The teacher's softmax attention, as a hybrid student keeps it in its `student.attention_layers`.

`SoftmaxAttention` holds the teacher attention's q/k/v/o projections in the teacher's layout (K and V at the
teacher's num_kv_heads, biases, Qwen3's and Gemma 3's per-head q/k RMSNorm before RoPE) under the teacher's names, so
that `load_state_dict(teacher_layer.self_attn.state_dict())` copies it bit for bit. It computes causal grouped-query
attention as the teacher does: with torch's scaled_dot_product_attention at the teacher's scale (head_dim**-0.5, or
Gemma's query_pre_attn_scalar**-0.5), or, where the teacher soft-caps its scores (Gemma 2's attn_logit_softcapping),
as transformers' eager attention does (scores, cap * tanh(scores / cap), softmax in float32); RoPE as the teacher's
layer has it (Gemma 3's local base on its sliding-window layers, none on SmolLM3's layers without). It decodes with
a growing `KVState` (keys and values of every token seen, `[B, kv_heads, T, D]`; under the teacher's sliding window,
Mistral's, only the last `window - 1`), or, where the decoder allocates the room up front, a `FixedKVState` written
in place (fixed shapes: a step that a CUDA graph can capture).

Padding (tests/test_padding.py's conventions): the key mask `[B, seen + T]` (0 at padding) hides padded keys, so
that a row padded on the left (generation) or on the right (scoring) attends at its real tokens to what it would
alone. A padded query attends at least to itself (a row of only masked keys would be NaN, and a NaN value at a
padded position would poison the real ones through 0 x NaN).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from harness.layouts import layer_rope, norm_class, softcap
from harness.mixers import MixerShape


@dataclass
class KVState:
    """Decoding state of a kept softmax-attention layer: keys and values of every token seen, `[B, kv_heads, T, D]`
    (after RoPE). It grows by one column per token, unlike a mixer's `MixerState`, up to the teacher's sliding window
    where it has one (then the last `window - 1` columns)."""

    k: torch.Tensor
    v: torch.Tensor

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "KVState":
        return KVState(fn(self.k), fn(self.v))

    def tensors(self) -> list[torch.Tensor]:
        """k and v, in the order `map` visits them (as MixerState.tensors)."""
        return [self.k, self.v]

    @property
    def length(self) -> int:
        return self.k.shape[2]

    @staticmethod
    def stack_left_padded(states: list["KVState"]) -> "KVState":
        """Rows' states (batch 1 each, any lengths) as one batch, each padded with zeros on the left to the longest:
        the columns of a left-padded batch, whose mask then hides the padding."""
        width = max(s.length for s in states)

        def pad(t: torch.Tensor) -> torch.Tensor:
            return F.pad(t, (0, 0, width - t.shape[2], 0))

        return KVState(torch.cat([pad(s.k) for s in states]), torch.cat([pad(s.v) for s in states]))


@dataclass
class FixedKVState:
    """Decoding state of a kept softmax-attention layer with its room allocated up front: keys and values
    `[B, kv_heads, capacity, D]` (after RoPE), `valid` `[B, capacity]` (True where a column holds a real key, so
    that a left-padded prompt's padding and the room not yet written stay hidden) and `length` `[B]` (the columns
    written, the same in every row; a tensor, so that a step reads and advances it on the device). Each decoding
    step writes its key and value in place at column `length` and attends over every column under `valid`: the
    step's shapes never change, so it can be captured as a CUDA graph (harness.decoding). A masked column adds
    exactly nothing to the softmax, so the step computes what a growing `KVState` computes."""

    k: torch.Tensor
    v: torch.Tensor
    valid: torch.Tensor
    length: torch.Tensor

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "FixedKVState":
        return FixedKVState(fn(self.k), fn(self.v), fn(self.valid), fn(self.length))

    def tensors(self) -> list[torch.Tensor]:
        """k, v, valid and length, in the order `map` visits them (as MixerState.tensors)."""
        return [self.k, self.v, self.valid, self.length]

    @staticmethod
    def from_growing(state: KVState, capacity: int, key_mask: Optional[torch.Tensor] = None) -> "FixedKVState":
        """`state`'s columns, then room for `capacity - state.length` more. key_mask: `[B, state.length]`, 0 where
        a column is padding (a left-padded batch's), or None (every column real)."""
        b, heads, seen, d = state.k.shape
        if capacity < seen:
            raise ValueError(f"capacity {capacity} is smaller than the {seen} columns already cached")
        k, v = (t.new_zeros(b, heads, capacity, d) for t in (state.k, state.v))
        k[:, :, :seen], v[:, :, :seen] = state.k, state.v
        valid = torch.zeros(b, capacity, dtype=torch.bool, device=state.k.device)
        valid[:, :seen] = True if key_mask is None else key_mask.to(state.k.device).bool()
        return FixedKVState(k, v, valid, torch.full((b,), seen, dtype=torch.long, device=state.k.device))


class SoftmaxAttention(nn.Module):
    """The teacher's attention block (module docstring): x `[B, T, hidden]` -> (y `[B, T, hidden]`, KVState)."""

    def __init__(self, shape: MixerShape, layer_idx: int = 0, window: Optional[int] = None):
        super().__init__()
        self.shape, self.layer_idx, self.window = shape, layer_idx, window
        # read by harness.transfer.AttentionProbe, under the names transformers' attention modules give them
        self.scaling, self.attn_logit_softcapping = shape.attention_scale, shape.softcap
        d = shape.head_dim
        self.q_proj = nn.Linear(shape.hidden_size, shape.num_heads * d, bias=shape.qkv_bias)
        self.k_proj = nn.Linear(shape.hidden_size, shape.num_kv_heads * d, bias=shape.qkv_bias)
        self.v_proj = nn.Linear(shape.hidden_size, shape.num_kv_heads * d, bias=shape.qkv_bias)
        self.o_proj = nn.Linear(shape.num_heads * d, shape.hidden_size, bias=shape.o_bias)
        if shape.qk_norm:  # Qwen3, Gemma 3: RMSNorm over each head of q and k, before RoPE
            norm = norm_class(shape.norm_style)
            self.q_norm = norm(d, eps=shape.norm_eps)
            self.k_norm = norm(d, eps=shape.norm_eps)

    def forward(self, x: torch.Tensor, *, position_embeddings: Optional[tuple[torch.Tensor, torch.Tensor]],
                state: Optional[KVState] = None, use_cache: bool = False,
                key_mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[KVState]]:
        """key_mask: None (no padding) or `[B, seen + T]` over the cached and the new tokens, 0 at padding.
        position_embeddings: the teacher's (cos, sin) `[B, T, D]` at the new tokens' positions, or a
        `harness.layouts.LayerRope` holding this layer's; None for a teacher layer without RoPE."""
        b, t, _ = x.shape
        q, k, v = (self._heads(p(x)) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.shape.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        rope = layer_rope(position_embeddings, self.layer_idx)
        if rope is not None:
            q, k = apply_rotary_pos_emb(q, k, *rope)
        if isinstance(state, FixedKVState):
            return self._fixed_step(q, k, v, state), state
        if state is not None:
            k, v = torch.cat([state.k, k], 2), torch.cat([state.v, v], 2)
        if key_mask is not None:  # a windowed cache holds only the last columns: the mask's columns end with them
            key_mask = key_mask[:, -k.shape[2]:]
        mask = causal_mask(t, k.shape[2], key_mask, x.device, self.window)
        out = self._attend(q, k, v, mask, causal=mask is None and t > 1)
        y = self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        return y, (self._cached(k, v) if use_cache else None)

    def _fixed_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: FixedKVState) -> torch.Tensor:
        """One decoding token against a FixedKVState: its key and value written in place at column `length`, then
        attention over the columns `valid` marks (the cached real keys and its own). `length` is read on the device,
        so there is no bound check here: the caller allocates the room (harness.decoding)."""
        if q.shape[2] != 1 or self.window is not None:
            raise ValueError("a FixedKVState takes one token per step, in a layer without a sliding window")
        column = state.length[:1]
        state.k.index_copy_(2, column, k)
        state.v.index_copy_(2, column, v)
        state.valid.index_fill_(1, column, True)
        state.length.add_(1)
        out = self._attend(q, state.k, state.v, state.valid[:, None, None, :], causal=False)
        return self.o_proj(out.transpose(1, 2).reshape(q.shape[0], 1, -1))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                causal: bool) -> torch.Tensor:
        """Softmax attention `[B, H, T, D]` of q `[B, H, T, D]` over k, v `[B, kv_heads, S, D]` under the bool mask
        (True: attend; None: all keys, or causal when `causal`), at the teacher's scale. Without soft-capping, torch's
        sdpa; with it, transformers' eager attention (scores scaled, capped, masked, softmax in float32, cast back)."""
        grouped = self.shape.num_kv_heads != self.shape.num_heads
        if self.shape.softcap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                  scale=self.shape.attention_scale, enable_gqa=grouped)
        if grouped:
            k, v = (t.repeat_interleave(self.shape.n_rep, dim=1) for t in (k, v))
        scores = softcap(torch.matmul(q, k.transpose(2, 3)) * self.shape.attention_scale, self.shape.softcap)
        if causal:
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - q.shape[2])
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(scores.softmax(-1, dtype=torch.float32).to(q.dtype), v)

    def _cached(self, k: torch.Tensor, v: torch.Tensor) -> KVState:
        """The KV state to keep: every column, or under a sliding window only the last `window - 1` (a later query
        sees no column before those; transformers' sliding-window cache keeps the same)."""
        if self.window is None:
            return KVState(k, v)
        first = max(0, k.shape[2] - (self.window - 1))
        return KVState(k[:, :, first:], v[:, :, first:])

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (-1, self.shape.head_dim))


def causal_mask(queries: int, keys: int, key_mask: Optional[torch.Tensor], device: torch.device,
                window: Optional[int] = None) -> Optional[torch.Tensor]:
    """The bool attention mask `[B or 1, 1, queries, keys]` of the last `queries` of `keys` tokens (True: attend),
    or None where sdpa's own `is_causal` (queries == keys) or no mask at all (one query) says it. window: the
    teacher's sliding window (a query sees the `window` columns up to its own; transformers' convention)."""
    if key_mask is None and window is None and (queries == keys or queries == 1):
        return None
    cols = torch.arange(keys, device=device)
    own = (keys - queries + torch.arange(queries, device=device))[:, None]  # each query's own column
    allowed = cols[None] <= own
    if window is not None:
        allowed = allowed & (cols[None] > own - window)
    if key_mask is not None:
        allowed = allowed[None] & key_mask.to(device).bool()[:, None, :]
        allowed = allowed | (cols[None] == own)[None]
    else:
        allowed = allowed[None]
    return allowed[:, None]
