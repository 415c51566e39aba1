"""Chat samples: a model's greedy answers to a few fixed prompts, to read beside the scores.

    generate_chat_samples(model, tokenizer, prompts, out_dir, label=...)  -> out_dir/chat_samples.json
    markdown_section(student_samples, teacher_samples)                    -> a "## Chat samples" Markdown section

Each prompt is one user turn. With a chat template ("auto" when the tokenizer has one, or "chat") it is rendered
by the template with the generation prompt (the assistant header), as SFT trains (harness.data.chat);
without ("plain") it is `User: <prompt>\\nAssistant:` after the tokenizer's own prefix (BOS). Decoding is greedy,
`generation_batch_size` prompts at a time (1 by default; by length), each answer ending where it would alone
(harness.decoding.greedy_ids_batch: students prefill each prompt unpadded and step the batch through their
recurrent state, teachers `generate` on left-padded prompts with their KV cache). An answer stops at EOS, at
the template's end-of-turn token (e.g. <|im_end|>, found by rendering a turn), after `max_new_tokens`, or in
plain mode once the model starts a new `User:` turn. The response is the decoded new text without special
tokens, stripped; `tokens` counts the generated tokens before the stop token (which is not counted); `stopped`
says why it ended ("end_of_turn": EOS or end-of-turn, "max_new_tokens", "new_user_turn": plain mode only).

chat_samples.json: {"label", "prompt_mode", "max_new_tokens", "samples": [{"prompt", "response", "tokens",
"stopped"}]}. Cheap (six short answers), so it is recomputed rather than resumed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

import torch

from harness.decoding import check_batch_size, greedy_ids_batch, length_batches, stop_token_ids
from harness.eval.niah import resolve_prompt_mode
from harness.files import atomic_write_text

CHAT_SAMPLES_FILE = "chat_samples.json"
DEFAULT_PROMPTS = (
    "Hi! How are you today?",
    "What is the capital of France?",
    "Explain in one sentence why the sky is blue.",
    "Tom has 3 apples and buys 5 more. He then gives 2 to his sister. How many apples does Tom have now?",
    "List three fruits that are red.",
    "Write a short, friendly greeting for a birthday card.",
)
PLAIN_USER, PLAIN_ASSISTANT = "User:", "Assistant:"
MAX_QUOTE_CHARS = 600  # markdown_section cuts longer responses
_MARK = "\x00RESPONSE\x00"  # stands for the assistant's content when locating the end-of-turn token


# ---------------------------------------------------------------------------------------------- prompts


def resolve_chat_mode(tokenizer: Any, mode: str) -> str:
    """"chat" or "plain" for `mode` ("auto": chat when the tokenizer has a chat template)."""
    return resolve_prompt_mode(tokenizer, mode, what="chat sample mode")


def _encode(tokenizer: Any, text: str, special: bool = False) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def prompt_ids(tokenizer: Any, prompt: str, mode: str) -> list[int]:
    """Token ids of one user turn ready for the answer, for a resolved mode "chat" or "plain"."""
    if mode == "chat":
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return _encode(tokenizer, text)  # the template spells BOS and turn markers itself
    if mode != "plain":
        raise ValueError(f"prompt_ids takes a resolved mode 'chat' or 'plain', got {mode!r}")
    return _encode(tokenizer, f"{PLAIN_USER} {prompt}\n{PLAIN_ASSISTANT}", special=True)


def end_of_turn_ids(tokenizer: Any) -> list[int]:
    """The id of the special token the chat template puts after an assistant message (e.g. <|im_end|>); [] when
    there is no template or it ends turns with no single special token."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    from harness.data.chat import special_strings

    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"},
                                              {"role": "assistant", "content": _MARK}], tokenize=False)
    except Exception:  # a template that insists on other roles: no end-of-turn token from it
        return []
    if text.count(_MARK) != 1:
        return []
    tail = text.split(_MARK, 1)[1]
    found = [(tail.find(s), -len(s), s) for s in special_strings(tokenizer) if s and s in tail]
    if not found:
        return []
    ids = _encode(tokenizer, min(found)[2])
    return ids if len(ids) == 1 else []


def stop_ids(model: Any, tokenizer: Any) -> list[int]:
    """Token ids that end an answer: EOS (tokenizer and generation config) and the template's end-of-turn."""
    return stop_token_ids(model, tokenizer, end_of_turn_ids(tokenizer))


# ---------------------------------------------------------------------------------------------- generation


def _new_user_turn(text: str) -> bool:
    """For plain prompts: the answer has started a new `User:` turn."""
    return f"\n{PLAIN_USER}" in text


@torch.no_grad()
def generate_response(model: Any, tokenizer: Any, input_ids: list[int], *, max_new_tokens: int, stop: list[int],
                      plain: bool = False, device: str | torch.device = "cpu") -> dict:
    """Greedy answer to one unpadded prompt: {"response", "tokens", "stopped"} (see the module docstring)."""
    return generate_responses(model, tokenizer, [input_ids], max_new_tokens=max_new_tokens, stop=stop, plain=plain,
                              device=device)[0]


@torch.no_grad()
def generate_responses(model: Any, tokenizer: Any, prompts: list[list[int]], *, max_new_tokens: int,
                       stop: list[int], plain: bool = False, device: str | torch.device = "cpu") -> list[dict]:
    """`generate_response` of each prompt, the prompts decoded together (`greedy_ids_batch`)."""
    news = greedy_ids_batch(model, tokenizer, prompts, max_new_tokens, stop, _new_user_turn if plain else None,
                            device)
    return [_answer(tokenizer, new, stop, plain) for new in news]


def _answer(tokenizer: Any, new: list[int], stop: list[int], plain: bool) -> dict:
    """{"response", "tokens", "stopped"} of one answer's new token ids (the stop token included, if any)."""
    cut = next((i for i, t in enumerate(new) if t in stop), None)
    stopped = "end_of_turn" if cut is not None else "max_new_tokens"
    new = new if cut is None else new[:cut]
    text = tokenizer.decode(new, skip_special_tokens=True)
    if plain and f"\n{PLAIN_USER}" in text:
        text, stopped = text.split(f"\n{PLAIN_USER}", 1)[0], "new_user_turn"
    return {"response": text.strip(), "tokens": len(new), "stopped": stopped}


def generate_chat_samples(model: Any, tokenizer: Any, prompts: Sequence[str] | None, out_dir: str | os.PathLike[str],
                          *, label: str, max_new_tokens: int = 96, device: str | torch.device = "cpu",
                          chat: str = "auto", progress: bool = False, generation_batch_size: int = 1) -> dict:
    """Answer `prompts` (None: DEFAULT_PROMPTS) greedily, `generation_batch_size` at a time (the answers of batch
    1, see the module docstring); write out_dir/chat_samples.json and return it, the samples in prompt order.

    `model`: anything with a transformers-style `generate` (a student, a teacher); nn.Modules are put in eval
    mode on `device`. `chat`: "auto", "chat" or "plain" (see the module docstring).
    """
    prompts = list(DEFAULT_PROMPTS if prompts is None else prompts)
    if not prompts or not all(isinstance(p, str) and p.strip() for p in prompts):
        raise ValueError(f"chat sample prompts must be non-empty strings, got {prompts!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive integer")
    check_batch_size(generation_batch_size)
    mode = resolve_chat_mode(tokenizer, chat)
    if isinstance(model, torch.nn.Module):
        model.to(device).eval()
    stop = stop_ids(model, tokenizer)
    ids = [prompt_ids(tokenizer, prompt, mode) for prompt in prompts]
    answers: dict[int, dict] = {}
    for batch in length_batches([len(x) for x in ids], generation_batch_size):
        found = generate_responses(model, tokenizer, [ids[i] for i in batch], max_new_tokens=max_new_tokens,
                                   stop=stop, plain=mode == "plain", device=device)
        for i, answer in zip(batch, found):
            answers[i] = answer
            if progress:
                print(f"[chat] {label} {len(answers)}/{len(prompts)} (prompt {i + 1}): {answer['tokens']} tokens "
                      f"({answer['stopped']})", flush=True)
    samples = [{"prompt": prompt, **answers[i]} for i, prompt in enumerate(prompts)]
    result = {"label": label, "prompt_mode": mode, "max_new_tokens": max_new_tokens, "samples": samples}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / CHAT_SAMPLES_FILE, json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    return result


def load_chat_samples(out_dir: str | os.PathLike[str]) -> dict | None:
    """out_dir/chat_samples.json, or None when there is none."""
    path = Path(out_dir) / CHAT_SAMPLES_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


# ---------------------------------------------------------------------------------------------- Markdown


def _quote(text: str, limit: int = MAX_QUOTE_CHARS) -> str:
    """`text` as a Markdown blockquote, cut at a word boundary past `limit` characters ("(empty)" when blank)."""
    text = text.strip()
    if len(text) > limit:
        cut = text[:limit]
        space = cut.rfind(" ")
        text = (cut[:space] if space > limit // 2 else cut).rstrip() + " [...]"
    lines = text.splitlines() or ["*(empty)*"]
    return "\n".join(f"> {line}".rstrip() for line in lines)


def _who(samples: dict, fallback: str) -> str:
    return str(samples.get("label") or fallback)


def markdown_section(student_samples: dict, teacher_samples: dict | None = None, *,
                     max_chars: int = MAX_QUOTE_CHARS) -> str:
    """A "## Chat samples" Markdown section: per prompt, the student's answer, then the teacher's (when given).

    Answers are blockquotes, cut at about `max_chars` characters; an answer cut by max_new_tokens is marked.
    Teacher samples are matched to the student's by prompt.
    """
    mode = student_samples.get("prompt_mode", "?")
    lines = ["## Chat samples", "",
             f"Greedy answers, up to {student_samples.get('max_new_tokens', '?')} new tokens, prompts "
             f"rendered {'with the chat template' if mode == 'chat' else 'as plain User:/Assistant: text'}.", ""]
    teacher = {s["prompt"]: s for s in (teacher_samples or {}).get("samples", [])}
    for i, sample in enumerate(student_samples.get("samples", []), 1):
        prompt = " ".join(sample["prompt"].split())
        lines += [f"**{i}. {prompt}**", ""]
        sides = [(_who(student_samples, "student"), sample)]
        if teacher_samples is not None:
            sides.append((_who(teacher_samples, "teacher"), teacher.get(sample["prompt"])))
        for who, answer in sides:
            if answer is None:
                lines += [f"*{who}:* (no answer to this prompt)", ""]
                continue
            note = ", cut at max_new_tokens" if answer.get("stopped") == "max_new_tokens" else ""
            lines += [f"*{who}* ({answer.get('tokens', '?')} tokens{note}):", "", _quote(answer["response"], max_chars),
                      ""]
    return "\n".join(lines).rstrip() + "\n"
