"""Every flag of a run, by concern: one frozen dataclass per concern, checked before any heavy import.

The command line stays flat (`--learning_rate`, not `--optim.learning_rate`), with Hugging Face's `run_clm.py` /
`TrainingArguments` spellings; each flag lives in the slice of the concern that reads it, and each consumer gets
only its slice (`cfg.model` to the model loader, `cfg.data` to the data side, ...). RunConfig
(scaletrain/config/run_config.py) composes them.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path

from scaletrain.config.values import (
    _check_at_least_one,
    _check_data_sources,
    _check_model_path,
    _check_not_negative,
    lr_schedule_name,
    parse_dataset_mix,
    parse_validation_sets,
)
from scaletrain.errors import UsageError

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_DIR = REPO_ROOT / "data" / "tiny-llama"
DEFAULT_TRAIN_FILE = REPO_ROOT / "data" / "sample" / "train.jsonl"
DEFAULT_VALIDATION_FILE = REPO_ROOT / "data" / "sample" / "validation.jsonl"
DEFAULT_DS_CONFIG = "ds_configs/zero3.json"
NVME_PATH_ENV = "SCALETRAIN_NVME_PATH"

RAMPUP_LR_SCALINGS = ("none", "sqrt", "linear")
REPORT_SINKS = ("none", "wandb", "tensorboard")


def _flag(default, help: str, **argparse_kwargs):
    """A dataclass field that also carries its command-line help (one source for both)."""
    return field(default=default, metadata={"help": help, **argparse_kwargs})


@dataclass(frozen=True)
class RunArgs:
    """The run as a whole: where it writes, and the modes that stop before training."""

    output_dir: str = _flag("runs/default", "Run folder: checkpoints, exported model, metrics, resolved configs.")
    overwrite_output_dir: bool = _flag(False, "Allow a fresh run in a folder that holds a previous run.")
    run_name: str | None = _flag(None, "Run name for wandb. Default: the output folder's name.")
    recipe: str | None = _flag(
        None, "A YAML file of flag values (keys are flag names); flags typed on the command line win over it."
    )
    dry_run: bool = _flag(
        False, "Build everything, run one full step, report memory and step time, exit; nothing is saved."
    )
    print_config: bool = _flag(False, "Print the resolved run and DeepSpeed configs, with sources, and exit.")
    local_rank: int = _flag(-1, "Set by the deepspeed launcher; leave it alone.")


@dataclass(frozen=True)
class ModelArgs:
    """Which model and tokenizer, and how the model is built."""

    model_name_or_path: str | None = _flag(None, "Pretrained model: hub id or local folder (from_pretrained).")
    config_name: str | None = _flag(
        None, "Model config (hub id or local folder/file) to train from scratch. Default: data/tiny-llama."
    )
    tokenizer_name: str | None = _flag(None, "Tokenizer (hub id or local folder). Default: the model's.")
    trust_remote_code: bool = _flag(False, "Allow model/tokenizer code from the hub to run. Off unless asked.")
    gradient_checkpointing: bool = _flag(False, "Recompute activations in backward to save memory.")
    activation_offloading: bool = _flag(
        False,
        "With --gradient_checkpointing: keep each checkpointed layer's input in host memory (pinned, copied on a "
        "side stream) and bring it back for the backward.",
    )
    tiled_mlp: bool = _flag(
        False,
        "Compute each decoder layer's MLP slice by slice along the sequence (ALST's TiledMLP), forward and "
        "backward, so its [tokens, intermediate] tensors never exist whole.",
    )
    tiled_mlp_shards: int = _flag(0, "Slices of --tiled_mlp. Default (0): ceil(tokens / hidden size), as ALST.")
    attn_implementation: str | None = _flag(
        None,
        "Attention backend, by transformers' name: sdpa, eager, flash_attention_2, flash_attention_3, "
        "flex_attention, or a hub kernel (e.g. kernels-community/flash-attn); checked before anything heavy. "
        "Default: transformers' choice for the model (sdpa where the model has it, eager otherwise).",
    )
    loss_chunk_size: int | None = _flag(
        None,
        "Tokens per chunk of the loss through the LM head, so the whole [tokens, vocabulary] logits never exist "
        "(training and evaluation). Default: auto, a chunk's fp32 logits at most 256 MiB. 0: the whole logits "
        "at once (as the Hugging Face loss does).",
    )
    router_aux_loss_coef: float | None = _flag(
        None,
        "Mixture-of-experts models: the weight of the router's load-balancing loss added to the token loss "
        "(logged as aux_loss). Default: the model config's router_aux_loss_coef. 0: no load-balancing loss.",
    )

    @property
    def model_source(self) -> str:
        """Where the model architecture comes from: the pretrained folder/id or the config to train from."""
        return self.model_name_or_path or self.config_name or str(DEFAULT_MODEL_DIR)

    @property
    def tokenizer_source(self) -> str:
        return self.tokenizer_name or self.model_source

    def validate(self) -> None:
        if self.model_name_or_path and self.config_name:
            raise UsageError(
                "--model_name_or_path and --config_name: choose one",
                "--model_name_or_path loads pretrained weights; --config_name trains from scratch",
            )
        for flag in ("model_name_or_path", "config_name", "tokenizer_name"):
            _check_model_path(flag, getattr(self, flag))
        if self.activation_offloading and not self.gradient_checkpointing:
            raise UsageError(
                "--activation_offloading without --gradient_checkpointing: it offloads the inputs of the "
                "checkpointed layers, and there are none",
                "add --gradient_checkpointing",
            )
        if self.tiled_mlp_shards < 0 or (self.tiled_mlp_shards and not self.tiled_mlp):
            raise UsageError(
                f"--tiled_mlp_shards {self.tiled_mlp_shards}: "
                + ("must not be negative" if self.tiled_mlp_shards < 0 else "given without --tiled_mlp"),
                "add --tiled_mlp and give a number of slices (0: ALST's default)",
            )
        if self.loss_chunk_size is not None and self.loss_chunk_size < 0:
            raise UsageError(
                f"--loss_chunk_size {self.loss_chunk_size}: must not be negative",
                "give tokens per chunk, 0 for the whole logits, or leave it unset (auto)",
            )
        if self.router_aux_loss_coef is not None and not self.router_aux_loss_coef >= 0:
            raise UsageError(
                f"--router_aux_loss_coef {self.router_aux_loss_coef}: must not be negative",
                "give a weight such as 0.01, 0 for no load-balancing loss, or leave it unset",
            )


@dataclass(frozen=True)
class PeftArgs:
    """LoRA through peft (TRL's flag spellings): only the adapter trains; the export is an adapter folder."""

    use_peft: bool = _flag(False, "Train a LoRA adapter on the frozen pretrained model (--model_name_or_path).")
    lora_r: int = _flag(16, "LoRA rank.")
    lora_alpha: int = _flag(32, "LoRA alpha: the adapter's update is scaled by alpha / r.")
    lora_dropout: float = _flag(0.05, "Dropout on the adapter's input.")
    lora_target_modules: str = _flag(
        "all-linear",
        "Modules that get an adapter: all-linear (every linear layer but the LM head) or names, "
        "comma-separated (q_proj,v_proj); a name matches a module whose path ends with it.",
    )
    merge_lora: bool = _flag(False, "Also export the merged full model (base + adapter) to <output_dir>/merged.")
    load_in_4bit: bool = _flag(False, "QLoRA: 4-bit base weights through bitsandbytes (refused without a CUDA GPU).")

    @property
    def target_modules(self):
        """peft's target_modules: "all-linear" as it is, names as a list."""
        if self.lora_target_modules.strip() == "all-linear":
            return "all-linear"
        return [name.strip() for name in self.lora_target_modules.split(",") if name.strip()]

    def validate(self) -> None:
        if self.lora_r < 1:
            raise UsageError(f"--lora_r {self.lora_r}: must be at least 1", "e.g. 8, 16 or 64")
        if not self.lora_alpha > 0:
            raise UsageError(f"--lora_alpha {self.lora_alpha}: must be positive", "e.g. twice --lora_r")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise UsageError(f"--lora_dropout {self.lora_dropout}: must be at least 0 and below 1")
        if not self.target_modules:
            raise UsageError(
                f"--lora_target_modules {self.lora_target_modules!r}: names no module",
                "give all-linear or module names such as q_proj,v_proj",
            )


@dataclass(frozen=True)
class DataArgs:
    """Raw data and how it becomes a token store (data/prepare.py parses these alone), and how training reads it."""

    dataset_name: str | None = _flag(None, "Hugging Face dataset name (hub or a local dataset script/folder).")
    dataset_config_name: str | None = _flag(None, "Configuration of --dataset_name.")
    dataset_revision: str | None = _flag(
        None,
        "Revision of a hub --dataset_name (branch, tag or commit; default: the main branch). Part of the token "
        "store's fingerprint: a commit ties the store to exact data.",
    )
    train_file: str | None = _flag(
        None,
        "Local training file(s): json, jsonl, csv, txt, parquet; a glob or a comma-separated list. "
        "Default: data/sample/train.jsonl.",
    )
    validation_file: str | None = _flag(
        None,
        "Local validation file(s), same formats as --train_file; several named sets, each with its own loss "
        "(eval_<name>_loss): name=path,name2=path2 (a glob per name).",
    )
    validation_split_percentage: int = _flag(
        5,
        "When there is no validation file or split, hold out this percent of the training documents, drawn at "
        "random (by --seed).",
    )
    validation_split_max_tokens: int = _flag(
        10_000_000,
        "Cap, in tokens, on what --validation_split_percentage holds out (0: no cap); the documents past "
        "it stay in training.",
    )
    text_column: str = _flag("text", "Column that holds the text.")
    block_size: int | None = _flag(None, "Tokens per training sequence. Default: min(1024, model's max positions).")
    preprocessing_num_workers: int | None = _flag(None, "Processes for tokenization (default: the CPU count).")
    # Training-time reading: prepared stores instead of raw data, and how blocks are fed to the model.
    data_path: str | None = _flag(
        None, "A token store made by data/prepare.py (instead of raw data).", training_only=True
    )
    dataset_mix: str | None = _flag(
        None,
        "Several token stores mixed by weight: store_a:0.7,store_b:0.3 (deterministic, by --seed).",
        training_only=True,
    )
    attention_isolation: bool = _flag(
        False, "No token attends across a document boundary (position ids restart per document).", training_only=True
    )
    # Chat data (a `messages` column, or `prompt` and `completion` columns): scaletrain/data/chat_store.py.
    chat_template: str | None = _flag(
        None, "Chat data: a Jinja chat template file to render the conversations with (default: the tokenizer's)."
    )
    assistant_only_loss: bool = _flag(
        False, "Chat data: train only on the assistant turns, each with its end-of-turn token."
    )
    truncation: str = _flag(
        "truncate",
        "Chat data: an example longer than --block_size is truncated to it (counted in the log) or dropped.",
        choices=("truncate", "drop"),
        training_only=True,
    )
    print_samples: int = _flag(
        0, "Chat data: print N rendered training examples with their trained tokens marked.", training_only=True
    )
    padding_free: bool = _flag(
        False,
        "Preference data: each micro-batch's sequences (chosen and rejected of every pair) in one row without "
        "padding, position ids restarting per sequence (TRL's padding_free).",
    )

    @property
    def uses_default_data(self) -> bool:
        return (
            self.dataset_name is None
            and self.train_file is None
            and self.data_path is None
            and self.dataset_mix is None
        )

    @property
    def train_data_file(self) -> str | None:
        return str(DEFAULT_TRAIN_FILE) if self.uses_default_data else self.train_file

    @property
    def validation_data_file(self) -> str | None:
        return str(DEFAULT_VALIDATION_FILE) if self.uses_default_data else self.validation_file

    @property
    def validation_sets(self) -> dict:
        """{store split: [files]} of the validation files: "validation" for unnamed ones, "validation.<name>" for each
        named set; {} without any."""
        return parse_validation_sets(self.validation_data_file)

    @property
    def mix(self) -> list:
        """--dataset_mix as [(store path, weight)], weights normalised to sum to 1; [] without it."""
        return parse_dataset_mix(self.dataset_mix) if self.dataset_mix else []

    @property
    def store_paths(self) -> list:
        """The prepared stores a run reads: --data_path, or every store of --dataset_mix ([] for raw data)."""
        if self.dataset_mix:
            return [path for path, _ in self.mix]
        return [self.data_path] if self.data_path else []

    @property
    def store_flag(self) -> str:
        return "--dataset_mix" if self.dataset_mix else "--data_path"

    def validate(self) -> None:
        """The data-source checks train.py and data/prepare.py share."""
        if self.block_size is not None and self.block_size < 2:
            raise UsageError(f"--block_size {self.block_size}: must be at least 2 (one input and one target token)")
        _check_not_negative(self, ("validation_split_percentage", "validation_split_max_tokens", "print_samples"))
        if self.validation_split_percentage >= 100:
            raise UsageError(f"--validation_split_percentage {self.validation_split_percentage}: must be below 100")
        if self.dataset_revision is not None and not self.dataset_name:
            raise UsageError(
                f"--dataset_revision {self.dataset_revision}: needs --dataset_name",
                "it names a revision of a hub dataset",
            )
        if self.preprocessing_num_workers is not None and self.preprocessing_num_workers < 1:
            raise UsageError(f"--preprocessing_num_workers {self.preprocessing_num_workers}: must be at least 1")
        _check_data_sources(self)


@dataclass(frozen=True)
class OptimArgs:
    """Batch sizes, the optimizer, the LR schedule and the run's length."""

    per_device_train_batch_size: int = _flag(8, "Sequences per rank per micro-batch.")
    per_device_eval_batch_size: int = _flag(8, "Sequences per rank per evaluation batch.")
    gradient_accumulation_steps: int = _flag(1, "Micro-batches accumulated per optimizer step.")
    learning_rate: float = _flag(1e-3, "Peak learning rate.")
    weight_decay: float = _flag(0.0, "AdamW weight decay.")
    adam_beta1: float = _flag(0.9, "AdamW beta1.")
    adam_beta2: float = _flag(0.95, "AdamW beta2.")
    adam_epsilon: float = _flag(1e-8, "AdamW epsilon.")
    max_grad_norm: float = _flag(1.0, "Gradient clipping norm (0 disables).")
    lr_scheduler_type: str = _flag(
        "cosine",
        "LR schedule after warmup: cosine, linear, constant (no warmup, Hugging Face's meaning), "
        "constant_with_warmup, wsd; Hugging Face's warmup_stable_decay and cosine_with_min_lr are taken as wsd and "
        "cosine.",
        type=lr_schedule_name,
    )
    warmup_steps: int = _flag(0, "Linear warmup steps (overrides --warmup_ratio when > 0).")
    warmup_ratio: float = _flag(0.05, "Warmup as a fraction of the total steps.")
    min_lr_ratio: float = _flag(0.1, "Final LR as a fraction of the peak (cosine, linear, wsd).")
    decay_ratio: float = _flag(0.2, "wsd: fraction of the total steps spent in the final decay.")
    max_steps: int = _flag(-1, "Optimizer steps to run; overrides --num_train_epochs (-1: unset).")
    num_train_epochs: float = _flag(3.0, "Epochs over the training blocks when --max_steps is not set.")
    seed: int = _flag(42, "Seed for initialisation and the data order.")
    rampup_batch_size: tuple[int, int, int] | None = _flag(
        None,
        "Batch-size ramp-up (Megatron's meaning): the global batch grows from START by INCREMENT blocks to its "
        "full size over SAMPLES blocks; the accumulation steps change at step boundaries only.",
        metavar=("START", "INCREMENT", "SAMPLES"),
    )
    rampup_lr_scaling: str = _flag(
        "none",
        "With --rampup_batch_size: scale the LR with the batch (x (batch/full)^0.5 or ^1), or not.",
        choices=RAMPUP_LR_SCALINGS,
    )

    def validate(self) -> None:
        if self.rampup_batch_size is not None:
            start, increment, samples = self.rampup_batch_size
            for name, value in (("START", start), ("INCREMENT", increment), ("SAMPLES", samples)):
                if value < 1:
                    raise UsageError(f"--rampup_batch_size {start} {increment} {samples}: {name} must be at least 1")
        elif self.rampup_lr_scaling != "none":
            raise UsageError(
                f"--rampup_lr_scaling {self.rampup_lr_scaling}: only acts with --rampup_batch_size",
                "add --rampup_batch_size START INCREMENT SAMPLES, or drop the flag",
            )
        _check_at_least_one(
            self, ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps")
        )
        if self.warmup_steps < 0:
            raise UsageError(f"--warmup_steps {self.warmup_steps}: must not be negative")
        if self.lr_scheduler_type == "constant" and self.warmup_steps > 0:
            raise UsageError(
                f"--lr_scheduler_type constant with --warmup_steps {self.warmup_steps}: constant has no warmup "
                "(Hugging Face's meaning)",
                "use --lr_scheduler_type constant_with_warmup",
            )
        if self.learning_rate <= 0:
            raise UsageError(f"--learning_rate {self.learning_rate}: must be positive")
        for name in ("warmup_ratio", "min_lr_ratio", "decay_ratio"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise UsageError(f"--{name} {getattr(self, name)}: must be between 0 and 1")
        if self.max_steps == 0 or self.max_steps < -1:
            raise UsageError(
                f"--max_steps {self.max_steps}: give a positive number of steps",
                "or leave it unset (-1) to train for --num_train_epochs",
            )
        if self.max_steps == -1 and self.num_train_epochs <= 0:
            raise UsageError("--max_steps and --num_train_epochs: set one of them to a positive number")


@dataclass(frozen=True)
class EngineArgs:
    """The DeepSpeed JSON and what the flags decide in it beyond the optimizer: precision and NVMe offload."""

    config: str = _flag(DEFAULT_DS_CONFIG, 'DeepSpeed JSON config; values set to "auto" are filled from these flags.')
    bf16: bool = _flag(False, 'Train in bf16 (overrides the JSON\'s "auto").')
    fp16: bool = _flag(False, 'Train in fp16 with dynamic loss scaling (overrides the JSON\'s "auto").')
    nvme_path: str | None = _flag(None, f"Folder for NVMe offload (zero3_nvme.json). Default: ${NVME_PATH_ENV}.")
    torch_compile: bool = _flag(
        False,
        'Compile the model with torch.compile through DeepSpeed\'s engine.compile (a "compile" section in '
        "the JSON turns it on too, with its DeepCompile options).",
    )
    cpu_shm_allreduce: bool = _flag(
        True,
        "CPU ranks all on one host: all-reduce gradient buckets through DeepSpeed's shared-memory kernel "
        "instead of gloo (3-14x faster on 2 cores; used where it can be: the log's first lines say).",
    )
    torch_compile_backend: str = _flag("inductor", "torch.compile backend for --torch_compile.")
    torch_compile_mode: str | None = _flag(
        None, "torch.compile mode for --torch_compile (default, reduce-overhead, max-autotune, ...)."
    )

    @property
    def resolved_nvme_path(self) -> str | None:
        return self.nvme_path or os.environ.get(NVME_PATH_ENV) or None

    def validate(self) -> None:
        if self.bf16 and self.fp16:
            raise UsageError("--bf16 and --fp16: choose one precision")
        config_path = Path(self.config)
        if not config_path.is_file():
            raise UsageError(f"--config {self.config}: no such file", "pick one of ds_configs/*.json")
        if not os.access(config_path, os.R_OK):
            raise UsageError(f"--config {self.config}: file is not readable", "check its permissions")


@dataclass(frozen=True)
class CheckpointArgs:
    """When checkpoints are written, kept and resumed, and the end-of-run export."""

    save_steps: int = _flag(0, "Save (and commit) a checkpoint every N steps (0: only at the end).")
    save_interval_minutes: float = _flag(0.0, "Also save when this many minutes passed since the last save (0: off).")
    save_total_limit: int = _flag(0, "Keep only the newest K committed checkpoints (0: keep all).")
    resume_from_checkpoint: str = _flag(
        "auto", "auto: newest committed checkpoint in --output_dir if any; none: start fresh; or a checkpoint path."
    )
    allow_schedule_change: bool = _flag(
        False,
        "Resume with another peak --learning_rate than the run being resumed (refused without it; another "
        "--max_steps, warmup or schedule is only warned about).",
    )
    async_save: bool = _flag(
        True,
        "Saves hold training only while each rank copies its share into host buffers; a writer process per rank "
        "writes the files in the background and the checkpoint is committed at a later step boundary "
        "(--no-async_save: every save written before training goes on). Falls back to synchronous saves, said in "
        "the first lines, where the host cannot hold the buffers.",
    )
    preemption_grace_seconds: float = _flag(
        120.0, "Seconds a scheduler allows between its signal and the kill; a slower save is warned about."
    )
    export_hf_at_end: bool = _flag(
        True,
        "Write the Hugging Face model (safetensors, config, tokenizer) to --output_dir at the end; "
        "--no-export_hf_at_end skips it (scripts/export_hf.py can export any checkpoint later).",
    )
    save_at_end: bool = _flag(
        True,
        "Commit a checkpoint of the last step at the end; --no-save_at_end skips it (benchmarks, sweeps: the "
        "run cannot then be continued from its last step; a pipeline's export needs it).",
    )
    push_to_hub: str | None = _flag(
        None,
        "After the run, rank 0 uploads the end-of-run export (weights, config, tokenizer, generation config, "
        "model card; not the checkpoints or logs) to this Hub repository (owner/name), with HF_TOKEN from the "
        "environment; retried, and a repeated upload resumes.",
    )
    hub_private_repo: bool = _flag(
        False, "--push_to_hub creates the repository private (an existing one keeps its visibility)."
    )

    def validate(self) -> None:
        _check_not_negative(
            self, ("save_steps", "save_interval_minutes", "save_total_limit", "preemption_grace_seconds")
        )


@dataclass(frozen=True)
class LoggingArgs:
    """Metrics, evaluation, sinks, profiling and the progress bar."""

    logging_steps: int = _flag(10, "Log metrics every N optimizer steps.")
    eval_steps: int = _flag(0, "Evaluate every N optimizer steps (0: only at the end).")
    max_eval_samples: int | None = _flag(None, "Cap on validation blocks per evaluation.")
    eval_prompts: str | None = _flag(
        None,
        "At each evaluation, a greedy generation of these prompts into metrics.jsonl and wandb: JSONL of "
        '{"prompt": text} or {"messages": [...]} (chat template), or one prompt per line of text.',
    )
    eval_max_new_tokens: int = _flag(64, "Tokens generated per --eval_prompts prompt.")
    peak_tflops: float | None = _flag(
        None, "Peak TFLOP/s of one device for MFU (default: a table for A100/H100/H200, a calibration on CPU)."
    )
    report_to: str = _flag(
        "none", "Extra metrics sinks, comma-separated: wandb, tensorboard (JSONL and console are always on)."
    )
    profile_steps: str | None = _flag(None, "A torch profiler trace of these steps (e.g. 5-7) in <output_dir>/profile.")
    disable_tqdm: bool = _flag(
        False, "No progress bar (where output is not a terminal there is none: a line per logging step instead)."
    )
    log_level: str = _flag(
        "info",
        "Console detail: info (default), debug (adds the resolved DeepSpeed JSON with the source of every value, "
        "also in <output_dir>/config_sources.txt), or warning (warnings and errors only).",
        choices=("debug", "info", "warning"),
    )
    comms_log: bool = _flag(
        False,
        "Communication log: per collective type (all-reduce, reduce-scatter, all-gather, broadcast, "
        "all-to-all, send/recv) the count, bytes, latency and bus bandwidth of this rank's DeepSpeed "
        "collectives, per logging window in the metrics and as a summary at the end. Each collective then "
        "synchronises the device: for diagnostic runs, not for production speed.",
    )

    @property
    def report_sinks(self) -> tuple:
        return tuple(s.strip() for s in self.report_to.split(",") if s.strip() and s.strip() != "none")

    @property
    def profile_range(self) -> tuple | None:
        if not self.profile_steps:
            return None
        first, _, last = self.profile_steps.partition("-")
        return int(first), int(last or first)

    def validate(self) -> None:
        if self.logging_steps < 1:
            raise UsageError(f"--logging_steps {self.logging_steps}: must be at least 1")
        if self.eval_max_new_tokens < 1:
            raise UsageError(f"--eval_max_new_tokens {self.eval_max_new_tokens}: must be at least 1")
        _check_not_negative(self, ("eval_steps",))
        for name in ("max_eval_samples", "peak_tflops"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise UsageError(f"--{name} {getattr(self, name)}: must be positive")
        for sink in self.report_sinks:
            if sink not in REPORT_SINKS:
                close = difflib.get_close_matches(sink, REPORT_SINKS, n=1)
                raise UsageError(
                    f'--report_to {self.report_to}: unknown sink "{sink}"',
                    f"did you mean {close[0]}?" if close else f"use {', '.join(REPORT_SINKS)}",
                )
        if self.profile_steps is not None:
            first, sep, last = self.profile_steps.partition("-")
            if (
                not (first.isdigit() and (not sep or last.isdigit()))
                or int(first) < 1
                or (sep and int(last) < int(first))
            ):
                raise UsageError(
                    f"--profile_steps {self.profile_steps}: give a step or a range of steps like 5-7",
                    "steps count from 1",
                )


@dataclass(frozen=True)
class ParallelArgs:
    """How the ranks split the model beyond data parallelism (the data-parallel size is what remains)."""

    tensor_parallel_size: int = _flag(
        1,
        "Tensor parallelism (DeepSpeed AutoTP, the model's own TP plan where it has one) over this many "
        "consecutive ranks, which read the same batches; keep it within a node.",
    )

    sequence_parallel_size: int = _flag(
        1,
        "Sequence parallelism (DeepSpeed Ulysses) over this many ranks (consecutive; every TP-th with "
        "--tensor_parallel_size, whose heads it splits again): each holds 1/N of every block's tokens, and attention "
        "all-to-alls trade tokens for heads; for blocks too long for one rank.",
    )

    pipeline_parallel_size: int = _flag(
        1,
        "Pipeline parallelism (deepspeed.pipe, 1F1B schedule) over this many stages of the model's own layers; "
        "the stages' data-parallel replicas are consecutive ranks, so stage-to-stage transfers cross nodes.",
    )

    allow_cross_node_tensor_parallel: bool = _flag(
        False, "Let a tensor-parallel group span nodes (refused by default: its all-reduces would cross the network)."
    )

    pipeline_partition: str = _flag(
        "parameters",
        "How the layers are cut into pipeline stages: balanced by parameter count (the embedding and "
        "head weigh in), or uniform (the same number of decoder layers per stage).",
        choices=("parameters", "uniform"),
    )

    def validate(self) -> None:
        _check_at_least_one(self, ("tensor_parallel_size", "sequence_parallel_size", "pipeline_parallel_size"))
