"""One Triton step call inside a CUDA profiler range, for Nsight Compute:

    ncu --profile-from-start off --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        --section SchedulerStats --section LaunchStats python3 bench/dev/step_ncu.py --gate kda --batch 256
"""
from __future__ import annotations

import argparse

import torch

import leapquant as lq
from leapquant.bench_common import slot_sets
from leapquant.bench_step import make_tokens, num_k_heads_for, tile_case
from leapquant.layout import Pool
from leapquant.step_families import make_step_case


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gate", default="kda")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--fill", type=int, default=15)
    a = ap.parse_args()
    dev = torch.device("cuda")
    hk = num_k_heads_for(a.gate, 32)
    case = tile_case(make_step_case(16, 32, a.gate, 0, "cpu", num_k_heads=hk), a.batch)
    pool = Pool(3 * a.batch + 1, 32, device=dev, gate=a.gate)
    sets = slot_sets(3, a.batch, 0, dev)
    tk = make_tokens(case, 3, dev)
    for s in sets:
        case.load_into(pool, s)
        pool.hcnt[s] = a.fill
    for s in range(3):
        lq.step_inplace(pool, sets[s].to(torch.int32), tk.qkv[s], tk.a[s], tk.b[s], tk.A_log, tk.dt_bias,
                        tk.out[s], num_k_heads=hk, backend="triton")
        if s == 1:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
