"""Stage 3's per-layer hidden-state term (`stages.distill.hidden_weight`): the relative squared error against a
direct computation, the layer outputs the teacher's hooks and the student's body record against transformers' own
hidden states, a student that is its teacher (the teacher's v_proj zeroed) at a term of 0 in every layer, the term
in the trained total, the compiled teacher's recording, and the key through a real stage 3."""

from __future__ import annotations

import copy

import pytest
import torch

import harness
from harness.losses import LossTerms, RelativeMSE
from harness.stages.distill import DistillForward, DistillModel, TeacherBody, hidden_term, with_hidden_term
from tests.tiny import tiny_llama


def _teacher(zero_values: bool = False):
    teacher = copy.deepcopy(tiny_llama(num_layers=3, hidden=64, heads=4, kv_heads=2, vocab=128, seed=0)).float()
    if zero_values:
        with torch.no_grad():
            for layer in teacher.model.layers:
                layer.self_attn.v_proj.weight.zero_()
    return teacher.eval()


def _ids(rows: int = 2, length: int = 12) -> torch.Tensor:
    return torch.randint(0, 128, (rows, length), generator=torch.Generator().manual_seed(1))


def test_relative_mse_is_each_tokens_squared_error_over_its_squared_norm_averaged():
    g = torch.Generator().manual_seed(0)
    pred, target = torch.randn(3, 5, 8, generator=g), torch.randn(3, 5, 8, generator=g)
    target[0, 0] *= 1000  # a token of huge norm (a row's first) counts as one token, not as most of the sum
    loss = RelativeMSE()
    errors = [((pred[b, i] - target[b, i]).double() ** 2).sum() / (target[b, i].double() ** 2).sum()
              for b in range(3) for i in range(5)]
    assert loss(pred, target).item() == pytest.approx((sum(errors) / 15).item(), rel=1e-6)
    assert loss(target, target).item() == 0.0
    assert loss(torch.zeros_like(target), target).item() == pytest.approx(1.0)


def test_hidden_term_averages_the_layers_over_the_kept_positions():
    g = torch.Generator().manual_seed(0)
    student = [torch.randn(2, 4, 8, generator=g) for _ in range(3)]
    teacher = [torch.randn(2, 4, 8, generator=g) for _ in range(3)]
    keep = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])

    def direct(s, t):  # the kept tokens: row 0's first three, row 1's first two
        kept = [(b, i) for b, n in enumerate((3, 2)) for i in range(n)]
        return sum((s[b, i] - t[b, i]).pow(2).sum() / t[b, i].pow(2).sum() for b, i in kept) / len(kept)

    expected = sum(direct(s, t) for s, t in zip(student, teacher)) / 3
    assert hidden_term(student, teacher, keep).item() == pytest.approx(expected.item(), rel=1e-6)
    assert hidden_term(student, teacher).item() == pytest.approx(
        sum(RelativeMSE()(s, t) for s, t in zip(student, teacher)).item() / 3, rel=1e-6)
    moved = [s.clone() for s in student]
    moved[0][0, 3] += 100.0  # a padded position: not compared
    assert hidden_term(moved, teacher, keep).item() == pytest.approx(expected.item(), rel=1e-6)
    with pytest.raises(ValueError, match="2 student layer outputs against 3"):
        hidden_term(student[:2], teacher)


def test_the_teacher_body_records_each_decoder_layers_output():
    """The hooks record what transformers calls the hidden states after each layer (its last entry is after the final
    norm, which the recorded last layer output gives); without layer_outputs the body returns the final states."""
    teacher, ids = _teacher(), _ids()
    with torch.no_grad():
        reference = teacher.model(input_ids=ids, output_hidden_states=True)
        last, layers = TeacherBody(teacher, layer_outputs=True)(ids)
        again = TeacherBody(teacher, layer_outputs=True)(ids)[1]  # a second call records afresh
        plain = TeacherBody(copy.deepcopy(teacher))(ids)
    assert len(layers) == 3 and len(again) == 3
    for recorded, expected in zip(layers[:-1], reference.hidden_states[1:-1]):
        torch.testing.assert_close(recorded, expected, rtol=0, atol=0)
    torch.testing.assert_close(teacher.model.norm(layers[-1]), reference.last_hidden_state)
    torch.testing.assert_close(last, reference.last_hidden_state, rtol=0, atol=0)
    torch.testing.assert_close(plain, reference.last_hidden_state, rtol=0, atol=0)


def test_a_student_that_is_its_teacher_has_a_hidden_term_of_zero_and_one_that_is_not_has_one_in_each_layer():
    """With the teacher's v_proj zeroed every attention and mixer output is 0, so each student block computes the
    teacher layer of the same index: the term is 0 to rounding (a layer off by one would not be). With the values
    back, the mixers differ from softmax attention and the term is positive."""
    ids = _ids()
    for zero_values in (True, False):
        teacher = _teacher(zero_values)
        torch.manual_seed(0)
        student = harness.build_student(teacher, "gated_deltanet", backend="reference").float().eval()
        layers: list[torch.Tensor] = []
        with torch.no_grad():
            final = student.model(ids, layer_outputs=layers)
            _, t_layers = TeacherBody(teacher, layer_outputs=True)(ids)
        assert len(layers) == 3
        torch.testing.assert_close(student.model.norm(layers[-1]), final)
        per_layer = [RelativeMSE()(s, t).item() for s, t in zip(layers, t_layers)]
        if zero_values:
            assert max(per_layer) < 1e-10
        else:
            assert min(per_layer) > 1e-6


def test_the_term_joins_the_trained_total_at_its_weight_and_is_logged_as_hidden():
    teacher, ids = _teacher(), _ids()
    torch.manual_seed(0)
    student = harness.build_student(teacher, "gated_deltanet", backend="reference").float()
    body = TeacherBody(teacher, layer_outputs=True)
    with torch.no_grad():
        t_last, t_layers = body(ids)
    head = teacher.lm_head.weight
    plain = DistillModel(student, _terms())(ids, t_last, head)
    weighted = DistillModel(student, _terms(), hidden_weight=0.5)(ids, t_last, head, teacher_layers=t_layers)
    assert set(weighted.terms) == set(plain.terms) | {"hidden"}
    assert weighted.total.item() == pytest.approx(plain.total.item() + 0.5 * weighted.terms["hidden"].item(), rel=1e-6)
    assert weighted.tokens == plain.tokens
    weighted.total.backward()  # the term's gradient reaches the first block's mixer
    assert student.model.layers[0].mixer.q_proj.weight.grad.abs().sum() > 0
    summed = with_hidden_term(LossTerms(torch.tensor(1.0), {"kl": torch.tensor(0.2)}, 4), torch.tensor(0.3), 2.0)
    assert summed.total.item() == pytest.approx(1.6) and summed.terms["hidden"].item() == pytest.approx(0.3)


def _terms():
    from harness.config import DistillConfig
    from harness.losses import token_losses

    return token_losses(DistillConfig().loss_terms())


def test_the_stage_3_forward_passes_the_teachers_layers_and_the_chat_mask_only_with_the_term():
    seen = {}

    class Student:  # an engine's call
        device = torch.device("cpu")

        def __call__(self, *args):
            seen["args"] = args
            return args[1].sum()

    ids = _ids()
    mask = torch.ones_like(ids)
    DistillForward(Student(), lambda i: (i.float(), ["layers"]), torch.nn.Parameter(torch.ones(2)))(
        {"input_ids": ids, "attention_mask": mask})
    assert seen["args"][5] == ["layers"] and seen["args"][6] is mask
    DistillForward(Student(), lambda i: i.float(), torch.nn.Parameter(torch.ones(2)))({"input_ids": ids})
    assert len(seen["args"]) == 5


def test_compiled_teacher_layers_record_their_outputs_in_one_graph():
    """Stage 3 compiles a replicated teacher's layers on a GPU (compile_teacher), the hidden-state term's recording
    hooks included; here on the CPU: the compiled body records what the eager body records, every call afresh, and
    the layers still share one graph (no recompilation per layer for the hook's list)."""
    from torch._dynamo.utils import counters

    from harness.engine import compile_decoder_layers

    torch.manual_seed(0)
    body = TeacherBody(tiny_llama(num_layers=3, hidden=64, heads=4, kv_heads=2), layer_outputs=True).eval()
    ids = torch.randint(0, 50, (2, 24))
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        want_last, want_layers = body(ids)
        assert compile_decoder_layers(body) == 3
        got_last, got_layers = body(ids)
        again = body(ids)[1]
    torch.testing.assert_close(got_last, want_last, rtol=1e-5, atol=1e-5)
    assert len(got_layers) == len(again) == 3
    for got, want in zip(got_layers, want_layers):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch._dynamo.reset()


@pytest.mark.parametrize("engines", [
    ["deepspeed.student_engine=plain", "deepspeed.teacher_placement=replicated"],
    ["deepspeed.teacher_placement=zero3"],  # ZeRO-3 student and teacher, every parameter sharded
], ids=["plain-replicated", "zero3"])
def test_a_job_with_hidden_weight_trains_and_logs_the_term_in_stage_3(tmp_path, engines):
    """The key through `harness stage distill`: every logged step and the held-out validation carry 'hidden', the
    loss is the next-token terms plus the weighted term, and the term falls over the stage."""
    from tests.test_distill import _rows, launch, write_job

    out = tmp_path / "run"
    launch(write_job(tmp_path, out, *engines, "stages.distill.hidden_weight=2.0", "run.validate_every_steps=4"))
    rows = [r for r in _rows(out) if "loss" in r]
    assert len(rows) >= 5 and all("hidden" in r for r in rows)
    assert all(r["loss"] == pytest.approx(r["kl"] + r["ce"] + 2.0 * r["hidden"], rel=1e-5) for r in rows)
    assert rows[-1]["hidden"] < rows[0]["hidden"]
    assert any("val_hidden" in r for r in _rows(out))
    assert (out / "student" / "config.json").is_file()


def test_recomputed_blocks_train_the_term_as_kept_activations_do(tmp_path):
    """With gradient_checkpointing the recorded block outputs come out of the recomputed blocks: the same logged
    losses and hidden terms step by step as with every activation kept (the term's gradient flows through them)."""
    from tests.test_distill import _rows, launch, write_job

    common = ["deepspeed.student_engine=plain", "deepspeed.teacher_placement=replicated",
              "stages.distill.hidden_weight=2.0"]
    kept, recomputed = tmp_path / "kept", tmp_path / "recomputed"
    launch(write_job(tmp_path, kept, *common))
    launch(write_job(tmp_path, recomputed, *common, "stages.distill.gradient_checkpointing=true"))
    a, b = ([r for r in _rows(out) if "loss" in r] for out in (kept, recomputed))
    assert len(a) == len(b) >= 5
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5) and y["hidden"] == pytest.approx(x["hidden"], rel=1e-5)
