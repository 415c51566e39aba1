"""The one training loop (harness.train) against the loops it replaced, on the tiny CPU pipeline (fp32):

- stage 3 on the plain engine and SFT on DeepSpeed and on the plain engine give the losses, gradient norms,
  validations and weights that the code before harness.train gave (BEFORE, pinned below: measured with that code,
  same jobs and seeds);
- `harness bench --what step` and stage 3 run the same step: patching `Trainer.train_step` changes both;
- every loss term is logged under its name: reverse_kl from the job's config (with the pinned losses of that job)
  in metrics.jsonl, TensorBoard and the training summary of `harness report`, and a term registered in code in
  metrics.jsonl and TensorBoard.

The stages run in this process, in one one-process gloo group (as `python -m harness.cli` makes). Data parallel,
SIGKILL and old checkpoints on the plain engine: tests/test_plain_engine_runs.py.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness.config import load_job
from harness.eval.training import training_summary
from tests.test_distill import CONDITIONED, REPO, student_weights, write_job

HARNESS = REPO / "harness"

PLAIN = ["deepspeed.student_engine=plain", "deepspeed.teacher_placement=replicated", *CONDITIONED]

# Measured with the loops before harness.train (stage 3's in harness/stages/distill.py, SFT's in harness/stages/sft.py,
# the plain engine of harness/engine.py with its own collectives) on the jobs of the tests below: (step, loss, ce,
# kl, grad_norm) per optimizer step, (step, val_ce, val_kl, val_ppl) per validation, and the exported student's
# `weight_summary`.
BEFORE = {
    "distill": {
        "train": [(1, 5.798527956008911, 5.773142337799072, 0.025385609827935696, 4.107166767120361),
                  (2, 5.7544567584991455, 5.729502439498901, 0.02495444566011429, 3.7626490592956543),
                  (3, 5.761388063430786, 5.737823724746704, 0.023564446717500687, 3.675084352493286),
                  (4, 5.728243827819824, 5.703434944152832, 0.024808889254927635, 3.8542802333831787),
                  (5, 5.718487977981567, 5.694609880447388, 0.023878317326307297, 3.8337905406951904),
                  (6, 5.699748754501343, 5.6740500926971436, 0.025698615238070488, 4.107740879058838),
                  (7, 5.672485589981079, 5.648014783859253, 0.024470691569149494, 4.452555179595947),
                  (8, 5.626952409744263, 5.603442907333374, 0.023509468883275986, 3.671311378479004),
                  (9, 5.638858795166016, 5.613464832305908, 0.025393780320882797, 3.674248456954956)],
        "val": [(4, 5.717344284057617, 0.023993690498173237, 304.09625244140625),
                (8, 5.619940519332886, 0.02453671768307686, 275.873046875),
                (9, 5.616075754165649, 0.02458418905735016, 274.80877685546875)],
        "weights": (52.15761817911857, 579.8449672404711, -75.85163657484308),
    },
    "terms": {
        "train": [(1, 5.772410869598389, 5.751398086547852, 0.026197640225291252, 6.29348611831665),
                  (2, 5.793434143066406, 5.77409029006958, 0.02409089356660843, 6.890050411224365),
                  (3, 5.682523250579834, 5.663359642028809, 0.02385629341006279, 5.065498352050781),
                  (4, 5.7794365882873535, 5.758939743041992, 0.025517061352729797, 5.776575088500977),
                  (5, 5.735426902770996, 5.716465473175049, 0.023613855242729187, 5.821047306060791),
                  (6, 5.734295845031738, 5.715597629547119, 0.023271119222044945, 5.273464679718018),
                  (7, 5.69569206237793, 5.676037788391113, 0.024453293532133102, 5.385898590087891),
                  (8, 5.710937023162842, 5.691027641296387, 0.024773942306637764, 6.738874912261963),
                  (9, 5.675017356872559, 5.655313491821289, 0.02449854649603367, 5.059055805206299)],
        "val": [(9, 5.670322418212891, 0.02413844410330057, 290.1280517578125)],
        "weights": (52.15379639906543, 581.7295933832615, -79.2636585652034),
    },
    "sft": {
        "train": [(1, 5.777311247448589, None, None, 8.98317072902765),
                  (2, 5.486927441188267, None, None, 6.2860240142657995),
                  (3, 5.254196453094482, None, None, 4.4151383213667525),
                  (4, 5.146539547864129, None, None, 4.055435284581085)],
        "val": [(4, 5.110540512280586, None, 165.75990295410156)],
        "weights": (60.70180542797995, 1659.5906537794135, -64.36395103301115),
    },
}
TERMS = ["stages.distill.losses=[{name: kl, weight: 0.5, temperature: 2}, {name: reverse_kl, weight: 0.3, "
         "temperature: 1.5}, {name: ce, weight: 1}]", "stages.distill.tokens=576"]  # 9 steps


def rows(out: Path, stage: str = "distill") -> list[dict]:
    return [json.loads(line) for line in (out / stage / "metrics.jsonl").read_text().splitlines()]


def weight_summary(weights: dict[str, torch.Tensor]) -> tuple[float, float, float]:
    """(2-norm of all weights, their sum, the sum of each tensor's dot product with a fixed random vector): any
    change of a weight beyond rounding moves the last."""
    norms, sums, dots = [], [], []
    for _, t in sorted(weights.items()):
        t = t.double().flatten()
        r = torch.randn(t.numel(), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        norms.append(t.norm().item() ** 2)
        sums.append(t.sum().item())
        dots.append((t * r).sum().item())
    return math.sqrt(sum(norms)), sum(sums), sum(dots)


def assert_as_before(case: str, logged: list[dict], weights: dict[str, torch.Tensor]) -> None:
    """Today's tolerances: losses rel 1e-5 (the plain engine against plain PyTorch, tests/test_distill.py), the KL
    within 1e-5 of the loss and the perplexity within the loss's rounding, gradient norms rel 1e-3, the weights'
    summaries rel 5e-5."""
    want = BEFORE[case]
    train = [(r["step"], r["loss"], r.get("ce"), r.get("kl"), r["grad_norm"]) for r in logged if "loss" in r]
    assert [t[0] for t in train] == [w[0] for w in want["train"]]
    for got, exp in zip(train, want["train"]):
        assert close(got[1:3], exp[1:3], 1e-5), (got, exp)
        # the KL is a small difference of log-probabilities of the loss's size: its rounding is the loss's, not its own
        assert exp[3] is None or got[3] == pytest.approx(exp[3], abs=1e-5 * exp[1]), (got, exp)
        assert got[4] == pytest.approx(exp[4], rel=1e-3), got[0]
    val = [(r["step"], r.get("val_ce"), r.get("val_kl"), r["val_ppl"]) for r in logged if "val_ppl" in r]
    assert [v[0] for v in val] == [w[0] for w in want["val"]]
    for got, exp in zip(val, want["val"]):
        assert close(got[1:2], exp[1:2], 1e-5), (got, exp)
        if exp[2] is not None:
            assert got[2] == pytest.approx(exp[2], abs=1e-5 * exp[1]), (got, exp)
        # perplexity = exp(loss): its relative rounding is the loss's absolute one
        assert got[3] == pytest.approx(exp[3], rel=1e-5 * math.log(exp[3])), (got, exp)
    # 5e-5: these sums of rounded terms moved 1.1e-5 (the dot product) between two CPUs of the same code
    assert weight_summary(weights) == pytest.approx(want["weights"], rel=5e-5)


def close(got: tuple, expected: tuple, rel: float) -> bool:
    """Each value within `rel` of the one before, where there was one (SFT logged no ce before)."""
    return all(e is None or g == pytest.approx(e, rel=rel) for g, e in zip(got, expected))


def distill(job_path: Path, **kwargs) -> None:
    from harness.stages.distill import distill as stage_3

    stage_3(load_job(job_path, []), **kwargs)


def test_stage_3_gives_the_losses_and_weights_of_the_loop_before(tmp_path, one_process_group):
    """The plain engine, micro-batch 2 x 2 accumulated, validation every 4 steps: what the loop before gave."""
    out = tmp_path / "run"
    distill(write_job(tmp_path, out, *PLAIN, "stages.distill.grad_accum=2", "run.validate_every_steps=4"))
    assert_as_before("distill", rows(out), student_weights(out))


def test_every_loss_term_is_logged_by_name_with_the_losses_before(tmp_path, one_process_group):
    """kl, reverse_kl and ce from the job's config: loss, kl and ce as before (reverse_kl was trained but not logged
    then), reverse_kl in every log line, val_reverse_kl, all of them in TensorBoard and in the training summary."""
    out = tmp_path / "run"
    distill(write_job(tmp_path, out, *PLAIN, *TERMS))
    logged = rows(out)
    assert_as_before("terms", logged, student_weights(out))
    train = [r for r in logged if "loss" in r]
    assert all(r["loss"] == pytest.approx(0.5 * r["kl"] + 0.3 * r["reverse_kl"] + r["ce"], rel=1e-5) for r in train)
    assert all(r["reverse_kl"] > 0 and r["loss_terms"] == ["kl", "reverse_kl", "ce"] for r in train)
    assert "val_reverse_kl" in logged[-1]
    tags = tensorboard_tags(out / "distill" / "tb")
    assert {"distill/loss", "distill/kl", "distill/reverse_kl", "distill/ce", "distill/val_reverse_kl"} <= tags
    final = training_summary(out)["final"]["distill"]  # what `harness report` tabulates
    assert final["terms"] == ["ce", "kl", "reverse_kl"]
    tail = [r["reverse_kl"] for r in train if r["step"] >= 0.9 * train[-1]["step"]]  # the logged last tenth
    assert final["reverse_kl"] == pytest.approx(sum(tail) / len(tail))
    assert final["val_reverse_kl"] == logged[-1]["val_reverse_kl"]


def tensorboard_tags(folder: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return set(events.Tags()["scalars"])


# ------------------------------------------------------------------------------ SFT


@pytest.fixture(scope="module")
def chat_setting(tmp_path_factory) -> dict:
    """tests/test_sft.py's setting: the tiny teacher, 160 chat conversations, the tiny chat template."""
    from tests.test_sft import TEMPLATE, conversations, make_setting

    root = tmp_path_factory.mktemp("chat_setting")
    teacher_dir, _ = make_setting(root)
    chats = root / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations(160, seed=3)))
    template = root / "tiny.jinja"
    template.write_text(TEMPLATE)
    return {"root": root, "teacher": teacher_dir, "chats": chats, "template": template}


@pytest.mark.parametrize("engine", ["deepspeed", "plain"])
def test_sft_gives_the_losses_and_weights_of_the_loop_before(chat_setting, tmp_path, one_process_group,
                                                             engine):
    """SFT, 2 accumulated micro-batches, on DeepSpeed ZeRO-3 (its engine before) and on the plain engine (which the
    loop before did not run SFT on; fp32 here, where both engines compute the same): what its loop before gave on
    DeepSpeed. Its lines now also carry ce (the one term)."""
    from harness.stages.sft import sft
    from tests.test_sft import write_job as sft_job

    out = tmp_path / "run"
    sft(load_job(sft_job(chat_setting, tmp_path, out, "stages.sft.grad_accum=2",
                         f"deepspeed.student_engine={engine}"), []))
    logged = rows(out, "sft")
    assert_as_before("sft", logged, load_file(out / "student-sft" / "model.safetensors"))
    assert all(r["ce"] == r["loss"] and r["loss_terms"] == ["ce"] for r in logged if "loss" in r)
    assert (out / "sft" / "checkpoints" / "latest").is_file()
    wrote = [p.relative_to(out) for p in (out / "sft" / "checkpoints").glob("step-*/ds/plain_engine.pt")]
    assert bool(wrote) == (engine == "plain")


# ------------------------------------------------------------------------------ host reads


class TinyLM(torch.nn.Module):
    """An embedding and an output head under SFT's loss: what the loop needs of a student, and nothing more."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11, bias=False)

    def forward(self, ids: torch.Tensor):
        from harness.losses import lm_loss

        return lm_loss(self.embed(ids), self.head.weight, ids)


def test_an_optimizer_step_reads_its_loss_terms_to_the_host_once(monkeypatch):
    """Four accumulated micro-steps: the terms stay on the device until the step's one `.tolist()` (no `.item()`,
    `float()` or `.tolist()` per micro-step), and the step's losses are the token-weighted means of the micro-steps."""
    from harness.engine import PlainEngine
    from harness.train import Trainer

    torch.manual_seed(0)
    engine = PlainEngine(TinyLM(), {"gradient_accumulation_steps": 4},
                         lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), torch.device("cpu"))
    trainer = Trainer(engine, lambda batch: engine(batch["input_ids"]), grad_accum=4, world=1)
    g = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(0, 11, (2, 6), generator=g)} for _ in range(8)]
    with torch.no_grad():
        expected = [sum(TinyLM.forward(engine.module, b["input_ids"]).total for b in batches[:4]).item() / 4]
    reads = []  # (method, the harness module that called it); torch's own CPU AdamW reads its step counts too

    def counted(method):
        original = getattr(torch.Tensor, method)

        def read(self, *args, **kwargs):
            caller = Path(sys._getframe(1).f_code.co_filename)
            if caller.is_relative_to(HARNESS):
                reads.append((method, caller.relative_to(HARNESS.parent).as_posix()))
            return original(self, *args, **kwargs)
        return read

    for method in ("item", "tolist", "__float__"):
        monkeypatch.setattr(torch.Tensor, method, counted(method))
    stream = iter(batches)
    first, second = trainer.train_step(stream), trainer.train_step(stream)
    monkeypatch.undo()
    assert reads == [("tolist", "harness/train/trainer.py")] * 2
    assert first["loss"] == pytest.approx(expected[0], rel=1e-6) and first["ce"] == first["loss"]
    assert second["loss"] != first["loss"] and engine.micro_steps == 8 and trainer.train_step(stream) is None


# ------------------------------------------------------------------------------ one step for the bench and stage 3


def test_the_step_bench_and_stage_3_run_the_same_step(tmp_path, one_process_group, monkeypatch):
    """One patch of harness.train.Trainer.train_step (a marker term added to its losses) shows in both the bench's
    row and stage 3's metrics.jsonl."""
    from harness.bench.step import bench_step
    from harness.train import Trainer

    calls = {"n": 0}
    original = Trainer.train_step

    def patched(self, batches):
        calls["n"] += 1
        result = original(self, batches)
        return None if result is None else {**result, "patched": 42.0}

    monkeypatch.setattr(Trainer, "train_step", patched)
    row = bench_step("tiny", "gated_deltanet", micro_batch=2, seq_len=32, steps=2, warmup=1, device="cpu",
                     zero3=False, profile_steps=0, options={"chunk_size": 16})
    assert calls["n"] == 3 and row["losses_last"]["patched"] == 42.0  # warm-up + 2 measured steps
    out = tmp_path / "run"
    distill(write_job(tmp_path, out, *PLAIN, "run.log_every_steps=1"), stop_after_steps=2)
    assert calls["n"] == 3 + 2 and [r["patched"] for r in rows(out) if "loss" in r] == [42.0, 42.0]


# ------------------------------------------------------------------------------ a term registered in code


def test_a_registered_loss_term_appears_in_metrics_and_tensorboard(tmp_path, one_process_group,
                                                                   monkeypatch):
    """A term registered in code (half the CE), added to stage 3's terms at weight 0.5: logged by name in every
    line and validation, in TensorBoard, and trained (in the total)."""
    from harness.losses import CrossEntropy, register_token_loss
    from harness.losses.chunked import TOKEN_LOSSES
    from harness.stages import distill as stage

    class HalfCE(CrossEntropy):
        name = "half_ce"

        def chunk(self, s, t, y, need_grad):
            total, grad = super().chunk(s, t, y, need_grad)
            return total / 2, None if grad is None else grad / 2

    monkeypatch.setitem(TOKEN_LOSSES, "half_ce", HalfCE)  # recorded as absent first, so removed again afterwards
    assert register_token_loss(HalfCE) is HalfCE  # registering the class that is there already is allowed
    job_terms = stage.job_loss_terms
    monkeypatch.setattr(stage, "job_loss_terms", lambda job: [*job_terms(job), HalfCE(0.5)])
    out = tmp_path / "run"
    distill(write_job(tmp_path, out, *PLAIN, "run.validate_every_steps=2"), stop_after_steps=3)
    train = [r for r in rows(out) if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    for r in train:
        assert r["half_ce"] == pytest.approx(r["ce"] / 2, rel=1e-6)
        assert r["loss"] == pytest.approx(r["kl"] + r["ce"] + 0.5 * r["half_ce"], rel=1e-5)  # it is trained too
    assert [r["val_half_ce"] for r in rows(out) if "val_ce" in r] == pytest.approx(
        [r["val_ce"] / 2 for r in rows(out) if "val_ce" in r], rel=1e-6)
    assert {"distill/half_ce", "distill/val_half_ce"} <= tensorboard_tags(out / "distill" / "tb")
