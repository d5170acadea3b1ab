"""The one device mesh of a run: ``dp_replicate x dp_shard x cp x tp``, named as torchtitan names them.

Every dimension is in the mesh, size 1 included, so a sub-mesh is found by name whatever the layout.
Flattened views (``DeviceMesh._flatten``) serve one purpose each:

- ``dp_shard_cp`` (``dp_shard x cp``): what FSDP2 shards over (with ``dp_replicate`` in front for HSDP);
  CP ranks hold different tokens, so their gradients are reduced like data parallel ones.
- ``dp`` (``dp_replicate x dp_shard``): the data loader's rank and world (the CP and TP ranks of one
  data-parallel replica read the same sequences).
- ``dp_cp`` (``dp x cp``): token counts and loss sums (the TP ranks of one replica hold the same loss).

The layout checks themselves are ``run.parallel`` (they run from the config alone, before any process).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from run.parallel import data_parallel_size

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from run.config import TrainConfig

MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    mesh: DeviceMesh | None = field(default=None, repr=False)
    # the flattened views, kept as _flatten returns them (slicing a flattened dim from the root is deprecated)
    views: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)

    @classmethod
    def from_config(cls, cfg: TrainConfig, world_size: int) -> ParallelDims:
        """The degrees for ``world_size`` processes (a one-line ``ConfigError`` for an impossible layout)."""
        dp = data_parallel_size(cfg, world_size)
        replicate = cfg.options("fsdp2").replicate if cfg.engine == "fsdp2" else 1
        return cls(replicate, dp // replicate, cfg.parallel.cp, cfg.parallel.tp)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The mesh (every rank calls this, in the same order) and its flattened views."""
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(
            device_type, (self.dp_replicate, self.dp_shard, self.cp, self.tp), mesh_dim_names=MESH_DIMS
        )
        self.views = {
            "dp_shard_cp": mesh["dp_shard", "cp"]._flatten("dp_shard_cp"),
            "dp": mesh["dp_replicate", "dp_shard"]._flatten("dp"),
            "dp_cp": mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp"),
        }
        self.mesh = mesh
        return mesh

    def _built(self) -> DeviceMesh:
        if self.mesh is None:
            raise RuntimeError("ParallelDims.build_mesh has not run")
        return self.mesh

    def fsdp_mesh(self) -> DeviceMesh:
        """What FSDP2 shards over: ``dp_shard_cp``, with ``dp_replicate`` in front for HSDP."""
        mesh = self._built()
        if self.dp_replicate == 1:
            return self.views["dp_shard_cp"]
        return mesh["dp_replicate", "dp_shard"] if self.cp == 1 else mesh["dp_replicate", "dp_shard_cp"]

    def tp_mesh(self) -> DeviceMesh | None:
        """The tensor-parallel sub-mesh; None when tp = 1."""
        return self._built()["tp"] if self.tp > 1 else None

    def cp_mesh(self) -> DeviceMesh | None:
        """The context-parallel sub-mesh (the ranks that split one sequence); None when cp = 1."""
        return self._built()["cp"] if self.cp > 1 else None

    def data_rank(self) -> int:
        """This rank's index among the data-parallel replicas (the loader's rank)."""
        self._built()
        return self.views["dp"].get_local_rank()

    def data_group(self) -> dist.ProcessGroup:
        """The ranks whose token counts and loss sums add up (``dp_cp``): one rank of each TP group."""
        self._built()
        return self.views["dp_cp"].get_group()
