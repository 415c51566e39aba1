"""Chat data for SFT and instruction-aware distillation: chat-template rendering, assistant-token masks, a cached
store of tokenised conversations, and deterministic, sharded, exactly resumable loaders.

Tokenising a conversation (`encode_conversation`). The conversation is rendered with the chat template and cut
into segments at its assistant turns: for assistant message i, the prompt is the rendering of messages[:i] with
the generation prompt, and the target is the assistant's content plus the template's end-of-turn token (the
first special token after the content, e.g. <|im_end|>); what follows it (e.g. a newline) starts the next
prompt. Each segment is tokenised on its own and the ids are concatenated, so a target starts on a token
boundary exactly where generation starts after the prompt, and the mask is exact: the masked-in tokens decode
to the assistant contents, each with its end-of-turn token, and all tokens decode to the rendered text. The
template must be prefix-consistent (messages[:i] with the generation prompt renders to a prefix of
messages[:i+1]); ChatML-style templates, SmolLM2's included, are. A conversation that opens with an assistant
message has no prompt to render and is left out, as is one without assistant tokens after truncation.

Rows. A batch row holds one conversation, right-padded to the longest conversation of its micro-batch; two
conversations never share a row. The student's mixers are causal recurrences (with causal short convolutions),
so a row's real tokens, which come before its padding, do not depend on the padding, and no state passes from
one row to another: a conversation's logits are the ones it has alone (tests/test_sft.py checks this for every
mixer, against a negative control that packs two conversations into one row). `labels` are the ids with -100
outside the assistant targets and on padding; the teacher (causal attention) sees the same right padding.

Loss normalisation. The loss of an optimizer step is the mean over all its assistant targets, on all ranks and
micro-batches together. Rows hold different numbers of targets, so a per-micro-batch mean averaged by
DeepSpeed would weight tokens unequally and depend on the batch geometry. Every batch therefore carries
`step_targets`, the step's total number of targets (known in advance from the store), and the stages scale a
micro-batch's mean by tokens / step_targets x world x grad_accum, which undoes DeepSpeed's averaging.

Budgets count conversation tokens (template included, padding not): `plan_chat_steps` takes the most whole
optimizer steps whose conversations fit in the budget (null: one pass over the training conversations).
Held out: a fixed seeded choice of instructions.validation_conversations conversations, whatever job.seed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from harness.assets import cache_root
from harness.data.errors import DataError
from harness.data.instructions import (InstructionSource, check_messages, load_conversations,
                                       parse_instruction_source, source_fingerprint)
from harness.data.order import EpochOrder, permutation
from harness.data.store import building
from harness.data.tokenise import default_num_proc, token_ids, tokenizer_fingerprint
from harness.files import file_lock

IGNORE_INDEX = -100
STORE_FORMAT = 1
HOLDOUT_SEED = 20_251_130  # fixed: every run of a source holds out the same conversations
LOADER_VERSION = 1
BATCH_CONVERSATIONS = 256
OK, TRUNCATED, DROPPED = 0, 1, 2

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


class TemplateError(DataError):
    """The chat template cannot mark assistant tokens (not prefix-consistent, or no end-of-turn token)."""


# ---------------------------------------------------------------------------------------------- template


def resolve_template(tokenizer: Any, chat_template: Optional[str]) -> str:
    """The Jinja template to use: instructions.chat_template ('chatml' or a file) or the tokenizer's own."""
    if chat_template == "chatml":
        return CHATML
    if chat_template:
        path = Path(chat_template).expanduser()
        if not path.is_file():
            raise DataError(f"instructions.chat_template='{chat_template}' is neither 'chatml' nor an existing file.")
        return path.read_text()
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):  # several named templates: the default one
        own = own.get("default")
    if not own:
        raise DataError("The teacher's tokenizer has no chat template; set instructions.chat_template to 'chatml' "
                        "(its special tokens must be in the vocabulary) or to a .jinja file.")
    return own


def render(tokenizer: Any, template: str, messages: list[dict], generation_prompt: bool = False) -> str:
    """The conversation as text, rendered by `template` (with the assistant generation prompt if asked)."""
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=generation_prompt)


def special_strings(tokenizer: Any) -> list[str]:
    """Every special or added token's text: the candidates for an end-of-turn token."""
    return sorted(set(tokenizer.all_special_tokens) | set(tokenizer.get_added_vocab()), key=len, reverse=True)


def conversation_segments(messages: list[dict], tokenizer: Any, template: str,
                          specials: Optional[list[str]] = None) -> list[tuple[str, bool]]:
    """The rendered conversation as (text, is_target) segments whose texts join to the whole rendering.

    Targets are each assistant message's content plus the end-of-turn token after it (see the module
    docstring). Raises TemplateError when the template is not prefix-consistent or ends no turn with a
    special token, and DataError when the conversation opens with an assistant message.
    """
    return list(iter_segments(messages, tokenizer, template, specials))


def iter_segments(messages: list[dict], tokenizer: Any, template: str,
                  specials: Optional[list[str]] = None) -> Iterator[tuple[str, bool]]:
    """`conversation_segments` one at a time: a consumer that stops early (a conversation cut to
    instructions.seq_len) renders only the turns it reads, O(turns read ^ 2) instead of O(turns ^ 2)."""
    specials = specials if specials is not None else special_strings(tokenizer)
    emitted = ""  # the rendering up to the end of the last target yielded
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise DataError("the conversation opens with an assistant message: there is no prompt to render.")
        prompt = render(tokenizer, template, messages[:i], generation_prompt=True)
        turn = render(tokenizer, template, messages[: i + 1])
        if not (turn.startswith(prompt) and prompt.startswith(emitted)):
            raise TemplateError(
                "The chat template is not prefix-consistent: the messages before assistant turn "
                f"{i} with the generation prompt render to {prompt[-60:]!r}, which does not begin the rendering of "
                "that turn or does not continue the turns before it. Assistant tokens cannot be located; use "
                "another instructions.chat_template.")
        body = turn[len(prompt):]
        start = len(prompt) + _find_content(body, message["content"], i)
        end = start + len(message["content"])
        end += _end_of_turn(turn[end:], specials, i)
        yield from ((text, target) for text, target in ((turn[len(emitted):start], False), (turn[start:end], True))
                    if text)
        emitted = turn[:end]
    full = render(tokenizer, template, messages)
    if not full.startswith(emitted):
        raise TemplateError("The chat template is not prefix-consistent: the whole conversation does not render to "
                            "a continuation of its assistant turns; use another instructions.chat_template.")
    if len(full) > len(emitted):
        yield full[len(emitted):], False


def _find_content(body: str, content: str, turn: int) -> int:
    if body.startswith(content):
        return 0
    at = body.find(content)
    if at < 0:
        raise TemplateError(f"The chat template changes the content of assistant turn {turn} (e.g. trims it): "
                            f"{content[:60]!r} is not in its rendering {body[:80]!r}.")
    return at


def _end_of_turn(tail: str, specials: list[str], turn: int) -> int:
    """Length of `tail` up to and including its first special token (the end-of-turn token)."""
    found = [(tail.find(s), -len(s), s) for s in specials if s and s in tail]
    if not found:
        raise TemplateError(f"The chat template puts no special token after assistant turn {turn} (after the content "
                            f"comes {tail[:40]!r}); a turn must end with a token the model can learn to emit, such "
                            "as <|im_end|>. Use another instructions.chat_template.")
    at, _, token = min(found)
    return at + len(token)


@dataclass
class Encoded:
    """One tokenised conversation: ids int32 [T], target mask bool [T] (True on assistant targets)."""

    ids: np.ndarray
    mask: np.ndarray
    truncated: bool = False

    @property
    def targets(self) -> int:
        """Tokens with a loss: targets after the first position (position t predicts token t+1)."""
        return int(self.mask[1:].sum())


def encode_conversation(messages: list[dict], tokenizer: Any, template: str, max_len: Optional[int] = None,
                        specials: Optional[list[str]] = None) -> Encoded:
    """Token ids and assistant-target mask of a conversation, cut to `max_len` tokens (see the module docstring)."""
    ids: list[int] = []
    flags: list[bool] = []
    for text, target in iter_segments(messages, tokenizer, template, specials):
        piece = token_ids(tokenizer, [text])[0]
        ids += piece
        flags += [target] * len(piece)
        if max_len is not None and len(ids) > max_len:
            break  # the rest is cut anyway: not rendered
    truncated = max_len is not None and len(ids) > max_len
    ids, flags = (ids[:max_len], flags[:max_len]) if truncated else (ids, flags)
    return Encoded(np.array(ids, dtype=np.int32), np.array(flags, dtype=bool), truncated)


def labels_for(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Training labels: the ids where the target mask is set, -100 elsewhere."""
    return ids.masked_fill(~mask.bool(), IGNORE_INDEX)


# ---------------------------------------------------------------------------------------------- store


@dataclass
class ChatStore:
    """Tokenised conversations on disk: conversation i is tokens[starts[i]:starts[i+1]] with its target mask.

    Folder: tokens.npy int32, mask.npy bool, starts.npy int64 [n+1], targets.npy int64 [n] (tokens with a
    loss per conversation), meta.json. Written once, atomically; read with memory maps.
    """

    path: Path
    tokens: np.ndarray
    mask: np.ndarray
    starts: np.ndarray
    targets: np.ndarray
    meta: dict

    @classmethod
    def open(cls, path: Path) -> "ChatStore":
        meta = json.loads((path / "meta.json").read_text())
        if meta.get("format") != STORE_FORMAT:
            raise DataError(f"Chat store {path} has format {meta.get('format')}, expected {STORE_FORMAT}; delete it.")
        load = lambda name: np.load(path / name, mmap_mode="r")  # noqa: E731
        return cls(path, load("tokens.npy"), load("mask.npy"), load("starts.npy"), load("targets.npy"), meta)

    @property
    def n(self) -> int:
        return len(self.starts) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.starts)

    def conversation(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids int64 [T], mask bool [T]) of conversation i."""
        a, b = int(self.starts[i]), int(self.starts[i + 1])
        return np.array(self.tokens[a:b], dtype=np.int64), np.array(self.mask[a:b], dtype=bool)


def build_chat_store(src: InstructionSource, ins: Any, tokenizer: Any, template: str, *, root: Path,
                     num_proc: Optional[int] = None) -> ChatStore:
    """The cached ChatStore of `src` under `tokenizer` and `template`, tokenising it if needed.

    Cache folder: <root>/data/chat/<slug>-<key>/, key = hash(source fingerprint, tokenizer fingerprint,
    template, instructions.seq_len, messages field).
    """
    fp = {"source": source_fingerprint(src, ins, root), "tokenizer": tokenizer_fingerprint(tokenizer),
          "template": hashlib.sha256(template.encode()).hexdigest(), "seq_len": ins.seq_len,
          "format": STORE_FORMAT}
    key = hashlib.sha256(json.dumps(fp, sort_keys=True, default=str).encode()).hexdigest()[:20]
    dest = root / "data" / "chat" / f"{src.slug()[:60]}-{key}"
    if (dest / "meta.json").is_file():
        return ChatStore.open(dest)
    with file_lock(dest.parent / f"{dest.name}.lock"):
        if not (dest / "meta.json").is_file():
            ds, messages_field = load_conversations(src, ins, root)
            with building(dest) as tmp:
                _write_store(tmp, _tokenise(ds, messages_field, tokenizer, template, ins.seq_len, src, tmp, num_proc),
                             {**fp, "key": key, "source_described": src.describe()})
    return ChatStore.open(dest)


def _encode_batch(batch: dict, indices: list[int], tokenizer: Any, template: str, field_name: str, max_len: int,
                  where: str) -> dict:
    """datasets.map function: conversations -> input_ids, mask (lists) and a status (OK, TRUNCATED, DROPPED)."""
    specials = special_strings(tokenizer)
    out: dict[str, list] = {"input_ids": [], "mask": [], "status": []}
    for index, raw in zip(indices, batch[field_name]):
        messages = check_messages(raw, f"conversation {index} of {where}")
        try:
            enc = encode_conversation(messages, tokenizer, template, max_len, specials)
        except TemplateError:
            raise
        except DataError:  # e.g. opens with an assistant message
            enc = None
        keep = enc is not None and enc.targets > 0
        out["input_ids"].append(enc.ids.tolist() if keep else [])
        out["mask"].append(enc.mask.tolist() if keep else [])
        out["status"].append((TRUNCATED if enc.truncated else OK) if keep else DROPPED)
    return out


def _tokenise(ds: Any, field_name: str, tokenizer: Any, template: str, max_len: int, src: InstructionSource,
              work_dir: Path, num_proc: Optional[int]) -> Any:
    """Tokenise every conversation with datasets.map (num_proc processes); returns the arrow table."""
    from datasets import Features, List, Value

    procs = max(1, min(num_proc or default_num_proc(), -(-len(ds) // BATCH_CONVERSATIONS)))
    out = ds.map(
        _encode_batch, batched=True, batch_size=BATCH_CONVERSATIONS, with_indices=True,
        num_proc=procs if procs > 1 else None, remove_columns=ds.column_names,
        fn_kwargs={"tokenizer": tokenizer, "template": template, "field_name": field_name, "max_len": max_len,
                   "where": src.describe()},
        features=Features({"input_ids": List(Value("int32")), "mask": List(Value("bool")), "status": Value("int8")}),
        cache_file_name=str(work_dir / "tokenised.arrow"),
        new_fingerprint=hashlib.sha256(str(work_dir).encode()).hexdigest()[:16],  # skip hashing the tokenizer
        desc=f"tokenising {src.describe()}",
    )
    return out.data.table


def _write_store(folder: Path, table: Any, meta: dict) -> None:
    status = table.column("status").to_numpy()
    ids = table.column("input_ids").combine_chunks()
    mask = table.column("mask").combine_chunks()
    keep = status != DROPPED
    lengths = ids.value_lengths().to_numpy(zero_copy_only=False)[keep].astype(np.int64)
    if not keep.any():
        raise DataError(f"{meta['source_described']} holds no conversation with an assistant turn to train on.")
    tokens = ids.flatten().to_numpy(zero_copy_only=False).astype(np.int32)
    flags = mask.flatten().to_numpy(zero_copy_only=False).astype(bool)
    starts = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    targets = np.add.reduceat(flags.astype(np.int64), starts[:-1]) - flags[starts[:-1]]  # mask[1:].sum() per row
    np.save(folder / "tokens.npy", tokens)
    np.save(folder / "mask.npy", flags)
    np.save(folder / "starts.npy", starts)
    np.save(folder / "targets.npy", targets)
    for leftover in folder.glob("tokenised*.arrow"):
        leftover.unlink()
    meta = {**meta, "format": STORE_FORMAT, "conversations": int(keep.sum()), "tokens": int(len(tokens)),
            "targets": int(targets.sum()), "truncated": int((status == TRUNCATED).sum()),
            "dropped": int((~keep).sum())}
    (folder / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True, default=str))


# ---------------------------------------------------------------------------------------------- data


@dataclass
class ChatData:
    """A ChatStore split into training and held-out conversations (indices into the store)."""

    store: ChatStore
    train: np.ndarray
    validation: np.ndarray
    template: str
    pad_id: int
    source: str = ""

    @property
    def fingerprint(self) -> str:
        blob = f"{self.store.meta['key']}|{len(self.train)}|{len(self.validation)}"
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def loader(self, stage: str, seed: int, rank: int, world: int, micro_batch_size: int, grad_accum: int,
               steps: int) -> "ChatLoader":
        return ChatLoader(self, stage, seed, rank, world, micro_batch_size, grad_accum, steps)

    def validation_batches(self, batch_size: int, rank: int = 0, world: int = 1) -> Iterator[dict]:
        """The held-out conversations in a fixed order, sharded round-robin over ranks (rank r: r, r+w, ...).

        Every rank yields the same number of batches (ZeRO-3 forwards are collective); rows past a rank's
        share repeat a conversation with valid=False and labels all -100.
        """
        if not len(self.validation):
            raise DataError("There is no held-out chat data (instructions.validation_conversations=0).")
        per_rank = math.ceil(len(self.validation) / world)
        mine = self.validation[rank::world]
        for lo in range(0, per_rank, batch_size):
            rows = [(int(mine[i]), True) if i < len(mine) else (int(self.validation[0]), False)
                    for i in range(lo, min(lo + batch_size, per_rank))]
            rows += [(int(self.validation[0]), False)] * (batch_size - len(rows))
            batch = self.batch([c for c, _ in rows])
            valid = torch.tensor([v for _, v in rows])
            batch["labels"] = batch["labels"].masked_fill(~valid[:, None], IGNORE_INDEX)
            batch["valid"] = valid
            yield batch

    def batch(self, conversations: list[int]) -> dict[str, torch.Tensor]:
        """Conversations (store indices) as one right-padded batch, one per row (see the module docstring).

        input_ids long [b, L], labels long [b, L] (-100 off the targets and on padding), attention_mask long
        [b, L] (1 on real tokens), conversation_index long [b]; L = the longest of the conversations.
        """
        rows = [self.store.conversation(c) for c in conversations]
        width = max(len(ids) for ids, _ in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.bool)
        real = torch.zeros((len(rows), width), dtype=torch.long)
        for r, (row_ids, row_mask) in enumerate(rows):
            ids[r, : len(row_ids)] = torch.from_numpy(row_ids)
            mask[r, : len(row_ids)] = torch.from_numpy(row_mask)
            real[r, : len(row_ids)] = 1
        return {"input_ids": ids, "labels": labels_for(ids, mask), "attention_mask": real,
                "conversation_index": torch.tensor(conversations, dtype=torch.long)}

    def describe(self) -> str:
        m = self.store.meta
        return (f"# chat data {self.source}\n  store: {self.store.path} ({m['conversations']:,} conversations, "
                f"{m['tokens']:,} tokens, {m['targets']:,} assistant targets; {m['truncated']:,} cut to "
                f"instructions.seq_len, {m['dropped']:,} left out without an assistant turn)\n  train: "
                f"{len(self.train):,} conversations; held out: {len(self.validation):,}")


def prepare_chat_data(job: Any, tokenizer: Any, *, max_positions: Optional[int] = None,
                      cache_dir: str | os.PathLike[str] | None = None) -> ChatData:
    """Tokenise (or reuse the cached tokens of) instructions.source with the job's chat template and split it.

    tokenizer: the teacher's. max_positions: the teacher's max_position_embeddings (instructions.seq_len may
    not exceed it). The cache is data.cache_dir's (or `cache_dir`); tokenisation uses data.num_proc processes.
    """
    ins = job.instructions
    if max_positions is not None and ins.seq_len > max_positions:
        raise DataError(f"instructions.seq_len={ins.seq_len} exceeds the teacher's maximum of {max_positions} "
                        "positions (max_position_embeddings); choose instructions.seq_len <= that.")
    root = cache_root(cache_dir if cache_dir is not None else job.data.cache_dir)
    template = resolve_template(tokenizer, ins.chat_template)
    src = parse_instruction_source(ins.source)
    store = build_chat_store(src, ins, tokenizer, template, root=root, num_proc=job.data.num_proc)
    n_val = ins.validation_conversations
    if n_val >= store.n:
        raise DataError(f"instructions.validation_conversations={n_val} leaves no training conversation: "
                        f"{src.describe()} has {store.n} usable conversations.")
    order = permutation(store.n, HOLDOUT_SEED)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return ChatData(store, np.sort(order[n_val:]), np.sort(order[:n_val]), template, int(pad or 0), src.describe())


def plan_chat_steps(data: ChatData, seed: int, per_step: int, tokens: Optional[int], allow_repeat: bool,
                    key: str) -> int:
    """Optimizer steps of a stage reading `per_step` conversations per step: the most whole steps whose
    conversation tokens fit in `tokens` (None: one pass over the training conversations).

    `key` names the budget setting in errors. Raises DataError when not one step fits, or when the budget
    needs a second pass and instructions.allow_repeat is off.
    """
    n = len(data.train)
    one_pass = n // per_step
    if tokens is None:
        if one_pass < 1:
            raise DataError(f"{n} training conversations are fewer than one optimizer step reads ({per_step} = "
                            "world_size x micro_batch_size x grad_accum).")
        return one_pass
    lengths = data.store.lengths[data.train]
    epochs = tokens // max(int(lengths.sum()), 1) + 2
    positions = np.arange((epochs * n) // per_step * per_step, dtype=np.int64)
    step_tokens = lengths[EpochOrder(n, seed).indices(positions)].reshape(-1, per_step).sum(1)
    steps = int(np.searchsorted(np.cumsum(step_tokens), tokens, side="right"))
    if steps < 1:
        raise DataError(f"{key}={tokens:,} tokens is less than one optimizer step reads ({int(step_tokens[0]):,} "
                        f"tokens in {per_step} conversations); raise it or shrink the batch.")
    if steps > one_pass and not allow_repeat:
        raise DataError(
            f"{key}={tokens:,} tokens needs {steps:,} steps of {per_step} conversations, more than one pass over the "
            f"{n:,} training conversations of {data.source} ({one_pass:,} steps, "
            f"{int(step_tokens[:one_pass].sum()):,} tokens). Set instructions.allow_repeat=true to train on them "
            f"again (a new seeded order per pass), lower {key}, or give more chat data.")
    return steps


# ---------------------------------------------------------------------------------------------- loader


@dataclass
class ChatLoader:
    """Micro-batches of one rank over `steps` optimizer steps of a stage (see the module docstring).

    Geometry as harness.data.loader.PackedLoader: after `consumed` conversations (all ranks), rank r's
    next micro-batch is stream positions consumed + r*b + [0, b); position p reads training conversation
    order[p] (a seeded order per pass). Each item: input_ids, labels, attention_mask [b, L],
    conversation_index, stream_position [b], and step_targets (int: the targets of the whole optimizer step).
    """

    data: ChatData
    stage: str
    seed: int
    rank: int
    world: int
    micro_batch_size: int
    grad_accum: int
    steps: int
    consumed: int = 0
    _conv: np.ndarray = field(init=False, repr=False)
    _cum_tokens: np.ndarray = field(init=False, repr=False)
    _step_targets: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise DataError(f"rank {self.rank} is not in [0, world={self.world}).")
        self.per_micro_step = self.world * self.micro_batch_size
        self.per_step = self.per_micro_step * self.grad_accum
        self.limit = self.steps * self.per_step
        positions = np.arange(self.limit, dtype=np.int64)
        self._conv = self.data.train[EpochOrder(len(self.data.train), self.seed).indices(positions)]
        self._cum_tokens = np.concatenate([[0], np.cumsum(self.data.store.lengths[self._conv])])
        self._step_targets = self.data.store.targets[self._conv].reshape(self.steps, self.per_step).sum(1)

    def __iter__(self) -> Iterator[dict]:
        return self

    def __len__(self) -> int:
        return max(0, (self.limit - self.consumed) // self.per_micro_step)

    def __next__(self) -> dict:
        if self.consumed + self.per_micro_step > self.limit:
            raise StopIteration
        positions = self.consumed + self.rank * self.micro_batch_size + np.arange(self.micro_batch_size)
        batch = self.data.batch([int(c) for c in self._conv[positions]])
        batch["stream_position"] = torch.from_numpy(positions.astype(np.int64))
        batch["step_targets"] = int(self._step_targets[self.consumed // self.per_step])
        self.consumed += self.per_micro_step
        return batch

    @property
    def tokens_consumed(self) -> int:
        """Conversation tokens handed out on all ranks together (padding not counted)."""
        return int(self._cum_tokens[self.consumed])

    @property
    def tokens_total(self) -> int:
        """Conversation tokens of the stage's whole steps, all ranks."""
        return int(self._cum_tokens[self.limit])

    @property
    def step(self) -> int:
        return self.consumed // self.per_step

    def state_dict(self) -> dict:
        """The position and the identity of what is read; the same on every rank."""
        return {"version": LOADER_VERSION, "kind": "chat", "stage": self.stage, "data": self.data.fingerprint,
                "seed": self.seed, "steps": self.steps, "per_step": self.per_step, "consumed": self.consumed,
                "tokens_consumed": self.tokens_consumed}

    def load_state_dict(self, state: dict) -> None:
        """Resume after the position in `state`; DataError if it was saved for other data or another plan."""
        expected = {"version": LOADER_VERSION, "kind": "chat", "stage": self.stage, "data": self.data.fingerprint,
                    "seed": self.seed, "steps": self.steps, "per_step": self.per_step}
        wrong = {k: (state.get(k), v) for k, v in expected.items() if state.get(k) != v}
        if wrong:
            detail = "; ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in wrong.items())
            raise DataError(f"The loader state in the checkpoint does not match this run's chat data ({detail}). "
                            "Resume with the same instructions.*, seed, batch geometry and budget.")
        consumed = int(state["consumed"])
        if not 0 <= consumed <= self.limit or consumed % self.per_micro_step:
            raise DataError(f"Saved loader position {consumed} is not a micro-step of this stage's {self.limit}.")
        self.consumed = consumed
