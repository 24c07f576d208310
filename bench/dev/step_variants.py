"""Times the Triton step kernels' variants on one GPU, L2-cold, CUDA kernel time
(leapquant.bench_common.time_calls_kernel), KDA and GDN, window at fill 1 and 15, every program stepping: the Gluon
kernel (also under register caps, --maxnreg), another version of it from a file (--gluon-file, e.g. `git show
<commit>:leapquant/triton/gluon_step_kernel.py`: an A/B on one machine; a kernel that takes ``num_rows`` is launched
as a persistent grid of the programs resident at once) and the portable kernel. Prints one markdown table.
Dev tool: python bench/dev/step_variants.py --batch 256 [--maxnreg 80 72] [--gluon-file old.py ...] [--no-tl]."""
from __future__ import annotations

import argparse
import importlib.util
import sys

import torch

from leapquant.bench_common import _percentile, slot_sets, time_calls_kernel
from leapquant.bench_step import make_tokens, num_k_heads_for, tile_case
from leapquant.layout import Pool, slot_stride, step_program_bytes
from leapquant.step_families import make_step_case
from leapquant.triton import step_kernel
from leapquant.triton.launch import pool_buffers, programs_per_sm


#: (kernel, options) -> the programs of a persistent kernel resident at once
RESIDENT: dict = {}


def launch(kernel, warps, bv, pool, idx, tk, hk):
    """One launch of ``kernel``: a persistent grid (the programs resident at once) when it takes ``num_rows``, else
    one program per (row, head)."""
    pb = pool_buffers(pool)
    qkv, a, b, out = tk
    head = (pb.raw, pb.raw.view(torch.uint8), pb.raw.view(torch.float16), pb.kbuf, pb.ubuf, pb.w, pb.gate_state,
            pb.gbuf, pb.hcnt, idx, qkv, a, b, A_LOG, DT, out)
    tail = (pool.num_slots, slot_stride(pool.num_heads), qkv.stride(0), a.stride(0), b.stride(0))
    meta = dict(H=pool.num_heads, HK=hk, IS_KDA=pool.gate == "kda", BETA_BF16=True, num_warps=warps, num_stages=1,
                **bv)
    items = idx.numel() * pool.num_heads
    if "num_rows" in kernel.arg_names:
        args = head + (idx.numel(),) + tail
        key = (kernel, tuple(sorted(meta.items())))
        if key not in RESIDENT:
            sms = torch.cuda.get_device_properties(pool.device).multi_processor_count
            RESIDENT[key] = programs_per_sm(pool.device, kernel, args, meta) * sms
        kernel[(min(items, RESIDENT[key]),)](*args, **meta)
    else:
        kernel[(items,)](*head, *tail, **meta)


def load_gluon_file(path: str):
    """The Gluon step kernel module from a file of the package's form (e.g. another commit's
    ``leapquant/triton/gluon_step_kernel.py``), loaded as a module of ``leapquant.triton`` so that its relative
    imports resolve as they do in the package; Gluon compiles from the file itself."""
    name = f"leapquant.triton._step_variant_{len(_VARIANTS)}"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    _VARIANTS.append(mod)
    return mod


#: the variant modules loaded so far (each under a name of its own)
_VARIANTS: list = []


def timing_points(gates, batches, dev, nsets: int = 8):
    """For each gate and batch, ``(gate, hk, pool, batch, sets, idx, tokens)``: one pool per gate holding ``nsets``
    disjoint slot sets of ``batch`` rows x 32 heads (the step families' 16 rows, seed 0, tiled to the batch), each
    set's slots (long) and idx (int32), and one token per set (``make_tokens``). What the step and decode A/B tools
    time on; the pool is released after its gate's last batch."""
    for gate in gates:
        hk = num_k_heads_for(gate, 32)
        base = make_step_case(16, 32, gate, 0, "cpu", num_k_heads=hk)
        pool = Pool(nsets * max(batches) + 9, 32, device=dev, gate=gate)
        for batch in batches:
            sets = slot_sets(nsets, batch, 0, dev)
            case = tile_case(base, batch)
            for s in sets:
                case.load_into(pool, s)
            yield gate, hk, pool, batch, sets, [s.to(torch.int32) for s in sets], make_tokens(case, nsets, dev)
        pool = None  # noqa: F841
        torch.cuda.empty_cache()


def main() -> None:
    global A_LOG, DT
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", nargs="+", type=int, default=[64, 256, 512])
    ap.add_argument("--repeats", type=int, default=64)
    ap.add_argument("--bandwidth", type=float, default=4270.0, help="GB/s for the bound column")
    ap.add_argument("--maxnreg", nargs="*", type=int, default=[],
                    help="also time every Gluon kernel under these register caps")
    ap.add_argument("--gluon-file", nargs="*", default=[],
                    help="also time the Gluon step kernels of these files (other versions)")
    ap.add_argument("--no-tl", action="store_true", help="leave the portable kernel out")
    ap.add_argument("--fill", nargs="+", type=int, default=[1, 15], help="window fill counts to time")
    args = ap.parse_args()
    dev = torch.device("cuda")
    from leapquant.triton import gluon_step_kernel
    modules = [("gluon", gluon_step_kernel)] + [(f"gluon {f}", load_gluon_file(f)) for f in args.gluon_file]
    # each module first as it launches (its own register cap), then under the caps asked for (0: none)
    variants = [(name, m.step_kernel, m.WARPS, cfg) for name, m in modules
                for cfg in [{"own": True}] + [{"maxnreg": n or None} for n in args.maxnreg]]
    if not args.no_tl:
        variants += [("tl", step_kernel.step_kernel, w, {"BV": bv}) for w, bv in ((4, 32),)]
    bw = float(args.bandwidth) * 1e9
    print("| gate | batch | fill | kernel | warps | config | median us | x bound |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for gate, hk, pool, batch, sets, idx, tk in timing_points(("kda", "gdn"), args.batch, dev):
        A_LOG, DT = tk.A_log, tk.dt_bias
        bound = batch * 32 * step_program_bytes(gate) / bw * 1e6
        for fill in args.fill:
            fills = torch.full((batch, 32), fill, dtype=torch.int32, device=dev)

            def prepare(s):
                pool.hcnt[sets[s]] = fills
            for name, kern, warps, cfg in variants:
                if "own" in cfg:
                    bv = {"maxnreg": getattr(dict(modules)[name], "MAX_REGISTERS", {}).get(gate)}
                else:
                    bv = cfg
                call = lambda s: launch(kern, warps, bv, pool, idx[s], (tk.qkv[s], tk.a[s], tk.b[s], tk.out[s]), hk)  # noqa: E731
                try:
                    samples, _ = time_calls_kernel(call, 8, args.repeats, dev, prepare=prepare)
                    med = _percentile(samples, 50)
                    print(f"| {gate} | {batch} | {fill} | {name} | {warps} | {bv} | {med:.1f} | {med / bound:.2f} |",
                          flush=True)
                except Exception as e:
                    print(f"| {gate} | {batch} | {fill} | {name} | {warps} | {bv} | error: {str(e)[:80]} | |",
                          flush=True)


if __name__ == "__main__":
    sys.exit(main())
