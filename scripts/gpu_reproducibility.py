r"""Does one student give the same numbers twice? The same weights scored in one process twice, in a second process
that reads the first one's Triton cache (compiled kernels and, with fla's FLA_CACHE_RESULTS=1, its autotuning
choices), and in processes that tune afresh; compared bit for bit.

    # once: build the job's student as stage 1 starts it (step 0, from the teacher) and save it
    python scripts/gpu_reproducibility.py score JOB --student /tmp/s --out $OUT/same-cache-1 --build
    python scripts/gpu_reproducibility.py score JOB --student /tmp/s --out $OUT/same-cache-2
    FLA_CACHE_RESULTS=0 python scripts/gpu_reproducibility.py score JOB --student /tmp/s --out $OUT/no-tuning-cache
    python scripts/gpu_reproducibility.py compare $OUT/same-cache-1 $OUT/same-cache-2 $OUT/no-tuning-cache

`score` runs, `--repeats` times in the process: full forwards of fixed random sequences (--batch x --seq-len, the
stage-3 path: chunked kernels) and greedy decoding of --new-tokens from their first --prompt-len tokens (the
evaluation's path: the recurrent step). It writes OUT/scores.pt (the log-probabilities at the last 64 positions,
fp32, and the generated ids, per repeat) and OUT/scores.json (the weights' sha256, each repeat's logits sha256, the
environment). `compare` prints and writes (--json) the largest differences between every pair of repeats, inside a
process and across processes: "bitwise" means the two full logits tensors hashed the same.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.config import load_job  # noqa: E402
from harness.export import weights_sha256  # noqa: E402

TAIL = 64  # positions of each sequence whose log-probabilities are kept for the differences


def tensor_sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def build_student(job: Any, dest: Path) -> None:
    """The job's student as stage 1 starts it (the teacher's weights, the mixers' initialisation under the job's
    seed), saved with the teacher's tokenizer."""
    import harness
    from harness.stages.common import kept_attention_layers
    from harness.student import build_student as build

    teacher = harness.load_teacher(job.teacher.source)
    torch.manual_seed(job.seed)
    kept = kept_attention_layers(job)  # as the merge reads them ('auto:K' from the run's layer ranking)
    student = build(teacher, job.student.mixer, attention_layers=kept, **dict(job.student.options))
    student.save_pretrained(dest)
    teacher.tokenizer.save_pretrained(dest)


def load_student(path: Path, device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    import harness  # noqa: F401  (registers the student classes)

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def fixed_batch(vocab: int, batch: int, seq_len: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234)
    low = min(1000, vocab // 4)  # ids 1000-20000 as the copy probe draws them, where the vocabulary has them
    return torch.randint(low, min(vocab, 20000), (batch, seq_len), generator=generator)


@torch.no_grad()
def score_once(model: Any, ids: torch.Tensor, prompt_len: int, new_tokens: int) -> dict[str, Any]:
    logits = model(ids).logits.float()
    out = {"logits_sha256": tensor_sha256(logits),
           "tail_logprobs": torch.log_softmax(logits[:, -TAIL:], dim=-1).cpu()}
    generated = model.generate(ids[:, :prompt_len], attention_mask=torch.ones_like(ids[:, :prompt_len]),
                               max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                               pad_token_id=0)
    out["generated"] = generated[:, prompt_len:].cpu()
    return out


def score(args: argparse.Namespace) -> None:
    job = load_job(args.job, list(args.overrides))
    student_dir = Path(args.student)
    if args.build:
        build_student(job, student_dir)
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    model = load_student(student_dir, device, dtype)
    ids = fixed_batch(model.config.vocab_size, args.batch, args.seq_len).to(device)
    repeats, seconds = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        repeats.append(score_once(model, ids, args.prompt_len, args.new_tokens))
        seconds.append(round(time.perf_counter() - start, 2))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save([{k: r[k] for k in ("tail_logprobs", "generated")} for r in repeats], out / "scores.pt")
    facts = {"job": args.job, "overrides": list(args.overrides), "student": str(student_dir),
             "weights_sha256": weights_sha256(student_dir),
             "logits_sha256": [r["logits_sha256"] for r in repeats], "seconds": seconds,
             "batch": args.batch, "seq_len": args.seq_len, "prompt_len": args.prompt_len,
             "new_tokens": args.new_tokens, "dtype": args.dtype, "device": str(device),
             "gpu": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
             "env": {k: os.environ.get(k) for k in ("FLA_CACHE_RESULTS", "TRITON_CACHE_DIR", "TILELANG_CACHE_DIR")},
             "torch": torch.__version__, "command": " ".join(sys.argv)}
    (out / "scores.json").write_text(json.dumps(facts, indent=1) + "\n")
    print(json.dumps({"out": str(out), "logits_sha256": facts["logits_sha256"], "seconds": seconds}))


def load_runs(paths: Sequence[str]) -> dict[str, tuple[dict[str, Any], list[dict[str, torch.Tensor]]]]:
    return {Path(p).name: (json.loads((Path(p) / "scores.json").read_text()), torch.load(Path(p) / "scores.pt"))
            for p in paths}


def compare_pair(a: tuple[str, dict], b: tuple[str, dict]) -> dict[str, Any]:
    """Two repeats, each (its logits' sha256, its saved tensors)."""
    (sha_a, ra), (sha_b, rb) = a, b
    diff = (ra["tail_logprobs"] - rb["tail_logprobs"]).abs()
    same_tokens = (ra["generated"] == rb["generated"])
    first_diff = [int(row.logical_not().nonzero()[0]) if not row.all() else None for row in same_tokens]
    return {"bitwise": sha_a == sha_b, "max_abs_logprob_diff": float(diff.max()),
            "median_abs_logprob_diff": float(diff.median()),
            "generated_equal": bool(same_tokens.all()), "first_differing_token": first_diff}


def compare(args: argparse.Namespace) -> dict[str, Any]:
    runs = load_runs(args.runs)
    rows = []
    items = [(f"{name}#{i}", (facts["logits_sha256"][i], rep))
             for name, (facts, reps) in runs.items() for i, rep in enumerate(reps)]
    weights = {name: facts["weights_sha256"] for name, (facts, _) in runs.items()}
    for (na, a), (nb, b) in itertools.combinations(items, 2):
        rows.append({"a": na, "b": nb, **compare_pair(a, b)})
    result = {"same_weights": len({json.dumps(w, sort_keys=True) for w in weights.values()}) == 1,
              "weights_sha256": weights, "pairs": rows}
    print(f"same weights in every run: {result['same_weights']}")
    print("| a | b | bitwise | max |dlogp| | median |dlogp| | greedy tokens equal | first differing token per row |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['a']} | {r['b']} | {r['bitwise']} | {r['max_abs_logprob_diff']:.3g} | "
              f"{r['median_abs_logprob_diff']:.3g} | {r['generated_equal']} | {r['first_differing_token']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    s = commands.add_parser("score", help="Score a student --repeats times in this process.")
    s.add_argument("job", help="Job YAML whose student is scored (its teacher, mixer, options, seed).")
    s.add_argument("overrides", nargs="*", help="key=value overrides of the job.")
    s.add_argument("--student", required=True, help="The student folder (written there with --build).")
    s.add_argument("--build", action="store_true", help="Build the job's step-0 student into --student first.")
    s.add_argument("--out", required=True, help="Folder for scores.pt and scores.json.")
    s.add_argument("--repeats", type=int, default=2, help="Scorings in this process (default 2).")
    s.add_argument("--batch", type=int, default=4, help="Sequences (default 4).")
    s.add_argument("--seq-len", type=int, default=2048, help="Tokens per sequence (default 2048).")
    s.add_argument("--prompt-len", type=int, default=256, help="Prompt tokens for greedy decoding (default 256).")
    s.add_argument("--new-tokens", type=int, default=32, help="Greedy tokens decoded (default 32).")
    s.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    s.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    c = commands.add_parser("compare", help="Compare the repeats of several `score` folders.")
    c.add_argument("runs", nargs="+", help="`score` output folders.")
    c.add_argument("--json", help="Also write the comparison here.")
    args = parser.parse_args(argv)
    if args.command == "score":
        if args.seq_len < args.prompt_len:
            parser.error(f"--seq-len {args.seq_len} is shorter than --prompt-len {args.prompt_len}")
        score(args)
    else:
        compare(args)


if __name__ == "__main__":
    main()
