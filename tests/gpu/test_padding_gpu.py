"""Padded batches on the kernel backend (fla's and mlstm_kernels' chunk kernels, bf16), for every mixer: a left- or
right-padded row's logits at its real tokens, and its recurrent state after a left-padded prompt, are as close to
the fp32 reference of that row alone as the kernel run on the row alone is (the bf16 floor of
tests/gpu/test_mixer_layers.py). The shortest row's padding fills a whole kernel chunk. Skipped without CUDA.

    source .devbundle/setup.sh && python3 -m pytest -q tests/gpu/test_padding_gpu.py
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

import harness  # noqa: E402
from harness.mixers import MIXERS  # noqa: E402
from harness.mixers.contract import row_state  # noqa: E402
from tests.tiny import tiny_llama  # noqa: E402

LENGTHS = (37, 100, 130)  # chunk 64: the shortest row starts after a whole chunk of padding
FLOOR_FACTOR, FLOOR_SLACK = 2.0, 2e-3


def students(mixer: str, rope: bool):
    """The same student on the kernel backend and on the fp32 reference backend, on the GPU."""
    teacher = tiny_llama(num_layers=3, hidden=256, heads=4, kv_heads=2, vocab=512)
    built = {}
    for backend in ("kernel", "reference"):
        torch.manual_seed(0)
        model = harness.build_student(teacher, mixer, backend=backend, rope=rope)
        for layer in model.model.layers:
            if hasattr(layer.mixer, "qkv_conv"):
                layer.mixer.qkv_conv.reset_parameters("random")  # a wrong conv tail must show
        built[backend] = model.to("cuda").eval()
    return built["kernel"], built["reference"]


def padded(prompts, side: str):
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        span = slice(width - len(p), width) if side == "left" else slice(0, len(p))
        ids[row, span], mask[row, span] = p, 1
    return ids.cuda(), mask.cuda()


def rel(a, b) -> float:
    """Relative error of a against b; the absolute error where b is exactly 0 (path's cumulative forget gate with the
    gate off is zeros: 0 / 0 failed this test on an H100, 2026-12-07)."""
    diff, ref = (a.float() - b.float()).norm(), b.float().norm()
    return (diff / ref if ref > 0 else diff).item()


CASES = [(m, False) for m in sorted(MIXERS)] + [(m, True) for m in ("gla", "gated_deltanet", "mlstm")]


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("mixer,rope", CASES)
@torch.no_grad()
def test_a_padded_batch_on_the_kernel_backend_is_each_row_alone(mixer, rope, side):
    kernel, reference = students(mixer, rope)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=gen) for n in LENGTHS]
    ids, mask = padded(prompts, side)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        batch = kernel(ids, attention_mask=mask, use_cache=True)
    for row, p in enumerate(prompts):
        alone = p[None].cuda()
        truth = reference(alone, use_cache=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            floor = kernel(alone, use_cache=True)
        real = slice(-len(p), None) if side == "left" else slice(0, len(p))
        err, floor_err = rel(batch.logits[row, real], truth.logits[0]), rel(floor.logits[0], truth.logits[0])
        assert err <= FLOOR_FACTOR * floor_err + FLOOR_SLACK, (mixer, side, row, err, floor_err)
        if side != "left":
            continue
        for layer, (b, t, f) in enumerate(zip(batch.cache.states, truth.cache.states, floor.cache.states)):
            for bt, tt, ft in zip(row_state(b, row), row_state(t, 0), row_state(f, 0)):  # a growing cache's real slots
                state_err, state_floor = rel(bt, tt), rel(ft, tt)
                assert state_err <= FLOOR_FACTOR * state_floor + FLOOR_SLACK, (mixer, layer, row, state_err)
