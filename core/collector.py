"""Python's cyclic garbage collector as the command-line programs run it (``cli_errors`` sets it up).

A program here imports torch and its compiler stack (about 300,000 long-lived objects), then runs loops that free
almost everything they allocate by reference counting. Under Python's default thresholds (700, 10, 10) the start-up
alone runs five full collections over that growing heap, about 0.5 s of CPU per process and rank (the tiny config,
measured 2026-11-27); during training a full collection stalls its rank and, at the next collective, every rank
(why torchtitan and Megatron-LM run the collector by hand). ``THRESHOLDS`` makes a young collection come every
50,000 net allocations of tracked objects and a full one only after 400 of those: reference cycles are still
collected, later; code that needs a cycle gone at once collects it itself (the DDP engine's re-wrap).
"""

from __future__ import annotations

import gc

THRESHOLDS = (50_000, 20, 20)


def for_programs() -> None:
    """The command-line programs' collector thresholds (process-wide: a program's ``main`` sets them)."""
    gc.set_threshold(*THRESHOLDS)
