"""Development timing of the Triton backend's kernels on a GPU (L2-cold, CUDA graphs, CUDA events) with a correctness
check by the criterion of docs/spec.md section 3 in the same run.

    PYTHONPATH=. python bench/dev/triton_dev.py [--batch 16 64 256 512] [--variants mma tl tl:w16 tl:r128]
        [--gate kda] [--out DIR]
    python bench/dev/triton_dev.py --render FILE.json       # the markdown table of an earlier run

A variant is ``KERNEL[:wWARPS][:rREGS][@FILE]``: KERNEL ``mma`` (the Gluon kernel) or ``tl``; ``:w`` the warps of a tl
program (the Gluon kernel's layouts are written for its own WARPS), ``:r`` a register cap (ptxas maxnreg), ``@FILE``
the kernel of another version of its module (e.g. ``git show REV:leapquant/triton/tl_kernel.py > FILE``; it must take
the current launcher's arguments). Each variant is compiled and launched here, with the launcher's arguments, grid
rule and compile-time constants (leapquant.triton.launch) and the options above; nothing of the package is patched.

Method (docs/spec.md section 5): for each batch B a pool of 8 B + 1 slots holds eight disjoint slot sets; one CUDA
graph per set holds one call; the graphs are replayed in rotation, so no call finds its data in L2. Launches are
queued behind a sleep kernel so the host never starves the GPU; CUDA events around each replay give the call's GPU
time. Due fractions: all (hcnt = L everywhere), sixteenth (B/16 whole rows due, as at steady state where all heads of a
sequence fill together), none. The memory bound is due programs x layout.due_program_bytes() over the device-to-device
copy bandwidth measured in the same run. The criterion checks run the shipped backend with each variant's kernel
chosen through LEAPQUANT_TRITON_KERNEL.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

import torch

import leapquant as lq
from leapquant import criterion, families
from leapquant.layout import L, QMAX, Pool, due_program_bytes
from leapquant.triton import launch


def kernel_from_file(path: str, kernel: str):
    """The kernel ``kernel`` ("tl": ``_flush_due``, "mma": ``flush_due``) of a module file, imported inside
    leapquant.triton so that its relative imports resolve."""
    name = "leapquant.triton._dev_" + os.path.basename(path).replace(".", "_").replace("-", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod.flush_due if kernel == "mma" else mod._flush_due


def parse_variant(variant: str) -> tuple[str, int, int, str]:
    """``KERNEL[:wWARPS][:rREGS][@FILE]`` -> (kernel, warps or 0, register cap or 0, file or "")."""
    spec, _, path = variant.partition("@")
    kernel, *opts = spec.split(":")
    if kernel not in launch.KERNELS:
        raise SystemExit(f"variant {variant!r}: the kernel is one of {launch.KERNELS}")
    warps = regs = 0
    for opt in opts:
        if opt[:1] == "w" and opt[1:].isdigit() and kernel == "tl":
            warps = int(opt[1:])
        elif opt[:1] == "r" and opt[1:].isdigit():
            regs = int(opt[1:])
        else:
            raise SystemExit(f"variant {variant!r}: unknown option {opt!r} (tl: wN, rN; mma: rN)")
    return kernel, warps, regs, path


def build(pool: Pool, variant: str, q0: torch.Tensor):
    """Compile ``variant`` for ``pool``: returns (call(idx), info) where call launches the variant's kernel with the
    launcher's arguments on its persistent grid (no host synchronisation: capturable once compiled)."""
    kernel, warps, regs, path = parse_variant(variant)
    fn = kernel_from_file(path, kernel) if path else launch.kernel_fn(kernel)
    buffers = launch.pool_buffers(pool)
    raw_u8, raw_f16 = pool.raw.view(torch.uint8), pool.raw.view(torch.float16)
    due = torch.zeros(pool.num_slots * pool.num_heads, dtype=torch.int32, device=pool.device)

    def args(idx):
        return launch.flush_args(pool, buffers, raw_u8, raw_f16, due, q0, idx)

    meta = launch.flush_meta(pool, kernel, 1)
    if warps:
        meta["num_warps"] = warps
    if regs:
        meta["maxnreg"] = regs
    idx1 = torch.zeros(1, dtype=torch.int32, device=pool.device)
    meta["G"] = launch.resident_programs(pool, fn, args(idx1), meta)
    grid = (meta["G"],)
    kern = fn.warmup(*args(idx1), grid=grid, **meta)
    info = dict(regs=None, spills=None, smem=None, grid=meta["G"])
    if kern is not None:                         # (None under TRITON_INTERPRET=1: a CPU smoke test of this path)
        kern._init_handles()
        info.update(regs=kern.n_regs, spills=kern.n_spills, smem=kern.metadata.shared)

    def call(idx):
        fn[grid](*args(idx), **meta)
    call(idx1)                                   # compiled and loaded outside any capture
    return call, info


SETS = 8                  #: disjoint slot sets flushed in rotation (L2-cold)
SLEEP_CYCLES = 20_000_000  #: ~10 ms at 2 GHz: the queue fills behind it


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second: the benchmark CLI's measurement."""
    from leapquant.bench_common import copy_bandwidth as measure
    return measure(torch.device("cuda"))[0]


def fill(pool: Pool, g: torch.Generator) -> None:
    """Valid random checkpoints and windows (never zeros: they can hide unwritten outputs and run faster)."""
    dev = pool.device
    pool.codes.copy_(torch.randint(-int(QMAX), int(QMAX) + 1, pool.codes.shape, dtype=torch.int8, device=dev))
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


def time_point(call, B: int, reps: int) -> list[float]:
    """Median-able list of per-call GPU times (us) of ``call(idx)`` over `reps` rotations of the SETS graphs."""
    stream = torch.cuda.Stream()
    graphs = []
    idxs = [torch.arange(1 + s * B, 1 + (s + 1) * B, dtype=torch.int32, device="cuda")[torch.randperm(B).cuda()]
            for s in range(SETS)]
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for s in range(SETS):
            call(idxs[s])                                           # warm (compiled already by build)
        torch.cuda.synchronize()
        for s in range(SETS):
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr, stream=stream):
                call(idxs[s])
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


def check(batch: int, gate: str, seed: int, kernel: str) -> criterion.Verdict:
    """Every family at ``batch`` x 32 heads through the shipped backend, ``kernel`` chosen by its environment switch
    (read when the case's pool is bound), judged by the criterion."""
    os.environ[launch.KERNEL_ENV] = kernel
    case = families.make_case(batch, 32, gate, seed=seed).to("cuda")
    out = case.run(backend="triton")
    S = criterion.exact_state(*case.checkpoint(), case.tensors["kbuf"], case.tensors["ubuf"], case.tensors["w"],
                              **case.gate_kwargs())
    return criterion.judge(S, out, case.reference(), labels=case.labels, name=f"triton {kernel} {gate} b{batch}")


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
        out.append(f"\n- criterion {v.get('kernel', 'tl')} {v['gate']} batch {v['batch']}: {v['message']}")
    return "\n".join(out)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--render":
        print(render(sys.argv[2]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", nargs="+", type=int, default=[16, 64, 256, 512])
    ap.add_argument("--variants", nargs="+", default=["tl"],
                    help="KERNEL[:wWARPS][:rREGS][@FILE], e.g. mma tl tl:w16 tl:r128 tl@old_tl_kernel.py; "
                         "the first at every batch")
    ap.add_argument("--variant-batch", nargs="+", type=int, default=[256], help="batches of the other variants")
    ap.add_argument("--gate", nargs="+", default=["kda"])
    ap.add_argument("--due", nargs="+", default=["all", "sixteenth", "none"])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--check", nargs="*", type=int, default=[64, 256], help="batches judged by the criterion")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    for variant in a.variants:
        parse_variant(variant)                   # (a bad variant fails before any GPU work)
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
            for B in (a.batch if vi == 0 else a.variant_batch):
                pool = Pool(SETS * B + 1, 32, device="cuda", gate=gate)
                g = torch.Generator().manual_seed(B)
                fill(pool, g)
                q0 = lq.default_q0("cuda")
                call, info = build(pool, variant, q0)
                for mode in a.due:
                    due = set_due(pool, B, mode, g)
                    t = time_point(call, B, a.reps)
                    med = statistics.median(t)
                    q = statistics.quantiles(t, n=5)
                    bound = due * due_program_bytes(gate) / bw * 1e6
                    row = dict(gate=gate, variant=variant, batch=B, due=mode, due_programs=due, median_us=med,
                               p20_us=q[0], p80_us=q[-1], bound_us=bound, ratio=med / bound if bound else None,
                               **info)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                del pool, call
                torch.cuda.empty_cache()
    verdicts = []
    for kernel in sorted({parse_variant(v)[0] for v in a.variants}):
        for gate in a.gate:
            for B in a.check:
                v = check(B, gate, seed=B, kernel=kernel)
                verdicts.append(dict(gate=gate, batch=B, kernel=kernel, passed=v.passed, worst_score=v.worst_score,
                                     message=v.message))
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
        print(f"criterion {v['kernel']} {v['gate']} b{v['batch']}: {'PASS' if v['passed'] else 'FAIL'} "
              f"worst {v['worst_score']:.4f}")


if __name__ == "__main__":
    main()
