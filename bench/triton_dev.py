"""Development timing of the Triton flush on a GPU (L2-cold, CUDA graphs, CUDA events) with a correctness check by
the SPEC criterion in the same run.

    PYTHONPATH=. python bench/triton_dev.py [--batch 16 64 256 512] [--variants w8:a0 w8:a1] [--gate kda] [--out DIR]
    python bench/triton_dev.py --render bench/results/FILE.json       # the markdown table of an earlier run

Method (SPEC section 5): for each batch B a pool of 8 B + 1 slots holds eight disjoint slot sets; one CUDA graph per
set holds one deployment call; the graphs are replayed in rotation, so no call finds its data in L2. Launches are
queued behind a sleep kernel so the host never starves the GPU; CUDA events around each replay give the call's GPU
time (both kernels and the gap between them). Due fractions: all (hcnt = L everywhere), sixteenth (B/16 whole rows
due, as at steady state where all heads of a sequence fill together), none. The memory bound is due programs x
layout.due_program_bytes() over the device-to-device copy bandwidth measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

import leapquant as lq
from leapquant import criterion, families
from leapquant.layout import L, Pool, due_program_bytes

import leapquant.triton  # noqa: F401  (registers the backend)
fm = sys.modules["leapquant.triton.flush"]
SHIPPED = fm._flush_due
SHIPPED_KNOBS = (fm.FLUSH_WARPS, fm.ALIGN_HINTS, fm.MAX_REGISTERS)


def kernel_from_file(path: str):
    """``_flush_due`` of another version of leapquant/triton/flush.py (e.g. ``git show REV:leapquant/triton/flush.py
    > FILE``); it must take the shipped launcher's arguments (A/B of kernel versions in one run, through the same
    launcher and timing)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tilelang_dev import load_kernel_module
    return load_kernel_module(path, "leapquant.triton")._flush_due


SETS = 8                  #: disjoint slot sets flushed in rotation (L2-cold)
SLEEP_CYCLES = 20_000_000  #: ~10 ms at 2 GHz: the queue fills behind it


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second: the benchmark CLI's measurement."""
    from leapquant.bench import copy_bandwidth as measure
    return measure(torch.device("cuda"))[0]


def fill(pool: Pool, g: torch.Generator) -> None:
    """Valid random checkpoints and windows (never zeros: they can hide unwritten outputs and run faster)."""
    dev = pool.device
    pool.codes.copy_(torch.randint(-127, 128, pool.codes.shape, dtype=torch.int8, device=dev))
    pool.s_k.uniform_(1e-3, 1.0)
    pool.s_v.uniform_(1e-3, 1.0)
    pool.tokens.copy_(0.1 * torch.randn(pool.tokens.shape, device=dev))
    pool.kbuf.copy_(torch.randn(pool.kbuf.shape, device=dev))
    pool.ubuf.copy_(torch.randn(pool.ubuf.shape, device=dev))
    pool.w.uniform_(0.0, 1.0)
    if pool.gate == "kda":
        pool.pcum.uniform_(-5.0, 0.0)
        pool.gbuf.copy_(torch.rand(pool.gbuf.shape, device=dev).clamp_min(1e-3))
    else:
        pool.p.uniform_(0.1, 1.0)


def set_due(pool: Pool, B: int, mode: str, g: torch.Generator) -> int:
    """hcnt for every slot set; returns due programs per call."""
    H = pool.num_heads
    if mode == "all":
        pool.hcnt.fill_(L)
        return B * H
    pool.hcnt.fill_(L - 1)
    if mode == "none":
        return 0
    rows = max(1, B // 16)
    for s in range(SETS):
        pick = torch.randperm(B, generator=g)[:rows] + 1 + s * B
        pool.hcnt[pick.to(pool.device)] = L
    return rows * H


def time_point(pool: Pool, B: int, q0: torch.Tensor, reps: int) -> list[float]:
    """Median-able list of per-call GPU times (us) over `reps` rotations of the SETS graphs."""
    stream = torch.cuda.Stream()
    graphs = []
    idxs = [torch.arange(1 + s * B, 1 + (s + 1) * B, dtype=torch.int32, device="cuda")[torch.randperm(B).cuda()]
            for s in range(SETS)]
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for s in range(SETS):
            lq.flush_inplace(pool, idxs[s], q0, backend="triton")   # warm (compiled already by warmup)
        torch.cuda.synchronize()
        for s in range(SETS):
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr, stream=stream):
                lq.flush_inplace(pool, idxs[s], q0, backend="triton")
            graphs.append(gr)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    out = []
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(SETS)]
    for _ in range(reps):
        torch.cuda._sleep(SLEEP_CYCLES)
        for s in range(SETS):
            ev[s][0].record()
            graphs[s].replay()
            ev[s][1].record()
        torch.cuda.synchronize()
        out += [a.elapsed_time(b) * 1e3 for a, b in ev]
    return out


def check(batch: int, gate: str, seed: int) -> criterion.Verdict:
    case = families.make_case(batch, 32, gate, seed=seed).to("cuda")
    out = case.run(backend="triton")
    S = criterion.exact_state(*case.checkpoint(), case.tensors["kbuf"], case.tensors["ubuf"], case.tensors["w"],
                              **case.gate_kwargs())
    return criterion.judge(S, out, case.reference(), labels=case.labels, name=f"triton {gate} b{batch}")


def render(path: str) -> str:
    """The markdown table of a triton_dev.json written by an earlier run (results files are generated, not typed)."""
    with open(path) as f:
        d = json.load(f)
    env = d["env"]
    out = [f"{env['gpu']} ({env['sms']} SMs), copy {env['copy_bw_tbs']:.2f} TB/s, torch {env['torch']}, "
           f"triton {env['triton']}, commit {env['commit']}, {env['date']}", "",
           "| gate | variant | batch | due | due programs | median us | p20 | p80 | bound us | x bound | regs | "
           "spills | grid |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        variant = r.get("variant", f"w{r.get('warps')}")
        ratio = f"{r['ratio']:.2f}" if r["ratio"] else "-"
        out.append(f"| {r['gate']} | {variant} | {r['batch']} | {r['due']} | {r['due_programs']} | "
                   f"{r['median_us']:.1f} | {r['p20_us']:.1f} | {r['p80_us']:.1f} | {r['bound_us']:.1f} | {ratio} | "
                   f"{r['regs']} | {r['spills']} | {r['grid']} |")
    for v in d.get("verdicts", []):
        out.append(f"\n- criterion {v['gate']} batch {v['batch']}: {v['message']}")
    return "\n".join(out)


def main() -> None:
    # the variants below are knobs of the tl kernel (leapquant/triton/flush.py); the Gluon kernel is timed by the
    # benchmark CLI (python -m leapquant bench --backends triton)
    os.environ[fm.KERNEL_ENV] = "tl"
    if len(sys.argv) == 3 and sys.argv[1] == "--render":
        print(render(sys.argv[2]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", nargs="+", type=int, default=[16, 64, 256, 512])
    ap.add_argument("--variants", nargs="+", default=[f"w{fm.FLUSH_WARPS}:a{int(fm.ALIGN_HINTS)}"],
                    help="kernel variants warps:align-hints[:register cap][@kernel file], e.g. w8:a0 w8:a1 w16:a0 "
                         "w8:a0:r128 w8:a1@old_flush.py; "
                         "the first at every batch")
    ap.add_argument("--variant-batch", nargs="+", type=int, default=[256], help="batches of the other variants")
    ap.add_argument("--gate", nargs="+", default=["kda"])
    ap.add_argument("--due", nargs="+", default=["all", "sixteenth", "none"])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--check", nargs="*", type=int, default=[64, 256], help="batches judged by the criterion")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    # the device machine gets the working tree without .git: pass the hash in LEAPQUANT_COMMIT there
    commit = os.environ.get("LEAPQUANT_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    props = torch.cuda.get_device_properties(0)
    bw = copy_bandwidth()
    env = dict(gpu=props.name, sms=props.multi_processor_count, torch=torch.__version__,
               triton=__import__("triton").__version__, commit=commit or "unknown", copy_bw_tbs=bw / 1e12,
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    print(json.dumps(env), flush=True)
    rows = []
    for gate in a.gate:
        for vi, variant in enumerate(a.variants):
            knobs, _, path = variant.partition("@")
            fm._flush_due = kernel_from_file(path) if path else SHIPPED
            w_, a_, *r_ = knobs.split(":")
            fm.FLUSH_WARPS = int(w_[1:])
            fm.ALIGN_HINTS = a_ == "a1"
            fm.MAX_REGISTERS = int(r_[0][1:]) if r_ else 0
            fm._WORKSPACES.clear()
            for B in (a.batch if vi == 0 else a.variant_batch):
                pool = Pool(SETS * B + 1, 32, device="cuda", gate=gate)
                g = torch.Generator().manual_seed(B)
                fill(pool, g)
                q0 = lq.default_q0("cuda")
                lq.warmup(pool, backend="triton")
                ws = fm._WORKSPACES[pool]
                idx1 = torch.zeros(1, dtype=torch.int32, device="cuda")
                kern = fm._flush_due.warmup(*fm._flush_args(pool, ws, q0, idx1), grid=(ws.programs,),
                                            **fm._flush_meta(pool, ws.kernel, ws.programs))
                info = dict(regs=kern.n_regs, spills=kern.n_spills, smem=kern.metadata.shared, grid=ws.programs)
                for mode in a.due:
                    due = set_due(pool, B, mode, g)
                    t = time_point(pool, B, q0, a.reps)
                    med = statistics.median(t)
                    q = statistics.quantiles(t, n=5)
                    bound = due * due_program_bytes(gate) / bw * 1e6
                    row = dict(gate=gate, variant=variant, batch=B, due=mode, due_programs=due, median_us=med,
                               p20_us=q[0], p80_us=q[-1], bound_us=bound, ratio=med / bound if bound else None,
                               **info)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                del pool
                fm._WORKSPACES.clear()
                torch.cuda.empty_cache()
    fm._flush_due = SHIPPED                              # the checks: the shipped kernel and knobs
    fm.FLUSH_WARPS, fm.ALIGN_HINTS, fm.MAX_REGISTERS = SHIPPED_KNOBS
    fm._WORKSPACES.clear()
    verdicts = []
    for gate in a.gate:
        for B in a.check:
            v = check(B, gate, seed=B)
            verdicts.append(dict(gate=gate, batch=B, passed=v.passed, worst_score=v.worst_score, message=v.message))
            print(v.message, flush=True)
    with open(os.path.join(a.out, "triton_dev.json"), "w") as f:
        json.dump(dict(env=env, rows=rows, verdicts=verdicts), f, indent=1)
    print(f"\n{env['gpu']}  copy {bw / 1e12:.2f} TB/s  torch {env['torch']}  triton {env['triton']}  {commit}")
    print("| gate | variant | batch | due | programs | median us | p20 | p80 | bound us | ratio | regs | spills | grid |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] else "-"
        print(f"| {r['gate']} | {r['variant']} | {r['batch']} | {r['due']} | {r['due_programs']} | {r['median_us']:.1f} "
              f"| {r['p20_us']:.1f} | {r['p80_us']:.1f} | {r['bound_us']:.1f} | {ratio} | {r['regs']} | {r['spills']} "
              f"| {r['grid']} |")
    for v in verdicts:
        print(f"criterion {v['gate']} b{v['batch']}: {'PASS' if v['passed'] else 'FAIL'} worst {v['worst_score']:.4f}")


if __name__ == "__main__":
    main()
