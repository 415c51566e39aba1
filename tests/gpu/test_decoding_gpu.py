"""CUDA-graph decoding (harness.decoding) against eager decoding on the GPU, for every mixer (and three with
rotary embeddings, whose positions the graph reads from the cache): the same greedy tokens, the same states after
the last step, the graph replayed across two prompts, and batched decoding (graphed = eager; float32 = batch 1).
Skipped without CUDA. The rotary cases (`-k True`): 9 passed on an H200, 2026-12-04.

    source .devbundle/setup.sh && python3 -m pytest -q tests/gpu/test_decoding_gpu.py
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

import harness  # noqa: E402
from harness.decoding import GraphedStep, greedy_decode, greedy_decode_batch  # noqa: E402
from harness.mixers import MIXERS  # noqa: E402
from harness.student import RecurrentCache  # noqa: E402
from tests.tiny import tiny_llama  # noqa: E402


# the graphed cases: every mixer whose state keeps its size (fox's growing KV cache decodes eagerly: graph_blocker)
CASES = ([(m, False) for m in sorted(MIXERS) if not MIXERS[m].growing_state]
         + [(m, True) for m in ("gla", "gated_deltanet", "mlstm")])


def student_on_gpu(mixer: str, rope: bool = False):
    teacher = tiny_llama(num_layers=3, hidden=256, heads=4, kv_heads=2, vocab=512)
    torch.manual_seed(0)
    return harness.build_student(teacher, mixer, rope=rope).to("cuda", torch.bfloat16).eval()


@pytest.mark.filterwarnings("error::RuntimeWarning")  # a failed capture falls back to eager with this warning
@pytest.mark.parametrize("mixer,rope", CASES)
def test_graphed_decoding_equals_eager(mixer, rope):
    student = student_on_gpu(mixer, rope)
    gen = torch.Generator().manual_seed(3)
    for length in (100, 37):  # a second prompt: a new graph over a new cache
        ids = torch.randint(3, 512, (1, length), generator=gen).cuda()
        eager = greedy_decode(student, ids, 24, graphs=False)
        graphed = greedy_decode(student, ids, 24, graphs=True)
        assert graphed == eager, (mixer, length)


@pytest.mark.parametrize("mixer,rope", CASES)
def test_graph_leaves_the_cache_as_eager_steps_do(mixer, rope):
    student = student_on_gpu(mixer, rope)
    ids = torch.randint(3, 512, (1, 64), generator=torch.Generator().manual_seed(5)).cuda()
    tokens = torch.randint(3, 512, (6, 1, 1), generator=torch.Generator().manual_seed(6)).cuda()
    caches = []
    for graphs in (False, True):
        cache = RecurrentCache(student.config.num_hidden_layers)
        with torch.no_grad():
            student(ids, cache=cache, use_cache=True)
            step = GraphedStep(student, cache) if graphs else None
            for tok in tokens:
                logits = step(tok) if graphs else student(tok, cache=cache, use_cache=True).logits[:, -1]
        caches.append((cache, logits.clone()))
    (eager, eager_logits), (graphed, graphed_logits) = caches
    assert graphed.seen_tokens == eager.seen_tokens == 70
    torch.testing.assert_close(graphed_logits, eager_logits, rtol=0, atol=0)
    for a, b in zip(eager.states, graphed.states):
        for x, y in zip(a.tensors(), b.tensors(), strict=True):
            torch.testing.assert_close(y, x, rtol=0, atol=0)



@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize("mixer,rope", CASES)
def test_batched_graphed_decoding_equals_batched_eager(mixer, rope):
    """The graph of a batched step (rows of different prompt lengths) replays the eager batched step: same tokens;
    the first token of each row comes from its own batch-1 prefill, so it is batch 1's."""
    student = student_on_gpu(mixer, rope)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 512, (n,), generator=gen).cuda() for n in (100, 37, 64)]
    eager = greedy_decode_batch(student, prompts, 24, graphs=False)
    assert greedy_decode_batch(student, prompts, 24, graphs=True) == eager
    alone = [greedy_decode(student, p[None], 24, graphs=False) for p in prompts]
    assert [e[0] for e in eager] == [a[0] for a in alone]
    same = sum(x == y for e, a in zip(eager, alone) for x, y in zip(e, a)) / sum(map(len, alone))
    print(f"{mixer} (rope {rope}): bf16 batch-3 tokens equal to batch 1: {100 * same:.0f}%")


@pytest.mark.parametrize("mixer", sorted(MIXERS))
def test_batched_decoding_in_float32_gives_batch_1_tokens(mixer):
    """In float32 on the GPU (kernel backend prefill, batched recurrent steps) each row's tokens are batch 1's."""
    student = student_on_gpu(mixer).float()
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 512, (n,), generator=gen).cuda() for n in (90, 33, 128)]
    alone = [greedy_decode(student, p[None], 16) for p in prompts]
    assert greedy_decode_batch(student, prompts, 16) == alone
