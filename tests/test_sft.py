"""SFT and instruction-aware distillation: assistant-token masks from the chat template, the template round trip,
no recurrent state across conversations, token-weighted losses, ZeRO-3 runs that match plain PyTorch and resume
exactly, the offline instruction data and the configuration errors."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from safetensors.torch import load_file

import harness
from harness.config import ConfigError, load_job
from harness.data.chat import (IGNORE_INDEX, TemplateError, encode_conversation, plan_chat_steps, prepare_chat_data,
                               render)
from harness.data.errors import DataError
from harness.losses import distill_loss, lm_loss
from harness.mixers import MIXERS
from harness.stages.common import load_job_teacher
from tests.pipeline import EOS, WORDS, make_setting, tiny_job

REPO = Path(__file__).resolve().parents[1]
# A tiny chat template for the tiny tokenizer (which has none): '<role>: <content><|endoftext|>\n' per message.
TEMPLATE = ("{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '" + EOS + "' + '\\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
TURN = re.compile(r"(system|user|assistant): (.*?)" + re.escape(EOS) + "\n", re.S)
CHATML_TURN = re.compile(r"<\|im_start\|>(system|user|assistant)\n(.*?)<\|im_end\|>\n", re.S)


def phrase(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def conversations(n: int, seed: int) -> list[list[dict]]:
    """Synthetic chats: an optional system prompt, 1-3 question/answer turns with a learnable answer pattern."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": "Answer briefly."}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, 3)):
            question = phrase(rng, 2, 10)
            messages += [{"role": "user", "content": question.capitalize() + "?"},
                         {"role": "assistant", "content": "The answer is " + question.split()[-1] + "."}]
        out.append(messages)
    return out


@pytest.fixture(scope="module")
def setting(tmp_path_factory) -> dict:
    """The tiny teacher (tests/pipeline.py), 160 chat conversations as jsonl, and the template as a .jinja file."""
    root = tmp_path_factory.mktemp("sft_setting")
    teacher_dir, _ = make_setting(root)
    chats = root / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations(160, seed=3)))
    template = root / "tiny.jinja"
    template.write_text(TEMPLATE)
    from transformers import AutoTokenizer

    return {"root": root, "teacher": teacher_dir, "chats": chats, "template": template,
            "tokenizer": AutoTokenizer.from_pretrained(teacher_dir)}


def chat_job(setting: dict, out: Path, *overrides: str):
    return tiny_job(setting["root"], out, f"instructions.source={setting['chats']}",
                    f"instructions.chat_template={setting['template']}", "instructions.seq_len=96",
                    "instructions.validation_conversations=8", "stages.sft.micro_batch_size=2", "stages.sft.lr=3e-3",
                    "stages.sft.warmup_fraction=0.2", *overrides)


def runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of True."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
    return list(zip(edges[::2], edges[1::2]))


def check_mask(messages: list[dict], tokenizer, template: str, eot: str) -> None:
    enc = encode_conversation(messages, tokenizer, template)
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    pieces = [tokenizer.decode(enc.ids[a:b].tolist()) for a, b in runs(enc.mask)]
    assert pieces == [a + eot for a in answers]
    assert tokenizer.decode(enc.ids.tolist()) == render(tokenizer, template, messages)


# ------------------------------------------------------------------------------ masks and the template


def test_only_assistant_contents_and_end_of_turn_are_targets(setting):
    tok = setting["tokenizer"]
    for messages in conversations(40, seed=5):
        check_mask(messages, tok, TEMPLATE, EOS)


def test_mask_on_the_real_smollm2_template(smollm2_gguf):
    """SmolLM2-Instruct's own ChatML template (special tokens, a default system prompt) round-trips too."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    default = {"role": "system", "content": "You are a helpful AI assistant named SmolLM, trained by Hugging Face"}
    chats = conversations(10, seed=6) + [[{"role": "user", "content": "  spaces \n"},
                                          {"role": "assistant", "content": "  kept\n\n as is "}]]
    for messages in chats:
        check_mask(messages, tok, tok.chat_template, "<|im_end|>")
        text = tok.decode(encode_conversation(messages, tok, tok.chat_template).ids.tolist())
        expected = messages if messages[0]["role"] == "system" else [default, *messages]
        assert [{"role": r, "content": c} for r, c in CHATML_TURN.findall(text)] == expected


def test_template_round_trip_recovers_the_messages(setting):
    """render -> tokenize (segment by segment) -> decode gives the rendered text, which parses back to the messages."""
    tok = setting["tokenizer"]
    for messages in conversations(30, seed=7):
        enc = encode_conversation(messages, tok, TEMPLATE)
        text = tok.decode(enc.ids.tolist())
        assert text == render(tok, TEMPLATE, messages)
        assert [{"role": r, "content": c} for r, c in TURN.findall(text)] == messages
        assert enc.targets == int(enc.mask[1:].sum()) > 0


def test_templates_that_cannot_mark_assistant_tokens_are_refused(setting):
    tok = setting["tokenizer"]
    messages = conversations(1, seed=8)[0]
    no_end = TEMPLATE.replace("'" + EOS + "' + ", "")
    with pytest.raises(TemplateError, match="no special token after assistant turn"):
        encode_conversation(messages, tok, no_end)
    inconsistent = TEMPLATE.replace("'assistant: '", "'bot: '")
    with pytest.raises(TemplateError, match="not prefix-consistent"):
        encode_conversation(messages, tok, inconsistent)
    cut = encode_conversation(messages, tok, TEMPLATE, max_len=5)
    assert cut.truncated and len(cut.ids) == 5


def test_tokenizer_without_template_needs_instructions_chat_template(setting, tmp_path):
    job = tiny_job(setting["root"], tmp_path / "run", f"instructions.source={setting['chats']}")
    with pytest.raises(DataError, match="no chat template; set instructions.chat_template"):
        prepare_chat_data(job, setting["tokenizer"])


# ------------------------------------------------------------------------------ no state across conversations


@pytest.mark.parametrize("mixer", list(MIXERS))
def test_a_conversation_in_a_batch_gives_the_logits_it_has_alone(setting, tmp_path, mixer):
    """Right-padded rows (one conversation each) are exact for every mixer; packing two into one row is not."""
    job = chat_job(setting, tmp_path / "run")
    data = prepare_chat_data(job, setting["tokenizer"])
    teacher = load_job_teacher(job)
    torch.manual_seed(0)
    student = harness.build_student(teacher, mixer, chunk_size=16).eval()
    convs = [int(c) for c in data.train[:4]]
    batch = data.batch(convs)
    lengths = batch["attention_mask"].sum(1).tolist()
    assert len(set(lengths)) > 1  # different lengths: the shorter rows are padded
    head = student.lm_head.weight
    with torch.no_grad():
        hidden = student.model(batch["input_ids"])
        for row, conv in enumerate(convs):
            alone = data.batch([conv])
            alone_hidden = student.model(alone["input_ids"])
            torch.testing.assert_close(student.lm_head(hidden[row, : lengths[row]]), student.lm_head(alone_hidden[0]),
                                       rtol=1e-4, atol=1e-5)
            loss_row = lm_loss(hidden[row: row + 1], head, batch["labels"][row: row + 1])
            loss_alone = lm_loss(alone_hidden, head, alone["labels"])
            assert loss_row.tokens == loss_alone.tokens == data.store.targets[conv]
            torch.testing.assert_close(loss_row.total, loss_alone.total, rtol=1e-5, atol=1e-6)
        # the negative control: conversation 1 right after conversation 0 in one row sees 0's state
        first, second = (data.store.conversation(c)[0] for c in convs[:2])
        packed = student(torch.from_numpy(np.concatenate([first, second]))[None]).logits[0, len(first):]
        alone = student(torch.from_numpy(second)[None]).logits[0]
        assert (packed - alone).abs().max() > 1e-3


# ------------------------------------------------------------------------------ loader, budget, losses


def test_loader_shards_resumes_weights_tokens_and_stops_at_the_budget(setting, tmp_path):
    job = chat_job(setting, tmp_path / "run")
    data = prepare_chat_data(job, setting["tokenizer"])
    steps = plan_chat_steps(data, 0, per_step=4, tokens=2000, allow_repeat=False, key="stages.sft.tokens")
    loaders = [data.loader("sft", 0, r, 2, 1, 2, steps) for r in range(2)]  # 2 ranks x 1 x grad_accum 2
    assert loaders[0].tokens_total <= 2000 < data.loader("sft", 0, 0, 2, 1, 2, steps + 1).tokens_total
    seen, counted = [], []
    for micro in range(2 * steps):
        for loader in loaders:
            b = next(loader)
            seen += b["conversation_index"].tolist()
            counted.append((micro // 2, b["step_targets"], int((b["labels"][:, 1:] != IGNORE_INDEX).sum())))
            assert int(b["attention_mask"].sum()) == sum(data.store.lengths[c] for c in b["conversation_index"])
    assert len(seen) == len(set(seen)) == 4 * steps  # within one pass: disjoint, nothing twice
    assert loaders[0].tokens_consumed == loaders[0].tokens_total == int(data.store.lengths[seen].sum())
    for s in range(steps):
        rows = [c for c in counted if c[0] == s]
        assert {c[1] for c in rows} == {sum(c[2] for c in rows)}  # step_targets = the step's counted targets
    partial = data.loader("sft", 0, 1, 2, 1, 2, steps)
    for _ in range(3):
        next(partial)
    resumed = data.loader("sft", 0, 1, 2, 1, 2, steps)
    resumed.load_state_dict(json.loads(json.dumps(partial.state_dict())))
    assert torch.equal(next(resumed)["conversation_index"], next(partial)["conversation_index"])
    with pytest.raises(DataError, match="does not match"):
        data.loader("sft", 1, 1, 2, 1, 2, steps).load_state_dict(partial.state_dict())
    with pytest.raises(DataError, match="instructions.allow_repeat=true"):
        plan_chat_steps(data, 0, per_step=4, tokens=10**6, allow_repeat=False, key="stages.sft.tokens")
    assert plan_chat_steps(data, 0, per_step=4, tokens=10**6, allow_repeat=True, key="k") > len(data.train) // 4
    assert plan_chat_steps(data, 0, per_step=4, tokens=None, allow_repeat=False, key="k") == len(data.train) // 4


def test_instruction_distillation_loss_is_on_assistant_tokens_only(setting, tmp_path):
    """distill_loss on chat labels == CE and tau^2 KL computed by hand over the assistant target positions."""
    job = chat_job(setting, tmp_path / "run")
    data = prepare_chat_data(job, setting["tokenizer"])
    teacher = load_job_teacher(job)
    torch.manual_seed(0)
    student = harness.build_student(teacher, "gated_deltanet", chunk_size=16)
    batch = data.batch([int(c) for c in data.train[:3]])
    ids, labels = batch["input_ids"], batch["labels"]
    with torch.no_grad():
        hs = student.model(ids)
        ht = teacher.model.model(input_ids=ids).last_hidden_state
        out = distill_loss(hs, ht, student.lm_head.weight, teacher.model.lm_head.weight, labels, ce_weight=0.7,
                           kl_weight=0.3, temperature=2.0)
        ce, kl, n = [], [], 0
        for row in range(ids.shape[0]):
            for t in range(ids.shape[1] - 1):
                y = int(labels[row, t + 1])
                conv = int(batch["conversation_index"][row])
                real = t + 1 < data.store.lengths[conv]
                is_target = real and bool(data.store.conversation(conv)[1][t + 1])
                assert (y != IGNORE_INDEX) == is_target
                if not is_target:
                    continue
                s_logits = hs[row, t] @ student.lm_head.weight.T
                t_logits = ht[row, t] @ teacher.model.lm_head.weight.T
                ce.append(F.cross_entropy(s_logits[None], torch.tensor([y])))
                p, log_q = F.softmax(t_logits / 2, -1), F.log_softmax(s_logits / 2, -1)
                kl.append(4 * (p * (p.log() - log_q)).sum())
                n += 1
    assert out.tokens == n == sum(int(data.store.targets[int(c)]) for c in batch["conversation_index"])
    torch.testing.assert_close(out.ce, torch.stack(ce).mean(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.kl, torch.stack(kl).mean(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.total, 0.7 * out.ce + 0.3 * out.kl, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------ runs under DeepSpeed


def make_student(job) -> None:
    """RUN_DIR/student (what stage 3 writes) and RUN_DIR/merged: the weight-transfer student of the tiny teacher."""
    teacher = load_job_teacher(job)
    torch.manual_seed(job.seed)
    student = harness.build_student(teacher, job.student.mixer, **job.student.options)
    for name in ("student", "merged"):
        student.save_pretrained(Path(job.output_dir) / name)
        teacher.tokenizer.save_pretrained(Path(job.output_dir) / name)


def write_job(setting: dict, tmp: Path, out: Path, *overrides: str) -> Path:
    from tests.test_distill import partition_everything

    job = chat_job(setting, out, "stages.sft.tokens=1500", "budget.split=[0.05,0.05,0.9]", "stages.distill.lr=3e-3",
                   "stages.distill.warmup_fraction=0.2", *partition_everything(tmp), *overrides)
    make_student(job)
    path = tmp / f"{out.name}.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.structured(job)))
    return path


def metrics(out: Path, stage: str) -> dict[int, float]:
    lines = [json.loads(line) for line in (out / stage / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines if "loss" in r}


def plain_run(job_path: Path, stage: str, per_step: int) -> list[float]:
    """The stage's losses in plain PyTorch, one process, no DeepSpeed, each step's conversations in one batch."""
    from harness.data.chat import prepare_chat_data
    from harness.engine import param_groups
    from harness.schedule import build_scheduler
    from harness.student import HarnessForCausalLM

    job = load_job(job_path)
    cfg = getattr(job.stages, stage)
    teacher = load_job_teacher(job)
    data = prepare_chat_data(job, teacher.tokenizer)
    tokens = cfg.tokens if stage == "sft" else int(job.budget.total_tokens * job.budget.split[2])
    steps = plan_chat_steps(data, job.seed, per_step, tokens, job.instructions.allow_repeat, "k")
    loader = data.loader(stage, job.seed, 0, 1, per_step, 1, steps)
    torch.manual_seed(job.seed)
    student = HarnessForCausalLM.from_pretrained(Path(job.output_dir) / ("student" if stage == "sft" else "merged"))
    opt = torch.optim.AdamW(param_groups(student, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    sched = build_scheduler(opt, cfg, steps)
    history = []
    for batch in loader:
        ids, labels = batch["input_ids"], batch["labels"]
        if stage == "sft":
            out = lm_loss(student.model(ids), student.lm_head.weight, labels)
        else:
            with torch.no_grad():
                t_hidden = teacher.model.model(input_ids=ids).last_hidden_state
            out = distill_loss(student.model(ids), t_hidden, student.lm_head.weight, teacher.model.lm_head.weight,
                               labels, ce_weight=cfg.ce_weight, kl_weight=cfg.kl_weight, temperature=cfg.temperature)
        out.total.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        history.append(out.total.item())
    return history


def test_sft_zero3_two_processes_with_accumulation_match_plain_pytorch(setting, tmp_path):
    """`harness stage sft` on 2 processes x micro-batch 1 x grad_accum 2 = the plain per-token mean over each step's
    4 conversations: the token weighting is exact, padding changes nothing; then the exported student and spec."""
    out = tmp_path / "sft2"
    job_path = write_job(setting, tmp_path, out, "deepspeed.world_size=2", "stages.sft.micro_batch_size=1",
                         "stages.sft.grad_accum=2", "stages.sft.tokens=3000")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "harness.cli",
           "stage", "sft", str(job_path)]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    ds = metrics(out, "sft")
    plain = plain_run(job_path, "sft", per_step=4)
    assert len(ds) == len(plain) >= 5
    for step, value in ds.items():
        assert value == pytest.approx(plain[step - 1], rel=2e-5), step
    assert plain[-1] < plain[0] - 0.5  # it learns
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tuned = out / "student-sft"
    assert AutoTokenizer.from_pretrained(tuned).chat_template == TEMPLATE
    assert AutoModelForCausalLM.from_pretrained(tuned).config.mixer == "gated_deltanet"
    spec = OmegaConf.load(out / "eval-sft.yaml")
    assert Path(spec.checkpoint) == tuned.resolve() and Path(spec.output_dir) == (out / "eval-sft").resolve()
    assert (out / "sft" / "checkpoints" / "COMPLETE.json").is_file()
    assert "val_ppl" in (out / "sft" / "metrics.jsonl").read_text().splitlines()[-1]


def test_sft_interrupted_and_resumed_equals_uninterrupted(setting, tmp_path, one_process_group):
    from harness.stages.sft import sft

    extra = ["run.checkpoint_every_tokens=200", "stages.sft.grad_accum=2"]
    whole = load_job(write_job(setting, tmp_path, tmp_path / "whole", *extra))
    sft(whole)
    cut = load_job(write_job(setting, tmp_path, tmp_path / "cut", *extra))
    sft(cut, stop_after_steps=3)
    assert not (tmp_path / "cut" / "student-sft").exists()
    before = (tmp_path / "cut" / "sft" / "metrics.jsonl").read_text().splitlines()
    sft(cut)
    after = (tmp_path / "cut" / "sft" / "metrics.jsonl").read_text().splitlines()
    assert after[:3] == before[:3] and len(after) > 3  # steps 1-3 (their wall-clock times too) were not redone
    assert metrics(tmp_path / "cut", "sft") == metrics(tmp_path / "whole", "sft")
    a, b = (load_file(p / "student-sft" / "model.safetensors") for p in (tmp_path / "cut", tmp_path / "whole"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ConfigError, match="SFT needs a student"):
        sft(load_job(None, [f"output_dir={tmp_path / 'nothing'}", f"teacher.source={setting['teacher']}"]))


def test_instruction_aware_distillation_stage_matches_plain_pytorch(setting, tmp_path, one_process_group):
    """Stage 3 with stages.distill.data=instructions (KD + CE on assistant tokens), micro-batch 2 x grad_accum 2 under
    ZeRO-3, equals the plain per-token mean over each step's 4 conversations."""
    from harness.stages.distill import distill

    out = tmp_path / "instruct"
    job_path = write_job(setting, tmp_path, out, "stages.distill.data=instructions", "stages.distill.micro_batch_size=2",
                         "stages.distill.grad_accum=2", "budget.total_tokens=3000")
    distill(load_job(job_path))
    ds = metrics(out, "distill")
    plain = plain_run(job_path, "distill", per_step=4)
    assert len(ds) == len(plain) >= 5
    for step, value in ds.items():
        assert value == pytest.approx(plain[step - 1], rel=2e-5), step
    assert (out / "student" / "model.safetensors").is_file()


# ------------------------------------------------------------------------------ data sources and config


def test_offline_instruction_data_from_pypi(tmp_path_factory, setting, monkeypatch):
    """chatterbot-corpus and chitchat-dataset really fetched with `pip download`, with provenance and licenses. The
    13-gram evaluation-text check runs against a stand-in set here (tests/test_instruction_data.py checks it)."""
    from harness.data import mixed
    from harness.data.instructions import WHEELS, ensure_embedded_instructions

    for wheel in WHEELS.values():
        monkeypatch.delenv(wheel.env, raising=False)
    monkeypatch.setattr(mixed, "evaluation_texts", lambda *a, **k: {"stand-in": ["no conversation holds this text"]})
    root = tmp_path_factory.mktemp("fresh_instructions")
    folder = ensure_embedded_instructions(root, ("chatterbot", "chitchat"), progress=False)
    bot, chit = (json.loads((folder / name / "PROVENANCE.json").read_text()) for name in ("chatterbot", "chitchat"))
    assert bot["conversations"] == 2026 and bot["wheel_sha256"] == WHEELS["chatterbot"].sha256
    assert chit["conversations"] == 4017 and chit["conversations_in_wheel"] == 7168
    assert "BSD" in bot["license"] and "MIT" in chit["license"] and "non-English" in str(bot["left_out"])
    assert bot["decontamination"]["dropped"] == 0 and bot["decontamination"]["evaluation_sets"] == {"stand-in": 1}
    assert (folder / "chitchat" / "LICENSE.chitchat-dataset.txt").read_text().startswith("MIT License")
    first = json.loads((folder / "chatterbot" / "chatterbot.jsonl").read_text().splitlines()[0])["messages"]
    assert [m["role"] for m in first][:2] == ["user", "assistant"]
    job = tiny_job(setting["root"], tmp_path_factory.mktemp("run"), "instructions.source=embedded:chatterbot",
                   f"instructions.chat_template={setting['template']}", f"data.cache_dir={root}")
    data = prepare_chat_data(job, setting["tokenizer"])
    assert data.store.n + data.store.meta["dropped"] == 2026 and len(data.validation) == 256


@pytest.mark.parametrize("override, needle", [
    (["stages.distill.data=chat"], "Bad value 'chat' for stages.distill.data. Allowed: text, instructions"),
    (["instructions.source=embedded:gsm8k"], "unknown embedded subset 'gsm8k'.*embedded:chatterbot, embedded:chitchat"),
    (["instructions.source=/no/such/chats.jsonl"], "instructions.source='/no/such/chats.jsonl' looks like a local path"),
    (["instructions.chat_template=/no/template.jinja"], "neither 'chatml' nor an existing .jinja file"),
    (["instructions.seq_len=1"], "instructions.seq_len=1 must be at least 2"),
    (["stages.sft.schedule=linear"], "stages.sft.schedule. Allowed: wsd, cosine, constant"),
])
def test_bad_chat_settings_give_clear_errors(setting, override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_job(None, [f"teacher.source={setting['teacher']}", *override])


def test_hub_chat_data_offline_says_what_to_do(setting, tmp_path, monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'HuggingFaceTB/smoltalk' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    job = chat_job(setting, tmp_path / "run", "instructions.source=hub:HuggingFaceTB/smoltalk",
                   "instructions.hub_config=all")
    with pytest.raises(DataError, match="needs the hub; without it use instructions.source=embedded"):
        prepare_chat_data(job, setting["tokenizer"])


def test_post_training_jobs_distil_exactly_as_the_runs_they_tune():
    """jobs/sft: each (a) job is its study job (same run directory, stages 1-3) plus instructions and SFT; each (b) job
    swaps in the Instruct teacher and stage 3 on instructions; quick.yaml is the quickstart plus SFT."""
    pairs = [(REPO / "jobs/sft/quick.yaml", REPO / "jobs/quickstart.yaml")]
    pairs += [(p, REPO / "jobs/study" / p.name.replace("study-", "").replace("-sft", ""))
              for p in sorted((REPO / "jobs/sft").glob("study-*-sft.yaml"))]
    instruct = sorted((REPO / "jobs/sft").glob("study-*-instruct.yaml"))
    assert len(pairs) == len(instruct) + 1 == 3 * len(MIXERS.builtins) + 1  # three scales x every built-in mixer
    for sft_path, base_path in pairs:
        tuned, base = load_job(sft_path), load_job(base_path)
        for key in ("name", "output_dir", "teacher", "student", "data", "budget", "deepspeed", "run"):
            assert getattr(tuned, key) == getattr(base, key), (sft_path.name, key)
        for stage in ("align_mixer", "align_hidden", "distill"):
            assert getattr(tuned.stages, stage) == getattr(base.stages, stage), (sft_path.name, stage)
    for path in instruct:
        job = load_job(path)
        assert job.teacher.source.endswith("-Instruct") and job.stages.distill.data == "instructions"
        assert job.instructions.source == "hub:HuggingFaceTB/smoltalk" and job.instructions.chat_template == "chatml"


def test_a_run_of_skipped_steps_stops_sft(setting, tmp_path, one_process_group, monkeypatch):
    """SFT stops after run.max_skipped_steps_in_a_row skipped optimizer steps (stage 3's twin, with real
    non-finite gradients on the plain engine: tests/test_distill.py). SFT runs on DeepSpeed here, which in fp32 on a
    CPU does not skip, so the engine's skip count, as the loop's hooks read it, rises with every optimizer step."""
    from harness.observe import TooManySkippedSteps
    from harness.stages import sft as sft_stage
    from harness.train import hooks

    monkeypatch.setattr(hooks, "skipped_steps", lambda engine: engine.global_steps)
    job = load_job(write_job(setting, tmp_path, tmp_path / "skips", "run.max_skipped_steps_in_a_row=2"))
    with pytest.raises(TooManySkippedSteps, match="2 optimizer steps in a row.*up to step 2"):
        sft_stage.sft(job)
    assert not (tmp_path / "skips" / "student-sft").exists()


def test_the_135m_post_training_pairs_are_their_study_jobs_but_for_sft_or_stage_3_on_instructions():
    """jobs/sft-50m (issue 53, item 5), as scripts/make_sft_jobs.py writes them: per mixer, (a) is the 50M study job
    (same run directory and evaluation) with SFT after stage 3; (b) is that job with stage 3 on the chat data, at the
    same stage-3 tokens, in its own run directory."""
    import importlib.util
    import sys

    from harness.config import pipeline_stages, plan_stages

    sys.path.insert(0, str(REPO / "scripts"))
    try:
        spec = importlib.util.spec_from_file_location("make_sft_jobs", REPO / "scripts" / "make_sft_jobs.py")
        gen = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(gen)
    finally:
        sys.path.remove(str(REPO / "scripts"))
    folder = REPO / "jobs" / "sft-50m"
    assert {p.name: p.read_text() for p in folder.glob("*.yaml")} == gen.post_training_50m_jobs()
    for mixer in ("gated_deltanet", "gla", "linear_attn"):
        base = load_job(REPO / "jobs" / "study-small-50m" / f"smollm2-135m-{mixer}-50m.yaml")
        tuned = load_job(folder / f"smollm2-135m-{mixer}-50m-sft.yaml")
        instruct = load_job(folder / f"smollm2-135m-{mixer}-50m-instruct.yaml")
        for key in ("name", "output_dir", "teacher", "student", "data", "budget", "deepspeed", "run", "eval"):
            assert getattr(tuned, key) == getattr(base, key), (mixer, key)
        for stage in ("align_mixer", "align_hidden", "distill"):
            assert getattr(tuned.stages, stage) == getattr(base.stages, stage), (mixer, stage)
        assert pipeline_stages(tuned)[-1] == "sft" and tuned.stages.sft.tokens is None  # one pass
        assert instruct.output_dir == f"{base.output_dir}-instruct" and instruct.stages.distill.data == "instructions"
        assert not instruct.stages.sft.enabled and instruct.instructions.allow_repeat
        assert instruct.eval == base.eval and instruct.student == base.student and instruct.teacher == base.teacher
        assert instruct.budget == base.budget and instruct.stages.distill.tokens is None  # the same stage-3 tokens
        assert [p.tokens for p in plan_stages(instruct)] == [p.tokens for p in plan_stages(base)]
