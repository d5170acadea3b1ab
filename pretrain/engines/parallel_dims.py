"""The one device mesh of a run, built from its ``run.parallel.ParallelLayout``: ``dp_replicate x dp_shard x cp x tp``,
named as torchtitan names them (``run.parallel.MESH_DIMS``).

Every dimension is in the mesh, size 1 included, so a sub-mesh is found by name whatever the layout.
Flattened views (``DeviceMesh._flatten``) serve one purpose each:

- ``dp_shard_cp`` (``dp_shard x cp``): what FSDP2 shards over (with ``dp_replicate`` in front for HSDP);
  CP ranks hold different tokens, so their gradients are reduced like data parallel ones.
- ``dp_cp`` (``dp x cp``): token counts and loss sums (the TP ranks of one replica hold the same loss).
- ``dp_shard_cp_tp`` (``dp_shard x cp x tp``): the gradient norm's one all-reduce (DTensor's own lookup).

The degrees, their products and checks are ``run.parallel.ParallelLayout`` (from the config alone, before any
process); this module only lays them onto devices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from run.parallel import MESH_DIMS, ParallelLayout

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh


@dataclass
class ParallelDims:
    layout: ParallelLayout
    mesh: DeviceMesh = field(repr=False)
    # the flattened views, kept as _flatten returns them (slicing a flattened dim from the root is deprecated)
    views: dict[str, DeviceMesh] = field(repr=False)

    @classmethod
    def build(cls, layout: ParallelLayout, device_type: str) -> ParallelDims:
        """The mesh of ``layout`` and its flattened views (every rank calls this, in the same order)."""
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, layout.mesh_shape, mesh_dim_names=MESH_DIMS)
        # the engines number ranks (the loader's data rank) by the layout's arithmetic: it must be the mesh's
        placed = tuple(mesh.get_coordinate() or ())
        if placed != layout.coordinates(mesh.get_rank())[: len(MESH_DIMS)]:
            raise RuntimeError(
                f"rank {mesh.get_rank()} sits at {placed} in the {layout.label()} mesh, not where "
                f"ParallelLayout.coordinates puts it ({layout.coordinates(mesh.get_rank())})"
            )
        views = {
            "dp_shard_cp": mesh["dp_shard", "cp"]._flatten("dp_shard_cp"),
            "dp_cp": mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp"),
            # not read here: DTensor finds it by its ranks' layout and reduces the gradient norm, partial over FSDP2's
            # shards and the TP ranks, in one all-reduce (without it: two in a row, and a warning on every rank)
            "dp_shard_cp_tp": mesh["dp_shard", "cp", "tp"]._flatten("dp_shard_cp_tp"),
        }
        return cls(layout, mesh, views)

    def fsdp_mesh(self) -> DeviceMesh:
        """What FSDP2 shards over: ``dp_shard_cp``, with ``dp_replicate`` in front for HSDP."""
        if self.layout.dp_replicate == 1:
            return self.views["dp_shard_cp"]
        return (
            self.mesh["dp_replicate", "dp_shard"] if self.layout.cp == 1 else self.mesh["dp_replicate", "dp_shard_cp"]
        )

    def tp_mesh(self) -> DeviceMesh | None:
        """The tensor-parallel sub-mesh; None when tp = 1."""
        return self.mesh["tp"] if self.layout.tp > 1 else None

    def cp_mesh(self) -> DeviceMesh | None:
        """The context-parallel sub-mesh (the ranks that split one sequence); None when cp = 1."""
        return self.mesh["cp"] if self.layout.cp > 1 else None

    def data_group(self) -> dist.ProcessGroup:
        """The ranks whose token counts and loss sums add up (``dp_cp``): one rank of each TP group."""
        return self.views["dp_cp"].get_group()
