"""Focus hard mode on the CPU kernel: selectors of the rows one kernel call reads, and the parts they form
(split out of ``cpu``, which plans and runs the parts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

NEG_INF = float("-inf")


# ---- selectors: which rows of a [B, H, T, ...] tensor one kernel call reads ------------------------------------
def take_rows(x: Tensor, b: int, idx: Tensor) -> Tensor:
    """``x[b][:, idx]`` ([H, n, ...]) as row copies. A KV-cache view (the first rows of a longer buffer) is re-viewed
    over its whole buffer, which is contiguous, so ``index_select`` copies rows; on the view itself it would first
    copy the whole view, and advanced indexing copies element by element (both several times slower)."""
    xb = x[b]
    if not xb.is_contiguous() and xb.dim() == 3 and xb.stride(2) == 1 and xb.stride(1) == xb.shape[2]:
        rows, rem = divmod(xb.stride(0), xb.stride(1))
        end = (xb.storage_offset() + xb.shape[0] * xb.stride(0)) * xb.element_size()
        if rem == 0 and end <= xb.untyped_storage().nbytes():
            xb = xb.as_strided((xb.shape[0], rows, xb.shape[2]), xb.stride())
    return xb.index_select(1, idx) if xb.is_contiguous() else xb[:, idx]


class Rows:
    """Rows ``idx`` of sequence ``b``: one problem, [1, H, L, ...] (a gathered copy)."""

    def __init__(self, b: int, idx: Tensor):
        self.b, self.idx = b, idx

    def take(self, x: Tensor) -> Tensor:
        return take_rows(x, self.b, self.idx).unsqueeze(0)

    def put(self, dst: Tensor, val: Tensor) -> None:
        dst[self.b].index_copy_(1, self.idx, val[0].to(dst.dtype))

    def add(self, dst: Tensor, val: Tensor) -> None:
        dst[self.b].index_add_(1, self.idx, val[0].to(dst.dtype))


class Stacked:
    """N position-ordered row lists of sequence ``b``, each padded at its end to L rows, gathered in one go as N
    problems [N, H, L, ...]. Padded slots repeat row 0; they follow every real row of their list, so under the
    kernel's causal mask no real query sees them; they are never written back, and the backward gives them zero
    probability (``Part.pad``)."""

    def __init__(self, b: int, idx: Tensor, real: Tensor):
        self.b, self.idx = b, idx  # [N, L] token rows
        self.real = torch.nonzero(real.flatten()).squeeze(1)  # slots holding real rows
        self.rows = idx.flatten()[self.real]

    def take(self, x: Tensor) -> Tensor:
        n, length = self.idx.shape
        return take_rows(x, self.b, self.idx.flatten()).unflatten(1, (n, length)).transpose(0, 1)

    def _real(self, val: Tensor) -> Tensor:
        flat = val.transpose(0, 1).flatten(1, 2)  # [H, N * L, ...]
        return flat.index_select(1, self.real)

    def put(self, dst: Tensor, val: Tensor) -> None:
        dst[self.b].index_copy_(1, self.rows, self._real(val).to(dst.dtype))

    def add(self, dst: Tensor, val: Tensor) -> None:
        dst[self.b].index_add_(1, self.rows, self._real(val).to(dst.dtype))


class Gathered:
    """Rows ``idx`` of sequence ``b`` gathered once per source tensor, shared by the parts that read slices of them
    (``part``); gradients into them accumulate in a gathered buffer that ``flush`` scatters back."""

    def __init__(self, b: int, idx: Tensor):
        self.b, self.idx = b, idx
        self._rows: dict[int, Tensor] = {}
        self._grads: dict[int, tuple[Tensor, Tensor]] = {}

    def rows(self, x: Tensor) -> Tensor:
        if id(x) not in self._rows:
            self._rows[id(x)] = take_rows(x, self.b, self.idx).unsqueeze(0)
        return self._rows[id(x)]

    def grad(self, dst: Tensor) -> Tensor:
        if id(dst) not in self._grads:
            shape = (1, dst.shape[1], self.idx.numel(), *dst.shape[3:])
            self._grads[id(dst)] = (dst, torch.zeros(shape, dtype=dst.dtype, device=dst.device))
        return self._grads[id(dst)][1]

    def part(self, lo: int, hi: int) -> Slice:
        return Slice(self, lo, hi)

    def flush(self) -> None:
        for dst, buf in self._grads.values():
            dst[self.b].index_add_(1, self.idx, buf[0])
        self._grads.clear()
        self._rows.clear()


class Slice:
    """Rows [lo, hi) of a ``Gathered`` set (keys only: reads come from the shared gather)."""

    def __init__(self, base: Gathered, lo: int, hi: int):
        self.base, self.lo, self.hi = base, lo, hi

    def take(self, x: Tensor) -> Tensor:
        return self.base.rows(x)[:, :, self.lo : self.hi]

    def add(self, dst: Tensor, val: Tensor) -> None:
        self.base.grad(dst)[:, :, self.lo : self.hi] += val.to(dst.dtype)


class Range:
    """Rows [lo, hi) of sequence ``b``: one problem, [1, H, hi - lo, ...] (a view)."""

    def __init__(self, b: int, lo: int, hi: int):
        self.b, self.lo, self.hi = b, lo, hi

    def take(self, x: Tensor) -> Tensor:
        return x[self.b : self.b + 1, :, self.lo : self.hi]

    def put(self, dst: Tensor, val: Tensor) -> None:
        self.take(dst).copy_(val)

    def add(self, dst: Tensor, val: Tensor) -> None:
        self.take(dst).add_(val.to(dst.dtype))


class Blocks:
    """``n`` consecutive blocks of ``w`` rows from ``start`` of sequence ``b``: n problems, [n, H, w, ...] (a view)."""

    def __init__(self, b: int, start: int, n: int, w: int):
        self.b, self.start, self.n, self.w = b, start, n, w

    def take(self, x: Tensor) -> Tensor:
        return x[self.b, :, self.start : self.start + self.n * self.w].unflatten(1, (self.n, self.w)).transpose(0, 1)

    def put(self, dst: Tensor, val: Tensor) -> None:
        self.take(dst).copy_(val)

    def add(self, dst: Tensor, val: Tensor) -> None:
        self.take(dst).add_(val.to(dst.dtype))


class Windows:
    """``n`` windows of ``size`` rows starting at ``start + j step`` (j < n) of sequence ``b``: [n, H, size, D], an
    overlapping view. ``size`` is a multiple of ``step``; gradients add as size / step non-overlapping block views."""

    def __init__(self, b: int, start: int, n: int, step: int, size: int):
        self.b, self.start, self.n, self.step, self.size = b, start, n, step, size

    def take(self, x: Tensor) -> Tensor:
        span = x[self.b, :, self.start : self.start + (self.n - 1) * self.step + self.size]
        return span.unfold(1, self.size, self.step).permute(1, 0, 3, 2)

    def add(self, dst: Tensor, val: Tensor) -> None:
        for i in range(0, self.size, self.step):
            Blocks(self.b, self.start + i, self.n, self.step).add(dst, val[:, :, i : i + self.step])


@dataclass
class Part:
    q: Any  # selector of query rows
    k: Any  # selector of key / value rows
    causal: bool  # the kernel's own (top-left) causal mask; exact when query rows == key rows, in order
    mask: Tensor | None = None  # additive, broadcastable to [N, H, Lq, Lk]
    nonempty: Tensor | None = None  # [N, 1, Lq]: rows with at least one allowed key (None: all)
    exclusive: bool = False  # the only part of these rows so far (written, not merged)
    pad: Tensor | None = None  # [N, 1, Lq]: padded query slots (no gradient flows through them)


def additive(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.full_like(zero, NEG_INF))


def narrow(bits: Tensor, n_groups: int) -> Tensor:
    """Bitmasks in the narrowest integer type that holds them (the masks' bitwise work is memory-bound)."""
    for dtype, limit in ((torch.int8, 7), (torch.int16, 15), (torch.int32, 31)):
        if n_groups <= limit:
            return bits.to(dtype)
    return bits
