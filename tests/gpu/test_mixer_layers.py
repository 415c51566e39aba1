"""On CUDA: every mixer layer's kernel path (bf16) matches its PyTorch reference (fp32), outputs and gradients,
at the SmolLM2 head layouts and sequence 2048. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from harness.mixers import MIXERS, MixerShape, mixer_class, mixer_options

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

LAYOUTS = {
    "135M": MixerShape(hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64),
    "1.7B": MixerShape(hidden_size=2048, num_heads=32, num_kv_heads=32, head_dim=64),
}
# The kernel runs in bf16, so its error against the fp32 reference is compared with the error of the PyTorch
# reference itself run in bf16 (the bf16 floor): the kernel may not be much worse than that (docs/KERNELS.md).
FLOOR_FACTOR, FLOOR_SLACK = 2.0, 2e-3
# Gradients held to a looser slack, each with the measurement that set it: path's beta bias (one value per KV head,
# ~1.2e-5 at beta_bias -8, a sum over every token) came out of fla's parallel_path_attn backward one bf16 step off
# the fp32 reference in each entry, 4.8e-3 relative against a bf16 floor of 1.1e-3 (limit 4.3e-3; H100,
# 2026-12-07, 135M layout at 1,000 tokens; the 1.7B layout at 2,048 failed the same way, its value not kept).
PARAM_SLACK = {("path", "bt_proj.bias"): 1e-2}


def within_floor(kernel_err: float, floor_err: float) -> bool:
    return kernel_err <= FLOOR_FACTOR * floor_err + FLOOR_SLACK


def rel(a, b):
    """Relative error of a against b; the absolute error where b is exactly 0 (e.g. the gradient of the factor
    in front of an open gate's zero weights: it is 0 at step 0 on either path)."""
    diff, ref = (a.float() - b.float()).norm(), b.float().norm()
    return (diff / ref if ref > 0 else diff).item()


def run(layer, x):
    x = x.detach().requires_grad_(True)
    y, _ = layer(x)
    y.float().square().mean().backward()
    return y, x.grad


@pytest.mark.parametrize("layout, seq", [("135M", 2048), ("135M", 1000), ("1.7B", 2048)])
@pytest.mark.parametrize("name", list(MIXERS))
def test_kernel_layer_matches_reference(name, layout, seq):
    check_kernel_against_reference(name, LAYOUTS[layout], seq, {})


def _having(option: str) -> list[str]:
    return [name for name in MIXERS if option in mixer_options(name).__dataclass_fields__]


OTHER_INITS = ([(n, {"qkv_activation": "silu"}) for n in _having("qkv_activation")]
               + [(n, {"conv_init": "random"}) for n in _having("conv_init")]
               + [(n, {"gate_init": "random"}) for n in _having("gate_init")]
               # the decay gate's granularity: per group (chunk_kda) and per head (chunk_gated_delta_rule)
               + [("gated_deltanet", {"decay_group_size": 16}), ("gated_deltanet", {"decay_group_size": 1}),
                  ("kda", {"decay_group_size": 16}), ("kda", {"decay_group_size": 0})]
               # gated DeltaProduct: more steps with beta in (0, 2), and extra steps copied from the teacher
               + [("deltaproduct", {"num_householder": 3, "negative_eigenvalues": True}),
                  ("deltaproduct", {"householder_kv_init": "copy"})]
               # Mamba2's D = 1, and hedgehog's random or smaller feature maps
               + [("mamba2", {"d_init": "one"}), ("hedgehog", {"feature_init": "random"}),
                  ("hedgehog", {"feature_dim": 32})]
               # the speed options: compiled PyTorch forms of the conv and the gated norm, three q/k/v matmuls
               + [(n, {"pieces": "compiled"}) for n in ("gated_deltanet", "kda", "gla", "deltanet", "mamba2")]
               + [("gated_deltanet", {"pieces": "compiled-norm"})]
               + [(n, {"fused_qkv": False}) for n in _having("fused_qkv")])  # three matmuls (the default: one)


@pytest.mark.parametrize("name, options", OTHER_INITS)
def test_kernel_layer_matches_reference_under_the_other_init_options(name, options):
    """The options docs/TRANSFER.md compares change the fused operators (convolution without SiLU, a random gate),
    the decay gate's granularity changes the fla route (docs/RECURRENCES.md, "Decay granularity"), and the speed
    options (`pieces`, `fused_qkv`) change what runs around the recurrence."""
    check_kernel_against_reference(name, LAYOUTS["135M"], 2048, options)


def check_kernel_against_reference(name, shape, seq, options):
    options = {"rope": False, **options}  # a layer alone, without a model's position embeddings (fox's default: on)
    torch.manual_seed(0)
    kernel = mixer_class(name)(shape, mixer_options(name, {"backend": "kernel", **options}))
    kernel.reset_new_parameters()
    with torch.no_grad():
        for proj in (kernel.q_proj, kernel.k_proj, kernel.v_proj, kernel.o_proj):
            proj.weight.normal_(0, shape.hidden_size**-0.5)
    ref = mixer_class(name)(shape, mixer_options(name, {"backend": "reference", **options}))
    ref.load_state_dict(kernel.state_dict())
    floor = mixer_class(name)(shape, mixer_options(name, {"backend": "reference", **options}))
    floor.load_state_dict(kernel.state_dict())
    kernel, ref, floor = kernel.cuda().bfloat16(), ref.cuda().float(), floor.cuda().bfloat16()
    x = torch.randn(2, seq, shape.hidden_size, device="cuda", dtype=torch.bfloat16)
    yk, dxk = run(kernel, x)
    yr, dxr = run(ref, x.float())
    yf, dxf = run(floor, x)
    assert rel(yk, yr) < 2e-2 and within_floor(rel(yk, yr), rel(yf, yr))
    assert within_floor(rel(dxk, dxr), rel(dxf, dxr))
    ref_params, floor_params = dict(ref.named_parameters()), dict(floor.named_parameters())
    for n, p in kernel.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
        err, floor_err = rel(p.grad, ref_params[n].grad), rel(floor_params[n].grad, ref_params[n].grad)
        assert err <= FLOOR_FACTOR * floor_err + PARAM_SLACK.get((name, n), FLOOR_SLACK), (n, err, floor_err)


@pytest.mark.parametrize("name", list(MIXERS))
def test_kernel_prefill_state_continues_with_reference_steps(name):
    """The kernel's final state is the reference's state: decoding after a kernel prefill stays right."""
    shape = LAYOUTS["135M"]
    torch.manual_seed(0)
    layer = mixer_class(name)(shape, mixer_options(name, {"backend": "kernel", "rope": False})).cuda().float()
    layer.reset_new_parameters()
    x = torch.randn(1, 200, shape.hidden_size, device="cuda")
    with torch.no_grad():
        layer.options.backend = "reference"
        full, _ = layer(x)
        layer.options.backend = "kernel"
        _, state = layer(x[:, :192], use_cache=True)
        steps = []
        for t in range(192, 200):
            y, state = layer(x[:, t : t + 1], state=state, use_cache=True)
            steps.append(y)
    assert rel(torch.cat(steps, 1), full[:, 192:]) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_short_conv_matches_pytorch_conv(dtype):
    """fla's Triton causal-conv1d (the kernel backend's short convolution) and the compiled shifted form
    (`pieces: compiled`) == PyTorch's conv1d + SiLU: output, input and weight gradients, and the decoding tail."""
    from harness.mixers.base import ShortConv

    torch.manual_seed(0)
    conv = ShortConv(3 * 576, kernel_size=4).cuda().to(dtype)
    x = torch.randn(4, 2048, 3 * 576, device="cuda", dtype=dtype)
    outs = {}
    for fused in (False, "fla", "compiled"):
        xi = x.clone().requires_grad_(True)
        conv.zero_grad()
        y, tail = conv(xi, fused=fused)
        (y.float() * torch.linspace(-1, 1, y.shape[-1], device="cuda")).sum().backward()
        outs[fused] = (y, xi.grad, conv.conv.weight.grad.clone(), tail)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for how in ("fla", "compiled"):
        for a, b in zip(outs[how][:3], outs[False][:3]):
            assert rel(a, b) < tol, (how, rel(a, b))
        assert torch.equal(outs[how][3], outs[False][3])


@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_gated_norm_matches_pytorch(activation, dtype):
    """fla's Triton gated RMSNorm (the kernel backend's output norm of gla, retnet, gated_deltanet, kda) and the
    compiled PyTorch form (`pieces: compiled`) == the PyTorch form: output, and the gradients of the input, the gate
    and the weight."""
    from harness.mixers.base import HeadRMSNorm

    torch.manual_seed(0)
    norm = HeadRMSNorm(64, activation=activation).cuda()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    o = torch.randn(4, 2048, 9, 64, device="cuda", dtype=dtype)
    gate = torch.randn_like(o)
    outs = {}
    for fused in (False, "fla", "compiled"):
        oi, gi = o.clone().requires_grad_(True), gate.clone().requires_grad_(True)
        norm.zero_grad()
        y = norm(oi, gi, fused=fused)
        (y.float() * torch.linspace(-1, 1, y.shape[-1], device="cuda")).sum().backward()
        outs[fused] = (y, oi.grad, gi.grad, norm.weight.grad.clone())
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    for how in ("fla", "compiled"):
        assert outs[how][0].dtype == dtype
        for a, b in zip(outs[how], outs[False]):
            assert rel(a, b) < tol, (how, rel(a, b))


def test_fused_student_block_matches_the_pytorch_block():
    """A student block on the kernel backend runs its norms (the second with the residual add) and its SwiGLU as
    fla's fused kernels. In bf16 it must be as close to an fp32 PyTorch block (reference backend) as the same bf16
    block through LlamaRMSNorm's and LlamaMLP's PyTorch forwards is (the bf16 floor, as for the mixer layers):
    output and gradients of the input, the norm weights and the MLP weights, at the 135M layout and 2 x 2048."""
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    from harness.bench.shapes import SHAPES
    from harness.student import HarnessConfig, StudentBlock

    torch.manual_seed(0)
    config = HarnessConfig(**SHAPES["135M"], mixer="gated_deltanet", mixer_options={"backend": "kernel"})
    block = StudentBlock(config, 0)
    with torch.no_grad():
        for norm in (block.input_layernorm, block.post_attention_layernorm):
            norm.weight.uniform_(0.5, 1.5)
    ref_config = HarnessConfig(**SHAPES["135M"], mixer="gated_deltanet", mixer_options={"backend": "reference"})
    ref = StudentBlock(ref_config, 0)
    ref.load_state_dict(block.state_dict())
    block, ref = block.to("cuda", torch.bfloat16), ref.to("cuda", torch.float32)

    def pytorch_block(b, h):
        mixed, _ = b.mixer(LlamaRMSNorm.forward(b.input_layernorm, h))
        h = h + mixed
        return h + LlamaMLP.forward(b.mlp, LlamaRMSNorm.forward(b.post_attention_layernorm, h))

    names = ("input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
             "mlp.up_proj.weight", "mlp.down_proj.weight")
    x = torch.randn(2, 2048, config.hidden_size, device="cuda")

    def run_block(b, forward, dtype):
        b.zero_grad()
        xi = x.to(dtype).requires_grad_(True)
        y = forward(xi)
        (y.float() * torch.linspace(-1, 1, y.shape[-1], device="cuda")).sum().backward()
        params = dict(b.named_parameters())
        return [y, xi.grad] + [params[n].grad.clone() for n in names]

    fused = run_block(block, lambda h: block(h)[0], torch.bfloat16)
    floor = run_block(block, lambda h: pytorch_block(block, h), torch.bfloat16)
    want = run_block(ref, lambda h: pytorch_block(ref, h), torch.float32)
    assert fused[0].dtype == torch.bfloat16
    errors = {n: (rel(f, w), rel(p, w)) for n, f, p, w in zip(("output", "input grad") + names, fused, floor, want)}
    print({n: f"fused {e[0]:.2e} floor {e[1]:.2e}" for n, e in errors.items()})
    assert all(within_floor(*e) for e in errors.values()), errors
