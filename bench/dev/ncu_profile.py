"""One flush call inside a CUDA profiler range, for Nsight Compute (hardware counters, warp-stall sampling).

    ncu --clock-control none --profile-from-start off --set full --import-source yes -o REPORT -f \\
        python3 bench/dev/ncu_profile.py --backend tilelang --batch 256 --due all
    python3 bench/dev/ncu_profile.py --summarize REPORT.ncu-rep    # stall reasons, issue rate, pipes (text)
    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > SASS.csv
    python3 bench/dev/ncu_profile.py --segments SASS.csv           # per segment between barriers: samples, opcodes

The call is the benchmark's (tilelang_dev.py's timing pool: 8 disjoint slot sets of ``batch`` rows x 32
heads, in-domain noise); two calls on other slot sets come first (compilation, module load, a warm TLB), so the
profiled call is L2-cold for its own slots like every timed call. ncu replays the kernel with its memory restored.
"""
from __future__ import annotations

import argparse
import csv
import io
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def launch(args) -> None:
    import torch

    from tilelang_dev import _timing_pool
    from leapquant import flush_inplace
    from leapquant.reference import default_q0
    cfg, _, call = _timing_pool(args.batch, args.gate, args.due)
    pool, sets = call.pool, call.sets
    q0 = default_q0(pool.raw.device)
    if args.backend == "tilelang":
        from leapquant.tilelang.kernel import compile_flush
        kern = compile_flush(cfg)

        def one(s):
            call(kern, s)
    else:
        def one(s):
            flush_inplace(pool, sets[s], q0, backend=args.backend)
    one(0)
    one(1)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    one(2)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


#: raw metrics printed by --summarize (name: what it says)
SUMMARY_METRICS = {
    "gpu__time_duration.sum": "kernel time",
    "sm__cycles_elapsed.avg": "SM cycles elapsed",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue slots busy (% of active cycles)",
    "smsp__inst_executed.sum": "warp instructions executed",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved occupancy (%)",
    "smsp__warps_eligible.avg.per_cycle_active": "eligible warps per scheduler per cycle",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "DRAM throughput (% of peak)",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum": "shared-memory wavefronts",
}


def _ncu_csv(report: str, *extra: str) -> list[list[str]]:
    out = subprocess.run(["ncu", "-i", report, "--csv", *extra], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return list(csv.reader(io.StringIO(out.stdout)))


def summarize(report: str) -> None:
    rows = _ncu_csv(report, "--page", "raw")
    head, units = rows[0], rows[1]
    unit = dict(zip(head, units))
    for row in rows[2:]:
        rec = dict(zip(head, row))
        print(f"== kernel {rec.get('Kernel Name', '?')[:60]} ({rec.get('Grid Size', '')} x {rec.get('Block Size', '')})")
        for name, what in SUMMARY_METRICS.items():
            if name in rec:
                print(f"  {what:45s} {rec[name]:>14s} {unit.get(name, ''):6s} [{name}]")
        # warp-state sampling: stall reasons, share of all samples
        stalls = {k: float(v.replace(",", "")) for k, v in rec.items()
                  if k.startswith("smsp__pcsamp_warps_issue_stalled_") and not k.endswith("_not_issued")
                  and v.replace(",", "").replace(".", "").isdigit()}
        tot = sum(stalls.values()) or 1.0
        print("  warp-state samples (all samples, issued or not), share:")
        for k, v in sorted(stalls.items(), key=lambda kv: -kv[1])[:14]:
            print(f"    {k[len('smsp__pcsamp_warps_issue_stalled_'):]:28s} {100 * v / tot:5.1f} %")
        pipes = {k: v for k, v in rec.items()
                 if k.startswith("sm__inst_executed_pipe_") and k.endswith(".avg.pct_of_peak_sustained_active")}
        busy = sorted(((float(v.replace(",", "")), k) for k, v in pipes.items() if v), reverse=True)[:8]
        print("  pipes (% of peak, active cycles): " + ", ".join(
            f"{k[len('sm__inst_executed_pipe_'):-len('.avg.pct_of_peak_sustained_active')]} {v:.1f}" for v, k in busy))


def _opcode(sass: str) -> str:
    """The opcode of a SASS line without its predicate and modifiers (``@!P0 FFMA.FTZ R1, ...`` -> ``FFMA``)."""
    parts = sass.split()
    if parts and parts[0].startswith("@"):
        parts = parts[1:]
    return parts[0].split(".")[0] if parts else ""


def segments(sass_csv: str, min_share: float = 0.004) -> None:
    """Per-segment table of a SASS page (``ncu -i REPORT --page source --csv --print-source sass > FILE``): the
    kernel's instructions cut after every barrier (BAR.*) in program order; per segment its share of warp samples and
    of executed instructions, its top opcodes and its top stall reasons. Segments under ``min_share`` of the samples
    are left out."""
    import collections
    rows = list(csv.reader(open(sass_csv)))
    head = rows[1] if rows and "Source" not in rows[0] else rows[0]
    col = {h: i for i, h in enumerate(head)}
    stall_cols = [h for h in head if h.startswith("stall_") and "Not Issued" not in h]

    def num(v: str) -> float:
        try:
            return float(v.replace(",", ""))
        except ValueError:
            return 0.0

    ins = [dict(src=r[col["Source"]].strip(), samples=num(r[col["Warp Stall Sampling (All Samples)"]]),
                exe=num(r[col["Instructions Executed"]]), stalls={h: num(r[col[h]]) for h in stall_cols})
           for r in rows[rows.index(head) + 1:] if len(r) >= len(head)]
    tot = sum(i["samples"] for i in ins) or 1.0
    totexe = sum(i["exe"] for i in ins) or 1.0
    print(f"instructions {len(ins)} samples {tot:.0f} warp-inst executed {totexe:.0f}")
    segs, cur = [], []
    for n, i in enumerate(ins):
        cur.append((n, i))
        if _opcode(i["src"]) == "BAR":
            segs.append(cur)
            cur = []
    segs.append(cur)
    for k, seg in enumerate(segs):
        smp = sum(i["samples"] for _, i in seg)
        if not seg or smp < min_share * tot:
            continue
        exe = sum(i["exe"] for _, i in seg) or 1.0
        ops, st = collections.Counter(), collections.Counter()
        for _, i in seg:
            ops[_opcode(i["src"])] += i["exe"]
            for h, v in i["stalls"].items():
                st[h[len("stall_"):]] += v
        print(f"seg {k:3d} [{seg[0][0]:5d}-{seg[-1][0]:5d}] samples {100 * smp / tot:5.1f}% exe {100 * exe / totexe:5.1f}%"
              "  ops: " + " ".join(f"{o}:{100 * v / exe:.0f}" for o, v in ops.most_common(6)) +
              " | stalls: " + " ".join(f"{h}:{100 * v / max(smp, 1):.0f}" for h, v in st.most_common(5)) +
              f" | ends {seg[-1][1]['src'][:40]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="tilelang", choices=["tilelang", "triton"])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--gate", default="kda")
    ap.add_argument("--due", default="all")
    ap.add_argument("--summarize", metavar="REPORT", default=None)
    ap.add_argument("--segments", metavar="SASS_CSV", default=None,
                    help="per-segment table of `ncu -i REPORT --page source --csv --print-source sass` output")
    args = ap.parse_args()
    if args.summarize:
        summarize(args.summarize)
    elif args.segments:
        segments(args.segments)
    else:
        launch(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
