"""What a run whose evaluation stopped part-way measured, beside the study's finished runs.

`harness report` reads only finished evaluations (eval/report.json). A run whose machine was lost during its
evaluation still has the parts the evaluation finished (perplexity.json, niah.json + niah_cells.jsonl, and
bench.json + bench_examples.json for the tasks done). This prints, with the same functions the report uses:
the partial run's normalised recovery per finished task (paired bootstrap with the study's teacher), and its
paired differences (this run - each finished run) in the NIAH likelihood score, overall and by length, and in
each finished task's score.

    .venv/bin/python scripts/study_partial_pairs.py docs/results/study-small-50m/partial/smollm2-135m-mlstm-50m
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from harness.eval.paired import _examples, difference, read_niah_prompts
from harness.eval.recovery import task_recovery
from harness.eval.report import paired_columns


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def _scores(examples: dict) -> list[float]:
    return [s for leaf in sorted(examples["by_task"]) for s in examples["by_task"][leaf]["score"]]


def recoveries(student: Path, teacher: Path) -> list[str]:
    bench = json.loads((student / "bench.json").read_text())
    ex_s, ex_t = _examples(student), _examples(teacher)
    lines = []
    for task in ex_s:
        columns, why = paired_columns(ex_s[task], ex_t.get(task))
        if columns is None:
            lines.append(f"{task}: no paired columns ({why})")
            continue
        row, _ = task_recovery(task, bench["tasks"][task]["score"], float(columns[1].mean()), float(columns[2].mean()),
                               columns)
        ci = row["recovery_norm_ci"]
        lines.append(f"{task}: score {bench['tasks'][task]['score']:.3f}, teacher {columns[1].mean():.3f}, "
                     f"chance {row['chance']:.3f}, normalised recovery {_pct(row['recovery_norm'])}% "
                     f"[{_pct(ci[0])}, {_pct(ci[1])}]" if ci else f"{task}: teacher at chance")
    return lines


def pairs(student: Path, other: Path) -> list[str]:
    mine, theirs = read_niah_prompts(student), read_niah_prompts(other)
    lines = []
    if mine is not None and theirs is not None:
        keys = list(theirs.records)
        groups = [("overall", keys)] + [(f"{n} tokens", [k for k in keys if k[1] == n]) for n in theirs.grid["lengths"]]
        for name, ks in groups:
            r = difference([float(theirs.records[k]["top1"]) for k in ks], [float(mine.records[k]["top1"]) for k in ks],
                           stream=f"niah top1 {name}")
            lines.append(f"NIAH likelihood {name}: {_pct(r['a'])} -> {_pct(r['b'])}, {100 * r['diff']:+.1f} points "
                         f"[{100 * r['ci'][0]:+.1f}, {100 * r['ci'][1]:+.1f}]")
    ex_mine, ex_theirs = _examples(student), _examples(other)
    for task in ex_mine:
        if task in ex_theirs:
            r = difference(_scores(ex_theirs[task]), _scores(ex_mine[task]), stream=f"{task} score")
            lines.append(f"{task}: {r['a']:.3f} -> {r['b']:.3f}, {r['diff']:+.3f} [{r['ci'][0]:+.3f}, {r['ci'][1]:+.3f}]")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="the partial run's directory (holds eval/student/)")
    parser.add_argument("--runs", type=Path, default=Path("docs/results/study-small-50m/runs"),
                        help="the finished runs to pair with, and the teacher's results (teacher-*/)")
    args = parser.parse_args()
    student = args.run / "eval" / "student"
    teacher = next((p.parent for p in sorted(args.runs.glob("teacher-*/**/bench_examples.json"))), None)
    if teacher is None:
        parser.error(f"no teacher results (teacher-*/**/bench_examples.json) under {args.runs}")
    print(f"# {args.run.name} against the teacher ({teacher})")
    print("\n".join(recoveries(student, teacher)))
    for other in sorted(args.runs.glob("*/eval/student")):
        print(f"\n# {args.run.name} - {other.parent.parent.name}")
        print("\n".join(pairs(student, other)))


if __name__ == "__main__":
    main()
