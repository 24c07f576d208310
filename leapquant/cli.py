"""``leapquant info | demo | bench`` (also ``python -m leapquant ...``)."""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time

import torch


def _info(args: argparse.Namespace) -> int:
    from . import api, dispatch
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    print(f"leapquant {__import__('leapquant').__version__}")
    print(f"device:   {api.device_description(device)}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in api.versions().items()))
    print(f"{dispatch.ENV_VAR}={dispatch.ENV_BACKEND}")
    rows = api.backend_info(device, num_heads=args.heads, gate=args.gate, num_rows=args.batch)
    chosen = None
    for r in rows:
        if r["available"] and r["auto_rank"] is not None and (chosen is None or r["auto_rank"] < chosen[1]):
            chosen = (r["name"], r["auto_rank"])
    print(f"\nbackends for gate={args.gate}, heads={args.heads}, batch={args.batch} on {device}:")
    for r in rows:
        state = "available" if r["available"] else "unavailable"
        mark = "  <- auto" if chosen and r["name"] == chosen[0] else ""
        print(f"  {r['name']:<9} {state}{mark}")
        if r["description"]:
            print(f"      {r['description']}")
        for why in r["reasons"]:
            print(f"      - {why}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    """Simulate KDA/GDN decoding for a batch of sequences, flush every window, judge every flush."""
    import leapquant as lq
    from . import families, layout
    from .criterion import judge
    from .reference import compress, rebuild

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    batch = args.batch or (64 if device.type == "cuda" else 8)
    H, gate = args.heads, args.gate
    g = torch.Generator().manual_seed(args.seed)
    pool = lq.Pool(batch + 1, H, device=device, gate=gate)
    rows = list(range(1, batch + 1))
    idx = torch.arange(1, batch + 1, dtype=torch.int32, device=device)
    q0 = lq.default_q0(device)
    prefill = families._low_rank_noise(batch * H, g, scale=0.1).reshape(batch, H, layout.V, layout.K)
    pool.encode(rows, prefill.to(device), q0)
    name = lq.warmup(pool, backend=args.backend)
    print(f"leapquant demo: {batch} sequences x {H} heads, gate {gate}, {args.windows} windows of {layout.L} tokens, "
          f"backend {name} on {lq.device_description(device)}\n")
    hdr = ("window", "backend", "median err/mean|S|", "worst err/ref", "median err/ref", "worst head score", "verdict",
           "flush time")
    lines = []
    for wi in range(args.windows):
        ck = [t.cpu().reshape(batch * H, *t.shape[2:]) for t in pool.read_checkpoint(rows)]
        win = families.simulate_window(ck, gate, g)
        win = {k: v.reshape(batch, H, *v.shape[1:]) for k, v in win.items()}
        pool.write_window(rows, win["kbuf"], win["ubuf"], win["w"], win["pcum"] if gate == "kda" else win["p"],
                          win.get("gbuf"))
        before = [t.cpu() for t in pool.read_checkpoint(rows)]
        gk = dict(pcum=win["pcum"], gbuf=win["gbuf"]) if gate == "kda" else dict(p=win["p"])
        S64 = rebuild(*before, win["kbuf"], win["ubuf"], win["w"], **gk, dtype=torch.float64)
        ref = compress(rebuild(*before, win["kbuf"], win["ubuf"], win["w"], **gk), q0.cpu())
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        lq.flush_inplace(pool, idx, q0, backend=args.backend)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        out = [t.cpu() for t in pool.read_checkpoint(rows)]
        v = judge(S64, out, ref, name=name)
        ratio = (v.err / v.err_ref.clamp_min(1e-300))[v.relative]
        rel_err = v.err / v.mean_abs.clamp_min(1e-300)
        lines.append((str(wi + 1), name, f"{float(rel_err.median()):.2e}", f"{float(ratio.max()):.4f}" if ratio.numel() else "-",
                      f"{float(ratio.median()):.4f}" if ratio.numel() else "-", f"{v.worst_score:.4f}",
                      "pass" if v.passed else "FAIL", f"{dt * 1e3:.2f} ms (wall)"))
        if not v.passed:
            print(v.message)
    widths = [max(len(h), *(len(r[i]) for r in lines)) for i, h in enumerate(hdr)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(hdr, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in lines:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
    win_bytes = layout.WINDOW_HEAD_BYTES_KDA if gate == "kda" else layout.WINDOW_HEAD_BYTES_GDN
    ck_b = layout.CHECKPOINT_HEAD_BYTES
    print(f"\nbytes per head: checkpoint {ck_b} + window {win_bytes} = {ck_b + win_bytes} "
          f"(fp32 state {layout.FP32_STATE_BYTES}: {layout.FP32_STATE_BYTES / (ck_b + win_bytes):.2f}x; "
          f"bf16 state {layout.BF16_STATE_BYTES}: {layout.BF16_STATE_BYTES / (ck_b + win_bytes):.2f}x)")
    print(f"decode step reads checkpoint + window: {ck_b + win_bytes} B per head vs {2 * layout.FP32_STATE_BYTES} B "
          f"(fp32 read + write) for a stock step; one flush every {layout.L} tokens")
    print("err/ref: per-head mean |decode - fp64 state| over the fp32 reference's; the criterion allows 1.01")
    times = [float(r[-1].split()[0]) for r in lines]
    print(f"median flush time {statistics.median(times):.2f} ms (wall clock, includes Python dispatch)")
    return 0 if all(r[6] == "pass" for r in lines) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="leapquant", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log the backend choice")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("info", help="backends (available or not, with reasons), device, versions")
    p.add_argument("--device")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--gate", choices=["kda", "gdn"], default="kda")
    p.add_argument("--batch", type=int, default=256, help="rows per call (the auto choice may depend on it)")
    p.set_defaults(fn=_info)
    p = sub.add_parser("demo", help="simulate decoding, flush every window, judge and time every flush")
    p.add_argument("--device")
    p.add_argument("--backend", default=None, help="auto, reference, triton or tilelang (default: auto)")
    p.add_argument("--batch", type=int, default=None, help="sequences (default 8 on CPU, 64 on a GPU)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--gate", choices=["kda", "gdn"], default="kda")
    p.add_argument("--windows", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=_demo)
    try:
        from . import bench
    except ImportError:
        bench = None
    if bench is not None:
        p = sub.add_parser("bench", help="check and time backends (see bench/README.md)")
        bench.add_arguments(p)
        p.set_defaults(fn=lambda a: bench.run_args(a) if hasattr(bench, "run_args") else bench.main(sys.argv[2:]))
    args = parser.parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
