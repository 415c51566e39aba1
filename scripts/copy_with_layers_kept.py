r"""Which softmax layers must a hybrid keep for the teacher's copying to survive? The teacher with a SET of layers
linearized at once, all but the kept ones, scored on the copy probe: `harness transfer --rank-layers --rank-by copy`
replaces one layer at a time and cannot see how the layers of the copy circuit interact.

    .venv/bin/python scripts/copy_with_layers_kept.py jobs/study-small-50m/smollm2-135m-gated_deltanet-50m.yaml \
        --linearize 0-2,16-20,23 --keep none --keep 16,18 --keep 17,18 --keep 18,23 \
        --seq-len 128 --sequences 8 --out docs/results/retrieval-135m/copy-kept/circuit-window16 run.device=cpu \
        data.source=embedded data.allow_repeat=true student.options.window=16

Each --keep is one configuration: the layers of --linearize minus the kept ones are replaced by their mixers, as
the ranking builds them (`harness.ranking.start_mixers`: the stage-1 weights where the job's run has them, else
the mixer as stage 1 starts it), and the model is scored on the ranking's copy prompts (`harness.ranking.CopyProbe`:
copies of seq_len // 2 random tokens, the same prompts for every configuration). key=value overrides after the
options change the job as they do for `harness`. Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from harness.config import load_job


def parse_layers(text: str) -> list[int]:
    """'0-2,16,18' -> [0, 1, 2, 16, 18]; 'none' -> []."""
    if text.strip().lower() == "none":
        return []
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise argparse.ArgumentTypeError(f"'{text}' is not a list of layers such as 0-2,16,18 (or 'none')")
        out += list(range(int(lo), int(hi or lo) + 1))
    return sorted(set(out))


def copy_with_kept(job: Any, linearize: Sequence[int], keeps: Sequence[Sequence[int]], *, sequences: int = 8,
                   seq_len: int = 128, device: Optional[torch.device] = None) -> dict[str, Any]:
    """The teacher's copy accuracy and, for each kept set, that of the teacher with `linearize` minus the kept set
    replaced by their mixers at once."""
    from harness.data import prepare_job_corpus
    from harness.ranking import CopyProbe, MixerAsAttention, replaced_attention, start_mixers
    from harness.stages.align import first_batch, stage_autocast
    from harness.stages.common import load_job_teacher, num_student_layers, resolve_device
    from harness.student import rope_for, student_config

    device = device or resolve_device(job)
    n_layers = num_student_layers(job)
    bad = [l for l in list(linearize) + [k for keep in keeps for k in keep] if not 0 <= l < n_layers]
    if bad:
        raise SystemExit(f"layers {bad} are outside the teacher's 0-{n_layers - 1}.")
    teacher = load_job_teacher(job, device)
    model = teacher.model
    corpus = prepare_job_corpus(job, teacher.tokenizer, max_positions=model.config.max_position_embeddings)
    config = student_config(model.config, job.student.mixer, dict(job.student.options))
    mixers = start_mixers(job, model, config, sorted(set(linearize)), first_batch(job, corpus).to(device), device)
    rope, autocast = rope_for(config, device), (lambda: stage_autocast(job, device))
    probe = CopyProbe.for_model(model, teacher.tokenizer, sequences, seq_len, device)
    rows = []
    with torch.no_grad():
        teacher_acc = probe.accuracy(model)
        for keep in keeps:
            replaced = [l for l in sorted(set(linearize)) if l not in set(keep)]
            with contextlib.ExitStack() as stack:
                for l in replaced:
                    mixer, _ = mixers[l]
                    mixer.eval()
                    stack.enter_context(replaced_attention(model, l, MixerAsAttention(mixer, rope, autocast())))
                acc = probe.accuracy(model)
            rows.append({"keep": list(keep), "replaced": replaced, "copy_acc": acc,
                         "weights": sorted({mixers[l][1] for l in replaced})})
    return {"job": job.name, "mixer": job.student.mixer, "options": dict(job.student.options),
            "linearize": sorted(set(linearize)), "copy_length": probe.length, "sequences": int(probe.rows.shape[0]),
            "teacher_copy_acc": teacher_acc, "rows": rows}


def markdown(result: dict[str, Any], command: str) -> str:
    lines = ["# Copy accuracy with a set of layers linearized at once, some kept as attention", "",
             f"Command: `{command}`", f"Machine: {platform.node()} ({platform.machine()}, CPU), "
             f"{time.strftime('%Y-%m-%d')}", "",
             f"Job {result['job']}, mixer {result['mixer']}, options {result['options']}; copies of "
             f"{result['copy_length']} tokens, {result['sequences']} sequences; linearized unless kept: "
             f"{result['linearize']}. The teacher: {result['teacher_copy_acc']:.1%}.", "",
             "| kept as attention | layers replaced | weights | copy accuracy |", "|---|---|---|---|"]
    for r in result["rows"]:
        kept = ", ".join(map(str, r["keep"])) or "none"
        lines.append(f"| {kept} | {len(r['replaced'])} | {'/'.join(r['weights']) or '-'} | {r['copy_acc']:.1%} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("job", help="The job file (its student mixer and options, teacher and data).")
    p.add_argument("--linearize", type=parse_layers, required=True,
                   help="Layers replaced by their mixers unless kept, e.g. 0-29 or 0-2,16-20,23.")
    p.add_argument("--keep", type=parse_layers, action="append", required=True,
                   help="One configuration's layers kept as the teacher's attention (e.g. 16,18, or none); repeat.")
    p.add_argument("--sequences", type=int, default=8, help="Copy prompts (at least 8).")
    p.add_argument("--seq-len", type=int, default=128, help="Prompt length: copies of seq_len // 2 tokens.")
    p.add_argument("--out", type=Path, required=True, help="Writes OUT.json and OUT.md.")
    args, overrides = p.parse_known_args(argv)
    if any("=" not in o for o in overrides):
        p.error(f"unknown arguments {[o for o in overrides if '=' not in o]}: overrides are key=value")
    job = load_job(args.job, overrides)
    result = copy_with_kept(job, args.linearize, args.keep, sequences=args.sequences, seq_len=args.seq_len)
    command = "python scripts/copy_with_layers_kept.py " + " ".join(sys.argv[1:] if argv is None else argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps({**result, "command": command}, indent=1) + "\n")
    Path(f"{args.out}.md").write_text(markdown(result, command))
    print(markdown(result, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
