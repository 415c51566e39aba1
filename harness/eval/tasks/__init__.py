"""Evaluation tasks behind one interface (harness.eval.tasks.base): each task one module, found through the
registry by the evaluation job (harness.eval.job), the spec (harness.eval.spec), the report and comparisons
(harness.eval.report), the paired differences (harness.eval.paired), the curves (harness.eval.curves) and the
evaluations along stage 3 (harness.eval.during).

    base.py          EvalTask (the hooks), ScoredTask (the hooks derived from `summarise`), Score, TaskResults,
                     Curve, and the registry: register_task, unregister_task, tasks, get_task
    benchmarks.py    lm-eval benchmarks (harness.eval.lm_eval_tasks): the rows of the recovery table
    niah.py          needle in a haystack (harness.eval.niah): exact match and likelihood by length
    perplexity.py    held-out perplexity (harness.eval.perplexity)
    chat_samples.py  greedy answers to fixed chat prompts (harness.eval.chat_samples)
    copy_probe.py    copy accuracy on random tokens shown twice, induction and previous-token scores per layer
                     (harness.eval.copy)
    text_copy.py     copy accuracy on text: generator:copy documents (string, cue, string), the second showing
                     beside the first (a task in one module; scripts/text_copy_score.py uses its scoring)
    state_probe.py   recurrent state along the context, retrieval against distance (harness.eval.state)
    ifeval.py        instruction following: IFEval-style prompts scored by if-verifiable (off unless asked)

Importing the package registers those eight, in that order (the order of the reports; the job runs them cheap
first: perplexity, NIAH, copy, copy on text, chat samples, instruction following, state, benchmarks).
"""

from harness.eval.tasks.base import (Curve, EvalTask, Score, ScoredTask, TaskResults, describe_tasks, get_task,
                                     register_task, task_names, tasks, tasks_in_run_order, unregister_task)
from harness.eval.tasks.benchmarks import BenchmarksTask
from harness.eval.tasks.chat_samples import ChatSamplesTask
from harness.eval.tasks.copy_probe import CopyTask
from harness.eval.tasks.ifeval import IfevalTask
from harness.eval.tasks.niah import NiahTask
from harness.eval.tasks.perplexity import PerplexityTask
from harness.eval.tasks.state_probe import StateTask
from harness.eval.tasks.text_copy import TextCopyTask

for _task in (BenchmarksTask(), NiahTask(), PerplexityTask(), ChatSamplesTask(), CopyTask(), TextCopyTask(),
              StateTask(), IfevalTask()):
    register_task(_task, replace=True)

__all__ = ["Curve", "EvalTask", "Score", "ScoredTask", "TaskResults", "describe_tasks", "get_task", "register_task",
           "task_names", "tasks", "tasks_in_run_order", "unregister_task"]
