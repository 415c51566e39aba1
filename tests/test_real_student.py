"""Students of the real SmolLM2-135M teacher (from its GGUF): finite loss on real text, exact parameter counts."""

from __future__ import annotations

import pytest
import torch

import harness
from harness.student import count_parameters
from tests.test_teacher import DARWIN

TEACHER_PARAMS = 134_515_008
C, H, D, KVH, L = 576, 9, 64, 3, 30
INNER = H * D
CONV = 3 * INNER * 4  # depthwise short conv over q, k, v, kernel 4, no bias
KV_EXPANSION = 2 * (INNER - KVH * D) * C  # k_proj and v_proj grow from 3 to 9 heads
NEW_PER_LAYER = {  # written from the mixers' definitions, not from the code
    "linear_attn": 0,
    # a swish output gate (retnet, gla, gated_deltanet) has a bias: silu(bias) = 1 opens it at step 0
    "retnet": C * INNER + INNER + D,
    "gla": C * 16 + 16 * INNER + INNER + C * INNER + INNER + D,
    "deltanet": CONV + C * H + D,
    "gated_deltanet": CONV + 2 * C * H + 2 * H + C * INNER + INNER + D,
    "kda": CONV + (C * D + D * INNER) + C * H + H + INNER + (C * D + D * INNER + INNER) + D,
    "mlstm": 2 * (C * H + H) + C * INNER + INNER,
}


@pytest.mark.parametrize("name", list(NEW_PER_LAYER))
def test_real_teacher_student_has_finite_loss_and_expected_size(smollm2_teacher, name):
    assert count_parameters(smollm2_teacher.model) == TEACHER_PARAMS
    student = harness.build_student(smollm2_teacher, name, backend="reference").eval()
    assert count_parameters(student) == TEACHER_PARAMS + L * (KV_EXPANSION + NEW_PER_LAYER[name])
    ids = smollm2_teacher.tokenizer(DARWIN, return_tensors="pt").input_ids[:, :128]
    with torch.no_grad():
        loss = student(ids, labels=ids).loss
        teacher_loss = smollm2_teacher.model(ids, labels=ids).loss
    assert torch.isfinite(loss), name
    # an undistilled student is a worse language model than its teacher
    assert loss > teacher_loss
