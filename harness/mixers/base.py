"""What every token mixer shares: shapes, options, Q/K/V/O projections, weight transfer, decoding state.

A mixer replaces one softmax-attention block. It keeps the teacher's head layout (num_heads query heads
of head_dim each) so the teacher's Q, K, V, O projections fit; grouped K/V heads are expanded so that
student head j takes teacher KV head j // n_rep (the order of transformers' `repeat_kv`).
Subclasses add their own parameters and implement `_mix` (recurrence over q, k, v) and `_output`
(gate/norm before o_proj).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Optional

import torch
import torch.nn.functional as F
from torch import nn

from harness.layouts import layer_rope, norm_class
from harness.mixers.kernel_case import KernelCase
from harness.mixers.kernels import resolve_backend
from harness.mixers.ops import apply_rope, expand_kv, l2norm, rotate_half_rope
from harness.mixers.window import WINDOW_BACKENDS, WindowCache, window_attention


@dataclass
class MixerShape:
    """The teacher attention's geometry, which the student mixer keeps, the layout of its projections
    (`harness.teacher_families.AttentionLayout`: biases, Qwen3's and Gemma 3's per-head q/k RMSNorm), the kind of
    that norm (`norm_style`: Gemma's scales by 1 + weight), and what its softmax computes beyond Llama's: the scale
    query_pre_attn_scalar ** -0.5 (Gemma 2/3; None: head_dim ** -0.5) and the scores' tanh soft-capping (`softcap`,
    Gemma 2's attn_logit_softcapping). The scale and the cap act where a softmax over the teacher's q and k is
    computed (kept attention layers, a mixer's sliding window); a mixer's recurrence keeps its own scale,
    head_dim ** -0.5, and has no softmax to cap."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    norm_eps: float = 1e-6  # of the q/k norms
    norm_style: Optional[str] = None  # of the q/k norms: None (Llama's RMSNorm) or "gemma"
    query_pre_attn_scalar: Optional[float] = None
    softcap: Optional[float] = None

    @property
    def attention_scale(self) -> float:
        """The softmax attention's scale of q.k: query_pre_attn_scalar ** -0.5 where set, else head_dim ** -0.5."""
        scalar = self.query_pre_attn_scalar
        return (scalar if scalar is not None else self.head_dim) ** -0.5

    @property
    def n_rep(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_config(cls, config: Any) -> "MixerShape":
        """From a student's config, or a teacher's (and a student's saved before the layout fields existed, which
        has only Llama's `attention_bias`): its layout as `harness.teacher_families.attention_layout` reads it, and
        the rest as `student_layout` does."""
        heads = config.num_attention_heads
        layout = {name: getattr(config, name, None) for name in ("qkv_bias", "o_bias", "qk_norm")}
        if any(v is None for v in layout.values()):
            from harness.teacher_families import attention_layout

            layout = asdict(attention_layout(config))
        if hasattr(config, "mixer"):  # a student's config holds the rest (None in one saved before they existed)
            softmax = {name: getattr(config, name, None) for name in
                       ("norm_style", "query_pre_attn_scalar", "attn_logit_softcapping")}
        else:
            from harness.teacher_families import student_layout

            softmax = student_layout(config)
        return cls(
            hidden_size=config.hidden_size,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            **{name: bool(value) for name, value in layout.items()},
            norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
            norm_style=softmax["norm_style"],
            query_pre_attn_scalar=softmax["query_pre_attn_scalar"],
            softcap=softmax["attn_logit_softcapping"],
        )


OUTPUT_SCALES = ("fit", "rms", "none")
# what runs the short convolution and the gated norm on the kernel backend: (convolution, norm) for each choice;
# compiled-norm is the pair that the H100 micro-bench found fastest (docs/BENCHMARKS.md, "The pieces alone")
PIECES = {"fla": ("fla", "fla"), "compiled": ("compiled", "compiled"), "compiled-norm": ("fla", "compiled")}


def piece_route(fused: "bool | str", piece: int) -> str:
    """What runs piece 0 (the convolution) or 1 (the norm) for a `fused` argument: a PIECES choice, True for fla,
    False or '' for the PyTorch form ('')."""
    if isinstance(fused, str) and fused:
        return PIECES[fused][piece]
    return "fla" if fused else ""


@dataclass
class MixerOptions:
    """Options every mixer takes; subclasses add their own fields (each with a description)."""

    rope: bool = field(default=False, metadata={"help": "Apply the teacher's rotary embedding to q and k."})
    rope_theta: Optional[float] = field(
        default=None, metadata={"help": "With rope: the rotary base; null takes the teacher's (SmolLM2: 100000). "
                                "10000 is the rotation of the published RetNet and of fla's layers."})
    chunk_size: int = field(default=64, metadata={"help": "Chunk length of the PyTorch chunkwise form."})
    window: int = field(
        default=0, metadata={"help": "Sliding-window softmax attention beside the recurrence in the same layer "
                             "(LoLCATs-style; 0: off): each token also attends, by the teacher's softmax over its q "
                             "and k with the teacher's RoPE, to itself and the window - 1 tokens before it. The window's "
                             "heads output is added to the mixer's, scaled per head by window_gain, which starts at 0: "
                             "at step 0 the layer is the teacher's attention cut to the window (docs/TRANSFER.md)."})
    backend: str = field(
        default="auto", metadata={"help": "auto (kernel on CUDA, else reference), kernel or reference."}
    )
    window_backend: str = field(
        default="auto", metadata={"help": "With a window: auto (fla's parallel_attn kernel where the mixer's backend "
                                  "is the kernel and the rows are unpadded, else the PyTorch blockwise form) or "
                                  "blockwise (always the PyTorch form, softmax in float32: slower, and what the "
                                  "kernel is checked against in tests/gpu/test_window_gpu.py)."})
    output_scale: str = field(
        default="fit", metadata={"help": "How stage 1 sets the scale of the heads' output before it trains: fit "
                                 "(on its first batch, each channel of o_proj's input gets the least-squares scale "
                                 "to the teacher's heads there, folded into o_proj's copied weight; "
                                 "docs/TRANSFER.md), rms (the teacher's RMS per channel) or none (as built)."}
    )
    pieces: str = field(
        default="fla", metadata={"help": "On the kernel backend, what runs the pieces around the recurrence (the "
                                 "short convolution and the gated output norm): fla (its Triton kernels), compiled "
                                 "(their PyTorch forms under torch.compile, one fused kernel each way) or "
                                 "compiled-norm (fla's convolution, the compiled norm). The same numbers to bf16 "
                                 "rounding. On an H100 the compiled norm alone is 1.8x faster than fla's and fla's "
                                 "convolution 1.6x faster than the compiled one (benchmarks/mixer_pieces.py), yet the "
                                 "135M step with compiled-norm is no faster than with fla (docs/BENCHMARKS.md, 'The "
                                 "speed options stepped'), so fla stays the default. The reference backend always "
                                 "runs the PyTorch forms; a mixer without these pieces ignores it."}
    )

    def __post_init__(self) -> None:
        self.check_choice("backend", ("auto", "kernel", "reference"))
        self.check_choice("window_backend", WINDOW_BACKENDS)
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size={self.chunk_size} must be >= 1")
        self.check_choice("output_scale", OUTPUT_SCALES)
        self.check_choice("pieces", PIECES)
        if self.rope_theta is not None and self.rope_theta <= 0:
            raise ValueError(f"rope_theta={self.rope_theta} must be > 0 (or null for the teacher's)")
        if self.window < 0:
            raise ValueError(f"window={self.window} must be >= 0 (0: no sliding window)")

    def check_choice(self, name: str, allowed: Collection[str]) -> None:
        """A ValueError naming the option, its value and what is allowed, unless the value is one of `allowed`."""
        value = getattr(self, name)
        if value not in allowed:
            raise ValueError(f"{name}='{value}' is not one of {', '.join(allowed)}")


@dataclass
class MixerState:
    """Decoding state of one mixer layer: the recurrent state, with short convolutions the conv tail, and with a
    sliding window (`options.window`) its last keys and values (`harness.mixers.window.WindowCache`)."""

    recurrent: Any = None
    conv: Optional[torch.Tensor] = None
    window: Optional[WindowCache] = None

    def map(self, fn) -> "MixerState":
        def apply(x):
            if isinstance(x, torch.Tensor):
                return fn(x)
            if isinstance(x, tuple) and hasattr(x, "_fields"):  # a NamedTuple takes its fields positionally
                return type(x)(*(apply(y) for y in x))
            if isinstance(x, (tuple, list)):
                return type(x)(apply(y) for y in x)
            return x

        return MixerState(apply(self.recurrent), apply(self.conv), apply(self.window))

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the state, in a fixed order (the order `map` visits them)."""
        found: list[torch.Tensor] = []
        self.map(lambda t: found.append(t) or t)
        return found


class Mixer(nn.Module):
    """Base class: projections, rope, weight transfer, backend choice. Input/output `[B, T, hidden]`."""

    name: ClassVar[str]
    Options: ClassVar[type[MixerOptions]] = MixerOptions
    # its recurrence on the kernel backend, for the recurrence bench and the GPU kernel tests (None: no kernel case)
    kernel_case: ClassVar[Optional[KernelCase]] = None
    # the modules whose outputs are the values the state stores: with all of them zero the mixer outputs 0 (the
    # contract's zeroed_values_give_the_teacher zeroes those beyond v_proj, which transfer copies from the teacher)
    value_projections: ClassVar[tuple[str, ...]] = ("v_proj",)
    # whether its decoding state grows with the context (a KV cache, fox's) rather than keeping a fixed size: its
    # recurrent state then stacks rows of different lengths itself (`stack_left_padded`), and decoding steps change
    # shape, so no CUDA graph captures them (harness.decoding)
    growing_state: ClassVar[bool] = False

    def __init__(self, shape: MixerShape, options: MixerOptions, layer_idx: int = 0):
        super().__init__()
        self.shape, self.options, self.layer_idx = shape, options, layer_idx
        inner = shape.num_heads * shape.head_dim
        self.q_proj = nn.Linear(shape.hidden_size, inner, bias=shape.qkv_bias)
        self.k_proj = nn.Linear(shape.hidden_size, inner, bias=shape.qkv_bias)
        self.v_proj = nn.Linear(shape.hidden_size, inner, bias=shape.qkv_bias)
        self.o_proj = nn.Linear(inner, shape.hidden_size, bias=shape.o_bias)
        if shape.qk_norm:  # Qwen3, Gemma 3: RMSNorm over each head of q and k, before RoPE (and here before any conv);
            # the teacher's own norm class, which rounds as the teacher does in bf16 (Llama's: the weight multiplies
            # after the cast; Gemma's: 1 + weight multiplies in float32, before it)
            norm = norm_class(shape.norm_style)
            self.q_norm = norm(shape.head_dim, eps=shape.norm_eps)
            self.k_norm = norm(shape.head_dim, eps=shape.norm_eps)
        self.window_rotary: Optional[nn.Module] = None  # the teacher's RoPE for the window (attach_window_rotary)
        if options.window:
            self.window_gain = nn.Parameter(torch.zeros(shape.num_heads))

    def attach_window_rotary(self, rotary: Optional[nn.Module]) -> None:
        """Give a mixer with a sliding window the teacher's rotary embedding of its layer (a transformers rotary
        module: (x, position_ids) -> (cos, sin)), which its window applies to q and k; None for a teacher layer
        without RoPE."""
        self.window_rotary = rotary

    # ---------------------------------------------------------------- forward
    def forward(
        self,
        x: torch.Tensor,
        *,
        position_embeddings: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        state: Optional[MixerState] = None,
        use_cache: bool = False,
        mask: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, Optional[MixerState]]:
        """x `[B, T, hidden]` -> (y `[B, T, hidden]`, new state if use_cache else None). mask: None, or bool
        `[B, T]` False at padded tokens, which leave the state (recurrence and conv tail) untouched.
        position_embeddings: (cos, sin), or a `harness.layouts.LayerRope` whose entry for this layer is read (None
        there: a teacher layer without RoPE, which a rope mixer then does not rotate either)."""
        heads, new_state = self.heads_output(x, position_embeddings=position_embeddings, state=state,
                                             use_cache=use_cache, mask=mask)
        return self.o_proj(heads), new_state

    def heads_output(self, x: torch.Tensor, *, position_embeddings=None, state: Optional[MixerState] = None,
                     use_cache: bool = False, mask: Optional[torch.Tensor] = None,
                     ) -> tuple[torch.Tensor, Optional[MixerState]]:
        """What o_proj reads, `[B, T, heads x head_dim]` in x's dtype (the teacher's counterpart is its attention
        heads' output), and the new state if use_cache; mask as in `forward`."""
        projected = (*self.project_qk(x), self.v_proj(x)) if self.options.window else None
        q, k, v, conv_state = self.project_qkv(x, state, use_cache, mask=mask, projected=projected)
        if self.options.rope:
            if position_embeddings is None:
                raise ValueError(f"{self.name}: rope=True needs position_embeddings from the model")
            rope = layer_rope(position_embeddings, self.layer_idx)
            if rope is not None:
                q, k = apply_rope(q, k, *rope)
        prior = state.recurrent if state is not None else None
        backend = self.backend_for(x)
        o, recurrent = self._mix(x, q, k, v, prior, backend, mask=mask)
        heads = self._output(x, o).to(x.dtype)
        window = None
        if self.options.window:
            local, window = self._window(projected, mask, state.window if state is not None else None, use_cache,
                                         backend)
            heads = local.to(x.dtype) + heads * self.window_gain.to(x.dtype)[:, None]
        return heads.flatten(2), (MixerState(recurrent, conv_state, window) if use_cache else None)

    def _window(self, projected, mask, prior: Optional[WindowCache], use_cache: bool, backend: str):
        """The sliding-window softmax attention `[B, T, H, D]` over the teacher's q, k (RoPE'd here), v, with the
        teacher's scale and soft-capping, and its new cache if use_cache; on the resolved `backend` (fla's kernel
        where harness.mixers.window says it applies)."""
        q, k, v = (self._heads(t) for t in projected)
        rotate = self._rotate_for_window if self.window_rotary is not None else None
        return window_attention(q, k, v, self.options.window, scale=self.shape.attention_scale, mask=mask,
                                prior=prior, want_cache=use_cache, rotate=rotate, softcap=self.shape.softcap,
                                backend="reference" if self.options.window_backend == "blockwise" else backend)

    def _rotate_for_window(self, t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The teacher's RoPE (`window_rotary`) on t `[B, L, H, D]` at positions `[L]`."""
        cos, sin = self.window_rotary(t, positions[None])
        return rotate_half_rope(t, cos, sin)

    def project_qkv(self, x, state: Optional[MixerState], use_cache: bool, mask: Optional[torch.Tensor] = None,
                    projected: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None):
        """q, k, v `[B, T, H, D]` and the new conv state (None for mixers without a short convolution). mask:
        padded tokens, which a short convolution sees as zeros (the recurrence ignores them in `_mix`). projected:
        (q, k, v) `[B, T, H x D]` as `project_qk` and v_proj give them, when the caller has them already."""
        q, k, v = projected if projected is not None else (*self.project_qk(x), self.v_proj(x))
        return self._heads(q), self._heads(k), self._heads(v), None

    def project_qk(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k `[B, T, H x D]` as the teacher's attention makes them before RoPE: projected, and with per-head
        q/k norms where the teacher has them (Qwen3)."""
        q, k = self.q_proj(x), self.k_proj(x)
        if self.shape.qk_norm:
            q = self.q_norm(self._heads(q)).flatten(2)
            k = self.k_norm(self._heads(k)).flatten(2)
        return q, k

    def _mix(self, x, q, k, v, prior, backend: str, mask: Optional[torch.Tensor] = None):
        """The recurrence over q, k, v `[B, T, H, D]` from state `prior` -> (o `[B, T, H, D]`, new state); padded
        tokens (mask False) leave the state untouched."""
        raise NotImplementedError

    def score_features(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k `[B, T, H, D]` as the recurrence pairs them (after the mixer's feature map or normalisation, which
        `_mix` applies): their dot products are the mixer's attention scores before decay and gating (what
        `harness transfer` compares with the teacher's). Default: as projected."""
        return q, k

    def _output(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Per-head output `[B, T, H, D]` -> what o_proj consumes (gates/norms go here). Default: identity."""
        return o

    def backend_for(self, x: torch.Tensor) -> str:
        return resolve_backend(self.options.backend, x.device)

    def fused_ops(self, x: torch.Tensor) -> bool:
        """Whether the operators around the recurrence (short convolution, gated norm) take fla's fused Triton
        kernels too: on the kernel backend, so that the reference backend stays plain PyTorch throughout."""
        return self.backend_for(x) == "kernel"

    def pieces_for(self, x: torch.Tensor) -> str:
        """How the short convolution and the gated norm run for x: the `pieces` option on the kernel backend, else ''
        (their plain PyTorch forms)."""
        return self.options.pieces if self.fused_ops(x) else ""

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(-1, (self.shape.num_heads, self.shape.head_dim))

    # ---------------------------------------------------------------- weight transfer
    @torch.no_grad()
    def transfer_from_attention(self, attn: nn.Module) -> None:
        """Copy the teacher attention's Q, K, V, O (K and V expanded from the KV heads), their biases and its q/k norms
        bit for bit."""
        s = self.shape
        self.q_proj.weight.copy_(attn.q_proj.weight)
        self.o_proj.weight.copy_(attn.o_proj.weight)
        for name in ("k_proj", "v_proj"):
            src = getattr(attn, name)
            dst = getattr(self, name)
            dst.weight.copy_(expand_kv(src.weight, s.num_kv_heads, s.n_rep))
            if dst.bias is not None:
                dst.bias.copy_(expand_kv(src.bias, s.num_kv_heads, s.n_rep))
        for name in ("q_proj", "o_proj"):
            dst, src = getattr(self, name), getattr(attn, name)
            if dst.bias is not None:
                dst.bias.copy_(src.bias)
        if s.qk_norm:  # one weight over head_dim, shared by every head: no expansion
            self.q_norm.weight.copy_(attn.q_norm.weight)
            self.k_norm.weight.copy_(attn.k_norm.weight)
        if self.options.window:  # the window alone at step 0: the teacher's attention over the recent tokens
            self.window_gain.zero_()

    def reset_new_parameters(self) -> None:
        """Initialise the parameters the teacher does not have, as the mixer's authors do."""

    @torch.no_grad()
    def fit_output_scale(self, x: torch.Tensor, teacher_heads: torch.Tensor, position_embeddings=None) -> torch.Tensor:
        """Rescale o_proj's input channels as `options.output_scale` says, from this mixer's heads output on x
        `[B, T, hidden]` and the teacher's on the same input (`teacher_heads`, o_proj's input `[B, T, H x D]`):
        fit: the least-squares scale of each channel, s_c = <h_c, t_c> / <h_c, h_c> (over batch and tokens);
        rms: s_c = rms(t_c) / rms(h_c); none: unchanged. o_proj.weight[:, c] *= s_c is the same network with
        that scale on the heads' output (its norm and gate keep their init). Returns s `[H x D]` (float32)."""
        how = self.options.output_scale
        channels = self.o_proj.in_features
        if how == "none":
            return torch.ones(channels)
        h = self.heads_output(x, position_embeddings=position_embeddings)[0].float().reshape(-1, channels)
        t = teacher_heads.float().reshape(-1, channels)
        hh = (h * h).sum(0)
        if how == "fit":
            scale = (h * t).sum(0) / hh.clamp_min(1e-12)
        else:
            scale = (t * t).sum(0).sqrt() / hh.sqrt().clamp_min(1e-12)
        scale = torch.where(hh > 0, scale, torch.ones_like(scale))  # a channel that is always 0 keeps its column
        self.o_proj.weight.mul_(scale.to(self.o_proj.weight.dtype)[None, :])
        return scale

    @classmethod
    def new_parameter_names(cls) -> tuple[str, ...]:
        """Parameter-name prefixes that are not copied from the teacher."""
        return ()


def no_weight_decay(param: nn.Parameter) -> nn.Parameter:
    """Mark `param` as one AdamW does not decay (`harness.plain_engine.decays`), as fla's layers mark theirs with
    `_no_weight_decay`; returns it. The student keeps the marks across `from_pretrained`."""
    param._no_weight_decay = True
    return param


def gated_rms_norm(o: torch.Tensor, gate: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
                   activation: Optional[str]) -> torch.Tensor:
    """RMSNorm over o's last dim, times act(gate) when gated, computed in float32 and returned in o's dtype."""
    y = F.rms_norm(o.float(), (o.shape[-1],), weight.float(), eps)
    if gate is not None:
        y = y * (F.silu(gate.float()) if activation == "silu" else torch.sigmoid(gate.float()))
    return y.to(o.dtype)


def causal_conv_shifted(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                        activation: Optional[str]) -> torch.Tensor:
    """Depthwise causal convolution of x `[B, T, C]` with weight `[C, W]` (+ bias, then SiLU or nothing) as W shifted
    multiply-adds in float32, returned in x's dtype: the form `torch.compile` fuses into one kernel."""
    width, length = weight.shape[1], x.shape[1]
    padded = F.pad(x, (0, 0, width - 1, 0)).float()
    y = sum(padded[:, j:j + length] * weight[:, j].float() for j in range(width))
    if bias is not None:
        y = y + bias.float()
    return (F.silu(y) if activation == "silu" else y).to(x.dtype)


_COMPILED: dict[Any, Any] = {}


def compiled(fn):
    """`torch.compile(fn)`, made once per function and process (the `compiled` pieces)."""
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn)
    return _COMPILED[fn]


class HeadRMSNorm(nn.Module):
    """RMSNorm over each head's last dim, optionally gated: norm(o) * act(gate) (fla's FusedRMSNormGated)."""

    def __init__(self, head_dim: int, eps: float = 1e-5, activation: Optional[str] = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.eps, self.activation = eps, activation

    def forward(self, o: torch.Tensor, gate: Optional[torch.Tensor] = None, fused: "bool | str" = False
                ) -> torch.Tensor:
        """o, gate `[B, T, H, D]` -> norm(o) * act(gate) in o's dtype, computed in float32. fused (True or 'fla'):
        fla's Triton kernel (norm, gate and their backward in one kernel each, instead of ~8 elementwise operators)
        when o is on a GPU, gated, and longer than one token (one-token decoding steps stay in PyTorch, as the
        mixers' recurrences do, so that the CUDA-graph step captures no autotuning); a `pieces` choice runs its norm
        (PIECES: 'compiled' and 'compiled-norm' the PyTorch form under torch.compile), on the same condition."""
        how = piece_route(fused, 1)
        if how and gate is not None and o.is_cuda and o.shape[1] > 1:
            if how == "compiled":
                return compiled(gated_rms_norm)(o, gate, self.weight, self.eps, self.activation)
            from fla.modules.norm.fused_norm_gate import rms_norm_gated

            act = "swish" if self.activation == "silu" else "sigmoid"
            return rms_norm_gated(o, gate.to(o.dtype), self.weight, None, activation=act, eps=self.eps)
        return gated_rms_norm(o, gate, self.weight, self.eps, self.activation)


class ShortConv(nn.Module):
    """Depthwise causal convolution, then SiLU (or nothing), over `[B, T, C]` (fla's ShortConvolution), with a
    decoding tail.

    The state is the last `kernel_size - 1` inputs `[B, C, kernel_size - 1]`, a copy of its own (a view of the
    input would hold the whole prefill's q, k, v in memory for as long as a decoding cache lives).
    """

    def __init__(self, channels: int, kernel_size: int = 4, bias: bool = False, activation: Optional[str] = "silu"):
        super().__init__()
        self.conv = nn.Conv1d(channels, channels, kernel_size, groups=channels, bias=bias)
        self.kernel_size, self.activation = kernel_size, activation

    @torch.no_grad()
    def reset_parameters(self, how: str = "identity") -> None:
        """identity: weight 1 on each channel's current token, 0 on the earlier ones (and a zero bias), so that
        forward(x) is exactly act(x); random: PyTorch's Conv1d default (kaiming uniform)."""
        if how == "random":
            self.conv.reset_parameters()
            return
        self.conv.weight.zero_()
        self.conv.weight[..., -1] = 1.0
        if self.conv.bias is not None:
            self.conv.bias.zero_()

    def forward(self, x: torch.Tensor, tail: Optional[torch.Tensor] = None, fused: "bool | str" = False,
                want_tail: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """-> (act(conv(x)) `[B, T, C]`, the new tail, or None unless `want_tail`: training does not keep it).
        fused (True or 'fla'): fla's Triton causal-conv1d (convolution and activation in one kernel, on `[B, T, C]`
        as it is) when x is on a GPU and no tail is carried in; a `pieces` choice runs its convolution (PIECES:
        'compiled' is `causal_conv_shifted` under torch.compile), on the same condition; else PyTorch's conv1d."""
        how = piece_route(fused, 0)
        if how and tail is None and x.is_cuda:
            weight = self.conv.weight.squeeze(1)
            if how == "compiled":
                y = compiled(causal_conv_shifted)(x, weight, self.conv.bias, self.activation)
            else:
                from fla.modules.causal_conv1d import causal_conv1d

                y, _ = causal_conv1d(x, weight=weight, bias=self.conv.bias, activation=self.activation)
            return y, (self.tail_of(x) if want_tail else None)
        xt = x.transpose(1, 2)  # [B, C, T]
        if tail is None:
            tail = xt.new_zeros(xt.shape[0], xt.shape[1], self.kernel_size - 1)
        padded = torch.cat([tail.to(xt.dtype), xt], dim=-1)
        y = F.conv1d(padded, self.conv.weight, self.conv.bias, groups=xt.shape[1])
        y = F.silu(y) if self.activation == "silu" else y
        return y.transpose(1, 2), (padded[..., -(self.kernel_size - 1):].clone() if want_tail else None)

    def tail_of(self, x: torch.Tensor) -> torch.Tensor:
        """The state after x `[B, T, C]` from a zero state: its last kernel_size - 1 inputs `[B, C, kernel_size - 1]`,
        zero-padded on the left when T is shorter."""
        width = self.kernel_size - 1
        xt = x[:, -width:].transpose(1, 2)
        if xt.shape[-1] < width:
            xt = F.pad(xt, (width - xt.shape[-1], 0))
        return xt.clone()  # a copy: a view would keep the whole [B, T, C] input alive in a decoding cache


class ConvMixer(Mixer):
    """A mixer with fla's short causal convolution (+SiLU) on q, k and v: the delta rules (DeltaNet, Gated DeltaNet,
    KDA), which then L2-normalise q and k (inside the recurrence call: fla's kernel does it in-kernel), and Mamba2
    (its conv over x, B, C), which does not."""

    def __init__(self, shape: MixerShape, options, layer_idx: int = 0):
        super().__init__(shape, options, layer_idx)
        if options.short_conv:
            self.qkv_conv = ShortConv(self.conv_channels(), options.conv_size,
                                      activation=None if options.qkv_activation == "identity" else "silu")

    def conv_channels(self) -> int:
        """Channels of the short convolution: q, k and v."""
        return 3 * self.shape.num_heads * self.shape.head_dim

    def stacked_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """q, k, v projected together, `[B, T, 3 x H x D]`: one matmul over the three weights stacked (the stacking
        copies ~2 MB a layer at 135M; its backward splits the gradient back to each weight)."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        weight = torch.cat([p.weight for p in projections])
        bias = torch.cat([p.bias for p in projections]) if self.q_proj.bias is not None else None
        return F.linear(x, weight, bias)

    def project_qkv(self, x, state, use_cache, mask=None, projected=None):
        if projected is None and self.options.fused_qkv and not self.shape.qk_norm and self.fused_ops(x):
            qkv = self.stacked_qkv(x)
        else:
            qkv = torch.cat(projected if projected is not None else [*self.project_qk(x), self.v_proj(x)], dim=-1)
        qkv, tail = self.convolve(x, qkv, state, use_cache, mask)
        q, k, v = (self._heads(t) for t in qkv.chunk(3, dim=-1))
        return q, k, v, tail

    def convolve(self, x, qkv: torch.Tensor, state: Optional[MixerState], use_cache: bool,
                 mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The projections `[B, T, conv_channels]` through the short convolution (+ `qkv_activation`), or the
        activation alone without it -> (result, the new conv tail or None)."""
        tail = None
        if self.options.short_conv:
            if mask is not None:  # a padded input is a zero, as before the first token: left padding changes nothing
                qkv = torch.where(mask.unsqueeze(-1), qkv, 0.0)
            qkv, tail = self.qkv_conv(qkv, state.conv if state is not None else None,
                                      fused=self.pieces_for(x), want_tail=use_cache)
        elif self.options.qkv_activation == "silu":
            qkv = F.silu(qkv)
        return qkv, tail

    def score_features(self, q, k):
        return l2norm(q), l2norm(k)

    @torch.no_grad()
    def _reset_decay_norm_conv(self, a_low: Optional[float] = None) -> None:
        """The tail every delta-rule mixer's init shares: A_log ~ log U(a_low, 16) and the Mamba2 dt_bias (when
        the mixer has them), and the short convolution as `options.conv_init` says."""
        if a_low is not None:
            self.A_log.copy_(torch.log(torch.empty_like(self.A_log).uniform_(a_low, 16)))
            self.dt_bias.copy_(mamba_dt_bias(self.dt_bias.numel()))
        if self.options.short_conv:
            self.qkv_conv.reset_parameters(self.options.conv_init)


CONV_INITS = ("identity", "random")
QKV_ACTIVATIONS = ("silu", "identity")
GATE_INITS = ("open", "random")
# silu(SILU_ONE) = 1: the bias that makes a swish gate with zero weights pass its input through unchanged
SILU_ONE = 1.2784645427610738


@dataclass
class ConvOptions(MixerOptions):
    short_conv: bool = field(default=True, metadata={"help": "Short causal convolution (+SiLU) on q, k, v."})
    conv_size: int = field(default=4, metadata={"help": "Kernel size of the short convolution."})
    conv_init: str = field(
        default="identity", metadata={"help": "identity: each channel's tap on its current token is 1, the others "
                                      "0, so conv+SiLU is SiLU of the copied q, k, v at step 0 (docs/TRANSFER.md); "
                                      "random: PyTorch's default, as fla's layers (trained from scratch) use."})

    qkv_activation: str = field(
        default="identity", metadata={"help": "After the short convolution (or alone without it): identity keeps the "
                                      "copied q, k, v linear, as the teacher's are (q and k are L2-normalised either "
                                      "way); silu, as fla's delta-rule layers (docs/TRANSFER.md)."})
    fused_qkv: bool = field(
        default=True, metadata={"help": "On the kernel backend, project q, k and v with one matmul over their "
                                "weights stacked (and write the convolution's input directly) instead of three "
                                "matmuls and a concatenation; teachers with per-head q/k norms keep three. The "
                                "same parameters (q_proj, k_proj, v_proj) and the same sums up to bf16 rounding; "
                                "the 135M stage-3 step ~3.5% faster on an H100 (docs/BENCHMARKS.md, 'The speed "
                                "options stepped'). false: three matmuls, as runs before 2026-12-07."})

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_choice("qkv_activation", QKV_ACTIVATIONS)
        self.check_choice("conv_init", CONV_INITS)
        if self.conv_size < 1:
            raise ValueError(f"conv_size={self.conv_size} must be >= 1")


@dataclass
class GateOptions(MixerOptions):
    """Options of a mixer with an output gate on its normalised output (RetNet, GLA, Gated DeltaNet, KDA, mLSTM)."""

    gate_init: str = field(
        default="open", metadata={"help": "open: gate weights 0 and a constant gate whose product with the output "
                                  "norm's weight is 1, so the mixer passes its normalised recurrence output to the "
                                  "copied o_proj at step 0 (a swish gate's constant is its bias, which fla's layers "
                                  "lack; it starts at 0 under random); random: the authors' "
                                  "init (weights ~N(0, 0.02): the gate starts near silu(0) = 0 or sigmoid(0) = 1/2, "
                                  "varying per token at random)."})

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_choice("gate_init", GATE_INITS)


@dataclass
class GatedConvOptions(ConvOptions, GateOptions):
    """Options of Gated DeltaNet and KDA: the short convolution and the output gate."""


@torch.no_grad()
def init_output_gate(gate: nn.Linear, norm_weight: torch.Tensor, activation: str, how: str,
                     std: float = 0.02) -> None:
    """Initialise an output gate act(gate(x)) that multiplies norm(o) * norm_weight (activation silu or sigmoid).
    random: gate weights ~N(0, std), bias 0, norm weight 1. open: gate weights 0, so the gate is the constant
    c = act(bias) (silu: bias SILU_ONE, c = 1; sigmoid: bias 0, c = 1/2), and norm weight 1 / c: the product is 1."""
    if how == "random":
        nn.init.normal_(gate.weight, std=std)
        if gate.bias is not None:
            nn.init.zeros_(gate.bias)
        norm_weight.fill_(1.0)
        return
    nn.init.zeros_(gate.weight)
    if activation == "silu":
        if gate.bias is None:
            raise ValueError("an open swish gate needs a bias (silu(0) = 0)")
        gate.bias.fill_(SILU_ONE)
        norm_weight.fill_(1.0)
    else:
        if gate.bias is not None:
            nn.init.zeros_(gate.bias)
        norm_weight.fill_(2.0)


def mamba_dt_bias(n: int, dt_min: float = 1e-3, dt_max: float = 0.1, floor: float = 1e-4) -> torch.Tensor:
    """Inverse-softplus of dt ~ LogUniform(dt_min, dt_max): the Mamba2 / Gated DeltaNet / KDA dt_bias init."""
    import math

    dt = torch.exp(torch.rand(n) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=floor)
    return dt + torch.log(-torch.expm1(-dt))
