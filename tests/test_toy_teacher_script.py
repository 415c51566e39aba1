"""scripts/toy_teacher.py (a small teacher trained from scratch for the CPU retrieval experiments): the copy share of
its data, its rows, its learning-rate schedule, and a short training that leaves a folder the harness loads as a
teacher, its tokenizer round-tripping text and its loss falling."""

from __future__ import annotations

import json

import pytest

from tests.pipeline import load_script


def script():
    return load_script("toy_teacher")


def test_copy_documents_take_their_share_of_the_characters():
    m = script()
    chars = {"prose": 0, "copy": 0}
    for _, (source, text) in zip(range(400), m.documents(0.3, seed=0)):
        chars[source] += len(text)
    assert chars["copy"] / (chars["copy"] + chars["prose"]) == pytest.approx(0.3, abs=0.03)
    assert all(source == "prose" for _, (source, _) in zip(range(50), m.documents(0.0, seed=0)))


def test_rows_are_packed_to_the_length_with_an_eos_after_each_document():
    m = script()

    class Chars:  # one id per character, eos 0
        eos_token_id = 0

        def __call__(self, text, add_special_tokens):
            return {"input_ids": [ord(c) for c in text]}

    counts: dict = {}
    docs = iter([("prose", "abc"), ("copy", "de"), ("prose", "fghij")])
    rows = list(m.rows(Chars(), docs, 4, counts))
    assert rows == [[97, 98, 99, 0], [100, 101, 0, 102], [103, 104, 105, 106]]  # the last eos waits for more
    assert counts == {"prose": 10, "copy": 3}


def test_learning_rate_warms_up_then_decays_to_a_tenth():
    m = script()
    lrs = [m.learning_rate(s, 100, 1.0, 10) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[10] == pytest.approx(1.0) and lrs[-1] == pytest.approx(0.1, abs=1e-3)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))


def test_a_short_training_leaves_a_teacher_the_harness_loads(tmp_path):
    from harness.teacher import load_teacher

    m = script()
    out = tmp_path / "teacher"
    record = m.train(m.parse(["--out", str(out), "--tokens", "8192", "--vocab", "300", "--tokenizer-docs", "300",
                              "--hidden", "64", "--layers", "1", "--kv-heads", "1", "--seq-len", "64", "--batch", "8",
                              "--lr", "3e-3", "--warmup", "2", "--log-every", "1"]))
    assert record["steps"] == 16 and record["tokens"] == 8192
    assert record["log"][-1]["loss"] < record["log"][0]["loss"] - 0.5
    assert set(record["token_shares"]) == {"prose", "copy"}
    assert json.loads((out / "train.json").read_text())["steps"] == 16
    teacher = load_teacher(str(out))
    assert teacher.config.num_hidden_layers == 1 and teacher.config.vocab_size == 300
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    text = "The river runs through the city."
    assert tok.decode(tok(text)["input_ids"]) == text and tok.eos_token == m.EOS


def test_bad_settings_are_refused_naming_the_value():
    m = script()
    with pytest.raises(SystemExit):
        m.parse(["--out", "x", "--copy-share", "1.5"])
    with pytest.raises(SystemExit, match="--hidden 100"):
        m.build_model(300, 100, 1, 1, 64, 0)


def test_the_quick_copy_check_is_one_for_a_copier_and_zero_for_a_model_that_ignores_context():
    import torch

    m = script()

    class Copier(torch.nn.Module):  # predicts the token `length` positions back: a perfect induction mechanism
        def forward(self, input_ids):
            logits = torch.full((*input_ids.shape, 300), -1.0)
            back = torch.roll(input_ids, shifts=31, dims=1)  # position t predicts id t+1, shown at t+1-32
            logits.scatter_(2, back[..., None], 1.0)
            return type("Out", (), {"logits": logits})

    class Constant(torch.nn.Module):
        def forward(self, input_ids):
            logits = torch.zeros((*input_ids.shape, 300))
            logits[..., 7] = 1.0
            return type("Out", (), {"logits": logits})

    assert m.copy_accuracy(Copier(), 300, length=32, low=100) == 1.0
    assert m.copy_accuracy(Constant(), 300, length=32, low=100) == 0.0


def test_stop_after_ends_early_on_the_longer_schedule(tmp_path):
    m = script()
    record = m.train(m.parse(["--out", str(tmp_path / "t"), "--tokens", "8192", "--stop-after", "3", "--vocab", "300",
                              "--tokenizer-docs", "300", "--hidden", "64", "--layers", "1", "--kv-heads", "1",
                              "--seq-len", "64", "--batch", "8", "--log-every", "100"]))
    assert (record["steps"], record["schedule_steps"], record["tokens"]) == (3, 16, 3 * 512)
    assert [row["step"] for row in record["log"]] == [0, 2]
