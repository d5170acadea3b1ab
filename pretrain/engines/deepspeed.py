"""The ``deepspeed`` engine: ZeRO stages 0-3 (optionally with CPU optimizer offload) behind the
same adapter surface as the other engines.

The ZeRO options come from a JSON file (``train.deepspeed.config``, default
``launch/deepspeed/zero.json``); everything the run config already says is filled in from it
(stage, global and micro batch, accumulation steps, precision, gradient clipping), so the two
cannot disagree. Our own AdamW and schedule are used (``zero_allow_untested_optimizer``), which
avoids DeepSpeed's JIT-compiled optimizers. Checkpoints are DeepSpeed's own
(``save_checkpoint`` / ``load_checkpoint`` under ``ds/``) plus the consolidated
``model.safetensors`` that evaluation reads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from core.errors import ConfigError
from pretrain.engines.base import MicroStepOut
from pretrain.engines.parallel import SCHEDULER_FILE, DataParallelEngine, check_written_by
from pretrain.engines.parallelize import parallelize

if TYPE_CHECKING:
    from model.transformer import Transformer
    from run.config import TrainConfig

DS_TAG = "ds"
DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "launch" / "deepspeed" / "zero.json"


def deepspeed_config(cfg: TrainConfig, world_size: int, bf16: bool) -> dict[str, Any]:
    options = cfg.options("deepspeed")
    path = Path(options.config) if options.config else DEFAULT_CONFIG
    try:
        ds = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"train.deepspeed.config: cannot read {path} as JSON ({exc})") from None
    zero = ds.setdefault("zero_optimization", {})
    if "stage" in zero and zero["stage"] != options.zero_stage:
        raise ConfigError(
            f"train.deepspeed.zero_stage: {options.zero_stage} disagrees with stage {zero['stage']} in {path}; set "
            "the stage in one place (train.deepspeed.zero_stage)"
        )
    zero["stage"] = options.zero_stage
    micro = cfg.micro_batch_size or cfg.batch_size // world_size
    ds.update(
        {
            "train_batch_size": cfg.batch_size,
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": cfg.batch_size // (micro * world_size),
            "gradient_clipping": cfg.grad_clip,
            "bf16": {"enabled": bf16},
            "fp16": {"enabled": False},
        }
    )
    return ds


class DeepSpeedEngine(DataParallelEngine):
    name = "deepspeed"

    def __init__(self, model: Transformer, cfg: TrainConfig, device: torch.device):
        if cfg.compile:
            raise ConfigError(
                "train.compile: not supported with train.engine=deepspeed here; use fsdp2 for torch.compile"
            )
        self._micro = 0
        super().__init__(model, cfg, device)

    def autocast_dtype(self) -> torch.dtype | None:
        return None  # DeepSpeed casts the model itself when bf16 is on

    def parallelize(self, model: Transformer) -> torch.nn.Module:
        """Activation checkpointing through ``parallelize`` (compile is refused above, TP / CP by the config check); the
        wrap is ``deepspeed.initialize``, with the optimizer (``make_optimizer``).

        ZeRO-3 gathers a module's partitioned parameters for its backward through hooks on the tensors its forward
        returns. An attention core returns an ``AttnOut``, which DeepSpeed does not look into, so the core's own
        parameters (Focus's centroids and lambda, focal's and Lazy's temperatures and biases) would still be
        partitioned (empty) when their gradients are computed: the block, which returns a tensor, gathers them."""
        wrapped = parallelize(model, self.cfg)  # no data-parallel wrap: the model itself
        if self.cfg.options("deepspeed").zero_stage == 3:
            from deepspeed.runtime.zero.partition_parameters import register_external_parameter

            for block in model.blocks:
                for param in block.attn.core.parameters(recurse=False):
                    register_external_parameter(block, param)
        return wrapped

    def make_optimizer(self, model: Transformer) -> tuple[Any, Any]:
        """DeepSpeed wraps model and optimizer together: the wrapped module is set here."""
        import deepspeed

        optimizer, scheduler = super().make_optimizer(model)
        bf16 = self.cfg.precision == "bf16" or (self.cfg.precision == "auto" and self.device.type == "cuda")
        self.ds, ds_optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=deepspeed_config(self.cfg, self.world_size, bf16)
        )
        self.wrapped = self.model = self.ds
        return ds_optimizer, scheduler

    def micro_step(
        self, inputs: Tensor, targets: Tensor, *, loss_scale: float, aux_scale: float, sync: bool
    ) -> MicroStepOut:
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        with self.attention_backends():
            out = self.ds(inputs, targets=targets, return_logits=False)
        loss = out.loss_sum * (loss_scale * self.world_size)  # DeepSpeed averages over ranks
        if out.aux_loss is not None:
            loss = loss + out.aux_loss * aux_scale
        self.ds.backward(loss, scale_wrt_gas=False)  # the loss is already per global token
        self.ds.step()  # counts micro-steps; steps the optimizer at the accumulation boundary
        aux = out.aux_loss.detach() if out.aux_loss is not None else None
        return MicroStepOut(out.loss_sum.detach(), out.n_tokens, aux, out.stats)

    def clip_gradients(self, grad_clip: float) -> Tensor:
        # DeepSpeed clipped and stepped inside the last micro_step (its accumulation boundary)
        norm = self.ds.get_global_grad_norm()
        return torch.as_tensor(float(norm) if norm is not None else float("nan"))

    def apply_update(self, *, skip: bool = False) -> None:
        # the update already happened (run.engines: deepspeed cannot skip one; train.nonfinite = stop)
        self.scheduler.step()

    @property
    def lr(self) -> float:
        return self.scheduler.optimizer.param_groups[0]["lr"]

    # ---- checkpoints ------------------------------------------------------------------
    def write_state(self, directory: Path) -> None:
        self.ds.save_checkpoint(str(directory), tag=DS_TAG, save_latest=False)
        dist.barrier()
        if self.is_main:
            stage = self.cfg.options("deepspeed").zero_stage
            full = {}
            if stage > 0:
                from run.safe_load import zero_state_dict

                full = zero_state_dict(directory, DS_TAG)
            if stage < 3:  # whole on every rank; ZeRO-1 leaves frozen parameters out of its files (centroid-only runs)
                own = self.raw_model.state_dict().items()
                full |= {k: v.detach().float().cpu() for k, v in own if k not in full}
            self._write_consolidated(directory, full)

    def read_state(self, directory: Path) -> None:
        from run.safe_load import check_deepspeed_files, deepspeed_globals, torch_load, weights_only_loads

        check_written_by(directory, DS_TAG, "the deepspeed engine")
        saved = sorted(p.name for p in (directory / DS_TAG).glob("*model_states.pt"))
        if self.cfg.options("deepspeed").zero_stage == 3 and len(saved) != self.world_size:
            raise ConfigError(
                f"train.engine: the deepspeed checkpoint {directory} was written by {len(saved)} ranks; resume it with "
                "the same world size"
            )
        if self.ds.load_universal_checkpoint():
            raise ConfigError(
                "train.deepspeed_config: checkpoint.load_universal is not supported (DeepSpeed reads universal "
                "checkpoints with weights_only=False)"
            )
        # DeepSpeed loads with weights_only=False: every file is checked on every rank first (one line naming a
        # refused file, on all ranks alike), then loaded through the allow-list, whoever calls torch.load
        check_deepspeed_files(directory / DS_TAG)
        engine = self.ds.checkpoint_engine
        self.ds.checkpoint_engine = _SafeCheckpointLoads(engine, deepspeed_globals())
        try:
            with weights_only_loads(deepspeed_globals()):
                path, _ = self.ds.load_checkpoint(str(directory), tag=DS_TAG, load_lr_scheduler_states=False)
        finally:
            self.ds.checkpoint_engine = engine
        if path is None:
            raise ConfigError(f"train.engine: deepspeed could not load {directory}")
        self.scheduler.load_state_dict(torch_load(directory / SCHEDULER_FILE, map_location="cpu"))


class _SafeCheckpointLoads:
    """DeepSpeed's checkpoint engine with ``load`` through ``run.safe_load.torch_load`` (its own passes
    ``weights_only=False``); everything else is the wrapped engine's."""

    def __init__(self, engine: Any, allow: list[Any]):
        self._engine, self._allow = engine, allow

    def load(self, path: str, map_location: Any = None) -> Any:
        from run.safe_load import torch_load

        return torch_load(path, map_location=map_location, allow=self._allow)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)
