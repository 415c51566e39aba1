"""A toy teacher that copies, trained from scratch on the CPU, for retrieval experiments many times faster than 135M.

Issue 50's question (does distillation keep the teacher's in-context copying, and what gives it back) costs a GPU
lease per run at 135M. This script makes a small Llama teacher that copies (induction heads form on the copy
documents), so that the harness's whole pipeline (stages 1-3 and the copy probe) runs on it on two CPU cores in
minutes, with seeds:

    1. a byte-level BPE tokenizer of --vocab ids (with <|endoftext|>) trained on the embedded Wikipedia text;
    2. a Llama (--hidden, --layers, heads of 64, --kv-heads, tied embeddings: SmolLM2's layout, scaled down);
    3. trained by AdamW (warm-up, cosine decay) on rows of --seq-len tokens packed from the embedded Wikipedia text
       and `generator:copy` documents (a --copy-share of the tokens: random strings and a cue and the string again,
       the harness's own copy generator, not the copy probe's format);
    4. saved with its tokenizer as a Hugging Face folder (`teacher.source: OUT` in a job), with train.json (the
       command, the settings, the loss every --log-every steps, the time).

    .venv/bin/python scripts/toy_teacher.py --out runs/toy/teacher --tokens 3000000

Score it with `harness eval copy OUT --lengths 16,32,64 --induction --device cpu --dtype float32`. The teacher's
training loop is a plain one on purpose: it trains a teacher, which no harness stage does.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Iterator

import torch

EOS = "<|endoftext|>"


def prose(limit: int | None = None) -> Iterator[str]:
    """The embedded Wikipedia documents in their fixed shuffled order."""
    from harness.data.embedded import embedded_subset_path

    with open(embedded_subset_path("wikipedia")) as f:
        for line in itertools.islice(f, limit):
            yield json.loads(line)["text"]


def train_tokenizer(texts: Iterator[str], vocab: int):
    """A byte-level BPE tokenizer of `vocab` ids, <|endoftext|> its eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=EOS)


def documents(copy_share: float, seed: int, copy_options: dict | None = None) -> Iterator[tuple[str, str]]:
    """(source, text) forever: Wikipedia paragraphs and copy documents, the copy documents drawn whenever their share
    of the characters so far is below `copy_share` (shares of characters follow shares of tokens closely enough
    for a teacher's data; the script reports the token shares it trained on)."""
    from harness.data.generators import make_generator

    copies = make_generator("copy", {"seed": seed, **(copy_options or {})})
    chars = {"prose": 0, "copy": 0}
    index = itertools.count()
    while True:
        for text in prose():
            while copy_share > 0 and chars["copy"] < copy_share * (chars["prose"] + chars["copy"] + 1):
                doc = copies.document(next(index))
                chars["copy"] += len(doc)
                yield "copy", doc
            chars["prose"] += len(text)
            yield "prose", text


def rows(tokenizer, docs: Iterator[tuple[str, str]], seq_len: int, counts: dict) -> Iterator[list[int]]:
    """Rows of seq_len token ids packed from the documents, each ended by eos; counts[source] += its tokens."""
    buffer: list[int] = []
    for source, text in docs:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        counts[source] = counts.get(source, 0) + len(ids)
        buffer.extend(ids)
        while len(buffer) >= seq_len:
            yield buffer[:seq_len]
            buffer = buffer[seq_len:]


def build_model(vocab: int, hidden: int, layers: int, kv_heads: int, seq_len: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = hidden // 64
    if heads * 64 != hidden or heads % kv_heads:
        raise SystemExit(f"--hidden {hidden} must be a multiple of 64 (heads of 64) whose heads ({heads}) "
                         f"--kv-heads {kv_heads} divides")
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=int(hidden * 8 / 3) // 64 * 64,
                         max_position_embeddings=max(1024, seq_len), tie_word_embeddings=True, rope_theta=10000.0)
    return LlamaForCausalLM(config)


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up to `peak`, then cosine decay to a tenth of it."""
    if step < warmup:
        return peak * (step + 1) / warmup
    done = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, done))))


def copy_accuracy(model, vocab: int, length: int = 32, rows: int = 16, low: int = 1000) -> float:
    """Greedy accuracy on the second copy of `rows` random id sequences shown twice (the copy probe's format, a fixed
    draw, ids from `low` (or the upper half of a smaller vocabulary); the first token of the copy excluded): a quick
    look at whether induction has formed."""
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(min(low, vocab // 2), vocab, (rows, length), generator=g)
    ids = torch.cat([seq, seq], 1)
    with torch.no_grad():
        guess = model(input_ids=ids).logits[:, length:-1].argmax(-1)
    return (guess == ids[:, length + 1:]).float().mean().item()


def train(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.init:  # go on training an earlier teacher: its weights and tokenizer, a fresh schedule
        from transformers import AutoTokenizer, LlamaForCausalLM

        tokenizer, model = AutoTokenizer.from_pretrained(args.init), LlamaForCausalLM.from_pretrained(args.init)
    else:
        tokenizer = train_tokenizer(prose(args.tokenizer_docs), args.vocab)
        model = build_model(len(tokenizer), args.hidden, args.layers, args.kv_heads, args.seq_len, args.seed)
    model.config.eos_token_id = model.config.bos_token_id = tokenizer.eos_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    per_step = args.batch * args.seq_len
    steps = max(1, args.tokens // per_step)
    counts: dict = {}
    copy_options = {"length": args.copy_length, "copies": args.copies}
    stream = rows(tokenizer, documents(args.copy_share, args.seed, copy_options), args.seq_len, counts)
    log, start = [], time.time()
    ran = min(steps, args.stop_after or steps)
    for step in range(ran):
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, steps, args.lr, args.warmup)
        batch = torch.tensor([next(stream) for _ in range(args.batch)])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % args.log_every == 0 or step == steps - 1 or step + 1 == args.stop_after:
            log.append({"step": step, "tokens": (step + 1) * per_step, "loss": round(loss.item(), 4),
                        "copy_accuracy": round(copy_accuracy(model, len(tokenizer)), 4),
                        "seconds": round(time.time() - start, 1)})
            print(json.dumps(log[-1]), flush=True)
        if args.save_every and (step + 1) % args.save_every == 0:  # a stopped run keeps its last weights
            model.save_pretrained(out)
            tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    total = sum(counts.values())
    record = {"command": " ".join([sys.executable, *sys.argv]), "settings": vars(args),
              "parameters": sum(p.numel() for p in model.parameters()), "steps": ran, "tokens": ran * per_step,
              "schedule_steps": steps,
              "token_shares": {k: round(v / total, 4) for k, v in counts.items()}, "seconds": round(time.time() - start, 1),
              "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
              "log": log}
    (out / "train.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="Folder for the teacher (Hugging Face format, with its tokenizer).")
    p.add_argument("--tokens", type=int, default=3_000_000, help="Training tokens (rounded down to whole steps).")
    p.add_argument("--init", default=None, help="Start from this earlier teacher's folder (its weights and "
                   "tokenizer; the size options are then ignored) instead of a new tokenizer and random weights.")
    p.add_argument("--copy-share", type=float, default=0.5, help="Share of the text drawn from generator:copy.")
    p.add_argument("--copy-length", type=int, nargs=2, default=[4, 24], metavar=("LO", "HI"),
                   help="Units of each copy document's string (generator:copy's `length`).")
    p.add_argument("--copies", type=int, nargs=2, default=[1, 3], metavar=("LO", "HI"),
                   help="Copies after each string (generator:copy's `copies`).")
    p.add_argument("--vocab", type=int, default=4096, help="Tokenizer size (ids), <|endoftext|> included.")
    p.add_argument("--tokenizer-docs", type=int, default=20000, help="Wikipedia documents the tokenizer learns from.")
    p.add_argument("--hidden", type=int, default=256, help="Model width (a multiple of 64: heads of 64).")
    p.add_argument("--layers", type=int, default=4, help="Decoder layers.")
    p.add_argument("--kv-heads", type=int, default=2, help="Key-value heads (grouped-query attention, as SmolLM2).")
    p.add_argument("--seq-len", type=int, default=256, help="Tokens per training row.")
    p.add_argument("--batch", type=int, default=16, help="Rows per step.")
    p.add_argument("--lr", type=float, default=2e-3, help="Peak learning rate.")
    p.add_argument("--warmup", type=int, default=100, help="Warm-up steps.")
    p.add_argument("--seed", type=int, default=0, help="Seed of the weights and the copy documents.")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads.")
    p.add_argument("--log-every", type=int, default=50, help="Steps between logged losses and copy accuracies.")
    p.add_argument("--save-every", type=int, default=0, help="Steps between saves of the weights (0: at the end).")
    p.add_argument("--stop-after", type=int, default=0, help="Stop after this many steps, the schedule still the one "
                   "of --tokens (0: run them all).")
    args = p.parse_args(argv)
    if not 0 <= args.copy_share < 1:
        p.error(f"--copy-share {args.copy_share}: give a share in [0, 1)")
    return args


if __name__ == "__main__":
    train(parse())
