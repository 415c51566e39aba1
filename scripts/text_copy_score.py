"""Copy accuracy on copy documents: how much of a string's second showing a model predicts, for teachers and students.

`harness eval copy` shows random token ids twice with nothing between; a model that learned to copy only after a
cue (the toy teacher of scripts/toy_teacher.py, trained on `generator:copy` documents: "string || string") scores
0 there while it copies text. This score reads the format such a teacher learned: documents of the harness's
`generator:copy` (random strings of words, pseudo-words, letter or digit groups, a cue, the string again; a seed of
its own, so not the documents any job trained on), teacher-forced, greedy. Per document it scores the second
showing's tokens after its first --skip (where the cue's tokenisation can differ from the first showing's), i.e.
the document's last len(tokens of the string) - skip tokens; the figure is the mean over documents with a 95%
bootstrap interval, beside the same score on the first showing (what the model guesses without a copy to read).
`--pairs A:B` adds B - A on the same documents (harness.eval.recovery.difference: the paired bootstrap of the
reports), A and B being rows' models as printed (e.g. RUN/student).

    .venv/bin/python scripts/text_copy_score.py runs/toy/teacher runs/toy/gdn-prose-s0/student --out OUT.json
    .venv/bin/python scripts/text_copy_score.py runs/toy/gdn-prose-s0/student runs/toy/gdn-copy50-s0/student \
        --pairs runs/toy/gdn-prose-s0/student:runs/toy/gdn-copy50-s0/student

The scoring is the evaluation task's (harness.eval.tasks.text_copy, `text_copy:` of an evaluation spec, on by
default); this script scores any model folders, e.g. the snapshots kept along stage 3.

Each MODEL is what `harness eval copy` takes (a student folder or a teacher source); a run folder is expanded to its
merged student (RUN/merged), its kept stage-3 snapshots (RUN/eval/snapshots/tokens-N) and its student (RUN/student).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

from harness.eval.tasks.text_copy import documents, score_document


def bootstrap(values: list[float], seed: int = 0, draws: int = 2000) -> tuple[float, float]:
    g = torch.Generator().manual_seed(seed)
    v = torch.tensor(values)
    idx = torch.randint(0, len(v), (draws, len(v)), generator=g)
    means = v[idx].mean(1).sort().values
    return means[int(0.025 * draws)].item(), means[int(0.975 * draws) - 1].item()


def expand(model: str) -> list[str]:
    """A run folder -> its merged student, kept snapshots and student, in that order; anything else as given."""
    run = Path(model)
    if not (run / "merged").is_dir() and not (run / "eval" / "snapshots").is_dir():
        return [model]
    found = [run / "merged"] + sorted((run / "eval" / "snapshots").glob("tokens-*")) + [run / "student"]
    return [str(p) for p in found if (p / "config.json").is_file()]


def score(model_path: str, docs: list[str], skip: int, device: str) -> dict:
    from harness.eval.cli import load_any

    args = argparse.Namespace(model=model_path, device=device, dtype="float32", teacher_layers=None)
    model, tokenizer, dev = load_any(args)
    model.eval()
    found = {i: p for i, p in enumerate(score_document(model, tokenizer, d, skip, dev) for d in docs) if p is not None}
    second, first = [p[0] for p in found.values()], [p[1] for p in found.values()]
    return {"model": model_path, "documents": len(found), "copy_accuracy": sum(second) / len(second),
            "interval": bootstrap(second), "first_showing_accuracy": sum(first) / len(first),
            "per_document": {str(i): p[0] for i, p in found.items()}}


def paired(rows: list[dict], pairs: list[str]) -> list[dict]:
    """B - A of the second-showing score for each "A:B" in pairs, over the documents both scored."""
    from harness.eval.recovery import difference

    by_model = {r["model"]: r for r in rows}
    out = []
    for pair in pairs:
        a, sep, b = pair.partition(":")
        missing = [m for m in (a, b) if m not in by_model]
        if not sep or missing:
            raise SystemExit(f"--pairs {pair!r}: give A:B, each one of the scored models {sorted(by_model)}")
        da, db = by_model[a]["per_document"], by_model[b]["per_document"]
        ids = sorted(set(da) & set(db), key=int)
        out.append({"model_a": a, "model_b": b, **difference([da[i] for i in ids], [db[i] for i in ids],
                                                stream=f"text copy {pair}", samples=2000, seed=0)})
    return out


def markdown(rows: list[dict], differences: list[dict] = ()) -> str:
    lines = ["| model | documents | second showing (copy) | 95% interval | first showing |", "|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["interval"]
        lines.append(f"| {r['model']} | {r['documents']} | {100 * r['copy_accuracy']:.1f}% | [{100 * lo:.1f}, "
                     f"{100 * hi:.1f}] | {100 * r['first_showing_accuracy']:.1f}% |")
    if differences:
        lines += ["", "| B - A (second showing, paired over documents) | n | A | B | B - A [95% CI] |",
                  "|---|---|---|---|---|"]
        for d in differences:
            lo, hi = d["ci"]
            lines.append(f"| {d['model_b']} - {d['model_a']} | {d['n']} | {100 * d['a']:.1f}% | {100 * d['b']:.1f}% | "
                         f"{100 * d['diff']:+.1f} pts [{100 * lo:+.1f}, {100 * hi:+.1f}] |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+", help="Model folders or teacher sources; run folders are expanded.")
    p.add_argument("--documents", type=int, default=64, help="Copy documents scored per model.")
    p.add_argument("--seed", type=int, default=7, help="Seed of the documents (no job here trains on seed 7).")
    p.add_argument("--length", type=int, nargs=2, default=[8, 32], metavar=("LO", "HI"),
                   help="Units of each string (generator:copy's `length`).")
    p.add_argument("--skip", type=int, default=2, help="Tokens at the start of each showing left unscored.")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--pairs", nargs="*", default=[], metavar="A:B",
                   help="Paired differences B - A of the second-showing score, A and B scored models as printed.")
    p.add_argument("--out", default=None, help="JSON file for the rows (and a .md beside it).")
    args = p.parse_args(argv)
    docs = documents(args.documents, args.seed, tuple(args.length))
    rows = [score(m, docs, args.skip, args.device) for model in args.models for m in expand(model)]
    differences = paired(rows, args.pairs)
    print(markdown(rows, differences))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"command": " ".join([sys.executable, *sys.argv]), "settings": vars(args),
                                   "machine": f"{platform.machine()}, torch {torch.__version__}", "rows": rows,
                                   "differences": differences}, indent=1) + "\n")
        out.with_suffix(".md").write_text(markdown(rows, differences) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
