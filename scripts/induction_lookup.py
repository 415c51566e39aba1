r"""Can a linear memory do what the teacher's induction heads do? For each induction head of the teacher, on the
copy probe's prompts (harness.eval.copy: random tokens shown twice), each query of the second copy reads the
context through four readouts, and the probe asks whether what comes out is the value of the induction target (the
token after the query token's earlier occurrence) rather than any other value of the context:

- softmax: the head itself, o_t = sum_s softmax(q_t . k_s * scale) v_s (what the teacher computes);
- taylor: softmax's exp replaced by its second-order Taylor form, weights 1 + a + a^2 / 2 with a = q_t . k_s * scale,
  normalised over s: Based's feature map (a linear state of D^2 + D + 1 rows per head computes it exactly);
- linear: o_t = sum_s (q^_t . k^_s) v_s with q and k L2-normalised: an additive state with no decay (the
  read-out of linear attention and GLA, and the delta rule's first write of each key);
- least squares: o_t = S_t^T q^_t with S_t = argmin_S sum_{s<=t} |S^T k^_s - v_s|^2 + ridge |S|^2, the best
  linear map of the context's keys to its values: what an ideal delta rule's state converges to (its `[D, D]` state
  per head holds it exactly only while the keys number at most D);
- least squares, queried by a fitted query: q^_t through one linear map per head, fitted (ridge regression) to
  send the queries of other sequences (the next seed's) to their targets' keys: whether a re-projection of the
  query, which stage 1 can learn (it trains the mixer's q_proj), gives the lookup back;
- least squares, queried by the target's own key (q^_t replaced by k^_target): the memory's capacity alone, with
  the query's mismatch to the key removed.

A readout hits when its output's nearest context value (cosine, over the values at positions <= t) is the target's.
Chance is 1 / (t + 1). The teacher's q and k are read with its RoPE ("rope", what its heads compute) or without
("plain", what the study's mixers read: `rope: false`). No mixer is trained here: this bounds what the teacher's own
q / k / v allow a linear state of one head's size, and splits a failure into the lookup (linear against softmax)
and the state's load (least squares against its capacity row, and both against the copy's length).

    .venv/bin/python scripts/induction_lookup.py --heads 17.3 18.6 20.6 23.2 --lengths 16 64 256 \
        --sequences 8 --out docs/results/retrieval-135m/induction-lookup

Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

READOUTS = ("softmax", "taylor", "linear", "least_squares", "fitted_query", "capacity")


def parse_head(text: str) -> tuple[int, int]:
    """'18.6' -> (18, 6): layer 18, head 6."""
    layer, dot, head = text.partition(".")
    if not dot or not layer.isdigit() or not head.isdigit():
        raise argparse.ArgumentTypeError(f"'{text}' is not LAYER.HEAD, e.g. 18.6")
    return int(layer), int(head)


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def readout_weights(q: torch.Tensor, k: torch.Tensor, queries: torch.Tensor, targets: torch.Tensor, *,
                    scale: float, ridge: float, query_map: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
    """One head's mixing weights of each readout (module docstring) for the query positions `[Q]`: {readout:
    `[Q, T]`}, zero above each query's position. q, k `[T, D]` (float64 advised); `targets` `[Q]` are the positions
    whose keys the capacity readout queries with; `query_map` `[D, D]` (fit_query_map's) adds "fitted_query"."""
    T, D = k.shape
    causal = torch.arange(T)[None, :] <= queries[:, None]  # [Q, T]
    scores = (q[queries] @ k.T) * scale
    softmax = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    taylor = (1 + scores + scores ** 2 / 2) * causal
    taylor = taylor / taylor.sum(-1, keepdim=True)
    qn, kn = _unit(q), _unit(k)
    linear = (qn[queries] @ kn.T) * causal
    gram = torch.cumsum(kn[:, :, None] * kn[:, None, :], 0)[queries]  # [Q, D, D]: sum_{s<=t} k^_s k^_s^T
    eye = torch.eye(D, dtype=k.dtype)

    def least_squares(probe: torch.Tensor) -> torch.Tensor:  # alpha = K_t (K_t^T K_t + ridge I)^-1 probe
        solved = torch.linalg.solve(gram + ridge * eye, probe[..., None])[..., 0]  # [Q, D]
        return (solved @ kn.T) * causal

    out = {"softmax": softmax, "taylor": taylor, "linear": linear, "least_squares": least_squares(qn[queries]),
           "capacity": least_squares(kn[targets])}
    if query_map is not None:
        out["fitted_query"] = least_squares(_unit(qn[queries] @ query_map))
    return out


def fit_query_map(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], ridge: float) -> torch.Tensor:
    """The map A `[D, D]` minimising sum |q^ A - k^|^2 + ridge |A|^2 over the (unit queries `[Q, D]`, unit target
    keys `[Q, D]`) pairs given."""
    x = torch.cat([p[0] for p in pairs])
    y = torch.cat([p[1] for p in pairs])
    eye = torch.eye(x.shape[1], dtype=x.dtype)
    return torch.linalg.solve(x.T @ x + ridge * eye, x.T @ y)


def hits(weights: torch.Tensor, v: torch.Tensor, queries: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per query `[Q]` (bool): whether o = weights @ v is nearer (cosine) to v[target] than to every other value at
    positions <= the query's."""
    out = _unit(weights @ v)
    similarity = out @ _unit(v).T  # [Q, T]
    causal = torch.arange(v.shape[0])[None, :] <= queries[:, None]
    return similarity.masked_fill(~causal, float("-inf")).argmax(-1) == targets


def head_qkv(probe, x: torch.Tensor, head: int, rope: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The teacher head's q, k, v `[T, D]` (float64) for one row's layer input x `[1, T, hidden]`, with or without
    its RoPE (harness.probes.AttentionProbe's own projections)."""
    q, k, v = probe._qkv(x, torch.arange(x.shape[1])[None], rope=rope)
    return q[0, :, head].double(), k[0, :, head].double(), v[0, :, head].double()


def head_views(model, tokenizer, heads: Sequence[tuple[int, int]], lengths: Sequence[int], *, sequences: int,
               seed: int) -> Iterator[dict]:
    """For each length, copy-probe prompt (harness.eval.copy's, no gap), head and RoPE setting: {"length",
    "sequence", "layer", "head", "rope", "q", "k", "v" `[T, D]` float64, "queries", "targets", "scale"}."""
    from harness.config.evaluation import CopyConfig
    from harness.eval.copy import (Layout, draw_sequences, induction_queries, layer_inputs, layer_probes, prompts,
                                   token_range, tokenizer_prefix, vocabulary_size)

    cfg = CopyConfig(lengths=list(lengths), sequences=sequences, seed=seed)
    rng = token_range(cfg, vocabulary_size(model, tokenizer), list(getattr(tokenizer, "all_special_ids", [])))
    prefix = tokenizer_prefix(tokenizer)
    probes = layer_probes(model)
    if probes is None:
        raise SystemExit("the model's layers cannot be read as softmax attention (a Llama-style teacher is needed)")
    for length in lengths:
        queries, targets = induction_queries(Layout(len(prefix), length, 0))
        ids = prompts(draw_sequences(cfg, length, rng), prefix, length)
        for index in range(ids.shape[0]):
            with layer_inputs(model) as store, torch.no_grad():
                model(input_ids=ids[index:index + 1])
                inputs = {layer: store[layer].float() for layer, _ in heads}
            for layer, head in heads:
                probe = probes[layer].probe
                for rope in (True, False):
                    with torch.no_grad():
                        q, k, v = head_qkv(probe, inputs[layer], head, rope)
                    yield {"length": length, "sequence": index, "layer": layer, "head": head, "rope": rope, "q": q,
                           "k": k, "v": v, "queries": queries, "targets": targets, "scale": probe.scaling}


def measure(model, tokenizer, heads: Sequence[tuple[int, int]], lengths: Sequence[int], *, sequences: int,
            seed: int, ridge: float, progress: bool = True) -> dict:
    """Hit rates per (length, head, RoPE or not, readout), each the mean over the sequences' induction queries,
    with the per-sequence rates for intervals. The fitted query maps are fitted on the prompts of seed + 1 (the same
    lengths and count) and scored on those of `seed`."""
    from harness.eval.copy import Layout, induction_queries, tokenizer_prefix

    pairs: dict[tuple, list] = {}
    for view in head_views(model, tokenizer, heads, lengths, sequences=sequences, seed=seed + 1):
        qn, kn = _unit(view["q"]), _unit(view["k"])
        pairs.setdefault((view["layer"], view["head"], view["rope"]), []).append(
            (qn[view["queries"]], kn[view["targets"]]))
    maps = {key: fit_query_map(p, ridge) for key, p in pairs.items()}
    rows, started = [], time.time()
    for view in head_views(model, tokenizer, heads, lengths, sequences=sequences, seed=seed):
        queries, targets = view["queries"], view["targets"]
        with torch.no_grad():
            weights = readout_weights(view["q"], view["k"], queries, targets, scale=view["scale"], ridge=ridge,
                                      query_map=maps[(view["layer"], view["head"], view["rope"])])
        for name, w in weights.items():
            rows.append({"length": view["length"], "layer": view["layer"], "head": view["head"], "rope": view["rope"],
                         "readout": name, "sequence": view["sequence"],
                         "hit_rate": float(hits(w, view["v"], queries, targets).double().mean())})
    if progress:
        print(f"{len(rows)} rates in {time.time() - started:.1f} s", file=sys.stderr)
    first = len(tokenizer_prefix(tokenizer))
    return {"rows": rows, "chance": {str(n): float((1.0 / (induction_queries(Layout(first, n, 0))[0] + 1.0)).mean())
                                     for n in lengths}}


def summarise(rows: list[dict]) -> list[dict]:
    """Mean hit rate and its 95% bootstrap interval over the sequences, per (length, head, rope, readout)."""
    import numpy as np

    from harness.eval.recovery import paired_bootstrap, percentile_interval

    groups: dict[tuple, list[float]] = {}
    for r in rows:
        groups.setdefault((r["length"], r["layer"], r["head"], r["rope"], r["readout"]), []).append(r["hit_rate"])
    out = []
    for (length, layer, head, rope, readout), values in groups.items():
        draws = paired_bootstrap(np.asarray(values, dtype=float)[None], stream=f"{length}.{layer}.{head}")[0]
        low, high = percentile_interval(draws) or (float("nan"), float("nan"))
        out.append({"length": length, "layer": layer, "head": head, "rope": rope, "readout": readout,
                    "hit_rate": sum(values) / len(values), "interval": [low, high], "sequences": len(values)})
    return out


def markdown(summary: list[dict], chance: dict, header: dict) -> str:
    """One table per RoPE setting: a row per (head, length), a column per readout (hit rate %, [interval])."""
    lines = [f"# Induction heads read by a linear memory ({header['model']})", "",
             f"`{header['command']}`", "",
             f"{header['sequences']} sequences per length, seed {header['seed']}, ridge {header['ridge']}; "
             f"{header['machine']}, {header['seconds']:.0f} s. Hit: the readout's nearest context value is the "
             "induction target's (chance per length: " +
             ", ".join(f"{n}: {100 * c:.1f}%" for n, c in chance.items()) + ").", ""]
    cell = {(s["length"], s["layer"], s["head"], s["rope"], s["readout"]): s for s in summary}
    keys = sorted({(s["layer"], s["head"], s["length"]) for s in summary})
    for rope, title in ((True, "with the teacher's RoPE"), (False, "without RoPE (what a `rope: false` mixer reads)")):
        lines += [f"## {title}", "", "| head | copy length | " + " | ".join(READOUTS) + " |",
                  "|---|---|" + "---|" * len(READOUTS)]
        for layer, head, length in keys:
            parts = []
            for readout in READOUTS:
                s = cell.get((length, layer, head, rope, readout))
                parts.append("" if s is None else
                             f"{100 * s['hit_rate']:.1f}% [{100 * s['interval'][0]:.0f}, {100 * s['interval'][1]:.0f}]")
            lines.append(f"| {layer}.{head} | {length} | " + " | ".join(parts) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct-gguf",
                   help="A teacher source (harness.teacher.load_teacher): a Hugging Face folder, a .gguf file or an "
                        "alias (default: %(default)s).")
    p.add_argument("--heads", type=parse_head, nargs="+", required=True,
                   help="LAYER.HEAD of each head to read, e.g. 17.3 18.6 (harness eval copy --induction ranks them).")
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 256], help="Copy lengths L (tokens).")
    p.add_argument("--sequences", type=int, default=8, help="Random sequences per length (default: %(default)s).")
    p.add_argument("--seed", type=int, default=0, help="Seeds the sequences (the copy probe's seed).")
    p.add_argument("--ridge", type=float, default=1e-3,
                   help="Ridge of the least-squares readouts (default: %(default)s); keys are unit vectors.")
    p.add_argument("--out", required=True, help="Writes OUT.json and OUT.md.")
    a = p.parse_args(argv)
    if any(n < 2 for n in a.lengths):
        p.error(f"--lengths {a.lengths}: each must be at least 2 (a query needs an earlier occurrence to find)")
    if a.sequences < 1 or a.ridge <= 0:
        p.error(f"--sequences {a.sequences} must be >= 1 and --ridge {a.ridge} > 0")
    from harness.teacher import load_teacher

    started = time.time()
    teacher = load_teacher(a.model, dtype=torch.float32)
    n_layers = teacher.model.config.num_hidden_layers
    n_heads = teacher.model.config.num_attention_heads
    bad = [f"{l}.{h}" for l, h in a.heads if not (0 <= l < n_layers and 0 <= h < n_heads)]
    if bad:
        p.error(f"--heads {' '.join(bad)}: the model has layers 0..{n_layers - 1} and heads 0..{n_heads - 1}")
    result = measure(teacher.model.eval(), teacher.tokenizer, a.heads, a.lengths, sequences=a.sequences,
                     seed=a.seed, ridge=a.ridge)
    header = {"model": a.model, "command": "python " + " ".join(["scripts/induction_lookup.py", *(argv or sys.argv[1:])]),
              "sequences": a.sequences, "seed": a.seed, "ridge": a.ridge, "heads": [f"{l}.{h}" for l, h in a.heads],
              "lengths": a.lengths, "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, fp32 model, "
              "fp64 readouts", "seconds": time.time() - started}
    summary = summarise(result["rows"])
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    as_json, as_md = Path(f"{out}.json"), Path(f"{out}.md")  # not with_suffix: OUT may hold dots (ridge1e-1)
    as_json.write_text(json.dumps({**header, "chance": result["chance"], "summary": summary,
                                                    "rows": result["rows"]}, indent=1) + "\n")
    as_md.write_text(markdown(summary, result["chance"], header))
    print(as_md.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
