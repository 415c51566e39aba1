"""Checkpoint export: a stage-3 or SFT checkpoint directory -> a consolidated fp32 Hugging Face student.

Stage 3 and SFT export their newest checkpoint at their end, the evaluations along stage 3 export snapshots
(harness.eval.during), and `harness export` exports any checkpoint by hand. A checkpoint holds the engine's
state under the DeepSpeed tag `TAG`; the student's config and tokenizer files come from the merged student
(or whichever student the stage started from).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from harness.files import atomic_dir

TAG = "ds"  # DeepSpeed's tag inside each step-* checkpoint directory


def export_checkpoint(checkpoint: Path, dest: Path, merged: Path) -> Path:
    """A stage-3 checkpoint directory -> a consolidated fp32 Hugging Face student at `dest` (atomically)."""
    from harness.engine import consolidated_state_dict
    from harness.student import HarnessForCausalLM

    state = consolidated_state_dict(checkpoint, TAG, prefix="student.")
    student = HarnessForCausalLM.from_pretrained(merged, dtype=torch.float32)
    missing, unexpected = student.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not student.config.tie_word_embeddings]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint {checkpoint} does not fit the student: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    with atomic_dir(dest, replace=True) as tmp:
        student.save_pretrained(tmp)
        for name in merged.iterdir():  # the tokenizer files saved with the merged student
            if name.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy(name, tmp / name.name)
    return dest
