"""Chat samples: greedy answers to fixed prompts (harness.eval.chat_samples), with a scripted fake model and the
real SmolLM2-135M-Instruct teacher."""

from __future__ import annotations

import json
import time

import pytest
import torch
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from harness.eval import chat_samples
from harness.eval.chat_samples import (DEFAULT_PROMPTS, end_of_turn_ids, generate_chat_samples, markdown_section,
                                       prompt_ids)
from tests.pipeline import tiny_tokenizer


class ScriptConfig(PretrainedConfig):
    model_type = "harness_test_script"


class ScriptedLM(PreTrainedModel, GenerationMixin):
    """A causal LM that answers any prompt with `script`: the next token is script[k], k the length of the longest
    script prefix that ends the input (0 right after a prompt, which must not end with script[0]). Records the
    prompts it was given."""

    config_class = ScriptConfig

    def __init__(self, vocab: int, script: list[int]) -> None:
        super().__init__(ScriptConfig(vocab_size=vocab))
        self.weight = nn.Parameter(torch.zeros(1))  # a parameter, for the device and dtype
        self.script, self.prompts = script, []
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False

    def prepare_inputs_for_generation(self, input_ids, **kwargs):
        return {"input_ids": input_ids, "attention_mask": kwargs.get("attention_mask")}

    def forward(self, input_ids, attention_mask=None, **kwargs):
        assert input_ids.shape[0] == 1 and (attention_mask is None or bool(attention_mask.all()))
        ids = input_ids[0].tolist()
        k = max((n for n in range(1, len(self.script)) if ids[-n:] == self.script[:n]), default=0)
        if k == 0:
            self.prompts.append(ids)
        logits = torch.full((1, len(ids), self.config.vocab_size), -1e4)
        logits[0, -1, self.script[min(k, len(self.script) - 1)]] = 0.0
        return CausalLMOutput(logits=logits)


@pytest.fixture(scope="module")
def tiny_tok():
    return tiny_tokenizer()


def test_scripted_answer_is_decoded_exactly(tiny_tok, tmp_path):
    """Plain prompts (the tiny tokenizer has no chat template): the response is the scripted tokens decoded, up to
    EOS; the file is written and returned; the model saw each prompt as `User: ...\\nAssistant:`."""
    text = " The river flows to the city."
    script = tiny_tok(text, add_special_tokens=False)["input_ids"] + [tiny_tok.eos_token_id]
    model = ScriptedLM(len(tiny_tok), script)
    result = generate_chat_samples(model, tiny_tok, ["Where does the river go?", "Hello"], tmp_path, label="fake",
                                   max_new_tokens=64)
    assert json.loads((tmp_path / "chat_samples.json").read_text()) == result
    assert (result["label"], result["prompt_mode"], result["max_new_tokens"]) == ("fake", "plain", 64)
    assert [s["prompt"] for s in result["samples"]] == ["Where does the river go?", "Hello"]
    for sample in result["samples"]:
        assert sample["response"] == text.strip()
        assert (sample["tokens"], sample["stopped"]) == (len(script) - 1, "end_of_turn")
    assert [tiny_tok.decode(p) for p in model.prompts] == ["User: Where does the river go?\nAssistant:",
                                                             "User: Hello\nAssistant:"]


def test_scripted_answer_cut_by_length_or_new_turn(tiny_tok, tmp_path):
    words = tiny_tok(" the garden was quiet and the market was closed", add_special_tokens=False)["input_ids"]
    model = ScriptedLM(len(tiny_tok), words + [tiny_tok.eos_token_id])
    cut = generate_chat_samples(model, tiny_tok, ["Tell me."], tmp_path, label="x", max_new_tokens=3)["samples"][0]
    assert (cut["tokens"], cut["stopped"]) == (3, "max_new_tokens")
    assert cut["response"] == tiny_tok.decode(words[:3]).strip()
    turn = tiny_tok(" Fine.\nUser: and you", add_special_tokens=False)["input_ids"]
    model = ScriptedLM(len(tiny_tok), turn + [tiny_tok.eos_token_id])
    sample = generate_chat_samples(model, tiny_tok, ["How are you?"], tmp_path, label="x")["samples"][0]
    assert (sample["response"], sample["stopped"]) == ("Fine.", "new_user_turn")


def test_chat_template_prompt_and_end_of_turn(smollm2_teacher, tmp_path):
    """With SmolLM2's ChatML template: the prompt is the rendered user turn with the assistant header, and the
    answer ends at <|im_end|> (the scripted tokens after it are never generated)."""
    tok = smollm2_teacher.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn_ids(tok) == [im_end]
    answer = tok("Paris is the capital of France.", add_special_tokens=False)["input_ids"]
    model = ScriptedLM(len(tok), answer + [im_end] + answer)
    result = generate_chat_samples(model, tok, ["What is the capital of France?"], tmp_path, label="fake")
    sample = result["samples"][0]
    assert result["prompt_mode"] == "chat"
    assert (sample["response"], sample["tokens"], sample["stopped"]) == (
        "Paris is the capital of France.", len(answer), "end_of_turn")
    rendered = tok.decode(model.prompts[0])
    assert rendered.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert model.prompts[0] == prompt_ids(tok, "What is the capital of France?", "chat")
    with pytest.raises(ValueError, match="chat template"):
        generate_chat_samples(model, tiny_tokenizer(), None, tmp_path, label="x", chat="chat")


def test_teacher_answers_default_prompts(smollm2_teacher, tmp_path):
    """The real teacher answers every default prompt with some text (quality is not checked). About 10 s on two
    idle cores; no time bound is asserted, since a loaded machine can be ten times slower."""
    start = time.time()
    result = generate_chat_samples(smollm2_teacher.model, smollm2_teacher.tokenizer, None, tmp_path,
                                   label="teacher", max_new_tokens=32)
    seconds = time.time() - start
    assert [s["prompt"] for s in result["samples"]] == list(DEFAULT_PROMPTS)
    assert 5 <= len(DEFAULT_PROMPTS) <= 6
    for sample in result["samples"]:
        assert sample["response"].strip() and 0 < sample["tokens"] <= 32
    print(f"teacher chat samples: {seconds:.1f} s; "
          + " | ".join(s["response"][:40].replace("\n", " ") for s in result["samples"]))


def test_markdown_section():
    student = {"label": "student", "prompt_mode": "chat", "max_new_tokens": 96, "samples": [
        {"prompt": "Hi! How are you?", "response": "Good.\nAnd you?", "tokens": 5, "stopped": "end_of_turn"},
        {"prompt": "List three fruits.", "response": "apple " * 300, "tokens": 96, "stopped": "max_new_tokens"},
    ]}
    teacher = {"label": "teacher", "prompt_mode": "chat", "max_new_tokens": 96, "samples": [
        {"prompt": "List three fruits.", "response": "Apple, cherry, plum.", "tokens": 7, "stopped": "end_of_turn"},
    ]}
    md = markdown_section(student, teacher)
    assert md.startswith("## Chat samples\n")
    for sample in student["samples"]:
        assert sample["prompt"] in md
    assert "> Good.\n> And you?" in md and "> Apple, cherry, plum." in md
    assert md.index("List three fruits.") < md.index("apple apple") < md.index("Apple, cherry, plum.")
    assert "[...]" in md and len(md) < 2000 and "cut at max_new_tokens" in md
    assert "(no answer to this prompt)" in md  # the teacher lacks the first prompt
    alone = markdown_section(student)
    assert "teacher" not in alone and "Hi! How are you?" in alone
    assert chat_samples.MAX_QUOTE_CHARS < len(student["samples"][1]["response"])
