"""Evaluation of students and teachers: what each module measures.

    spec.py          the evaluation job spec (RUN_DIR/eval.yaml) that stage 3 writes
    niah.py          needle in a haystack: exact-match retrieval at depth x length, heatmap
    niah_summary.py  NIAH's niah.json, niah.csv and heatmaps from its sample records
    lm_eval_tasks.py benchmarks through lm-evaluation-harness (offline on local data: benchmark_data.py)
    perplexity.py    perplexity on the corpus' held-out slice or any text file
    tasks/           each evaluation a task behind one interface (EvalTask) and the registry the modules below ask
    job.py           `harness eval EVAL.yaml`: every registered task for a student and its teacher, then the report
    recovery.py      chance levels, chance-normalised recovery, paired bootstrap intervals over examples
    report.py        teacher recovery (raw and normalised), each task's section, comparisons across runs, plots
    paired.py        run-vs-run paired differences on the same examples
    formatting.py    what the report's and the tasks' tables share

Modules import torch, lm-eval and matplotlib lazily where they can, so that `import harness.eval.spec` stays light.
"""
