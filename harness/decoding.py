"""Greedy decoding of a harness student, one recurrent step per token, with the step captured as a CUDA graph.

At batch 1 a student's decoding step is a few hundred small kernels whose launches, not their work, take the time
(135M on an H200: ~68 ms per token eagerly, the GPU idle most of it). Every step has the same shapes - one token
in, fixed-size states - so it can be recorded once as a CUDA graph and replayed: one launch per token.

    greedy_decode(model, ids, max_new_tokens, stop_ids=..., done=..., graphs=True) -> new token ids
    GraphedStep(model, cache)                              the captured step: __call__(token) -> logits [B, V]
    graphable(model)                                       whether a model's step can be captured

HARNESS_DECODE_GRAPHS=0 in the environment turns the graphs off wherever `graphs` is not given (NIAH, chat samples).

The graph reads the token and every layer's state from static buffers, and its last kernels copy the new states
back into them, so a replay leaves the cache as an eager step would (`cache.seen_tokens` is advanced on the host).
Mixers with rotary embeddings take positions from the host each step and are decoded eagerly, as is everything
off CUDA. `tests/gpu/test_decoding_gpu.py` checks graphed against eager tokens for every mixer.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable, Optional, Sequence

import torch

from harness.student import HarnessForCausalLM, RecurrentCache


def graphable(model: Any) -> bool:
    """A harness student on a CUDA device without rotary embeddings (their positions come from the host)."""
    return (isinstance(model, HarnessForCausalLM) and model.model.rotary_emb is None
            and next(model.parameters()).is_cuda)


class GraphedStep:
    """One decoding step of `model` over `cache` (after its prefill) as a CUDA graph. The cache's states become
    the graph's static buffers: keep using this object (not the model) for the cache's next tokens."""

    def __init__(self, model: HarnessForCausalLM, cache: RecurrentCache, warmup: int = 2) -> None:
        if not graphable(model):
            raise ValueError("GraphedStep needs a harness student on CUDA without rotary embeddings")
        if any(s is None for s in cache.states):
            raise ValueError("GraphedStep needs a prefilled cache (every layer's state set)")
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
                        dst.copy_(src)
                self.logits = out.logits[:, -1]
        finally:  # also after a failed capture, so that eager decoding can go on from this cache
            cache.states, cache.seen_tokens = list(self.states), seen

    def _warm_up(self, steps: int) -> None:
        """Run the step on copies of the states on a side stream (CUDA graphs need the allocator and the libraries'
        workspaces set up before capture); the real states are left as they are."""
        scratch = RecurrentCache(len(self.states))
        scratch.states = [s.map(lambda t: t.clone()) for s in self.states]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(steps):
                self.model(self.token, cache=scratch, use_cache=True, logits_to_keep=1)
        torch.cuda.current_stream().wait_stream(side)

    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        """Feed `token` `[B, 1]`; returns the next-token logits `[B, V]` (a static buffer: overwritten next call)."""
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
    if ids.shape[0] != 1:
        raise ValueError(f"greedy_decode takes one prompt (batch 1), got a batch of {ids.shape[0]}")
    if graphs is None:
        graphs = os.environ.get("HARNESS_DECODE_GRAPHS", "1") != "0"
    cache = RecurrentCache(model.config.num_hidden_layers)
    logits = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    step = _graphed_or_none(model, cache) if graphs and graphable(model) and max_new_tokens > 1 else None
    new: list[int] = []
    stops = set(int(t) for t in stop_ids)
    while len(new) < max_new_tokens:
        token = logits.argmax(-1, keepdim=True)
        new.append(int(token.item()))
        if new[-1] in stops or len(new) >= max_new_tokens or (done is not None and done(new)):
            break
        logits = step(token) if step is not None else model(token, cache=cache, use_cache=True).logits[:, -1]
    return new
