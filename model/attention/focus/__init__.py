"""Focus attention (papers/focus-sinkhorn-centroid-attention.md, sections 2.1, 3.6, E.4).

Per layer: a projection ``w_g: d_model -> d_group``, centroids ``C [K, d_group]`` and a gate
strength ``lam``. Group scores ``S = (h w_g) C^T / tau`` [B, T, K] become assignments ``g`` by
Sinkhorn (balanced; ``prefix`` scope = causal, ``sequence`` = the paper's form, which leaks the
future) or by softmax (kept for the collapse comparison).

- ``soft`` mode (training): pairs inside the window (i - j < w) are plain attention; outside it
  ``log sigmoid(lam (g_i . g_j - 0.5))`` is added to the logit (E.4.8), or with
  ``gate = "multiplicative"`` the logit is multiplied by ``sigmoid(lam g_i . g_j)`` (eq. 4).
  Reference: dense gate, any device (``naive.soft_attention``). Fast paths (``soft/``): CUDA
  (``flex.py``), FlexAttention ``score_mod`` computing the gate from the captured per-token assignments;
  CPU (``cpu.py``), per query block the gate as the fused CPU kernel's ``attn_mask`` and a blockwise backward,
  exact in O(T * block) memory.
- ``hard`` mode (inference): each token belongs to its top-k groups; i attends j iff j <= i and
  (i - j < w or their memberships intersect). Reference: dense mask (``naive.hard_attention``). Fast paths
  (``hard/``): CPU (``cpu.py``), the sorted-group decomposition on the fused CPU flash kernel (values and
  gradients); CUDA (``flex.py``), two FlexAttention calls over group-sorted tokens and the cross-group band;
  decode on the CPU (``decode.py``), the window plus the far members of the token's groups from per-group index
  lists in the KV cache; decode on the GPU (``decode_device.py``), a static-shape step without host synchronisation
  (CUDA-graph capturable) reading the token's groups' pages and the window (split-KV, merged by log-sum-exp).
  Elsewhere the batched dense decomposition of ``group_sparse.hard_attention``.

With prefix Sinkhorn (or softmax) a token's assignment never changes once computed, so the KV cache
keeps each token's assignment and membership (and, in hard mode on the CPU, each group's member positions) and
generation equals the full forward.

Rooms: ``config`` (``FocusConfig``, ``lambda_at``), ``module`` (``FocusAttention``), ``naive`` (the dense
references as plain functions), ``sinkhorn``, ``soft/`` and ``hard/`` (the fast paths).
"""

from model.attention.common.base import register_attention
from model.attention.focus import naive
from model.attention.focus.config import (
    ASSIGNMENTS,
    ENTROPY_WHEN,
    GATES,
    LAMBDA_SCHEDULES,
    MAX_GROUPS,
    MODES,
    SCOPES,
    FocusConfig,
    lambda_at,
)
from model.attention.focus.module import FocusAttention
from model.attention.focus.sinkhorn import group_imbalance, sinkhorn_prefix, sinkhorn_sequence

register_attention("focus", FocusConfig)(FocusAttention)

__all__ = [
    "ASSIGNMENTS",
    "ENTROPY_WHEN",
    "GATES",
    "LAMBDA_SCHEDULES",
    "MAX_GROUPS",
    "MODES",
    "SCOPES",
    "FocusAttention",
    "FocusConfig",
    "group_imbalance",
    "lambda_at",
    "naive",
    "sinkhorn_prefix",
    "sinkhorn_sequence",
]
