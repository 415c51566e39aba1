"""Needle in a haystack as an evaluation task (harness.eval.niah does the work).

Settings: the spec's `niah:` section (harness.config.NiahConfig; lengths [] skips) and the spec-wide
`generation_batch_size`. Results: niah.json (+ .csv, heatmaps) and niah_cells.jsonl, one record per prompt keyed
by (kind, length, depth, index). It reports both of its scores by length: exact match of the greedy answer, and
the likelihood score (the true value ranked first among it and its distractors, teacher-forced; chance 1 /
candidates; niah.json files written before it have none, and their rows show only exact match). Both sides of a
report should use one prompt mode (the evaluation job passes the same one); the report says which, and warns if
not. Paired differences: both scores, overall and by length, over the prompts both runs were given.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from harness.eval.formatting import figure, fmt, read_json, run_name, teachers
from harness.eval.recovery import BOOTSTRAP_SAMPLES, BOOTSTRAP_SEED, difference
from harness.eval.tasks.base import Column, Curve, EvalTask, Score, TaskResults

NIAH_FILE, CELLS_FILE = "niah.json", "niah_cells.jsonl"
NIAH_SETTINGS = ("niah_format", "haystack", "prompt", "seed", "max_new_tokens", "tokenizer")  # the cells' header
LIKELIHOOD_KEYS = ("overall", "by_length", "by_depth", "mean_rank", "mean_rank_by_length", "chance", "chance_rank",
                   "candidates", "first_token_top1", "first_token_top1_by_length", "value_token_top1",
                   "value_token_top1_by_length")

NiahKey = tuple[str, int, float, int]


class NiahTask(EvalTask):
    name = "niah"
    title = "Needle in a haystack"
    spec_keys = ("niah",)
    run_order = 20
    plots = ("niah_by_length.png",)

    def settings_of(self, spec: Any) -> Any:
        return spec.niah

    def wanted(self, spec: Any) -> bool:
        return bool(spec.niah.lengths)

    def cache_key(self, spec: Any) -> dict:
        return {"haystack": spec.niah.haystack, "prompt": spec.niah.prompt}

    def for_during(self, spec: Any, during: Any) -> None:
        spec.niah.lengths, spec.niah.samples = list(during.niah_lengths), during.niah_samples

    def run(self, model: Any, tokenizer: Any, settings: Any, out_dir: Path, *, label: str, device: Any,
            progress: bool, spec: Any) -> dict:
        from harness.eval.niah import NiahGrid, run_niah

        grid = NiahGrid(lengths=list(settings.lengths), depths=list(settings.depths), kinds=list(settings.kinds),
                        samples=settings.samples, haystack=settings.haystack, prompt=settings.prompt,
                        distractors=settings.distractors)
        return run_niah(model, tokenizer, grid, out_dir, label=label, device=device, progress=progress,
                        generation_batch_size=spec.generation_batch_size)

    def summarise(self, folder: Path) -> Optional[TaskResults]:
        """Exact match and the likelihood score overall, per prompt keyed 'kind/length/depth/index'."""
        result = read_json(Path(folder) / NIAH_FILE)
        if result is None:
            return None
        prompts = read_niah_prompts(Path(folder))
        likelihood = result.get("likelihood") or {}
        n = len(prompts.records) if prompts else None
        scores = [Score("exact match", result["overall"], n), Score("likelihood", likelihood.get("overall"), n,
                                                                    chance=likelihood.get("chance"))]
        key = lambda k: "/".join(map(str, k))  # noqa: E731
        examples = {} if prompts is None else {
            "exact match": {key(k): float(r["correct"]) for k, r in prompts.records.items()},
            "likelihood": {key(k): float(r["top1"]) for k, r in prompts.records.items()}}
        return TaskResults(scores, examples, {**result.get("grid", {}), **(prompts.settings if prompts else {})})

    # ------------------------------------------------------------------------------------------ one run

    def report_fields(self, student_dir: Path, teacher_dir: Optional[Path]) -> dict:
        get = lambda d: read_json(d / NIAH_FILE) if d is not None else None  # noqa: E731
        return {"niah": niah_summary(get(student_dir), get(teacher_dir))}

    def markdown(self, report: dict) -> list[str]:
        niah = report.get("niah")
        if not niah:
            return []
        sides = [(side, niah[side]) for side in ("student", "teacher") if niah[side]]
        return (niah_length_table("Needle in a haystack (exact match)", sides)
                + [f"NIAH recovery (overall accuracy, student / teacher): {fmt(niah['recovery'], pct=True)}", ""]
                + niah_likelihood_table("Needle in a haystack (likelihood)", sides) + prompt_note(sides))

    # ------------------------------------------------------------------------------------------ several runs

    def comparison_columns(self) -> list[Column]:
        side = lambda r, s: (r.get("niah") or {}).get(s)  # noqa: E731
        return [("NIAH student", lambda r: fmt((side(r, "student") or {}).get("overall"), pct=True)),
                ("NIAH teacher", lambda r: fmt((side(r, "teacher") or {}).get("overall"), pct=True)),
                ("NIAH lik. student", lambda r: fmt(likelihood(side(r, "student")).get("overall"), pct=True)),
                ("NIAH lik. teacher", lambda r: fmt(likelihood(side(r, "teacher")).get("overall"), pct=True))]

    def comparison_legend(self) -> str:
        return ("NIAH: exact-match accuracy over all lengths, depths, kinds; NIAH lik.: the likelihood score, the "
                "true value ranked first among its candidates (chance: see its table)")

    def comparison_sections(self, reports: list[dict]) -> list[str]:
        sides = [(run_name(r), (r.get("niah") or {}).get("student")) for r in reports]
        sides += [(name, (r.get("niah") or {}).get("teacher")) for name, r in teachers(reports)]
        sides = [(name, result) for name, result in sides if result]
        if not sides:
            return []
        return (niah_length_table("Needle in a haystack by length (exact match)", sides)
                + niah_likelihood_table("Needle in a haystack by length (likelihood)", sides) + prompt_note(sides))

    def plot(self, reports: list[dict], out: Path) -> None:
        if any(r.get("niah") for r in reports):
            plot_niah_by_length(reports, Path(out) / self.plots[0])

    # ------------------------------------------------------------------------------------------ paired

    def pairing(self, student_dir: Path, report: dict) -> Optional["NiahPrompts"]:
        return read_niah_prompts(student_dir)

    def example_differences(self, a: Any, b: Any) -> list[str]:
        return niah_differences(a.data.get("niah"), b.data.get("niah"))

    def paired_rows(self, a: Any, b: Any, samples: int = BOOTSTRAP_SAMPLES, seed: int = BOOTSTRAP_SEED) -> list[dict]:
        return niah_rows(a.data.get("niah"), b.data.get("niah"), samples, seed)

    # ------------------------------------------------------------------------------------------ curves

    def curves(self) -> dict[str, Curve]:
        overall = lambda r, s: ((r.get("niah") or {}).get(s) or {}).get("overall")  # noqa: E731
        return {
            "niah_overall": Curve(lambda r: overall(r, "student"), "NIAH accuracy (overall)", True,
                                  lambda r: overall(r, "teacher")),
            "niah_recovery": Curve(lambda r: (r.get("niah") or {}).get("recovery"), "NIAH recovery (1.0 = teacher)",
                                   True, lambda r: 1.0),
            "niah_likelihood": Curve(lambda r: niah_likelihood(r, "student"),
                                     "NIAH likelihood: true value first (overall)", True,
                                     lambda r: niah_likelihood(r, "teacher")),
        }

    def default_curves(self) -> tuple[str, ...]:
        return ("niah_overall",)


# --------------------------------------------------------------------------------------------- report


def niah_side(result: Optional[dict]) -> Optional[dict]:
    """What a report keeps of one niah.json: exact match overall and by length, the prompt mode, and the likelihood
    score's LIKELIHOOD_KEYS (None for a niah.json written before the likelihood score)."""
    if result is None:
        return None
    lik = result.get("likelihood")
    return {"overall": result["overall"], "by_length": result["by_length"], "prompt_mode": result.get("prompt_mode"),
            "likelihood": None if lik is None else {k: lik.get(k) for k in LIKELIHOOD_KEYS}}


def niah_summary(student: Optional[dict], teacher: Optional[dict]) -> Optional[dict]:
    """Both sides' NIAH (`niah_side`) and the exact-match recovery, student / teacher overall."""
    if student is None and teacher is None:
        return None
    s, t = niah_side(student), niah_side(teacher)
    recovery = s["overall"] / t["overall"] if s and t and t["overall"] else None
    return {"student": s, "teacher": t, "recovery": recovery}


def niah_likelihood(report: dict, side: str) -> Optional[float]:
    """The overall NIAH likelihood score of a report's side; None for reports made before it."""
    niah = (report.get("niah") or {}).get(side) or {}
    return (niah.get("likelihood") or {}).get("overall")


def likelihood(side: Optional[dict]) -> dict:
    """The likelihood block of a report's NIAH side; {} when there is none (an older niah.json)."""
    return (side or {}).get("likelihood") or {}


def niah_likelihood_table(title: str, sides: list[tuple[str, dict]]) -> list[str]:
    """A Markdown section: one row per NIAH result that has the likelihood score, one column per prompt length,
    then overall, chance and the mean rank; [] when none has it."""
    rows = [(name, likelihood(result)) for name, result in sides if likelihood(result)]
    if not rows:
        return []
    lengths = sorted({int(k) for _, lik in rows for k in lik["by_length"]})
    head = " | ".join(str(n) for n in lengths)
    lines = [f"## {title}", "", f"| model | {head} | overall | chance | mean rank |", "|" + "---|" * (len(lengths) + 4)]
    for name, lik in rows:
        cells = [fmt(lik["by_length"].get(str(n)), pct=True) for n in lengths]
        cells += [fmt(lik["overall"], pct=True), fmt(lik.get("chance"), pct=True), fmt(lik.get("mean_rank"))]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    candidates = ", ".join(map(str, sorted({lik.get("candidates") for _, lik in rows if lik.get("candidates")})))
    return lines + ["", f"Likelihood: per sample, the needle's value and its distractors ({candidates} candidates; "
                        "other values of its kind, the same for every model) are scored as the answer by their summed "
                        "token log-probability, teacher-forced; accuracy = the true value ranked first (ties shared), "
                        "chance = 1 / candidates; mean rank 1 = best, chance (candidates + 1) / 2.", ""] \
        + first_token_table(rows, lengths)


def first_token_table(rows: list[tuple[str, dict]], lengths: list[int]) -> list[str]:
    """Beside the likelihood table: per length, the share of prompts whose value's first token is the model's most
    likely next token, then the same at the value's first token that carries a character of it; [] when no result
    has them (written before those fields)."""
    lines = []
    for prefix, what in (("first_token", "value's first token is the model's first choice"),
                         ("value_token", "value's first character token is the model's first choice")):
        scored = [(name, lik) for name, lik in rows if lik.get(f"{prefix}_top1") is not None]
        if not scored:
            continue
        if lines:
            lines.append("")
        lines += [f"| {what} | " + " | ".join(str(n) for n in lengths) + " | overall |",
                  "|" + "---|" * (len(lengths) + 2)]
        for name, lik in scored:
            by_length = lik.get(f"{prefix}_top1_by_length") or {}
            cells = [fmt(by_length.get(str(n)), pct=True) for n in lengths] + [fmt(lik[f"{prefix}_top1"], pct=True)]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if not lines:
        return []
    return lines + ["", "First token: teacher-forced at the answer's start, the value's first token ranked among the "
                        "whole vocabulary; where another token is more likely (prose, a restated question, a newline), "
                        "greedy decoding does not start the value however it ranks among the candidates. First character "
                        "token: the same at the value's first token that carries a character of it, after the value's "
                        "tokens before it (a number's first digit, after the lone space token that starts every "
                        "number in SmolLM2's tokenizer; elsewhere the first token again).", ""]


def prompt_note(sides: list[tuple[str, dict]]) -> list[str]:
    """One line naming the NIAH prompt mode, or a warning when the results compared used different ones."""
    modes = {name: result.get("prompt_mode") for name, result in sides if result.get("prompt_mode")}
    if len(set(modes.values())) > 1:
        detail = ", ".join(f"{name}: {mode}" for name, mode in modes.items())
        return [f"**Warning:** these NIAH results used different prompt modes ({detail}): not comparable.", ""]
    return [f"NIAH prompts: {next(iter(modes.values()))}.", ""] if modes else []


def niah_length_table(title: str, sides: list[tuple[str, dict]]) -> list[str]:
    """A Markdown section: one row per (name, NIAH result), one column per prompt length, then overall."""
    lengths = sorted({int(k) for _, result in sides for k in result["by_length"]})
    lines = [f"## {title}", "", "| model | " + " | ".join(str(n) for n in lengths) + " | overall |",
             "|" + "---|" * (len(lengths) + 2)]
    for name, result in sides:
        cells = [fmt(result["by_length"].get(str(n)), pct=True) for n in lengths]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {fmt(result['overall'], pct=True)} |")
    return lines + [""]


def plot_niah_by_length(reports: list[dict], path: Path) -> None:
    """Lines: NIAH accuracy against prompt length per run, the teacher dashed (once per distinct teacher); exact
    match, and beside it the likelihood score with its chance level dotted when any result has it."""
    has_likelihood = any(likelihood((r.get("niah") or {}).get(side)) for r in reports
                         for side in ("student", "teacher"))
    fig = figure(width=14.0 if has_likelihood else 9.5)
    axes = fig.subplots(1, 2) if has_likelihood else [fig.add_subplot()]
    plot_niah_panel(axes[0], reports, lambda side: side, "NIAH exact match (%)")
    if has_likelihood:
        plot_niah_panel(axes[1], reports, likelihood, "NIAH likelihood: true value first (%)")
        for chance in {lik.get("chance") for r in reports for side in ("student", "teacher")
                       if (lik := likelihood((r.get("niah") or {}).get(side))) and lik.get("chance")}:
            axes[1].axhline(100 * chance, color="gray", linestyle=":", linewidth=1)
    axes[-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))  # outside: lines at 0% hide nothing
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")


def plot_niah_panel(ax, reports: list[dict], pick, ylabel: str) -> None:
    """One panel of plot_niah_by_length: `pick(side)` gives the {"by_length"} block drawn from a report's side."""
    from harness.eval.training import run_line_style

    lines = [(run_name(r), pick(r["niah"]["student"]), run_line_style(i)) for i, r in enumerate(reports)
             if (r.get("niah") or {}).get("student")]
    teacher_styles = [{"color": "black", "linestyle": "--"}, {"color": "dimgray", "linestyle": "-."}]
    lines += [(name, pick(r["niah"]["teacher"]), teacher_styles[i % 2])
              for i, (name, r) in enumerate(teachers(reports)) if (r.get("niah") or {}).get("teacher")]
    for name, result, style in lines:
        if not result:
            continue
        xs = sorted(int(k) for k in result["by_length"])
        ax.plot(xs, [100 * result["by_length"][str(x)] for x in xs], marker="o", label=name, **style)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_ylim(-5, 105)


# --------------------------------------------------------------------------------------------- paired


@dataclass(frozen=True)
class NiahPrompts:
    """One model's NIAH prompts: the settings they depend on and the record of every prompt of the grid."""

    settings: dict  # niah_cells.jsonl's header, NIAH_SETTINGS only
    grid: dict  # niah.json's grid
    records: dict[NiahKey, dict]


def _niah_key(record: dict) -> NiahKey:
    return record["kind"], int(record["length"]), float(record["depth"]), int(record["index"])


def read_niah_prompts(folder: Path) -> Optional[NiahPrompts]:
    """The grid's prompts from folder/niah_cells.jsonl and folder/niah.json; None without both, or when a prompt
    of the grid has no record with both scores."""
    summary, cells = read_json(folder / NIAH_FILE), folder / CELLS_FILE
    if summary is None or not cells.is_file():
        return None
    lines = [json.loads(line) for line in cells.read_text(encoding="utf-8").splitlines() if line.strip()]
    header = lines[0].get("header", {}) if lines else {}
    records = {_niah_key(r): r for r in lines[1:]}
    grid = summary["grid"]
    keys = [(kind, int(length), float(depth), i) for length in grid["lengths"] for depth in grid["depths"]
            for kind in grid["kinds"] for i in range(grid["samples"])]
    if any(k not in records or "top1" not in records[k] for k in keys):
        return None
    return NiahPrompts({k: header.get(k) for k in NIAH_SETTINGS}, grid, {k: records[k] for k in keys})


def niah_differences(a: Optional[NiahPrompts], b: Optional[NiahPrompts]) -> list[str]:
    """What differs between two runs' NIAH prompts ([] when they are the same prompts)."""
    if a is None or b is None:
        return []  # only one run has them: EvalTask.unpaired names that
    found = [f"NIAH {k} ({a.grid.get(k)} against {b.grid.get(k)})"
             for k in sorted(set(a.grid) | set(b.grid)) if a.grid.get(k) != b.grid.get(k)]
    found += [f"NIAH {k} ({a.settings[k]} against {b.settings[k]})"
              for k in NIAH_SETTINGS if a.settings[k] != b.settings[k]]
    if not found:
        other = [k for k in a.records if a.records[k]["value"] != b.records[k]["value"]]
        found += [f"NIAH needles ({len(other)} prompts hide different values)"] if other else []
    return found


def niah_rows(a: Optional[NiahPrompts], b: Optional[NiahPrompts], samples: int = BOOTSTRAP_SAMPLES,
              seed: int = BOOTSTRAP_SEED) -> list[dict]:
    """NIAH exact match and likelihood score (top1), overall and by length, over the prompts both were given."""
    if a is None or b is None:
        return []
    keys = list(a.records)
    rows = []
    for label, field in (("exact match", "correct"), ("likelihood", "top1")):
        score = lambda run, ks: [float(run.records[k][field]) for k in ks]  # noqa: E731
        groups = [("overall", keys)] + [(f"{n} tokens", [k for k in keys if k[1] == n]) for n in a.grid["lengths"]]
        for name, ks in groups:
            row = difference(score(a, ks), score(b, ks), stream=f"niah {field} {name}", samples=samples, seed=seed)
            rows.append({"metric": f"NIAH {label}, {name}", "unit": "fraction", **row})
    return rows

