"""leapquant info | demo | bench  (also python -m leapquant ...)

Nothing heavy is imported before a command runs: --help loads neither torch nor a backend. Bad arguments, and
ValueErrors raised by the library (a bad argument, an invalid LEAPQUANT_BACKEND, a forced backend that cannot serve),
print a one-line reason to stderr and exit with status 2.
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time

from . import dispatch

EXIT_USAGE = 2


class UsageError(Exception):
    """A command's argument that argparse could not check (a device that does not exist here, ...)."""


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (the reason and where to find the usage) instead of usage + reason."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _count(minimum: int):
    """An argparse type: an integer >= ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    parse.__name__ = f"integer >= {minimum}"
    return parse


def _device(args: argparse.Namespace):
    """The torch device of ``--device`` (default: cuda when available, else cpu), checked to exist here."""
    import torch
    if args.device is None:
        return dispatch.default_device()
    try:
        device = torch.device(args.device)
    except (RuntimeError, ValueError) as e:
        raise UsageError(f"--device {args.device!r}: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device!r}: CUDA is not available on this machine")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UsageError(f"--device {args.device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {args.device!r}: leapquant runs on cpu or cuda devices")
    return device


# ---- info ----------------------------------------------------------------------------------------------------------
def _info(args: argparse.Namespace) -> int:
    """Device, versions, LEAPQUANT_BACKEND and every backend with its reasons; the backends' packages are not imported
    (see leapquant.dispatch). Exit status 2 when LEAPQUANT_BACKEND is invalid (every flush would raise)."""
    from . import __version__
    device = _device(args)
    env_problem = dispatch.env_problem()
    print(f"leapquant {__version__}")
    print(f"device:   {dispatch.device_description(device)}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in dispatch.versions().items()))
    if env_problem:
        print(f"{dispatch.ENV_VAR}={dispatch.ENV_BACKEND!r}   <- INVALID: every flush without backend= raises "
              f"ValueError (valid: {', '.join(dispatch.CHOICES)})")
    else:
        print(f"{dispatch.ENV_VAR}={dispatch.ENV_BACKEND}")
    rows = dispatch.backend_info(device, num_heads=args.heads, gate=args.gate, num_rows=args.batch)
    forced = dispatch.ENV_BACKEND if not env_problem and dispatch.ENV_BACKEND != "auto" else None
    chosen = None
    if forced is None and not env_problem:
        ranked = [r for r in rows if r["available"] and r["auto_rank"] is not None]
        chosen = min(ranked, key=lambda r: r["auto_rank"])["name"] if ranked else None
    print(f"\nbackends for gate={args.gate}, heads={args.heads}, batch={args.batch} on {device}:")
    for r in rows:
        state = "available" if r["available"] else "unavailable"
        mark = ""
        if r["name"] == chosen:
            mark = "  <- auto"
        elif r["name"] == forced:
            mark = f"  <- forced by {dispatch.ENV_VAR}" + ("" if r["available"] else
                                                             " (flushes raise BackendUnavailable)")
        print(f"  {r['name']:<9} {state}{mark}")
        if r["description"]:
            print(f"      {r['description']}")
        extra = {k: v for k, v in r["versions"].items() if k != "torch"}
        if extra:
            print("      uses " + ", ".join(f"{k} {v}" for k, v in extra.items()))
        for why in r["reasons"]:
            print(f"      - {why}")
    if env_problem:
        print(f"leapquant info: error: {env_problem}", file=sys.stderr)
        return EXIT_USAGE
    return 0


# ---- demo ----------------------------------------------------------------------------------------------------------
#: what the demo's verdict means where the reference judges itself
CPU_REFERENCE_NOTE = ("note: the reference backend is the criterion's own yardstick (err/ref = 1 by construction), so "
                      "the verdict column checks the format, not a kernel; to judge a kernel on a CPU run "
                      "'leapquant demo --backend triton --batch 1 --heads 4' (the Triton kernel through its "
                      "interpreter, about 0.2 s per head and window)")


def _demo(args: argparse.Namespace) -> int:
    """Simulate KDA/GDN decoding for a batch of sequences, flush every window, judge every flush."""
    import torch
    device = _device(args)
    if args.backend == "triton" and device.type == "cpu":
        # the Triton kernel runs on a CPU through its interpreter, which triton reads when it is first imported
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise UsageError("--backend triton on a CPU needs TRITON_INTERPRET=1 set before triton is imported")
        os.environ["TRITON_INTERPRET"] = "1"

    import leapquant as lq
    from . import families, layout
    from .criterion import judge
    from .reference import compress, rebuild

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
    windows = f"{args.windows} window{'s' if args.windows > 1 else ''}"
    print(f"leapquant demo: {batch} sequences x {H} heads, gate {gate}, {windows} of {layout.L} tokens, "
          f"backend {name} on {lq.device_description(device)}")
    if name == "reference":
        print(CPU_REFERENCE_NOTE if device.type == "cpu" else CPU_REFERENCE_NOTE.split("; to judge")[0])
    print()
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
        lines.append((str(wi + 1), name, f"{float(rel_err.median()):.2e}",
                      f"{float(ratio.max()):.4f}" if ratio.numel() else "-",
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


# ---- the parser ----------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="leapquant", description="LeapQuant flush kernels for compressed KDA / GDN recurrent "
                                                   "states: 'info' lists the backends and why any cannot serve, "
                                                   "'demo' runs the main job, 'bench' checks and times backends. "
                                                   "Bad arguments exit with status 2 and a one-line reason.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log the backend choice")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="{info,demo,bench}")

    p = sub.add_parser("info", help="backends (available or not, with reasons), device, versions",
                       description="Device, package versions, LEAPQUANT_BACKEND (exit status 2 when it is invalid) "
                                   "and every backend, available or not, with the reasons it cannot serve a pool of "
                                   "the given geometry.")
    p.add_argument("--device", default=None, help="torch device to report on (default: cuda when available, else cpu)")
    p.add_argument("--heads", type=_count(1), default=32,
                   help="heads per sequence of the pool asked about (default 32)")
    p.add_argument("--gate", choices=["kda", "gdn"], default="kda", help="gate variant (default kda)")
    p.add_argument("--batch", type=_count(1), default=256,
                   help="rows per call; the auto choice may depend on it (default 256)")
    p.set_defaults(fn=_info)

    p = sub.add_parser("demo", help="simulate decoding, flush every window, judge and time every flush",
                       description="Simulate decoding for a batch of sequences, flush every window, judge every "
                                   "flush against the exact fp64 state by the SPEC criterion and time it. On a CPU the "
                                   "default backend is the fp32 reference, the criterion's own yardstick.")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--backend", default=None, choices=dispatch.CHOICES,
                   help="backend to flush with (default: LEAPQUANT_BACKEND, else auto); 'triton' on a CPU runs its "
                        "interpreter (slow: use a small --batch and --heads)")
    p.add_argument("--batch", type=_count(1), default=None, help="sequences (default 8 on a CPU, 64 on a GPU)")
    p.add_argument("--heads", type=_count(1), default=32, help="heads per sequence (default 32)")
    p.add_argument("--gate", choices=["kda", "gdn"], default="kda", help="gate variant (default kda)")
    p.add_argument("--windows", type=_count(1), default=3,
                   help="windows of 16 decode tokens, each flushed and judged (default 3)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the simulated prefill states and decode tokens (default 0)")
    p.set_defaults(fn=_demo)

    try:
        from . import bench
    except ImportError:
        bench = None
    if bench is not None:
        p = sub.add_parser("bench", help="check and time backends (see bench/README.md)")
        bench.add_arguments(p)
        p.set_defaults(fn=lambda a: bench.run_args(a) if hasattr(bench, "run_args") else bench.main(sys.argv[2:]))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        return args.fn(args)
    except (UsageError, ValueError) as e:   # BackendUnavailable is a ValueError too
        if args.cmd == "bench":          # the bench reports its own failures and exit codes
            raise
        print(f"leapquant {args.cmd}: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:              # the reader left (``leapquant info | head``): no traceback for that
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _one_line(e: BaseException) -> str:
    """An exception's message on one line: a list of reasons (lines '  - why') joined with '; '."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    rest = [line[2:] if line.startswith("- ") else line for line in lines[1:]]
    return " ".join([lines[0], "; ".join(rest)]) if rest else lines[0]


if __name__ == "__main__":
    sys.exit(main())
