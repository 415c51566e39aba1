"""The decode bench (`bench_decode`): greedy decoding of `batch` prompts together: prefill `batch` contexts of
random tokens (all of one length, so unpadded), then time `new_tokens` steps of one token per row; the student keeps
a `RecurrentCache` (fixed-size state per row), the teacher a KV cache (grows with the context). Reported per
context: ms per step (`ms_per_token`: one token per row), tokens/s (batch x steps / s), prefill ms, state /
KV-cache bytes for the whole batch; flatness = ms/token at the longest context / at the shortest (1.0 = flat).
`harness bench --what decode` runs it at each of `--decode-batches` (default 1, 8, 32).

A hybrid student (`--attention-layers 3,17`: those layers keep softmax attention) also reports `kv_bytes`, the part
of its state held by the kept layers' keys and values (it grows with the context), and `kv_bytes_per_token`
(kv_bytes / tokens in the cache, the whole batch); its `state_bytes` counts everything. On CUDA a hybrid's step is
graphed with its KV room allocated up front (harness.decoding; `graph_skipped` says why where it cannot be).
"""

from __future__ import annotations

import inspect
import time
from typing import Any, Optional, Sequence

import torch
from torch import nn

from harness.bench.machine import free_memory, resolve_device, resolve_dtype, synchronize
from harness.bench.shapes import build_pair, canonical_shape


def _kv_cache_bytes(cache: Any) -> Optional[int]:
    """Bytes held by a transformers KV cache (DynamicCache layers' keys/values), None if not readable."""
    total, found = 0, False
    for layer in getattr(cache, "layers", None) or []:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
                found = True
    return total if found else None


def _output_cache(out: Any) -> Any:
    """The KV cache of a transformers output: `cache` (transformers >= 5.2x) or `past_key_values`."""
    for name in ("cache", "past_key_values"):
        value = out.get(name) if hasattr(out, "get") else getattr(out, name, None)
        if value is not None:
            return value
    raise RuntimeError("the teacher returned no KV cache (use_cache=True)")


@torch.no_grad()
def decode_timing(model: nn.Module, ids: torch.Tensor, new_tokens: int, warmup_tokens: int = 2,
                  recurrent: bool = True, graphs: bool = False) -> dict[str, Any]:
    """Prefill `ids`, then `warmup_tokens` + `new_tokens` greedy one-token steps; ms per timed token.

    recurrent: a harness student with a RecurrentCache; else a transformers model with its KV cache.
    graphs: the student's step captured as a CUDA graph (harness.decoding; capture time reported apart).
    The timed loop does not synchronize per token (the argmax feeds the next step on the device).
    """
    from harness.decoding import GraphedStep
    from harness.student import RecurrentCache

    dev = ids.device
    synchronize(dev)
    t0 = time.perf_counter()
    if recurrent:
        cache = RecurrentCache(model.config.num_hidden_layers)
        out = model(ids, cache=cache, use_cache=True, logits_to_keep=1)
    else:
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        cache = _output_cache(out)
        cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    synchronize(dev)
    prefill_ms = (time.perf_counter() - t0) * 1e3
    graphed, capture_ms = None, None
    if recurrent and graphs:
        t0 = time.perf_counter()
        graphed = GraphedStep(model, cache, new_tokens=warmup_tokens + new_tokens)
        synchronize(dev)
        capture_ms = (time.perf_counter() - t0) * 1e3

    def step(tok: torch.Tensor) -> torch.Tensor:
        nonlocal cache
        if graphed is not None:
            return graphed(tok).argmax(-1, keepdim=True)
        if recurrent:
            o = model(tok, cache=cache, use_cache=True)
        else:
            o = model(input_ids=tok, use_cache=True, **{cache_kw: cache})
            cache = _output_cache(o)
        return o.logits[:, -1].argmax(-1, keepdim=True)

    for _ in range(warmup_tokens):
        nxt = step(nxt)
    synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        nxt = step(nxt)
    synchronize(dev)
    ms = (time.perf_counter() - t0) * 1e3 / max(new_tokens, 1)
    state = cache.state_bytes() if recurrent else _kv_cache_bytes(cache)
    kv = kv_figures(cache) if recurrent and model.config.kept_layers() else {}
    return {"ms_per_token": ms, "tokens_per_s": ids.shape[0] * 1e3 / ms if ms > 0 else 0.0,
            "prefill_ms": prefill_ms, "state_bytes": state, **kv, "cuda_graph": graphed is not None,
            **({"graph_capture_ms": capture_ms} if graphed is not None else {})}


def kv_figures(cache: Any) -> dict[str, Any]:
    """A hybrid student's KV part of its RecurrentCache: kv_bytes (whole batch) and kv_bytes_per_token (per token
    of context the cache holds: prompt and decoded tokens, or the room a fixed KV cache allocated, each row counted
    once, as the bytes are over the batch)."""
    kv = cache.kv_bytes()
    return {"kv_bytes": kv, "kv_bytes_per_token": kv / max(cache.capacity or cache.seen_tokens, 1)}


def bench_decode(shape: str = "135M", mixer: str = "gated_deltanet", *, contexts: Sequence[int] = (1024, 8192, 32768),
                 new_tokens: int = 64, warmup_tokens: int = 4, batch: int = 1,
                 dtype: Optional[str | torch.dtype] = None, device: Optional[str | torch.device] = None,
                 teacher_source: Optional[str] = None, layers: Optional[int] = None,
                 options: Optional[dict] = None, teacher: bool = True, seed: int = 0,
                 attention_layers: Sequence[int] = ()) -> dict[str, Any]:
    """Per-token decoding time of the student (recurrent state) and the teacher (KV cache) at each context.
    On CUDA the student is timed with its step as a CUDA graph (`student`, as NIAH decodes) and eagerly
    (`student_eager`; for a hybrid student, whose kept layers then hold FixedKVStates, the eager one keeps growing
    KV states, as `generate` does); elsewhere `student` is eager.

    Returns {"shape", "mixer", ..., "rows": [{context, student: {...}, teacher: {...}, speedup}],
    "student_flatness", "teacher_flatness"} with flatness = ms/token at the longest context / at the shortest.
    Contexts beyond the teacher's max_position_embeddings are timed all the same (rope extrapolates; the
    numbers are about time, not quality) and flagged.
    """
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    t_model, student = build_pair(shape, mixer, options=options, source=teacher_source, layers=layers,
                                  device=device, teacher_dtype=dtype, seed=seed, attention_layers=attention_layers)
    student.to(dtype).eval()
    from harness.decoding import graph_blocker

    blocker = graph_blocker(student)
    graphs = blocker is None
    vocab, max_pos = t_model.config.vocab_size, t_model.config.max_position_embeddings
    g = torch.Generator(device="cpu").manual_seed(seed + 7)
    warm = torch.randint(0, vocab, (batch, 64), generator=g).to(device)
    for model, recurrent in ((student, True), (t_model, False)):  # first calls (Triton compiles) untimed
        if recurrent or teacher:
            decode_timing(model, warm, 2, 1, recurrent=recurrent)
    rows = []
    for ctx in sorted(int(c) for c in contexts):
        ids = torch.randint(0, vocab, (batch, ctx), generator=g).to(device)
        row: dict[str, Any] = {"context": ctx}
        runs = [("student", student, True, graphs)] + ([("student_eager", student, True, False)] if graphs else [])
        for label, model, recurrent, graphed in runs + [("teacher", t_model, False, False)]:
            if label == "teacher" and not teacher:
                continue
            try:
                row[label] = decode_timing(model, ids, new_tokens, warmup_tokens, recurrent=recurrent, graphs=graphed)
            except Exception as err:  # noqa: BLE001 - e.g. out of memory at the longest context
                row[label] = {"error": f"{type(err).__name__}: {err}"}
            free_memory()
        if ctx > max_pos:
            row["teacher_beyond_trained_context"] = True
        s, t = row.get("student", {}), row.get("teacher", {})
        if "ms_per_token" in s and "ms_per_token" in t and s["ms_per_token"] > 0:
            row["speedup"] = t["ms_per_token"] / s["ms_per_token"]
        rows.append(row)
    out: dict[str, Any] = {
        "shape": "custom" if teacher_source else canonical_shape(shape), "mixer": mixer,
        "options": dict(options or {}), "layers": t_model.config.num_hidden_layers, "batch": batch,
        "attention_layers": sorted(student.config.kept_layers()),
        **({"graph_skipped": blocker} if blocker and device.type == "cuda" else {}),
        "dtype": str(dtype).removeprefix("torch."), "device": str(device), "new_tokens": new_tokens, "rows": rows,
    }
    for label in ("student", "student_eager", "teacher"):
        if any(label in r for r in rows):
            out[f"{label}_flatness"] = flatness([r.get(label, {}).get("ms_per_token") for r in rows])
    free_memory(t_model, student)
    return out


def flatness(ms_per_token: Sequence[Optional[float]]) -> Optional[float]:
    """ms/token at the longest context over the shortest (inputs ordered by context); None if either is missing."""
    vals = list(ms_per_token)
    if len(vals) < 2 or not vals[0] or not vals[-1]:
        return None
    return vals[-1] / vals[0]
