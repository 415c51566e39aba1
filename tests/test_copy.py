"""The copy probe (harness/eval/copy.py): copy accuracy on repeated random tokens and per-layer induction and
previous-token scores.

Test doubles: an oracle that copies by construction (its logits put the maximum on the token that followed the
previous occurrence of the current token, teacher-forced) and a model that ignores the context (logits from the
current token alone). Induction and previous-token scores are checked on hand-made attention and mixing patterns
(against their values worked out by hand), and end to end on the tiny pipeline teacher (against transformers' own
attention weights) and a hybrid student built from it, through `harness eval copy`.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from harness.cli import main as harness_main
from harness.config import ConfigError
from harness.eval.copy import (SEQUENCES_FILE, CopyConfig, CopyError, Layout, LayerProbe, TokenRange, check_range,
                               draw_sequences, evaluate_copy, induction_chance, induction_scores, induction_summary,
                               is_complete, markdown, previous_token_chance, previous_token_scores, run_header,
                               sequence_head_scores, summarise, token_range)

VOCAB = 500


class Tokenizer:
    """What the probe reads of a tokenizer: its size, its special ids and the prefix it puts before text (BOS 1)."""

    all_special_ids = [0, 1]

    def __len__(self) -> int:
        return VOCAB

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": ([1] if add_special_tokens else []) + [7]}


class Oracle(nn.Module):
    """Teacher-forced copier: at each position, the maximum on the token after the previous occurrence of the
    current token (token 0 where it has none). Counts the prompts it scores."""

    def __init__(self) -> None:
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(1))  # a parameter, so that .to(device) and the dtype work
        self.rows = 0

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        b, t = input_ids.shape
        self.rows += b
        same = input_ids[:, :, None] == input_ids[:, None, :]  # [B, query, key]
        earlier = torch.ones(t, t, dtype=torch.bool).tril(-1)
        index = torch.arange(t).expand(t, t)
        last = torch.where(same & earlier, index, -1).amax(-1)  # the previous occurrence, -1 if none
        nxt = torch.where(last >= 0, input_ids.gather(1, (last + 1).clamp_max(t - 1)), torch.zeros_like(last))
        return SimpleNamespace(logits=20 * nn.functional.one_hot(nxt, VOCAB).float() + self.anchor)


class Contextless(nn.Module):
    """Logits from the current token only (a random token -> vocabulary table): it cannot copy."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(VOCAB, VOCAB)
        torch.nn.init.normal_(self.table.weight, generator=torch.Generator().manual_seed(3))

    def forward(self, input_ids: torch.Tensor, logits_to_keep: int = 0) -> SimpleNamespace:
        logits = self.table(input_ids)
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


def _cfg(**changes) -> CopyConfig:
    return CopyConfig(**{"lengths": [16, 40], "sequences": 3, "token_low": 2, "token_high": VOCAB,
                         "batch_size": 2, **changes})


def test_an_oracle_copies_every_token_after_the_first(tmp_path):
    for gap in (0, 5):
        result = evaluate_copy(Oracle(), Tokenizer(), _cfg(gap=gap), tmp_path / f"gap{gap}", label="oracle",
                               progress=False)
        for length, entry in result["lengths"].items():
            n = int(length)
            assert entry["copy_acc_after_first"] == 1.0 and entry["copy_acc_after_first_ci"] == [1.0, 1.0]
            # the first token follows s_{L-1} (gap 0) or a filler token, neither seen before: token 0 is predicted
            assert entry["first_token_acc"] == 0.0 and entry["copy_acc"] == pytest.approx((n - 1) / n)
            assert [b["acc"] for b in entry["by_position"]][1:] == [1.0] * 7 and entry["n"] == 3
            assert entry["positions"] == 1 + 2 * n + gap  # the tokenizer's BOS, both copies, the gap
            assert entry["nll_after_first"] < 1e-5


def test_a_model_that_ignores_the_context_scores_near_chance(tmp_path):
    result = evaluate_copy(Contextless(), Tokenizer(), _cfg(lengths=[64], sequences=4), tmp_path, label="none",
                           progress=False)
    entry = result["lengths"]["64"]
    assert entry["copy_acc"] < 0.03 and entry["chance"] == pytest.approx(1 / (VOCAB - 2))
    assert entry["nll_after_first"] > 3.0
    assert "| 64 | 4 |" in markdown(result)


def test_sequences_are_seeded_distinct_and_do_not_depend_on_the_count():
    rng = TokenRange(2, 60, (7,))
    cfg = _cfg(lengths=[40], gap=10, sequences=6, token_high=60)
    rows = draw_sequences(cfg, 40, rng)
    assert torch.equal(rows, draw_sequences(cfg, 40, rng)) and rows.shape == (6, 50)
    assert torch.equal(rows[:3], draw_sequences(_cfg(lengths=[40], gap=10, sequences=3, token_high=60), 40, rng))
    assert not torch.equal(rows, draw_sequences(_cfg(lengths=[40], gap=10, sequences=6, seed=1), 40, rng))
    for row in rows.tolist():  # 50 of 57 ids: repeats are frequent in the raw draw, none is left
        assert len(set(row)) == 50 and min(row) >= 2 and max(row) < 60 and 7 not in row


def test_the_default_draw_is_the_issues_but_for_its_one_repeated_id():
    """The issue's 75.6%: torch.manual_seed(0); torch.randint(1000, 20000, (8, 64)); sequence 6 repeats one id."""
    torch.manual_seed(0)
    issue = torch.randint(1000, 20000, (8, 64))
    cfg = CopyConfig(lengths=[64])
    rows = draw_sequences(cfg, 64, token_range(cfg, 49152, [0, 1, 2]))
    differs = (rows != issue).sum(1).tolist()
    assert differs == [0, 0, 0, 0, 0, 0, 1, 0]


def test_a_run_resumes_after_a_line_cut_short(tmp_path):
    model, cfg = Oracle(), _cfg()
    first = evaluate_copy(model, Tokenizer(), cfg, tmp_path, label="oracle", progress=False)
    assert model.rows == 6
    path = tmp_path / SEQUENCES_FILE
    path.write_bytes(path.read_bytes()[:-25])  # a crash in the middle of the last record
    model.rows = 0
    again = evaluate_copy(model, Tokenizer(), cfg, tmp_path, label="oracle", progress=False)
    assert model.rows == 1 and again == first
    assert len(path.read_text().splitlines()) == 1 + 6  # header and one line per (length, sequence)
    model.rows = 0
    evaluate_copy(model, Tokenizer(), _cfg(sequences=4), tmp_path, label="oracle", progress=False)
    assert model.rows == 2  # one more sequence per length
    with pytest.raises(CopyError, match=r"seed: saved 0, now 1"):
        evaluate_copy(model, Tokenizer(), _cfg(seed=1), tmp_path, label="oracle", progress=False)
    model.rows = 0
    evaluate_copy(model, Tokenizer(), _cfg(seed=1), tmp_path, label="oracle", progress=False, overwrite=True)
    assert model.rows == 6


def _patterns(layout: Layout, heads: int = 2) -> dict[str, torch.Tensor]:
    """Hand-made mixing matrices [heads, T, T]: an induction head, a previous-token head, uniform attention."""
    t = layout.total
    causal = torch.ones(t, t).tril()
    uniform = causal / causal.sum(-1, keepdim=True)
    previous = torch.eye(t).roll(-1, dims=1).tril()  # row q: all mass on q - 1
    previous[0, 0] = 1.0
    induction = 0.2 * uniform.clone()
    i = torch.arange(layout.length)
    induction[layout.second + i, layout.first + i + 1] += 0.8
    return {name: m.expand(heads, t, t).clone() for name, m in
            (("induction", induction), ("previous", previous), ("uniform", uniform))}


def test_the_induction_score_reads_the_mass_on_the_token_after_the_previous_occurrence():
    layout = Layout(prefix=1, length=12, gap=3)
    scores = {name: induction_scores(m, layout) for name, m in _patterns(layout).items()}
    chance = induction_chance(layout)
    assert scores["induction"].tolist() == pytest.approx([0.8 + 0.2 * chance] * 2, rel=1e-5)
    assert scores["uniform"].tolist() == pytest.approx([chance] * 2, rel=1e-5)
    assert scores["previous"].tolist() == [0.0, 0.0]
    # a mixer's weights are signed and not normalised: the target's share of the row's absolute weight
    mixer = torch.zeros(1, layout.total, layout.total)
    mixer[0, :, :] = torch.triu(torch.full((layout.total, layout.total), 5.0), 1)  # above the diagonal: ignored
    i = torch.arange(layout.length - 1)
    mixer[0, layout.second + i, layout.first + i + 1] = -3.0
    mixer[0, layout.second + i, layout.second + i] = 1.0
    assert induction_scores(mixer, layout).tolist() == pytest.approx([0.75])


def test_the_previous_token_score_reads_the_mass_on_the_token_before():
    layout = Layout(prefix=1, length=12, gap=3)
    queries = range(layout.first + 1, layout.total)  # t = 2 .. 28: both copies and the gap, not the first token
    chance = previous_token_chance(layout)
    assert chance == pytest.approx(sum(1 / (t + 1) for t in queries) / len(queries), rel=1e-12)
    scores = {name: previous_token_scores(m, layout) for name, m in _patterns(layout).items()}
    assert scores["previous"].tolist() == [1.0, 1.0]
    assert scores["uniform"].tolist() == pytest.approx([chance] * 2, rel=1e-5)
    # the induction pattern: uniform rows but in the second copy, where 0.2 of the row is spread evenly
    by_hand = sum((0.2 if t >= layout.second else 1.0) / (t + 1) for t in queries) / len(queries)
    assert scores["induction"].tolist() == pytest.approx([by_hand] * 2, rel=1e-5) and by_hand < chance
    p = _patterns(layout, heads=1)
    mixed = 0.6 * p["previous"] + 0.4 * p["uniform"]
    assert previous_token_scores(mixed, layout).tolist() == pytest.approx([0.6 + 0.4 * chance], rel=1e-5)
    # a mixer's signed weights, no prefix (queries from t = 1): the share of the row's absolute weight on t - 1
    bare = Layout(prefix=0, length=12, gap=3)
    t = bare.total
    mixer = torch.triu(torch.full((1, t, t), 5.0), 1)  # above the diagonal: ignored
    rows = torch.arange(1, t)
    mixer[0, rows, rows - 1] = -3.0
    mixer[0, rows, rows] = 0.5
    mixer[0, rows, 0] += 0.5  # row 1: its t - 1 = 0 holds -2.5 of 3.0; every later row 3.0 of 4.0
    expected = [2.5 / 3.0] + [0.75] * (t - 2)
    assert previous_token_scores(mixer, bare).tolist() == pytest.approx([sum(expected) / len(expected)], rel=1e-6)


class _Fixed:
    """A probe whose mixing is a fixed matrix (a layer of a hand-made model)."""

    def __init__(self, mixing: torch.Tensor) -> None:
        self.matrix = mixing

    def mixing(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        assert x.shape[1] == self.matrix.shape[-1] and positions.shape == (1, x.shape[1])
        return self.matrix[None]


def _three_layers(layout: Layout) -> tuple[list[LayerProbe], list[dict]]:
    """Probes of a hand-made model (layer 0: previous-token heads; 1: uniform; 2: one induction head among uniform
    ones) and the scores of two sequences."""
    p = _patterns(layout, heads=3)
    heads = p["uniform"].clone()
    heads[1] = p["induction"][1]
    probes = [LayerProbe("attention", "softmax", _Fixed(m)) for m in (p["previous"], p["uniform"], heads)]
    inputs = {i: torch.zeros(2, layout.total, 4) for i in range(3)}
    return probes, [sequence_head_scores(probes, inputs, r, layout) for r in range(2)]


def test_the_layer_with_the_induction_head_scores_highest():
    layout = Layout(prefix=0, length=10, gap=0)
    probes, rows = _three_layers(layout)
    summary = induction_summary(rows, probes, layout)
    layers = summary["layers"]
    assert max(layers, key=lambda e: e["max"])["layer"] == 2 and layers[2]["max_head"] == 1
    assert layers[2]["max"] > 0.8 and layers[0]["max"] == 0.0
    assert layers[1]["mean"] == pytest.approx(summary["chance"], rel=1e-4)


def test_the_layer_with_the_previous_token_head_scores_highest():
    layout = Layout(prefix=0, length=10, gap=0)
    probes, rows = _three_layers(layout)
    previous = induction_summary(rows, probes, layout)["previous_token"]
    layers = previous["layers"]
    assert previous["queries"] == 19 and previous["sequences"] == 2
    assert previous["chance"] == pytest.approx(previous_token_chance(layout))
    assert max(layers, key=lambda e: e["max"])["layer"] == 0 and layers[0]["mean"] == layers[0]["max"] == 1.0
    assert layers[1]["mean"] == pytest.approx(previous["chance"], rel=1e-4)
    assert layers[2]["max"] == pytest.approx(previous["chance"], rel=1e-4)  # the uniform heads; the induction one less
    assert layers[2]["heads"][1] < layers[2]["heads"][0]


def test_records_written_before_the_previous_token_score_still_summarise_and_are_scored_again():
    layout = Layout(prefix=1, length=10, gap=0)
    probes, scores = _three_layers(layout)
    cfg = CopyConfig(lengths=[10], sequences=2, induction=True, token_low=2, token_high=400)
    rng = TokenRange(2, 400, ())
    header = run_header(cfg, "old", rng, [1], VOCAB, "float32")
    new = {(10, i): {"length": 10, "index": i, "hits": "0111111111", "nll_after_first": 0.5, **scores[i]}
           for i in range(2)}
    old = {key: {k: v for k, v in r.items() if k != "previous_token"} for key, r in new.items()}
    results = {name: summarise(records, cfg, header, rng, probes, {}) for name, records in (("old", old), ("new", new))}
    entry = {name: result["induction"]["10"] for name, result in results.items()}
    assert "previous_token" not in entry["old"] and entry["new"]["previous_token"]["layers"][0]["max"] == 1.0
    assert entry["old"] == {k: v for k, v in entry["new"].items() if k != "previous_token"}
    assert "previous-token" not in markdown(results["old"]) and "| 0 | attention |" in markdown(results["old"])
    assert "L=10 previous-token max (head)" in markdown(results["new"]) and "| 1.000 (0) |" in markdown(results["new"])
    # a rerun with the layers readable scores an old record again; without readable layers it is complete
    assert not is_complete(old[(10, 0)], cfg, 10, readable=True) and is_complete(new[(10, 0)], cfg, 10, readable=True)
    assert is_complete(old[(10, 0)], cfg, 10, readable=False)


def test_bad_settings_are_one_paragraph_errors():
    with pytest.raises(ConfigError, match=r"copy.lengths.*at least 2"):
        CopyConfig(lengths=[64, 1])
    with pytest.raises(ConfigError, match="copy.gap=-1 must be >= 0"):
        CopyConfig(gap=-1)
    with pytest.raises(CopyError, match="token_low=500 must be below copy.token_high=400"):
        CopyConfig(token_low=500, token_high=400)
    cfg = CopyConfig(lengths=[64, 256], gap=8, token_low=100, token_high=300)
    with pytest.raises(CopyError, match="holds 199 usable ids, fewer than the 264 distinct ids"):
        check_range(token_range(cfg, 49152, [150]), cfg)
    with pytest.warns(UserWarning, match="ends at or below token_low=1000"):
        assert token_range(CopyConfig(), 320, [0]) == TokenRange(0, 320, (0,))


# ---------------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny pipeline teacher, and a hybrid student of it (layer 0 kept as softmax attention) saved beside."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from harness.student import build_student
    from tests.pipeline import make_setting

    root = tmp_path_factory.mktemp("copy")
    teacher_dir, _ = make_setting(root)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir)
    torch.manual_seed(0)
    student = build_student(teacher, "gated_deltanet", chunk_size=16, attention_layers=[0])
    student.save_pretrained(root / "student")
    AutoTokenizer.from_pretrained(teacher_dir).save_pretrained(root / "student")
    return teacher_dir, root / "student"


def _cli(model: Path, out: Path, *extra: str) -> dict:
    args = ["eval", "copy", str(model), "--lengths", "8,24", "--sequences", "2", "--induction",
            "--induction-max-length", "16", "--device", "cpu", "--dtype", "float32", "--out", str(out), *extra]
    with pytest.warns(UserWarning, match="vocabulary \\(320 ids\\)"):  # the tiny vocabulary ends below 1000
        assert harness_main(args) == 0
    return json.loads((out / "copy.json").read_text())


def test_teacher_and_student_run_end_to_end_through_the_cli(models, tmp_path, capsys):
    teacher_dir, student_dir = models
    teacher = _cli(teacher_dir, tmp_path / "teacher")
    student = _cli(student_dir, tmp_path / "student")
    printed = capsys.readouterr().out
    assert "## Copy: teacher" in printed and "## Copy: student" in printed and "gated_deltanet" in printed
    for result in (teacher, student):
        assert set(result["lengths"]) == {"8", "24"} and set(result["induction"]) == {"8"}
        assert result["settings"]["token_range"] == [0, 320] and result["settings"]["special_ids_skipped"] == [0]
        assert all(0.0 <= e["copy_acc"] <= 1.0 for e in result["lengths"].values())
        assert any("not for [24]" in note for note in result["notes"])
    assert printed.count("L=8 previous-token max (head)") == 2
    t_layers, s_layers = teacher["induction"]["8"]["layers"], student["induction"]["8"]["layers"]
    t_previous, s_previous = (r["induction"]["8"]["previous_token"]["layers"] for r in (teacher, student))
    assert [e["kind"] for e in t_layers] == ["attention"] * 4
    assert [e["kind"] for e in s_layers] == ["attention", "mixer", "mixer", "mixer"]
    assert all(0.0 <= h <= 1.0 for layers in (s_layers, s_previous) for e in layers for h in e["heads"])
    assert len(s_layers[1]["heads"]) == len(s_previous[1]["heads"]) == 4
    # the kept layer 0 reads the same input as the teacher's layer 0 (the embeddings): the same attention
    assert s_layers[0]["heads"] == pytest.approx(t_layers[0]["heads"], abs=1e-5)
    assert s_previous[0]["heads"] == pytest.approx(t_previous[0]["heads"], abs=1e-5)
    # both saw the same prompts: the per-sequence records pair up
    records = {who: (tmp_path / who / SEQUENCES_FILE).read_text().splitlines()[1:] for who in ("teacher", "student")}
    shas = {who: [json.loads(line)["sequence_sha"] for line in lines] for who, lines in records.items()}
    assert shas["teacher"] == shas["student"] and len(shas["teacher"]) == 4


def test_the_teachers_induction_scores_are_those_of_its_own_attention_weights(models, tmp_path):
    """The probe recomputes each layer's attention from the layer's input; transformers' eager attention returns the
    weights it used: the induction and previous-token scores of both agree."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from harness.eval.copy import prompts, tokenizer_prefix

    teacher_dir, _ = models
    model = AutoModelForCausalLM.from_pretrained(teacher_dir, attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    cfg = CopyConfig(lengths=[12], sequences=3, gap=2, token_low=1, token_high=320, induction=True)
    result = evaluate_copy(model, tokenizer, cfg, tmp_path, label="teacher", progress=False)
    prefix = tokenizer_prefix(tokenizer)
    ids = prompts(draw_sequences(cfg, 12, token_range(cfg, 320, tokenizer.all_special_ids)), prefix, 12)
    with torch.no_grad():
        attentions = model(ids, output_attentions=True).attentions  # per layer [B, H, T, T]
    layout = Layout(len(prefix), 12, 2)
    entry, t = result["induction"]["12"], torch.arange(layout.first + 1, layout.total)
    for layer, weights in enumerate(attentions):
        expected = torch.stack([induction_scores(w, layout) for w in weights]).mean(0)
        assert entry["layers"][layer]["heads"] == pytest.approx(expected.tolist(), abs=1e-5)
        on_previous = weights[:, :, t, t - 1].mean((0, 2))  # the probability on t - 1, per head
        assert entry["previous_token"]["layers"][layer]["heads"] == pytest.approx(on_previous.tolist(), abs=1e-5)


def test_the_cli_names_a_bad_token_range(models, tmp_path, capsys):
    teacher_dir, _ = models
    assert harness_main(["eval", "copy", str(teacher_dir), "--token-range", "1000-2000", "--out", str(tmp_path)]) == 2
    assert "Bad --token-range '1000-2000'" in capsys.readouterr().err
