"""What a relaunch may change about a stored run (issue 30 item 3). The config a checkpoint was written
with is compared key by key with the relaunch's: keys that change the model or the data are refused in
one line naming each key and both values; hyperparameters the trainer can honour from the resume step
on (learning rate, schedule, cadence, logging) and launch settings (engine, device, precision, compile)
are taken, one line per key saying so; ``config.toml`` keeps a line per change below the config.

Classes (a key not listed falls in its section's class): ``model.*`` and ``data.*`` refuse, except the
data keys that only say where or how fast to read; ``train.seed`` and the trainable set refuse (the data
order and the optimizer state depend on them); ``train.init_from`` is ignored once a run has a checkpoint;
everything else under ``train``, ``checkpoint``, ``eval``, ``log`` and ``run`` is honoured."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import tomllib

from core.errors import ConfigError

REFUSE, HONOUR, LAUNCH, IGNORE = "refused", "honoured", "launch", "ignored"
_SECTIONS = {
    "model": REFUSE,
    "data": REFUSE,
    "train": HONOUR,
    "checkpoint": HONOUR,
    "eval": HONOUR,
    "log": HONOUR,
    "profile": LAUNCH,
}
_KEYS = {
    "data.cache_dir": LAUNCH,
    "data.num_workers": LAUNCH,
    "data.val_path": HONOUR,
    "train.seed": REFUSE,
    "train.trainable": REFUSE,
    "train.freeze": REFUSE,
    "train.unfreeze_at": REFUSE,
    "train.init_from": IGNORE,
    "train.engine": LAUNCH,
    "train.device": LAUNCH,
    "train.precision": LAUNCH,
    "train.compile": LAUNCH,
    "train.activation_checkpointing": LAUNCH,
    "train.fused_cross_entropy": LAUNCH,
    "train.sdpa_backend": LAUNCH,
    # float8 casts inside the matmuls only: the weights and the optimizer state stay high precision
    "train.float8": LAUNCH,
    "train.float8_filter": LAUNCH,
    "train.float8_emulate": LAUNCH,
    "train.micro_batch_size": LAUNCH,
    "train.fsdp2.replicate": LAUNCH,
    "train.parallel": LAUNCH,  # tp / cp: the layout; DCP reshards the state onto another
    "train.deepspeed.zero_stage": LAUNCH,
    "train.deepspeed.config": LAUNCH,
    "checkpoint.unverifiable": LAUNCH,  # what this launch does when no checkpoint verifies
    "checkpoint.collective_timeout": LAUNCH,
}
HISTORY_PREFIX = "# resumed at step "
# the optimizer's own copies of these come back from the checkpoint: a change must be written into it
OPTIMIZER_KEYS = ("train.lr", "train.beta1", "train.beta2", "train.eps", "train.weight_decay")


def kind_of(key: str) -> str:
    if key in _KEYS:
        return _KEYS[key]
    for prefix, kind in _KEYS.items():  # a table's keys (train.deepspeed.*) follow the table's entry
        if key.startswith(prefix + "."):
            return kind
    return _SECTIONS.get(key.split(".", 1)[0], HONOUR)


def _flat(data: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in data.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any
    kind: str

    def line(self, step: int) -> str:
        what = {
            HONOUR: f"honoured from step {step}",
            LAUNCH: "this launch's setting",
            IGNORE: "ignored: the run continues from its own checkpoint",
        }.get(self.kind, self.kind)
        return f"{self.key}: {self.old!r} -> {self.new!r} ({what})"


def changes(stored_toml: str, new_toml: str) -> list[Change]:
    """Every key whose value differs between the stored config and the relaunch's (both resolved TOML)."""
    old = dict(_flat(tomllib.loads(stored_toml)))
    new = dict(_flat(tomllib.loads(new_toml)))
    missing = object()
    out = []
    for key in sorted(old.keys() | new.keys()):
        before, after = old.get(key, missing), new.get(key, missing)
        if before == after:
            continue
        before = "(unset)" if before is missing else before
        after = "(unset)" if after is missing else after
        out.append(Change(key, before, after, kind_of(key)))
    return out


def check(found: list[Change], checkpoint: str) -> None:
    """One ``ConfigError`` line naming every refused key with both values, if any."""
    refused = [c for c in found if c.kind == REFUSE]
    if refused:
        keys = "; ".join(f"{c.key} {c.old!r} -> {c.new!r}" for c in refused)
        raise ConfigError(
            f"resume: the relaunch changes the model or the data of the run in {checkpoint}: {keys}; put them back, "
            "or start a new run.dir (train.init_from can start it from these weights)"
        )


def with_history(toml: str, previous: str | None, lines: list[str]) -> str:
    """``toml`` followed by the change lines ``previous`` carried and the new ``lines`` (TOML comments)."""
    kept = [line for line in (previous or "").splitlines() if line.startswith(HISTORY_PREFIX)]
    history = kept + lines
    return toml if not history else toml.rstrip("\n") + "\n\n" + "\n".join(history) + "\n"
