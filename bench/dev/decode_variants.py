"""Times one decode token at the steady state several ways on one GPU, L2-cold, CUDA kernel time
(leapquant.bench_common.time_calls_kernel, graph replays), KDA and GDN: decode_inplace as it dispatches, and the step
followed by the flush as two calls, with TileLang's flush and with Triton's (an A/B bed for decode variants: a
variant of decode_inplace is timed against the two-call forms in the same run). Each call steps every program; the
fill counts are staggered so that 1/16 of the programs fill their window per call (as `leapquant bench --op
decode`). Prints one markdown table. Dev tool: python bench/dev/decode_variants.py [--batch 64 256] [--gate kda gdn]."""
from __future__ import annotations

import argparse

import torch
from step_variants import timing_points

import leapquant as lq
from leapquant.bench_common import _percentile, time_calls_kernel
from leapquant.layout import L, due_program_bytes, step_program_bytes

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
    for gate, hk, pool, batch, sets, idx, tk in timing_points(a.gate, a.batch, dev):
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


if __name__ == "__main__":
    main()
