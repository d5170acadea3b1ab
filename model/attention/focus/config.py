"""Focus's options: ``FocusConfig``, its choice tuples, and the scheduled gate strength ``lambda_at``."""

from __future__ import annotations

import math
from dataclasses import dataclass

from core.errors import ConfigError, check_choice, check_min, check_range
from model.attention.common.base import VariantConfig

SCOPES = ("prefix", "sequence")
ASSIGNMENTS = ("sinkhorn", "softmax")
GATES = ("additive", "multiplicative")
MODES = ("soft", "hard")
LAMBDA_SCHEDULES = ("constant", "linear", "cosine")
ENTROPY_WHEN = ("centroid_phase", "always")
MAX_GROUPS = 62  # memberships are int64 bitmasks


@dataclass
class FocusConfig(VariantConfig):
    n_groups: int = 4  # K
    d_group: int = 16  # d_g; 0 = d_model (the paper's full-rank projection)
    tau: float = 0.1  # temperature dividing the group scores
    sinkhorn_iters: int = 10  # Sinkhorn normalisation rounds
    sinkhorn_scope: str = "prefix"  # prefix (causal) | sequence (the paper's; not causal)
    assignment: str = "sinkhorn"  # sinkhorn | softmax (collapses; kept for the comparison)
    window: int = 128  # pairs with i - j < window are never gated
    gate: str = "additive"  # additive: + log sigmoid(lam (a - 0.5)) | multiplicative: x sigmoid(lam a)
    lambda_init: float = 2.0  # gate strength lambda at the start
    lambda_learnable: bool = True  # lambda is a trained parameter (constant schedule only)
    # lambda annealing: from lambda_init to lambda_end over the first lambda_warmup share of
    # train.max_steps, then held (the paper: 2 -> 12 over half the steps)
    lambda_schedule: str = "constant"
    lambda_end: float = 12.0  # scheduled lambda: the value after the warm-up
    lambda_warmup: float = 0.5  # scheduled lambda: share of train.max_steps to reach lambda_end
    mode: str = "soft"  # soft (training) | hard (exact sparse inference)
    top_k: int = 1  # hard mode: groups per token
    entropy_weight: float = 0.1  # auxiliary loss on assignment entropy (mean over layers), see entropy
    # when the entropy penalty applies: centroid_phase = while only the variants' own parameters train (the paper's
    # phase 1, centroid-only retrofits) | always = whenever the centroids train (also from scratch and in phase 2)
    entropy: str = "centroid_phase"

    def validate(self, prefix: str) -> None:
        p = prefix
        check_range(p + "n_groups", self.n_groups, 1, MAX_GROUPS)
        check_min(p + "d_group", self.d_group, 0, note=" (0 = model.d_model)")
        check_min(p + "tau", self.tau, 0.0, strict=True)
        check_min(p + "sinkhorn_iters", self.sinkhorn_iters, 1)
        check_choice(p + "sinkhorn_scope", self.sinkhorn_scope, SCOPES)
        check_choice(p + "assignment", self.assignment, ASSIGNMENTS)
        check_min(p + "window", self.window, 1)
        check_choice(p + "gate", self.gate, GATES)
        check_choice(p + "lambda_schedule", self.lambda_schedule, LAMBDA_SCHEDULES)
        check_range(p + "lambda_warmup", self.lambda_warmup, 0.0, 1.0)
        check_choice(p + "mode", self.mode, MODES)
        check_range(p + "top_k", self.top_k, 1, self.n_groups)
        check_min(p + "entropy_weight", self.entropy_weight, 0.0)
        check_choice(p + "entropy", self.entropy, ENTROPY_WHEN)
        if self.lambda_schedule != "constant" and self.lambda_learnable:
            raise ConfigError(
                f"{p}lambda_learnable: a scheduled lambda (lambda_schedule={self.lambda_schedule!r}) "
                "cannot also be learned; set lambda_learnable=false"
            )


def lambda_at(cfg: FocusConfig, step: int, max_steps: int) -> float:
    """The scheduled gate strength at optimizer step ``step``."""
    span = cfg.lambda_warmup * max_steps
    frac = 1.0 if span <= 0 else min(1.0, step / span)
    if cfg.lambda_schedule == "cosine":
        frac = 0.5 * (1.0 - math.cos(math.pi * frac))
    elif cfg.lambda_schedule == "constant":
        frac = 0.0
    return cfg.lambda_init + (cfg.lambda_end - cfg.lambda_init) * frac
