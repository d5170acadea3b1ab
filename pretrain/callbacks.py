"""What the training loop does besides stepping, as callbacks on a small hook vocabulary.

The loop calls, in list order: ``pre_train`` once, then per step ``pre_step`` and ``post_step``
(``record`` holds the step's metrics on logging steps, else it is empty), ``post_checkpoint``
after every save, and ``post_train`` once after the loop (``trainer.preempted`` says why it
ended). ``default_callbacks(cfg)`` builds the standard set from the run config; order matters
where one callback's output is another's input (the final checkpoint before the preemption
marker the SLURM script requeues on).
"""

from __future__ import annotations

import time
from typing import Any

from core.files import atomic_write_text
from pretrain.hooks import Callback, Trainer
from pretrain.loggers import format_duration
from pretrain.metrics import memory_gib
from pretrain.profiling import Profiler
from pretrain.signals import PREEMPTED_MARKER
from run.config import RunConfig


class Throughput(Callback):
    """Logs each logging step's record with tokens/s over the steps since the last one (step time
    only: validation, tasks and checkpoints are not training throughput), memory and MFU."""

    def pre_train(self, trainer: Trainer) -> None:
        self.seconds, self.tokens_at, self.step_at = 0.0, trainer.tokens, trainer.step

    def pre_step(self, trainer: Trainer) -> None:
        self.started = time.perf_counter()

    def post_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        self.seconds += time.perf_counter() - self.started
        if not record:
            return
        tps = (trainer.tokens - self.tokens_at) / max(self.seconds, 1e-9)
        record["tokens_per_s"] = tps
        record["memory_gib"] = memory_gib(trainer.device)
        if trainer.peak:
            record["mfu"] = tps * trainer.flops_per_token / (trainer.peak * trainer.engine.world_size)
        trainer.loggers.log(record)
        eta = (trainer.stop - trainer.step) * self.seconds / max(1, trainer.step - self.step_at)
        trainer.loggers.console(
            f"step {trainer.step:>6}/{trainer.cfg.train.max_steps} | loss {record['loss']:.4f} | "
            f"lr {record['lr']:.2e} | gnorm {record['grad_norm']:.3f} | {tps:,.0f} tok/s"
            + (f" | mfu {record['mfu']:.1%}" if "mfu" in record else "")
            + f" | mem {record['memory_gib']:.2f} GiB | eta {format_duration(eta)}"
        )
        self.seconds, self.tokens_at, self.step_at = 0.0, trainer.tokens, trainer.step


class Validation(Callback):
    """Validation loss every ``eval.every`` steps, and on the final weights."""

    def __init__(self, every: int):
        self.every = every

    def post_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if self.every and trainer.step % self.every == 0:
            trainer.validate()

    def post_train(self, trainer: Trainer) -> None:
        if trainer.finished and (not self.every or trainer.step % self.every) and not trainer.stop_requested():
            trainer.validate()


class LmEvalTasks(Callback):
    """lm-eval tasks (``eval.tasks``) every ``eval.tasks_every`` (else ``eval.every``) steps and on
    the final weights."""

    def __init__(self, every: int):
        self.every = every

    def _due(self, step: int) -> bool:
        return bool(self.every and step % self.every == 0)

    def post_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if self._due(trainer.step):
            trainer.evaluate_tasks()

    def post_train(self, trainer: Trainer) -> None:
        if trainer.finished and not self._due(trainer.step) and not trainer.stop_requested():
            trainer.evaluate_tasks()


class Checkpointer(Callback):
    """A checkpoint every ``checkpoint.every`` steps (not at the last step: the final save covers
    it) and at the end when there is unsaved progress, whatever ended the run (never after a
    non-finite step: the newest checkpoint is the last good state)."""

    def __init__(self, every: int):
        self.every = every

    def post_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if trainer.step < trainer.stop and self.every and trainer.step % self.every == 0:
            trainer.save()

    def post_train(self, trainer: Trainer) -> None:
        if not trainer.error and trainer.step > trainer.saved_step:
            trainer.save()


class PreemptionMarker(Callback):
    """``<run.dir>/preempted`` after a preemption's checkpoint (the sbatch script requeues on it;
    the trainer's set-up removes it when the requeued job starts)."""

    def post_train(self, trainer: Trainer) -> None:
        # a signal during the final work still ends as a preemption (checked by every rank alike)
        if trainer.stop_requested() and not trainer.signals.interrupted and trainer.engine.is_main:
            atomic_write_text(trainer.run_dir / PREEMPTED_MARKER, f"{trainer.step}\n")


class FinalReport(Callback):
    """On a finished run: the final validation loss and perplexity, and a generated sample (every
    rank generates: sharded weights need all of them; rank 0 prints)."""

    def __init__(self, sample_tokens: int, prompt: str):
        self.sample_tokens, self.prompt = sample_tokens, prompt

    def post_train(self, trainer: Trainer) -> None:
        from eval.perplexity import perplexity

        if not trainer.finished or trainer.stop_requested():
            return
        if trainer.last_val is not None and trainer.engine.is_main:
            entropy = trainer.corpus.unigram_entropy
            # eval.batches of the validation split: eval.run --tasks ppl scores all of it (its figure differs a little)
            print(
                f"final validation loss {trainer.last_val:.4f} | perplexity {perplexity(trainer.last_val):.2f} over "
                f"{trainer.last_val_tokens:,} tokens (eval.batches = {trainer.cfg.eval.batches}; eval.run --tasks ppl "
                "scores the whole validation split)"
                + (f" | corpus unigram entropy {entropy:.4f} nats" if entropy is not None else "")
            )
        if self.sample_tokens:
            text = trainer.sample(self.sample_tokens, self.prompt)
            if trainer.engine.is_main:
                print("sample:\n" + text)


def default_callbacks(cfg: RunConfig, *, report: bool = True) -> list[Callback]:
    """The standard set, in the order they must run. ``report``: print the final report."""
    callbacks: list[Callback] = [Throughput(), Validation(cfg.eval.every)]
    if cfg.profile.start or cfg.profile.memory_snapshot != "none":
        callbacks.insert(0, Profiler(cfg.profile))  # first: its trace covers the other callbacks' step work too
    if cfg.eval.tasks:
        callbacks.append(LmEvalTasks(cfg.eval.tasks_every or cfg.eval.every))
    callbacks += [Checkpointer(cfg.checkpoint.every), PreemptionMarker()]  # the marker after the checkpoint
    if report:
        callbacks.append(FinalReport(cfg.eval.sample_tokens, cfg.eval.sample_prompt))
    return callbacks
