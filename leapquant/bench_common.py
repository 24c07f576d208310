"""What the benchmarks of every op share (:mod:`leapquant.bench`: the flush and the CLI; :mod:`leapquant.bench_step`:
the step and the decode): the rows of a record and their columns, the timing methods, the copy bandwidth that sets
the bound, the rotated slot sets. Imports nothing heavy at module level."""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from .numerics import L

DUE_FRACTIONS = {"all": 1.0, "sixteenth": 1.0 / L, "none": 0.0}   #: "sixteenth": serving's steady state, 1 / L


CSV_COLUMNS = (
    "op", "backend", "gate", "batch", "heads", "due", "due_fraction", "due_programs",
    "median_us", "p20_us", "p80_us", "samples", "timing",
    "bound_us", "ratio", "verdict", "worst_ratio", "message",
    "device", "sm_count", "bandwidth_gbs", "timer_floor_us", "torch", "triton", "tilelang", "python", "commit", "date",
)


def _one_line(e: BaseException, limit: int = 300) -> str:
    s = f"{type(e).__name__}: {e}".replace("\n", " ").replace("|", "/")
    return s if len(s) <= limit else s[:limit - 3] + "..."


def _percentile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (q in [0, 100]) of a non-empty list."""
    s = sorted(xs)
    if not s:
        return float("nan")
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def copy_bandwidth(device) -> tuple[float, str]:
    """Device-to-device copy bandwidth in bytes/s (read + written), measured here; and how."""
    import torch
    dev = torch.device(device)
    if dev.type == "cuda":
        n = 1 << 30
        src = torch.empty(n // 4, dtype=torch.float32, device=dev).normal_()
        dst = torch.empty_like(src)
        for _ in range(3):
            dst.copy_(src)
        torch.cuda.synchronize(dev)
        times = []
        for _ in range(10):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e-3)
        del src, dst
        torch.cuda.empty_cache()
        return 2 * n / _percentile(times, 50), "1 GiB device-to-device copy, CUDA events, median of 10"
    n = 64 << 20
    src = torch.randn(n // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * n / _percentile(times, 50), "64 MiB host memory copy, wall-clock, median of 5"


def _unprepared(prepare: Callable[[int], None] | None) -> Callable[[int], None]:
    return prepare if prepare is not None else (lambda s: None)


def time_calls(call: Callable[[int], None], nsets: int, repeats: int, device, max_seconds: float,
               capture: bool, host_sync: bool = False,
               prepare: Callable[[int], None] | None = None) -> tuple[list[float], str]:
    """Per-call times in microseconds of ``call(s)`` rotating s over ``nsets`` slot sets, and the method used.

    On a GPU every call is bracketed by CUDA events. ``capture``: one CUDA graph per slot set holds the call and its
    replay is timed (falls back to the eager call when the capture fails). Unless the call synchronises with the host
    (``host_sync``), each batch of launches is queued behind a sleep kernel, so the events measure the GPU's work and
    not the host's launch latency. ``prepare(s)``, when given, restores what a call on set s consumes (a flush's
    windows, a step's fill counts): it runs eagerly before each call, outside the call's events (and outside its graph)."""
    import torch
    dev = torch.device(device)
    prep = _unprepared(prepare)
    if dev.type != "cuda":
        prep(nsets - 1)
        call(nsets - 1)                              # warm-up (no L2 to speak of at CPU timescales: one call)
        out: list[float] = []
        t_end = time.perf_counter() + max_seconds
        for r in range(repeats):
            prep(r % nsets)
            t0 = time.perf_counter()
            call(r % nsets)
            out.append((time.perf_counter() - t0) * 1e6)
            if len(out) >= 3 and time.perf_counter() > t_end:
                break
        return out, "wall-clock (CPU)"

    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):                  # warm-up on a side stream, as before a capture
        for _ in range(2):
            for s in range(nsets):
                prep(s)
                call(s)
    torch.cuda.current_stream(dev).wait_stream(stream)
    torch.cuda.synchronize(dev)

    graphs: list | None = None
    note = ""
    if capture:
        try:
            graphs = []
            for s in range(nsets):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    call(s)
                graphs.append(g)
            for s, g in enumerate(graphs):           # one replay each before timing
                prep(s)
                g.replay()
            torch.cuda.synchronize(dev)
        except Exception as e:
            graphs = None
            note = f" (graph capture failed: {_one_line(e, 120)})"
            with contextlib.suppress(Exception):
                torch.cuda.synchronize(dev)
    out = []
    t_end = time.perf_counter() + max_seconds
    batch = 32                  # launches queued behind one sleep kernel
    r = 0
    try:
        while r < repeats:
            n = min(batch, repeats - r)
            evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
            if not host_sync and hasattr(torch.cuda, "_sleep"):
                torch.cuda._sleep(10_000_000)         # ~5 ms: keeps the GPU queue ahead of the host's launches
            for i in range(n):
                s = (r + i) % nsets
                prep(s)
                evs[i][0].record()
                if graphs is not None:
                    graphs[s].replay()
                else:
                    call(s)
                evs[i][1].record()
            torch.cuda.synchronize(dev)
            out.extend(a.elapsed_time(b) * 1e3 for a, b in evs)
            r += n
            if len(out) >= 3 and time.perf_counter() > t_end:
                break
    finally:
        del graphs
    if capture and not note:
        method = "CUDA graph replay, CUDA events"
    else:
        method = ("eager call, CUDA events" + (" (host-synchronising call)" if host_sync else " (queued)")) + note
    return out, method


def time_calls_wall(call: Callable[[int], None], nsets: int, repeats: int, device, max_seconds: float,
                    run: int = 16, prepare: Callable[[int], None] | None = None) -> tuple[list[float], str]:
    """Host wall-clock microseconds per eager call: each sample is one run of ``run`` back-to-back calls (rotating
    over ``nsets`` slot sets) from an idle GPU to the device's synchronisation after the last, divided by ``run``. It is
    what an engine that calls the flush eagerly (prefill, mixed batches) pays per call: the larger of the host's cost
    (argument checks, dispatch, launch) and the GPU's. ``prepare(s)``, when given, restores what a call on set s
    consumes; it runs for every set of a run before the run's clock starts, and a run then calls each set at most once
    (``run`` at most ``nsets``)."""
    import torch
    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    prep = _unprepared(prepare)
    if prepare is not None:
        run = min(run, nsets)
    for s in range(nsets):
        prep(s)
        call(s)
    sync()
    out: list[float] = []
    t_end = time.perf_counter() + max_seconds
    r = 0
    while r < repeats:
        n = min(run, repeats - r)
        if prepare is not None:
            for i in range(n):
                prep((r + i) % nsets)
            sync()
        t0 = time.perf_counter()
        for i in range(n):
            call((r + i) % nsets)
        sync()
        out.append((time.perf_counter() - t0) / n * 1e6)
        r += n
        if len(out) >= 3 and time.perf_counter() > t_end:
            break
    return out, f"host wall-clock per eager call (runs of {run} back-to-back calls, synchronised after each run)"


def time_calls_kernel(call: Callable[[int], None], nsets: int, repeats: int, device,
                      prepare: Callable[[int], None] | None = None,
                      kernels: list[list[str]] | None = None) -> tuple[list[float], str]:
    """Per-call CUDA kernel time in microseconds from torch.profiler: the call is captured once per slot set in a
    CUDA graph (eager when capture fails) and replayed ``repeats`` times in rotation, each replay preceded by a marker
    kernel; a call's time is the span from its first kernel's start to its last kernel's end (gaps between its own
    kernels included, host launch overhead excluded). ``prepare(s)``, when given, restores what a call on set s
    consumes (a flush's windows, a step's fill counts): it runs eagerly for every set before the first call and after
    each round of ``nsets`` calls (each set called once a round), behind a marker of its own, outside every call's
    time; within a round the calls follow each other as without it. The markers are float64 fills: neither ``call``
    nor ``prepare`` may launch a float64 fill of its own: a marker is told by its kernel's name alone, never by its
    duration, so that a GPU shared with other processes (whose time slices can stretch any kernel) cannot shift the
    calls' boundaries. ``kernels``, when given, receives each timed call's kernel names (a list per call, in order)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    dev = torch.device(device)
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    prep = _unprepared(prepare)
    with torch.cuda.stream(stream):
        for s in range(nsets):
            prep(s)
            call(s)
    torch.cuda.current_stream(dev).wait_stream(stream)
    torch.cuda.synchronize(dev)
    graphs: list | None = []
    note = ""
    try:
        for s in range(nsets):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                call(s)
            graphs.append(g)
        for s, g in enumerate(graphs):
            prep(s)
            g.replay()
        torch.cuda.synchronize(dev)
    except Exception as e:
        graphs, note = None, f" (graph capture failed: {_one_line(e, 120)}; eager calls)"
        with contextlib.suppress(Exception):
            torch.cuda.synchronize(dev)
    marker = torch.zeros(1, device=dev, dtype=torch.float64)     # its fill kernel separates the calls in the trace
    MARK = "leapquant_bench_marker"
    for s in range(nsets):                                        # the first round's preparation, before the trace:
        prep(s)                                                   # the trace's first fill kernel is then a marker
    torch.cuda.synchronize(dev)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        if hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(20_000_000)                         # keep the queue ahead of the host's launches
        for r in range(repeats):
            with torch.profiler.record_function(MARK):
                marker.fill_(float(r))
            if graphs is not None:
                graphs[r % nsets].replay()
            else:
                call(r % nsets)
            if prepare is not None and (r + 1) % nsets == 0:   # a marker closes the round, then its preparation
                marker.fill_(-2.0)
                for s in range(nsets):
                    prep(s)
        marker.fill_(-1.0)
        torch.cuda.synchronize(dev)
    del graphs
    evs = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    fill_name = None
    out: list[float] = []
    spans: list[list] = []
    for e in evs:
        name = e.name
        if "spin" in name.lower() or "sleep" in name.lower():
            continue
        if fill_name is None and "fill" in name.lower():
            fill_name = name                      # the first round's preparation ran before the trace: a marker
        if name == fill_name:
            spans.append([])
            continue
        if spans:
            spans[-1].append((e.time_range.start, e.time_range.end, name))
    if prepare is not None:                       # the span after every nsets calls holds a preparation
        spans = [sp for i, sp in enumerate(spans) if (i + 1) % (nsets + 1)]
    for sp in spans[:repeats]:
        out.append(max(b for _, b, _ in sp) - min(a for a, _, _ in sp) if sp else 0.0)
        if kernels is not None:
            kernels.append([n for _, _, n in sp])
    if len(out) < min(3, repeats):
        raise RuntimeError(f"profiler trace held {len(out)} calls of {repeats}")
    return out, "CUDA kernel time (torch.profiler, first kernel start to last kernel end per call, " + \
        ("CUDA graph replay)" if not note else "eager)") + note


def timer_floor(device, graph: bool | str) -> float:
    """Median microseconds that :func:`time_calls` reports for one tiny kernel (a graph replay of it on a GPU): the
    floor of the method, inside every reported time."""
    import torch
    dev = torch.device(device)
    x = torch.zeros(1, device=dev)
    if dev.type == "cuda" and graph == "kernel":
        samples, _ = time_calls_kernel(lambda s: x.add_(1.0), 8, 64, dev)
        return _percentile(samples, 50)
    if graph == "wall":
        samples, _ = time_calls_wall(lambda s: x.add_(1.0), 8, 64, dev, 2.0)
        return _percentile(samples, 50)
    samples, _ = time_calls(lambda s: x.add_(1.0), 8, 64 if dev.type == "cuda" else 16, dev, 2.0,
                            capture=(dev.type == "cuda" and graph in (True, "graph")))
    return _percentile(samples, 50)


@dataclass
class Row:
    backend: str
    gate: str
    batch: int
    heads: int
    due: str
    due_programs: int = 0
    median_us: float = float("nan")
    p20_us: float = float("nan")
    p80_us: float = float("nan")
    samples: int = 0
    timing: str = ""
    bound_us: float = float("nan")
    ratio: float = float("nan")
    verdict: str = ""
    worst_ratio: float = float("nan")
    message: str = ""
    op: str = "flush"

    def as_dict(self, env: dict) -> dict:
        d = {c: getattr(self, c, None) for c in CSV_COLUMNS if hasattr(self, c)}
        for c in ("median_us", "p20_us", "p80_us", "bound_us"):
            d[c] = round(d[c], 3)
        d["ratio"] = round(d["ratio"], 4)
        d["worst_ratio"] = round(d["worst_ratio"], 6)
        env = dict(env, bandwidth_gbs=round(env["bandwidth_gbs"], 1), timer_floor_us=round(env["timer_floor_us"], 3))
        d["due_fraction"] = DUE_FRACTIONS.get(self.due, "")
        d.update({k: env[k] for k in CSV_COLUMNS if k in env})
        return {c: d.get(c, "") for c in CSV_COLUMNS}


def _fmt(x: float, nd: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x:.{nd}f}"


def slot_sets(nsets: int, batch: int, seed: int, device) -> list:
    """``nsets`` disjoint sets of ``batch`` slots (long, on ``device``), drawn from slots 1.. in a shuffled order."""
    import torch
    g = torch.Generator().manual_seed(seed + 1000 * batch)
    perm = torch.randperm(nsets * batch, generator=g) + 1
    return [perm[s * batch:(s + 1) * batch].to(device) for s in range(nsets)]
