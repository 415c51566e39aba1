"""GPU kernel path of the recurrences in docs/RECURRENCES.md: fla.ops for the gated-delta family (gated
DeltaProduct included), RWKV-7's DPLR delta rule and gated slot attention, mlstm_kernels for the mLSTM; and of
the softmax attentions: the sliding window of `options.window` (fla's parallel_attn), the fox mixer's
forgetting attention (fla's parallel_forgetting_attn) and the path mixer's PaTH attention (fla's parallel_path_attn).
CUDA only; the PyTorch references (harness.mixers.recurrence, harness.mixers.window, harness.mixers.fox,
harness.mixers.path) are the oracles.

Nothing here imports fla, triton or mlstm_kernels at module import time: this module is imported on CPU
machines (CI) where triton does not exist. The kernel libraries are imported inside the functions.

Conventions found in fla 0.6.0 (fla/ops/*/chunk.py) and mlstm_kernels 2.0.6, which this module adapts to:

- Layout: fla takes `[B, T, H, D]` (our layout; `head_first` is gone in 0.6.0); states `[B, H, K, V]`
  (`state_v_first=False`, the default), final states always float32. mlstm_kernels takes `[B, H, T, D]`,
  gates `[B, H, T]`, m `[B, H, 1]`; we transpose and reshape.
- Decay g: natural-log decay (`S <- exp(g) S`); fla multiplies by 1/ln2 itself (RCP_LN2 inside
  `chunk_local_cumsum`) and works in log2 internally. We pass our g as is (float32, values <= 0).
  Per-head g is `[B, T, H]` (simple_gla, gated_delta_rule), per-channel g is `[B, T, H, K]` (gla, kda).
  KDA and GDN are called with `use_gate_in_kernel=False` (g is the final log decay, no in-kernel
  `-exp(A_log) * softplus(.)`), `use_beta_sigmoid_in_kernel=False` (beta already in (0, 1)),
  `safe_gate=False` (our gates are not bounded below). DeltaNet, GDN and KDA ask for L2-normalised q and k
  (`normalize_qk=True`): `use_qk_l2norm_in_kernel=True` on the delta_rule / gated_delta_rule / kda routes
  (fla's l2norm, x / sqrt(sum x^2 + 1e-6), our `l2norm`'s formula), our `l2norm` before any other route.
- scale: every fla op applies `scale` to q inside (o = scale * S^T q), as the contract does; pass it.
  mlstm_kernels' triton_limit_chunk always uses scale = K^-0.5 (its autograd Function calls the backward
  without qk_scale), so q is pre-multiplied by scale * sqrt(K) when the requested scale differs.
- Sequence length: fla's chunk ops accept any T (they mask the last partial chunk). mlstm_kernels asserts
  T % chunk_size == 0, so we pad T at the end (see `kernel_mlstm`).
- dtypes: fla's chunk_delta_rule refuses float32 q/k/v; kernels run in 16-bit. We compute in v's dtype when
  it is bf16/fp16, else in bf16 (a float32 caller gets float32 outputs back, computed in bf16; use the
  reference backend for a true float32 recurrence). g is float32; beta is passed in its own dtype; initial
  states are cast to float32 (gla and kda assert it).
- Known GPU trap (fla 0.6.0 on Hopper with triton >= 3.4, < 3.7.1, i.e. the H200's triton 3.6):
  fla's gated `chunk_bwd_dqkwg` raises "produces incorrect results ... install tilelang" unless its TileLang
  backend takes the call. TileLang accepts it for gated_delta_rule, but not for simple_gla with a
  per-head g, whose backward keeps its states in float32 (the TileLang verifier wants h.dtype == q.dtype).
  So on such a machine, when gradients are needed, per-head g without beta is routed through chunk_gla (g
  broadcast over K), and gated_delta_rule without a usable TileLang through chunk_kda (g broadcast over K).
  A constant per-head decay (RetNet: g is an expanded `[H]` tensor with zero batch/time strides and no
  gradient) goes through chunk_simple_gla's `g_gamma` (fla's chunk_retention path), which that guard
  does not cover. Caution: the miscompile behind the guard (fla issue #640) is reported at BK = 64, which is
  what K = 64 heads give, and the g_gamma and g=None branches of that kernel have the same transposed dot;
  tests/gpu/test_kernels.py and harness/bench/recurrences.py check every route against the reference. If one
  is wrong on a machine, switch it with HARNESS_FLA_ROUTES="case=route" (cases and routes below).
- mLSTM gradients: mlstm_kernels' backward (triton_limit_chunk, like native_custbw) does not differentiate
  the normaliser max(|n^T q~|, exp(-m)); exact only behind the layer's per-head LayerNorm (see kernel_mlstm).
"""

from __future__ import annotations

import functools
import importlib
import math
import os
import warnings
from typing import Optional

import torch
import torch.nn.functional as F

from harness.mixers.ops import l2norm
from harness.mixers.recurrence import interleave_householder

BACKENDS = ("auto", "kernel", "reference")

# ----------------------------------------------------------------------------------------------------------
# availability and backend choice


class KernelUnavailable(RuntimeError):
    """The GPU kernel path cannot run here; the message names what is missing."""


_KERNEL_MODULES = {
    # what each kernel family needs importable (in order: the first failure is the reason reported)
    "fla": ("triton", "fla.ops"),
    "mlstm": ("triton", "mlstm_kernels.torch.chunkwise.triton_limit_chunk"),
}


@functools.lru_cache(maxsize=None)
def _import_error(module: str) -> Optional[str]:
    """None if `module` imports, else '<module> not importable: <error>'."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # ImportError, but also e.g. a RuntimeError raised by a library's import
        return f"{module} not importable: {exc}"
    return None


def kernel_unavailable_reason(which: str = "fla") -> Optional[str]:
    """Why the kernels of family `which` ('fla', 'mlstm' or 'all') cannot run here, or None if they can."""
    families = tuple(_KERNEL_MODULES) if which == "all" else (which,)
    for fam in families:
        if fam not in _KERNEL_MODULES:
            raise ValueError(f"unknown kernel family '{fam}'; valid: {', '.join(_KERNEL_MODULES)}, all")
    if not torch.cuda.is_available():
        return "CUDA is not available (torch.cuda.is_available() is False)"
    for fam in families:
        for module in _KERNEL_MODULES[fam]:
            err = _import_error(module)
            if err is not None:
                return err
    return None


def kernels_available(which: str = "fla") -> bool:
    """True when CUDA is present and the kernel libraries (triton + fla by default) import."""
    return kernel_unavailable_reason(which) is None


def _require(which: str, *tensors: torch.Tensor, fn: str) -> None:
    for t in tensors:
        if t is not None and t.device.type != "cuda":
            raise KernelUnavailable(
                f"{fn} needs CUDA tensors, got a tensor on '{t.device}'; use the reference backend "
                "(harness.mixers.recurrence) on this device")
    reason = kernel_unavailable_reason(which)
    if reason is not None:
        raise KernelUnavailable(f"{fn}: GPU kernels unavailable: {reason}. Use backend='reference'.")


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def resolve_backend(requested: str, device) -> str:
    """'auto' | 'kernel' | 'reference' -> 'kernel' or 'reference' for tensors on `device`.

    auto: the kernels on a CUDA device where they import, else the reference. kernel: the kernels, or a
    ValueError saying why they cannot run on `device`. reference: the PyTorch reference.
    """
    if requested not in BACKENDS:
        raise ValueError(f"backend='{requested}' is not one of {', '.join(BACKENDS)}")
    if requested == "reference":
        return "reference"
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type != "cuda":
        if requested == "kernel":
            raise ValueError(
                f"backend='kernel' is impossible on device '{dev}': the fla / mlstm_kernels kernels are "
                f"Triton and run on CUDA only. Choose one of {', '.join(BACKENDS)}: 'auto' or 'reference' here.")
        return "reference"
    reason = kernel_unavailable_reason("fla")
    if reason is None:
        return "kernel"
    if requested == "kernel":
        raise ValueError(
            f"backend='kernel' is impossible on device '{dev}': {reason}. Choose one of "
            f"{', '.join(BACKENDS)}: 'auto' (falls back to the reference) or 'reference'.")
    _warn_once("auto-fallback", f"backend='auto' on {dev} uses the PyTorch reference: {reason}")
    return "reference"


# ----------------------------------------------------------------------------------------------------------
# shared helpers

def _check_values(v: torch.Tensor, **lead: int) -> None:
    """v is `[*lead, V]` (lead: the named leading sizes, B, T, ... in order) and the sequence is not empty."""
    if v.dim() != len(lead) + 1 or tuple(v.shape[:len(lead)]) != tuple(lead.values()):
        raise ValueError(f"v must be [{', '.join(lead)}, V] = [{', '.join(map(str, lead.values()))}, V]; "
                         f"got {tuple(v.shape)}")
    if lead["T"] == 0:
        raise ValueError("empty sequence (T == 0)")


def _check_state(initial_state: Optional[torch.Tensor], B: int, H: int, K: int, V: int) -> None:
    """initial_state is None or `[B, H, K, V]`."""
    if initial_state is not None and tuple(initial_state.shape) != (B, H, K, V):
        raise ValueError(f"initial_state must be [B, H, K, V] = {[B, H, K, V]}; got {tuple(initial_state.shape)}")


def _compute_dtype(v: torch.Tensor) -> torch.dtype:
    return v.dtype if v.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


@functools.lru_cache(maxsize=None)
def _gated_bwd_blocked() -> bool:
    """fla refuses (raises in backward) the triton gated chunk_bwd_dqkwg on this machine (Hopper, triton in
    [3.4.0, 3.7.1)) unless its TileLang backend takes the call."""
    from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1

    return bool(IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1)


@functools.lru_cache(maxsize=None)
def _tilelang_usable() -> bool:
    """fla's dispatch will hand chunk_bwd_dqkwg to TileLang (installed, nvcc found, enabled)."""
    if os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") == "1":
        return False
    try:
        from fla.ops.common.backends.tilelang import CommonTileLangBackend
    except Exception:
        return False
    return bool(CommonTileLangBackend.is_available() and CommonTileLangBackend().is_enabled())


def kernel_environment() -> dict:
    """Versions and the routing-relevant facts of this machine (for reports)."""
    info: dict = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
        info["capability"] = list(torch.cuda.get_device_capability(0))
    for mod in ("triton", "fla", "mlstm_kernels", "tilelang"):
        try:
            info[mod] = getattr(importlib.import_module(mod), "__version__", "?")
        except Exception as exc:
            info[mod] = f"unavailable ({exc})"
    info["reason_fla"] = kernel_unavailable_reason("fla")
    info["reason_mlstm"] = kernel_unavailable_reason("mlstm")
    if info["reason_fla"] is None:
        info["gated_bwd_blocked"] = _gated_bwd_blocked()
        info["tilelang_usable"] = _tilelang_usable()
    info["route_overrides"] = os.environ.get("HARNESS_FLA_ROUTES", "")
    return info


# ----------------------------------------------------------------------------------------------------------
# gated-delta family -> fla.ops

# Cases of (g, beta), and the fla route taken by default for each:
#   none           g None,                 beta None  -> simple_gla (g=None: linear attention, no normaliser)
#   head_const     g [B,T,H] constant*,    beta None  -> simple_gla_gamma (g_gamma = g[0, 0], RetNet)
#   head           g [B,T,H],              beta None  -> simple_gla, or gla on a gated-bwd-blocked machine
#   channel        g [B,T,H,K],            beta None  -> gla
#   delta          g None,                 beta [B,T,H] -> delta_rule
#   head_delta     g [B,T,H],              beta [B,T,H] -> gated_delta_rule, or kda if blocked w/o TileLang
#   channel_delta  g [B,T,H,K],            beta [B,T,H] -> kda
# (* an expanded tensor: zero strides over B and T, and no gradient needed for g.)
# Override per case with HARNESS_FLA_ROUTES="case=route,case=route" (e.g. "head_const=gla").
GATED_DELTA_CASES = ("none", "head_const", "head", "channel", "delta", "head_delta", "channel_delta")
ROUTES = ("simple_gla", "simple_gla_gamma", "gla", "delta_rule", "gated_delta_rule", "kda")
# Gated DeltaProduct (several Householder steps per token, `kernel_gated_delta_product`), its own case:
#   product  -> gated_delta_product (fla's chunk_gated_delta_product), or interleaved (the gated delta rule over
#               the T * n steps through kernel_gated_delta) where gradients are needed and fla's gated backward is
#               blocked without TileLang (chunk_gated_delta_product's backward is chunk_gated_delta_rule's)
PRODUCT_CASE = "product"
PRODUCT_ROUTES = ("gated_delta_product", "interleaved")
_L2NORM_IN_KERNEL = ("delta_rule", "gated_delta_rule", "kda")  # routes whose fla op normalises q, k itself
_ROUTE_ACCEPTS = {  # route -> (g kinds it can take, whether it takes beta)
    "simple_gla": ({"none", "head"}, False),
    "simple_gla_gamma": ({"head_const"}, False),
    "gla": ({"none", "head", "channel"}, False),
    "delta_rule": ({"none"}, True),
    "gated_delta_rule": ({"none", "head"}, True),
    "kda": ({"none", "head", "channel"}, True),
}


def _is_constant_per_head(g: torch.Tensor) -> bool:
    B, T = g.shape[:2]
    return (B == 1 or g.stride(0) == 0) and (T == 1 or g.stride(1) == 0)


def gated_delta_case(g: Optional[torch.Tensor], beta: Optional[torch.Tensor]) -> str:
    """Which (g, beta) case of the table above a call is."""
    if g is None:
        kind = "none"
    elif g.dim() == 3:
        kind = "head_const" if (beta is None and _is_constant_per_head(g) and not _needs_grad(g)) else "head"
    elif g.dim() == 4:
        kind = "channel"
    else:
        raise ValueError(f"g must be [B, T, H] or [B, T, H, K], got shape {tuple(g.shape)}")
    if beta is None:
        return kind
    return {"none": "delta", "head": "head_delta", "channel": "channel_delta"}[kind]


def _route_overrides() -> dict[str, str]:
    spec = os.environ.get("HARNESS_FLA_ROUTES", "").strip()
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        case, _, route = item.partition("=")
        case, route = case.strip(), route.strip()
        routes = PRODUCT_ROUTES if case == PRODUCT_CASE else ROUTES
        if case not in (*GATED_DELTA_CASES, PRODUCT_CASE) or route not in routes:
            raise ValueError(f"HARNESS_FLA_ROUTES item '{item}': case must be one of {', '.join(GATED_DELTA_CASES)}"
                             f" and route one of {', '.join(ROUTES)}; or case {PRODUCT_CASE} (gated DeltaProduct) "
                             f"and route one of {', '.join(PRODUCT_ROUTES)}")
        out[case] = route
    return out


def select_gated_delta_route(q, k, v, g=None, beta=None, initial_state=None) -> str:
    """The fla route `kernel_gated_delta` takes for these arguments on this machine."""
    case = gated_delta_case(g, beta)
    override = _route_overrides().get(case)
    if override is not None:
        return override
    grad = _needs_grad(q, k, v, g, beta, initial_state)
    if case == "none":
        return "simple_gla"
    if case == "head_const":
        return "simple_gla_gamma"
    if case == "head":
        return "gla" if (grad and _gated_bwd_blocked()) else "simple_gla"
    if case == "channel":
        return "gla"
    if case == "delta":
        return "delta_rule"
    if case == "head_delta":
        if grad and _gated_bwd_blocked() and not _tilelang_usable():
            _warn_once("gdn-kda", "fla's gated backward is blocked on this GPU/triton and TileLang is not usable; "
                       "gated_deltanet runs through chunk_kda with g broadcast over K (same recurrence, slower). "
                       "Install tilelang (with nvcc) or triton >= 3.7.1 for chunk_gated_delta_rule.")
            return "kda"
        return "gated_delta_rule"
    return "kda"


def _check_gated_delta(q, k, v, g, beta, initial_state) -> None:
    if q.dim() != 4 or q.shape != k.shape:
        raise ValueError(f"q and k must both be [B, T, H, K]; got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, H, K = q.shape
    _check_values(v, B=B, T=T, H=H)
    if g is not None and tuple(g.shape) not in ((B, T, H), (B, T, H, K)):
        raise ValueError(f"g must be [B, T, H] or [B, T, H, K] = {[B, T, H, K]}; got {tuple(g.shape)}")
    if beta is not None and tuple(beta.shape) != (B, T, H):
        raise ValueError(f"beta must be [B, T, H] = {[B, T, H]}; got {tuple(beta.shape)}")
    _check_state(initial_state, B, H, K, v.shape[-1])
    if (beta is not None or (g is not None and g.dim() == 4)) and K > 256:
        raise ValueError(f"fla's delta-rule / kda / gla kernels support K <= 256; got K={K}")


def run_gated_delta_route(route: str, q, k, v, g=None, beta=None, *, scale: float, initial_state=None,
                          output_final_state: bool = True, normalize_qk: bool = False):
    """Run one named fla route (see ROUTES); `kernel_gated_delta` picks the route, tests pin one."""
    if route not in ROUTES:
        raise ValueError(f"unknown route '{route}'; valid: {', '.join(ROUTES)}")
    _check_gated_delta(q, k, v, g, beta, initial_state)
    _require("fla", q, k, v, g, beta, initial_state, fn="kernel_gated_delta")
    kinds, takes_beta = _ROUTE_ACCEPTS[route]
    kind = "none" if g is None else ("channel" if g.dim() == 4 else "head")
    if route == "simple_gla_gamma":
        if not (g is not None and g.dim() == 3 and _is_constant_per_head(g)):
            raise ValueError("route simple_gla_gamma needs a constant per-head g (expanded [H] -> [B, T, H])")
        if _needs_grad(g):
            raise ValueError("route simple_gla_gamma gives no gradient to g; g must not require grad")
        kind = "head_const"
    if kind not in kinds or takes_beta != (beta is not None):
        raise ValueError(f"route '{route}' cannot take g={kind} with beta={'given' if beta is not None else 'None'}")

    out_dtype = v.dtype
    dt = _compute_dtype(v)
    B, T, H, K = q.shape
    q, k, v = (t.to(dt).contiguous() for t in (q, k, v))
    h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    if g is not None and route != "simple_gla_gamma":
        g = g.to(torch.float32)
        if route in ("gla", "kda") and g.dim() == 3:
            g = g.unsqueeze(-1).expand(B, T, H, K)  # the per-head decay on every key channel
        g = g.contiguous()
    if g is None and route in ("gla", "kda"):
        g = q.new_zeros(B, T, H, K, dtype=torch.float32)
    if g is None and route == "gated_delta_rule":
        g = q.new_zeros(B, T, H, dtype=torch.float32)
    if beta is not None:
        beta = beta.contiguous()
    if normalize_qk and route not in _L2NORM_IN_KERNEL:
        q, k, normalize_qk = l2norm(q), l2norm(k), False
    common = dict(scale=float(scale), initial_state=h0, output_final_state=output_final_state)

    if route == "simple_gla":
        from fla.ops.simple_gla import chunk_simple_gla

        o, ht = chunk_simple_gla(q, k, v, g=g, **common)
    elif route == "simple_gla_gamma":
        from fla.ops.simple_gla import chunk_simple_gla

        g_gamma = g[0, 0].detach().to(torch.float32).contiguous()  # [H] natural-log decays
        o, ht = chunk_simple_gla(q, k, v, g=None, g_gamma=g_gamma, **common)
    elif route == "gla":
        from fla.ops.gla import chunk_gla

        o, ht = chunk_gla(q, k, v, g=g, **common)
    elif route == "delta_rule":
        from fla.ops.delta_rule import chunk_delta_rule

        o, ht = chunk_delta_rule(q, k, v, beta, use_qk_l2norm_in_kernel=normalize_qk, **common)
    elif route == "gated_delta_rule":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        o, ht = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=normalize_qk,
                                       use_beta_sigmoid_in_kernel=False, **common)
    else:  # kda
        from fla.ops.kda import chunk_kda

        o, ht = chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=normalize_qk, use_gate_in_kernel=False,
                          use_beta_sigmoid_in_kernel=False, safe_gate=False, **common)
    return o.to(out_dtype), ht


def kernel_gated_delta(q, k, v, g=None, beta=None, *, scale: float, initial_state=None,
                       output_final_state: bool = True, normalize_qk: bool = False):
    """The gated-delta recurrence of docs/RECURRENCES.md through fla.ops -> (o `[B,T,H,V]`, final `[B,H,K,V]`).

    q, k `[B, T, H, K]`, v `[B, T, H, V]`, g None | `[B, T, H]` | `[B, T, H, K]` (natural-log decay <= 0),
    beta None | `[B, T, H]`, initial_state None | `[B, H, K, V]`. o has v's dtype; the final state is float32
    (None when output_final_state is False). Gradients flow to q, k, v, g, beta and initial_state, including
    through the final state. Raises KernelUnavailable off CUDA or without fla/triton.
    """
    _check_gated_delta(q, k, v, g, beta, initial_state)
    _require("fla", q, k, v, g, beta, initial_state, fn="kernel_gated_delta")
    route = select_gated_delta_route(q, k, v, g, beta, initial_state)
    try:
        return run_gated_delta_route(route, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                     output_final_state=output_final_state, normalize_qk=normalize_qk)
    except RuntimeError as exc:
        if "tilelang" in str(exc).lower() or "#640" in str(exc):
            raise RuntimeError(f"{exc}\n[harness] fla refused route '{route}' on this GPU/triton. tilelang (with a "
                               "usable nvcc) or triton >= 3.7.1 lifts it; or set HARNESS_FLA_ROUTES to another route "
                               "(see harness.mixers.kernels), or use backend='reference'.") from exc
        raise


# ----------------------------------------------------------------------------------------------------------
# sliding-window softmax attention (options.window) -> fla.ops.attn

# Not float32: on Hopper fla sends parallel_attn to its TileLang backend, which fails to compile float32 inputs
# ("Layout infer conflict between b_s and b_p", H100, 2026-12-05); float32 windows take the blockwise form.
WINDOW_KERNEL_DTYPES = (torch.bfloat16, torch.float16)
WINDOW_KERNEL_MAX_HEAD_DIM = 256  # parallel_attn holds a whole head of q and k in one block (its NK == 1 assert)


def kernel_window_attention(q, k, v, window: int, *, scale: float) -> torch.Tensor:
    """Causal sliding-window softmax attention through fla's parallel_attn (flash-style: no score matrix is kept):
    query t attends to keys t - window + 1 .. t. q `[B, T, HQ, D]`, k and v `[B, T, H, D]` with HQ divisible by H
    (GQA), cast to q's dtype (bf16 or fp16: WINDOW_KERNEL_DTYPES); the output in q's dtype. fla dispatches the
    call to its TileLang backend where that is usable on Hopper, else to Triton.
    Raises KernelUnavailable off CUDA or without fla/triton."""
    _require("fla", q, k, v, fn="kernel_window_attention")
    if q.dtype not in WINDOW_KERNEL_DTYPES:
        raise ValueError(f"kernel_window_attention: q.dtype={q.dtype} is not one of {WINDOW_KERNEL_DTYPES}")
    if q.shape[-1] > WINDOW_KERNEL_MAX_HEAD_DIM:
        raise ValueError(f"kernel_window_attention: head_dim={q.shape[-1]} is over parallel_attn's "
                         f"{WINDOW_KERNEL_MAX_HEAD_DIM}")
    if window < 1:
        raise ValueError(f"kernel_window_attention: window={window} must be >= 1")
    from fla.ops.attn.parallel import parallel_attn

    o = parallel_attn(q, k.to(q.dtype), v.to(q.dtype), scale=scale, window_size=window)
    return o.to(q.dtype)


# ----------------------------------------------------------------------------------------------------------
# forgetting attention (the fox mixer) -> fla.ops.forgetting_attn

FOX_KERNEL = "parallel_forgetting_attn"  # its one route: fla's parallel_attn with a log forget gate


def _fla_forgetting_attn():
    """fla's parallel_forgetting_attn (imported on call: triton exists on GPU machines only)."""
    from fla.ops.forgetting_attn import parallel_forgetting_attn

    return parallel_forgetting_attn


def kernel_forgetting_attention(q, k, v, g, *, scale: float) -> torch.Tensor:
    """Causal softmax attention with a forget gate through fla's parallel_forgetting_attn (flash-style, no score
    matrix kept): logits scale q_i.k_j + sum_{l=j+1..i} g_l. q `[B, T, HQ, D]`, k and v `[B, T, H, D]` (GQA: HQ
    divisible by H), g `[B, T, HQ]` the log forget gates (<= 0; fla sums them in-kernel and returns their gradient in
    float32). q, k, v run in v's 16-bit dtype (bf16 for a float32 v, as the recurrences': `_compute_dtype`), g in
    float32; the output in v's dtype. Raises KernelUnavailable off CUDA or without fla/triton."""
    _require("fla", q, k, v, g, fn="kernel_forgetting_attention")
    if q.shape[-1] > WINDOW_KERNEL_MAX_HEAD_DIM:
        raise ValueError(f"kernel_forgetting_attention: head_dim={q.shape[-1]} is over parallel_attn's "
                         f"{WINDOW_KERNEL_MAX_HEAD_DIM}")
    out_dtype, dt = v.dtype, _compute_dtype(v)
    o = _fla_forgetting_attn()(q.to(dt), k.to(dt), v.to(dt), g.to(torch.float32), scale=float(scale))
    return o.to(out_dtype)


# ----------------------------------------------------------------------------------------------------------
# PaTH attention (the path mixer) -> fla.ops.path_attn

PATH_KERNEL = "parallel_path_attn"  # its one route: softmax attention with accumulated Householder transforms
PATH_KERNEL_HEAD_DIMS = (16, 32, 64, 128)  # the head dims of q and of v that parallel_path_attn takes


def _fla_path_attn():
    """fla's parallel_path_attn (imported on call: triton exists on GPU machines only)."""
    from fla.ops.path_attn import parallel_path_attn

    return parallel_path_attn


def kernel_path_attention(q, k, v, w, beta, g=None, *, scale: float, want_cache: bool = False):
    """PaTH attention through fla's parallel_path_attn: logits scale (q_i . H_i ... H_{j+1} k_j + sum_{l=j+1..i}
    g_l), H_t = I - beta_t w_t w_t^T. q `[B, T, HQ, D]`, k, v, w `[B, T, H, D]` (GQA: HQ divisible by H), beta
    `[B, T, H]`, g `[B, T, HQ]` (log forget gates, or None). q, k, v run in v's 16-bit dtype (bf16 for a float32 v,
    as the recurrences'), w, beta and g in float32 (fla asserts it). -> (o in v's dtype, and with `want_cache` the
    keys transformed up to the last token `[B, T, H, D]` in the compute dtype, else None). Raises KernelUnavailable
    off CUDA or without fla/triton."""
    _require("fla", q, k, v, w, beta, fn="kernel_path_attention")
    if q.shape[-1] not in PATH_KERNEL_HEAD_DIMS or v.shape[-1] not in PATH_KERNEL_HEAD_DIMS:
        raise ValueError(f"kernel_path_attention: head dims {q.shape[-1]}, {v.shape[-1]} are not among "
                         f"parallel_path_attn's {PATH_KERNEL_HEAD_DIMS}")
    out_dtype, dt = v.dtype, _compute_dtype(v)
    o, keys = _fla_path_attn()(q.to(dt), k.to(dt), v.to(dt), w.float(), beta.float(),
                               None if g is None else g.float(), scale=float(scale), use_cache=want_cache)
    return o.to(out_dtype), keys


# ----------------------------------------------------------------------------------------------------------
# gated DeltaProduct -> fla.ops.gated_delta_product

def _check_gated_delta_product(q, k, v, g, beta, initial_state) -> None:
    if q.dim() != 4 or k.dim() != 5 or tuple(k.shape[:2]) + tuple(k.shape[3:]) != tuple(q.shape):
        raise ValueError(f"q must be [B, T, H, K] and k [B, T, n, H, K]; got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, n, H, K = k.shape
    _check_values(v, B=B, T=T, n=n, H=H)
    if g is not None and tuple(g.shape) != (B, T, H):
        raise ValueError(f"g must be [B, T, H] = {[B, T, H]}; got {tuple(g.shape)}")
    if tuple(beta.shape) != (B, T, n, H):
        raise ValueError(f"beta must be [B, T, n, H] = {[B, T, n, H]}; got {tuple(beta.shape)}")
    _check_state(initial_state, B, H, K, v.shape[-1])
    if K > 256:
        raise ValueError(f"fla's delta-rule kernels support K <= 256; got K={K}")


def select_gated_delta_product_route(q, k, v, g=None, beta=None, initial_state=None) -> str:
    """The route `kernel_gated_delta_product` takes for these arguments on this machine (PRODUCT_ROUTES)."""
    override = _route_overrides().get(PRODUCT_CASE)
    if override is not None:
        return override
    if g is not None and _needs_grad(q, k, v, g, beta, initial_state) and _gated_bwd_blocked() \
            and not _tilelang_usable():
        return "interleaved"
    return "gated_delta_product"


def _fla_gated_delta_product():
    """fla's chunk_gated_delta_product (imported on call: triton exists on GPU machines only)."""
    from fla.ops.gated_delta_product import chunk_gated_delta_product

    return chunk_gated_delta_product


def kernel_gated_delta_product(q, k, v, g, beta, *, scale: float, initial_state=None,
                               output_final_state: bool = True, normalize_qk: bool = False,
                               route: Optional[str] = None):
    """Gated DeltaProduct (docs/RECURRENCES.md) through fla -> (o `[B, T, H, V]`, final `[B, H, K, V]`).

    q `[B, T, H, K]`, k `[B, T, n, H, K]`, v `[B, T, n, H, V]`, g None | `[B, T, H]` (natural-log decay <= 0),
    beta `[B, T, n, H]`, initial_state None | `[B, H, K, V]`. route: one of PRODUCT_ROUTES, or None for
    `select_gated_delta_product_route`'s. fla takes the steps interleaved, `[B, T n, ...]` with step j of token t
    at row t n + j; the interleaved route runs `kernel_gated_delta` on q zero but at each token's last step and g on
    its first (`recurrence.interleave_householder`). dtypes as `kernel_gated_delta`. Raises KernelUnavailable off
    CUDA or without fla/triton.
    """
    _check_gated_delta_product(q, k, v, g, beta, initial_state)
    _require("fla", q, k, v, g, beta, initial_state, fn="kernel_gated_delta_product")
    route = route or select_gated_delta_product_route(q, k, v, g, beta, initial_state)
    if route not in PRODUCT_ROUTES:
        raise ValueError(f"unknown gated DeltaProduct route '{route}'; valid: {', '.join(PRODUCT_ROUTES)}")
    B, T, steps = k.shape[:3]
    if route == "interleaved":
        o, ht = kernel_gated_delta(*interleave_householder(q, k, v, g, beta), scale=scale,
                                   initial_state=initial_state, output_final_state=output_final_state,
                                   normalize_qk=normalize_qk)
        return o.unflatten(1, (T, steps))[:, :, -1], ht
    out_dtype, dt = v.dtype, _compute_dtype(v)
    q = q.to(dt).contiguous()
    k, v = (t.to(dt).flatten(1, 2).contiguous() for t in (k, v))
    g = None if g is None else g.to(torch.float32).contiguous()
    h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    o, ht = _fla_gated_delta_product()(q, k, v, g, beta.flatten(1, 2).contiguous(), scale=float(scale),
                                       initial_state=h0, output_final_state=output_final_state,
                                       num_householder=steps, use_qk_l2norm_in_kernel=normalize_qk)
    return o.to(out_dtype), ht


# ----------------------------------------------------------------------------------------------------------
# gated slot attention -> fla.ops.gsa

GSA_KERNEL = "chunk_gsa"  # its one route


def _check_gsa(q, k, v, s, g, initial_state) -> None:
    if q.dim() != 4 or q.shape != k.shape:
        raise ValueError(f"q and k must both be [B, T, H, K]; got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, H, K = q.shape
    _check_values(v, B=B, T=T, H=H)
    if s.dim() != 4 or tuple(s.shape[:3]) != (B, T, H) or s.shape != g.shape:
        raise ValueError(f"s and g must both be [B, T, H, M] = [{B}, {T}, {H}, M]; got {tuple(s.shape)} and "
                         f"{tuple(g.shape)}")
    if initial_state is not None:
        want = ((B, H, K, s.shape[-1]), (B, H, s.shape[-1], v.shape[-1]))
        got = tuple(tuple(t.shape) for t in initial_state)
        if len(got) != 2 or got != want:
            raise ValueError(f"initial_state must be (hk, hv) of shapes {[list(w) for w in want]}; got {got}")


def _fla_chunk_gsa():
    """fla's chunk_gsa (imported on call: triton exists on GPU machines only)."""
    from fla.ops.gsa import chunk_gsa

    return chunk_gsa


def kernel_gsa(q, k, v, s, g, *, scale: float, initial_state=None, output_final_state: bool = True):
    """Gated slot attention (docs/RECURRENCES.md) through fla's chunk_gsa -> (o `[B, T, H, V]`, (hk `[B, H, K, M]`,
    hv `[B, H, M, V]`) float32, or None when output_final_state is False).

    q, k `[B, T, H, K]`, v `[B, T, H, V]`, s (slot write strengths) and g (per-slot log decay <= 0) `[B, T, H, M]`,
    initial_state None | (hk, hv). q, k, v and s go in 16 bits as `kernel_gated_delta`'s (o in v's dtype), g and the
    states in float32. Gradients flow to every input and the initial state, also through the final state. Raises
    KernelUnavailable off CUDA or without fla/triton.
    """
    _check_gsa(q, k, v, s, g, initial_state)
    _require("fla", q, k, v, s, g, *(initial_state or ()), fn="kernel_gsa")
    out_dtype, dt = v.dtype, _compute_dtype(v)
    q, k, v, s = (t.to(dt).contiguous() for t in (q, k, v, s))
    h0 = None if initial_state is None else tuple(t.to(torch.float32).contiguous() for t in initial_state)
    o, final = _fla_chunk_gsa()(q, k, v, s, g.to(torch.float32).contiguous(), scale=float(scale), initial_state=h0,
                                output_final_state=output_final_state)
    return o.to(out_dtype), (tuple(final) if output_final_state else None)


# the DPLR delta rule (RWKV-7) -> fla.ops.rwkv7

DPLR_ROUTES = ("rwkv7",)  # fla's chunk_rwkv7 (its generalized delta rule, chunk_dplr_delta_rule)


def _check_dplr_delta(q, k, v, a, b, g, initial_state) -> None:
    if q.dim() != 4 or any(tuple(t.shape) != tuple(q.shape) for t in (k, a, b, g)):
        raise ValueError(f"q, k, a, b and g must all be [B, T, H, K]; got {[tuple(t.shape) for t in (q, k, a, b, g)]}")
    B, T, H, K = q.shape
    _check_values(v, B=B, T=T, H=H)
    _check_state(initial_state, B, H, K, v.shape[-1])


def _fla_rwkv7():
    """fla's chunk_rwkv7 (imported on call: triton exists on GPU machines only)."""
    from fla.ops.rwkv7 import chunk_rwkv7

    return chunk_rwkv7


def kernel_dplr_delta(q, k, v, a, b, g, *, scale: float, initial_state=None, output_final_state: bool = True,
                      lower_bound: Optional[float] = None):
    """The DPLR delta rule (docs/RECURRENCES.md) through fla's chunk_rwkv7 -> (o `[B, T, H, V]`, final
    `[B, H, K, V]` float32, None unless output_final_state).

    q, k, a, b, g `[B, T, H, K]` (g the natural-log decay <= 0), v `[B, T, H, V]`, initial_state None |
    `[B, H, K, V]`. lower_bound: the caller's guarantee g >= lower_bound (< 0), fla's `lower_bound`, which lets it
    take 64-token chunks on its tensor-core scheme (16 without). q, k, v, a, b run in v's 16-bit dtype (bf16 for a
    float32 v), g in float32; gradients flow to all of them and to initial_state. Raises KernelUnavailable off CUDA
    or without fla/triton.
    """
    _check_dplr_delta(q, k, v, a, b, g, initial_state)
    _require("fla", q, k, v, a, b, g, initial_state, fn="kernel_dplr_delta")
    out_dtype, dt = v.dtype, _compute_dtype(v)
    q, k, v, a, b = (t.to(dt).contiguous() for t in (q, k, v, a, b))
    h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    o, ht = _fla_rwkv7()(q, g.to(torch.float32).contiguous(), k, v, a, b, scale=float(scale), initial_state=h0,
                         output_final_state=output_final_state, lower_bound=lower_bound)
    return o.to(out_dtype), ht


# ----------------------------------------------------------------------------------------------------------
# mLSTM -> mlstm_kernels chunkwise--triton_limit_chunk

MLSTM_KERNEL = "chunkwise--triton_limit_chunk"
# Padding gates: logsigmoid(+1e4) is exactly 0.0 in float32 (exp(-1e4) underflows to 0), so a padded token
# does not decay C, n or m; with i = -1e4 (far below any real input gate; the layer soft-caps at +-15),
# m = max(logf + m_prev, i) = m_prev exactly and exp(i - m) = 0, so it writes nothing (its k, v are 0 too).
MLSTM_PAD_GATE = 1.0e4


def kernel_mlstm(q, k, v, i, f, *, scale: float, initial_state=None, output_final_state: bool = True,
                 eps: float = 1e-6, chunk_size: int = 64):
    """The mLSTM of docs/RECURRENCES.md through mlstm_kernels' chunkwise--triton_limit_chunk.

    q, k `[B, T, H, K]`, v `[B, T, H, V]`, i, f `[B, T, H]` gate pre-activations, initial_state None |
    (C `[B, H, K, V]`, n `[B, H, K]`, m `[B, H]`). Returns (h `[B, T, H, V]` in v's dtype, (C, n, m) float32),
    the state None when output_final_state is False.

    - T need not be a multiple of chunk_size: the sequence is padded at the end with q = k = v = 0,
      f = +1e4 (log forget gate exactly 0) and i = -1e4 (no write, m unchanged), and the padded outputs are
      dropped, so h and the final (C, n, m) are those of the unpadded sequence, exactly.
    - scale: the kernel fixes scale = K^-0.5; q is pre-multiplied by scale * sqrt(K) when they differ.
    - Gradients come from mlstm_kernels' hand-written backward (the same algorithm as its native_custbw),
      which does not differentiate the normaliser max(|n^T q~|, exp(-m)) + eps: it treats it as a constant
      ("it cancels out in the forward in the groupnorm"). So dq, dk, di, df (dv is exact) equal the true
      gradients only when h goes through a per-(token, head) scale-invariant norm, as the mLSTM layer's
      head-wise LayerNorm is; of raw h they are off by ~100%. C0 gets its gradient; n0 and m0 get zeros
      (n0's true gradient after the norm is ~0, m0's is not). Gradients arriving at the final (C, n, m) are
      not supported (ignored for n and m, wrong gate gradients for C): backward through them raises.
    """
    if q.dim() != 4 or q.shape != k.shape:
        raise ValueError(f"q and k must both be [B, T, H, K]; got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    _check_values(v, B=B, T=T, H=H)
    if tuple(i.shape) != (B, T, H) or tuple(f.shape) != (B, T, H):
        raise ValueError(f"i and f must be [B, T, H] = {[B, T, H]}; got {tuple(i.shape)} and {tuple(f.shape)}")
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of 2 >= 16; got {chunk_size}")
    state = tuple(initial_state) if initial_state is not None else None
    if state is not None:
        if len(state) != 3:
            raise ValueError("initial_state must be (C, n, m)")
        want = ((B, H, K, V), (B, H, K), (B, H))
        for name, t, shp in zip("Cnm", state, want):
            if t is not None and tuple(t.shape) != shp:
                raise ValueError(f"initial {name} must be {list(shp)}; got {tuple(t.shape)}")
    _require("mlstm", q, k, v, i, f, *(state or ()), fn="kernel_mlstm")
    from mlstm_kernels.torch.chunkwise.triton_limit_chunk import mlstm_chunkwise__limit_chunk

    # autocast off: the kernel's custom_fwd would otherwise re-cast every input (gates included) to its
    # autocast_kernel_dtype; we cast q, k, v ourselves and keep the gates in float32.
    with torch.autocast("cuda", enabled=False):
        h, last = _mlstm_padded(mlstm_chunkwise__limit_chunk, q, k, v, i, f, scale=scale, state=state, eps=eps,
                                chunk_size=chunk_size, dtype=_compute_dtype(v))
    if not output_final_state:
        return h, None
    _refuse_state_grads(last)
    return h, last


def _refuse_state_grads(state) -> None:
    """Make a backward pass through the kernel's final mLSTM state fail loudly instead of going wrong."""
    if not torch.is_grad_enabled():
        return

    def refuse(grad):
        # autograd hands unused outputs of the kernel's Function zero gradients: only real ones are refused
        if grad is None or not bool(grad.any()):
            return grad
        raise RuntimeError(
            "kernel_mlstm: a gradient reached the final mLSTM state (C, n, m); mlstm_kernels' backward ignores it "
            "for n and m and gets the gate gradients wrong for C. Detach the state (state passing without "
            "backprop through it), or use backend='reference'.")

    for t in state:
        if t.requires_grad:
            t.register_hook(refuse)


def _mlstm_padded(kernel, q, k, v, i, f, *, scale, state, eps, chunk_size, dtype):
    """Layout, scale and padding around an mlstm_kernels chunkwise function `kernel` (same signature as
    mlstm_chunkwise__limit_chunk); the CPU tests run it with mlstm_kernels' native chunkwise."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    out_dtype = v.dtype
    factor = float(scale) * math.sqrt(K)
    if abs(factor - 1.0) > 1e-9:
        q = q.float() * factor
    qh, kh, vh = (t.to(dtype).transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
    ih, fh = (t.to(torch.float32).transpose(1, 2) for t in (i, f))  # [B, H, T]
    pad = (-T) % chunk_size
    if pad:
        qh, kh, vh = (F.pad(t, (0, 0, 0, pad)) for t in (qh, kh, vh))
        ih = F.pad(ih, (0, pad), value=-MLSTM_PAD_GATE)
        fh = F.pad(fh, (0, pad), value=MLSTM_PAD_GATE)
    qh, kh, vh, ih, fh = (t.contiguous() for t in (qh, kh, vh, ih, fh))
    c0 = n0 = m0 = None
    if state is not None:
        c0, n0, m0 = state
        c0 = (c0 if c0 is not None else q.new_zeros(B, H, K, V)).to(torch.float32).contiguous()
        n0 = (n0 if n0 is not None else q.new_zeros(B, H, K)).to(torch.float32).contiguous()
        m0 = (m0 if m0 is not None else q.new_zeros(B, H)).to(torch.float32).reshape(B, H, 1).contiguous()
    h, (c, n, m) = kernel(qh, kh, vh, ih, fh, c_initial=c0, n_initial=n0, m_initial=m0, return_last_states=True,
                          eps=eps, chunk_size=chunk_size, autocast_kernel_dtype=dtype)
    h = h[:, :, :T].transpose(1, 2).to(out_dtype).contiguous()
    return h, (c, n, m.reshape(B, H))


__all__ = [
    "BACKENDS", "DPLR_ROUTES", "FOX_KERNEL", "GATED_DELTA_CASES", "GSA_KERNEL", "KernelUnavailable", "MLSTM_KERNEL",
    "PATH_KERNEL", "PATH_KERNEL_HEAD_DIMS", "PRODUCT_ROUTES", "ROUTES", "gated_delta_case", "kernel_dplr_delta",
    "kernel_environment", "kernel_forgetting_attention", "kernel_gated_delta", "kernel_gated_delta_product",
    "kernel_gsa", "kernel_mlstm", "kernel_path_attention", "kernel_unavailable_reason", "kernels_available",
    "resolve_backend", "run_gated_delta_route", "select_gated_delta_product_route", "select_gated_delta_route",
]
