"""Greedy decoding of a harness student, one recurrent step per token, with the step captured as a CUDA graph; and
the greedy generation and candidate scoring of any causal LM that the evaluations (NIAH, the state probe, the chat
samples) run on students and teachers alike.

At batch 1 a student's decoding step is a few hundred small kernels whose launches, not their work, take the time
(135M on an H200: ~68 ms per token eagerly, the GPU idle most of it). Every step has the same shapes - one token
in, fixed-size states - so it can be recorded once as a CUDA graph and replayed: one launch per token.

    greedy_decode(model, ids, max_new_tokens, stop_ids=..., done=..., graphs=True) -> new token ids
    greedy_decode_batch(model, prompts, max_new_tokens, stop_ids=..., done=..., graphs=True) -> one list per prompt
    GraphedStep(model, cache)                              the captured step: __call__(token) -> logits [B, V]
    graphable(model)                                       whether a model's step can be captured

    greedy_ids_batch(model, tokenizer, prompts, max_new_tokens, stop, text_done) -> new ids per prompt (any model)
    greedy_ids(model, tokenizer, ids, max_new_tokens, stop, text_done)           -> new ids of one prompt [1, T]
    candidate_logprobs(model, prompt_ids, candidates)      teacher-forced log p of each candidate continuation
    candidate_scores(model, prompt_ids, candidates)        the same and the first candidate's next-token log-probs
    stop_token_ids, length_batches, check_batch_size       stop ids, batches by length, a batch size's check

HARNESS_DECODE_GRAPHS=0 in the environment turns the graphs off wherever `graphs` is not given (NIAH, chat samples).

Batches (`greedy_decode_batch`): each prompt is prefilled on its own (batch 1, unpadded: exactly the prefill of
`greedy_decode`, on either backend, with no padding computed, and one long prompt at a time in
memory), the prompts' states are stacked into one batch, and then every decoding step feeds one token per row.
No row ever sees padding: the steps of a row are those it takes alone, only batched. With rotary embeddings the
cache tracks each row's next position on the device (`RecurrentCache.track_positions`, from the prompts'
left-padded mask), so that a row's positions count its own tokens and no step needs a mask. A row that has stopped
keeps stepping (its tokens are dropped) until every row has: the batch keeps its shape, so the graph stays valid.
On CPU float32 the tokens are those of batch 1 (tests/test_decoding.py); on a GPU in bfloat16 a batched matmul may
round differently from a batch-1 one, so a near-tie can rarely go the other way.

The graph reads the token and every layer's state from static buffers, and its last kernels copy the new states
back into them, so a replay leaves the cache as an eager step would (`cache.seen_tokens` is advanced on the host).
Rotary positions are read from the cache and advanced in the graph; everything off CUDA decodes eagerly.
`tests/gpu/test_decoding_gpu.py` checks graphed against eager tokens for every mixer.

Hybrid students (kept softmax-attention layers): after the prefill their growing KV states become FixedKVStates
with room for the new tokens (`RecurrentCache.fix_kv`; eagerly too, so that CPU tests check the path a graph
captures): each step writes its key and value in place and reads its rotary position from the device, so the step
has fixed shapes and is captured like a pure student's. In a batch the rows' KV columns are left-padded to the
longest prompt and `valid` hides the padding. Kept layers under a sliding window (Mistral's) keep growing states
and decode eagerly (`graph_blocker` says why), as does a mixer whose state grows (`Mixer.growing_state`: fox's and
path's KV caches, whose rows are stacked left-padded too, its `valid` slots hiding the padding).

Any causal LM (`greedy_ids_batch`): a harness student decodes through `greedy_decode_batch`; any other model (a
transformers teacher) through `generate()` with its KV cache, the prompts left-padded with an attention mask. Each
row is cut where it would end alone: at a stop id, after `max_new_tokens`, or once `text_done(its new text)` holds.
On CPU float32 a batch gives the tokens of batch 1 (tests/test_eval_batching.py); on a GPU in bfloat16 a batched
matmul may round differently from a batch-1 one, so a near-tie between two tokens can rarely go the other way.
"""

from __future__ import annotations

import inspect
import numbers
import os
import warnings
from typing import Any, Callable, Optional, Sequence

import torch

from harness.attention import KVState
from harness.mixers import MixerState, mixer_class
from harness.student import HarnessForCausalLM, RecurrentCache


def graph_blocker(model: Any) -> Optional[str]:
    """Why `model`'s decoding step cannot be captured as a CUDA graph, or None when it can."""
    if not isinstance(model, HarnessForCausalLM):
        return f"{type(model).__name__} is not a harness student"
    if model.config.kept_layers() and not fixable_kv(model):
        return (f"a hybrid student whose kept softmax-attention layers {sorted(model.config.kept_layers())} have a "
                "sliding window: their KV caches drop columns, so the step's shapes change")
    if mixer_class(model.config.mixer).growing_state:
        return (f"its mixer {model.config.mixer} keeps a KV cache that grows by a column per token, so the step's "
                "shapes change")
    if not next(model.parameters()).is_cuda:
        return "it is not on a CUDA device"
    return None


def graphable(model: Any) -> bool:
    """A harness student on a CUDA device without kept attention layers under a sliding window: `graph_blocker`
    is None. A mixer's sliding window (student.options.window) keeps a fixed-size cache of its last N - 1 keys and
    values, kept layers decode with FixedKVStates, and rotary positions are read from the cache on the device
    (`RecurrentCache.track_positions`), so these steps are captured like the recurrence's
    (tests/gpu/test_hybrid_gpu.py and test_decoding_gpu.py check the graphed steps against the eager ones)."""
    return graph_blocker(model) is None


def fixable_kv(model: HarnessForCausalLM) -> bool:
    """Whether a hybrid student's KV states can be fixed (`RecurrentCache.fix_kv`): kept layers, none under a
    sliding window."""
    kept = model.config.kept_layers()
    return bool(kept) and all(model.config.attention_window(i) is None for i in kept)


def needs_positions(model: HarnessForCausalLM) -> bool:
    """Whether the student's steps read positions (rotary mixers, kept attention layers): after a batch of prompts
    of unequal lengths the cache tracks them (`track_positions`, `fix_kv`), or, for kept layers under a sliding
    window, each step passes the prompts' left-padded mask."""
    return model.model.rotary_emb is not None or model.model.attention_rotary is not None


class GraphedStep:
    """One decoding step of `model` over `cache` (after its prefill) as a CUDA graph. The cache's states become
    the graph's static buffers: keep using this object (not the model) for the cache's next tokens. A hybrid's
    growing KV states are fixed first with room for `new_tokens` (`RecurrentCache.fix_kv`), unless they are; a
    student with rotary mixers gets its positions tracked in the cache (`track_positions`), unless they are."""

    def __init__(self, model: HarnessForCausalLM, cache: RecurrentCache, warmup: int = 2,
                 new_tokens: Optional[int] = None) -> None:
        if (reason := graph_blocker(model)) is not None:
            raise ValueError(f"GraphedStep cannot capture this model's step: {reason}")
        if any(s is None for s in cache.states):
            raise ValueError("GraphedStep needs a prefilled cache (every layer's state set)")
        if any(isinstance(s, KVState) for s in cache.states):
            if new_tokens is None:
                raise ValueError("GraphedStep of a hybrid needs new_tokens (the room its fixed KV states allocate)")
            cache.fix_kv(new_tokens)
        if cache.positions is None and needs_positions(model):
            cache.track_positions()
        if cache.capacity is not None and cache.capacity - cache.seen_tokens < warmup:
            raise ValueError(f"the cache's fixed KV room holds {cache.capacity - cache.seen_tokens} more tokens; "
                             f"the capture's warm-up takes {warmup}")
        self.model, self.cache = model, cache
        batch = cache.states[0].tensors()[0].shape[0]
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=next(model.parameters()).device)
        self.states = [s.map(lambda t: t.contiguous()) for s in cache.states]  # the static inputs
        seen = cache.seen_tokens
        self._warm_up(warmup)
        self.graph = torch.cuda.CUDAGraph()
        cache.states = list(self.states)
        try:  # capture records kernels without running them: the states keep their values
            with torch.cuda.graph(self.graph):
                out = model(self.token, cache=cache, use_cache=True, logits_to_keep=1)
                for static, new in zip(self.states, cache.states):
                    for dst, src in zip(static.tensors(), new.tensors(), strict=True):
                        if dst.data_ptr() != src.data_ptr():  # a FixedKVState was written in place
                            dst.copy_(src)
                self.logits = out.logits[:, -1]
        finally:  # also after a failed capture, so that eager decoding can go on from this cache
            cache.states, cache.seen_tokens = list(self.states), seen

    def _warm_up(self, steps: int) -> None:
        """Run the step on copies of the states on a side stream (CUDA graphs need the allocator and the libraries'
        workspaces set up before capture); the real states are left as they are."""
        scratch = RecurrentCache(len(self.states))
        scratch.states = [s.map(lambda t: t.clone()) for s in self.states]
        scratch.seen_tokens, scratch.capacity = self.cache.seen_tokens, self.cache.capacity
        scratch.positions = None if self.cache.positions is None else self.cache.positions.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(steps):
                self.model(self.token, cache=scratch, use_cache=True, logits_to_keep=1)
        torch.cuda.current_stream().wait_stream(side)

    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        """Feed `token` `[B, 1]`; returns the next-token logits `[B, V]` (a static buffer: overwritten next call)."""
        if self.cache.capacity is not None and self.cache.seen_tokens >= self.cache.capacity:
            raise ValueError(f"the cache's fixed KV room ({self.cache.capacity} tokens) is full")
        self.token.copy_(token)
        self.graph.replay()
        self.cache.seen_tokens += 1
        return self.logits


def _graphed_or_none(model: HarnessForCausalLM, cache: RecurrentCache) -> Optional[GraphedStep]:
    """The graphed step, or None (decode eagerly, with a warning) when capture fails: a slower evaluation beats
    a lost one."""
    try:
        return GraphedStep(model, cache)
    except Exception as err:  # noqa: BLE001 - any capture error: the eager step is always correct
        warnings.warn(f"CUDA-graph decoding unavailable ({type(err).__name__}: {err}); decoding eagerly",
                      RuntimeWarning, stacklevel=3)
        return None


@torch.no_grad()
def greedy_decode(model: Any, ids: torch.Tensor, max_new_tokens: int, *, stop_ids: Sequence[int] = (),
                  done: Optional[Callable[[list[int]], bool]] = None, graphs: Optional[bool] = None) -> list[int]:
    """Greedy continuation of one prompt `ids` `[1, T]` by a harness student: the prompt in one chunked pass,
    then one recurrent step per token, replayed as a CUDA graph when `graphable(model)` and `graphs` (default:
    on unless HARNESS_DECODE_GRAPHS=0). Stops after a token in `stop_ids`, at `max_new_tokens`, or once
    `done(new ids)` holds. Returns the new token ids, the stop token included, as transformers' `generate` does."""
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"greedy_decode takes one prompt (batch 1), got a batch of {ids.shape[0]}")
    return greedy_decode_batch(model, [ids[0]], max_new_tokens, stop_ids=stop_ids, done=done, graphs=graphs)[0]


@torch.no_grad()
def greedy_decode_batch(model: Any, prompts: Sequence[Sequence[int] | torch.Tensor], max_new_tokens: int, *,
                        stop_ids: Sequence[int] = (), done: Optional[Callable[[list[int]], bool]] = None,
                        graphs: Optional[bool] = None) -> list[list[int]]:
    """`greedy_decode` of several prompts (token id lists or 1-D tensors, any lengths) together: each prompt's
    new token ids, in the order given, each cut at its own end (a stop token, included; `max_new_tokens`; or
    `done(that row's new ids)`). Each prompt is prefilled alone, then the rows step together (module docstring)."""
    if max_new_tokens < 1 or not prompts:
        return [[] for _ in prompts]
    if graphs is None:
        graphs = os.environ.get("HARNESS_DECODE_GRAPHS", "1") != "0"
    device = next(model.parameters()).device
    rows = [torch.as_tensor(p, dtype=torch.long, device=device).reshape(-1) for p in prompts]
    if any(r.numel() == 0 for r in rows):
        raise ValueError("greedy_decode_batch: every prompt needs at least one token")
    logits, cache = _prefill_rows(model, rows)
    mask = _prompt_mask(rows) if needs_positions(model) else None
    if fixable_kv(model):  # positions and padding then live in the cache
        cache.fix_kv(max_new_tokens, mask)
        mask = None
    elif mask is not None and not model.config.kept_layers():  # rotary mixers only: positions live in the cache
        cache.track_positions(mask)
        mask = None
    step = _graphed_or_none(model, cache) if graphs and graphable(model) and max_new_tokens > 1 else None
    news: list[list[int]] = [[] for _ in rows]
    open_rows = set(range(len(rows)))
    stops = set(int(t) for t in stop_ids)

    def ends(new: list[int]) -> bool:
        return new[-1] in stops or len(new) >= max_new_tokens or (done is not None and done(new))

    while True:
        token = logits.argmax(-1, keepdim=True)
        for row, tid in enumerate(token[:, 0].tolist()):  # a row that has ended keeps stepping; its tokens are dropped
            if row in open_rows:
                news[row].append(tid)
                if ends(news[row]):
                    open_rows.discard(row)
        if not open_rows:
            return news
        if step is not None:
            logits = step(token)
            continue
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(len(rows), 1)], 1)
        logits = model(token, attention_mask=mask, cache=cache, use_cache=True).logits[:, -1]


def _prefill_rows(model: HarnessForCausalLM, rows: list[torch.Tensor]) -> tuple[torch.Tensor, RecurrentCache]:
    """Each row's prompt through the model alone (batch 1, no padding); -> (last logits `[B, V]`, one cache holding
    the rows' states stacked in order, `seen_tokens` the longest prompt's length, as for a left-padded batch)."""
    layers = model.config.num_hidden_layers
    last, states = [], []
    for ids in rows:
        cache = RecurrentCache(layers)
        last.append(model(ids[None], cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1])
        states.append(cache.states)
    cache = RecurrentCache(layers)
    cache.states = [_stack(list(layer)) for layer in zip(*states)]
    cache.seen_tokens = max(r.numel() for r in rows)
    return torch.cat(last), cache


def _stack(states: list[Any]) -> Any:
    """One layer's per-row states (batch 1 each) as one state of the rows in order (a copy even for one row); KV
    states of unequal lengths are left-padded to the longest (the prompts' mask hides the padding), and so is a
    mixer's growing cache (`Mixer.growing_state`: its own `stack_left_padded` marks the padding)."""
    if isinstance(states[0], KVState):
        return KVState.stack_left_padded(states)
    if hasattr(states[0].recurrent, "stack_left_padded"):
        rest = _stack([MixerState(None, s.conv, s.window) for s in states])
        return MixerState(type(states[0].recurrent).stack_left_padded([s.recurrent for s in states]), rest.conv,
                          rest.window)
    columns = [torch.cat(ts) for ts in zip(*(s.tensors() for s in states), strict=True)]
    it = iter(columns)
    return states[0].map(lambda _: next(it))


def _prompt_mask(rows: list[torch.Tensor]) -> torch.Tensor:
    """The left-padded attention mask `[B, longest]` of the prompts: 1 at each row's last len(row) columns."""
    width = max(r.numel() for r in rows)
    lengths = torch.tensor([r.numel() for r in rows], device=rows[0].device)
    return (torch.arange(width, device=rows[0].device)[None] >= width - lengths[:, None]).long()


# ------------------------------------------------------------------------------------------ generation (any causal LM)


def check_batch_size(value: Any, name: str = "generation_batch_size") -> int:
    """A positive integer batch size, else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer (1: one prompt at a time)")
    return int(value)


def stop_token_ids(model: Any, tokenizer: Any, extra: Any = ()) -> list[int]:
    """Token ids that end a greedy answer, without repeats: the tokenizer's and the generation config's EOS, plus
    `extra` (e.g. a chat template's end-of-turn ids)."""
    found: list[int] = []
    for value in (getattr(tokenizer, "eos_token_id", None),
                  getattr(getattr(model, "generation_config", None), "eos_token_id", None), extra):
        for tid in value if isinstance(value, (list, tuple)) else [value]:
            if tid is not None and int(tid) not in found:
                found.append(int(tid))
    return found


def greedy_config(max_new_tokens: int, stop: list[int], tokenizer: Any):
    """A transformers GenerationConfig for greedy decoding that ends at `stop` (padding: the tokenizer's pad id,
    else the first stop id)."""
    from transformers import GenerationConfig

    pad = getattr(tokenizer, "pad_token_id", None)
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, eos_token_id=stop or None,
                            pad_token_id=pad if pad is not None else (stop or [0])[0])


class NewTextStop:
    """A transformers stopping criterion, per row: a row is done once `done(its new text)` holds, the new text being
    what was generated after the (left-padded) prompts' `prompt_length` columns, decoded without special tokens."""

    def __init__(self, tokenizer: Any, prompt_length: int, done: Callable[[str], bool]) -> None:
        self.tokenizer, self.prompt_length, self.done = tokenizer, prompt_length, done

    def __call__(self, input_ids: torch.Tensor, scores: Any = None, **kwargs: Any) -> torch.Tensor:
        texts = [self.tokenizer.decode(row, skip_special_tokens=True)
                 for row in input_ids[:, self.prompt_length:].tolist()]
        return torch.tensor([bool(self.done(t)) for t in texts], dtype=torch.bool, device=input_ids.device)


def length_batches(lengths: list[int], size: int) -> list[list[int]]:
    """Indices 0..n-1 in batches of at most `size`, by length (stable: equal lengths keep their order), so that a
    batch pads little; size 1 keeps the order given."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i]) if size > 1 else list(range(len(lengths)))
    return [order[i:i + size] for i in range(0, len(order), size)]


@torch.no_grad()
def greedy_ids(model: Any, tokenizer: Any, ids: torch.Tensor, max_new_tokens: int, stop: list[int],
               text_done: Optional[Callable[[str], bool]] = None) -> list[int]:
    """The new token ids of a greedy continuation of one unpadded prompt `ids` `[1, T]` (`greedy_ids_batch` of
    that one prompt, on ids' device)."""
    return greedy_ids_batch(model, tokenizer, [ids[0].tolist()], max_new_tokens, stop, text_done, ids.device)[0]


@torch.no_grad()
def greedy_ids_batch(model: Any, tokenizer: Any, prompts: list[list[int]], max_new_tokens: int, stop: list[int],
                     text_done: Optional[Callable[[str], bool]] = None,
                     device: str | torch.device = "cpu") -> list[list[int]]:
    """The new token ids of greedy continuations of `prompts` (token id lists), decoded together, each cut where
    it would end alone (the stop token included): at a `stop` id, after `max_new_tokens`, or once
    `text_done(new text)` holds, the new text decoded without special tokens. Harness students go through
    `greedy_decode_batch` (each prompt prefilled alone, then batched recurrent steps, a CUDA graph on GPUs), other
    models through `generate` with their KV cache, the prompts left-padded (one prompt: no padding)."""
    if not prompts:
        return []
    if isinstance(model, HarnessForCausalLM):
        done = None if text_done is None else (
            lambda new: text_done(tokenizer.decode(new, skip_special_tokens=True)))
        return greedy_decode_batch(model, prompts, max_new_tokens, stop_ids=stop, done=done)
    return _generate_batch(model, tokenizer, prompts, max_new_tokens, stop, text_done, device)


def _generate_batch(model: Any, tokenizer: Any, prompts: list[list[int]], max_new_tokens: int, stop: list[int],
                    text_done: Optional[Callable[[str], bool]], device: str | torch.device) -> list[list[int]]:
    """`generate` on the left-padded prompts; each row cut at its own end (after it, generate pads the row)."""
    from transformers import StoppingCriteriaList

    config = greedy_config(max_new_tokens, stop, tokenizer)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[config.pad_token_id] * (width - len(p)) + list(p) for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    criteria = StoppingCriteriaList([NewTextStop(tokenizer, width, text_done)] if text_done else [])
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, stopping_criteria=criteria)
    return [_cut_at_end(row, stop, tokenizer, text_done) for row in out[:, width:].tolist()]


def _cut_at_end(new: list[int], stop: list[int], tokenizer: Any,
                text_done: Optional[Callable[[str], bool]]) -> list[int]:
    """`new` up to where a lone generation of it ends: its first stop id, or the first token after which
    `text_done` holds (included), else all of it."""
    for n, token in enumerate(new, 1):
        if token in stop or (text_done is not None and text_done(tokenizer.decode(new[:n], skip_special_tokens=True))):
            return new[:n]
    return new


# ----------------------------------------------------------------------------------- candidate scoring (any causal LM)


def candidate_logprobs(model: Any, prompt_ids: list[int], candidates: list[list[int]],
                       device: str | torch.device = "cpu") -> list[float]:
    """log p(candidate | prompt) of each candidate token list, teacher-forced (`candidate_scores`)."""
    return candidate_scores(model, prompt_ids, candidates, device)[0]


@torch.no_grad()
def candidate_scores(model: Any, prompt_ids: list[int], candidates: list[list[int]],
                     device: str | torch.device = "cpu") -> tuple[list[float], torch.Tensor]:
    """log p(candidate | prompt) of each candidate token list, teacher-forced: the sum of its tokens' log-probs;
    and the first candidate's steps: `[len(candidates[0]), vocab]` float32 log-probabilities (on the model's
    device), row j the next-token distribution its token j was scored from (row 0: right after the prompt; row j:
    after the prompt and the candidate's own first j tokens).

    One forward over the prompt keeps its cache (a teacher's KV cache, a student's RecurrentCache), which is
    repeated once per candidate (`batch_repeat_interleave`); then one batched forward feeds every candidate but
    its last token. Shorter candidates are right-padded, which changes none of their positions (causal models).
    `model` is called as `model(input_ids=, cache=, use_cache=True, logits_to_keep=)` (`past_key_values=` where
    its forward has no `cache`) and returns `.logits` and its cache (`.cache`, else `.past_key_values`), as
    transformers causal LMs and HarnessForCausalLM do.
    """
    if not candidates or not all(candidates):
        raise ValueError("candidate_logprobs needs non-empty candidates")
    out = model(input_ids=torch.tensor([prompt_ids], device=device), use_cache=True, logits_to_keep=1)
    first = out.logits[0, -1].float().log_softmax(-1)
    scores = first[torch.tensor([c[0] for c in candidates], device=first.device)]
    longest = max(len(c) for c in candidates)
    if longest == 1:
        return scores.tolist(), first[None]
    cache = _output_cache(out)
    cache.batch_repeat_interleave(len(candidates))
    ids = torch.tensor([c + c[-1:] * (longest - len(c)) for c in candidates], device=device)
    logprobs = model(input_ids=ids[:, :-1], use_cache=True, **{_cache_keyword(model): cache}).logits.float()
    logprobs = logprobs.log_softmax(-1)
    token_lp = logprobs.gather(-1, ids[:, 1:, None].to(logprobs.device))[..., 0]
    lengths = torch.tensor([len(c) for c in candidates], device=token_lp.device)
    real = torch.arange(longest - 1, device=token_lp.device)[None] < (lengths - 1)[:, None]
    steps = torch.cat([first[None].to(logprobs.device), logprobs[0, :len(candidates[0]) - 1]])
    return (scores.to(token_lp.device) + torch.where(real, token_lp, 0.0).sum(1)).tolist(), steps


def _output_cache(out: Any) -> Any:
    """The cache a forward with use_cache=True returned: `cache` (transformers >= 5.2x) or `past_key_values`."""
    for name in ("cache", "past_key_values"):
        value = getattr(out, name, None)
        if value is not None:
            return value
    raise TypeError("the model returned no cache for use_cache=True; candidate_logprobs needs one")


def _cache_keyword(model: Any) -> str:
    """The keyword the model's forward takes its cache by: "cache" (transformers >= 5.2x), else "past_key_values"."""
    forward = getattr(model, "forward", model)
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"
