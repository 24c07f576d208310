"""Issue 28, probe P3: the floor of a flush's memory traffic on this GPU. A copy-only kernel moves exactly the bytes
of every due program that ``layout.due_program_bytes`` counts, at the addresses the flush uses: it reads the
checkpoint (19,456 B of the program's region), the window (kbuf, ubuf, w, the fill count; KDA gbuf) and the gate
state (pcum or p), and writes the checkpoint back and the reset fields (w, pcum / p, KDA gbuf) with values made of
what it read (so no load is dead). One program of 8 warps per (row, head), every program due; timed as the tables
of record are (CUDA-graph replay, L2-cold over 8 rotated slot sets, kernel time, medians). The gap between this and
the bound at the copy bandwidth is the part of the bound no flush design can remove with this access pattern.

Dev tool: python bench/dev/probe_copy_floor.py [--batch 16 64 256 512] [--repeats 30]. It scribbles on a scratch
pool of its own. CPU check: bench/dev/test_probes.py runs the kernel through the interpreter."""
from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from leapquant.layout import CHECKPOINT_BYTES, OFF, REGION_WORDS, Pool, due_program_bytes, slot_stride
from leapquant.numerics import K, L

CK_WORDS = CHECKPOINT_BYTES // 4          #: 4864
WIN_WORDS = L * K // 2                    #: a bf16 / fp16 [L, K] window tensor in 32-bit words: 1024


@triton.jit
def copy_floor_kernel(raw, kbuf, ubuf, w, gate, gbuf, hcnt, idx, SS, H: tl.constexpr, IS_KDA: tl.constexpr,
                      OFF_: tl.constexpr, REGION: tl.constexpr, CKW: tl.constexpr, WINW: tl.constexpr,
                      NL: tl.constexpr, NK: tl.constexpr):
    """All pointers int32 views. Program (row, head) of the grid (N * H,)."""
    pid = tl.program_id(0)
    row = pid // H
    head = (pid % H).to(tl.int64)
    slot = tl.load(idx + row).to(tl.int64)
    prog = slot * H + head
    region = OFF_ + slot * SS + head * REGION
    o = tl.arange(0, 8192)
    ck = tl.load(raw + region + o, mask=o < CKW)
    ow = tl.arange(0, WINW)
    mix = tl.load(kbuf + prog * WINW + ow) ^ tl.load(ubuf + prog * WINW + ow)
    ol = tl.arange(0, NL)
    wv = tl.load(w + prog * NL + ol)
    hc = tl.load(hcnt + prog)
    tl.store(raw + region + o, ck, mask=o < CKW)
    if IS_KDA:
        mix = mix ^ tl.load(gbuf + prog * WINW + ow)
        ok = tl.arange(0, NK)
        pc = tl.load(gate + prog * NK + ok)
        tl.store(gbuf + prog * WINW + ow, mix)
        tl.store(gate + prog * NK + ok, pc ^ hc)
        tl.store(w + prog * NL + ol, wv ^ hc)
    else:
        pv = tl.load(gate + prog)
        tl.store(gate + prog, pv ^ tl.xor_sum(mix, 0))
        tl.store(w + prog * NL + ol, wv ^ hc)


def launch(pool: Pool, idx: torch.Tensor) -> None:
    """One copy-floor call over the programs of ``idx`` (int32 slots, every head)."""
    kda = pool.gate == "kda"
    gate = pool.pcum if kda else pool.p
    gbuf = pool.gbuf if kda else pool.p
    v = [t.view(torch.int32) for t in (pool.raw, pool.kbuf, pool.ubuf, pool.w, gate, gbuf)]
    copy_floor_kernel[(idx.numel() * pool.num_heads,)](
        *v, pool.hcnt, idx, slot_stride(pool.num_heads), H=pool.num_heads, IS_KDA=kda, OFF_=OFF, REGION=REGION_WORDS,
        CKW=CK_WORDS, WINW=WIN_WORDS, NL=L, NK=K, num_warps=8)


def main() -> None:
    from leapquant.bench_common import _percentile, copy_bandwidth, slot_sets, time_calls_kernel
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", nargs="+", type=int, default=[16, 64, 256, 512])
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    dev = torch.device("cuda")
    bw, _ = copy_bandwidth(dev)
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    print("| gate | batch | copy floor us | bound us | floor / bound |")
    print("| --- | --- | --- | --- | --- |")
    for gate in ("kda", "gdn"):
        pool = Pool(8 * max(args.batch) + 1, 32, device=dev, gate=gate)
        for batch in args.batch:
            idx = [s.to(torch.int32) for s in slot_sets(8, batch, 0, dev)]
            samples, _ = time_calls_kernel(lambda s: launch(pool, idx[s]), 8, args.repeats, dev)
            med = _percentile(samples, 50)
            bound = batch * 32 * due_program_bytes(gate) / bw * 1e6
            print(f"| {gate} | {batch} | {med:.1f} | {bound:.1f} | {med / bound:.2f} |", flush=True)
        pool = None  # noqa: F841
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
