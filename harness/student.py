"""The student: the teacher's network with its attention blocks replaced by linear-time mixers.

`HarnessConfig` / `HarnessForCausalLM` are ordinary transformers classes registered with the Auto* factories
when `harness` is imported, so a saved student loads with `AutoModelForCausalLM.from_pretrained(dir)`
(no remote code). Decoding keeps one `MixerState` per layer in a `RecurrentCache`: prefill runs the chunked
form once, then each new token is one recurrent step; memory does not grow with the context.

A hybrid student (`HarnessConfig.attention_layers`, the job's `student.attention_layers`) keeps the teacher's
softmax attention in those layers (`AttentionBlock`, harness.attention): their weights are the teacher's under
the teacher's names, their RoPE the teacher's, and their cache entry a growing `KVState` beside the other
layers' fixed-size MixerStates.

What a teacher computes beyond Llama's decoder (harness.teacher_families.student_layout) is carried by the config
fields of the same names and computed here as the teacher does (harness.layouts): Gemma's norms (1 + weight) and
scaled embedding, Gemma 2/3's norms after the attention and around the MLP, logit soft-capping, and RoPE per layer
(Gemma 3's local base, SmolLM3's layers without RoPE), in kept attention layers and in rope mixers alike.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, LlamaConfig, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import ModelOutput
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from harness.attention import FixedKVState, KVState, SoftmaxAttention
from harness.layouts import GemmaRMSNorm, ScaledEmbedding, layer_rope, layer_rotary, model_rotary, norm_class, softcap
from harness.mixers import (Mixer, MixerShape, MixerState, mixer_class, mixer_options, no_weight_decay,
                            resolved_options, saved_options)
from harness.teacher_families import (
    attention_layout,
    check_teacher_config,
    student_layout,
    teacher_window,
)


@strict
class HarnessConfig(LlamaConfig):
    """A Llama config plus the mixer that replaces attention and its options: every option, as `student_config`
    writes them; a key missing (a student saved before that option existed) is read as it was then
    (`harness.mixers.saved_options`)."""

    model_type = "harness_student"
    mixer: str = "gated_deltanet"
    mixer_options: dict | None = None
    # The teacher's attention layout (harness.teacher.AttentionLayout), which every mixer keeps; None in a student
    # saved before these existed, whose `attention_bias` then says it (MixerShape.from_config).
    qkv_bias: bool | None = None
    o_bias: bool | None = None
    qk_norm: bool | None = None
    # Layers that keep the teacher's softmax attention (a hybrid student); None or [] keeps none.
    attention_layers: list[int] | None = None
    # The teacher's sliding window of each kept layer, in attention_layers' order (Mistral's; None: full context).
    attention_windows: list[int | None] | None = None
    # What the teacher computes beyond Llama's decoder (harness.teacher_families.student_layout; None: Llama's).
    norm_style: str | None = None  # "gemma": every RMSNorm scales by (1 + weight), in float32 before the cast
    sandwich_norms: bool | None = None  # Gemma 2/3: post_attention_layernorm on the attention output before the
    # residual add, pre_feedforward_layernorm before the MLP and post_feedforward_layernorm after it
    embed_scale: float | None = None  # Gemma: the embeddings are multiplied by sqrt(hidden_size)
    query_pre_attn_scalar: float | None = None  # Gemma 2/3: softmax attention scale query_pre_attn_scalar ** -0.5
    attn_logit_softcapping: float | None = None  # Gemma 2: cap * tanh(scores / cap) in softmax attention (kept
    # layers, mixer windows); a mixer's recurrence has no scores to cap and drops it
    final_logit_softcapping: float | None = None  # Gemma 2/3: cap * tanh(logits / cap)
    no_rope_layers: list[int] | None = None  # SmolLM3: per layer 1 = RoPE, 0 = none (kept layers and rope mixers)
    local_rope_layers: list[int] | None = None  # Gemma 3: the sliding-window layers, whose RoPE is ...
    local_rope_parameters: dict | None = None  # ... this one (its local base), not rope_parameters

    def kept_layers(self) -> frozenset[int]:
        """The layers that keep softmax attention (`attention_layers`)."""
        return frozenset(self.attention_layers or ())

    def attention_window(self, layer: int) -> Optional[int]:
        """The teacher's sliding window at kept layer `layer` (None: it attends to the whole context)."""
        windows = self.attention_windows or [None] * len(self.attention_layers or ())
        return dict(zip(self.attention_layers or (), windows)).get(layer)


class RecurrentCache(Cache):
    """Per-layer decoding states behind transformers' Cache interface: a MixerState for a mixer layer, a KVState
    (growing with the context) or a FixedKVState (its room allocated up front: `fix_kv`) for a kept
    softmax-attention layer.

    `positions` (`[B]`, on the device; None until `track_positions` or `fix_kv` sets it): each row's next rotary
    position, its count of real tokens so far. Where it is set, a step reads its positions from it (no mask needed
    after a left-padded prompt) and advances it in place, so that the step's inputs all live on the device (a CUDA
    graph's)."""

    is_compileable = False

    def __init__(self, num_layers: int = 0) -> None:
        super().__init__(layers=[])
        self.states: list[Optional[MixerState | KVState | FixedKVState]] = [None] * num_layers
        self.seen_tokens = 0
        self.positions: Optional[torch.Tensor] = None
        self.capacity: Optional[int] = None  # the FixedKVStates' columns (`fix_kv`), None while KV states grow

    def __len__(self) -> int:
        return len(self.states)

    def get_seq_length(self, layer_idx: int | None = 0, *args, **kwargs) -> int:
        return self.seen_tokens

    def get_max_cache_shape(self, *args, **kwargs) -> int:
        return -1

    def get_mask_sizes(self, *args, **kwargs):  # no attention mask is built for recurrent layers
        return self.seen_tokens + 1, 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_rows(lambda t: t.repeat_interleave(repeats, 0))

    def _map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.states = [s.map(fn) if s else s for s in self.states]
        if self.positions is not None:
            self.positions = fn(self.positions)

    def fix_kv(self, new_tokens: int, prompt_mask: Optional[torch.Tensor] = None) -> None:
        """Turn every growing KVState into a FixedKVState with room for `new_tokens` more tokens, and set
        `positions` from the prompts (prompt_mask: `[B, seen_tokens]`, 0 at a left-padded batch's padding; None:
        no padding). Not for a student whose kept layers have a sliding window (their states drop columns)."""
        if self.capacity is not None:
            raise ValueError("the cache's KV states are fixed already")
        self.capacity = self.seen_tokens + new_tokens
        self.states = [FixedKVState.from_growing(s, self.capacity, prompt_mask)
                       if isinstance(s, KVState) else s for s in self.states]
        self.track_positions(prompt_mask)

    def track_positions(self, prompt_mask: Optional[torch.Tensor] = None) -> None:
        """Set `positions` from the prompts (prompt_mask as in `fix_kv`): from here on each step reads its rotary
        positions from the cache, on the device, instead of from a mask or the host's `seen_tokens`."""
        rows = next(t for s in self.states if s is not None for t in s.tensors())
        self.positions = (prompt_mask.long().sum(-1).to(rows.device) if prompt_mask is not None
                          else torch.full((rows.shape[0],), self.seen_tokens, dtype=torch.long, device=rows.device))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(indices)

    def state_bytes(self) -> int:
        """Memory held by every state: constant in the context length, but for the KV part (`kv_bytes`)."""
        return sum(_tensor_bytes(s) for s in self.states if s is not None)

    def kv_bytes(self) -> int:
        """Memory held by the kept attention layers' keys and values: it grows linearly with the context (a
        FixedKVState's: its whole capacity, allocated up front)."""
        return sum(t.numel() * t.element_size() for s in self.states if isinstance(s, (KVState, FixedKVState))
                   for t in (s.k, s.v))


def _tensor_bytes(state: MixerState | KVState | FixedKVState) -> int:
    return sum(t.numel() * t.element_size() for t in state.tensors())


@dataclass
class StudentOutput(ModelOutput):
    """Causal-LM output; the cache is exposed under both names transformers versions read."""

    loss: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None
    past_key_values: Optional[RecurrentCache] = None
    cache: Optional[RecurrentCache] = None


class BlockRMSNorm(LlamaRMSNorm):
    """The teacher's RMSNorm (same weight, same name), which can also add the residual before normalising and
    run as fla's fused Triton kernel (one kernel forward and one backward, where PyTorch runs ~6 elementwise
    operators over fp32 copies each way). The fused form computes in fp32 and rounds once: it may differ
    from LlamaRMSNorm, which rounds before the weight multiply, by one bf16 step."""

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, fused: bool = False):
        """-> norm(x), or with a residual (norm(x + residual), x + residual)."""
        if fused:
            from fla.modules.norm.layernorm import rms_norm

            return rms_norm(x, self.weight, None, residual=residual, eps=self.variance_epsilon,
                            prenorm=residual is not None)
        if residual is None:
            return super().forward(x)
        total = residual + x
        return super().forward(total), total


class GemmaBlockNorm(GemmaRMSNorm):
    """Gemma's RMSNorm (the teacher's weight, same name) with BlockRMSNorm's interface: it can add the residual before
    normalising. It always runs in PyTorch (`fused` is ignored): fla's kernel multiplies by the weight itself, not by
    1 + weight in float32."""

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, fused: bool = False):
        """-> norm(x), or with a residual (norm(x + residual), x + residual)."""
        if residual is None:
            return super().forward(x)
        total = residual + x
        return super().forward(total), total


def block_norm(config: Any) -> type[nn.Module]:
    """The norm class of a student's blocks: BlockRMSNorm (Llama's), or GemmaBlockNorm where `norm_style` is gemma."""
    return GemmaBlockNorm if getattr(config, "norm_style", None) == "gemma" else BlockRMSNorm


def add_block_norms(block: nn.Module, config: Any, names: Sequence[str]) -> None:
    """Norms of a block's class (`block_norm`) under `names`, the teacher's; with `sandwich_norms` (Gemma 2/3),
    post_attention_layernorm is followed by pre_feedforward_layernorm and post_feedforward_layernorm. Registered in
    that order, after what the block registered before (the order of its parameters, which its optimizer states and
    checkpoints follow)."""
    norm = block_norm(config)
    for name in names:
        setattr(block, name, norm(config.hidden_size, eps=config.rms_norm_eps))
        if name == "post_attention_layernorm" and getattr(config, "sandwich_norms", None):
            for extra in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                setattr(block, extra, norm(config.hidden_size, eps=config.rms_norm_eps))


def residual_and_mlp(block: nn.Module, hidden: torch.Tensor, mixed: torch.Tensor, fused: bool) -> torch.Tensor:
    """The rest of a decoder layer after its attention (or mixer) output `mixed`, as the teacher's layer computes it:
    h = hidden + mixed, then h + mlp(norm(h)) (Llama); with sandwich norms (Gemma 2/3), h = hidden +
    post_attention_layernorm(mixed), then h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))."""
    if not hasattr(block, "pre_feedforward_layernorm"):
        normed, hidden = block.post_attention_layernorm(mixed, residual=hidden, fused=fused)
        return hidden + block.mlp(normed, fused=fused)
    normed, hidden = block.pre_feedforward_layernorm(block.post_attention_layernorm(mixed, fused=fused),
                                                     residual=hidden, fused=fused)
    return hidden + block.post_feedforward_layernorm(block.mlp(normed, fused=fused), fused=fused)


class BlockMLP(LlamaMLP):
    """The teacher's gated MLP (same weights, same names); `fused` runs act(gate) * up as fla's SwiGLU kernel
    (one kernel each way, computed in fp32 and rounded once) when the activation is SiLU."""

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        if fused and self.config.hidden_act == "silu":
            from fla.modules.activations import swiglu

            return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))
        return super().forward(x)


class StudentBlock(nn.Module):
    """A teacher decoder layer with its attention replaced: x + mixer(norm(x)), then x + mlp(norm(x)) (with Gemma 2/3's
    sandwich norms: `residual_and_mlp`).

    On the mixer's kernel backend (CUDA) and for more than one token, the norms (the second one with the
    residual add) and the MLP's SwiGLU run as fla's fused kernels; each submodule uses only its own weights
    inside its own forward, as ZeRO-3's gathering hooks require. One-token decoding steps stay in PyTorch, as
    the mixers' recurrences do, so that the CUDA-graph step captures no autotuning."""

    def __init__(self, config: HarnessConfig, layer_idx: int):
        super().__init__()
        options = saved_options(config.mixer, config.mixer_options)
        add_block_norms(self, config, ["input_layernorm"])
        self.mixer: Mixer = mixer_class(config.mixer)(MixerShape.from_config(config), options, layer_idx)
        attach_teacher_rope(self.mixer, config)
        add_block_norms(self, config, ["post_attention_layernorm"])
        self.mlp = BlockMLP(config)

    def forward(self, hidden, position_embeddings=None, state=None, use_cache=False, mask=None):
        """mask: None, or bool `[B, T]` False at padded tokens (the mixer's state ignores them). position_embeddings:
        (cos, sin), a `harness.layouts.LayerRope` (the mixer reads its layer's), or None."""
        fused = hidden.shape[1] > 1 and self.mixer.fused_ops(hidden)
        mixed, state = self.mixer(self.input_layernorm(hidden, fused=fused),
                                  position_embeddings=position_embeddings, state=state, use_cache=use_cache,
                                  mask=mask)
        return residual_and_mlp(self, hidden, mixed, fused), state


class AttentionBlock(nn.Module):
    """A teacher decoder layer kept as it is (a hybrid student's `attention_layers`): x + attn(norm(x)), then
    x + mlp(norm(x)) (with Gemma 2/3's sandwich norms: `residual_and_mlp`), with the teacher's softmax attention
    (`SoftmaxAttention`), norms and MLP under the teacher's names. It runs in PyTorch (no fused norms): at init it
    computes what the teacher's layer computes."""

    def __init__(self, config: HarnessConfig, layer_idx: int):
        super().__init__()
        add_block_norms(self, config, ["input_layernorm"])
        self.self_attn = SoftmaxAttention(MixerShape.from_config(config), layer_idx, config.attention_window(layer_idx))
        add_block_norms(self, config, ["post_attention_layernorm"])
        self.mlp = BlockMLP(config)

    def forward(self, hidden, position_embeddings=None, state=None, use_cache=False, mask=None):
        """position_embeddings: the teacher's rotary (cos, sin) at the new tokens, or a LayerRope holding them (None
        for a teacher layer without RoPE); mask: None, or `[B, seen + T]` over the cached and the new tokens, 0 at
        padding (the keys a row must not see)."""
        mixed, state = self.self_attn(self.input_layernorm(hidden), position_embeddings=position_embeddings,
                                      state=state, use_cache=use_cache, key_mask=mask)
        return residual_and_mlp(self, hidden, mixed, fused=False), state


class HarnessPreTrainedModel(PreTrainedModel):
    config_class = HarnessConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["StudentBlock", "AttentionBlock"]
    # students saved before gate_init existed have swish gates without a bias; initialised to 0 it computes the same
    _keys_to_ignore_on_load_missing = [r"\.mixer\.g_proj\.bias$"]


class HarnessModel(HarnessPreTrainedModel):
    def __init__(self, config: HarnessConfig):
        super().__init__(config)
        if config.embed_scale is not None:  # Gemma: rows times sqrt(hidden)
            self.embed_tokens = ScaledEmbedding(config.vocab_size, config.hidden_size, config.pad_token_id,
                                                config.embed_scale)
        else:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        kept = config.kept_layers()
        self.layers = nn.ModuleList((AttentionBlock if i in kept else StudentBlock)(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = norm_class(config.norm_style)(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = student_rotary(config)
        # the teacher's own rotary (its theta, not the mixers' rope_theta option), for the kept attention layers: a
        # LayerRotary where its layers' RoPE differs (harness.layouts.model_rotary)
        self.attention_rotary = model_rotary(config) if kept else None
        self.gradient_checkpointing = False
        self.recompute_blocks = frozenset(range(config.num_hidden_layers))  # under gradient_checkpointing
        self.post_init()

    def forward(self, input_ids=None, inputs_embeds=None, cache: Optional[RecurrentCache] = None,
                use_cache: bool = False, attention_mask: Optional[torch.Tensor] = None,
                layer_outputs: Optional[list] = None) -> torch.Tensor:
        """Final hidden states `[B, T, hidden]`; each block's output (the residual stream after it, before the final
        norm) is appended to `layer_outputs` where one is given (stage 3's hidden-state term). attention_mask: None
        (no padding), or `[B, seen + T]` over the cached and the new tokens (transformers' convention), 0 at padding:
        padded tokens leave every state untouched and the rotary positions count real tokens only, so that a padded
        row computes what it would alone (at its real positions)."""
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        rope = attention_rope = None
        if self.rotary_emb is not None or self.attention_rotary is not None:
            positions = self._positions(hidden, cache, attention_mask)
            rope = self.rotary_emb(hidden, positions) if self.rotary_emb is not None else None
            attention_rope = self.attention_rotary(hidden, positions) if self.attention_rotary is not None else None
        mask = None
        if attention_mask is not None:
            mask = attention_mask[:, -hidden.shape[1]:].bool()
            mask = None if bool(mask.all()) else mask  # decoding steps after a left-padded prompt
        if cache is not None and cache.capacity is not None and cache.seen_tokens + hidden.shape[1] > cache.capacity:
            raise ValueError(f"the cache's fixed KV room ({cache.capacity} tokens) is full: {cache.seen_tokens} seen, "
                             f"{hidden.shape[1]} more given")
        for i, block in enumerate(self.layers):
            prior = cache.states[i] if cache is not None else None
            # a kept attention layer reads the teacher's rotary of its layer and the mask over every key, cached ones
            # included; a mixer its layer's entry of the student's rotary (when that is a LayerRope)
            args = ((layer_rope(attention_rope, i), attention_mask) if isinstance(block, AttentionBlock)
                    else (rope, mask))
            if self.gradient_checkpointing and self.training and i in self.recompute_blocks:
                hidden, state = self._gradient_checkpointing_func(block.__call__, hidden, args[0], prior, use_cache,
                                                                  args[1])
            else:
                hidden, state = block(hidden, args[0], prior, use_cache, args[1])
            if layer_outputs is not None:
                layer_outputs.append(hidden)
            if use_cache:
                cache.states[i] = state
        if use_cache:
            cache.seen_tokens += hidden.shape[1]
            if cache.positions is not None:
                cache.positions.add_(hidden.shape[1])
        return self.norm(hidden)

    @staticmethod
    def _positions(hidden: torch.Tensor, cache: Optional[RecurrentCache],
                   attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """Rotary positions `[B, T]` of the new tokens: seen..seen+T-1 without a mask; with one, each token's count
        of real tokens before it (transformers' cumsum(mask) - 1; padded tokens get 0)."""
        length = hidden.shape[1]
        if attention_mask is None and cache is not None and cache.positions is not None:
            return cache.positions[:, None] + torch.arange(length, device=hidden.device)[None]
        if attention_mask is None:
            start = cache.seen_tokens if cache is not None else 0
            positions = torch.arange(start, start + length, device=hidden.device)[None]
            return positions.expand(hidden.shape[0], -1)
        counted = attention_mask.long().cumsum(-1) - 1
        return counted.clamp_min(0)[:, -length:].to(hidden.device)


class HarnessForCausalLM(HarnessPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: HarnessConfig):
        super().__init__(config)
        self.model = HarnessModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
        self.no_weight_decay_names = frozenset(name for name, p in self.named_parameters()
                                               if getattr(p, "_no_weight_decay", False))

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any):
        """transformers' loader, then the mixers' no-weight-decay marks (`harness.mixers.no_weight_decay`) back on
        the parameters: the loader puts new Parameter objects in place of those the model was built with."""
        loaded = super().from_pretrained(*args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded  # output_loading_info=True: (model, info)
        for name in model.no_weight_decay_names:
            no_weight_decay(model.get_parameter(name))
        return loaded

    def enable_recompute(self, fraction: float = 1.0) -> list[int]:
        """Gradient checkpointing of round(fraction x layers) blocks (at least one), spread evenly over the
        depth; returns their indices. Each recomputed block saves its activations for one more forward."""
        n = self.config.num_hidden_layers
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction={fraction} must lie in (0, 1]")
        k = max(1, round(n * fraction))
        self.model.recompute_blocks = frozenset(int((j + 0.5) * n / k) for j in range(k))
        kwargs = {"use_reentrant": False}
        if hasattr(self, "activation_checkpointing_enable"):  # transformers >= 5.2x; the old name warns there
            self.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            self.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return sorted(self.model.recompute_blocks)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # our layers keep recurrent states, not key/value caches

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, labels=None,
                past_key_values=None, cache=None, use_cache: Optional[bool] = None, logits_to_keep: int = 0,
                **kwargs: Any) -> StudentOutput:
        """Logits for every position (or the last `logits_to_keep`), soft-capped as the teacher's where it caps them
        (`final_logit_softcapping`, Gemma 2/3). `attention_mask` (1 = token, 0 = padding) may
        pad on the left (generation) or the right (scoring), on either backend: each row's logits at its real
        tokens, and after left padding its states, are those of the row alone. With a cache, the mask covers the
        cached tokens too (`[B, seen + T]`, as `generate` passes it). After right padding the conv tail holds the
        padding: continue decoding only from left-padded rows. No mask, or one of all ones, is the unpadded path."""
        state = cache if cache is not None else past_key_values
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None
        if attention_mask is not None:
            _check_mask_length(attention_mask, input_ids if inputs_embeds is None else inputs_embeds, state)
        use_cache = bool(use_cache) or state is not None
        if use_cache and state is None:
            state = RecurrentCache(self.config.num_hidden_layers)
        hidden = self.model(input_ids, inputs_embeds, state, use_cache, attention_mask)
        keep = slice(-logits_to_keep, None) if logits_to_keep else slice(None)
        logits = softcap(self.lm_head(hidden[:, keep]), self.config.final_logit_softcapping)
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                               ignore_index=-100)
        out = StudentOutput(loss=loss, logits=logits)
        if use_cache:  # set after construction: transformers >= 5.2x renames the kwargs in __init__
            out["past_key_values"] = out["cache"] = state
        return out

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, cache=None, attention_mask=None,
                                      inputs_embeds=None, use_cache=True, next_sequence_length=None, **kwargs):
        """The tokens the cache has not seen. With `inputs_embeds` the first step takes the embeddings, and
        `input_ids` then holds only the generated tokens, so the new ones are counted from the end: by
        `next_sequence_length` (transformers >= 5.2x), else by the mask, which covers prompt and generated tokens."""
        state = cache if cache is not None else past_key_values
        seen = state.seen_tokens if isinstance(state, RecurrentCache) else 0
        inputs = {"use_cache": use_cache, "attention_mask": attention_mask, "cache": state}
        if inputs_embeds is not None and seen == 0:
            return {**inputs, "inputs_embeds": inputs_embeds}
        if next_sequence_length is not None and seen > 0:
            new = next_sequence_length
        elif attention_mask is not None and seen > 0:
            new = attention_mask.shape[1] - seen
        else:
            new = input_ids.shape[1] - seen
        return {**inputs, "input_ids": input_ids[:, input_ids.shape[1] - new:]}


def _check_mask_length(attention_mask: torch.Tensor, tokens: torch.Tensor, cache: Optional[RecurrentCache]) -> None:
    """A padding mask must cover the cached tokens and the new ones: its prefix is where the rotary positions
    of the new tokens start from."""
    seen = cache.seen_tokens if isinstance(cache, RecurrentCache) else 0
    expected = (tokens.shape[0], seen + tokens.shape[1])
    if tuple(attention_mask.shape[:2]) != expected:
        raise ValueError(f"attention_mask of shape {tuple(attention_mask.shape)} must be [batch, cached + new tokens] "
                         f"= {list(expected)} when it pads")


def attach_teacher_rope(mixer: Mixer, config: Any) -> None:
    """A mixer with a sliding window (`options.window`) rotates its window's q and k as the teacher's layer does: the
    teacher's rotary embedding of that layer (its own base, not the mixer's `rope_theta`; none on a layer without)."""
    if mixer.options.window:
        mixer.attach_window_rotary(layer_rotary(config, mixer.layer_idx))


def student_rotary(config: HarnessConfig) -> Optional[nn.Module]:
    """The rotary embedding of a student whose mixer options say `rope: true` (None otherwise): the teacher's (per
    layer where its layers' RoPE differs: `harness.layouts.model_rotary`), with the base `rope_theta` when that
    option is set (on every layer that has RoPE)."""
    options = config.mixer_options or {}
    if not options.get("rope", False):
        return None
    theta = options.get("rope_theta")
    return model_rotary(config, float(theta) if theta is not None else None)


AutoConfig.register(HarnessConfig.model_type, HarnessConfig, exist_ok=True)
AutoModelForCausalLM.register(HarnessConfig, HarnessForCausalLM, exist_ok=True)


# ---------------------------------------------------------------- building from a teacher


def rope_for(config: HarnessConfig, device: torch.device) -> Callable[[torch.Tensor], Any]:
    """ids [B, T] -> the student's position embeddings for them (positions 0..T-1, as the teacher's: (cos, sin), or a
    LayerRope from which each mixer reads its layer's), or None when its mixer does not use RoPE: what a mixer reads
    outside a whole student (stages 1-2, the scale fit)."""
    rotary = student_rotary(config)
    if rotary is None:
        return lambda ids: None
    rotary = rotary.to(device)

    def rope(ids: torch.Tensor) -> Any:
        pos = torch.arange(ids.shape[1], device=device)[None].expand(ids.shape[0], -1)
        return rotary(torch.empty(0, device=device, dtype=torch.float32), pos)

    return rope


def build_student(teacher: Any, mixer: str, *, fit_on: Optional[torch.Tensor] = None,
                  attention_layers: Sequence[int] = (), **options: Any) -> HarnessForCausalLM:
    """A student of `teacher` (a `harness.teacher.Teacher` or a Llama-style causal LM) with `mixer` layers.

    Embeddings, norms, MLPs and the (tied) head are copied; each mixer gets the teacher attention's
    Q, K, V, O (K/V expanded over the query heads) and its new parameters as its options say (docs/TRANSFER.md).
    attention_layers: layers that keep the teacher's softmax attention (a hybrid), copied bit for bit.
    fit_on: token ids `[B, T]` on which each mixer's output scale is fitted to the teacher's attention heads
    (options.output_scale), as stage 1 does on its first batch; None leaves the scales as built.
    """
    model = teacher if isinstance(teacher, nn.Module) else teacher.model
    mixer_options(mixer, options)  # validates before anything is built
    config = student_config(model.config, mixer, options, attention_layers)
    dtype = next(model.parameters()).dtype
    student = HarnessForCausalLM(config).to(dtype)
    copy_teacher_weights(model, student)
    warn_zero_embedding_rows(student)
    if fit_on is not None:
        from harness.teacher import capture_activations

        ids = fit_on.to(next(model.parameters()).device)
        acts = capture_activations(model, ids, kinds=FIT_KINDS)
        rope = rope_for(config, ids.device)(ids)
        student.to(ids.device)
        fit_output_scales({i: layer.mixer for i, layer in enumerate(student.model.layers)
                           if isinstance(layer, StudentBlock)}, acts, rope)
    return student


FIT_KINDS = ("attn_input", "attn_heads")  # the teacher activations fit_output_scales reads


@torch.no_grad()
def fit_output_scales(mixers: dict[int, Mixer], acts: Any, rope: Any,
                      autocast: Any = contextlib.nullcontext()) -> None:
    """Each mixer's `fit_output_scale` (options.output_scale) on the teacher's activations `acts` (FIT_KINDS of
    the layers in `mixers`): layer l's input and its attention heads' output. The mixers run under `autocast`, as
    the stage that trains them does (the sums of the fit are float32)."""
    for layer, mixer in mixers.items():
        with autocast:
            mixer.fit_output_scale(acts.attn_input[layer].to(mixer.o_proj.weight.dtype), acts.attn_heads[layer], rope)


def zero_embedding_rows(embedding: torch.Tensor) -> list[int]:
    """Token ids whose embedding row is exactly zero (none for a trained model; Hugging Face zeroes the
    padding_idx row of a freshly initialised one)."""
    if embedding.numel() == 0:  # a ZeRO-3 partition: nothing to look at here
        return []
    return (embedding == 0).all(-1).nonzero().flatten().tolist()


def warn_zero_embedding_rows(student: HarnessForCausalLM) -> None:
    """A token with an all-zero embedding can keep an exactly zero hidden state through every block of a student
    (a mixer whose output gate maps zero to zero, as Gated DeltaNet's does, and an MLP without bias), so each
    RMSNorm's backward multiplies its gradient by 1/sqrt(eps): about 100x per block, an overflow to inf by the
    bottom of a 24-block 1.7B Gated DeltaNet student (docs/BENCHMARKS.md, runs 16-18), where every step whose batch
    holds such a token is skipped; in a shallower student that one token's gradient dominates the clipped step."""
    rows = zero_embedding_rows(student.model.embed_tokens.weight)
    if rows:
        warnings.warn(f"the teacher's embedding rows of token id(s) {rows[:8]}{' ...' if len(rows) > 8 else ''} "
                      "are all zero: where the data holds such a token, the student's gradient there can grow ~100x "
                      "per block (overflow, skipped steps). Train on data without these tokens, or give the rows "
                      "values.",
                      RuntimeWarning, stacklevel=3)


def student_config(teacher_config: Any, mixer: str, options: dict[str, Any],
                   attention_layers: Sequence[int] = ()) -> HarnessConfig:
    """The config of a `mixer` student of a teacher with `teacher_config`: the teacher's geometry and attention layout
    (biases, q/k norms), what it computes beyond Llama's decoder (`student_layout`: Gemma's norms, embedding scale and
    soft-capping, RoPE per layer), the mixer and every one of its options, and the layers that keep softmax attention
    (`attention_layers`, sorted; None when there are none, as in a student saved before hybrids existed). A teacher
    config that sets what the student would not carry is a TeacherLoadError naming it (`check_teacher_config`)."""
    check_teacher_config(teacher_config)
    kept = sorted(int(i) for i in attention_layers)
    outside = [i for i in kept if not 0 <= i < teacher_config.num_hidden_layers]
    if outside or len(set(kept)) != len(kept):
        raise ValueError(f"attention_layers {list(attention_layers)} must be distinct layers of the "
                         f"{teacher_config.num_hidden_layers}-layer teacher (0-{teacher_config.num_hidden_layers - 1})")
    fields = {k: v for k, v in teacher_config.to_dict().items() if k in HarnessConfig.__dataclass_fields__}
    for drop in ("model_type", "architectures", "quantization_config", "transformers_version", "dtype",
                 "qkv_bias", "o_bias", "qk_norm", "attention_layers", "attention_windows"):
        fields.pop(drop, None)
    fields.update(student_layout(teacher_config))
    layout = asdict(attention_layout(teacher_config))
    windows = [teacher_window(teacher_config, i) for i in kept]
    return HarnessConfig(**fields, **layout, mixer=mixer, mixer_options=resolved_options(mixer, options),
                         attention_layers=kept or None, attention_windows=windows if any(windows) else None,
                         architectures=["HarnessForCausalLM"])


@torch.no_grad()
def copy_teacher_weights(teacher: nn.Module, student: HarnessForCausalLM) -> None:
    """The teacher's embedding, final norm, head (unless tied) and, in every block, each part under the teacher's
    name (its norms, Gemma 2/3's four, and its MLP) bit for bit; a kept layer's attention bit for bit, a mixer
    transferred from the teacher's attention (and its new parameters initialised)."""
    tm, sm = teacher.model, student.model
    sm.embed_tokens.load_state_dict(tm.embed_tokens.state_dict())
    sm.norm.load_state_dict(tm.norm.state_dict())
    if not student.config.tie_word_embeddings:
        student.lm_head.load_state_dict(teacher.lm_head.state_dict())
    for t_layer, s_layer in zip(tm.layers, sm.layers):
        for name, part in s_layer.named_children():
            if name not in ("mixer", "self_attn"):
                part.load_state_dict(getattr(t_layer, name).state_dict())
        if isinstance(s_layer, AttentionBlock):
            copy_attention(t_layer.self_attn, s_layer.self_attn)
        else:
            s_layer.mixer.transfer_from_attention(t_layer.self_attn)
            s_layer.mixer.reset_new_parameters()


def copy_attention(teacher_attn: nn.Module, kept: SoftmaxAttention) -> None:
    """The teacher attention's tensors into a kept layer's SoftmaxAttention, bit for bit, by their names (the
    teacher's non-persistent rotary buffers, if its attention holds any, are not ours)."""
    theirs = teacher_attn.state_dict()
    missing = [k for k in kept.state_dict() if k not in theirs]
    if missing:
        raise ValueError(f"the teacher's attention has no {missing} for kept layer {kept.layer_idx}")
    kept.load_state_dict({k: theirs[k] for k in kept.state_dict()})


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (tied weights counted once), also under ZeRO-3, whose partitioned parameters report
    numel() 0 (DeepSpeed keeps the full size in `ds_numel`)."""
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in {id(p): p for p in model.parameters()}.values())
