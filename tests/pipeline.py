"""A tiny but real pipeline setting for CPU tests: a byte-level BPE tokenizer trained here, a random Llama
teacher with grouped KV heads whose vocabulary matches it (saved as an HF folder with the tokenizer), an
English-like jsonl corpus, and a job pointing at them."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf

from harness.config import JobConfig, load_job
from tests.tiny import tiny_llama

REPO = Path(__file__).resolve().parents[1]


def load_script(name: str):
    """scripts/NAME.py as a module (the scripts are not a package), run from the repository's scripts folder."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EOS = "<|endoftext|>"
WORDS = ("the of and to in is was for on that with as by at from his it an were are which this be has had "
         "river city music history science garden window mountain language teacher market winter summer "
         "village government library station engine theory painting harbour forest kingdom island bridge").split()


def documents(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 80))).capitalize() + "." for _ in range(n)]


def tiny_tokenizer(vocab: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(documents(200, seed=99), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=EOS)


def make_setting(root: Path, layers: int = 4) -> tuple[Path, Path]:
    """(teacher dir, corpus jsonl) under root, built once per root."""
    teacher_dir, corpus = root / "teacher", root / "corpus.jsonl"
    if not (teacher_dir / "config.json").exists():
        tok = tiny_tokenizer()
        model = tiny_llama(num_layers=layers, hidden=64, heads=4, kv_heads=2, vocab=len(tok), seed=0)
        model.config.eos_token_id = tok.eos_token_id
        model.save_pretrained(teacher_dir)
        tok.save_pretrained(teacher_dir)
        with open(corpus, "w") as f:
            for d in documents(600, seed=1):
                f.write(json.dumps({"text": d}) + "\n")
    return teacher_dir, corpus


def tiny_job(root: Path, out: Path, *overrides: str, total: int = 40_960) -> JobConfig:
    teacher_dir, corpus = make_setting(root)
    return load_job(None, [
        f"teacher.source={teacher_dir}", f"data.source={corpus}", "data.seq_len=32", "data.validation_tokens=256",
        f"data.cache_dir={root / 'cache'}", "data.num_proc=1", f"budget.total_tokens={total}",
        f"output_dir={out}", "run.device=cpu", "run.log_every_steps=1", "student.options.chunk_size=16",
        *(f"stages.{s}.micro_batch_size=2" for s in ("align_mixer", "align_hidden", "distill")),
        "eval.enabled=false",  # tests that evaluate say so
        "eval.chat_samples=false",  # ~55 s of greedy decoding per CPU eval job; tests/test_eval_job.py opts in
        *overrides,
    ])


NO_BUILT_IN_TASKS = ("eval.enabled=true", "eval.tasks=[]", "eval.niah.lengths=[]", "eval.perplexity_tokens=0",
                     "eval.copy=null", "eval.text_copy=null")  # the copy probe and the copy on text run by default


def student_run(root: Path, out: Path, *overrides: str, seed: int = 0) -> Path:
    """OUT as stage 3 leaves it for tiny_job(root, out, *overrides): OUT/student holding a gated_deltanet student of
    the tiny teacher (its mixer weights drawn after torch.manual_seed(seed)) and the teacher's tokenizer, and
    OUT/eval.yaml."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from harness.eval.spec import write_eval_spec
    from harness.student import build_student

    job = tiny_job(root, out, *overrides)
    teacher = AutoModelForCausalLM.from_pretrained(job.teacher.source)
    torch.manual_seed(seed)
    build_student(teacher, "gated_deltanet", chunk_size=16).save_pretrained(out / "student")
    AutoTokenizer.from_pretrained(job.teacher.source).save_pretrained(out / "student")
    write_eval_spec(job, out / "student")
    return out


def eval_run(root: Path, name: str, seed: int, *overrides: str) -> Path:
    """student_run at ROOT/NAME (job name NAME) evaluating only what `overrides` turn on: no built-in task."""
    return student_run(root, root / name, *NO_BUILT_IN_TASKS, f"name={name}", *overrides, seed=seed)


def job_file(root: Path, out: Path, *overrides: str, total: int) -> Path:
    """tiny_job written beside its run directory as OUT.yaml (what `harness` commands take)."""
    job = tiny_job(root / "setting", out, *overrides, total=total)
    path = out.parent / f"{out.name}.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.structured(job)))
    return path


def start(*args: str, log: Path, failpoints: str = "", pauses: Path | None = None) -> subprocess.Popen:
    """`harness ARGS` as its own process, output to `log`; with failpoints (harness.failpoints) armed where given."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu"}
    env.pop("HARNESS_PREEMPT_FILE", None)
    if failpoints:
        env.update(HARNESS_FAILPOINTS=failpoints, HARNESS_FAILPOINTS_DIR=str(pauses))
    with open(log, "w") as handle:
        return subprocess.Popen([sys.executable, "-m", "harness.cli", *args], cwd=REPO, env=env, stdout=handle,
                                stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, log: Path, timeout: float = 600) -> tuple[int, str]:
    """The process's exit code and its output."""
    code = proc.wait(timeout=timeout)
    return code, log.read_text(errors="replace")


def run(*args: str, log: Path) -> str:
    """`harness ARGS` to its end; its output, or a failed assertion showing the output's tail."""
    code, output = finish(start(*args, log=log), log)
    assert code == 0, output[-3000:]
    return output


def reference_run(root: Path, *overrides: str, total: int) -> tuple[Path, Path]:
    """An uninterrupted run at ROOT/reference: stages 1-2 and the merge in this process (its SIGTERM and SIGUSR1
    handlers kept as they were), stage 3 as a `harness` process. (run directory, job file)."""
    import signal

    from harness.stages.align import align_group
    from harness.stages.merge import merge_student

    out = root / "reference"
    job_path = job_file(root, out, *overrides, total=total)
    job = load_job(str(job_path), [])
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        for stage in ("align_mixer", "align_hidden"):
            align_group(job, stage, list(range(job_layers(job))))
        merge_student(job)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    run("stage", "distill", str(job_path), log=root / "distill.log")
    return out, job_path


def job_layers(job: JobConfig) -> int:
    """How many layers the job's (tiny) teacher has."""
    config = json.loads((Path(job.teacher.source) / "config.json").read_text())
    return int(config["num_hidden_layers"])
