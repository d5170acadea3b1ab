"""SDPA for calls whose shapes change from call to call: decode and chunked prefill onto a KV cache.

On Hopper and newer GPUs torch 2.11 tries cuDNN's SDPA first, and cuDNN builds an execution plan for every new shape
(FunASR issue 3704 measured 0.44 s per new shape on a B200). Decoding changes the key length with every token. On an
H100 this project measured 43.6 ms per decode token of full attention at a 16K context (docs/benchmarks.md), far above
what reading 16K keys and values should take (an estimate, not a measurement: 16 MiB in bf16 at ~3 TB/s is ~5 us).
These calls therefore leave cuDNN out; fixed-shape training calls take ``train.sdpa_backend``'s order
(``sdpa_backends``), entered around the training forward by the engine.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

VARYING_SHAPE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

# train.sdpa_backend: the SDPA backend tried first on CUDA; the others follow in "auto"'s order, so a call the named
# backend cannot take (a mask, a head dimension, a dtype) falls back instead of failing. "auto": cuDNN (the fastest
# for bf16 causal attention on Hopper), then FlashAttention-2, then memory-efficient, then math.
_BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
SDPA_BACKENDS = ("auto", *_BACKENDS)


def sdpa_backend_order(name: str) -> list[SDPBackend]:
    """The priority order ``train.sdpa_backend = name`` sets: ``name``'s backend first, then "auto"'s order."""
    if name not in SDPA_BACKENDS:
        raise ValueError(f"train.sdpa_backend: {name!r} is not one of {', '.join(SDPA_BACKENDS)}")
    auto = list(_BACKENDS.values())
    return auto if name == "auto" else [_BACKENDS[name], *(b for b in auto if b != _BACKENDS[name])]


def sdpa_backends(name: str, device_type: str) -> contextlib.AbstractContextManager[Any]:
    """SDPA's backends in ``sdpa_backend_order(name)``'s priority (``sdpa_kernel(..., set_priority=True)``, torch
    >= 2.6) on CUDA; nothing elsewhere (the CPU has its own kernels). Entered outside compiled code: SDPA picks its
    kernel when dynamo traces the call, so the compiled step keeps the backend it was traced under."""
    if device_type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(sdpa_backend_order(name), set_priority=True)


def sdpa_varying(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Tensor:
    """``F.scaled_dot_product_attention`` for a shape that changes per call (on CUDA without cuDNN's backend)."""
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    with sdpa_kernel(VARYING_SHAPE_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


# ---- queries at the end of a longer key sequence, on the CPU ---------------------------------------------------
# SDPA's is_causal aligns top-left, so queries at positions tk - tq .. tk - 1 need an explicit [Tq, Tk] mask, and
# with one the CPU takes the math path, which materialises the Tq x Tk scores (context parallelism's chunks, chunked
# prefill). Instead: two calls of the fused CPU kernel, the keys before the queries unmasked and the square block of
# the queries' own positions causal, merged by logsumexp; the backward calls the kernel's backward per part with the
# merged output and logsumexp (the parts' gradients then add up exactly). Memory O((Tq + Tk) D).
_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
PREFIX_DTYPES = (torch.float32, torch.float64)


def prefix_causal_supported(q: Tensor) -> bool:
    """Whether ``prefix_causal_attention`` takes this call (CPU, float32 / float64, eager)."""
    return q.device.type == "cpu" and q.dtype in PREFIX_DTYPES and not torch.compiler.is_compiling()


def _prefix_forward(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    start = k.shape[2] - q.shape[2]
    out, lse = _FWD(q, k[:, :, start:], v[:, :, start:], 0.0, True, scale=scale)
    if start == 0:
        return out, lse
    o1, l1 = _FWD(q, k[:, :, :start], v[:, :, :start], 0.0, False, scale=scale)
    merged = torch.logaddexp(l1, lse)
    out = o1 * torch.exp(l1 - merged)[..., None].to(o1.dtype) + out * torch.exp(lse - merged)[..., None].to(out.dtype)
    return out, merged


class _PrefixCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        out, lse = _prefix_forward(q, k, v, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        start = k.shape[2] - q.shape[2]
        dout = dout.contiguous()
        dq, dk2, dv2 = _BWD(dout, q, k[:, :, start:], v[:, :, start:], out, lse, 0.0, True, scale=ctx.scale)
        if start == 0:
            return dq, dk2, dv2, None
        dq1, dk1, dv1 = _BWD(dout, q, k[:, :, :start], v[:, :, :start], out, lse, 0.0, False, scale=ctx.scale)
        return dq + dq1, torch.cat([dk1, dk2], dim=2), torch.cat([dv1, dv2], dim=2), None


@torch.compiler.disable  # eager CPU kernels and a custom autograd.Function (as DGA's parts form)
def prefix_causal_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float) -> Tensor:
    """Causal attention of q [B, H, Tq, D] at positions Tk - Tq .. Tk - 1 over k, v [B, H, Tk, D] (heads already
    expanded), exact, with gradients, in O((Tq + Tk) D) memory on the CPU (``prefix_causal_supported``)."""
    if torch.is_autocast_enabled(q.device.type):  # as autocast casts SDPA's inputs (rotated q, k can be float32)
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        return _PrefixCausal.apply(q, k, v, scale)
    return _prefix_forward(q, k, v, scale)[0]
