"""``leapquant bench``: time the deployment form of the flush against its memory bound, and judge its output.

For every chosen backend (and every ``--impl`` module), gate, batch and due fraction this runs
``leapquant.flush_inplace(pool, idx, q0, backend=name)`` on a pool whose rows are rotated over ``--rotate`` (>= 8)
disjoint slot sets, so that no call finds its data in L2 (SPEC section 5), and reports:

* the call's time: median, p20, p80 over ``--repeats`` calls. On a GPU by default the CUDA kernel time of a CUDA
  graph that holds one call (the deployment form), read from torch.profiler; ``--timer`` picks CUDA events around the
  graph replay or the eager call, or the host's wall-clock per eager call instead. The reference synchronises with the
  host and cannot be captured: it is timed with events around the eager call. On a CPU, wall-clock time. Every row's
  ``timing`` says which;
* the memory bound: due programs x ``due_program_bytes(gate)`` over the device-to-device copy bandwidth measured in the
  same run (bytes read + written), and the ratio of the median to it;
* the verdict of the SPEC section 3 criterion (``leapquant.criterion``) on every input family of
  ``leapquant.families``, for the same backend and batch, run through the same pool and the same deployment call.

Output: a markdown table on stdout (``--md`` also writes it with its header to a file), a long-format CSV (``--csv``),
a PNG plot of time against batch (``--plot``; needs matplotlib), and with ``--record DIR`` the table of record
(``DIR/RECORD.md``, ``.csv``, ``.png``) plus this run's timed rows appended to ``DIR/history.csv``. ``--impl
MODULE.py`` checks and times an implementation outside the package beside the backends, provided the module has the
project's interface (:func:`impl_target`). See bench/README.md.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import importlib.util
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from . import bench_step
from .bench_common import (CSV_COLUMNS, DUE_FRACTIONS, Row, _fmt, _one_line, _percentile, copy_bandwidth,
                           slot_sets, time_calls, time_calls_kernel, time_calls_wall, timer_floor)
from .numerics import DEFAULT_HEADS, GATES, L
from .options import UsageError, name_word as _word, parse_device

DEFAULT_GPU_BATCHES = (16, 64, 256, 512)
DEFAULT_CPU_BATCHES = (1, 2)


#: exit codes
EXIT_OK, EXIT_NOTHING, EXIT_USAGE, EXIT_BUSY = 0, 2, 2, 3


# ---- command line ----------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the bench options to ``parser`` (``leapquant.cli`` mounts them as the ``bench`` subcommand)."""
    parser.add_argument("--op", choices=bench_step.BENCH_OPS, default="flush",
                        help="the operation timed: flush (flush_inplace), step (step_inplace, every program "
                             "stepping) or decode (decode_inplace at the steady state: 1/16 of the programs due per "
                             "call); step and decode run fla's stock decode beside them (see --fla)")
    parser.add_argument("--fill", nargs="+", type=int, default=list(bench_step.DEFAULT_FILLS), metavar="H",
                        help="--op step: the windows' fill count while timed, one row each (default 1 15)")
    parser.add_argument("--fla", action=argparse.BooleanOptionalAction, default=True,
                        help="--op step/decode: time fla's fused_recurrent_kda decode with an fp32 and a bf16 state "
                             "beside the backends, where fla is installed (default on)")
    parser.add_argument("--backends", nargs="+", default=None, metavar="NAME",
                        help="project backends to run (reference, triton, tilelang, or 'auto'); default: every "
                             "backend that can serve on this device ('none' for --impl modules only)")
    parser.add_argument("--impl", action="append", default=[], metavar="MODULE.py",
                        help="an implementation outside the package, checked and timed beside the backends "
                             "(repeatable). The module defines Pool(num_slots, num_heads=H, device=D, gate=G) with "
                             "leapquant.Pool's attributes and flush_inplace(pool, idx, q0); optional NAME (rows "
                             "'impl:NAME') and close()")
    parser.add_argument("--batch", nargs="+", type=int, default=None, metavar="N",
                        help=f"sequences per call (x heads programs); default {' '.join(map(str, DEFAULT_GPU_BATCHES))}"
                             f" on a GPU, {' '.join(map(str, DEFAULT_CPU_BATCHES))} on a CPU")
    parser.add_argument("--heads", type=int, default=DEFAULT_HEADS, help=f"heads per sequence (default {DEFAULT_HEADS})")
    parser.add_argument("--gate", nargs="+", type=_word, default=["kda"], choices=GATES,
                        help="gate variant(s) (default kda)")
    parser.add_argument("--due", nargs="+", default=list(DUE_FRACTIONS), choices=tuple(DUE_FRACTIONS),
                        help="fraction of programs due: all, sixteenth (1/16, spread unevenly as at steady state), "
                             "none (default: all three)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed calls per point, rotating over the slot sets (default 100 on a GPU, 3 on a CPU)")
    parser.add_argument("--max-seconds", type=float, default=10.0,
                        help="stop timing one point after this many seconds (at least 3 calls; default 10)")
    parser.add_argument("--rotate", type=int, default=8,
                        help="disjoint slot sets used in rotation, so no call finds its data in L2 (default 8, "
                             "the least allowed)")
    parser.add_argument("--timer", choices=("kernel", "graph", "eager", "wall"), default="kernel",
                        help="GPU: 'kernel' (default) = CUDA kernel time from torch.profiler: per call, first kernel "
                             "start to last kernel end, replaying a CUDA graph of the call; 'graph' = CUDA events "
                             "around the graph replay (includes the replay's launch overhead); 'eager' = CUDA events "
                             "around the eager call (launches queued ahead); 'wall' = host wall-clock per eager call "
                             "of leapquant.flush_inplace (validation, dispatch and launch included): runs of "
                             "back-to-back calls, synchronised at the end of each run")
    parser.add_argument("--ref-max-batch", type=int, default=None, metavar="N",
                        help="run the reference backend only at batches <= N (it is slow)")
    parser.add_argument("--refcheck", action=argparse.BooleanOptionalAction, default=True,
                        help="judge every backend with the SPEC criterion at every batch (default on)")
    parser.add_argument("--check-rows", type=int, default=16, metavar="N",
                        help="distinct rows of input families generated per gate; a batch of B rows tiles them "
                             "(default 16: 512 heads at 32 heads, every family many times)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the input families and the due pattern")
    parser.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--interpret", action="store_true",
                        help="on a CPU, run Triton kernels through TRITON_INTERPRET=1 (tiny sizes only)")
    parser.add_argument("--allow-busy", action="store_true",
                        help="time even when another process is seen loading the GPU (the header says so)")
    parser.add_argument("--commit", default=None,
                        help="commit recorded in the results (default: git rev-parse of the checkout, or 'unknown')")
    parser.add_argument("--csv", metavar="PATH", help="write the long-format CSV here")
    parser.add_argument("--md", metavar="PATH", help="write the header and the markdown table here")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG plot of time against batch here (matplotlib)")
    parser.add_argument("--record", metavar="DIR",
                        help="write the table of record: DIR/RECORD.md, DIR/RECORD.csv and DIR/RECORD.png (as --md, "
                             "--csv, --plot) and append this run's timed rows to DIR/history.csv (created with a "
                             "header when missing); only for a run that completed and timed something")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return parser


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="leapquant bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    return add_arguments(p)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``leapquant bench`` / ``python -m leapquant.bench``; returns the exit status."""
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    return run_args(args, argv=argv)


# ---- small helpers ---------------------------------------------------------------------------------------------
class Progress:
    """A progress bar on stderr: tqdm when it is installed and stderr is a terminal, else one line per step."""

    def __init__(self, total: int, quiet: bool = False) -> None:
        self.total, self.done, self.quiet, self.bar = total, 0, quiet, None
        self.t0 = time.perf_counter()
        if not quiet and sys.stderr.isatty():
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, file=sys.stderr, leave=False, dynamic_ncols=True)
            except Exception:
                self.bar = None

    def step(self, what: str, n: int = 1) -> None:
        self.done += n
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.set_description(what[:60])
            self.bar.update(n)
        else:
            print(f"[bench {self.done}/{self.total} {time.perf_counter() - self.t0:6.1f}s] {what}", file=sys.stderr,
                  flush=True)

    def log(self, msg: str) -> None:
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            print(f"[bench] {msg}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _where(e: BaseException) -> str:
    """'file:line in function: ' of the innermost frame of ``e``'s traceback (or of its cause's)."""
    while e.__cause__ is not None and e.__traceback__ is None:
        e = e.__cause__
    tb = traceback.extract_tb(e.__traceback__) if e.__traceback__ is not None else []
    if not tb:
        return ""
    f = tb[-1]
    return f"{Path(f.filename).name}:{f.lineno} in {f.name}: "


def git_commit(default: str = "unknown") -> str:
    """Short commit of the checkout holding this package ("-dirty" when tracked files differ), or ``default``."""
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10)
        if sha.returncode != 0 or not sha.stdout.strip():
            return default
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)
        return sha.stdout.strip() + ("-dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")
    except Exception:
        return default


def package_versions() -> dict[str, str]:
    """Versions of python, torch, triton and tilelang, read from the installed metadata (no import of tilelang)."""
    from importlib import metadata

    import torch
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("triton", "tilelang"):
        try:
            out[mod] = metadata.version(mod)
        except Exception:
            out[mod] = "not installed"
    return out


def gpu_load(device) -> tuple[bool | None, str]:
    """(busy, description) of the GPU's load by other processes, read cheaply before any work of ours: NVML
    utilisation through torch (pynvml), else nvidia-smi. ``busy`` is None when it cannot be read."""
    import torch
    samples: list[int] = []
    how = ""
    try:
        for _ in range(3):
            samples.append(int(torch.cuda.utilization(device)))
            time.sleep(0.05)
        how = "NVML"
    except Exception:
        samples = []
    if not samples:
        try:
            index = torch.device(device).index or 0
            for _ in range(3):
                r = subprocess.run(["nvidia-smi", "-i", str(index), "--query-gpu=utilization.gpu",
                                    "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=5)
                samples.append(int(r.stdout.strip().splitlines()[0]))
                time.sleep(0.05)
            how = "nvidia-smi"
        except Exception:
            samples = []
    if not samples:
        return None, "GPU load could not be read (no NVML, no nvidia-smi): timings are from a possibly shared machine"
    busy = sorted(samples)[1] > 5
    desc = f"GPU utilisation before the run {'/'.join(map(str, samples))} % ({how})"
    return busy, (desc + ": another process is loading the GPU" if busy else
                  desc + ": idle at start; the machine may still be shared, so timings are from a shared machine")


# ---- pools: written and read through leapquant.layout.Pool's attributes -------------------------------------------
def load_programs(pool, slots, t: dict, gate: str) -> None:
    """Write checkpoints and full windows ``t`` (leading dims [n, H]) into ``slots`` (long [n]) of a pool with the
    attributes of :class:`leapquant.layout.Pool`; ``hcnt`` is set to L (due). Plain tensor writes, so an ``--impl``
    module's pool works as long as it has those attributes."""
    from .layout import K
    pool.codes[slots] = t["codes"]
    pool.s_k[slots] = t["s_k"]
    pool.s_v[slots] = t["s_v"]
    pool.tokens[slots, :, :, :K] = t["u"]
    pool.tokens[slots, :, :, K:] = t["q"]
    pool.kbuf[slots] = t["kbuf"]
    pool.ubuf[slots] = t["ubuf"]
    pool.w[slots] = t["w"]
    if gate == "kda":
        pool.pcum[slots] = t["pcum"]
        pool.gbuf[slots] = t["gbuf"]
    else:
        pool.p[slots] = t["p"]
    pool.hcnt[slots] = L


def read_checkpoint(pool, slots) -> tuple:
    """Copies of the checkpoints ``(codes, s_k, s_v, u, q)`` of ``slots`` (long [n])."""
    from .layout import K
    tok = pool.tokens[slots]
    return (pool.codes[slots].clone(), pool.s_k[slots].clone(), pool.s_v[slots].clone(),
            tok[..., :K].contiguous(), tok[..., K:].contiguous())


# ---- what gets timed ----------------------------------------------------------------------------------------------
@dataclass
class Target:
    """One column of the comparison: a project backend or an ``--impl`` module."""
    name: str
    kind: str                                   # "backend" | "impl"
    flush: Callable | None = None               # flush(pool, idx, q0)
    make_pool: Callable | None = None           # make_pool(num_slots, heads, gate, device) -> pool
    warmup: Callable | None = None              # warmup(pool)
    unavailable: str | None = None              # why it cannot run at all
    max_batch: int | None = None                # run only at batches <= this
    release: Callable | None = None             # release(): called once the target's rows are done


def project_target(name: str, device, heads: int, gate_list: Sequence[str], shared_pools: dict) -> Target:
    """The target of the project's backend ``name`` (or ``auto``): ``flush_inplace(..., backend=name)`` on a
    :class:`leapquant.layout.Pool`; ``unavailable`` holds the dispatch's reasons when it cannot serve a gate asked
    for. The backends share one pool per geometry through ``shared_pools`` (they read and write the same layout)."""
    import leapquant
    from . import dispatch
    from .layout import Pool

    why: list[str] = []
    try:
        for gate in gate_list if name != "auto" else ():     # auto: whatever the dispatch picks (raises if none)
            probe = Pool(2, heads, device=device, gate=gate)
            r = dispatch.reasons(name, probe)
            if r:
                why.append(f"{gate}: " + "; ".join(r))
    except Exception as e:
        why.append(_one_line(e))

    def make_pool(num_slots, heads_, gate, dev):
        key = (num_slots, heads_, gate, str(dev))
        if key not in shared_pools:
            shared_pools.clear()
            shared_pools[key] = Pool(num_slots, heads_, device=dev, gate=gate)
        return shared_pools[key]

    def flush(pool, idx, q0):
        leapquant.flush_inplace(pool, idx, q0, backend=name)

    def warmup(pool):
        leapquant.warmup(pool, backend=name)

    return Target(name=name, kind="backend", flush=flush, make_pool=make_pool, warmup=warmup,
                  unavailable=" | ".join(why) or None)


IMPL_INTERFACE = ("Pool(num_slots, num_heads=H, device=D, gate=G) with leapquant.layout.Pool's attributes, "
                  "flush_inplace(pool, idx, q0)")


def load_module(path: str, label: str, required: Sequence[str], interface: str):
    """Import the file ``path`` as a module of its own (nothing is copied) and check that it defines ``required``;
    errors name it by ``label`` (the option or variable that gave the path) and describe ``interface``."""
    p = Path(path).expanduser().resolve()
    if not p.is_file():
        raise FileNotFoundError(f"{label} {path}: no such file")
    modname = f"leapquant_bench_impl_{p.stem}_{abs(hash(str(p))) % 10**8}"
    spec = importlib.util.spec_from_file_location(modname, p)
    if spec is None or spec.loader is None:
        raise ImportError(f"{label} {path}: cannot be loaded as a Python module")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[modname] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(modname, None)
        raise
    for attr in required:
        if not hasattr(mod, attr):
            raise AttributeError(f"{label} {path}: the module has no {attr!r} (the interface: {interface})")
    return mod


def load_impl_module(path: str):
    """Import an ``--impl`` file and check that it defines the names of the interface (:func:`impl_target`)."""
    return load_module(path, "--impl", ("Pool", "flush_inplace"), IMPL_INTERFACE)


def check_impl_pool(pool, heads: int, gate: str) -> None:
    """Raise ``ValueError`` when an ``--impl`` module's pool lacks the geometry the run asks for (heads, gate)."""
    have = int(pool.codes.shape[1])
    if have != heads:
        raise ValueError(f"the module's Pool has {have} heads, the run asks for {heads} (--heads)")
    missing = [f for f in (("pcum", "gbuf") if gate == "kda" else ("p",)) if getattr(pool, f, None) is None]
    if missing:
        raise ValueError(f"the module's Pool has no {', '.join(missing)}: not a {gate} pool (--gate {gate})")


def impl_target(path: str) -> Target:
    """The target of ``--impl MODULE.py``: an implementation outside the package, held to the project's interface.

    The module defines ``Pool(num_slots, num_heads=H, device=D, gate=G)``, whose instances carry the attributes of
    :class:`leapquant.layout.Pool` that the flush reads and writes (``codes``, ``s_k``, ``s_v``, ``tokens``, ``kbuf``,
    ``ubuf``, ``w``, ``hcnt``, and ``pcum`` + ``gbuf`` for KDA or ``p`` for GDN; same shapes and dtypes), and
    ``flush_inplace(pool, idx, q0)`` with the meaning of :func:`leapquant.flush_inplace`. It may define ``NAME`` (its
    rows are named ``impl:NAME``; default: the file's stem) and ``close()`` (called once its rows are done, to free
    what it holds). A subclass of ``leapquant.Pool`` meets the pool's part. A module that cannot be imported, or a
    pool of another geometry, becomes rows that say so; the run goes on."""
    label = "impl:" + Path(path).stem
    try:
        mod = load_impl_module(path)
    except BaseException as e:  # a broken module is a row of the table, not a crash
        if isinstance(e, KeyboardInterrupt):
            raise
        return Target(name=label, kind="impl", unavailable="import failed: " + _one_line(e))

    def make_pool(num_slots, heads, gate, dev):
        pool = mod.Pool(num_slots, num_heads=heads, device=dev, gate=gate)
        check_impl_pool(pool, heads, gate)
        return pool

    return Target(name="impl:" + str(getattr(mod, "NAME", Path(path).stem)), kind="impl", flush=mod.flush_inplace,
                  make_pool=make_pool, release=getattr(mod, "close", None))


# ---- measurements ----------------------------------------------------------------------------------------------


# ---- the families, tiled to any batch ------------------------------------------------------------------------------
class CheckData:
    """The input families of one gate: ``rows`` distinct rows generated once, tiled to every batch; their fp64 exact
    states and fp32 reference checkpoints computed once on the device."""

    def __init__(self, gate: str, heads: int, rows: int, seed: int, device) -> None:
        import torch

        from . import families
        from .layout import CHECKPOINT_FIELDS
        from .reference import compress, rebuild
        case = families.make_case(rows, heads, gate, seed, "cpu")
        self.gate, self.rows = gate, rows
        self.q0 = case.q0.to(device)
        self.tensors = {k: v.to(device) for k, v in case.tensors.items()}
        self.labels = case.labels
        t = self.tensors
        gate_kw = dict(pcum=t["pcum"], gbuf=t["gbuf"]) if gate == "kda" else dict(p=t["p"])
        ck = tuple(t[n] for n in CHECKPOINT_FIELDS)
        self.exact = rebuild(*ck, t["kbuf"], t["ubuf"], t["w"], **gate_kw, dtype=torch.float64)
        self.ref = compress(rebuild(*ck, t["kbuf"], t["ubuf"], t["w"], **gate_kw), self.q0)

    @staticmethod
    def _tile(x, batch: int):
        import torch
        reps = -(-batch // x.shape[0])
        return (torch.cat([x] * reps) if reps > 1 else x)[:batch]

    def batch(self, batch: int) -> tuple[dict, Any, tuple, list]:
        """(inputs, exact fp64 states, reference checkpoint, labels) of ``batch`` rows."""
        t = {k: self._tile(v, batch) for k, v in self.tensors.items()}
        labels = [self.labels[b % self.rows] for b in range(batch)]
        return t, self._tile(self.exact, batch), tuple(self._tile(r, batch) for r in self.ref), labels


def family_scores(verdict, labels: Sequence[Sequence[str]]) -> str:
    """'family score, ...' (worst per-head score of each input family, worst first) of a criterion verdict."""
    score = verdict.score.reshape(len(labels), -1)
    worst: dict[str, float] = {}
    for b, row in enumerate(labels):
        for h, fam in enumerate(row):
            worst[fam] = max(worst.get(fam, 0.0), float(score[b, h]))
    return ", ".join(f"{f} {x:.4g}" for f, x in sorted(worst.items(), key=lambda kv: -kv[1]))


def judge(name: str, data: CheckData, batch: int, out: Sequence) -> Any:
    from . import criterion
    _, exact, ref, labels = data.batch(batch)
    return criterion.judge(exact, list(out), list(ref), labels=labels, name=name)


# ---- rows: one per point, and their formats --------------------------------------------------------------------


def due_pattern(nsets: int, batch: int, heads: int, due: str, seed: int, device) -> tuple[list, int]:
    """hcnt values [batch, heads] for each slot set, and the number of due programs per call.

    all: every program due. none: every program at a phase in [0, L). sixteenth: round(batch * heads / 16) programs
    (at least one) due, placed at random over rows and heads (so rows and heads carry uneven loads, as at steady
    state), every other program at a phase in [0, L); a different placement in every set."""
    import torch

    g = torch.Generator().manual_seed(seed * 7919 + batch * 31 + heads)
    n = batch * heads
    if due == "all":
        return [torch.full((batch, heads), L, dtype=torch.int32, device=device)] * nsets, n
    ndue = 0 if due == "none" else max(1, round(n * DUE_FRACTIONS[due]))
    out = []
    for _ in range(nsets):
        h = torch.randint(0, L, (n,), generator=g, dtype=torch.int32)
        if ndue:
            h[torch.randperm(n, generator=g)[:ndue]] = L
        out.append(h.reshape(batch, heads).to(device))
    return out, ndue


def markdown_table(rows: Sequence[Row]) -> str:
    head = ("| backend | gate | batch | heads | due | due programs | median us | p20 us | p80 us | bound us "
            "| x bound | verdict | worst ratio |")
    lines = [head, "|" + "|".join([" --- "] * (head.count("|") - 1)) + "|"]
    for r in rows:
        verdict = r.verdict if len(r.verdict) <= 60 else r.verdict[:57] + "..."
        lines.append(f"| {r.backend} | {r.gate} | {r.batch} | {r.heads} | {r.due} | {r.due_programs} "
                     f"| {_fmt(r.median_us)} | {_fmt(r.p20_us)} | {_fmt(r.p80_us)} | {_fmt(r.bound_us)} "
                     f"| {_fmt(r.ratio, 2)} | {verdict} | {_fmt(r.worst_ratio, 4)} |")
    return "\n".join(lines)


def write_csv(path: str, rows: Sequence[Row], env: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(CSV_COLUMNS))
        w.writeheader()
        for r in rows:
            w.writerow(r.as_dict(env))


def write_plot(path: str, rows: Sequence[Row], env: dict) -> None:
    """Median time (p20-p80 bars) against batch, one panel per (gate, due fraction), one line per backend, with the
    memory bound dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(g, d) for g in dict.fromkeys(r.gate for r in rows) for d in dict.fromkeys(r.due for r in rows)
              if any(r.gate == g and r.due == d for r in rows)]
    if not panels:
        raise ValueError("nothing to plot")
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.4), squeeze=False)
    unit = "us" if env.get("device_type") == "cuda" else "us (wall-clock)"
    for ax, (gate, due) in zip(axes[0], panels):
        sel = [r for r in rows if r.gate == gate and r.due == due]
        for name in dict.fromkeys(r.backend for r in sel):
            pts = sorted((r.batch, r.median_us, r.p20_us, r.p80_us) for r in sel
                         if r.backend == name and not math.isnan(r.median_us))
            if not pts:
                continue
            b, m, lo, hi = zip(*pts)
            ax.errorbar(b, m, yerr=[[mi - l for mi, l in zip(m, lo)], [h - mi for mi, h in zip(m, hi)]],
                        marker="o", capsize=3, label=name)
        bound = sorted({(r.batch, r.bound_us) for r in sel if not math.isnan(r.bound_us) and r.bound_us > 0})
        if bound:
            ax.plot([b for b, _ in bound], [u for _, u in bound], "k--", label="memory bound")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(f"batch (sequences x {sel[0].heads} heads)")
        ax.set_ylabel(f"time per call, {unit}")
        ax.set_title(f"{gate}, {'due: ' if due in DUE_FRACTIONS else 'window: '}{due}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"LeapQuant {env.get('op', 'flush')} on {env.get('device', '?')}, {env.get('commit', '?')} "
                 f"(copy {env.get('bandwidth_gbs', 0):.0f} GB/s; {env.get('timing_short', '')})", fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _header(env: dict) -> str:
    lines = [
        f"# LeapQuant {env.get('op', 'flush')} benchmark ({env['date']})",
        "",
        f"- device: {env['device_long']}",
        f"- copy bandwidth (read + written): {env['bandwidth_gbs']:.0f} GB/s — {env['bandwidth_how']}",
        "- " + env.get("bytes_line", f"memory bound: due programs x {env['bytes_kda']} B (kda) / {env['bytes_gdn']} B "
                                     f"(gdn) per due program (`due_program_bytes`)") + " at that bandwidth",
        f"- timing: {env['timing_long']}",
        f"- timer floor: {env['timer_floor_us']:.2f} us — the same timing around one tiny kernel "
        f"(what an empty call costs with this method here; it is inside every time below)",
        f"- L2-cold: {env['rotate']} disjoint slot sets used in rotation",
        f"- correctness: {env['check_long']}",
        f"- versions: python {env['python']}, torch {env['torch']}, triton {env['triton']}, "
        f"tilelang {env['tilelang']}; commit {env['commit']}",
        f"- load: {env['load']}",
        f"- command: `{env['command']}`",
    ]
    return "\n".join(lines)


def _argv(argv: Sequence[str] | None) -> list[str]:
    """The bench's own arguments: ``argv``, else the process's (without the ``bench`` subcommand word)."""
    if argv is not None:
        return list(argv)
    cmd = sys.argv[1:]
    return cmd[1:] if cmd[:1] == ["bench"] else cmd


# ---- the run, step by step ---------------------------------------------------------------------------------------
#: the header's description of each --timer on a GPU, and the short form in the plot's title
TIMING_LONG = {
    "kernel": "CUDA kernel time from torch.profiler: per call, first kernel start to last kernel end, replaying a CUDA "
              "graph of one {call} call (markers between calls; what the calls consume restored after each round over "
              "the slot sets, outside every call); the reference (host-synchronising) with CUDA "
              "events around the eager call",
    "graph": "per call, CUDA events around the replay of a CUDA graph holding one {call} call (launches queued "
             "behind a sleep kernel; includes the replay's launch overhead)",
    "eager": "per call, CUDA events around the eager call (launches queued behind a sleep kernel)",
    "wall": "host wall-clock per eager call of leapquant.{call} (argument checks, dispatch and launch "
            "included): runs of 16 back-to-back calls (where each call consumes its slot set's windows: one call per "
            "slot set, at most 16, the sets restored before the run's clock starts), synchronised after each run",
}
TIMING_SHORT = {"kernel": "kernel time (profiler)", "graph": "CUDA-graph replay, events", "eager": "eager, events",
                "wall": "eager, host wall-clock"}

#: the table of record inside a --record directory, and the history of every recorded run beside it
HISTORY_FILE = "history.csv"
HISTORY_COLUMNS = ("commit", "date", "gpu", "backend", "gate", "batch", "heads", "due", "median_us", "bound_us",
                   "verdict", "op")


@dataclass
class Plan:
    """The resolved options of one run: the device, the batches and the timed calls per point."""
    device: Any
    batches: list[int]
    repeats: int

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"


def _rerun_interpreted(argv: Sequence[str] | None) -> int:
    """Run the benchmark again in a child process with TRITON_INTERPRET=1 and return its exit status: the
    interpreter must be on before triton is first imported, and importing leapquant (torch.compiler) already did."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = "import sys; from leapquant.bench import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.call([sys.executable, "-c", code, *_argv(argv)], env=env)


def plan_run(args: argparse.Namespace) -> Plan:
    """Resolve the device, the batches and the repeats from ``args``; raise :class:`UsageError` for options that
    cannot run."""
    from . import dispatch
    problem = dispatch.env_problem()
    if problem and args.backends is None:       # (named backends never read the variable)
        raise UsageError(problem)
    known = (*dispatch.CHOICES, "none")
    if args.backends is not None:
        args.backends = [_word(name) for name in args.backends]
    for name in args.backends or ():
        if name not in known:
            raise UsageError(f"--backends: unknown backend {name!r} (choose from {', '.join(known)})")
    device = parse_device(args.device)
    if args.rotate < 8:
        raise UsageError("--rotate must be at least 8 (L2-cold timing)")
    if args.repeats is not None and args.repeats < 1:
        raise UsageError(f"--repeats must be positive, got {args.repeats}")
    if not args.max_seconds > 0:
        raise UsageError(f"--max-seconds must be positive, got {args.max_seconds}")
    if args.ref_max_batch is not None and args.ref_max_batch < 1:
        raise UsageError(f"--ref-max-batch must be positive, got {args.ref_max_batch}")
    if args.op != "flush" and args.impl:
        raise UsageError("--impl modules are flush implementations (--op flush)")
    if args.op != "flush" and any(f < 0 or f >= L for f in args.fill):
        raise UsageError(f"--fill values must be in [0, {L})")
    on_gpu = device.type == "cuda"
    batches = list(dict.fromkeys(args.batch or (DEFAULT_GPU_BATCHES if on_gpu else DEFAULT_CPU_BATCHES)))
    if any(b < 1 for b in batches) or args.heads < 1 or args.check_rows < 1:
        raise UsageError("--batch, --heads and --check-rows must be positive")
    if args.record:
        try:                                     # checked before measuring: a record without its plot is incomplete
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--record writes RECORD.png and needs matplotlib (pip install -e '.[bench]')") from None
    return Plan(device=device, batches=batches, repeats=args.repeats if args.repeats is not None else
                (100 if on_gpu else 3))


def build_targets(args: argparse.Namespace, device) -> list[Target]:
    """The targets asked for, in the order asked: ``--backends`` (default: every backend that can serve on
    ``device``; ``none``: no backend), then the ``--impl`` modules. One that cannot run stays, with the reason, so its
    rows say why."""
    import leapquant
    names = args.backends
    if names is None:
        names = [r["name"] for r in leapquant.backend_info(device, args.heads, args.gate[0]) if r["available"]]
    targets: list[Target] = []
    shared_pools: dict = {}
    for n in dict.fromkeys(n for n in names if n.lower() != "none"):
        try:
            t = project_target(n, device, args.heads, args.gate, shared_pools)
        except Exception as e:
            t = Target(name=n, kind="backend", unavailable=_one_line(e))
        if n == "reference":
            t.max_batch = args.ref_max_batch
        targets.append(t)
    targets.extend(impl_target(path) for path in args.impl)
    return targets


def environment(args: argparse.Namespace, plan: Plan, load: str, argv: Sequence[str] | None) -> dict[str, Any]:
    """The facts every result carries: the device, the copy bandwidth and the timer floor measured now, the bytes per
    due program, the timing method, the correctness set-up, the versions, commit, date, load and the exact command.
    They make the markdown header and the per-run columns of the CSV."""
    import torch

    import leapquant
    from .layout import due_program_bytes
    device, on_gpu = plan.device, plan.on_gpu
    versions = package_versions()
    bw, bw_how = copy_bandwidth(device)
    floor_us = timer_floor(device, args.timer)
    described = leapquant.device_description(device)
    op = getattr(args, "op", "flush")
    if not args.refcheck:
        check = "not checked (--no-refcheck)"
    elif op == "flush":
        check = (f"SPEC section 3 criterion (leapquant.criterion.judge) on every family of leapquant.families: "
                 f"{args.check_rows} distinct rows x {args.heads} heads per gate (seed {args.seed}) tiled to the "
                 f"batch, run through the same pool and deployment call as the timing; `worst ratio` is the largest "
                 f"err / bound over the heads (pass <= 1)")
    else:
        check = (f"SPEC section 7 criterion (leapquant.criterion.judge_step, element-wise against fp64) on every "
                 f"family of leapquant.step_families: {args.check_rows} distinct rows x {args.heads} heads per gate "
                 f"(seed {args.seed}) tiled to the batch, one step_inplace through the row's backend on the same "
                 f"pool as the timing" + ("" if op == "step" else " (the decode's flush is judged by the flush's "
                                          "record)") + "; `worst ratio` is the largest err / bound (pass <= 1)")
    call = {"flush": "flush_inplace", "step": "step_inplace", "decode": "decode_inplace"}[op]
    return dict(
        device=described.split(" (")[0] if on_gpu else described,
        device_long=described,
        device_type=device.type,
        sm_count=torch.cuda.get_device_properties(device).multi_processor_count if on_gpu else "",
        bandwidth_gbs=bw / 1e9, bandwidth_how=bw_how, timer_floor_us=floor_us,
        bytes_kda=due_program_bytes("kda"), bytes_gdn=due_program_bytes("gdn"),
        commit=args.commit or git_commit(),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        rotate=args.rotate, load=load,
        command="leapquant bench " + " ".join(shlex.quote(a) for a in _argv(argv)),
        op=op,
        timing_long=(TIMING_LONG[args.timer].format(call=call) + " (the row's `timing` column in the CSV says which)"
                     if on_gpu else
                     "wall-clock per call on the CPU (not kernel times)"),
        timing_short=TIMING_SHORT[args.timer] if on_gpu else "CPU wall-clock",
        check_long=check,
        **versions,
    )


class CheckCache:
    """The check data (:class:`CheckData`) of each gate, built once on first use, or why it could not be built;
    ``None`` under ``--no-refcheck``."""

    def __init__(self, args: argparse.Namespace, device) -> None:
        self.args, self.device, self.data = args, device, {}

    def get(self, gate: str) -> CheckData | str | None:
        if not self.args.refcheck:
            return None
        if gate not in self.data:
            a = self.args
            try:
                self.data[gate] = CheckData(gate, a.heads, a.check_rows, a.seed, self.device)
            except Exception as e:
                self.data[gate] = "families/criterion unavailable: " + _one_line(e)
        return self.data[gate]


@dataclass
class Run:
    """What the steps of one run share: the options, the environment, the check data, the rows and the progress."""
    args: argparse.Namespace
    plan: Plan
    env: dict
    q0: Any
    checks: CheckCache
    prog: Progress
    rows: list = field(default_factory=list)


def steps_per_batch(args: argparse.Namespace) -> int:
    """Progress steps of one (target, gate, batch): a check (when on), then one per due fraction."""
    return len(args.due) + (1 if args.refcheck else 0)


def execution_order(targets: Sequence[Target]) -> list[Target]:
    """The order the targets run in: the reference, then the ``--impl`` modules, then the project's GPU kernels, so
    that a kernel that breaks the CUDA context (a sticky error) cannot cost the rows measured before it."""
    declared = {t.name: i for i, t in enumerate(targets)}
    return sorted(targets, key=lambda t: (0 if t.name == "reference" else 1 if t.kind == "impl" else 2,
                                          declared[t.name]))


def measure(targets: Sequence[Target], args: argparse.Namespace, plan: Plan, env: dict) -> tuple[list[Row], bool]:
    """Check and time every (target, gate, batch, due fraction). Returns the rows in the order the targets were asked
    for (gate, batch and due order kept) and whether the run completed: after Ctrl-C, the rows measured so far and
    ``False``."""
    import torch

    from .reference import default_q0
    steps = len(targets) * len(args.gate) * len(plan.batches) * steps_per_batch(args)
    run = Run(args=args, plan=plan, env=env, q0=default_q0(plan.device), checks=CheckCache(args, plan.device),
              prog=Progress(steps, args.quiet))
    run.prog.log(f"{env['device']}: copy bandwidth {env['bandwidth_gbs']:.0f} GB/s; {env['load']}")
    complete = False
    try:
        for tgt in execution_order(targets):
            for gate in args.gate:
                measure_gate(run, tgt, gate)
            if tgt.release is not None:
                with contextlib.suppress(Exception):
                    tgt.release()
            if plan.on_gpu:
                torch.cuda.empty_cache()
        complete = True
    except KeyboardInterrupt:
        run.prog.log("interrupted: writing what was measured")
    finally:
        run.prog.close()
    declared = {t.name: i for i, t in enumerate(targets)}
    run.rows.sort(key=lambda r: declared.get(r.backend, len(declared)))    # stable: gate, batch, due order kept
    return run.rows, complete


def build_pool(run: Run, tgt: Target, gate: str) -> Any:
    """The target's pool for ``gate``: ``rotate x max(batch) + 9`` slots (every batch's slot sets fit), warmed up
    (kernels compiled) when the target can be."""
    import torch
    num_slots = run.args.rotate * max(run.plan.batches) + 9
    if run.plan.on_gpu:
        torch.cuda.empty_cache()
    run.prog.log(f"{tgt.name}: building a {gate} pool of {num_slots} slots")
    pool = tgt.make_pool(num_slots, run.args.heads, gate, run.plan.device)
    if tgt.warmup is not None:
        tgt.warmup(pool)
    return pool


def measure_gate(run: Run, tgt: Target, gate: str) -> None:
    """One target and gate at every batch. The pool is built at the first batch the target runs; a batch it cannot
    run (unavailable, above ``--ref-max-batch``, a pool that could not be built) is one row per due fraction that says
    why."""
    pool = None
    why_not = tgt.unavailable
    for batch in run.plan.batches:
        skip = why_not
        if skip is None and tgt.max_batch is not None and batch > tgt.max_batch:
            skip = f"skipped: batch > --ref-max-batch {tgt.max_batch}"
        if skip is None and pool is None:
            try:
                pool = build_pool(run, tgt, gate)
            except BaseException as e:
                if isinstance(e, KeyboardInterrupt):
                    raise
                why_not = skip = ("unavailable: " if tgt.kind == "backend" else "error: ") + _one_line(e)
                run.prog.log(f"{tgt.name}: {skip}")
        if skip is not None:
            status = skip if skip.startswith(("skipped", "error", "unavailable")) else "unavailable: " + skip
            run.rows.extend(Row(backend=tgt.name, gate=gate, batch=batch, heads=run.args.heads, due=due,
                                verdict=status) for due in run.args.due)
            run.prog.step(f"{tgt.name} {gate} b={batch}: {status[:50]}", steps_per_batch(run.args))
            continue
        measure_batch(run, tgt, pool, gate, batch)
        if run.args.csv:                     # what is measured so far survives a killed run
            with contextlib.suppress(Exception):
                write_csv(run.args.csv, run.rows, run.env)


def check_batch(tgt: Target, pool, gate: str, batch: int, sets: list, idx: list, data: CheckData | str | None,
                device) -> tuple[str, float, str]:
    """(verdict, worst ratio, message) of the target at ``batch``: the families tiled to the batch are loaded into the
    first slot set, flushed by the same call as the timing and judged by the criterion."""
    import torch
    if data is None:
        return "unchecked (--no-refcheck)", float("nan"), ""
    if isinstance(data, str):
        return data, float("nan"), ""
    try:
        t, _, _, labels = data.batch(batch)
        load_programs(pool, sets[0], t, gate)
        tgt.flush(pool, idx[0], data.q0)
        out = read_checkpoint(pool, sets[0])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        v = judge(tgt.name, data, batch, out)
        message = v.message + "; worst score per family: " + family_scores(v, labels)
        return ("PASS" if v.passed else "FAIL"), float(v.worst_score), message
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):
            raise
        return "error: " + _one_line(e, 200), float("nan"), "error: " + _where(e) + _one_line(e, 600)


def timing_inputs(data: CheckData | str | None, batch: int, heads: int, gate: str, rows: int, seed: int,
                  device) -> dict:
    """The programs every slot set holds while timed: the families' rows tiled to ``batch`` (real, varied data),
    taken from the check data when there is some, else generated here."""
    if isinstance(data, CheckData):
        with contextlib.suppress(Exception):
            return data.batch(batch)[0]
    from . import families
    t = families.make_case(min(batch, rows), heads, gate, seed, "cpu").tensors
    return {k: CheckData._tile(v.to(device), batch) for k, v in t.items()}


def time_target(run: Run, tgt: Target, call: Callable[[int], None],
                prepare: Callable[[int], None] | None = None) -> tuple[list[float], str]:
    """Per-call samples (us) of ``call(s)`` over the slot sets and the method's label, by ``--timer``: the profiler's
    kernel time of graph replays, the host's wall-clock, or CUDA events (around graph replays, or around the eager
    call for ``eager`` and for the host-synchronising reference); on a CPU, wall-clock."""
    a, plan = run.args, run.plan
    kernel = plan.on_gpu and tgt.name != "reference"
    if kernel and a.timer == "kernel":
        return time_calls_kernel(call, a.rotate, plan.repeats, plan.device, prepare=prepare)
    if a.timer == "wall":
        return time_calls_wall(call, a.rotate, plan.repeats, plan.device, a.max_seconds, prepare=prepare)
    return time_calls(call, a.rotate, plan.repeats, plan.device, a.max_seconds, capture=kernel and a.timer == "graph",
                      host_sync=(tgt.name == "reference"), prepare=prepare)


def time_due(run: Run, tgt: Target, pool, gate: str, batch: int, due: str, sets: list, idx: list, tiled: dict,
             row: Row) -> None:
    """Time the target at one due fraction and fill ``row``'s times, due programs, bound and ratio: every slot set
    holds ``tiled`` with the fraction's ``hcnt`` pattern, and the calls rotate over the sets."""
    import torch

    from .layout import due_program_bytes
    device = run.plan.device
    pattern, ndue = due_pattern(len(sets), batch, run.args.heads, due, run.args.seed, device)
    for s, slots in enumerate(sets):
        load_programs(pool, slots, tiled, gate)
        pool.hcnt[slots] = pattern[s]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    # a flush empties the windows it folds, and a flush of an empty window writes nothing: every timed call gets its
    # windows' weights and gate back first, outside its time (every timer); with nothing due nothing is consumed
    gate_name = "pcum" if gate == "kda" else "p"
    saved = [(pool.w[slots].clone(), getattr(pool, gate_name)[slots].clone()) for slots in sets]

    def prepare(s: int) -> None:
        pool.w[sets[s]] = saved[s][0]
        getattr(pool, gate_name)[sets[s]] = saved[s][1]
    samples, method = time_target(run, tgt, lambda s: tgt.flush(pool, idx[s], run.q0), prepare if ndue else None)
    row.due_programs = ndue
    row.median_us, row.p20_us, row.p80_us = (_percentile(samples, 50), _percentile(samples, 20),
                                             _percentile(samples, 80))
    row.samples, row.timing = len(samples), method
    row.bound_us = ndue * due_program_bytes(gate) / (run.env["bandwidth_gbs"] * 1e9) * 1e6
    row.ratio = row.median_us / row.bound_us if row.bound_us > 0 else float("nan")


def measure_batch(run: Run, tgt: Target, pool, gate: str, batch: int) -> None:
    """Check (once) and time (per due fraction) one target at one batch, appending one row per due fraction. A timing
    that fails is its row's verdict; the other rows go on."""
    import torch
    a, device = run.args, run.plan.device
    sets = slot_sets(a.rotate, batch, a.seed, device)
    idx = [s.to(torch.int32) for s in sets]
    data = run.checks.get(gate)
    verdict, worst, message = check_batch(tgt, pool, gate, batch, sets, idx, data, device)
    if data is not None:
        run.prog.step(f"{tgt.name} {gate} b={batch}: check {verdict[:40]}")
    tiled = None
    for due in a.due:
        row = Row(backend=tgt.name, gate=gate, batch=batch, heads=a.heads, due=due, verdict=verdict,
                  worst_ratio=worst, message=message)
        try:
            if tiled is None:
                tiled = timing_inputs(data, batch, a.heads, gate, a.check_rows, a.seed, device)
            time_due(run, tgt, pool, gate, batch, due, sets, idx, tiled, row)
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):
                raise
            row.verdict = (verdict + "; " if verdict else "") + "timing error: " + _one_line(e, 200)
            with contextlib.suppress(Exception):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
        run.rows.append(row)
        run.prog.step(f"{tgt.name} {gate} b={batch} due={due}: {_fmt(row.median_us)} us")


# ---- output ------------------------------------------------------------------------------------------------------
def report_text(rows: Sequence[Row], env: dict, dues: Sequence[str]) -> str:
    """The markdown report: the header, the table, then one verdict line per (target, gate, batch) that has one."""
    text = _header(env) + "\n\n" + markdown_table(rows) + "\n"
    first = dues[0] if dues else None
    notes = [f"- {r.backend} {r.gate} b={r.batch}: {r.message}" for r in rows
             if r.message and (first is None or r.due == first)]
    if notes:
        text += "\nVerdicts:\n\n" + "\n".join(dict.fromkeys(notes)) + "\n"
    return text


def write_outputs(text: str, rows: Sequence[Row], args: argparse.Namespace, env: dict) -> None:
    """Write ``--md`` (the report), ``--csv`` and ``--plot`` where asked; a plot that cannot be drawn is a message."""
    if args.md:
        Path(args.md).parent.mkdir(parents=True, exist_ok=True)
        Path(args.md).write_text(text)
    if args.csv:
        write_csv(args.csv, rows, env)
    if args.plot:
        try:
            write_plot(args.plot, rows, env)
        except Exception as e:
            print(f"leapquant bench: no plot written: {_one_line(e)}", file=sys.stderr)


def history_row(row: Row, env: dict) -> dict:
    """``row`` in the fields of the history: the CSV's values, ``gpu`` = the device's name and ``verdict`` shortened
    to its outcome (PASS, FAIL, error, unchecked)."""
    d = row.as_dict(env)
    d["gpu"] = d["device"]
    d["verdict"] = re.split(r"[:;(]", row.verdict, maxsplit=1)[0].strip()
    return d


def append_history(path: str | Path, rows: Sequence[Row], env: dict) -> int:
    """Append the timed rows to the history CSV at ``path``, in the columns of its header and with its line ends (a new
    file gets :data:`HISTORY_COLUMNS` and a header); returns the number of rows appended."""
    path = Path(path)
    columns, newline, add_line_end = list(HISTORY_COLUMNS), "\n", False
    exists = path.is_file() and path.stat().st_size > 0
    if exists:
        data = path.read_bytes()
        first = data.split(b"\n", 1)[0]
        newline = "\r\n" if first.endswith(b"\r") else "\n"
        header = next(csv.reader([first.decode().rstrip("\r")]), None)
        if header:
            columns = header
        add_line_end = not data.endswith(b"\n")
    timed = [r for r in rows if not math.isnan(r.median_us)]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", newline="") as f:
        if add_line_end:
            f.write(newline)
        w = csv.DictWriter(f, fieldnames=columns, restval="", extrasaction="ignore", lineterminator=newline)
        if not exists:
            w.writeheader()
        for r in timed:
            w.writerow(history_row(r, env))
    return len(timed)


def record_files(op: str = "flush") -> tuple[str, str, str]:
    """The table of record's files of ``op``: RECORD.{md,csv,png} for the flush, RECORD-step.* and RECORD-decode.*."""
    stem = "RECORD" if op == "flush" else f"RECORD-{op}"
    return tuple(f"{stem}.{ext}" for ext in ("md", "csv", "png"))


def write_record(directory: str | Path, text: str, rows: Sequence[Row], env: dict, op: str = "flush") -> int:
    """Write the table of record into ``directory``: RECORD.md (the report, whose header names the commit, GPU,
    versions, method and command), RECORD.csv and RECORD.png, as ``--md``, ``--csv`` and ``--plot`` would; then
    append the run's timed rows to history.csv. Returns the number of rows appended."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    md, csv_path, png = (d / name for name in record_files(op))
    md.write_text(text)
    write_csv(str(csv_path), rows, env)
    try:
        write_plot(str(png), rows, env)
    except Exception as e:
        print(f"leapquant bench: no {png} written: {_one_line(e)}", file=sys.stderr)
    return append_history(d / HISTORY_FILE, rows, env)


def run_args(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    """Run the benchmark for parsed ``args`` (see :func:`add_arguments`); returns the exit status.

    The steps: resolve the options (:func:`plan_run`), refuse a GPU another process is loading, build the targets
    (:func:`build_targets`), measure the environment (:func:`environment`), check and time every point
    (:func:`measure`), then print and write the report (:func:`report_text`, :func:`write_outputs`) and the record
    (:func:`write_record`, only for a complete run that timed something)."""
    if args.interpret and os.environ.get("TRITON_INTERPRET") != "1":
        return _rerun_interpreted(argv)
    try:
        plan = plan_run(args)
    except UsageError as e:
        print(f"leapquant bench: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    load = "CPU run: wall-clock timings, not kernel times"
    if plan.on_gpu:
        busy, load = gpu_load(plan.device)
        if busy and not args.allow_busy:
            print(f"leapquant bench: refusing to time: {load} (pass --allow-busy to time anyway)", file=sys.stderr)
            return EXIT_BUSY
    if args.op != "flush":
        return run_op(args, plan, load, argv)
    targets = build_targets(args, plan.device)
    if not targets:
        print("leapquant bench: nothing to run (no --backends, no --impl)", file=sys.stderr)
        return EXIT_NOTHING
    env = environment(args, plan, load, argv)
    rows, complete = measure(targets, args, plan, env)
    return finish(args, rows, env, complete, report_text(rows, env, args.due))


def run_op(args: argparse.Namespace, plan: Plan, load: str, argv: Sequence[str] | None) -> int:
    """``--op step`` / ``--op decode`` (:mod:`leapquant.bench_step`): the project's backends with a step kernel (or
    those named), fla beside them, every (gate, batch) checked and timed."""
    import leapquant

    from .layout import step_program_bytes
    names = args.backends
    if names is None:
        names = [r["name"] for r in leapquant.backend_info(plan.device, args.heads, args.gate[0], op="step")
                 if r["available"] and r["name"] != "reference"] or ["reference"]
        if args.op == "decode":
            names = ["auto"] + [n for n in names if n != "auto"]
    targets = bench_step.op_targets(names, args.fla and plan.on_gpu)
    env = environment(args, plan, load, argv)
    env["bytes_line"] = (f"memory bound: every program x {step_program_bytes('kda')} B (kda) / "
                         f"{step_program_bytes('gdn')} B (gdn) per step program (`step_program_bytes`: the whole "
                         "window, as SPEC section 7 counts it; the Triton step reads only the window rows its fill "
                         "count needs, so at a small fill it moves less and can run below this bound)"
                         + (", plus the due programs' flush bytes" if args.op == "decode" else "")
                         + "; fla: the state read and written")
    run = Run(args=args, plan=plan, env=env, q0=None, checks=None, prog=Progress(0, args.quiet))
    run.prog.log(f"{env['device']}: copy bandwidth {env['bandwidth_gbs']:.0f} GB/s; {env['load']}")
    complete = False
    try:
        bench_step.measure_ops(run, targets)
        complete = True
    except KeyboardInterrupt:
        run.prog.log("interrupted: writing what was measured")
    finally:
        run.prog.close()
    text = _header(env) + "\n\n" + bench_step.op_table(run.rows) + "\n"
    notes = [f"- {r.backend} {r.gate} b={r.batch}: {r.message}" for r in run.rows if r.message]
    if notes:
        text += "\nVerdicts:\n\n" + "\n".join(dict.fromkeys(notes)) + "\n"
    return finish(args, run.rows, env, complete, text)


def finish(args: argparse.Namespace, rows: Sequence[Row], env: dict, complete: bool, text: str) -> int:
    """Print and write the report (:func:`write_outputs`) and the record (:func:`write_record`, only for a complete
    run that timed something); the exit status."""
    print(text, end="")
    write_outputs(text, rows, args, env)
    timed = any(not math.isnan(r.median_us) for r in rows)
    if args.record:
        if complete and timed:
            n = write_record(args.record, text, rows, env, args.op)
            if not args.quiet:
                print(f"leapquant bench: record written to {args.record} ({', '.join(record_files(args.op))}); {n} rows "
                      f"appended to {Path(args.record) / HISTORY_FILE}", file=sys.stderr)
        else:
            print(f"leapquant bench: --record {args.record}: not written, "
                  f"{'nothing was timed' if complete else 'the run was interrupted'}", file=sys.stderr)
    return EXIT_OK if timed else EXIT_NOTHING


if __name__ == "__main__":
    sys.exit(main())
