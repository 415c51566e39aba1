"""The resumable record files of the evaluations (harness.eval.records) through each evaluation's load_records (NIAH,
copy, state): a new file gets its header, a last line cut short by a crash is cut off the file, another header is
refused naming what changed (unless overwrite), and records come back by each evaluation's key. Expected contents are
written out here by hand. A record's text may hold line separators other than the newline (U+2028, NEL): JSON
leaves them unescaped, and they stay inside their record."""

from __future__ import annotations

import json

import pytest

from harness.config import ConfigError, CopyError
from harness.eval import copy, niah, state
from harness.eval.records import append_record, changed_settings

HEADER = {"seed": 0, "label": "tiny"}
RECORD = {"kind": "passkey", "length": 64, "depth": 0.5, "distance": 8, "index": 1, "output": "a\u2028b\x85c"}
CASES = [  # load_records, its error, the key it files RECORD under
    (niah.load_records, ValueError, ("passkey", 64, 0.5, 1)),
    (copy.load_records, CopyError, (64, 1)),
    (state.load_records, ConfigError, ("passkey", 8, 1)),
]


@pytest.mark.parametrize("load_records,error,key", CASES)
def test_records_resume_after_a_cut_line_and_refuse_another_header(tmp_path, load_records, error, key):
    path = tmp_path / "records.jsonl"
    assert load_records(path, HEADER) == {}
    assert path.read_text() == json.dumps({"header": HEADER}) + "\n"
    append_record(path, RECORD)
    with open(path, "a") as f:
        f.write('{"kind": "uuid", "len')  # what a crash mid-write leaves
    assert load_records(path, HEADER) == {key: RECORD}
    assert path.read_text(encoding="utf-8") == "\n".join(
        [json.dumps({"header": HEADER}), json.dumps(RECORD, ensure_ascii=False), ""])
    with pytest.raises(error, match=r"\(seed: saved 0, now 3\)"):
        load_records(path, {**HEADER, "seed": 3})
    assert load_records(path, {**HEADER, "seed": 3}, overwrite=True) == {}
    assert path.read_text() == json.dumps({"header": {**HEADER, "seed": 3}}) + "\n"


def test_changed_settings_names_each_setting_saved_otherwise():
    saved = {"seed": 0, "label": "a", "gap": 4}
    assert changed_settings(saved, {"seed": 0, "label": "a"}) == ""
    assert changed_settings(saved, {"seed": 1, "label": "a", "new": [1]}) == "seed: saved 0, now 1, new: saved None, now [1]"
