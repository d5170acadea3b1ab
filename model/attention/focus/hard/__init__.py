"""Focus hard mode (inference): each token attends its window and the tokens that share one of its
top-k groups. ``group_sparse`` holds the dense mask (the reference) and its exact disjoint
decomposition; ``cpu`` the sorted-group decomposition on the fused CPU kernel (values and gradients)
with ``rows`` choosing what one kernel call reads; ``flex`` the CUDA form; ``decode`` the KV-cache
step over per-group member lists and ``decode_host`` its CPU assignment on host floats."""
