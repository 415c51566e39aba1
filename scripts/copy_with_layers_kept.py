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


class KeptSets:
    """The teacher, the mixers of `linearize` and the copy prompts, built once; `score(keep)` measures one kept set:
    the teacher with `linearize` minus `keep` replaced by their mixers at once, put back afterwards."""

    def __init__(self, job: Any, linearize: Sequence[int], *, sequences: int = 8, seq_len: int = 128,
                 device: Optional[torch.device] = None):
        from harness.data import prepare_job_corpus
        from harness.ranking import CopyProbe, start_mixers
        from harness.stages.align import first_batch, stage_autocast
        from harness.stages.common import load_job_teacher, num_student_layers, resolve_device
        from harness.student import rope_for, student_config

        device = device or resolve_device(job)
        n_layers = num_student_layers(job)
        bad = [l for l in linearize if not 0 <= l < n_layers]
        if bad:
            raise SystemExit(f"layers {bad} are outside the teacher's 0-{n_layers - 1}.")
        teacher = load_job_teacher(job, device)
        self.job, self.model, self.linearize = job, teacher.model, sorted(set(linearize))
        corpus = prepare_job_corpus(job, teacher.tokenizer, max_positions=self.model.config.max_position_embeddings)
        config = student_config(self.model.config, job.student.mixer, dict(job.student.options))
        self.mixers = start_mixers(job, self.model, config, self.linearize, first_batch(job, corpus).to(device),
                                   device)
        for mixer, _ in self.mixers.values():
            mixer.eval()
        self.rope, self.autocast = rope_for(config, device), (lambda: stage_autocast(job, device))
        self.probe = CopyProbe.for_model(self.model, teacher.tokenizer, sequences, seq_len, device)
        with torch.no_grad():
            self.teacher = self.probe.measure(self.model)

    @torch.no_grad()
    def score(self, keep: Sequence[int]) -> dict[str, Any]:
        from harness.ranking import MixerAsAttention, replaced_attention

        bad = sorted(set(keep) - set(self.linearize))
        if bad:
            raise SystemExit(f"kept layers {bad} are not among the linearized {self.linearize}.")
        replaced = [l for l in self.linearize if l not in set(keep)]
        with contextlib.ExitStack() as stack:
            for l in replaced:
                mixer = MixerAsAttention(self.mixers[l][0], self.rope, self.autocast())
                stack.enter_context(replaced_attention(self.model, l, mixer))
            scores = self.probe.measure(self.model)
        return {"keep": sorted(keep), "replaced": replaced, **scores,
                "weights": sorted({self.mixers[l][1] for l in replaced})}

    def header(self) -> dict[str, Any]:
        return {"job": self.job.name, "mixer": self.job.student.mixer, "options": dict(self.job.student.options),
                "linearize": self.linearize, "copy_length": self.probe.length,
                "sequences": int(self.probe.rows.shape[0]), "teacher_copy_acc": self.teacher["copy_acc"],
                "teacher_nll_after_first": self.teacher["nll_after_first"]}


def copy_with_kept(job: Any, linearize: Sequence[int], keeps: Sequence[Sequence[int]], *, sequences: int = 8,
                   seq_len: int = 128, device: Optional[torch.device] = None) -> dict[str, Any]:
    """The teacher's copy accuracy and, for each kept set, that of the teacher with `linearize` minus the kept set
    replaced by their mixers at once."""
    sets = KeptSets(job, linearize, sequences=sequences, seq_len=seq_len, device=device)
    return {**sets.header(), "rows": [sets.score(keep) for keep in keeps]}


def ranked(candidates: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One round's candidates, best first: the lowest copy NLL, then the higher accuracy, then the lower layer."""
    return sorted(candidates, key=lambda c: (c["nll_after_first"], -c["copy_acc"], c["layer"]))


def greedy_keep(job: Any, linearize: Sequence[int], k: int, *, start: Sequence[int] = (), sequences: int = 8,
                seq_len: int = 128, device: Optional[torch.device] = None, progress: bool = True) -> dict[str, Any]:
    """Forward selection of the layers to keep: starting from `start`, each round keeps the one more layer of
    `linearize` that leaves the lowest copy NLL (ties: higher accuracy, then the lower layer), until k are kept.
    The NLL, not the accuracy, picks: with most layers linearized every accuracy is 0 and would not tell them apart."""
    from tqdm.auto import tqdm

    sets = KeptSets(job, linearize, sequences=sequences, seq_len=seq_len, device=device)
    kept, rounds = sorted(set(start)), []
    if not 0 < k <= len(sets.linearize) or len(kept) >= k:
        raise SystemExit(f"--greedy {k}: must be more than the {len(kept)} layers kept at the start and at most "
                         f"the {len(sets.linearize)} linearized.")
    total = sum(len(sets.linearize) - n for n in range(len(kept), k))
    with tqdm(total=total, desc="kept sets", unit="set", disable=not progress) as bar:
        while len(kept) < k:
            candidates = []
            for layer in (l for l in sets.linearize if l not in kept):
                scored = sets.score(kept + [layer])
                del scored["replaced"]  # `linearize` minus `keep`: not repeated for every candidate
                candidates.append({"layer": layer, **scored})
                bar.update()
            best = ranked(candidates)[0]
            kept = best["keep"]
            rounds.append({"chosen": best["layer"], "kept": kept, "candidates": candidates})
    return {**sets.header(), "start": sorted(set(start)), "rounds": rounds}


def _preamble(result: dict[str, Any], command: str, title: str) -> list[str]:
    return [f"# {title}", "", f"Command: `{command}`", f"Machine: {platform.node()} ({platform.machine()}, CPU), "
            f"{time.strftime('%Y-%m-%d')}", "",
            f"Job {result['job']}, mixer {result['mixer']}, options {result['options']}; copies of "
            f"{result['copy_length']} tokens, {result['sequences']} sequences; linearized unless kept: "
            f"{result['linearize']}. The teacher: {result['teacher_copy_acc']:.1%} (NLL after the first token "
            f"{result['teacher_nll_after_first']:.2f} nats).", ""]


def _kept(layers: Sequence[int]) -> str:
    return ", ".join(map(str, layers)) or "none"


def markdown(result: dict[str, Any], command: str) -> str:
    lines = _preamble(result, command, "Copy accuracy with a set of layers linearized at once, some kept as attention")
    lines += ["| kept as attention | layers replaced | weights | copy accuracy | NLL after first |",
              "|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {_kept(r['keep'])} | {len(r['replaced'])} | {'/'.join(r['weights']) or '-'} | "
                     f"{r['copy_acc']:.1%} | {r['nll_after_first']:.2f} |")
    return "\n".join(lines) + "\n"


def greedy_markdown(result: dict[str, Any], command: str, shown: int = 8) -> str:
    lines = _preamble(result, command, "Which layers to keep, chosen one at a time (forward selection by copy NLL)")
    lines += [f"Start: {_kept(result['start'])}. Each round keeps the candidate that leaves the lowest NLL.", "",
              "| round | kept | copy accuracy | NLL after first | runner-up (its NLL) |", "|---|---|---|---|---|"]
    rounds = [ranked(r["candidates"]) for r in result["rounds"]]
    for i, (r, order) in enumerate(zip(result["rounds"], rounds), 1):
        runner = f"{order[1]['layer']} ({order[1]['nll_after_first']:.2f})" if len(order) > 1 else "-"
        lines.append(f"| {i} | {_kept(r['kept'])} | {order[0]['copy_acc']:.1%} | "
                     f"{order[0]['nll_after_first']:.2f} | {runner} |")
    for i, order in enumerate(rounds, 1):
        lines += ["", f"Round {i}: the {min(shown, len(order))} best of {len(order)} candidates (all in the JSON)",
                  "", "| layer added | copy accuracy | NLL after first |", "|---|---|---|"]
        lines += [f"| {c['layer']} | {c['copy_acc']:.1%} | {c['nll_after_first']:.2f} |" for c in order[:shown]]
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("job", help="The job file (its student mixer and options, teacher and data).")
    p.add_argument("--linearize", type=parse_layers, required=True,
                   help="Layers replaced by their mixers unless kept, e.g. 0-29 or 0-2,16-20,23.")
    p.add_argument("--keep", type=parse_layers, action="append",
                   help="One configuration's layers kept as the teacher's attention (e.g. 16,18, or none); repeat. "
                        "With --greedy: the layers kept at the start (once; default none).")
    p.add_argument("--greedy", type=int, metavar="K",
                   help="Instead of scoring the --keep sets, choose K layers to keep one at a time: each round adds "
                        "the layer whose keeping leaves the lowest copy NLL (forward selection).")
    p.add_argument("--sequences", type=int, default=8, help="Copy prompts (at least 8).")
    p.add_argument("--seq-len", type=int, default=128, help="Prompt length: copies of seq_len // 2 tokens.")
    p.add_argument("--out", type=Path, required=True, help="Writes OUT.json and OUT.md.")
    args, overrides = p.parse_known_args(argv)
    if any("=" not in o for o in overrides):
        p.error(f"unknown arguments {[o for o in overrides if '=' not in o]}: overrides are key=value")
    if args.greedy is None and not args.keep:
        p.error("give the kept sets to score (--keep, repeated) or --greedy K")
    if args.greedy is not None and len(args.keep or []) > 1:
        p.error("with --greedy, --keep gives the one set kept at the start")
    job = load_job(args.job, overrides)
    command = "python scripts/copy_with_layers_kept.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.greedy is None:
        result = copy_with_kept(job, args.linearize, args.keep, sequences=args.sequences, seq_len=args.seq_len)
        text = markdown(result, command)
    else:
        result = greedy_keep(job, args.linearize, args.greedy, start=(args.keep or [[]])[0],
                             sequences=args.sequences, seq_len=args.seq_len)
        text = greedy_markdown(result, command)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps({**result, "command": command}, indent=1) + "\n")
    Path(f"{args.out}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
