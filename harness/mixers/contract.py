"""The contract every mixer passes, built-in or plug-in (`harness mixers check NAME`; tests/test_mixer_contract.py
runs it on every registered mixer). Each property is a function of a `Subject` (the mixer, its options and a tiny
random Llama teacher: nothing is downloaded) that returns an `Outcome`: PASS, FAIL or SKIP, with the numbers it
compared. A property that raises fails with the error. A few seconds per mixer on a CPU.

- chunked_equals_step: the layer's reference backend over a whole sequence == one token at a time carrying the
  state (outputs and every parameter's gradient);
- kernel_matches_reference: on CUDA, the kernel backend in fp32 equals the reference in fp32, and in bf16 it is no
  farther from it than the reference run in bf16 (the bf16 floor) allows (SKIP without CUDA);
- zeroed_values_give_the_teacher: with the teacher's v_proj zeroed (and a mixer's own further value projections,
  `Mixer.value_projections`), the student's logits are the teacher's (every attention and every mixer outputs 0, so
  what is left is the rest of the network, which the student copies);
- cached_generate_equals_full_forwards: greedy `generate` with the recurrent cache gives the tokens of repeated
  full forwards, and each cached step's logits are the full forward's;
- padding_left_and_right: in a batch padded on the left or on the right, each row's logits at its real tokens are
  those of the row alone, and after left padding its states too (a cache's real slots: `row_state`);
- save_load: `save_pretrained` then `AutoModelForCausalLM.from_pretrained` gives the same logits, bit for bit.

New parameters (everything but the copied projections and q/k norms) get random offsets first, so that gates far
from their (often saturated) initial values take part in every comparison.
"""

from __future__ import annotations

import contextlib
import copy
import tempfile
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

from harness.layouts import LayerRope
from harness.mixers import Mixer, MixerState, mixer_options
from harness.mixers.kernels import kernel_unavailable_reason
from harness.student import HarnessForCausalLM, build_student, rope_for

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
COPIED = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")  # what transfer_from_attention copies
CHUNK_SIZE = 8  # unless the options give one: the test sequences span several chunks and a partial one
PAD = 0
PROMPT_LENGTHS = (5, 13, 22)
LOGIT_ATOL = 1e-5  # float32 students of a float32 teacher; the built-in mixers measure <= 2e-6
STEP_RTOL, STEP_ATOL, GRAD_RTOL = 1e-4, 1e-5, 1e-4
# kernel_matches_reference: each compared tensor within FACTOR x the reference's own bf16 error + SLACK, at inputs
# small enough that the comparison is well conditioned (docs/results/contract-h100-2026-12-05/README.md).
KERNEL_FLOOR_FACTOR, KERNEL_FLOOR_SLACK = 2.0, 3e-2
KERNEL_X_SCALE, KERNEL_OFFSET_STD = 0.1, 0.05
KERNEL_FLOOR_LIMIT = 0.1  # tests/test_mixer_contract.py: each mixer's bf16 floor at those inputs stays below it


@dataclass
class Outcome:
    """One property's result: PASS, FAIL or SKIP, and what was measured (or why it was skipped)."""

    name: str
    status: str
    detail: str


@dataclass
class Subject:
    """A mixer to check: its name, its options and the tiny teacher its students are built from."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)
    teacher: Optional[nn.Module] = None
    seed: int = 0

    def __post_init__(self) -> None:
        mixer_options(self.name, self.student_options())  # a clear error for a bad name or option, before any check
        if self.teacher is None:
            self.teacher = tiny_teacher(seed=self.seed)

    def student_options(self, backend: str = "reference") -> dict[str, Any]:
        return {"chunk_size": CHUNK_SIZE, **self.options, "backend": backend}

    def student(self, teacher: Optional[nn.Module] = None, backend: str = "reference") -> HarnessForCausalLM:
        """A student of the teacher (or of `teacher`) with its new parameters moved off their init."""
        model = build_student(teacher if teacher is not None else self.teacher, self.name,
                              **self.student_options(backend)).eval()
        perturb_new_parameters(model, self.seed)
        return model


def tiny_teacher(num_layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, vocab: int = 97,
                 tie: bool = True, seed: int = 0) -> LlamaForCausalLM:
    """A random float32 Llama with grouped KV heads, and distinct K/V rows per head (a wrong head mapping shows);
    its embeddings tied to the head unless `tie` is off. The tests' tiny Llama too (tests/tiny.py)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=512, tie_word_embeddings=tie, attn_implementation="sdpa",
                         bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.normal_(0, 0.2)
            layer.self_attn.v_proj.weight.normal_(0, 0.2)
    return model


@torch.no_grad()
def perturb_new_parameters(student: nn.Module, seed: int, std: float = 0.2) -> None:
    generator = torch.Generator().manual_seed(seed + 5)
    for module in student.modules():
        if isinstance(module, Mixer):
            for name, p in module.named_parameters():
                if not name.startswith(COPIED):
                    p.add_(std * torch.randn(p.shape, generator=generator).to(p.dtype))


def token_ids(batch: int, length: int, seed: int, vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (||a - b|| where b is 0)."""
    diff, ref = (a.double() - b.double()).norm().item(), b.double().norm().item()
    return diff / ref if ref > 0 else diff


def max_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


# ---------------------------------------------------------------------------------------------------- properties
def chunked_equals_step(subject: Subject) -> Outcome:
    """Layer 0's mixer (reference backend) on x `[2, 13, hidden]` at once (chunks of 8 unless the options say) vs
    token by token from its state: |y_chunk - y_step| <= 1e-5 + 1e-4 |y_step| everywhere, and every parameter's
    gradient of sum(y^2) within 1e-4 relative (and None on both paths or on neither)."""
    student = subject.student()
    mixer = student.model.layers[0].mixer
    x = torch.randn(2, 13, student.config.hidden_size, generator=torch.Generator().manual_seed(subject.seed + 1))
    rope = rope_for(student.config, x.device)(x[..., 0])
    params = [p for _, p in mixer.named_parameters()]
    y_chunk, _ = mixer(x, position_embeddings=rope)
    grads_chunk = torch.autograd.grad(y_chunk.square().sum(), params, allow_unused=True)
    state, steps = None, []
    for t in range(x.shape[1]):
        y, state = mixer(x[:, t:t + 1], position_embeddings=positions(rope, t), state=state, use_cache=True)
        steps.append(y)
    y_step = torch.cat(steps, 1)
    grads_step = torch.autograd.grad(y_step.square().sum(), params, allow_unused=True)
    excess = float(((y_chunk - y_step).abs() - STEP_ATOL - STEP_RTOL * y_step.abs()).max().detach())
    problems = [] if excess <= 0 else [f"outputs beyond 1e-05 + 1e-04 |y| by {excess:.1e}"]
    worst, worst_name = 0.0, "-"
    for (name, _), gc, gs in zip(mixer.named_parameters(), grads_chunk, grads_step):
        if (gc is None) != (gs is None):
            problems.append(f"gradient of {name} is None on the {'chunked' if gc is None else 'step'} path only")
        elif gc is not None and relative(gc, gs) >= worst:
            worst, worst_name = relative(gc, gs), name
    if worst >= GRAD_RTOL:
        problems.append(f"gradient of {worst_name} differs by {worst:.1e} relative (limit {GRAD_RTOL:.0e})")
    numbers = f"outputs max |diff| {max_gap(y_chunk, y_step):.1e}; worst gradient {worst:.1e} relative ({worst_name})"
    return _outcome("chunked_equals_step", problems, numbers)


def positions(rope: Any, t: int) -> Any:
    """The position embeddings of token t alone: (cos, sin) `[B, T, D]`, a LayerRope or None, cut to t."""
    if rope is None:
        return None
    if isinstance(rope, LayerRope):
        return LayerRope([positions(entry, t) for entry in rope.per_layer])
    return tuple(e[:, t:t + 1] for e in rope)


def kernel_matches_reference(subject: Subject) -> Outcome:
    """On CUDA, at SmolLM2-135M's head layout (hidden 576, 9 heads of 64, 3 KV heads), x `[2, 512, 576]`: the layer
    on the kernel backend in bf16 against the reference backend in fp32 (same weights), its output, input gradient
    and every parameter's gradient each no farther than KERNEL_FLOOR_FACTOR x the reference's own bf16 run +
    KERNEL_FLOOR_SLACK (`kernel_errors`). The inputs are `kernel_inputs`: small, so that bf16 roundings are not
    amplified into gradients a precision apart (at x ~ N(0, 1) and offsets of 0.2 the reference's own bf16 run was
    45-130% off its fp32 gradients for mlstm and mamba2). The slack covers what the kernels compute differently: the
    decay gates' gradients rebuilt from dq and dk (q.dq - k.dk, then a reverse cumulative sum) in fla and
    mlstm_kernels. There is no fp32 kernel run: the kernel path sends q, k and v to the kernels in bf16 whatever
    the layer's dtype (kernels._compute_dtype). SKIP without CUDA or without the kernel libraries."""
    reason = kernel_unavailable_reason("all")
    if reason is not None:
        return Outcome("kernel_matches_reference", SKIP, f"needs CUDA and the kernels: {reason}")
    reference_student, x = kernel_inputs(subject)
    kernel_student = kernel_inputs(subject, backend="kernel")[0]
    kernel_student.load_state_dict(reference_student.state_dict())
    runs = {label: _layer_run(copy.deepcopy(model).to("cuda", dtype), x.to("cuda", dtype)) for label, model, dtype in
            (("kernel", kernel_student, torch.bfloat16), ("reference", reference_student, torch.float32),
             ("floor", reference_student, torch.bfloat16))}
    problems = kernel_errors(runs)
    errors = {what: (relative(runs["kernel"][what], ref), relative(runs["floor"][what], ref))
              for what, ref in runs["reference"].items()}
    worst = max(errors, key=lambda w: errors[w][0] - KERNEL_FLOOR_FACTOR * errors[w][1])
    return _outcome("kernel_matches_reference", problems,
                    f"output {errors['output'][0]:.1e} (floor {errors['output'][1]:.1e}); nearest its limit: "
                    f"{worst} {errors[worst][0]:.1e} (floor {errors[worst][1]:.1e})")


def kernel_inputs(subject: Subject, backend: str = "reference") -> tuple[HarnessForCausalLM, torch.Tensor]:
    """kernel_matches_reference's one-layer student (SmolLM2-135M's head layout, new parameters moved off their init
    by KERNEL_OFFSET_STD) on `backend`, float32 on the CPU, and its input x `[2, 512, 576]` ~ N(0, KERNEL_X_SCALE^2)."""
    teacher = tiny_teacher(num_layers=1, hidden=576, heads=9, kv_heads=3, seed=subject.seed)
    student = build_student(teacher, subject.name, **subject.student_options(backend)).eval()
    perturb_new_parameters(student, subject.seed, std=KERNEL_OFFSET_STD)
    x = KERNEL_X_SCALE * torch.randn(2, 512, 576, generator=torch.Generator().manual_seed(subject.seed + 2))
    return student, x


def kernel_errors(runs: dict[str, dict[str, torch.Tensor]]) -> list[str]:
    """Each tensor of the bf16 kernel run farther from the fp32 reference than KERNEL_FLOOR_FACTOR x the reference's
    own bf16 run + KERNEL_FLOOR_SLACK, named with both errors."""
    problems = []
    for what, ref in runs["reference"].items():
        kernel, floor = relative(runs["kernel"][what], ref), relative(runs["floor"][what], ref)
        if kernel > KERNEL_FLOOR_FACTOR * floor + KERNEL_FLOOR_SLACK:
            problems.append(f"{what}: kernel {kernel:.1e} vs bf16 floor {floor:.1e} "
                            f"(limit {KERNEL_FLOOR_FACTOR:g} x floor + {KERNEL_FLOOR_SLACK:g})")
    return problems


def bf16_floor(subject: Subject) -> dict[str, float]:
    """The reference's own bf16 error at kernel_matches_reference's inputs, per compared tensor, on the CPU: how
    finely the property can tell a kernel from the reference (tests/test_mixer_contract.py bounds it)."""
    student, x = kernel_inputs(subject)
    reference = _layer_run(copy.deepcopy(student), x)
    floor = _layer_run(copy.deepcopy(student).to(torch.bfloat16), x.to(torch.bfloat16))
    return {what: relative(floor[what], ref) for what, ref in reference.items()}


def _layer_run(student: HarnessForCausalLM, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Layer 0's mixer on x: its output, the input's gradient and each parameter's, of mean(y^2)."""
    mixer = student.model.layers[0].mixer
    x = x.detach().requires_grad_(True)
    y, _ = mixer(x, position_embeddings=rope_for(student.config, x.device)(x[..., 0]))
    y.float().square().mean().backward()
    grads = {f"d{name}": p.grad for name, p in mixer.named_parameters() if p.grad is not None}
    return {"output": y.detach(), "dx": x.grad, **grads}


def zeroed_values_give_the_teacher(subject: Subject) -> Outcome:
    """The teacher with every v_proj (and its bias) zeroed, and its student (its mixers' further value projections
    zeroed too): logits within 1e-5 on 2 x 24 tokens."""
    teacher = copy.deepcopy(subject.teacher)
    with torch.no_grad():
        for layer in teacher.model.layers:
            layer.self_attn.v_proj.weight.zero_()
            if layer.self_attn.v_proj.bias is not None:
                layer.self_attn.v_proj.bias.zero_()
    student = subject.student(teacher)
    with torch.no_grad():
        for module in student.modules():
            if isinstance(module, Mixer):
                for name in module.value_projections:
                    for p in getattr(module, name).parameters():
                        p.zero_()
    ids = token_ids(2, 24, subject.seed, teacher.config.vocab_size)
    with torch.no_grad():
        gap = max_gap(student(ids).logits, teacher(ids).logits)
    problems = [] if gap <= LOGIT_ATOL else [f"logits differ by {gap:.1e} (limit {LOGIT_ATOL:.0e})"]
    return _outcome("zeroed_values_give_the_teacher", problems, f"logits max |diff| {gap:.1e}")


def cached_generate_equals_full_forwards(subject: Subject) -> Outcome:
    """Greedy decoding of 6 tokens after an 11-token prompt: `generate` (recurrent cache: the prompt at once, then
    one token per step) gives the tokens of 6 full forwards, and the logits it chose each token by are the full
    forward's within 1e-4."""
    student = subject.student()
    # no end of sequence: transformers fills the config's eos_token_id=None from the model's own (the tiny teacher's
    # 2), and min_new_tokens would then forbid token 2 to generate but not to the full forwards
    student.generation_config.eos_token_id = None
    prompt = token_ids(1, 11, subject.seed, student.config.vocab_size)
    new, start = 6, prompt.shape[1]
    with torch.no_grad():
        config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, num_beams=1,
                                  pad_token_id=PAD, eos_token_id=None, output_logits=True,
                                  return_dict_in_generate=True)
        generated = student.generate(prompt, generation_config=config)
        ids = prompt
        for _ in range(new):
            full = student(ids).logits
            ids = torch.cat([ids, full[:, -1:].argmax(-1)], 1)
    gap = max_gap(torch.stack(generated.logits, 1), full[:, start - 1:])
    problems = [] if torch.equal(generated.sequences, ids) else [
        f"generate gave {generated.sequences[0, start:].tolist()}, the full forwards {ids[0, start:].tolist()}"]
    if gap > 1e-4:
        problems.append(f"generate's logits differ from the full forwards' by {gap:.1e} (limit 1e-04)")
    return _outcome("cached_generate_equals_full_forwards", problems, f"cached vs full logits max |diff| {gap:.1e}")


def padding_left_and_right(subject: Subject) -> Outcome:
    """Prompts of 5, 13 and 22 tokens in one batch padded on the left, then on the right: each row's logits at its
    real tokens equal the row's alone within 1e-5, and after left padding each row's states (every tensor of every
    layer's) equal its own within 1e-5 + 1e-6 relative."""
    student = subject.student()
    prompts = [token_ids(1, n, subject.seed + i, student.config.vocab_size)[0] for i, n in enumerate(PROMPT_LENGTHS)]
    problems, gaps = [], {}
    with torch.no_grad():
        alone = [student(p[None], use_cache=True) for p in prompts]
        for side in ("left", "right"):
            ids, mask = padded(prompts, side)
            out = student(ids, attention_mask=mask, use_cache=True)
            gaps[side] = max(max_gap(real(out.logits[row], len(p), side), alone[row].logits[0])
                             for row, p in enumerate(prompts))
            if gaps[side] > LOGIT_ATOL:
                problems.append(f"{side} padding: a row's logits differ from its own by {gaps[side]:.1e}")
            if side == "left":
                gaps["state"] = state_gap(out.cache, [a.cache for a in alone])
    if gaps["state"] > 0:
        problems.append(f"left padding: a row's state is beyond 1e-5 + 1e-6 relative of its own by {gaps['state']:.1e}")
    numbers = f"logits max |diff| left {gaps['left']:.1e}, right {gaps['right']:.1e}"
    return _outcome("padding_left_and_right", problems, numbers)


def padded(prompts: list[torch.Tensor], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of the prompts padded with PAD on `side` ('left' or 'right'), and its mask."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        span = slice(width - len(p), width) if side == "left" else slice(0, len(p))
        ids[row, span], mask[row, span] = p, 1
    return ids, mask


def real(row_logits: torch.Tensor, n: int, side: str) -> torch.Tensor:
    """The last (left padding) or first (right padding) `n` positions of a padded row: its real tokens'."""
    return row_logits[-n:] if side == "left" else row_logits[:n]


def state_gap(batch_cache: Any, caches: list[Any]) -> float:
    """How far (beyond 1e-5 + 1e-6 |own|, so 0 when within) any row's state tensors in the batch's cache are from
    the row's own (`row_state`)."""
    worst = 0.0
    for row, own in enumerate(caches):
        for mine, theirs in zip(batch_cache.states, own.states):
            for a, b in zip(row_state(mine, row), row_state(theirs, 0), strict=True):
                if not b.is_floating_point():  # e.g. a window cache's mask of real tokens
                    excess = 0.0 if torch.equal(a, b) else float("inf")
                else:
                    excess = ((a - b).abs() - 1e-5 - 1e-6 * b.abs()).max().item()
                worst = max(worst, excess)
    return worst


def row_state(state: MixerState, row: int) -> list[torch.Tensor]:
    """One row's state tensors (batch 1, in `MixerState.tensors`' order); of a cache that marks its real slots (a
    `valid` field `[B, S]`: a sliding window's, fox's or path's growing KV cache) that row's real slots only, so that
    the slots left padding adds to a growing cache, or leaves empty in a window's, are not compared."""
    picked, out = state.map(lambda t: t[row:row + 1]), []
    for part in (picked.recurrent, picked.conv, picked.window):
        if "valid" in getattr(part, "_fields", ()):
            out += [t[:, part.valid[0]] for t in part]
        else:
            out += MixerState(part).tensors()
    return out


def save_load(subject: Subject) -> Outcome:
    """save_pretrained, then AutoModelForCausalLM.from_pretrained: a HarnessForCausalLM of this mixer and options
    whose logits on 2 x 21 tokens are the saved student's bit for bit."""
    student = subject.student()
    ids = token_ids(2, 21, subject.seed, student.config.vocab_size)
    with torch.no_grad(), tempfile.TemporaryDirectory() as folder, no_progress_bars():
        before = student(ids).logits
        student.save_pretrained(folder)
        loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
        after = loaded(ids).logits
    problems = []
    if not isinstance(loaded, HarnessForCausalLM) or loaded.config.mixer != subject.name:
        problems.append(f"loaded a {type(loaded).__name__} of mixer {getattr(loaded.config, 'mixer', None)!r}")
    if loaded.config.mixer_options != student.config.mixer_options:
        problems.append(f"options {loaded.config.mixer_options} came back for {student.config.mixer_options}")
    if not torch.equal(before, after):
        problems.append(f"logits differ by {max_gap(before, after):.1e} after loading")
    return _outcome("save_load", problems, f"logits max |diff| {max_gap(before, after):.1e}")


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """transformers' progress bars (saving and loading shards) off, as they were after."""
    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _outcome(name: str, problems: list[str], numbers: str) -> Outcome:
    return Outcome(name, FAIL, "; ".join(problems) + f" ({numbers})") if problems else Outcome(name, PASS, numbers)


PROPERTIES: dict[str, Callable[[Subject], Outcome]] = {
    fn.__name__: fn for fn in (chunked_equals_step, kernel_matches_reference, zeroed_values_give_the_teacher,
                               cached_generate_equals_full_forwards, padding_left_and_right, save_load)
}


def run_contract(name: str, options: Optional[dict[str, Any]] = None, only: Optional[list[str]] = None,
                 seed: int = 0) -> list[Outcome]:
    """Every property (or those named in `only`) of mixer `name` with `options`; one that raises is a FAIL naming
    the error and where it was raised. A ValueError names a bad mixer, option or property before anything runs."""
    unknown = sorted(set(only or ()) - set(PROPERTIES))
    if unknown:
        raise ValueError(f"unknown contract properties {unknown}; the properties: {', '.join(PROPERTIES)}")
    subject = Subject(name, dict(options or {}), seed=seed)
    return [_run_one(prop, check, subject) for prop, check in PROPERTIES.items() if not only or prop in only]


def _run_one(prop: str, check: Callable[[Subject], Outcome], subject: Subject) -> Outcome:
    try:
        return check(subject)
    except Exception as exc:  # a broken mixer fails the property it breaks, and the other properties still run
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        return Outcome(prop, FAIL, f"raised {type(exc).__name__}: {exc} (at {frame.filename}:{frame.lineno})")
