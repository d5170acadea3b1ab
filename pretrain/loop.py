"""The training loop: step (loss -> backward -> clip -> optimizer) -> callbacks.

Logging, validation, lm-eval tasks, checkpoints, the preemption marker and the final report are
callbacks (``pretrain/callbacks.py``); the trainer's checkpointed state is ``pretrain.state.TrainState``.

It never branches on the engine or the attention variant: engines sit behind
``pretrain.engines`` and variants behind the attention registry.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import re
import shutil
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np
import tomllib
import torch

from core.errors import ConfigError
from core.files import atomic_write_text
from core.memory import PeakMemory, fix_malloc_for_rss
from core.rng import rng_state, set_rng_state
from data.build import Corpus, build_corpus
from data.loader import BatchLoader, StreamBatchLoader, eval_batches
from eval.perplexity import mean_loss, perplexity
from model.counts import flops_per_token
from model.transformer import build_model
from pretrain import checkpoint as ckpt
from pretrain import resume_config
from pretrain.callbacks import Callback, default_callbacks
from pretrain.engines import Engine, build_engine, prepare_device, rank_zero_first
from pretrain.engines.parallel import STARTUP_COLLECTIVE_TIMEOUT
from pretrain.freezing import apply_trainable, check_patterns
from pretrain.loggers import Loggers
from pretrain.metrics import peak_flops
from pretrain.optim import apply_hyperparameters
from pretrain.signals import PREEMPTED_MARKER, SignalHandler
from pretrain.state import TrainState
from pretrain.state_sizes import StateProbe, probe_enabled
from run.checkpoint import NewerFormat
from run.config import RunConfig, run_config_from_dict
from run.hf_init import hf_source, load_state, mapped_state
from run.sizes import check_machine


@dataclass
class TrainResult:
    step: int
    tokens: int
    val_loss: float | None
    exit_code: int  # 0 done or stopped at train.stop_at; 75 / 130 after a signal; NONFINITE_EXIT_CODE
    error: str = ""  # one line, when the run stopped on a failure


NONFINITE_EXIT_CODE = 3  # a non-finite loss or gradient norm stopped the run (train.nonfinite)
STALLED_EXIT_CODE = 75  # another rank stopped answering: like a preemption, the marker is left for a requeue
LOCK_FILE = ".lock"
# set to 1: every step's forward + backward is measured as ``bench.memory`` measures (``core.memory.PeakMemory``: the
# CUDA allocator's peak, or on the CPU the growth of the resident set's peak, glibc returning freed blocks) and log
# steps carry each rank's ``mem/step_peak_mib/rank<r>`` and their maximum ``mem/step_peak_mib``
PEAK_MEMORY_ENV = "FOCUSED_PRETRAIN_PEAK_MEMORY"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def code_version() -> str:
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class Trainer:
    """Steps the model and calls its callbacks (``pretrain.callbacks``); ``callbacks=None`` is the
    standard set for ``cfg``."""

    def __init__(self, cfg: RunConfig, callbacks: list[Callback] | None = None, signals: SignalHandler | None = None):
        self.cfg = cfg
        self.run_dir = cfg.run_dir
        self.callbacks = default_callbacks(cfg, report=False) if callbacks is None else callbacks
        # None: the trainer catches signals only while it runs (pretrain.train installs one for the process)
        self.signals = signals
        self.step = 0
        self.tokens = 0
        self.saved_step = -1  # the step of the newest checkpoint this run has (restored or written)
        self.stalled_ranks: str | None = None  # the ranks a failed collective waited for, named once found
        # the bound on a collective between steps (set-up and the first step compile: the long one) and the key
        # that sets the bound in effect now (a stall names it)
        self.step_timeout = STARTUP_COLLECTIVE_TIMEOUT
        self.timeout_key = "train.collective_timeout"
        self.fired_bound: tuple[float, str] | None = None  # (seconds, key) of a checkpoint bound a failure left
        self.config_changes: list[str] = []  # what a relaunch changed about the stored run, one line each
        self.last_val: float | None = None
        self.last_val_tokens = 0  # the target tokens last_val averages (eval.batches of the validation split)
        self.stop = cfg.train.stop_at or cfg.train.max_steps
        self.preempted = False
        self.error = ""  # a failure that stopped the run (non-finite values)
        self.nonfinite_streak = 0
        self.measure_memory = os.environ.get(PEAK_MEMORY_ENV, "") not in ("", "0")

    @property
    def finished(self) -> bool:
        """Trained to train.max_steps (not stopped early by a signal, a failure or train.stop_at)."""
        return not self.preempted and not self.error and self.step == self.cfg.train.max_steps

    def _call(self, hook: str, *args: object) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(self, *args)

    # ---- setup ----------------------------------------------------------------------
    def setup(self) -> None:
        """Everything that can fail on bad input runs before the run directory is touched; the
        directory is written only after the resume (if any) has been validated."""
        cfg = self.cfg
        for line in cfg.train.warnings():
            self._say(f"warning: {line}")
        # sizes against this machine before the corpus or the model is built (pretrain.train checked them already;
        # an in-process caller such as hf_import's start has not)
        check_machine(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        self.device = prepare_device(cfg.train)
        if self.measure_memory and self.device.type == "cpu":
            fix_malloc_for_rss()  # the resident set then follows the live tensors (bench.memory's method)
        seed_everything(cfg.train.seed)
        with rank_zero_first():
            self.corpus: Corpus = build_corpus(cfg.data, vocab_size=cfg.model.vocab_size, log=self._say)
        self.model = build_model(cfg.model, device=self.device)
        if cfg.data.document_masking:
            self.model.document_eos_id = self.corpus.tokenizer.eos_id
        check_patterns(self.model, cfg.train)
        self._apply_trainable()
        if cfg.train.init_from and not ckpt.step_directories(self.run_dir):
            self._init_from(cfg.train.init_from)  # before the engine wraps the weights (FSDP2 shards, ZeRO copies them)
        self.engine: Engine = build_engine(self.model, cfg.train, self.device)
        self._say(self.engine.layout.describe(self.engine.name))
        if self.engine.float8_summary:
            self._say(self.engine.float8_summary)
        # the loader is indexed by the data-parallel rank: the TP (and CP) ranks of one replica read the same sequences
        world = self.engine.data_world_size
        micro = cfg.train.micro_batch_size or max(1, cfg.train.batch_size // world)
        if self.corpus.stream is not None:
            self.loader: StreamBatchLoader | BatchLoader = StreamBatchLoader(
                self.corpus.stream,
                self.corpus.tokenizer,
                seq_len=cfg.data.seq_len,
                batch_size=cfg.train.batch_size,
                micro_batch_size=micro,
                rank=self.engine.data_rank,
                world_size=world,
                seed=cfg.train.seed,
            )
        else:
            assert self.corpus.train is not None  # not a stream
            self.loader = BatchLoader(
                self.corpus.train,
                batch_size=cfg.train.batch_size,
                micro_batch_size=micro,
                rank=self.engine.data_rank,
                world_size=world,
                seed=cfg.train.seed,
            )
        self.eval_batch_size = cfg.eval.batch_size or micro
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)["flops_per_token"]
        self.peak = peak_flops(self.device)
        self._take_run_dir()
        self.loggers = Loggers(
            self.run_dir,
            cfg.log,
            run_name=cfg.run.name or self.run_dir.name,
            config=cfg.to_dict(),
            enabled=self.engine.is_main,
        )
        with self._checkpoint_timeout():  # verification and loading wait on every rank's share
            self._restore()
        if self.engine.is_main:  # the resume is valid: now the run directory may change
            (self.run_dir / PREEMPTED_MARKER).unlink(missing_ok=True)  # this start is the requeued job
            self.corpus.tokenizer.save(self.run_dir)
            config_file = self.run_dir / "config.toml"
            previous = config_file.read_text() if config_file.is_file() else None
            history = [f"{resume_config.HISTORY_PREFIX}{self.step}: {line}" for line in self.config_changes]
            toml = resume_config.with_history(cfg.to_toml(), previous, history)
            if previous != toml:
                atomic_write_text(config_file, toml)
        if self.signals is not None:
            self.signals.defer()  # from here on a signal checkpoints at the next step boundary

    def _take_run_dir(self) -> None:
        """Create run.dir and hold its lock (rank 0) for the life of the process: a second live trainer
        on the same directory is refused; a dead one's lock is released by the OS."""
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if not self.engine.is_main:
                return
            self._lock: IO[str] | None = open(self.run_dir / LOCK_FILE, "a+")  # held until exit
        except OSError as exc:
            raise ConfigError(f"run.dir: cannot write {self.run_dir} ({exc.strerror})") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.seek(0)
            owner = self._lock.read().strip() or "another process"
            raise ConfigError(f"run.dir: another trainer ({owner}) is running in {self.run_dir}") from None
        self._lock.seek(0)
        self._lock.truncate()
        self._lock.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        self._lock.flush()
        # no other trainer can be writing here now: any temporary checkpoint directory is a dead save's
        for leftover in ckpt.leftover_temporaries(self.run_dir):
            shutil.rmtree(leftover, ignore_errors=True)

    def release_run_dir(self) -> None:
        """Let another trainer take run.dir (the process exiting does the same)."""
        lock = getattr(self, "_lock", None)
        if lock is not None:
            lock.close()
            self._lock = None

    def _apply_trainable(self, step: int | None = None) -> None:
        step = self.step if step is None else step
        counts = apply_trainable(self.model, self.cfg.train, step)
        if counts is not None:
            self._say(f"step {step}: training {counts[0]:,} of {counts[1]:,} parameters")
            if getattr(self, "engine", None) is not None:  # set-up applies the first set before wrapping
                self.engine.trainable_changed()

    def _source_tokens(self) -> dict[str, float]:
        """data/tokens/<source>: target tokens drawn per source, all ranks; data/share/<source>: their share."""
        counts = self.loader.token_counts()
        if not counts:
            return {}
        names = sorted(counts)
        total = self.engine.all_reduce_data_sum(
            torch.tensor([float(counts[n]) for n in names], dtype=torch.float64, device=self.device)
        )
        out = {f"data/tokens/{n}": float(v) for n, v in zip(names, total.tolist())}
        return out | {k.replace("tokens", "share", 1): v / max(sum(out.values()), 1.0) for k, v in out.items()}

    def _reference_batch(self) -> torch.Tensor:
        """A fixed validation batch for statistics tracked across log steps (Focus stability)."""
        if getattr(self, "_ref_batch", None) is None:
            assert self.corpus.val is not None  # the caller checks
            batch = next(eval_batches(self.corpus.val, batch_size=self.eval_batch_size, max_batches=1))
            self._ref_batch = batch[:, :-1].to(self.device)
        return self._ref_batch

    def _say(self, line: str) -> None:
        if getattr(self, "engine", None) is None or self.engine.is_main:
            print(line, flush=True)

    def _trainer_state(self) -> TrainState:
        return TrainState(
            step=self.step,
            tokens=self.tokens,
            rng=self.engine.gather_object(rng_state()),
            world_size=self.engine.world_size,
            loader=self._loader_states(),
            data_fingerprint=self.corpus.fingerprint,
            tokenizer_fingerprint=self.corpus.tokenizer.fingerprint,
            config=self.cfg.to_toml(),
            code_version=code_version(),
        )

    def _loader_states(self) -> list:
        """Every data-parallel rank's loader state, in data-rank order (the TP ranks of a replica hold the same)."""
        by_rank = dict(self.engine.gather_object((self.engine.data_rank, self.loader.state_dict())))
        return [by_rank[r] for r in sorted(by_rank)]

    def _init_from(self, source: str) -> None:
        """Continue training another run's weights (context extension, retrofits): model only."""
        hf_dir = hf_source(source)
        if hf_dir is not None:
            self._init_from_hf(hf_dir)
            return
        path = ckpt.resolve_checkpoint(source, key="train.init_from")
        state = TrainState.from_state_dict(ckpt.verify_checkpoint(path, key="train.init_from"))
        if state.tokenizer_fingerprint != self.corpus.tokenizer.fingerprint:
            raise ConfigError(
                f"data.tokenizer: does not match the tokenizer of {path}; set data.tokenizer to "
                f"{path / 'tokenizer.model'}"
            )
        ckpt.load_weights(self.model, path, device=self.device, new_attention_ok=True, key="train.init_from")
        self._say(f"initialised weights from {path} (step {state.step})")

    def _init_from_hf(self, path: Path) -> None:
        """``train.init_from = "hf:PATH"``: the folder's weights, mapped (the config already has its shape,
        run/hf_init.py); its tokenizer, when it has one, must be the run's."""
        from data.tokenizer import load_tokenizer

        try:
            theirs = load_tokenizer(path).fingerprint
        except ConfigError:
            theirs = None  # a model folder without a tokenizer: data.tokenizer is the user's word
        if theirs is not None and theirs != self.corpus.tokenizer.fingerprint:
            raise ConfigError(f"data.tokenizer: is not the tokenizer of hf:{path}; set data.tokenizer to {path}")
        state, _, arch = mapped_state(path)
        load_state(self.model, state, where=f"hf:{path}", key="train.init_from")
        self._say(f"initialised weights from hf:{path} ({arch})")

    def _newest_good_checkpoint(self) -> Path | None:
        """The newest step directory that verifies: a well-formed manifest (``meta.json``: a checksum for every
        file) and files whose sizes and content checksums match it, headers, trainer state (each rank hashes its
        share of the files). One that does not (bits flipped on disk, a kill mid-copy, a full disk, a manifest
        deleted or rewritten) is skipped with one line naming why and, once an older good one is found, moved to
        ``checkpoints/damaged/`` so that pruning never counts it nor keeps it over the good one. With step
        directories but none that verifies, nothing is touched and the run stops with one line (never silently
        start over), unless ``checkpoint.unverifiable = start_over`` says to: then they are moved aside first."""
        skipped: list[tuple[Path, str]] = []
        share = (self.engine.rank, self.engine.world_size)
        found = ckpt.step_directories(self.run_dir)
        for _, path in reversed(found):
            try:
                ckpt.verify_checkpoint(path, key="resume", all_files=True, share=share)
                problem = None
            except NewerFormat:
                raise  # written by newer code: not damaged, and falling back would discard its training
            except ConfigError as exc:
                problem = str(exc)
            problems = [p for p in self.engine.gather_object(problem) if p]
            if not problems:
                for _, why in skipped:
                    self._say(f"warning: skipping a damaged checkpoint: {why}")
                if self.engine.is_main:
                    for bad, _ in skipped:
                        self._say(f"warning: moved the damaged checkpoint aside: {ckpt.set_aside(bad)}")
                return path
            skipped.append((path, problems[0]))
        if not skipped:
            return None
        root = ckpt.checkpoint_root(self.run_dir)
        newest = skipped[0][1].removeprefix("resume: ")
        what = f"{len(skipped)} step director{'y' if len(skipped) == 1 else 'ies'}"
        if self.cfg.checkpoint.unverifiable != "start_over":  # never silently start over and overwrite the run
            raise ConfigError(
                f"resume: no checkpoint in {root} can be verified ({what}; the newest: {newest}); nothing was "
                f"changed; to start over on purpose use a new run.dir, or set checkpoint.unverifiable=start_over "
                f"(moves them to {root / ckpt.DAMAGED_DIR})"
            )
        records: list[Path] = []
        if self.engine.is_main:
            for bad, _ in skipped:
                ckpt.set_aside(bad)
            records = ckpt.set_aside_records(self.run_dir)  # the old model's metrics and eval results go with it
        self.engine.barrier()
        with_them = f", with the run's {' and '.join(p.name for p in records)}" if records else ""
        self._say(
            f"warning: checkpoint.unverifiable=start_over: moved {what} that cannot be verified{with_them} to "
            f"{root / ckpt.DAMAGED_DIR} (the newest: {newest}); training from step 0"
        )
        if self.cfg.train.init_from:  # read before the engine wrapped the weights, which this launch did not
            raise ConfigError(
                "checkpoint.unverifiable: the unverifiable checkpoints are out of the way now; launch again to "
                "start from train.init_from"
            )
        return None

    def _restore(self) -> None:
        path = self._newest_good_checkpoint()
        if path is None:
            self.loggers.start_fresh()  # a restart before the first checkpoint: its metrics are stale
            return
        state = TrainState.from_state_dict(ckpt.load_trainer_state(path))
        found = resume_config.changes(_resolved(state.config), self.cfg.to_toml())
        resume_config.check(found, str(path))  # refused keys first: the errors below would not name them
        if state.tokenizer_fingerprint != self.corpus.tokenizer.fingerprint:
            raise ConfigError(
                f"data.tokenizer: does not match the tokenizer of checkpoint {path} (fingerprints differ)"
            )
        if state.data_fingerprint != self.corpus.fingerprint:
            raise ConfigError(f"data: the corpus or its settings changed since checkpoint {path}; use a new run.dir")
        # the trainable set of the checkpoint's last step, so the engine's optimizer state matches the saved one
        self._apply_trainable(max(state.step - 1, 0))
        self.engine.read_state(path)
        if any(c.key in resume_config.OPTIMIZER_KEYS for c in found):  # the checkpoint's optimizer has the old ones
            apply_hyperparameters(self.engine.scheduler, self.cfg.train)
        self.config_changes = [c.line(state.step) for c in found]
        for line in self.config_changes:
            self._say(f"config: {line}")
        self.loader.load_state_dict(state.loader)
        set_rng_state(state.rng_for(self.engine.rank, self.engine.world_size))
        self.step, self.tokens = state.step, state.tokens
        self.saved_step = state.step
        self.loggers.truncate_after(self.step)
        self._say(f"resumed from {path} at step {self.step} ({self.tokens:,} tokens)")

    @contextlib.contextmanager
    def _checkpoint_timeout(self) -> Iterator[None]:
        """Collectives inside bounded by checkpoint.collective_timeout (0: train.collective_timeout), then by the
        step-time bound again."""
        seconds, key = self.cfg.checkpoint.collective_timeout, "checkpoint.collective_timeout"
        if not seconds:
            seconds, key = self.cfg.train.collective_timeout, "train.collective_timeout"
        self._bound_collectives(seconds, key)
        try:
            yield
        except BaseException:
            # a collective that timed out in here was bounded by ``key``: _stalled names that one, not the step's
            self.fired_bound = (seconds, key)
            raise
        finally:
            self._bound_collectives(self.step_timeout, "train.collective_timeout")

    def _bound_collectives(self, seconds: float, key: str) -> None:
        if self.engine.world_size > 1:
            self.engine.set_collective_timeout(seconds)
        self.timeout_key = key

    def _write_checkpoint_files(self, directory: Path) -> None:
        self.engine.write_state(directory)
        if self.engine.is_main:
            self.corpus.tokenizer.save(directory)  # a checkpoint is self-contained for evaluation

    def save(self) -> Path | None:
        """A checkpoint of the current state; refused (the run stops) if any weight is not finite."""
        if not self._weights_finite():
            self.error = f"train.nonfinite: non-finite weights at step {self.step}; no checkpoint written"
            return None
        with self._checkpoint_timeout():  # a stalled rank ends the job within it, saves included
            path = ckpt.save_checkpoint(
                self.run_dir,
                self.step,
                write_engine_state=self._write_checkpoint_files,
                trainer_state=self._trainer_state().state_dict(),
                keep=self.cfg.checkpoint.keep,
                meta={"tokens": self.tokens},
                coord=self.engine,
            )
        self.saved_step = self.step
        self._say(f"checkpoint saved: {path}")
        self._call("post_checkpoint", path)
        return path

    def _weights_finite(self) -> bool:
        bad = sum(int(not bool(torch.isfinite(p.detach()).all())) for p in self.model.parameters())
        return self._agree(float(bad)) == 0

    # ---- steps ----------------------------------------------------------------------
    def validate(self) -> float | None:
        if self.corpus.val is None:  # a stream without data.val_path
            return None
        batches = eval_batches(
            self.corpus.val,
            batch_size=self.eval_batch_size,
            max_batches=self.cfg.eval.batches,
            rank=self.engine.data_rank,
            world_size=self.engine.data_world_size,
        )
        local, count = mean_loss(
            self.engine.model,
            batches,
            device=self.device,
            autocast=self.engine.autocast(),
            split=self.engine.local_batch,  # under CP each rank scores its chunks; the sums add over dp x cp
        )
        sums = self.engine.all_reduce_data_sum(
            torch.tensor([local * count, float(count)], dtype=torch.float64, device=self.device)
        )
        loss = float(sums[0] / sums[1])
        self.last_val, self.last_val_tokens = loss, int(sums[1])
        self.loggers.log({"step": self.step, "val_loss": loss, "val_ppl": perplexity(loss)})
        self.loggers.console(f"step {self.step:>6} | val_loss {loss:.4f} | val_ppl {perplexity(loss):.2f}")
        return loss

    def evaluate_tasks(self) -> dict:
        """lm-eval tasks on the current weights (every rank runs them: sharded forwards need all
        ranks); rank 0 logs ``eval/<task>/<metric>``."""
        from eval.harness import FocusedLM, evaluate, flatten_for_metrics

        ev = self.cfg.eval
        lm = FocusedLM(
            self.model,
            self.corpus.tokenizer,
            device=self.device,
            batch_size=self.eval_batch_size,
            max_length=self.cfg.data.seq_len,
            rank=self.engine.rank,
            world_size=self.engine.world_size,
        )
        with self.engine.autocast(), self.model.whole_sequences():  # the harness's batches are not CP-sharded
            results = evaluate(lm, ev.tasks, limit=ev.limit or None, data_dir=ev.data_dir or None)
        flat = flatten_for_metrics(results)
        if flat:
            self.loggers.log({"step": self.step, **flat})
            self.loggers.console(
                f"step {self.step:>6} | " + " | ".join(f"{k.removeprefix('eval/')} {v:.4f}" for k, v in flat.items())
            )
        return flat

    def train_step(self, log_step: bool) -> dict:
        """One optimizer step. Values stay on the device (no host sync) unless this is a logging step."""
        self.model.set_collect_stats(log_step)
        self.model.set_train_progress(self.step, self.cfg.train.max_steps)
        self._apply_trainable()
        micro = self.loader.next_step()
        # this rank's targets: every CP rank of a replica loads the same windows and keeps 1 / cp of each (summed
        # over dp x cp, each target counts once)
        n_local = sum(mb.shape[0] * (mb.shape[1] - 1) for mb in micro) // self.engine.cp_size
        n_global = int(self.engine.all_reduce_data_sum(torch.tensor(float(n_local), device=self.device)))
        lr = self.engine.lr
        loss_sum = torch.zeros((), device=self.device)
        aux_sum: torch.Tensor | None = None
        stats: dict[str, torch.Tensor | float] = {}
        # PRETRAIN_STATE_SIZES: the first step's local state and saved activations, for the layout planner's test
        probe = StateProbe(self.model, self.run_dir, self.engine.rank) if self.step == 0 and probe_enabled() else None
        with PeakMemory(self.device.type if self.measure_memory else "none") as mem:
            for i, mb in enumerate(micro):
                with probe.micro_step() if probe is not None else contextlib.nullcontext():
                    out = self.engine.micro_step(
                        mb[:, :-1],
                        mb[:, 1:],
                        loss_scale=1.0 / n_global,
                        aux_scale=1.0 / len(micro),
                        sync=i == len(micro) - 1,
                    )
                loss_sum += out.loss_sum
                if out.aux_loss is not None:
                    aux_sum = out.aux_loss / len(micro) + (0 if aux_sum is None else aux_sum)
                for key, value in out.stats.items():
                    stats[key] = stats.get(key, 0.0) + value / len(micro)
        grad_norm = self.engine.clip_gradients(self.cfg.train.grad_clip)
        # every rank must agree: one all-reduce (and host sync) of the two checks per step
        nonfinite = self._agree(float(not bool(torch.isfinite(loss_sum))) + float(not bool(torch.isfinite(grad_norm))))
        if probe is not None:
            probe.before_update()
        self.engine.apply_update(skip=nonfinite > 0)
        if probe is not None:
            probe.after_update(self.engine.optimizer)
        self.step += 1
        self.tokens += n_global
        if nonfinite:
            self._nonfinite_step(grad_norm)
        else:
            self.nonfinite_streak = 0
        if not log_step:
            return {}
        record = {
            "step": self.step,
            "loss": float(self.engine.all_reduce_data_sum(loss_sum)) / n_global,
            "lr": lr,
            "grad_norm": float(grad_norm),
            "tokens": self.tokens,
        }
        if aux_sum is not None:
            record["aux_loss"] = float(aux_sum)
        if self.measure_memory:  # every rank's peak: one all-reduce, on logging steps only (all ranks log alike)
            record.update(self._rank_peaks(mem.peak))
        record.update(self._source_tokens())
        if self.corpus.val is not None:
            with self.engine.autocast():
                stats.update(self.model.reference_batch_stats(self._reference_batch()))
        record.update({k: float(v) for k, v in stats.items()})
        return record

    def run(self) -> TrainResult:
        """step -> callbacks, until train.stop_at / train.max_steps, a signal or a non-finite step."""
        if self.step >= self.stop:
            self._say(f"nothing to do: the run is at step {self.step} (stop at {self.stop})")
            self.release_run_dir()
            return TrainResult(self.step, self.tokens, None, 0)
        first = self.step  # the first step after (re)start is always logged
        self.model.train()
        own = self.signals is None  # embedded use (benchmarks): catch signals only while running
        signals = self.signals = self.signals or SignalHandler(deferred=True)
        with signals if own else contextlib.nullcontext():
            self._call("pre_train")
            while self.step < self.stop and not self.error:
                try:
                    if self._one_step(first):
                        break
                except RuntimeError as exc:  # gloo / NCCL: a collective timed out or lost its peer
                    if self._stalled(exc):
                        break
                    raise
            if self.stalled_ranks is None:
                try:
                    self._call("post_train")  # signals here wait for the final checkpoint
                except RuntimeError as exc:  # a rank stalled in the final save
                    if not self._stalled(exc):
                        raise
            self.loggers.close()
        if own:
            self.signals = None
        self.release_run_dir()
        if self.stalled_ranks is not None:
            return TrainResult(self.step, self.tokens, self.last_val, STALLED_EXIT_CODE, self.error)
        code = NONFINITE_EXIT_CODE if self.error else signals.exit_code if self.preempted else 0
        return TrainResult(self.step, self.tokens, self.last_val, code, self.error)

    def _one_step(self, first: int) -> bool:
        """One step and its callbacks; True when a stop was requested instead."""
        if self.stop_requested():
            return True
        last = self.step + 1 == self.stop
        log_step = self.step == first or (self.step + 1) % self.cfg.train.log_every == 0 or last
        self._call("pre_step")
        self.engine.heartbeat(self.step)
        record = self.train_step(log_step)
        if self.step == first + 1:  # compiled and warmed up: from here on a stall is found in minutes
            self.step_timeout = self.cfg.train.collective_timeout
            self._bound_collectives(self.step_timeout, "train.collective_timeout")
        self._call("post_step", record)
        return False

    def _stalled(self, exc: RuntimeError) -> bool:
        """Whether a failed collective was another rank that stopped answering (its heartbeat is behind): then
        this rank says which in one line, leaves the requeue marker and ends (torchrun stops the others)."""
        if self.engine.world_size == 1 or not _collective_failure(exc):
            return False
        who = self.engine.stalled()
        if who is None:
            return False
        self.stalled_ranks = who
        timeout, key = self.fired_bound or (getattr(self.engine, "collective_timeout", None), self.timeout_key)
        waited = f"no answer within {key}={timeout:g} s" if timeout else "a collective failed"
        said = re.sub(r"^\[[^\]]*\]\s*", "", " ".join(str(exc).split()))[:80]  # gloo starts with its source line
        self.error = f"{key}: {who} stopped answering ({waited}{'; ' + said if said else ''})"
        atomic_write_text(self.run_dir / PREEMPTED_MARKER, f"{self.saved_step}\n")  # requeue from the last checkpoint
        self.engine.end_stalled()  # a stopped rank on this host would hold the job for torchrun's shutdown grace
        return True

    def stop_requested(self) -> bool:
        """Whether any rank got a signal. Signals reach ranks at different moments and every rank must
        stop (and save) at the same point: one scalar all-reduce, so every rank calls this alike."""
        if self.signals is None:
            return False
        if self._agree(float(self.signals.requested)) == 0:
            return False
        if not self.preempted:
            self.preempted = True
            what = "interrupted" if self.signals.interrupted else "preemption signal"
            self._say(
                f"{what} ({self.signals.describe() or 'another rank'}): saving at step {self.step} and exiting "
                f"with {self.signals.exit_code}"
            )
        return True

    def _rank_peaks(self, peak: int | None) -> dict[str, float]:
        """Every rank's peak (MiB) of this step's forward + backward, and their maximum (one all-reduce; -1 where
        unmeasurable)."""
        world, rank = self.engine.world_size, self.engine.rank
        mib = torch.zeros(world, dtype=torch.float64, device=self.device)
        mib[rank] = -1.0 if peak is None else peak / 2**20
        if world > 1:
            mib = self.engine.all_reduce_sum(mib)
        values = mib.tolist()
        return {"mem/step_peak_mib": max(values), **{f"mem/step_peak_mib/rank{r}": v for r, v in enumerate(values)}}

    def _agree(self, value: float) -> float:
        """``value`` summed over ranks (itself in one process)."""
        if self.engine.world_size == 1:
            return value
        return float(self.engine.all_reduce_sum(torch.tensor([value], dtype=torch.float64, device=self.device)))

    def _nonfinite_step(self, grad_norm: torch.Tensor) -> None:
        cfg = self.cfg.train
        self.nonfinite_streak += 1
        what = f"non-finite loss or gradient norm at step {self.step} (grad_norm {float(grad_norm):.4g})"
        if cfg.nonfinite == "skip" and self.nonfinite_streak <= cfg.nonfinite_skips:
            self._say(
                f"warning: {what}: update skipped ({self.nonfinite_streak} in a row, at most {cfg.nonfinite_skips})"
            )
            return
        newest = f"step {self.saved_step}" if self.saved_step >= 0 else "none yet"
        policy = "train.nonfinite = skip skips such steps" if cfg.nonfinite == "stop" else "too many in a row"
        self.error = (
            f"train.nonfinite: {what}; stopped without saving this state (newest checkpoint: {newest}; {policy})"
        )

    def sample(self, max_new_tokens: int, prompt: str = "") -> str:
        """A short generated continuation, for the console (seeded: the same run prints the same sample)."""
        tok = self.corpus.tokenizer
        if prompt or self.corpus.val is None:
            ids = tok.encode(prompt) or [tok.eos_id]
        else:
            ids = self.corpus.val[0][:16].tolist()
        gen = torch.Generator(device=self.device).manual_seed(self.cfg.train.seed)
        x = torch.tensor([ids], device=self.device)
        self.model.eval()
        out = self.model.generate(
            x, max_new_tokens, temperature=0.8, top_k=50, generator=gen, eos_id=tok.eos_id, vocab_size=tok.vocab_size
        )
        return tok.decode(out[0].tolist())


def _resolved(stored: str) -> str:
    """A checkpoint's config as this code resolves it (keys added since get their defaults), so only real
    changes differ; the stored text itself if this code no longer reads it."""
    try:
        return run_config_from_dict(tomllib.loads(stored)).to_toml()
    except (ConfigError, tomllib.TOMLDecodeError):
        return stored


def _collective_failure(exc: BaseException) -> bool:
    """A collective that timed out or lost its peer (torch's DistError family, or the backend's own words), as
    opposed to any other error raised during a step."""
    if isinstance(exc, torch.distributed.DistError):
        return True
    text = str(exc)
    return any(word in text for word in ("Timed out", "timed out", "Connection closed by peer", "Connection reset"))
