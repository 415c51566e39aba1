"""Seed a lent machine's teacher caches from a teacher evaluation already made, so that no run scores it again.

A study's runs share the teacher's results through `eval.teacher_cache` (harness/eval/job.py): one folder per
teacher-cache key. Runs at another sequence length (the paper recipe's 512 against the study's 2048) have another
key only because the held-out perplexity is cut from their own data; the benchmarks and NIAH do not depend on it.
This writes OUT/<cache folder>/<key folder> for each JOB from SOURCE, the cache of FROM_JOB: everything when the
keys are equal, everything but perplexity.json (which the run then computes, a few seconds) when they differ only
in the perplexity settings, and refuses otherwise. `study_small_device.sh setup` copies OUT into the runs folder.

    .venv/bin/python scripts/study_seed.py --from-job jobs/study-small-50m/smollm2-135m-gated_deltanet-50m.yaml \\
        --source docs/results/study-small-50m/runs/teacher-2048 \\
        jobs/study-small-50m/smollm2-135m-kda-50m.yaml jobs/paper-recipe/smollm2-135m-gated_deltanet-50m-paper.yaml
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from harness.config import load_job, to_yaml
from harness.eval.job import PERPLEXITY_FILE, teacher_cache_key, teacher_results_dir
from harness.eval.spec import EvalSpec, spec_from_job


def job_spec(path: str, work: Path) -> EvalSpec:
    """The evaluation spec `harness run` would write for JOB (its job.yaml dumped as the run dumps it)."""
    job = load_job(path)
    if not job.eval.teacher or not job.eval.teacher_cache:
        raise SystemExit(f"{path}: eval.teacher_cache is not set, so its runs share no teacher results to seed")
    dumped = work / f"{Path(path).stem}.yaml"
    dumped.write_text(to_yaml(job))
    return spec_from_job(job, work, dumped)


def seed(job_path: str, source: Path, from_spec: EvalSpec, out: Path, work: Path) -> Path:
    """Copy FROM_JOB's cached teacher results in SOURCE to where JOB's runs look for theirs, under OUT."""
    spec = job_spec(job_path, work)
    have, want = teacher_cache_key(from_spec), teacher_cache_key(spec)
    differs = sorted(k for k in want if want[k] != have[k])
    if set(differs) - {"perplexity"}:
        raise SystemExit(f"{job_path}: its teacher results differ from the source's in {differs}, not only in "
                         f"'perplexity': they must be computed, not seeded")
    src = source / teacher_results_dir(from_spec).name
    if not src.is_dir():
        raise SystemExit(f"{src} does not exist: SOURCE must be the teacher cache of --from-job")
    dst = out / Path(str(spec.teacher_cache)).name / teacher_results_dir(spec).name
    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.is_file() and not (differs and f.name == PERPLEXITY_FILE):
            shutil.copy2(f, dst / f.name)
    what = "all but the perplexity" if differs else "all"
    print(f"{job_path}: {what} of {src} -> {dst}")
    return dst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("jobs", nargs="+", metavar="JOB", help="The jobs whose runs will read the seeded caches.")
    p.add_argument("--from-job", required=True, help="A job whose teacher cache SOURCE holds (same teacher).")
    p.add_argument("--source", required=True, type=Path, help="That teacher cache folder (e.g. .../teacher-2048).")
    p.add_argument("--out", type=Path, default=Path(".cache/study-seed"), help="Default: .cache/study-seed.")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        from_spec = job_spec(args.from_job, Path(tmp))
        for job in args.jobs:
            seed(job, args.source, from_spec, args.out, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
