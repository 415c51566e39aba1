"""State saturation along the context: what a student's recurrent state holds after p tokens, and how far back the
model still retrieves a fact (`harness eval state MODEL`; issue 50, "students that retrieve").

Two measurements, so that "the additive mixers' state saturates" is a measured curve rather than a word:

State along the context (students only; a teacher has no recurrent state). `sequences` windows of `length` tokens
of held-out prose (`text`: the NIAH haystack essays by default) go through the student in pieces: the first p_1
tokens in one forward that returns the cache (`RecurrentCache`), then the tokens p_1..p_2 continued from that
cache, and so on (`states_at`), so each layer's state after every position in `positions` costs one pass over the
`length` tokens in all, and equals the state of one prefill of p tokens (the chunkwise form from an initial state,
up to rounding; tests/test_state.py checks every mixer). Position p is the number of tokens read: S_p is the state
after tokens 1..p. For every mixer layer and position, per head:

    norm   ||S_p||_F, the Frobenius norm of the K x V state
    rank   the effective rank of S_p (Roy & Vetterli, "The effective rank: a measure of effective dimensionality",
           EUSIPCO 2007): exp(H(p)), p_i = sigma_i / sum_j sigma_j over the singular values sigma of S_p and
           H(p) = -sum_i p_i log p_i (0 log 0 = 0). 1 for a rank-1 state, min(K, V) for one with equal singular
           values (the identity), continuous in between; scale-invariant; 0 for the zero state. The singular values
           are the square roots of the Gram matrix's eigenvalues in float64, those below ~1e-7 of the largest
           (float32 rounding of the state) counted as 0 (`singular_values`).

reported as the mean and the max over heads of the per-head values averaged over the sequences, with the per-head
values themselves; and per layer the norm's growth exponent over the last doubling of the context,
log(norm(p_b) / norm(p_a)) / log(p_b / p_a) with p_b = the last position and p_a the largest position <= p_b / 2:
about 1 for a sum of aligned writes (linear attention's elu+1 keys are all positive), 1/2 for a random walk, 0 for
a state that has saturated (a decayed or delta-rule state at its fixed point). What the state is, per mixer
(`STATE_OF`): S of the gated-delta recurrence (docs/RECURRENCES.md) for RetNet, GLA, DeltaNet, Gated DeltaNet,
KDA and Mamba2, of Gated DeltaProduct's n Householder steps per token and of RWKV-7's DPLR delta rule; for linear
attention and Hedgehog S = sum phi(k_t) v_t^T (the value its normaliser divides by is z = sum phi(k_t), reported as
`normaliser_norm`); for the mLSTM the de-stabilised C_t (the stored C times exp(m_t): the true sum of gated writes,
comparable across positions), beside the stored one's norm (`stored_norm`), the de-stabilised normaliser n_t and the
stabiliser m_t; for gated slot attention its value slots hv (`[M, V]` per head), beside its key slots' norm
(`key_slots_norm`). A hybrid's kept softmax-attention layers are listed as such, without measures, and so are the
layers of a mixer whose state is no fixed-size matrix but a KV cache that grows with the context (fox's and
path's: `Mixer.growing_state`); a mixer's sliding window cache (`options.window`) is not part of the recurrent state
and is not measured.

Retrieval against distance (students and teachers). For each needle kind, distance d and sample i, a prompt of
exactly `length` tokens: the NIAH frame (`harness.eval.niah.prompt_frame`: instruction, then the question and
answer primer), its needle sentence (`make_needle`), and haystack prose around it such that exactly d prose tokens
lie between the needle's last token and the first token of the question's frame (the frame starts with a blank
line, then "Question: ..."). The needle is spliced in at a sentence start (else a word start) found within
`niah.snap_window` tokens after the prose that must precede it, so the d tokens are exact and the needle reads as
its own sentence. Sample i has the same needle, distractors and prose start at every distance (the curve is paired
across distances); only where the needle sits changes. Scored as NIAH scores (`niah.is_correct` on the greedy
answer, `niah.likelihood_record`: the true value ranked among `distractors` others by teacher-forced
log-probability). Per distance: exact-match accuracy with its Wilson 95% interval, likelihood accuracy (mean top1,
chance 1 / (1 + distractors)) with a 95% percentile bootstrap interval over samples (`recovery.paired_bootstrap`),
and the mean rank.

Outputs in `out_dir`:
    state.json             settings, definitions, "state" (per layer per position; None for a teacher) and
                           "retrieval" (per distance, pooled over kinds and per kind; None when switched off)
    state_retrieval.jsonl  a header line (the settings a record depends on), then one line per finished sample;
                           a rerun skips the samples there (resumes); a change of label, text, prompt, seed,
                           max_new_tokens, length or tokenizer is an error unless overwrite=True
    state.md               the Markdown summary (`markdown`)
    state_curves.png       norm and effective rank against position (one line per layer), retrieval against distance
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch
from tqdm.auto import tqdm

from harness.config import ConfigError, StateConfig
from harness.decoding import check_batch_size
from harness.eval.niah import (NiahGrid, NiahSample, generate_answers, haystack_tokens, is_complete, is_correct,
                               likelihood_record, make_distractors, make_needle, prompt_frame, resolve_prompt_mode,
                               run_header, snap_window)
from harness.eval.records import append_record, changed_settings, resume_lines
from harness.eval.recovery import Z_95, paired_bootstrap, percentile_interval
from harness.files import atomic_write_text
from harness.mixers import mixer_class

FORMAT_VERSION = 1  # bump when prompts, needles or measures change, so that old records are not mixed in
JSON_FILE, RECORDS_FILE, MARKDOWN_FILE, PLOT_FILE = ("state.json", "state_retrieval.jsonl", "state.md",
                                                     "state_curves.png")

RANK_DEFINITION = ("effective rank (Roy & Vetterli, EUSIPCO 2007): exp(-sum_i p_i log p_i), p_i = sigma_i / "
                   "sum_j sigma_j over the singular values of the K x V state of one head; 1 for rank 1, min(K, V) "
                   "for equal singular values, 0 for the zero state")
NORM_DEFINITION = "Frobenius norm of the K x V state of one head"
GROWTH_DEFINITION = ("log(norm(p_b) / norm(p_a)) / log(p_b / p_a), p_b the last position, p_a the largest position "
                     "<= p_b / 2: ~1 linear growth, ~0.5 a random walk, ~0 saturated")
AGGREGATION = ("each per-head value is averaged over the sequences; mean and max are then over heads "
               "(per_head lists them)")

STATE_OF = {
    "linear_attn": "S_p = sum_{t<=p} phi(k_t) v_t^T (phi: the feature map; no decay); normaliser_norm: "
                   "||z_p||, z_p = sum phi(k_t), the normaliser's state",
    "retnet": "S_p = gamma_h S_{p-1} + k_p v_p^T, a fixed decay gamma_h per head",
    "gla": "S_p = Diag(exp g_p) S_{p-1} + k_p v_p^T, a data-dependent decay per key channel",
    "deltanet": "S_p = (I - b_p k_p k_p^T) S_{p-1} + b_p k_p v_p^T, k L2-normalised",
    "gated_deltanet": "S_p = exp(g_p) (I - b_p k_p k_p^T) S_{p-1} + b_p k_p v_p^T, k L2-normalised",
    "kda": "S_p = (I - b_p k_p k_p^T) Diag(exp g_p) S_{p-1} + b_p k_p v_p^T, k L2-normalised",
    "mamba2": "S_p = exp(dt_p A_h) S_{p-1} + dt_p k_p v_p^T (Mamba2's SSD: B = k, x = v), a data-dependent decay per "
              "head",
    "hedgehog": "S_p = sum_{t<=p} phi(k_t) v_t^T, phi the learned Hedgehog feature map (2F rows; no decay); "
                "normaliser_norm: ||z_p||, z_p = sum phi(k_t), the normaliser's state",
    "gsa": "hv_p = Diag(alpha_p) hv_{p-1} + s_p v_p^T, the M value slots of gated slot attention (M x V per head); "
           "key_slots_norm: ||hk_p||, its key slots hk_p = hk_{p-1} Diag(alpha_p) + k_p s_p^T (K x M)",
    "deltaproduct": "S_p = exp(g_p) S_{p-1}, then for j = 1..n S_p = (I - b_pj k_pj k_pj^T) S_p + b_pj k_pj v_pj^T: "
                    "n Householder steps per token after one decay per head, k L2-normalised",
    "rwkv7": "S_p = Diag(exp g_p) S_{p-1} + b_p a_p^T S_{p-1} + k_p v_p^T (RWKV-7's DPLR delta rule): a_p = -kk_p and "
             "b_p = kk_p * iclr_p (kk the L2-normalised removal key, iclr the in-context learning rate), k the written "
             "key, a data-dependent decay per key channel",
    "fox": "none of a fixed size: softmax attention with a forget gate keeps every token's key, value and cumulative "
           "log forget gate (a KV cache that grows with the context), so its layers are listed without measures",
    "path": "none of a fixed size: PaTH attention keeps every token's key (transformed by every later token's "
            "Householder step), value and convolution input (a KV cache that grows with the context), so its layers "
            "are listed without measures",
    "mlstm": "C_p de-stabilised: the stored C_p times exp(m_p), i.e. sum_t exp(i_t + sum_{t<s<=p} logsigmoid(f_s)) "
             "k_t v_t^T; stored_norm: ||C_p|| as the recurrence carries it (scaled by exp(-m_p)); normaliser_norm: "
             "||n_p|| de-stabilised; stabiliser: m_p",
}

GROWS = "its state grows with the context (Mixer.growing_state): not measured"  # a plug-in's, without an entry

# ---------------------------------------------------------------------------------------------- settings


def retrieval_grid(cfg: StateConfig) -> NiahGrid:
    """The NIAH settings the retrieval prompts share (text, prompt mode, seed, budget, distractors)."""
    try:
        return NiahGrid(lengths=[cfg.length], depths=[0.0], kinds=[str(k) for k in cfg.kinds or ["passkey"]],
                        samples=cfg.samples, haystack=cfg.text, prompt=str(cfg.prompt), seed=cfg.seed,
                        max_new_tokens=cfg.max_new_tokens, distractors=cfg.distractors)
    except ValueError as err:
        raise ConfigError(f"state: {err}") from None


# ---------------------------------------------------------------------------------------------- measures


def singular_values(matrices: torch.Tensor) -> torch.Tensor:
    """The singular values of each matrix in `matrices` `[..., K, V]`, in float64, ascending: the square roots of
    the eigenvalues of its Gram matrix (on a CPU ~17x faster than an SVD of 64 x 64 matrices), those below
    n * eps(float64) times the largest (rounding; n = the Gram's size) set to exactly 0, so that a rank-1 matrix
    has one nonzero value. Only singular values below ~1e-7 of the largest are lost."""
    m = matrices.to(torch.float64)
    gram = m.mT @ m if m.shape[-1] <= m.shape[-2] else m @ m.mT
    eig = torch.linalg.eigvalsh(gram)
    floor = eig[..., -1:] * gram.shape[-1] * torch.finfo(torch.float64).eps
    return torch.where(eig > floor, eig, 0.0).sqrt()


def effective_rank(matrices: torch.Tensor) -> torch.Tensor:
    """The effective rank (Roy & Vetterli 2007) of each matrix in `matrices` `[..., K, V]`, in float64: exp of the
    entropy of the singular values (`singular_values`) normalised to sum 1; 0 for a zero matrix."""
    sigma = singular_values(matrices)
    total = sigma.sum(-1, keepdim=True)
    p = sigma / torch.where(total > 0, total, 1.0)
    entropy = -torch.special.xlogy(p, p).sum(-1)
    return torch.where(total[..., 0] > 0, entropy.exp(), 0.0)


def frobenius(matrices: torch.Tensor) -> torch.Tensor:
    """||M||_F of each matrix in `matrices` `[..., K, V]`, in float64."""
    return torch.linalg.matrix_norm(matrices.to(torch.float64))


def state_measures(mixer: str, recurrent: Any) -> dict[str, torch.Tensor]:
    """One layer's measures `[B, H]` (float64, CPU) from its recurrent state (`MixerState.recurrent`): norm and
    rank of the state matrix as STATE_OF[mixer] defines it, and the mixer's extras (normaliser, stored norm,
    stabiliser)."""
    if mixer == "mlstm":
        C, n, m = (t.detach().to("cpu", torch.float64) for t in recurrent)
        scale = m.exp()
        matrix = C * scale[..., None, None]
        extra = {"stored_norm": frobenius(C), "normaliser_norm": (n * scale[..., None]).norm(dim=-1),
                 "stabiliser": m}
    elif mixer in ("linear_attn", "hedgehog"):
        S, z = recurrent
        matrix = S.detach().to("cpu", torch.float64)
        extra = {} if z is None else {"normaliser_norm": z.detach().to("cpu", torch.float64).norm(dim=-1)}
    elif mixer == "gsa":
        hk, hv = (t.detach().to("cpu", torch.float64) for t in recurrent)
        matrix, extra = hv, {"key_slots_norm": frobenius(hk)}
    elif isinstance(recurrent, torch.Tensor) and recurrent.dim() == 4:
        matrix, extra = recurrent.detach().to("cpu", torch.float64), {}
    else:
        raise ValueError(f"state_measures does not know the recurrent state of mixer '{mixer}' "
                         f"({type(recurrent).__name__}); known: {', '.join(STATE_OF)} and any [B, H, K, V] tensor")
    return {"norm": frobenius(matrix), "rank": effective_rank(matrix), **extra}


# ---------------------------------------------------------------------------------------------- reading states


def state_text(tokenizer: Any, cfg: StateConfig) -> torch.Tensor:
    """The `sequences` x `length` token ids of the state curve: windows of `text` prose, each from a document
    drawn from the seed (`niah.HaystackTokens.prose`: documents joined by blank lines)."""
    hay = haystack_tokens(tokenizer, cfg.text)
    rows = [hay.prose(_rng(cfg.seed, "text", i).randrange(len(hay.documents)), cfg.length)
            for i in range(cfg.sequences)]
    return torch.tensor(rows, dtype=torch.long)


@torch.no_grad()
def states_at(model: Any, ids: torch.Tensor, positions: list[int]) -> Iterator[tuple[int, Any]]:
    """(p, cache) after the first p tokens of `ids` `[B, T]` for each p in `positions` (sorted, 1..T): the tokens
    up to the first position in one forward that returns the cache, then each next stretch continued from it
    (no prefix is read twice). The cache (`RecurrentCache`) is updated in place by the next stretch: read it
    before the iterator resumes."""
    from harness.student import RecurrentCache

    cache = RecurrentCache(model.config.num_hidden_layers)
    start = 0
    for p in positions:
        if not start < p <= ids.shape[1]:
            raise ValueError(f"positions must increase within 1..{ids.shape[1]}; got {p} after {start}")
        model(ids[:, start:p], cache=cache, use_cache=True, logits_to_keep=1)
        start = p
        yield p, cache


def mixer_layers(model: Any) -> dict[int, bool]:
    """layer index -> whether it is a mixer layer with a state to measure (False: a hybrid's kept softmax attention,
    and every layer of a mixer whose state grows with the context, `Mixer.growing_state`)."""
    kept, grows = model.config.kept_layers(), mixer_class(model.config.mixer).growing_state
    return {i: i not in kept and not grows for i in range(model.config.num_hidden_layers)}


def measure_states(model: Any, tokenizer: Any, cfg: StateConfig, device: Any, progress: bool = True) -> dict:
    """state.json's "state" block: every mixer layer's measures at every read position (`layer_entry`)."""
    positions = cfg.read_positions()
    ids = state_text(tokenizer, cfg).to(device)
    layers, kept = mixer_layers(model), model.config.kept_layers()
    mixer = model.config.mixer
    notes = {i: f"{mixer}: {STATE_OF.get(mixer, GROWS)}" for i in layers if i not in kept}  # unmeasured mixer layers
    found: dict[int, dict[str, list[torch.Tensor]]] = {i: {} for i, is_mixer in layers.items() if is_mixer}
    bar = tqdm(total=len(positions), desc=f"state {mixer}", unit="position", disable=not progress,
               dynamic_ncols=True)
    with bar:
        for _, cache in states_at(model, ids, positions) if found else ():  # nothing to read: no pass
            for i, measures in found.items():
                for name, value in state_measures(mixer, cache.states[i].recurrent).items():
                    measures.setdefault(name, []).append(value)
            bar.update()
    shape = model.model.layers[next(iter(found))].mixer.shape if found else None
    return {"mixer": mixer, "what": STATE_OF.get(mixer, "the mixer's recurrent state"), "text": cfg.text,
            "sequences": cfg.sequences, "length": cfg.length, "positions": positions,
            "heads": shape.num_heads if shape else None, "key_dim": shape.head_dim if shape else None,
            "value_dim": shape.head_dim if shape else None,
            "definitions": {"norm": NORM_DEFINITION, "rank": RANK_DEFINITION, "growth": GROWTH_DEFINITION,
                            "aggregation": AGGREGATION},
            "layers": [layer_entry(i, positions, found.get(i), notes.get(i)) for i in layers],
            "over_layers": over_layers(found, positions)}


def layer_entry(layer: int, positions: list[int], measures: Optional[dict[str, list[torch.Tensor]]],
                note: Optional[str] = None) -> dict:
    """One layer of the "state" block: for each measure (norm, rank, and the mixer's extras) its mean and max over
    heads per position and its per-head values (heads x positions), each averaged over the sequences; the norm's
    growth exponent; or, for a layer without measures (a kept softmax-attention layer, or `note` says why), only what
    it is."""
    if measures is None:
        return {"layer": layer, "kind": "attention",
                "note": note or "kept softmax attention: no recurrent state (its KV cache grows with the context)"}
    entry: dict[str, Any] = {"layer": layer, "kind": "mixer"}
    for name, values in measures.items():
        per_head = torch.stack(values, -1).mean(0)  # [H, positions], averaged over the sequences
        entry[f"{name}_mean"] = _rounded(per_head.mean(0))
        entry[f"{name}_max"] = _rounded(per_head.max(0).values)
        entry[f"{name}_per_head"] = [_rounded(row) for row in per_head]
    entry["norm_growth"] = growth_exponent(positions, entry["norm_mean"])
    return entry


def growth_exponent(positions: list[int], values: list[float]) -> Optional[float]:
    """GROWTH_DEFINITION over the last doubling of `positions`; None without two such positions or with a zero."""
    last = positions[-1]
    earlier = [i for i, p in enumerate(positions) if p <= last / 2]
    if not earlier or values[earlier[-1]] <= 0 or values[-1] <= 0:
        return None
    a = earlier[-1]
    return round(math.log(values[-1] / values[a]) / math.log(last / positions[a]), 4)


def over_layers(found: dict[int, dict[str, list[torch.Tensor]]], positions: list[int]) -> dict:
    """The mean over mixer layers of the heads' mean norm and rank, per position."""
    if not found:
        return {}
    out = {}
    for name in ("norm", "rank"):
        per_layer = torch.stack([torch.stack(m[name], -1).mean((0, 1)) for m in found.values()])
        out[f"{name}_mean"] = _rounded(per_layer.mean(0))
    out["norm_growth"] = growth_exponent(positions, out["norm_mean"])
    return out


def _rounded(values: torch.Tensor) -> list[float]:
    return [float(f"{v:.6g}") for v in values.tolist()]


# ---------------------------------------------------------------------------------------------- retrieval prompts


def _rng(seed: int, *parts: object) -> random.Random:
    # A string seed is hashed with sha512 by `random`: the same on every machine and Python run.
    return random.Random("state|" + "|".join(str(p) for p in (seed, *parts)))


def needle_end(prose: list[int], at: int, window: int, boundary: Any) -> int:
    """Where a needle goes in `prose` after at least `at` tokens: the first sentence start in at..at + window,
    else the first word start there, else exactly `at` (`boundary` as `niah.HaystackTokens.boundary`)."""
    for cleanest in (2, 1):
        for cut in range(at, min(at + window, len(prose)) + 1):
            if boundary(prose, cut) >= cleanest:
                return cut
    return at


def distance_sample(tokenizer: Any, cfg: StateConfig, kind: str, distance: int, index: int) -> NiahSample:
    """The retrieval prompt of sample `index` at `distance` (module docstring): `length` tokens, exactly `distance`
    prose tokens between the needle's end and the question's frame. ConfigError when the distance does not fit."""
    grid = retrieval_grid(cfg)
    mode = resolve_prompt_mode(tokenizer, grid.prompt)
    needle = make_needle(kind, _rng(cfg.seed, "needle", kind, index))
    head, tail = prompt_frame(tokenizer, needle, mode)
    needle_ids = list(tokenizer(needle.text, add_special_tokens=False)["input_ids"])
    prose_tokens = cfg.length - len(head) - len(tail) - len(needle_ids)
    before = prose_tokens - distance
    if before < 0:
        raise ConfigError(f"state.distances: {distance} does not fit in a {cfg.length}-token {kind} prompt, whose "
                          f"instruction, needle and question take {cfg.length - prose_tokens} tokens: the largest "
                          f"distance is {max(prose_tokens, 0)}. Raise state.length or drop the distance.")
    hay = haystack_tokens(tokenizer, grid.haystack)
    window = snap_window(prose_tokens)
    prose = hay.prose(_rng(cfg.seed, "haystack", index).randrange(len(hay.documents)), before + window + distance)
    cut = needle_end(prose, before, window, hay.boundary)
    ids = head + prose[cut - before:cut] + needle_ids + prose[cut:cut + distance] + tail
    distractors = make_distractors(tokenizer, needle, cfg.distractors, _rng(cfg.seed, "distractors", kind, index))
    return NiahSample(kind=kind, length=cfg.length, depth=before / prose_tokens, index=index, input_ids=ids,
                      needle=needle, needle_offset=len(head) + before, needle_tokens=len(needle_ids),
                      needle_depth=before / prose_tokens, haystack_start=len(head), haystack_end=len(ids) - len(tail),
                      prompt_mode=mode, distractors=distractors)


def retrieval_keys(cfg: StateConfig) -> list[tuple[str, int, int]]:
    """Every retrieval sample as (kind, distance, index), shortest distances first."""
    return [(str(kind), d, i) for d in cfg.distances for kind in cfg.kinds for i in range(cfg.samples)]


# ---------------------------------------------------------------------------------------------- retrieval records


def records_header(tokenizer: Any, cfg: StateConfig, label: str) -> dict:
    """The settings every retrieval record depends on (NIAH's run header, plus this format and the length)."""
    return {**run_header(tokenizer, retrieval_grid(cfg), label), "state_format": FORMAT_VERSION, "length": cfg.length}


def load_records(path: Path, header: dict, overwrite: bool = False) -> dict[tuple, dict]:
    """Finished retrieval samples in `path` by (kind, distance, index), after checking its header; a new file gets
    `header`. A last line cut short by a crash is dropped; another header is a ConfigError unless `overwrite`."""
    saved, lines = resume_lines(path, header, overwrite)
    detail = changed_settings(saved, header)
    if detail:
        raise ConfigError(f"{path} was written with other settings ({detail}). Use another output folder, delete the "
                          "file, or pass --overwrite to start over.")
    records = {}
    for line in lines:
        record = json.loads(line)
        records[(record["kind"], int(record["distance"]), int(record["index"]))] = record
    return records


def evaluate_retrieval(model: Any, tokenizer: Any, cfg: StateConfig, out: Path, *, device: Any, label: str,
                       progress: bool = True, overwrite: bool = False) -> dict:
    """Score every retrieval sample missing from out/state_retrieval.jsonl, appending each as it finishes; return
    state.json's "retrieval" block (`summarise_retrieval`)."""
    records = load_records(out / RECORDS_FILE, records_header(tokenizer, cfg, label), overwrite)
    keys = retrieval_keys(cfg)
    samples = {key: distance_sample(tokenizer, cfg, *key) for key in keys}  # every distance fits, before any work
    todo = [k for k in keys if not is_complete(records.get(k), samples[k].distractors)]
    with tqdm(total=len(keys), initial=len(keys) - len(todo), desc=f"retrieval {label}", unit="sample",
              disable=not progress, dynamic_ncols=True) as bar:
        for start in range(0, len(todo), cfg.generation_batch_size):
            batch = todo[start:start + cfg.generation_batch_size]
            fresh = [k for k in batch if k not in records]
            answers = dict(zip(fresh, generate_answers(model, tokenizer, [samples[k].input_ids for k in fresh],
                                                       cfg.max_new_tokens, device)))
            for key in batch:
                record = records.get(key) or sample_record(samples[key], answers[key])
                record = {**record, **likelihood_record(model, tokenizer, samples[key], device)}
                append_record(out / RECORDS_FILE, record)
                records[key] = record
                bar.update()
    return summarise_retrieval([records[k] for k in keys], cfg)


def sample_record(sample: NiahSample, output: str) -> dict:
    """The generated part of one retrieval record (likelihood_record adds the rest)."""
    return {"kind": sample.kind, "distance": sample.haystack_end - sample.needle_offset - sample.needle_tokens,
            "index": sample.index, "value": sample.value, "output": output, "correct": is_correct(sample.value, output),
            "context_length": sample.context_length, "needle_offset": sample.needle_offset,
            "question_offset": sample.haystack_end}


# ---------------------------------------------------------------------------------------------- retrieval summary


def wilson_interval(successes: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95% by default)."""
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def curve_point(rows: list[dict], distance: int, stream: str) -> dict:
    """One distance of the retrieval curve from its samples' records."""
    correct = sum(bool(r["correct"]) for r in rows)
    top1 = np.array([[r["top1"] for r in rows]], dtype=float)
    interval = percentile_interval(paired_bootstrap(top1, stream=stream)[0])
    return {"distance": distance, "samples": len(rows), "exact": correct / len(rows),
            "exact_ci": list(wilson_interval(correct, len(rows))), "likelihood": float(top1.mean()),
            "likelihood_ci": list(interval) if interval else None,
            "mean_rank": float(np.mean([r["rank"] for r in rows]))}


def summarise_retrieval(rows: list[dict], cfg: StateConfig) -> dict:
    """The "retrieval" block: per distance (pooled over kinds) and per kind and distance, both scores with 95%
    intervals (exact: Wilson; likelihood: percentile bootstrap over samples) and the mean rank."""
    kinds = [str(k) for k in cfg.kinds]

    def curve(selected: list[str], name: str) -> list[dict]:
        return [curve_point([r for r in rows if r["distance"] == d and r["kind"] in selected], d,
                            f"state|{name}|{d}") for d in cfg.distances]

    candidates = 1 + cfg.distractors
    return {"length": cfg.length, "kinds": kinds, "distances": cfg.distances, "samples": cfg.samples,
            "distractors": cfg.distractors, "chance": 1 / candidates, "chance_rank": (candidates + 1) / 2,
            "distance_rule": "prose tokens between the needle's last token and the first token of the question's "
                             "frame (a blank line, then 'Question: ...'), in a prompt of exactly `length` tokens",
            "scoring": {"exact": "the needle's value in the first line of the greedy answer (niah.is_correct); "
                                 "95% Wilson interval",
                        "likelihood": "the true value ranked first among it and the distractors by teacher-forced "
                                      "log-probability (niah.likelihood_record); 95% percentile bootstrap interval"},
            "by_distance": curve(kinds, "all"), "by_kind": {k: curve([k], k) for k in kinds}}


# ---------------------------------------------------------------------------------------------- run


def evaluate_state(model: Any, tokenizer: Any, cfg: StateConfig, out_dir: str | os.PathLike[str], *,
                   device: str | torch.device, label: str, progress: bool = True, overwrite: bool = False) -> dict:
    """Measure `model` as `cfg` says and write state.json, state_retrieval.jsonl, state.md and state_curves.png
    into `out_dir`; return state.json's content.

    model: a student (HarnessForCausalLM: state curve and retrieval) or any causal LM with a cache, e.g. a teacher
    (retrieval only: "state" is None); put in eval mode on `device`. Retrieval resumes from
    state_retrieval.jsonl (module docstring); the state curve is recomputed (one pass over sequences x length)."""
    from harness.student import HarnessForCausalLM

    cfg.validate()
    check_batch_size(cfg.generation_batch_size, "state.generation_batch_size")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(model, torch.nn.Module):
        model.to(device).eval()
    student = isinstance(model, HarnessForCausalLM)
    result = {"label": label, "format": FORMAT_VERSION, "settings": _settings(cfg),
              "model": {"kind": "student" if student else "teacher",
                        "mixer": model.config.mixer if student else None,
                        "layers": getattr(getattr(model, "config", None), "num_hidden_layers", None),
                        "dtype": str(next(model.parameters()).dtype) if isinstance(model, torch.nn.Module) else None},
              "state": None, "retrieval": None}
    if not student:
        result["state_note"] = "not a harness student: a softmax-attention model has no recurrent state"
    if cfg.retrieval:  # first, so that a distance that does not fit fails before the state pass
        result["retrieval"] = evaluate_retrieval(model, tokenizer, cfg, out, device=device, label=label,
                                                 progress=progress, overwrite=overwrite)
    if student:
        result["state"] = measure_states(model, tokenizer, cfg, device, progress)
    atomic_write_text(out / JSON_FILE, json.dumps(result, indent=2) + "\n")
    atomic_write_text(out / MARKDOWN_FILE, markdown(result) + "\n")
    plot_curves(result, out / PLOT_FILE)
    return result


def _settings(cfg: StateConfig) -> dict:
    """The config as plain JSON values, with the positions actually read."""
    settings = json.loads(json.dumps(asdict(cfg), default=str))
    settings["read_positions"] = cfg.read_positions()
    return settings


# ---------------------------------------------------------------------------------------------- summary


def shown_positions(positions: list[int], most: int = 6) -> list[int]:
    """At most `most` of `positions`, spread evenly over their index (first and last always)."""
    if len(positions) <= most:
        return positions
    picks = sorted({round(i * (len(positions) - 1) / (most - 1)) for i in range(most)})
    return [positions[i] for i in picks]


def markdown(result: dict) -> str:
    """The printable summary: per layer the state's norm and effective rank at a few positions (and the norm's
    growth exponent), then the retrieval curve."""
    lines = [f"# State and retrieval: {result['label']}", ""]
    state = result["state"]
    if state is None:
        lines += [f"No state curve: {result.get('state_note', 'not measured')}.", ""]
    else:
        lines += _state_tables(state)
    if result["retrieval"] is not None:
        lines += _retrieval_table(result["retrieval"])
    return "\n".join(lines).rstrip()


def _state_tables(state: dict) -> list[str]:
    positions = state["positions"]
    shown = shown_positions(positions)
    columns = [positions.index(p) for p in shown]
    lines = [f"State of `{state['mixer']}`: {state['what']}.", "",
             f"{state['sequences']} sequences of {state['length']} tokens of {state['text']}; heads {state['heads']}, "
             f"K = {state['key_dim']}, V = {state['value_dim']}. Norm: {NORM_DEFINITION}; rank: {RANK_DEFINITION}. "
             f"Mean over heads; growth: {GROWTH_DEFINITION}.", ""]
    head = " | ".join(f"@{p}" for p in shown)
    for name, title in (("norm", "Norm"), ("rank", "Effective rank")):
        lines += [f"**{title}** of the state after p tokens", "",
                  f"| layer | {head} |" + (" growth |" if name == "norm" else ""),
                  "|---|" + "---|" * (len(shown) + (name == "norm"))]
        for layer in state["layers"]:
            if layer["kind"] != "mixer":
                lines.append(f"| {layer['layer']} | " + " | ".join("attn" for _ in shown) + " |"
                             + (" - |" if name == "norm" else ""))
                continue
            values = " | ".join(_fmt(layer[f"{name}_mean"][c]) for c in columns)
            growth = f" {_fmt(layer['norm_growth'])} |" if name == "norm" else ""
            lines.append(f"| {layer['layer']} | {values} |{growth}")
        if state["over_layers"]:
            values = " | ".join(_fmt(state["over_layers"][f"{name}_mean"][c]) for c in columns)
            growth = f" {_fmt(state['over_layers']['norm_growth'])} |" if name == "norm" else ""
            lines.append(f"| mean | {values} |{growth}")
        lines.append("")
    return lines


def _retrieval_table(retrieval: dict) -> list[str]:
    lines = [f"**Retrieval against distance** ({', '.join(retrieval['kinds'])}; {retrieval['samples']} samples per "
             f"kind and distance, prompts of {retrieval['length']} tokens; likelihood chance "
             f"{retrieval['chance']:.0%})", "",
             "| distance | samples | exact match (95% CI) | likelihood top-1 (95% CI) | mean rank |",
             "|---|---|---|---|---|"]
    for point in retrieval["by_distance"]:
        lines.append(f"| {point['distance']} | {point['samples']} | {_pct(point['exact'], point['exact_ci'])} | "
                     f"{_pct(point['likelihood'], point['likelihood_ci'])} | {point['mean_rank']:.2f} |")
    return lines + [""]


def _fmt(value: Optional[float]) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if abs(value) < 1e4 else f"{value:.2e}"


def _pct(value: float, interval: Optional[list[float]]) -> str:
    if interval is None:
        return f"{value:.0%}"
    return f"{value:.0%} [{interval[0]:.0%}, {interval[1]:.0%}]"


def plot_curves(result: dict, path: Path) -> None:
    """state_curves.png: the heads' mean norm (log-log) and effective rank against position, one line per mixer
    layer, and the retrieval accuracy against distance with its intervals, for the parts that were measured."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    state, retrieval = result["state"], result["retrieval"]
    panels = (["norm", "rank"] if state else []) + (["retrieval"] if retrieval else [])
    if not panels:
        return
    fig = Figure(figsize=(4.2 * len(panels), 3.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, panel in zip(axes, panels):
        if panel == "retrieval":
            _plot_retrieval(ax, retrieval)
        else:
            _plot_state(ax, state, panel)
    fig.suptitle(f"{result['label']}: state along the context and retrieval against distance", fontsize=9)
    fig.savefig(path, dpi=120)


def _plot_state(ax: Any, state: dict, name: str) -> None:
    from matplotlib import colormaps

    layers = [layer for layer in state["layers"] if layer["kind"] == "mixer"]
    cmap = colormaps["viridis"]
    for n, layer in enumerate(layers):
        ax.plot(state["positions"], layer[f"{name}_mean"], color=cmap(n / max(len(layers) - 1, 1)), lw=1,
                label=f"layer {layer['layer']}" if n in (0, len(layers) - 1) else None)
    ax.set_xscale("log", base=2)
    if name == "norm":
        ax.set_yscale("log")
    ax.set_xlabel("tokens read")
    ax.set_ylabel("state norm (mean over heads)" if name == "norm" else f"effective rank (of {state['key_dim']})")
    ax.legend(fontsize=7)


def _plot_retrieval(ax: Any, retrieval: dict) -> None:
    points = retrieval["by_distance"]
    distances = [p["distance"] for p in points]
    for key, label in (("exact", "exact match"), ("likelihood", "likelihood top-1")):
        values = [p[key] for p in points]
        low = [v - (p[f"{key}_ci"] or [v, v])[0] for v, p in zip(values, points)]
        high = [(p[f"{key}_ci"] or [v, v])[1] - v for v, p in zip(values, points)]
        ax.errorbar(distances, values, yerr=[low, high], marker="o", capsize=3, label=label)
    ax.axhline(retrieval["chance"], color="grey", ls=":", label="likelihood chance")
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("needle-to-question distance (tokens)")
    ax.set_ylabel("accuracy")
    ax.legend(fontsize=7)
