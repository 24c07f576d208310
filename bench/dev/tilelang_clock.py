"""Clock-stamp profiles of the TileLang kernel: its profiling builds (``FlushConfig(..., clock=MODE)``, see
leapquant/tilelang/clock.py for what each mode stamps and where) timed on a GPU, and the stamps printed as tables.

    python bench/dev/tilelang_clock.py precompile [--modes phases ctas prologue] [--arch sm_90a --sms 132]   # CPU
    python bench/dev/tilelang_clock.py phases 256:all 256:sixteenth 4:all      # cycles per program of each step
    python bench/dev/tilelang_clock.py ctas 256:all 256:sixteenth              # per-CTA timeline of a call
    python bench/dev/tilelang_clock.py prologue 256:sixteenth                  # the milestones of a round's prologue

A point is ``batch:due`` (due: all, sixteenth, none; default 256:all) on bench/dev/tilelang_dev.py's timing pool
(8 disjoint slot sets of ``batch`` rows x 32 heads; ``--gate``, default kda). ``precompile`` builds the profiling
kernels into TileLang's disk cache without a GPU (run it with the same TILELANG_CACHE_DIR as the GPU run, and carry
the cache, to spare GPU time). ``--kernel PATH`` profiles the generator of another version instead of the installed
one: a copy of leapquant/tilelang/ (a directory, e.g. ``git archive REV leapquant/tilelang | tar -x -C DIR`` then
``DIR/leapquant/tilelang``) whose FlushConfig has the same clock option.

``phases``: thread 0 of each group adds the cycles of every step of the program loop to a counter; printed per
program and group. ``batch 4`` (128 programs on 132 CTAs) leaves one group alone on its SM: the uncontended latency
of a program. ``ctas``: per call the span, the CTAs' start skew, their mean / max / min duration and the group loops'
cycles, and the slowest and fastest CTAs (block, SM, us): how evenly the persistent grid ends. ``prologue``: the mean
cycles of each milestone after the CTA's start over the groups that flush at least two programs: where the first
program's extra cost goes at low load. The stamps change the kernel's code, so these tables show where a program's
time goes, not A/B differences between kernels (two builds' totals differed by 5-7 % where the shipped kernels did
not, H200): compare kernels by tilelang_dev.py's ``ab``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MODES = ("phases", "ctas", "prologue")


def generator(path: str | None):
    """The kernel generator module: the installed one, or the one of the version at ``path``."""
    if path is None:
        from leapquant.tilelang import kernel
        return kernel
    import tilelang_dev
    return tilelang_dev.load_kernel_module(path)


def clock_module(path: str | None):
    """The clock module (header word layout) that goes with the generator."""
    if path is None:
        from leapquant.tilelang import clock
        return clock
    import importlib
    return importlib.import_module(generator(path).__package__ + ".clock")


def build(mod, cfg, mode: str):
    """The profiling build of ``cfg``'s geometry in clock mode ``mode`` (compiled, or loaded from the disk cache)."""
    return mod.compile_flush(mod.FlushConfig(cfg.num_heads, cfg.gate, cfg.arch, cfg.num_sms, clock=mode))


def _warm_points(mod, mode: str, points: list[str], gate: str):
    """For each "batch:due" point (default 256:all): the timing pool of tilelang_dev.py and the profiling build for
    it, after one warm-up call per slot set (first touch)."""
    import torch

    import tilelang_dev as td
    for point in points or ["256:all"]:
        batch, due = point.split(":")
        cfg, nsets, call = td._timing_pool(int(batch), gate, due)
        kern = build(mod, cfg, mode)
        for s in range(nsets):
            call(kern, s)
        torch.cuda.synchronize()
        yield batch, due, cfg, nsets, call, kern


def _stamped_calls(mod, ck, mode: str, points: list[str], gate: str, words_per_cta: int, calls: int):
    """Per point: (batch, due, grid, stamps of each call), the stamps an int64 tensor [grid, words_per_cta / 2] read
    from the pool's header after the call (zeroed before it)."""
    import torch

    for batch, due, cfg, nsets, call, kern in _warm_points(mod, mode, points, gate):
        grid = cfg.num_sms
        assert grid <= ck.MAX_STAMPED_CTAS, f"{grid} CTAs' stamps do not fit the pool's header"
        words = call.pool.raw[ck.CTA_WORD:ck.CTA_WORD + words_per_cta * grid]

        def each_call():
            for c in range(calls):
                words.zero_()
                call(kern, c % nsets)
                torch.cuda.synchronize()
                yield words.view(torch.int64).view(grid, words_per_cta // 2).cpu()
        yield batch, due, grid, each_call()


def run_phases(mod, ck, points: list[str], gate: str) -> None:
    import torch

    for batch, due, cfg, nsets, call, kern in _warm_points(mod, "phases", points, gate):
        names = mod.clock_segments(mod.FlushConfig(cfg.num_heads, cfg.gate, cfg.arch, cfg.num_sms, clock="phases"))
        pool = call.pool                        # after the warm-up: one counted call per slot set
        counters = pool.raw.view(torch.int32)[: 2 * (len(names) + 1)]
        counters.zero_()
        for s in range(nsets):
            call(kern, s)
        torch.cuda.synchronize()
        c = counters.cpu().double().tolist()
        progs = c[0:2]
        print(f"\nbatch {batch} due {due} ({gate}): programs per group {progs}")
        print("| step | cycles/program, group 0 | group 1 |\n| --- | --- | --- |")
        tot = [0.0, 0.0]
        for k, n in enumerate(names, 1):
            v = [c[2 * k + i] / max(progs[i], 1) for i in range(2)]
            tot = [tot[i] + v[i] for i in range(2)]
            print(f"| {n} | {v[0]:.0f} | {v[1]:.0f} |")
        print(f"| total | {tot[0]:.0f} | {tot[1]:.0f} |")


def run_ctas(mod, ck, points: list[str], gate: str, calls: int = 6) -> None:
    import torch

    for batch, due, grid, stamps in _stamped_calls(mod, ck, "ctas", points, gate, ck.CTA_WORDS, calls):
        print(f"\nbatch {batch} due {due} ({gate}), {grid} CTAs, us (globaltimer) and kcycles (clock64):")
        for c, flat in enumerate(stamps):
            d = flat.view(grid, 4, 3)
            t0 = d[:, 0, 0].min()
            dur = (d[:, 3, 0] - d[:, 0, 0]).double() / 1e3
            loops = torch.stack([d[:, 1, 1] - d[:, 0, 1], d[:, 2, 1] - d[:, 0, 1]], 1).double() / 1e3
            print(f"call {c}: span {(d[:, 3, 0].max() - t0).item() / 1e3:.1f} us, start skew "
                  f"{(d[:, 0, 0].max() - t0).item() / 1e3:.2f} us, CTA duration mean / max / min "
                  f"{dur.mean():.1f} / {dur.max():.1f} / {dur.min():.1f} us, group loop mean / max / min "
                  f"{loops.mean():.1f} / {loops.max():.1f} / {loops.min():.1f} kcycles")
        order = dur.argsort()
        print("slowest CTAs (block, SM, us):", [(int(b), int(d[b, 0, 2]), round(dur[b].item(), 1)) for b in order[-6:]])
        print("fastest CTAs (block, SM, us):", [(int(b), int(d[b, 0, 2]), round(dur[b].item(), 1)) for b in order[:6]])


def run_prologue(mod, ck, points: list[str], gate: str, calls: int = 6) -> None:
    import torch

    for batch, due, grid, stamps in _stamped_calls(mod, ck, "prologue", points, gate, ck.PRO_WORDS, calls):
        rows = []
        for flat in stamps:
            d = flat.double()
            rel = (d - d[:, :1]) / 1e3
            rel[d == 0] = float("nan")          # a milestone this CTA never passed
            for g in range(2):
                grp = rel[:, 2 + 7 * g: 9 + 7 * g]
                two = d[:, 2 + 7 * g + 4] > 0          # the group started a second program
                rows.append(torch.cat([rel[two, 16:20], rel[two, 1:2], grp[two]], 1))
        m = torch.cat(rows).nanmean(0).tolist()
        print(f"\nbatch {batch} due {due} ({gate}): kcycles after the CTA's start (mean over groups with >= 2 "
              f"programs, {calls} calls)")
        print("| milestone | kcycles |\n| --- | --- |")
        for name, v in zip(ck.PRO_RANKING + ("ranked",) + ck.PRO_GROUP, m):
            print(f"| {name} | {v:.2f} |")


def precompile(mod, args) -> None:
    for mode in args.modes:
        for gate in args.gates:
            cfg = mod.FlushConfig(32, gate, args.arch, args.sms, clock=mode)
            t0 = time.time()
            mod.compile_flush(cfg)
            print(f"built clock={mode} gate={gate} arch={args.arch} sms={args.sms}: {time.time() - t0:.1f} s",
                  flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=("precompile",) + MODES)
    ap.add_argument("points", nargs="*", help="batch:due points (default 256:all)")
    ap.add_argument("--gate", default="kda", help="gate of the timed pool")
    ap.add_argument("--kernel", default=None, help="generator of another version (a copy of leapquant/tilelang/)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="precompile: the builds")
    ap.add_argument("--gates", nargs="+", default=["kda"], help="precompile: the gates")
    ap.add_argument("--arch", default="sm_90a", help="precompile: the target")
    ap.add_argument("--sms", type=int, default=132, help="precompile: the grid (SM count of the GPU)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    mod = generator(args.kernel)
    if args.command == "precompile":
        precompile(mod, args)
        return 0
    run = {"phases": run_phases, "ctas": run_ctas, "prologue": run_prologue}[args.command]
    run(mod, clock_module(args.kernel), args.points, args.gate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
