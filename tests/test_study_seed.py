"""scripts/study_seed.py on the study's committed teacher cache (made on the H200 by the 50M study's runs)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "docs/results/study-small-50m/runs/teacher-2048"
GDN = "jobs/study-small-50m/smollm2-135m-gated_deltanet-50m.yaml"
KDA = "jobs/study-small-50m/smollm2-135m-kda-50m.yaml"
PAPER = "jobs/paper-recipe/smollm2-135m-gated_deltanet-50m-paper.yaml"


def _seed(out: Path, *jobs: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts/study_seed.py"), "--from-job", GDN, "--source",
                           str(SOURCE), "--out", str(out), *jobs], capture_output=True, text=True, cwd=ROOT)


def test_seeds_the_same_key_whole_and_another_seq_len_without_its_perplexity(tmp_path):
    done = _seed(tmp_path, KDA, PAPER)
    assert done.returncode == 0, done.stderr
    # the key the device's runs computed names the committed folder: the script must reach the same name on CPU
    (made,) = SOURCE.iterdir()
    same = tmp_path / "teacher-2048" / made.name
    assert sorted(f.name for f in same.iterdir()) == sorted(f.name for f in made.iterdir())
    (paper,) = (tmp_path / "teacher-512").iterdir()
    assert paper.name.startswith("smollm2-135m-instruct-gguf-") and paper.name != made.name
    names = sorted(f.name for f in paper.iterdir())
    assert "perplexity.json" not in names and {"bench.json", "niah_cells.jsonl"} <= set(names)
    for name in names:
        assert (paper / name).read_bytes() == (made / name).read_bytes()


def test_refuses_a_job_whose_teacher_results_differ_beyond_the_perplexity(tmp_path):
    job = tmp_path / "fewer.yaml"
    job.write_text((ROOT / GDN).read_text().replace("limit: 500", "limit: 100"))
    done = _seed(tmp_path / "out", str(job))
    assert done.returncode != 0
    assert "['limit']" in done.stderr and "must be computed" in done.stderr
    assert not (tmp_path / "out").exists()
