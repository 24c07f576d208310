"""Where an eager flush_inplace call's host time goes, on one GPU: per call (runs of back-to-back calls, the device
synchronised after each run, median), the call's parts (argument checks, dispatch, the backend's launch) and the whole
call, with nothing due (the kernel takes 3-4 us: the host's work is what is timed), then cProfile's top functions of the
whole call. Dev tool: python bench/dev/eager_profile.py [--backends triton tilelang] [--gate kda]."""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

import leapquant as lq
from leapquant import dispatch


def per_call_us(fn, runs: int = 40, n: int = 50, sync=torch.cuda.synchronize) -> float:
    """Median over ``runs`` of the host wall-clock per call of ``n`` back-to-back calls, the device synchronised
    (``sync``) after each run."""
    fn()
    sync()
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        out.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--backends", nargs="+", default=["triton", "tilelang"])
    ap.add_argument("--gate", default="kda")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    x = torch.zeros(1, device=dev)
    print("| part | us per call |\n| --- | --- |")
    print(f"| a tiny kernel (x.add_(1)) | {per_call_us(lambda: x.add_(1.0)):.1f} |")
    print(f"| torch.cuda.current_device() | {per_call_us(torch.cuda.current_device):.2f} |")
    print(f"| torch.cuda.is_current_stream_capturing() | {per_call_us(torch.cuda.is_current_stream_capturing):.2f} |")
    pool = lq.Pool(a.batch + 1, 32, device=dev, gate=a.gate)
    idx = torch.arange(1, a.batch + 1, dtype=torch.int32, device=dev)
    q0 = lq.default_q0(dev)
    from leapquant.validate import check_flush_args
    print(f"| argument checks (check_flush_args) | {per_call_us(lambda: check_flush_args(pool, idx, q0)):.1f} |")
    for name in a.backends:
        lq.warmup(pool, backend=name)
        be = dispatch.select(pool, a.batch, name)
        print(f"| {name}: dispatch.select | {per_call_us(lambda: dispatch.select(pool, a.batch, name)):.1f} |")
        print(f"| {name}: the backend's flush (launch) | {per_call_us(lambda: be.flush(pool, idx, q0)):.1f} |")
        print(f"| {name}: flush_inplace, the whole call | "
              f"{per_call_us(lambda: lq.flush_inplace(pool, idx, q0, backend=name)):.1f} |")
    if hasattr(lq, "step_inplace"):
        from leapquant.bench_step import make_tokens, num_k_heads_for, tile_case
        from leapquant.step_families import make_step_case
        hk = num_k_heads_for(a.gate, 32)
        tk = make_tokens(tile_case(make_step_case(16, 32, a.gate, 0, "cpu", num_k_heads=hk), a.batch), 1, dev)
        step = (pool, idx, tk.qkv[0], tk.a[0], tk.b[0], tk.A_log, tk.dt_bias)
        pool.hcnt.zero_()
        print(f"| step_inplace (triton), the whole call | "
              f"{per_call_us(lambda: lq.step_inplace(*step, tk.out[0], num_k_heads=hk, backend='triton')):.1f} |")
        print(f"| decode_inplace (auto), the whole call | "
              f"{per_call_us(lambda: lq.decode_inplace(*step, q0, tk.out[0], num_k_heads=hk)):.1f} |")
    for name in a.backends:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(500):
            lq.flush_inplace(pool, idx, q0, backend=name)
        torch.cuda.synchronize()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.top)
        print(f"\n### cProfile, {name}, 500 calls\n```\n{s.getvalue()}\n```")


if __name__ == "__main__":
    main()
