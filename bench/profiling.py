"""Where the time goes: ``torch.profiler`` over a few steps of a benchmark's work, summed up per step.

``profile(work, steps, device, what)`` runs ``work()`` ``steps`` times under the profiler, each call inside a
``record_function(STEP)`` range, and returns (``summarize``):

- on CUDA: the top kernels by device time (kernels and the copies / fills the device ran, grouped by name: calls, ms
  and share of the device time per step), the kernels launched per step (device kernel records), the kernel-launch
  API calls per step, and the host synchronisations per step: the CUDA runtime / driver calls in ``SYNC_CALLS`` made
  inside a step (``.item()``, ``bool(tensor)``, ``.cpu()`` and a blocking copy each show up as a
  ``cudaStreamSynchronize``; ``torch.cuda.synchronize()`` as ``cudaDeviceSynchronize``);
- on CPU (``--device cpu``): the top operators by self CPU time; no device, so kernels, launches and
  synchronisations are ``None`` (reported as n/a).

Per step: totals over the profiled steps divided by their number; wall time is the mean of the steps' ranges, the
profiler's overhead included. Device time sums the kernels' durations (overlapping streams count twice).

The events are read from the profiler's raw (kineto) results: their name, device type, start and end, thread and,
where this torch has them, ``is_user_annotation`` and ``activity_type`` (torch 2.11 has the first; the second is
newer); when those results cannot be read, from ``prof.events()`` (slower: it builds a Python object and a tree per
event; a long training step has hundreds of thousands). Either way they become ``Ev`` tuples, and ``summarize``
works on those alone, so the CUDA path is checked on CPU with synthetic events (tests/test_bench_gpu.py).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch

STEP = "bench step"  # the record_function range around each profiled step
TOP = 10
# host waits on the device: explicit synchronisation, and synchronous copies (runtime and driver API names)
SYNC_CALLS = frozenset(
    {
        "cudaDeviceSynchronize",
        "cudaStreamSynchronize",
        "cudaEventSynchronize",
        "cudaMemcpy",
        "cudaMemcpy2D",
        "cudaMemcpyFromSymbol",
        "cuCtxSynchronize",
        "cuStreamSynchronize",
        "cuEventSynchronize",
        "cuMemcpyDtoH",
        "cuMemcpyHtoD",
    }
)
LAUNCH_CALLS = frozenset(
    {
        "cudaLaunchKernel",
        "cudaLaunchKernelExC",
        "cudaLaunchCooperativeKernel",
        "cuLaunchKernel",
        "cuLaunchKernelEx",
        "cuLaunchCooperativeKernel",
        "cudaGraphLaunch",
        "cuGraphLaunch",
    }
)
# device-timeline records that are not work: kineto's synchronisation records (when enabled) and the GPU side of
# record_function ranges (also recognised by name: every one has a CPU range of the same name)
DEVICE_SYNC_RECORDS = ("Stream Sync", "Event Sync", "Context Sync", "Stream Wait Event")
ANNOTATION_PREFIXES = ("## ", "Torch-Compiled Region", "CompiledFxGraph", "ProfilerStep#", STEP)
ACTIVITY_KINDS = {"kernel": "kernel", "concurrent_kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
# the profiler's own bookkeeping (torch leaves the same names out of its tables)
IGNORED = frozenset(
    {
        "[memory]",
        "[OutOfMemory]",
        "profiler::_record_function_enter",
        "profiler::_record_function_enter_new",
        "profiler::_record_function_exit",
    }
)
NAME_CHARS = 160  # longer kernel names (C++ templates) are cut in the JSON


class Ev(NamedTuple):
    """One profiler event, as ``summarize`` reads it."""

    name: str
    device: bool  # on the device's timeline (a kernel, a copy, a GPU-side range)
    start: float  # microseconds
    end: float
    thread: int = 0
    annotation: bool = False  # a record_function range (or its GPU side)
    activity: str = ""  # kineto's activity type (kernel, gpu_memcpy, cuda_runtime...) where this torch names it


_ON_DEVICE: dict[object, bool] = {}


def _on_device(device_type: object) -> bool:
    """Whether a device type (``torch.autograd.DeviceType``) is not the host's (memoised: called per event)."""
    known = _ON_DEVICE.get(device_type)
    if known is None:
        known = _ON_DEVICE[device_type] = str(device_type).split(".")[-1] not in ("CPU", "")
    return known


def _call(obj: Any, method: str, default: Any) -> Any:
    fn = getattr(obj, method, None)
    return fn() if callable(fn) else default


def from_kineto(result: Any) -> list[Ev]:
    """``Ev``s from the profiler's raw results (``prof.profiler.kineto_results``)."""
    out = []
    for e in result.events():
        name = e.name()
        if name in IGNORED or _call(e, "is_hidden_event", False):
            continue
        on_device = _on_device(e.device_type())
        if not on_device and _call(e, "is_async", False):
            continue
        out.append(
            Ev(
                name,
                on_device,
                e.start_ns() / 1e3,
                e.end_ns() / 1e3,
                int(e.start_thread_id()),
                bool(_call(e, "is_user_annotation", False)),
                str(_call(e, "activity_type", "") or ""),
            )
        )
    return out


def from_function_events(events: Iterable[Any]) -> list[Ev]:
    """``Ev``s from ``prof.events()`` (``FunctionEvent``s)."""
    out = []
    for e in events:
        on_device = _on_device(e.device_type)
        if e.name in IGNORED or (not on_device and getattr(e, "is_async", False)):
            continue
        rng = e.time_range
        annotation = bool(getattr(e, "is_user_annotation", False))
        activity = str(getattr(e, "activity_type", "") or "")
        out.append(Ev(e.name, on_device, float(rng.start), float(rng.end), int(e.thread), annotation, activity))
    return out


def api_name(name: str) -> str:
    """A CUDA API call's name without its version / stream-mode suffix (``cuMemcpyDtoH_v2`` -> ``cuMemcpyDtoH``)."""
    for suffix in ("_v2", "_v3", "_ptsz", "_ptds"):
        name = name.removesuffix(suffix)
    return name


def device_kind(e: Ev, annotations: set[str]) -> str | None:
    """What a device-timeline event is: ``kernel``, ``memcpy``, ``memset``, or None (not device work: an annotation,
    a synchronisation record)."""
    if e.activity:  # newer torch names kineto's activity type: then it decides
        return ACTIVITY_KINDS.get(e.activity.lower())
    if e.annotation or e.name in annotations or e.name.startswith(ANNOTATION_PREFIXES):
        return None
    if e.name.startswith(DEVICE_SYNC_RECORDS):
        return None
    if e.name.startswith("Memcpy"):
        return "memcpy"
    if e.name.startswith("Memset"):
        return "memset"
    return "kernel"


def self_times(events: list[Ev]) -> tuple[list[float], list[int]]:
    """Each host event's own time (its span less its direct children's) and its parent's index (-1: none),
    nesting by time within each thread."""
    own = [e.end - e.start for e in events]
    parent = [-1] * len(events)
    threads: dict[int, list[int]] = {}
    for i, e in enumerate(events):
        threads.setdefault(e.thread, []).append(i)
    for order in threads.values():
        order.sort(key=lambda i: (events[i].start, -events[i].end))
        stack: list[int] = []
        for i in order:
            while stack and events[stack[-1]].end <= events[i].start:
                stack.pop()
            if stack:
                own[stack[-1]] -= events[i].end - events[i].start
                parent[i] = stack[-1]
            stack.append(i)
    return own, parent


def demangle(name: str) -> str:
    try:
        return str(torch._C._demangle(name)) if name.startswith("_Z") else name
    except (AttributeError, RuntimeError):
        return name


def summarize(events: Iterable[Ev], steps: int, device: str, top: int = TOP) -> dict[str, Any]:
    """Per-step figures of a profiled run (see the module docstring)."""
    events = list(events)
    host = [e for e in events if not e.device]
    windows = sorted((e.start, e.end) for e in host if e.name == STEP)
    n = max(steps, 1)
    out: dict[str, Any] = {
        "steps": steps,
        "activity": device,
        "wall_ms": sum(b - a for a, b in windows) / len(windows) / 1e3 if windows else None,
        "events": len(events),
    }
    groups: dict[str, list[float]] = {}  # name -> [calls, microseconds]
    if device == "cuda":
        annotations = {e.name for e in host if e.annotation} | {STEP}
        counts = {"kernel": 0, "memcpy": 0, "memset": 0}
        for e in events:
            kind = device_kind(e, annotations) if e.device else None
            if kind is None:
                continue
            counts[kind] += 1
            g = groups.setdefault(e.name, [0, 0.0])
            g[0] += 1
            g[1] += e.end - e.start
        starts = [a for a, _ in windows]
        sync_calls: dict[str, int] = {}
        launches = 0
        for e in host:
            name = api_name(e.name)
            if name not in SYNC_CALLS and name not in LAUNCH_CALLS:
                continue
            i = bisect.bisect_right(starts, e.start) - 1
            if i < 0 or e.start > windows[i][1]:  # outside every step (the profiler's own synchronisation)
                continue
            if name in LAUNCH_CALLS:
                launches += 1
            else:
                sync_calls[name] = sync_calls.get(name, 0) + 1
        recorded = sum(counts.values()) > 0
        out.update(
            time_kind="device time of CUDA kernels and copies",
            kernels=counts["kernel"] / n if recorded else None,
            copies=(counts["memcpy"] + counts["memset"]) / n if recorded else None,
            launch_calls=launches / n,
            syncs=sum(sync_calls.values()) / n,
            sync_calls={k: v / n for k, v in sorted(sync_calls.items())},
        )
        if not recorded:
            out["note"] = "no device activity recorded (CUPTI unavailable?)"
    else:
        own, parent = self_times(host)
        for i, e in enumerate(host):
            if e.annotation or e.name == STEP:
                continue
            g = groups.setdefault(e.name, [0, 0.0])
            g[0] += parent[i] < 0 or host[parent[i]].name != e.name  # an op re-entering itself is one call
            g[1] += own[i]
        out.update(
            time_kind="CPU: self time of operators (no device: kernels and synchronisations n/a)",
            kernels=None,
            copies=None,
            launch_calls=None,
            syncs=None,
            sync_calls={},
        )
    busy_us = sum(us for _, us in groups.values())
    out["busy_ms"] = busy_us / n / 1e3
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]
    out["top"] = [
        {"name": demangle(name)[:NAME_CHARS], "calls": calls / n, "ms": us / n / 1e3, "share": us / busy_us}
        for name, (calls, us) in ranked
        if busy_us > 0
    ]
    return out


def events_of(prof: Any) -> tuple[list[Ev], str]:
    """A finished ``torch.profiler.profile``'s events, and where they were read from."""
    raw = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if raw is not None:
        try:
            return from_kineto(raw), "kineto results"
        except (AttributeError, TypeError):  # a torch whose raw events lack a method read here
            pass
    return from_function_events(prof.events()), "prof.events()"


def profile(work: Callable[[], object], steps: int, device: str, what: str, top: int = TOP) -> dict[str, Any]:
    """``work()`` ``steps`` times under ``torch.profiler`` (CUDA activity on ``cuda``), summed up per step;
    ``what`` names one step (``train step``, ``fwd+bwd``...)."""
    from torch.profiler import ProfilerActivity, record_function
    from torch.profiler import profile as torch_profile

    cuda = device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()  # nothing launched before the profile runs inside it
    with torch_profile(activities=activities) as prof:
        for _ in range(steps):
            with record_function(STEP):
                work()
        if cuda:
            torch.cuda.synchronize()  # the last step's kernels end inside the profile (outside its steps)
    t0 = time.perf_counter()
    events, source = events_of(prof)
    out = summarize(events, steps, device, top)
    out.update(what=what, source=source, parse_s=time.perf_counter() - t0)
    return out


def safe_profile(work: Callable[[], object], steps: int, device: str, what: str, top: int = TOP) -> dict[str, Any]:
    """``profile``, or ``{"error": ...}`` when the profiler or the work fails (an out-of-memory under the profiler,
    a profiler this build lacks): a profile is an extra, never the reason a measured row is lost."""
    try:
        return profile(work, steps, device, what, top)
    except Exception as err:  # reported in the row; the run goes on
        first = (str(err).splitlines() or [""])[0][:160]
        return {"what": what, "steps": steps, "error": f"{type(err).__name__}: {first}".rstrip(": ")}
