"""Times one decode token at the steady state several ways on one GPU, L2-cold, CUDA kernel time
(leapquant.bench_common.time_calls_kernel, graph replays), KDA and GDN: decode_inplace as it dispatches, and the step
followed by the flush as two calls, with TileLang's flush and with Triton's (an A/B bed for decode variants: a
variant of decode_inplace is timed against the two-call forms in the same run). Each call steps every program; the
fill counts are staggered so that 1/16 of the programs fill their window per call (as `leapquant bench --op
decode`). Prints one markdown table. Dev tool: python bench/dev/decode_variants.py [--batch 64 256] [--gate kda gdn]."""
from __future__ import annotations

import argparse

import torch

import leapquant as lq
from leapquant.bench_common import _percentile, slot_sets, time_calls_kernel
from leapquant.bench_step import make_tokens, num_k_heads_for, tile_case
from leapquant.layout import L, Pool, due_program_bytes, step_program_bytes
from leapquant.step_families import make_step_case

WAYS = ("decode_inplace", "step + tilelang flush", "step + triton flush")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", nargs="+", type=int, default=[64, 256])
    ap.add_argument("--gate", nargs="+", default=["kda", "gdn"])
    ap.add_argument("--repeats", type=int, default=48)
    ap.add_argument("--bandwidth", type=float, default=4270.0, help="GB/s for the bound column")
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    q0 = lq.default_q0(dev)
    print("| gate | batch | way | median us | x bound |")
    print("| --- | --- | --- | --- | --- |")
    for gate in a.gate:
        hk = num_k_heads_for(gate, 32)
        base = make_step_case(16, 32, gate, 0, "cpu", num_k_heads=hk)
        pool = Pool(8 * max(a.batch) + 9, 32, device=dev, gate=gate)
        for batch in a.batch:
            sets = slot_sets(8, batch, 0, dev)
            idx = [s.to(torch.int32) for s in sets]
            case = tile_case(base, batch)
            tk = make_tokens(case, 8, dev)
            for s in sets:
                case.load_into(pool, s)
            prog = torch.arange(batch * 32, device=dev, dtype=torch.int32).reshape(batch, 32)
            nprog = batch * 32
            bound = (nprog * step_program_bytes(gate) + nprog / L * due_program_bytes(gate)) / (a.bandwidth * 1e9) * 1e6
            for way in WAYS:
                for s, slots in enumerate(sets):
                    pool.hcnt[slots] = (prog + s) % L

                def call(s, way=way):
                    args = (pool, idx[s], tk.qkv[s], tk.a[s], tk.b[s], tk.A_log, tk.dt_bias)
                    if way == "decode_inplace":
                        lq.decode_inplace(*args, q0, tk.out[s], num_k_heads=hk)
                    else:
                        lq.step_inplace(*args, tk.out[s], num_k_heads=hk, backend="triton")
                        lq.flush_inplace(pool, idx[s], q0, backend=way.split()[2])
                try:
                    samples, _ = time_calls_kernel(call, 8, a.repeats, dev)
                    med = _percentile(samples, 50)
                    print(f"| {gate} | {batch} | {way} | {med:.1f} | {med / bound:.2f} |", flush=True)
                except Exception as e:
                    print(f"| {gate} | {batch} | {way} | error: {str(e)[:100]} | |", flush=True)
        del pool
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
