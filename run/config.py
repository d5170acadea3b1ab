"""The run configuration (SPEC section 11): sections, defaults, loading and validation."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from core import configlib
from core.cache import cache_root, default_eval_data
from core.device import check_device_name
from core.errors import ConfigError, check_choice, check_min, check_range
from data.config import DataConfig
from model.activation_checkpointing import MODES as AC_MODES
from model.attention.common.sdpa import SDPA_BACKENDS
from model.config import ModelConfig, model_config_from_dict
from run.engines import ENGINE_SPECS
from run.parallel import ParallelConfig, check_layout

SCHEDULES = ("cosine", "linear", "constant", "wsd")
# the lm-eval tasks eval/harness.py ships templates for (a test checks the two lists agree)
LM_EVAL_TASKS = (
    "hellaswag",
    "arc_easy",
    "arc_challenge",
    "piqa",
    "winogrande",
    "boolq",
    "social_iqa",
    "lambada_openai",
    "wikitext",
)
EVAL_DATA_ENV = "FOCUSED_PRETRAIN_EVAL_DATA"
DEFAULT_DATA_DIR = "<cache root>/eval_data"  # core.cache: used when it exists and nothing else is given
PRECISIONS = ("auto", "fp32", "bf16")
WANDB_MODES = ("offline", "online", "disabled")
NONFINITE_POLICIES = ("stop", "skip")
UNVERIFIABLE_POLICIES = ("stop", "start_over")  # checkpoint.unverifiable
# seconds a collective may wait: a day at most (torch keeps the bound in milliseconds; 1e308 overflows it), and a
# checkpoint's bound at least 10 s (every rank writes and hashes its files inside it)
MAX_COLLECTIVE_TIMEOUT = 86400.0
MIN_CHECKPOINT_TIMEOUT = 10.0
# train.float8: torchao's float8 training recipes (pretrain/engines/float8.py); none = no float8
FLOAT8_RECIPES = ("none", "tensorwise", "rowwise", "rowwise_with_gw_hp")


def resolve_data_dir(data_dir: str | Path | None) -> Path:
    """``data_dir``, else $FOCUSED_PRETRAIN_EVAL_DATA, else ``<cache root>/eval_data`` when it exists (core.cache:
    ``$FOCUSED_PRETRAIN_CACHE`` or ``~/.cache/focused-pretrain``; the old underscore-spelled folder is still read,
    with a note); a directory."""
    raw = data_dir if data_dir is not None else os.environ.get(EVAL_DATA_ENV)
    if not raw:
        default = default_eval_data()
        if default is not None:
            return default
        raise ConfigError(
            f"data_dir: not given and ${EVAL_DATA_ENV} is unset (nor is there {cache_root() / 'eval_data'}); pass the "
            "eval data directory, laid out like the offline bundle (docs/eval.md)"
        )
    path = Path(raw).expanduser()
    if not path.is_dir():
        raise ConfigError(f"data_dir: no such directory {str(path)!r}")
    return path


MAX_BATCH_TOKENS = 2**32  # tokens in one optimizer step (train.batch_size x data.seq_len)


@dataclass
class RunSection:
    dir: str = "runs/default"  # the run directory: config, checkpoints, metrics, logs
    name: str = ""  # display name for loggers; "" = the directory's name

    def validate(self) -> None:
        if not self.dir.strip():
            raise ConfigError("run.dir: must name a directory (it holds the checkpoints, logs and config)")


@dataclass
class TrainConfig:
    engine: str = "single"  # an engine of run.engines.ENGINE_SPECS; its own options: [train.<engine>]
    max_steps: int = 1000  # the schedule's length and the end of training
    stop_at: int = 0  # > 0: checkpoint and stop at this step, schedule unchanged (as a preemption would)
    batch_size: int = 32  # global sequences per optimizer step, whatever the world size
    micro_batch_size: int = 0  # per rank per forward; 0 = batch_size / world size (no accumulation)
    lr: float = 3e-4  # peak learning rate
    min_lr_ratio: float = 0.1  # the schedule's floor, as a fraction of lr
    warmup_steps: int = 100  # linear warm-up steps
    schedule: str = "cosine"  # cosine | linear | constant | wsd (warm-up, stable, decay)
    decay_fraction: float = 0.2  # wsd: share of steps spent decaying at the end
    weight_decay: float = 0.1  # AdamW decoupled weight decay (matrices only)
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.95  # AdamW beta2
    eps: float = 1e-8  # AdamW epsilon
    grad_clip: float = 1.0  # 0 = no clipping (the norm is still measured)
    seed: int = 0  # seeds weights, data order and sampling
    precision: str = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    log_every: int = 10  # steps between logged metrics
    compile: bool = False  # torch.compile each transformer block (before FSDP2 wraps it)
    activation_checkpointing: str = "none"  # none | selective (recompute cheap ops) | full (recompute each block)
    # the LM head and cross-entropy fused and chunked (model/loss.py): no [tokens, vocab] logits kept; false = the
    # plain head (the reference; losses equal to float32 rounding)
    fused_cross_entropy: bool = True
    # the SDPA backend tried first on CUDA (the others follow as fallbacks): auto (cudnn, then flash, efficient,
    # math) | cudnn | flash | efficient | math
    sdpa_backend: str = "auto"
    # float8 matmuls in the blocks' linear layers through torchao (pip install -e '.[float8]'): none | tensorwise |
    # rowwise | rowwise_with_gw_hp; the weights, checkpoints and exports stay high precision
    float8: str = "none"
    # module-name patterns (fnmatch) of further linear layers kept in high precision under train.float8
    float8_filter: list[str] = field(default_factory=list)
    # train.float8 on a CUDA device without float8 tensor cores (compute capability < 8.9): emulated (slow)
    float8_emulate: bool = False
    # initialise the weights from another run's checkpoint (a checkpoint dir, or a run dir = its
    # latest); optimizer and schedule start fresh. Ignored once this run has its own checkpoint.
    init_from: str = ""
    # parameter freezing by name pattern (pretrain/freezing.py): trainable = only these train;
    # freeze = these do not; unfreeze_at = from this step on everything trains (two-phase recipes)
    trainable: list[str] = field(default_factory=list)
    freeze: list[str] = field(default_factory=list)  # parameter-name patterns that do not train
    unfreeze_at: int = 0  # > 0: from this step on every parameter trains (two-phase recipes)
    # a non-finite loss or gradient norm: stop (exit 3, no checkpoint of that state) or skip the
    # step's update (at most nonfinite_skips in a row, then stop)
    nonfinite: str = "stop"
    nonfinite_skips: int = 3  # train.nonfinite = skip: consecutive skipped steps before stopping
    # seconds a collective may wait for another rank once the first step is done (set-up and the first step, which
    # compiles, get 30 minutes; checkpoint saves and resumes get checkpoint.collective_timeout, by default this);
    # a stalled rank then ends the job with one line naming it, and a requeue
    collective_timeout: float = 300.0
    # [train.parallel]: tensor / context parallel degrees; data parallelism is the rest of the world size
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # each engine's own options (the table [train.<engine>]), filled from the engine specs
    engine_options: dict[str, Any] = field(default_factory=dict, metadata={"config": False})
    # keys that moved into an engine's table: still read, with a one-line note (core.configlib)
    moved_keys: ClassVar[dict[str, str]] = {
        "zero_stage": "deepspeed.zero_stage",
        "deepspeed_config": "deepspeed.config",
        "fsdp_replicate": "fsdp2.replicate",
    }

    def __post_init__(self) -> None:
        for name, spec in ENGINE_SPECS.items():
            if spec.options_cls is not None:
                self.engine_options.setdefault(name, spec.options_cls())

    def config_sections(self) -> dict[str, Any]:
        return self.engine_options

    def options(self, engine: str) -> Any:
        """``[train.<engine>]``'s options."""
        return self.engine_options[engine]

    def warnings(self) -> list[str]:
        """Settings that run but are likely mistakes, one line each (the trainer prints them as warnings)."""
        out = []
        if self.warmup_steps > self.max_steps:
            out.append(
                f"train.warmup_steps={self.warmup_steps} exceeds train.max_steps={self.max_steps}: the learning rate "
                f"never reaches train.lr (it stops at {self.max_steps / self.warmup_steps:.0%} of it)"
            )
        return out

    def validate(self) -> None:
        check_choice("train.engine", self.engine, ENGINE_SPECS)
        for name in ("max_steps", "batch_size", "log_every"):
            check_min(f"train.{name}", getattr(self, name), 1)
        for name in ("micro_batch_size", "warmup_steps", "stop_at", "unfreeze_at"):
            check_min(f"train.{name}", getattr(self, name), 0)
        check_choice("train.activation_checkpointing", self.activation_checkpointing, AC_MODES)
        check_choice("train.sdpa_backend", self.sdpa_backend, SDPA_BACKENDS)
        self.parallel.validate("train.parallel.")
        for name, options in self.engine_options.items():
            options.validate(f"train.{name}.")
            if name != self.engine and options != type(options)():
                changed = next(k for k, v in vars(options).items() if v != getattr(type(options)(), k))
                raise ConfigError(
                    f"train.{name}.{changed}: set, but train.engine = {self.engine!r}; it applies to the {name} engine"
                )
        if self.unfreeze_at and not ENGINE_SPECS[self.engine].changes_trainable:
            capable = ", ".join(n for n, s in ENGINE_SPECS.items() if s.changes_trainable)
            raise ConfigError(
                f"train.unfreeze_at: not supported with train.engine={self.engine} (the trainable set is fixed "
                f"when the model is wrapped); engines that support it: {capable}"
            )
        self.validate_float8()
        check_choice("train.nonfinite", self.nonfinite, NONFINITE_POLICIES)
        check_min("train.nonfinite_skips", self.nonfinite_skips, 1)
        check_range("train.collective_timeout", self.collective_timeout, 1.0, MAX_COLLECTIVE_TIMEOUT)
        if self.nonfinite == "skip" and not ENGINE_SPECS[self.engine].skips_updates:
            raise ConfigError(
                f"train.nonfinite: 'skip' is not supported with train.engine={self.engine} (it updates inside "
                "backward); use 'stop'"
            )
        if self.stop_at > self.max_steps:
            raise ConfigError(f"train.stop_at: {self.stop_at} is past train.max_steps={self.max_steps}")
        check_min("train.lr", self.lr, 0, strict=True)
        check_range("train.min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        check_choice("train.schedule", self.schedule, SCHEDULES)
        check_range("train.decay_fraction", self.decay_fraction, 0.0, 1.0)
        check_choice("train.precision", self.precision, PRECISIONS)
        check_device_name(self.device, key="train.device")
        check_range("train.beta1", self.beta1, 0.0, 1.0, open_high=True)
        check_range("train.beta2", self.beta2, 0.0, 1.0, open_high=True)
        check_min("train.eps", self.eps, 0.0, strict=True)
        check_min("train.weight_decay", self.weight_decay, 0.0)
        check_min("train.grad_clip", self.grad_clip, 0)

    def validate_float8(self) -> None:
        check_choice("train.float8", self.float8, FLOAT8_RECIPES)
        if self.float8 != "none" and not ENGINE_SPECS[self.engine].float8:
            capable = ", ".join(n for n, s in ENGINE_SPECS.items() if s.float8)
            raise ConfigError(
                f"train.float8: not supported with train.engine={self.engine}; engines that support it: {capable}"
            )
        for pattern in self.float8_filter:
            if not isinstance(pattern, str) or not pattern:
                raise ConfigError(f"train.float8_filter: {pattern!r} is not a module-name pattern (a non-empty string)")


@dataclass
class CheckpointConfig:
    every: int = 500  # steps between checkpoints; 0 = only at the end (and on preemption)
    keep: int = 3  # complete checkpoints kept (the newest); 0 = all
    # a run.dir whose step directories hold no checkpoint that verifies (manifest and checksums): stop, one line,
    # nothing touched; or start_over: move them to checkpoints/damaged/ and train from step 0 (on purpose)
    unverifiable: str = "stop"
    # seconds a collective of a checkpoint save or resume may wait for another rank (a large save on slow storage
    # may need more than the step-time bound); 0 = train.collective_timeout
    collective_timeout: float = 0.0

    def validate(self) -> None:
        check_min("checkpoint.every", self.every, 0)
        check_min("checkpoint.keep", self.keep, 0)
        check_choice("checkpoint.unverifiable", self.unverifiable, UNVERIFIABLE_POLICIES)
        value = self.collective_timeout
        if value != 0 and not MIN_CHECKPOINT_TIMEOUT <= value <= MAX_COLLECTIVE_TIMEOUT:  # nan fails both
            raise ConfigError(
                f"checkpoint.collective_timeout: must be 0 (= train.collective_timeout) or in "
                f"[{MIN_CHECKPOINT_TIMEOUT}, {MAX_COLLECTIVE_TIMEOUT}] seconds, got {value}"
            )


@dataclass
class EvalConfig:
    every: int = 200  # steps between validation passes; 0 = only at the end
    batches: int = 20  # validation batches per pass
    batch_size: int = 0  # 0 = train.micro_batch_size
    sample_prompt: str = ""  # "" = the start of the first validation document
    sample_tokens: int = 64  # tokens of the sample printed at the end (0 = none)
    # lm-eval tasks in the loop (eval/harness.py: hellaswag, arc_easy, lambada_openai, ...), results
    # in metrics.jsonl as eval/<task>/<metric>; every rank runs them (sharded engines need that)
    tasks: list[str] = field(default_factory=list)
    tasks_every: int = 0  # steps between task evaluations; 0 = eval.every
    limit: int = 100  # examples per task (0 = all)
    data_dir: str = ""  # the tasks' data (layout of the offline bundle); "" = $FOCUSED_PRETRAIN_EVAL_DATA

    def validate(self) -> None:
        for name in ("every", "batch_size", "sample_tokens", "tasks_every", "limit"):
            check_min(f"eval.{name}", getattr(self, name), 0)
        check_min("eval.batches", self.batches, 1)
        if self.tasks:
            # names only: lm-eval itself is imported when a task runs, so validation needs no extra
            unknown = [t for t in self.tasks if t not in LM_EVAL_TASKS]
            if unknown:
                raise ConfigError(
                    f"eval.tasks: {', '.join(unknown)} not available; allowed: {', '.join(LM_EVAL_TASKS)}"
                )
            try:
                resolve_data_dir(self.data_dir or None)
            except ConfigError as exc:  # named data_dir there; here it is an eval.* key
                raise ConfigError(f"eval.{exc}") from None


@dataclass
class LogConfig:
    tensorboard: bool = True  # TensorBoard event files in <run.dir>/tb
    wandb: str = "offline"  # offline unless configured; online needs WANDB_API_KEY in the environment
    wandb_project: str = "focused-pretrain"  # W&B project ("" = the default)
    wandb_entity: str = ""  # W&B entity ("" = the default)
    console: bool = True  # print metrics to the console

    def validate(self) -> None:
        check_choice("log.wandb", self.wandb, WANDB_MODES)


MEMORY_SNAPSHOTS = ("none", "traced", "oom", "both")


@dataclass
class ProfileConfig:
    # torch.profiler trace of steps start .. start + steps - 1, written under <run.dir>/profile/ (TensorBoard's
    # profiler plugin and Perfetto read it); 0 = no trace
    start: int = 0
    steps: int = 3  # steps traced from profile.start
    all_ranks: bool = False  # trace every rank (default: rank 0 only)
    # CUDA memory snapshot (pytorch.org/memory_viz) of the traced steps, when a CUDA out-of-memory error is raised,
    # or both; CUDA runs only
    memory_snapshot: str = "none"

    def validate(self) -> None:
        check_min("profile.start", self.start, 0, note=" (0 = no trace)")
        check_range("profile.steps", self.steps, 1, 1000)
        check_choice("profile.memory_snapshot", self.memory_snapshot, MEMORY_SNAPSHOTS)
        if self.memory_snapshot in ("traced", "both") and not self.start:
            raise ConfigError("profile.memory_snapshot: 'traced' snapshots the traced steps; set profile.start too")


@dataclass
class RunConfig:
    run: RunSection = field(default_factory=RunSection)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir)

    def _length_message(self) -> str:
        """data.seq_len past the model's length: the keys that change the model's length, in one line."""
        seq, max_len = self.data.seq_len, self.model.max_seq_len
        fix = f"raise model.max_seq_len (--set model.max_seq_len={seq})"
        if self.model.uses_rope:
            fix += (
                f"; to continue a checkpoint trained at {max_len}, extend RoPE too: model.rope.scaling (yarn, linear, "
                f"ntk, dynamic_ntk, llama3) with model.rope.factor={seq / max_len:g}, or a larger model.rope.theta"
            )
        else:
            fix += " (learned positions: the new ones start untrained)"
        return f"data.seq_len: {seq} exceeds model.max_seq_len={max_len}; {fix}"

    def validate(self) -> None:
        self.run.validate()
        self.model.validate()
        self.data.validate()
        self.train.validate()
        self.checkpoint.validate()
        self.eval.validate()
        self.log.validate()
        self.profile.validate()
        if self.data.seq_len > self.model.max_seq_len:
            raise ConfigError(self._length_message())
        tokens = self.train.batch_size * self.data.seq_len
        if tokens > MAX_BATCH_TOKENS:
            raise ConfigError(
                f"train.batch_size: {self.train.batch_size:,} sequences of {self.data.seq_len:,} tokens is "
                f"{tokens:,} tokens per step, beyond {MAX_BATCH_TOKENS:,} (2^32, a sane upper bound: 256x the largest "
                "published batch)"
            )
        check_layout(self.train, self.model, self.data.seq_len)
        if self.data.document_masking:
            from model.attention import registry

            if not registry[self.model.attention.kind].cls.supports_documents:
                supported = ", ".join(k for k, e in sorted(registry.items()) if e.cls.supports_documents)
                raise ConfigError(
                    f"data.document_masking: not supported by model.attention.kind = {self.model.attention.kind!r}; "
                    f"supported: {supported}"
                )

    def to_dict(self) -> dict[str, Any]:
        return configlib.to_dict(self)

    def to_toml(self) -> str:
        return configlib.dump_toml(self.to_dict())


def run_config_from_dict(data: dict[str, Any]) -> RunConfig:
    data = dict(data)
    model_table = data.pop("model", {})
    cfg = configlib.from_dict(RunConfig, data)
    cfg.model = model_config_from_dict(model_table)
    return cfg


def derived_config(path: str | Path) -> dict[str, Any] | None:
    """``<dir>/<base>_<variant>.toml`` that does not exist as a file: ``<dir>/<base>.toml`` with
    ``model.attention.kind = <variant>``, the variant's launch overrides (``Attention.launch_overrides``)
    and ``run.dir`` suffixed with the variant. None when ``path`` names no such pair."""
    from model.attention import registry

    path = Path(path)
    if path.is_file() or path.suffix != ".toml":
        return None
    for variant in sorted(registry, key=len, reverse=True):  # prescored_hyper before any shorter suffix
        base = path.with_name(path.name.removesuffix(f"_{variant}.toml") + ".toml")
        if path.name.endswith(f"_{variant}.toml") and base.is_file():
            data = configlib.load_toml(base)
            family = model_config_from_dict(dict(data.get("model", {}))).family
            configlib.apply_override(data, f"model.attention.kind={variant}")
            for key, value in registry[variant].cls.launch_overrides(family).items():
                configlib.apply_override(data, f"{key}={value}")
            run_dir = data.get("run", {}).get("dir")
            if run_dir:
                configlib.apply_override(data, f'run.dir="{run_dir}_{variant}"')
            return data
    return None


def raw_run_config(path: str | Path | None) -> dict[str, Any]:
    """A TOML run config (or a derived ``<base>_<variant>.toml``) as written: a dict, nothing resolved."""
    return (derived_config(path) or configlib.load_toml(path)) if path else {}


def load_run_config(path: str | Path | None, overrides: Sequence[str] = (), *, validate: bool = True) -> RunConfig:
    """Read a TOML file (or a derived ``<base>_<variant>.toml``, see ``derived_config``), apply
    ``--set`` overrides, take the model's shape from ``train.init_from = "hf:PATH"`` (run/hf_init.py),
    build and validate."""
    from run.hf_init import apply_hf_init

    data = raw_run_config(path)
    for assignment in overrides:
        configlib.apply_override(data, assignment)
    apply_hf_init(data)  # train.init_from = "hf:PATH": the model's shape is the folder's config.json
    cfg = run_config_from_dict(data)
    if validate:
        cfg.validate()
    return cfg
