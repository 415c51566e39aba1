"""Instruction following as an evaluation task: greedy answers of student and teacher to the IFEval-style prompts of
harness.eval.ifeval_prompts, scored by if-verifiable's IFEval checkers (harness.eval.verifiable).

Settings: the spec's section `ifeval:`, from the job's eval.ifeval (harness.config.IfevalConfig): off unless the job
or the spec asks for it (`harness eval RUN/eval.yaml 'ifeval={}'`). Each prompt is one user turn, framed as the chat
samples frame theirs (harness.eval.chat_samples: the chat template with the generation prompt, or plain
`User:`/`Assistant:` text) and decoded greedily, `generation_batch_size` prompts at a time (the spec's), up to
`max_new_tokens`; the answer ends at EOS or the template's end of turn.

Results per model: ifeval_responses.jsonl (a header line with what every record depends on: the prompt set's
digest, the prompt mode, max_new_tokens, the label; then one record per prompt with its response and each
instruction's strict and loose verdict; resumable: a re-run keeps the records there and a different header is an
error) and ifeval.json (the scores, per instruction id too, and the ids of the prompts scored).

Scores (IFEval's four): prompt-level strict / loose (a prompt counts when every one of its instructions is
followed) and instruction-level strict / loose (the share of all instructions followed). Prompt-level intervals
bootstrap the prompts; instruction-level intervals bootstrap the prompts too (ratio of followed to given
instructions, since a prompt's instructions are judged on one response); the paired differences between runs pair
prompts and, for the instruction-level scores, instructions (`<prompt id>/<k>`). No chance level: the scores stay out
of the recovery table. Drawn along stage 3 as ifeval_prompt_level_strict and ifeval_instruction_level_strict.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import numpy as np

from harness.config import ConfigError, IfevalConfig
from harness.eval.records import append_record, changed_settings
from harness.eval.tasks.base import Score, ScoredTask, TaskResults
from harness.files import atomic_write_text

RECORDS_FILE, JSON_FILE = "ifeval_responses.jsonl", "ifeval.json"
FORMAT = 1  # the layout of the records file
PROMPT_STRICT, PROMPT_LOOSE = "prompt-level strict", "prompt-level loose"
INSTRUCTION_STRICT, INSTRUCTION_LOOSE = "instruction-level strict", "instruction-level loose"


class IfevalTask(ScoredTask):
    name, title = "ifeval", "Instruction following (IFEval-style prompts, if-verifiable checkers)"
    run_order = 32
    runs_by_default = False  # a job asks for it: minutes of generation per model on a CPU
    curve_scores = {PROMPT_STRICT: True, INSTRUCTION_STRICT: True}

    settings = IfevalConfig

    def for_during(self, spec: Any, during: Any) -> None:
        """Along stage 3: the first `during_prompts` prompts."""
        settings = self.settings_of(spec)
        if settings is not None:
            settings.prompts = min(settings.prompts or settings.during_prompts, settings.during_prompts)

    def run(self, model: Any, tokenizer: Any, settings: IfevalConfig, out_dir: Path, *, label: str, device: Any,
            progress: bool, spec: Any) -> dict:
        """Answer the prompts not answered yet, score them, and write ifeval.json."""
        from harness.eval.chat_samples import resolve_chat_mode
        from harness.eval.ifeval_prompts import prompt_set, prompt_set_digest
        from harness.eval.verifiable import LIBRARY

        prompts = list(prompt_set())[: settings.prompts]
        mode = resolve_chat_mode(tokenizer, str(settings.prompt))
        header = {"format": FORMAT, "label": label, "prompt_set": prompt_set_digest(), "prompt_mode": mode,
                  "max_new_tokens": settings.max_new_tokens, "checker": LIBRARY}
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        records = load_records(out / RECORDS_FILE, header)
        todo = [p for p in prompts if p.id not in records]
        for record in answer(model, tokenizer, todo, mode, settings.max_new_tokens, device,
                             spec.generation_batch_size, label if progress else None):
            append_record(out / RECORDS_FILE, record)
            records[record["id"]] = record
        result = summary([records[p.id] for p in prompts], header)
        atomic_write_text(out / JSON_FILE, json.dumps(result, indent=1) + "\n")
        return result

    def summarise(self, folder: Path) -> Optional[TaskResults]:
        """The four scores over the prompts ifeval.json names, with each prompt's (and instruction's) value."""
        from harness.eval.formatting import read_json

        result, path = read_json(Path(folder) / JSON_FILE), Path(folder) / RECORDS_FILE
        if result is None or not path.is_file():
            return None
        by_id = {r["id"]: r for r in _read_records(path)[1]}
        records = [by_id[i] for i in result["ids"] if i in by_id]
        if not records:
            return None
        return results_of(records, result["settings"])


def results_of(records: list[dict], settings: dict) -> TaskResults:
    """The four scores of scored records (each with "id", "strict" and "loose": one verdict per instruction)."""
    from harness.eval.recovery import paired_bootstrap, percentile_interval

    n = len(records)
    examples = {PROMPT_STRICT: {r["id"]: float(all(r["strict"])) for r in records},
                PROMPT_LOOSE: {r["id"]: float(all(r["loose"])) for r in records}}
    scores = [Score(PROMPT_STRICT, sum(examples[PROMPT_STRICT].values()) / n, n),
              Score(PROMPT_LOOSE, sum(examples[PROMPT_LOOSE].values()) / n, n)]
    counts = np.array([len(r["strict"]) for r in records], dtype=float)
    for name, key in ((INSTRUCTION_STRICT, "strict"), (INSTRUCTION_LOOSE, "loose")):
        followed = np.array([sum(r[key]) for r in records], dtype=float)
        means = paired_bootstrap(np.stack([followed, counts]), stream=f"ifeval {name}")
        interval = percentile_interval(means[0] / means[1])
        scores.append(Score(name, float(followed.sum() / counts.sum()), int(counts.sum()), interval))
        examples[name] = {f"{r['id']}/{k}": float(v) for r in records for k, v in enumerate(r[key])}
    keys = ("prompt_set", "prompt_mode", "max_new_tokens", "checker")
    return TaskResults(scores, examples, {**{k: settings.get(k) for k in keys}, "prompts": n})


def summary(records: list[dict], header: dict) -> dict:
    """ifeval.json: the settings, the ids scored, the four scores and each instruction id's strict and loose share."""
    results = results_of(records, header)
    by_instruction: dict[str, dict[str, list[float]]] = {}
    for r in records:
        for k, instruction_id in enumerate(r["instruction_ids"]):
            entry = by_instruction.setdefault(instruction_id, {"strict": [], "loose": []})
            entry["strict"].append(float(r["strict"][k]))
            entry["loose"].append(float(r["loose"][k]))
    return {"label": header["label"], "settings": {**header, "prompts": len(records)}, "ids": [r["id"] for r in records],
            "scores": {s.name: {"value": s.value, "n": s.n} for s in results.scores},
            "by_instruction": {i: {"n": len(v["strict"]), "strict": sum(v["strict"]) / len(v["strict"]),
                                   "loose": sum(v["loose"]) / len(v["loose"])}
                               for i, v in sorted(by_instruction.items())},
            "stopped": {s: sum(r["stopped"] == s for r in records) for s in sorted({r["stopped"] for r in records})}}


def score(prompt: Any, response: str) -> dict:
    """One prompt's record fields for `response`: each instruction's strict and loose verdict (if-verifiable)."""
    from harness.eval.verifiable import follow

    verdicts = follow(prompt.prompt, prompt.instruction_ids, prompt.kwargs, response)
    return {"strict": [v.strict for v in verdicts], "loose": [v.loose for v in verdicts]}


def answer(model: Any, tokenizer: Any, prompts: list, mode: str, max_new_tokens: int, device: Any,
           batch_size: int, label: Optional[str] = None):
    """Yield a scored record per prompt: greedy answers, `batch_size` prompts at a time (by length)."""
    import torch

    from harness.decoding import check_batch_size, length_batches
    from harness.eval.chat_samples import generate_responses, prompt_ids, stop_ids

    if not prompts:
        return
    check_batch_size(batch_size)
    if isinstance(model, torch.nn.Module):
        model.to(device).eval()
    stop = stop_ids(model, tokenizer)
    ids = [prompt_ids(tokenizer, p.prompt, mode) for p in prompts]
    done = 0
    for batch in length_batches([len(x) for x in ids], batch_size):
        found = generate_responses(model, tokenizer, [ids[i] for i in batch], max_new_tokens=max_new_tokens,
                                   stop=stop, plain=mode == "plain", device=device)
        for i, reply in zip(batch, found):
            p = prompts[i]
            done += 1
            if label is not None:
                print(f"[ifeval] {label} {done}/{len(prompts)} ({p.id}): {reply['tokens']} tokens", flush=True)
            yield {**p.as_dict(), **reply, **score(p, reply["response"])}


def load_records(path: Path, header: dict) -> dict[str, dict]:
    """The records in `path` by prompt id after checking its header; a new file gets `header` written. A last line
    cut short by a crash is dropped; a different header raises ConfigError naming what changed."""
    saved, records = _read_records(path, repair=True) if path.exists() else (None, [])
    if saved is None:
        path.write_text(json.dumps({"header": header}) + "\n")
        return {}
    detail = changed_settings(saved, header)
    if detail:
        raise ConfigError(f"{path} holds answers made otherwise ({detail}). Use another output folder or delete the "
                          "file to start over.")
    return {r["id"]: r for r in records}


def _read_records(path: Path, repair: bool = False) -> tuple[Optional[dict], list[dict]]:
    """(header, records) of a records file; with `repair`, a last line cut short is cut off the file."""
    raw = path.read_bytes()
    if raw and not raw.endswith(b"\n"):
        raw = raw[: raw.rfind(b"\n") + 1]
        if repair:
            with open(path, "r+b") as f:
                f.truncate(len(raw))
    lines = raw.decode("utf-8").split("\n")  # not splitlines(): a response may hold U+2028 and the like
    if not lines[0]:
        return None, []
    return json.loads(lines[0]).get("header", {}), [json.loads(line) for line in lines[1:] if line.strip()]
