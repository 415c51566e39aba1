"""Chat samples as an evaluation task (harness.eval.chat_samples does the work): greedy answers of student and
teacher to six fixed chat prompts, read side by side at the end of report.md.

Settings: the spec's `chat_samples` (a switch) and the spec-wide `generation_batch_size`. Results:
chat_samples.json per model, reused when it was made for the same label. No scores: nothing to pair or draw.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from harness.eval.formatting import read_json
from harness.eval.tasks.base import EvalTask, TaskResults

CHAT_SAMPLES_FILE = "chat_samples.json"


class ChatSamplesTask(EvalTask):
    name = "chat_samples"
    title = "Chat samples"
    spec_keys = ("chat_samples",)
    run_order = 30
    section = "samples"  # after the training losses, at the end of report.md

    def settings_of(self, spec: Any) -> bool:
        return bool(spec.chat_samples)

    def wanted(self, spec: Any) -> bool:
        return bool(spec.chat_samples)

    def for_during(self, spec: Any, during: Any) -> None:
        spec.chat_samples = False

    def run(self, model: Any, tokenizer: Any, settings: bool, out_dir: Path, *, label: str, device: Any,
            progress: bool, spec: Any) -> dict:
        """The fixed chat prompts' greedy answers, reused from out/chat_samples.json when made the same way."""
        from harness.eval.chat_samples import generate_chat_samples, load_chat_samples

        saved = load_chat_samples(out_dir)
        if saved is not None and saved.get("label") == label:
            return saved
        return generate_chat_samples(model, tokenizer, None, out_dir, label=label, device=str(device),
                                     generation_batch_size=spec.generation_batch_size)

    def summarise(self, folder: Path) -> Optional[TaskResults]:
        return None if read_json(Path(folder) / CHAT_SAMPLES_FILE) is None else TaskResults([])

    def report_fields(self, student_dir: Path, teacher_dir: Optional[Path]) -> dict:
        get = lambda d: read_json(d / CHAT_SAMPLES_FILE) if d is not None else None  # noqa: E731
        return {"chat_samples": {"student": get(student_dir), "teacher": get(teacher_dir)}}

    def markdown(self, report: dict) -> list[str]:
        chat = report.get("chat_samples") or {}
        if not chat.get("student"):
            return []
        from harness.eval.chat_samples import markdown_section

        return [markdown_section(chat["student"], chat.get("teacher")), ""]
