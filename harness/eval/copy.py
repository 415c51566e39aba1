"""In-context copying: greedy copy accuracy on repeated random token sequences, and each layer's induction and
previous-token scores.

NIAH asks a model to find one fact in prose; this probe measures the mechanism underneath, on text with no
meaning at all. A sequence of `length` random token ids is shown twice; a model that copies predicts every token
of the second copy from the first. One prompt (token positions from 0):

    prefix   the ids the tokenizer puts before any text by default (BOS for Llama-2-style tokenizers; none for
             SmolLM2's, whose bos_token <|im_start|> is a chat-turn marker it never adds to text; the issue's
             75.6% was measured without one); P tokens
    copy 1   s_0 .. s_{L-1}                      at positions P .. P+L-1
    filler   `gap` random ids, drawn like s      at positions P+L .. P+L+gap-1
    copy 2   s_0 .. s_{L-1} again                at positions P+L+gap .. P+2L+gap-1 (the prompt ends here)

Sequences (`draw_sequences`): row i of `torch.randint(low, high, (sequences, L + gap))` from a CPU generator
seeded with `seed` (one row = copy 1 then the filler), so that row i depends only on (seed, L, gap, i), not on how
many sequences are drawn. Every id of a row (sequence and filler) is distinct and no special token: an id that
repeats an earlier one of its row, or is one of the tokenizer's special ids, is redrawn from a side generator
seeded by (seed, L, gap, i). Each token of the second copy then has exactly one earlier occurrence (in the first
copy), so copying is unambiguous and a perfect induction mechanism scores 100%. With the defaults (seed 0, ids
1000..19999) the draw at L = 64 is the issue's (`torch.manual_seed(0); torch.randint(1000, 20000, (8, 64))`)
but for the one id of sequence 6 that repeats.

Token range: ids in [token_low, token_high), the high end clipped to the vocabulary (the tokenizer's size, or the
model's output size if smaller). The default 1000..20000 skips the first thousand ids of a BPE vocabulary (special
tokens, the 256 byte tokens and the earliest merges, which are fragments rather than words) and stays among
common merges that the model has seen often. A vocabulary that ends at or below token_low (a test tokenizer)
falls back to every non-special id, with a warning; copy.json records the range used.

Copy accuracy (teacher-forced: one forward pass per batch of prompts, no generation). For second-copy token j
(j = 0..L-1) the prediction is the argmax of the logits at the position before it; a hit when it equals s_j.

    copy_acc              hits / L over all second-copy tokens, j = 0..L-1
    copy_acc_after_first  hits / (L - 1) over j = 1..L-1: the tokens whose predecessor s_{j-1} occurred before,
                          so an induction head can predict them (the issue's 75.6% is this one: 381 of 504 tokens
                          of its draw for SmolLM2-135M-Instruct in float32; 382 of 504 on this probe's draw)
    first_token_acc       the hit rate of j = 0: after the filler (gap > 0) it cannot be predicted by induction;
                          without a gap the model must guess that the sequence starts again
    nll_after_first       mean negative log-likelihood (nats) of s_j, j = 1..L-1: a smooth companion of the
                          accuracy that separates students which all score 0%
    by_position           copy_acc per bucket of j (`position_buckets` equal spans): accuracy against the position
                          in the copy shows a recurrent state saturating (early tokens copied, later ones lost)

Per length: the mean over sequences (each has L tokens, so it is also the mean over tokens) and a 95% percentile
bootstrap interval over sequences (`harness.eval.recovery.paired_bootstrap`, 1000 resamples seeded by the length
and the measure, so that the same hits give the same interval whatever the label): tokens of one sequence are not
independent, sequences are. `chance` = 1 / (ids in the range): the hit rate of a uniform guess over the drawn ids.

Induction score (with `induction`, for lengths <= `induction_max_length`: mixing matrices are T x T per head and
sequence). For query position t = P+L+gap+i in the second copy, i = 0..L-2 (the queries whose next token s_{i+1}
is a second-copy token), the induction target is position P+i+1: the token after the previous occurrence of the
query's token s_i. Each layer's mixing matrix A `[heads, T, T]` on the layer's own input (the model's activations,
the layer recomputed in float32) comes from `harness.probes`:

    softmax attention  (a teacher's layers, a hybrid student's kept `attention_layers`): `AttentionProbe.mixing`,
                       the attention probabilities; score = A[t, target], the probability mass on the target
    mixer              (a student's linear-attention layers): `MixerProbe.mixing`, the effective weights
                       o_t = sum_s A_ts v_s (decays, gates, betas, normalisers and feature maps included; over the
                       values the recurrence reads, after a short convolution where the mixer has one; a mixer's
                       sliding-window branch, `options.window`, is not part of A). They are no probabilities (signed,
                       rows need not sum to 1), so score = |A[t, target]| / sum_{s <= t} |A[t, s]|, the target's
                       share of the row's absolute weight (0 for a row of zeros).

For softmax rows both formulas agree (non-negative, summing to 1). Per head: the mean over the L-1 queries and the
sequences. Per layer: `mean` (over heads) and `max` (over heads, and `max_head`, its index). `chance`: the mean over
the same queries of 1 / (t + 1), the score of a row spread evenly over its t + 1 causal keys. A head that copies
puts most of its mass on the target (score near 1); a previous-token or local head scores near 0.

Previous-token score (the other half of an induction circuit: a head in an earlier layer that attends to t - 1, so
that the induction head can match on the token before): from the same mixing matrices, score = |A[t, t - 1]| /
sum_{s <= t} |A[t, s]| (the probability on t - 1 for softmax rows), averaged over the queries t = P+1 .. P+2L+gap-1
(both copies and the filler between them, but for the first copy's first token, whose predecessor is the prefix or
nothing); per layer `mean`, `max`, `max_head` and `chance` (1 / (t + 1) over these queries) as for induction.

Outputs in `out_dir`:
    copy_sequences.jsonl  a header line (the settings a record depends on: COPY_FORMAT, label, seed, gap, the
                          token range used, the prefix ids, the vocabulary size, the model dtype), then one line
                          per (length, sequence): "hits" (a 0/1 string over the L second-copy tokens),
                          "nll_after_first", "sequence_sha" (of the prompt's ids: equal across models, for paired
                          comparisons), and with induction "induction" and "previous_token" (per layer, per head,
                          the sequence's mean score). A rerun keeps every record already there (a last line cut
                          short by a crash is dropped) and computes the rest, and both scores for a record that lacks
                          either (one written before the previous-token score existed is scored again); a different
                          header is an error (overwrite=True starts over). Records are keyed on (length, index):
                          other lengths or more sequences reuse the overlap.
    copy.json             `summarise`: the settings, the definitions above in words, per length the accuracies
                          with intervals, and per length <= the cap the per-layer induction scores (key
                          "induction"), the previous-token scores beside them ("previous_token" in that entry; left
                          out when summarising records that lack them).
"""

from __future__ import annotations

import copy as copy_module
import hashlib
import json
import math
import os
import warnings
import zlib
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch
from torch import nn

from harness.config import CopyConfig, CopyError
from harness.eval.niah import position_limit
from harness.eval.records import append_record, changed_settings, resume_lines
from harness.eval.recovery import paired_bootstrap, percentile_interval
from harness.files import atomic_write_text

COPY_FORMAT = 1  # bump when sequences or scoring change, so that old records are not mixed in
SEQUENCES_FILE, JSON_FILE = "copy_sequences.jsonl", "copy.json"


# ---------------------------------------------------------------------------------------------- sequences


@dataclass(frozen=True)
class TokenRange:
    """The ids sequences are drawn from: [low, high) without `special` (the tokenizer's special ids in it)."""

    low: int
    high: int
    special: tuple[int, ...]

    @property
    def size(self) -> int:
        return self.high - self.low - len(self.special)


def vocabulary_size(model: Any, tokenizer: Any) -> int:
    """The ids both the tokenizer and the model's output know: len(tokenizer), or the model's vocab_size if smaller."""
    size = len(tokenizer)
    model_size = getattr(getattr(model, "config", None), "vocab_size", None)
    return min(size, int(model_size)) if model_size else size


def token_range(cfg: CopyConfig, vocab: int, special_ids: list[int]) -> TokenRange:
    """[token_low, min(token_high, vocab)), or every id of a vocabulary that ends at or below token_low (warned)."""
    high, low = min(cfg.token_high, vocab), cfg.token_low
    if low >= high:
        warnings.warn(f"copy probe: the vocabulary ({vocab} ids) ends at or below token_low={low}; drawing from "
                      f"every non-special id 0..{vocab - 1} instead", stacklevel=3)
        low = 0
    special = tuple(sorted({int(i) for i in special_ids if low <= int(i) < high}))
    return TokenRange(low, high, special)


def check_range(rng: TokenRange, cfg: CopyConfig) -> None:
    """CopyError when the range holds fewer distinct ids than the longest row (L + gap) needs."""
    need = max(cfg.lengths) + cfg.gap
    if rng.size < need:
        raise CopyError(f"The copy probe's token range {rng.low}..{rng.high - 1} holds {rng.size} usable ids, fewer "
                        f"than the {need} distinct ids a row of length {max(cfg.lengths)} plus gap {cfg.gap} needs. "
                        "Use shorter lengths or a smaller gap, or widen token_low/token_high (within the vocabulary).")


def draw_sequences(cfg: CopyConfig, length: int, rng: TokenRange) -> torch.Tensor:
    """The rows `[sequences, length + gap]` of one length: the sequence, then its filler (module docstring)."""
    generator = torch.Generator().manual_seed(cfg.seed)
    rows = torch.randint(rng.low, rng.high, (cfg.sequences, length + cfg.gap), generator=generator)
    return torch.stack([_distinct(row, rng, _side_seed(cfg, length, i)) for i, row in enumerate(rows)])


def _side_seed(cfg: CopyConfig, length: int, index: int) -> int:
    return zlib.crc32(f"copy|{cfg.seed}|{length}|{cfg.gap}|{index}".encode())


def _distinct(row: torch.Tensor, rng: TokenRange, seed: int) -> torch.Tensor:
    """`row` with each id that repeats an earlier one, or is special, redrawn from a generator seeded by `seed`."""
    seen, out, side, banned = set(), row.tolist(), None, set(rng.special)
    for j, value in enumerate(out):
        while value in seen or value in banned:
            side = side or torch.Generator().manual_seed(seed)
            value = int(torch.randint(rng.low, rng.high, (1,), generator=side))
        seen.add(value)
        out[j] = value
    return torch.tensor(out, dtype=torch.long)


@dataclass(frozen=True)
class Layout:
    """Where the parts of one prompt sit: the prefix's length, the sequence length and the gap."""

    prefix: int
    length: int
    gap: int

    @property
    def first(self) -> int:
        return self.prefix

    @property
    def second(self) -> int:
        return self.prefix + self.length + self.gap

    @property
    def total(self) -> int:
        return self.second + self.length


def prompts(rows: torch.Tensor, prefix: list[int], length: int) -> torch.Tensor:
    """Prompts `[n, P + 2L + gap]`: prefix, sequence, filler, sequence (rows from `draw_sequences`)."""
    head = torch.tensor(prefix, dtype=torch.long).expand(rows.shape[0], len(prefix))
    return torch.cat([head, rows, rows[:, :length]], dim=1)


def tokenizer_prefix(tokenizer: Any) -> list[int]:
    """The ids the tokenizer puts before any text by default (BOS for Llama-2-style tokenizers; often none)."""
    plain = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    full = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    return full[: full.index(plain[0])] if plain and plain[0] in full else []


# ---------------------------------------------------------------------------------------------- copy accuracy


def forward_logits(model: Any, ids: torch.Tensor, keep: int) -> torch.Tensor:
    """The logits of the last `keep` positions `[B, keep, V]` of one teacher-forced forward pass (only those are
    computed where the model's forward takes `logits_to_keep`, as transformers' models and the students do)."""
    kwargs: dict[str, Any] = {}
    params = _forward_parameters(model)
    if "logits_to_keep" in params:
        kwargs["logits_to_keep"] = keep
    if "use_cache" in params:
        kwargs["use_cache"] = False
    out = model(input_ids=ids, **kwargs)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits[:, -keep:]


def _forward_parameters(model: Any) -> set[str]:
    import inspect

    try:
        return set(inspect.signature(model.forward if isinstance(model, nn.Module) else model).parameters)
    except (TypeError, ValueError):
        return set()


def copy_record(logits: torch.Tensor, sequence: torch.Tensor) -> dict:
    """One sequence's copy fields from the logits `[L + 1, V]` of the positions P+L+gap-1 .. P+2L+gap-1 (the
    last one predicts past the prompt and is not read) and its ids `[L]`: "hits" and "nll_after_first"."""
    scores = logits[:-1].float()
    target = sequence.to(scores.device)
    hits = scores.argmax(-1) == target
    nll = torch.logsumexp(scores, -1) - scores.gather(-1, target[:, None])[:, 0]
    return {"hits": "".join("1" if h else "0" for h in hits.tolist()),
            "nll_after_first": round(float(nll[1:].mean()), 6)}


# ---------------------------------------------------------------------------------------------- induction


def induction_queries(layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """(query positions, their targets) `[L - 1]` each: t = second + i, target = first + i + 1, i = 0..L-2."""
    i = torch.arange(layout.length - 1)
    return layout.second + i, layout.first + i + 1


def previous_token_queries(layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """(query positions, their targets) `[2L + gap - 1]` each: t = first + 1 .. total - 1 (both copies and the gap
    between them, the first copy's first token left out), target = t - 1."""
    queries = torch.arange(layout.first + 1, layout.total)
    return queries, queries - 1


HEAD_SCORES = {"induction": induction_queries, "previous_token": previous_token_queries}  # record key -> queries


def induction_chance(layout: Layout) -> float:
    """The mean over the induction queries t of 1 / (t + 1): a row spread evenly over its causal keys."""
    return _chance(induction_queries(layout)[0])


def previous_token_chance(layout: Layout) -> float:
    """The mean over the previous-token queries t of 1 / (t + 1): a row spread evenly over its causal keys."""
    return _chance(previous_token_queries(layout)[0])


def _chance(queries: torch.Tensor) -> float:
    return float((1.0 / (queries.double() + 1)).mean())


def induction_scores(mixing: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Per head, the mean over the induction queries of |A[t, target]| / sum_{s <= t} |A[t, s]| (module docstring),
    for mixing weights `[H, T, T]` (query rows, key columns); `[H]`. Entries above the diagonal are ignored."""
    return target_share(mixing, *induction_queries(layout))


def previous_token_scores(mixing: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Per head, the mean over the previous-token queries of |A[t, t - 1]| / sum_{s <= t} |A[t, s]| (module
    docstring), for mixing weights `[H, T, T]`; `[H]`. Entries above the diagonal are ignored."""
    return target_share(mixing, *previous_token_queries(layout))


def target_share(mixing: torch.Tensor, queries: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per head, the mean over `queries` of |A[t, target]| / sum_{s <= t} |A[t, s]| (0 for a row of zeros), for
    mixing weights `[H, T, T]` and each query's target `[Q]`; `[H]` in float32 on the CPU."""
    queries, targets = queries.to(mixing.device), targets.to(mixing.device)
    rows = mixing[:, queries].abs().double()  # [H, Q, T]
    keys = torch.arange(mixing.shape[-1], device=mixing.device)
    rows = rows.masked_fill(keys[None, :] > queries[:, None], 0.0)
    total = rows.sum(-1)
    on_target = rows.gather(-1, targets.view(1, -1, 1).expand(rows.shape[0], -1, 1))[..., 0]
    share = torch.where(total > 0, on_target / total.clamp_min(1e-300), torch.zeros_like(total))
    return share.mean(-1).float().cpu()


@dataclass
class LayerProbe:
    """One layer's mixing-weight reader: "attention" (softmax) or "mixer" (its name in `name`)."""

    kind: str
    name: str
    probe: Any  # harness.probes.AttentionProbe or MixerProbe, on float32 copies of the layer's modules


def layer_probes(model: Any) -> Optional[list[LayerProbe]]:
    """The probes of every layer of a student (HarnessForCausalLM: mixers, and kept attention layers as attention)
    or a teacher (Llama-style: every layer softmax attention); None for a model whose layers cannot be read."""
    from harness.student import AttentionBlock, HarnessForCausalLM
    from harness.probes import AttentionProbe, MixerProbe

    if isinstance(model, HarnessForCausalLM):
        inner, out = model.model, []
        for block in inner.layers:
            if isinstance(block, AttentionBlock):
                s = block.self_attn.shape
                out.append(LayerProbe("attention", "softmax", AttentionProbe(
                    _float(block.self_attn), _float(inner.attention_rotary), s.num_heads, s.num_kv_heads, s.head_dim)))
            else:
                rotary = _float(inner.rotary_emb) if inner.rotary_emb is not None else None
                out.append(LayerProbe("mixer", block.mixer.name, MixerProbe(_float(block.mixer), rotary)))
        return out
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or getattr(inner, "rotary_emb", None) is None or not all(hasattr(x, "self_attn") for x in layers):
        return None
    c = model.config
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    rotary = _float(inner.rotary_emb)
    return [LayerProbe("attention", "softmax", AttentionProbe(_float(x.self_attn), rotary, heads, kv_heads, head_dim))
            for x in layers]


def _float(module: nn.Module) -> nn.Module:
    """`module` itself when every parameter and buffer is float32, else a float32 copy (the probe's arithmetic)."""
    tensors = [*module.parameters(), *module.buffers()]
    if all(t.dtype == torch.float32 for t in tensors if t.is_floating_point()):
        return module
    return copy_module.deepcopy(module).float()


@contextmanager
def layer_inputs(model: Any) -> Iterator[dict[int, torch.Tensor]]:
    """Within the block, each forward pass stores every layer's normalised input (its input_layernorm's output, what
    its attention or mixer reads) in the yielded dict, by layer index."""
    from harness.teacher import decoder_of

    store: dict[int, torch.Tensor] = {}
    handles = []

    def keep(index: int):
        def hook(module, args, output):
            store[index] = output.detach()
        return hook

    try:
        for i, layer in enumerate(decoder_of(model).layers):
            handles.append(layer.input_layernorm.register_forward_hook(keep(i)))
        yield store
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def sequence_head_scores(probes: list[LayerProbe], inputs: dict[int, torch.Tensor], row: int,
                         layout: Layout) -> dict[str, list[list[float]]]:
    """Per score of HEAD_SCORES ("induction", "previous_token"), per layer, per head, the score of batch row `row`;
    both from the one mixing matrix computed per layer."""
    out: dict[str, list[list[float]]] = {key: [] for key in HEAD_SCORES}
    for index, layer in enumerate(probes):
        x = inputs[index][row:row + 1].float()
        positions = torch.arange(x.shape[1], device=x.device)[None]
        mixing = layer.probe.mixing(x, positions)[0]
        for key, queries in HEAD_SCORES.items():
            out[key].append([round(float(v), 6) for v in target_share(mixing, *queries(layout))])
    return out


# ---------------------------------------------------------------------------------------------- records


def run_header(cfg: CopyConfig, label: str, rng: TokenRange, prefix: list[int], vocab: int, dtype: str) -> dict:
    """The settings every record depends on; a resumed run must match them."""
    return {"copy_format": COPY_FORMAT, "label": label, "seed": cfg.seed, "gap": cfg.gap,
            "token_range": [rng.low, rng.high], "special_ids_skipped": list(rng.special), "prefix": prefix,
            "vocabulary": vocab, "dtype": dtype}


def load_records(path: Path, header: dict, overwrite: bool = False) -> dict[tuple[int, int], dict]:
    """Finished records in `path` by (length, index), after checking its header; a new file gets `header` written.
    A last line cut short by a crash is dropped; a different header raises CopyError naming what changed, unless
    `overwrite` (then the file starts over)."""
    saved, lines = resume_lines(path, header, overwrite)
    detail = changed_settings(saved, header)
    if detail:
        raise CopyError(f"{path} was written with other copy-probe settings ({detail}). Use another output folder, "
                        "delete the file, or overwrite to start over.")
    records = {}
    for n, line in enumerate(lines, start=2):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise CopyError(f"{path} line {n} is not JSON ({err}); delete the file to start over.") from None
        records[(int(record["length"]), int(record["index"]))] = record
    return records


def wants_induction(cfg: CopyConfig, length: int) -> bool:
    return cfg.induction and length <= cfg.induction_max_length


def is_complete(record: Optional[dict], cfg: CopyConfig, length: int, readable: bool) -> bool:
    """Whether a saved record has what `cfg` asks: the copy fields, and every score of HEAD_SCORES where induction is
    asked and the layers are readable (a record written before the previous-token score existed is scored again)."""
    if record is None or "hits" not in record:
        return False
    return not (readable and wants_induction(cfg, length)) or all(key in record for key in HEAD_SCORES)


def _sha(ids: torch.Tensor) -> str:
    return hashlib.sha256(json.dumps(ids.tolist()).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------- summary


def _interval(values: list[float], stream: str) -> Optional[list[float]]:
    """The 95% percentile bootstrap interval of the mean of `values` (resampled over sequences)."""
    draws = paired_bootstrap(np.asarray(values, dtype=float)[None], stream=stream)[0]
    interval = percentile_interval(draws)
    return None if interval is None else [round(interval[0], 6), round(interval[1], 6)]


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else math.nan


def by_position(hits: list[str], buckets: int) -> list[dict]:
    """copy_acc over `buckets` equal spans [start, end) of the copy's token indices, pooled over sequences."""
    length = len(hits[0])
    n = min(buckets, length)
    edges = [round(b * length / n) for b in range(n + 1)]
    return [{"start": a, "end": b, "acc": _mean([h[j] == "1" for h in hits for j in range(a, b)])}
            for a, b in zip(edges, edges[1:])]


def length_summary(rows: list[dict], length: int, cfg: CopyConfig, rng: TokenRange) -> dict:
    """copy.json's entry of one length from its sequences' records (module docstring)."""
    hits = [r["hits"] for r in rows]
    acc = [h.count("1") / length for h in hits]
    after = [h[1:].count("1") / (length - 1) for h in hits]
    return {"n": len(rows), "tokens": len(rows) * length,
            "copy_acc": _mean(acc), "copy_acc_ci": _interval(acc, f"copy|{length}|all"),
            "copy_acc_after_first": _mean(after),
            "copy_acc_after_first_ci": _interval(after, f"copy|{length}|after_first"),
            "first_token_acc": _mean([h[0] == "1" for h in hits]),
            "nll_after_first": _mean([r["nll_after_first"] for r in rows]),
            "chance": 1.0 / rng.size, "by_position": by_position(hits, cfg.position_buckets)}


def induction_summary(rows: list[dict], probes: list[LayerProbe], layout: Layout) -> dict:
    """copy.json's induction entry of one length: per layer the heads' induction scores (mean over sequences), their
    mean and max, and the chance level; under "previous_token" the same for the previous-token score, left out when
    a record lacks it (one written before the score existed)."""
    entry = _score_summary(rows, "induction", probes, induction_queries(layout)[0])
    if all("previous_token" in r for r in rows):
        entry["previous_token"] = _score_summary(rows, "previous_token", probes, previous_token_queries(layout)[0])
    return entry


def _score_summary(rows: list[dict], key: str, probes: list[LayerProbe], queries: torch.Tensor) -> dict:
    """The records' `key` scores per layer: each head's mean over sequences, the heads' mean and max; the chance
    level and the number of `queries`."""
    scores = np.asarray([r[key] for r in rows], dtype=float)  # [sequences, layers, heads]
    layers = []
    for index, layer in enumerate(probes):
        heads = scores[:, index].mean(0)
        layers.append({"layer": index, "kind": layer.kind, "name": layer.name, "mean": float(heads.mean()),
                       "max": float(heads.max()), "max_head": int(heads.argmax()),
                       "heads": [round(float(h), 6) for h in heads]})
    return {"chance": _chance(queries), "queries": len(queries), "sequences": len(rows), "layers": layers}


DEFINITIONS = {
    "copy_acc": "teacher-forced greedy: share of the second copy's L tokens whose argmax next-token prediction "
                "(from the position before each) equals the token; mean over sequences",
    "copy_acc_after_first": "the same over the second copy's tokens 2..L (those an induction head can predict: "
                            "their predecessor occurred before)",
    "first_token_acc": "hit rate of the second copy's first token (not predictable by induction after a gap)",
    "nll_after_first": "mean negative log-likelihood (nats) of the second copy's tokens 2..L",
    "ci": "95% percentile bootstrap interval over sequences (1000 resamples)",
    "chance": "1 / (ids in the token range): a uniform guess over the drawn ids",
    "induction": "per head, mean over queries t in the second copy (tokens 1..L-1) of |A[t, target]| / "
                 "sum_{s<=t} |A[t, s]|, target = the position after the query token's occurrence in the first copy; "
                 "A = attention probabilities (softmax layers) or a mixer's effective mixing weights "
                 "(harness.probes.MixerProbe); per layer the mean and max over heads; induction chance = mean over "
                 "the queries of 1/(t+1)",
    "previous_token": "per head, mean over queries t from the first copy's second token to the end of the second "
                      "copy (the gap between the copies included) of |A[t, t-1]| / sum_{s<=t} |A[t, s]|, A as for "
                      "induction; per layer the mean and max over heads (copy.json: induction[length].previous_token); "
                      "previous-token chance = mean over those queries of 1/(t+1)",
}


def summarise(records: dict[tuple[int, int], dict], cfg: CopyConfig, header: dict, rng: TokenRange,
              probes: Optional[list[LayerProbe]], extra: dict, limit: Optional[int] = None) -> dict:
    """copy.json from the records of every (length, index) of `cfg`; `limit`: the model's trained context (a rope
    teacher's max_position_embeddings; None for students), past which a length is marked beyond_max_positions."""
    prefix = len(header["prefix"])
    result: dict[str, Any] = {"label": header["label"], "settings": {**header, **asdict(cfg)}, **extra,
                              "definitions": DEFINITIONS, "lengths": {}, "induction": {}}
    for length in cfg.lengths:
        rows = [records[(length, i)] for i in range(cfg.sequences)]
        layout = Layout(prefix, length, cfg.gap)
        result["lengths"][str(length)] = {**length_summary(rows, length, cfg, rng),
                                          "positions": layout.total,
                                          "beyond_max_positions": limit is not None and layout.total > limit}
        if probes is not None and wants_induction(cfg, length):
            result["induction"][str(length)] = induction_summary(rows, probes, layout)
    return result


def markdown(result: dict) -> str:
    """copy.json as Markdown: the accuracy table per length, then the induction scores per layer and length."""
    s = result["settings"]
    lines = [f"## Copy: {result['label']}", "",
             f"{s['sequences']} random sequences per length, ids {s['token_range'][0]}..{s['token_range'][1] - 1}, "
             f"gap {s['gap']}, prefix {s['prefix'] or 'none'}, seed {s['seed']}; teacher-forced greedy, 95% "
             "bootstrap intervals over sequences.", "",
             "| length | n | copy_acc | after first | first token | NLL after first | by position in the copy |",
             "|---|---|---|---|---|---|---|"]
    for length, e in result["lengths"].items():
        positions = " ".join(f"{100 * b['acc']:.0f}" for b in e["by_position"])
        lines.append(f"| {length} | {e['n']} | {_pct(e['copy_acc'], e['copy_acc_ci'])} | "
                     f"{_pct(e['copy_acc_after_first'], e['copy_acc_after_first_ci'])} | "
                     f"{100 * e['first_token_acc']:.1f}% | {e['nll_after_first']:.3f} | {positions} |")
    if result["induction"]:
        lines += ["", _induction_table(result["induction"])]
    for note in result.get("notes", []):
        lines += ["", f"- {note}"]
    return "\n".join(lines) + "\n"


def _induction_table(induction: dict) -> str:
    lengths = list(induction)
    previous = {n: induction[n].get("previous_token") for n in lengths}
    title = "Induction score per layer (mean over heads / max head); chance " + ", ".join(
        f"{n}: {induction[n]['chance']:.3f}" for n in lengths)
    if any(previous.values()):
        title += "; previous-token score (on t-1, max head); chance " + ", ".join(
            f"{n}: {p['chance']:.3f}" for n, p in previous.items() if p)
    header = [f"L={n} mean | L={n} max (head)" + (f" | L={n} previous-token max (head)" if previous[n] else "")
              for n in lengths]
    columns = sum(3 if previous[n] else 2 for n in lengths)
    lines = [title, "", "| layer | kind | " + " | ".join(header) + " |", "|---|---|" + "---|" * columns]
    for index, first in enumerate(induction[lengths[0]]["layers"]):
        cells = []
        for n in lengths:
            e = induction[n]["layers"][index]
            cells.append(f"{e['mean']:.3f} | {e['max']:.3f} ({e['max_head']})")
            if previous[n]:
                p = previous[n]["layers"][index]
                cells.append(f"{p['max']:.3f} ({p['max_head']})")
        kind = first["name"] if first["kind"] == "mixer" else "attention"
        lines.append(f"| {index} | {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _pct(value: float, interval: Optional[list[float]]) -> str:
    if interval is None:
        return f"{100 * value:.1f}%"
    return f"{100 * value:.1f}% [{100 * interval[0]:.1f}, {100 * interval[1]:.1f}]"


# ---------------------------------------------------------------------------------------------- run


def evaluate_copy(model: Any, tokenizer: Any, cfg: CopyConfig, out_dir: str | os.PathLike[str], *,
                  device: str | torch.device = "cpu", label: str, progress: bool = True,
                  overwrite: bool = False) -> dict:
    """Score `model` on the copy probe of `cfg`, resuming from out_dir/copy_sequences.jsonl; write and return
    copy.json (module docstring). `model`: a causal LM whose forward takes `input_ids` and returns `.logits`
    (a student, a transformers teacher, a test double); an nn.Module is put in eval mode on `device`. Induction
    scores need readable layers (`layer_probes`); for other models copy.json says they were left out."""
    from tqdm.auto import tqdm

    cfg.validate()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(model, nn.Module):
        model.to(device).eval()
    vocab = vocabulary_size(model, tokenizer)
    rng = token_range(cfg, vocab, list(getattr(tokenizer, "all_special_ids", []) or []))
    check_range(rng, cfg)
    prefix = tokenizer_prefix(tokenizer)
    header = run_header(cfg, label, rng, prefix, vocab, _dtype(model))
    records = load_records(out / SEQUENCES_FILE, header, overwrite)
    probes = layer_probes(model) if cfg.induction else None
    keys = [(n, i) for n in cfg.lengths for i in range(cfg.sequences)]
    todo = [k for k in keys if not is_complete(records.get(k), cfg, k[0], probes is not None)]
    with tqdm(total=len(keys), initial=len(keys) - len(todo), desc=f"copy {label}", unit="sequence",
              disable=not progress, dynamic_ncols=True) as bar:
        for length in cfg.lengths:
            indices = [i for n, i in todo if n == length]
            for record in score_length(model, cfg, length, indices, rng, prefix, probes, device):
                append_record(out / SEQUENCES_FILE, record)
                records[(length, record["index"])] = record
                bar.update()
    result = summarise(records, cfg, header, rng, probes, {"notes": _notes(cfg, probes)}, position_limit(model))
    atomic_write_text(out / JSON_FILE, json.dumps(result, indent=1) + "\n")
    return result


def score_length(model: Any, cfg: CopyConfig, length: int, indices: list[int], rng: TokenRange, prefix: list[int],
                 probes: Optional[list[LayerProbe]], device: str | torch.device) -> Iterator[dict]:
    """The records of sequences `indices` of one length, `cfg.batch_size` prompts per forward pass."""
    if not indices:
        return
    rows = draw_sequences(cfg, length, rng)
    layout = Layout(len(prefix), length, cfg.gap)
    ids = prompts(rows, prefix, length)
    induction = probes if wants_induction(cfg, length) else None
    for start in range(0, len(indices), cfg.batch_size):
        batch = indices[start:start + cfg.batch_size]
        yield from score_batch(model, ids[batch], rows[batch, :length], batch, layout, induction, device)


@torch.no_grad()
def score_batch(model: Any, ids: torch.Tensor, sequences: torch.Tensor, indices: list[int], layout: Layout,
                probes: Optional[list[LayerProbe]], device: str | torch.device) -> Iterator[dict]:
    """One forward pass over prompts `ids` `[B, T]`: each row's record (copy fields; induction with `probes`)."""
    ids = ids.to(device)
    with layer_inputs(model) if probes is not None else _nothing() as inputs:
        logits = forward_logits(model, ids, layout.length + 1)
    for row, index in enumerate(indices):
        record = {"length": layout.length, "index": index, "sequence_sha": _sha(ids[row].cpu()),
                  **copy_record(logits[row], sequences[row])}
        if probes is not None:
            record.update(sequence_head_scores(probes, inputs, row, layout))
        yield record


@contextmanager
def _nothing() -> Iterator[dict]:
    yield {}


def _dtype(model: Any) -> str:
    param = next(model.parameters(), None) if isinstance(model, nn.Module) else None
    return str(param.dtype).removeprefix("torch.") if param is not None else "unknown"


def _notes(cfg: CopyConfig, probes: Optional[list[LayerProbe]]) -> list[str]:
    notes = []
    if cfg.induction and probes is None:
        notes.append("induction scores left out: the model's layers cannot be read (neither a harness student nor "
                     "a Llama-style model with model.layers[i].self_attn and model.rotary_emb)")
    above = [n for n in cfg.lengths if n > cfg.induction_max_length]
    if cfg.induction and probes is not None and above:
        notes.append(f"induction scores only for lengths <= induction_max_length={cfg.induction_max_length}: not "
                     f"for {above}")
    return notes
