"""A tiny but real pipeline setting for CPU tests: a byte-level BPE tokenizer trained here, a random Llama
teacher with grouped KV heads whose vocabulary matches it (saved as an HF folder with the tokenizer), an
English-like jsonl corpus, and a job pointing at them."""

from __future__ import annotations

import json
import random
from pathlib import Path

from harness.config import JobConfig, load_job
from tests.tiny import tiny_llama

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
