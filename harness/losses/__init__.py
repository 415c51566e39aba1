"""Training losses, one kind of term per module behind one base (base.py: `Loss`, `AlignmentLoss`, `TokenLoss`).

- mse.py      stages 1 and 2: MSE and the per-token L2 norm between student and teacher tensors (`mse`, `l2`); the
              relative squared error of stage 3's per-layer hidden-state term (`RelativeMSE`)
- kl.py       KL(teacher || student) (`kl`) and KL(student || teacher) (`reverse_kl`) at a temperature, tau^2-scaled
- ce.py       next-token cross-entropy (`ce`)
- chunked.py  stage 3's and SFT's weighted sum of next-token terms from final hidden states, a chunk of tokens at a
              time (`ChunkedLoss`, returning `LossTerms`: the total and every term by name; `distill_loss` = CE + KL,
              `lm_loss` = CE; `register_token_loss` adds a kind of term)
- kl_ce.py    the fused CE + KL pass over a chunk that `ChunkedLoss` runs for those two terms (a Triton kernel on
              CUDA, harness.loss_kernel)
- head_matmuls.py  the output-head matmuls of the chunked loss (logits and gradients, fp32 out of bf16 heads)
"""

from harness.losses.base import IGNORE_INDEX, AlignmentLoss, Loss, TokenLoss
from harness.losses.ce import CrossEntropy
from harness.losses.chunked import (TOKEN_LOSSES, ChunkedLoss, LossTerms, distill_loss, kl_and_ce, lm_loss,
                                    register_token_loss, token_losses)
from harness.losses.head_matmuls import VOCAB_BLOCK, tf32_matmuls
from harness.losses.kl import ForwardKL, ReverseKL
from harness.losses.mse import ALIGNMENT_LOSSES, L2, MSE, RelativeMSE, alignment_l2, alignment_loss, alignment_mse

__all__ = ["ALIGNMENT_LOSSES", "IGNORE_INDEX", "L2", "MSE", "TOKEN_LOSSES", "VOCAB_BLOCK", "AlignmentLoss",
           "ChunkedLoss", "CrossEntropy", "ForwardKL", "Loss", "LossTerms", "RelativeMSE", "ReverseKL", "TokenLoss",
           "alignment_l2", "alignment_loss", "alignment_mse", "distill_loss", "kl_and_ce", "lm_loss",
           "register_token_loss", "tf32_matmuls", "token_losses"]
