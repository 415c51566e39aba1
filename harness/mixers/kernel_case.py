"""What a mixer's recurrence is on the kernel backend, declared by the mixer class (`Mixer.kernel_case`): the kernel
route it reaches, and the inputs with which the recurrence bench (`harness bench --what recurrences`,
harness/bench/recurrences.py) and the GPU kernel tests check that route against the PyTorch reference. A mixer
without one (None) runs no kernel of its own there: the bench and those tests leave it out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

from harness.mixers.kernels import (DPLR_ROUTES, FOX_KERNEL, GSA_KERNEL, MLSTM_KERNEL, PATH_KERNEL, PRODUCT_ROUTES,
                                    ROUTES)

# gated_delta_product: the gated delta rule with several Householder steps per token (keys, values and beta with a
# step axis, `harness.bench.recurrences.PRODUCT_STEPS` of them in the bench); dplr_delta: the delta rule with a
# diagonal-plus-low-rank transition (RWKV-7's: its own a and b beside k, and a per-channel decay); gsa: gated slot
# attention (its slots `harness.bench.recurrences.GSA_SLOTS` in the bench, gate slot); forgetting_attn: softmax
# attention with a forget gate (the fox mixer, gate forget), which has no recurrent state: it decodes from a KV cache;
# path_attn: softmax attention whose keys pass through Householder-like transforms (the path mixer: beta and its w
# directions, no gate in the bench), which decodes from a KV cache too
RECURRENCES = ("gated_delta", "gated_delta_product", "dplr_delta", "mlstm", "gsa", "forgetting_attn", "path_attn")
KV_CACHE_RECURRENCES = ("forgetting_attn", "path_attn")  # no recurrent state: they decode from a KV cache
_ROUTES_OF = {"gated_delta": ROUTES, "gated_delta_product": PRODUCT_ROUTES, "dplr_delta": DPLR_ROUTES,
              "mlstm": (MLSTM_KERNEL,), "gsa": (GSA_KERNEL,), "forgetting_attn": (FOX_KERNEL,),
              "path_attn": (PATH_KERNEL,)}
# the gates that belong to one recurrence each, and it to them
PAIRED_GATES = {"gsa": "slot", "forgetting_attn": "forget"}
# How q and k reach the recurrence: raw ~N(0, 1) with scale K^-0.5; elu1, elu + 1 with scale 1 (linear attention's
# feature map and normaliser); l2, L2-normalised with scale K^-0.5 (the delta rules); softmax_pair, [softmax(x),
# softmax(-x)] with scale 1 and twice the key dim (hedgehog's learned feature map)
FEATURES = ("raw", "elu1", "l2", "softmax_pair")
# The decay g of the gated-delta recurrence (harness.mixers.kernels' cases): none; head_const, a constant per
# head (RetNet's log(1 - 2^(-5-h))); head, data-dependent per head (-exp(A) softplus(x + dt_bias), Mamba2-style);
# channel, data-dependent per key channel (logsigmoid(x) / 16); ssd, Mamba2's -A dt per head with dt folded into k;
# slot, gated slot attention's per-slot log decay logsigmoid(x) / 8 and write strength s = 1 - exp(g);
# rwkv7, RWKV-7's per-channel -exp(-0.5) sigmoid(x), so every decay lies in [exp(-exp(-0.5)), 1); forget, FoX's
# per-head log forget gate logsigmoid(x), its cumulative sum between key and query added to the softmax logits
GATES = (None, "head_const", "head", "channel", "ssd", "slot", "rwkv7", "forget")
TOLERANCE_KEYS = ("out", "state", "grad", "gate_grad")


@dataclass(frozen=True)
class KernelCase:
    """A mixer's recurrence on the kernel backend (see the module docstring)."""

    route: str = field(metadata={"help": "The kernel its recurrence takes by default: an fla route of "
                                 "harness.mixers.kernels.ROUTES (gated_delta), of kernels.PRODUCT_ROUTES "
                                 "(gated_delta_product), of kernels.DPLR_ROUTES (dplr_delta), kernels.MLSTM_KERNEL "
                                 "(mlstm), kernels.GSA_KERNEL (gsa), kernels.FOX_KERNEL (forgetting_attn) or "
                                 "kernels.PATH_KERNEL (path_attn)."})
    recurrence: str = field(default="gated_delta", metadata={"help": "gated_delta (docs/RECURRENCES.md), "
                                                             "gated_delta_product, dplr_delta, mlstm, gsa, "
                                                             "forgetting_attn or path_attn."})
    features: str = field(default="raw", metadata={"help": "How q and k reach the recurrence: raw, elu1, l2 or "
                                                   "softmax_pair."})
    gate: Optional[str] = field(default=None, metadata={"help": "The decay g: None, head_const, head, channel, ssd, "
                                                        "slot (gsa's), rwkv7 or forget (forgetting_attn's)."})
    beta: bool = field(default=False, metadata={"help": "Whether the recurrence takes the delta rule's beta."})
    alternative_routes: tuple[str, ...] = field(
        default=(), metadata={"help": "Other fla routes of the same recurrence, measured beside the default one "
                              "(the fallbacks HARNESS_FLA_ROUTES may switch to)."})
    tolerances: Mapping[str, float] = field(
        default_factory=dict, metadata={"help": "Relative-error limits that differ from the bench's (keys out, "
                                        "state, grad, gate_grad), with the measurement that justifies them."})

    def __post_init__(self) -> None:
        if self.recurrence not in RECURRENCES:
            raise ValueError(f"KernelCase recurrence={self.recurrence!r} is not one of "
                             f"{', '.join(map(repr, RECURRENCES))}")
        routes = _ROUTES_OF[self.recurrence]
        checks = (("features", self.features, FEATURES), ("gate", self.gate, GATES), ("route", self.route, routes))
        for name, value, allowed in checks:
            if value not in allowed:
                raise ValueError(f"KernelCase {name}={value!r} is not one of {', '.join(map(repr, allowed))}")
        for recurrence, gate in PAIRED_GATES.items():
            if (self.recurrence == recurrence) != (self.gate == gate):
                raise ValueError(f"KernelCase gate={self.gate!r} with recurrence={self.recurrence!r}: gate '{gate}' "
                                 f"goes with recurrence '{recurrence}' and only with it")
        bad = [r for r in self.alternative_routes if r not in routes or self.recurrence == "mlstm"]
        if bad:
            raise ValueError(f"KernelCase alternative_routes {bad}: each must be one of {', '.join(routes)} "
                             f"(recurrence {self.recurrence})")
        unknown = sorted(set(self.tolerances) - set(TOLERANCE_KEYS))
        if unknown:
            raise ValueError(f"KernelCase tolerances {unknown}: keys must be among {', '.join(TOLERANCE_KEYS)}")

    @property
    def stateful(self) -> bool:
        """Whether the kernel carries a recurrent state (initial and final): every recurrence but the softmax
        attentions that decode from a KV cache (forgetting_attn, path_attn)."""
        return self.recurrence not in KV_CACHE_RECURRENCES

    @property
    def variants(self) -> tuple[str, ...]:
        """The routes the bench measures: "auto" (the default choice) and the alternatives."""
        return ("auto", *self.alternative_routes)
