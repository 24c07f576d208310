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
from .numerics import DEFAULT_HEADS, GATES
from .options import UsageError, name_word as _word, parse_device

EXIT_USAGE = 2


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
    """The torch device of ``--device``, checked to exist here (:func:`leapquant.options.parse_device`)."""
    return parse_device(args.device)


# ---- info ----------------------------------------------------------------------------------------------------------
def _info(args: argparse.Namespace) -> int:
    """Device, versions, LEAPQUANT_BACKEND and every backend of each op (flush, step) with its reasons; the backends'
    packages are not imported (see leapquant.dispatch). Exit status 2 when LEAPQUANT_BACKEND is invalid (every call
    without ``backend=`` would raise)."""
    from . import __version__
    device = _device(args)
    env_problem = dispatch.env_problem()
    print(f"leapquant {__version__}")
    print(f"device:   {dispatch.device_description(device)}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in dispatch.versions().items()))
    if env_problem:
        print(f"{dispatch.ENV_VAR}={dispatch.ENV_BACKEND!r}   <- INVALID: every call without backend= raises "
              f"ValueError (valid: {', '.join(dispatch.CHOICES)})")
    else:
        print(f"{dispatch.ENV_VAR}={dispatch.ENV_BACKEND}")
    forced = dispatch.ENV_BACKEND if not env_problem and dispatch.ENV_BACKEND != "auto" else None
    titles = {"flush": "flush backends", "step": "step backends (decode_inplace: the step, then the flush)"}
    for op, title in titles.items():
        rows = dispatch.backend_info(device, num_heads=args.heads, gate=args.gate, num_rows=args.batch, op=op)
        chosen = None
        if forced is None and not env_problem:
            ranked = [r for r in rows if r["available"] and r["auto_rank"] is not None]
            chosen = min(ranked, key=lambda r: r["auto_rank"])["name"] if ranked else None
        print(f"\n{title} for gate={args.gate}, heads={args.heads}, batch={args.batch} on {device}:")
        for r in rows:
            state = "available" if r["available"] else "unavailable"
            mark = ""
            if r["name"] == chosen:
                mark = "  <- auto"
            elif r["name"] == forced:
                mark = f"  <- forced by {dispatch.ENV_VAR}" + ("" if r["available"] else
                                                                 f" ({op} calls raise BackendUnavailable)")
            print(f"  {r['name']:<9} {state}{mark}")
            if op == "flush" and r["description"]:        # (what each backend is and uses: once, here)
                print(f"      {r['description']}")
            extra = {k: v for k, v in r["versions"].items() if k != "torch"}
            if op == "flush" and extra:
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


#: the demo's decode: tokens of prefill before the first decode token (the fp64 dense recurrence from zero)
DEMO_PREFILL = 64


def _demo(args: argparse.Namespace) -> int:
    """The main job: decode a batch of sequences through the pool (outputs against the fp64 dense recurrence), then
    flush simulated windows and judge every flush by the criterion. Exit status 1 when a check fails."""
    device = _device(args)
    wanted = args.backend if args.backend is not None else (None if dispatch.env_problem() else dispatch.ENV_BACKEND)
    if wanted == "triton" and device.type == "cpu":
        # the Triton kernel runs on a CPU through its interpreter, which triton reads when it is first imported
        # (--backend triton and LEAPQUANT_BACKEND=triton alike)
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise UsageError("the triton backend on a CPU needs TRITON_INTERPRET=1 set before triton is imported")
        os.environ["TRITON_INTERPRET"] = "1"

    import leapquant as lq
    batch = args.batch or (64 if device.type == "cuda" else 8)
    print(f"leapquant demo: {batch} sequences x {args.heads} heads, gate {args.gate}, on "
          f"{lq.device_description(device)}\n")
    decoded = _demo_decode(args, device, batch)
    print()
    flushed = _demo_flush(args, device, batch)
    return 0 if decoded and flushed else 1


def _table(hdr: tuple[str, ...], lines: list[tuple[str, ...]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in lines)) for i, h in enumerate(hdr)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(hdr, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in lines:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")


def _demo_decode(args: argparse.Namespace, device, batch: int) -> bool:
    """Decode ``args.windows`` windows of tokens per sequence with one :func:`leapquant.decode_inplace` per token
    (leapquant.e2e's simulated layer) and print each window's output error beside dense fp32- and bf16-state
    recurrences. True when every output is finite and the padding row's is zero."""
    from . import e2e
    from .layout import L
    tokens = args.windows * L
    name = dispatch.requested(args.backend)
    forced = dispatch.get_backend(name) if name != "auto" else None
    if forced is not None and forced.step is None:
        print(f"decode: not run: the {name} backend has no step kernel (without a forced backend, --backend or "
              f"{dispatch.ENV_VAR}, the demo decodes with each op's own choice)")
        return True
    r = e2e.simulate(args.gate, backend=args.backend, device=device, batch=batch, heads=args.heads, tokens=tokens,
                     last=tokens, prefill=DEMO_PREFILL, seed=args.seed)
    print(f"decode: {tokens} tokens per sequence after a {DEMO_PREFILL}-token prefill (encoded into the pool), one "
          f"decode_inplace per token (step: {r.backends['step']}, flush: {r.backends['flush']}); {r.k_heads} key "
          f"heads, one padding row (idx -1)")
    print("error: ||o - o_fp64|| / ||o_fp64|| over the window's tokens, every sequence and head, against the fp64 "
          "dense recurrence of the same bf16 inputs; beside it the dense recurrence with an fp32 and a bf16 state\n")
    hdr = ("window", "leapquant", "fp32 state", "bf16 state", "leapquant / bf16 state")
    lines = [(str(i + 1), *(f"{w[m]:.3e}" for m in e2e.METHODS), f"{w['leapquant'] / w['bf16 state']:.3f}")
             for i, w in enumerate(r.windows)]
    _table(hdr, lines)
    ok = r.finite and r.padding_zero
    print(f"\noutputs finite: {'yes' if r.finite else 'NO'}; padding row's output exactly zero: "
          f"{'yes' if r.padding_zero else 'NO'}; {r.token_seconds * 1e3:.2f} ms per token (median wall clock of a "
          f"decode_inplace call, includes Python dispatch and a device synchronisation)")
    print("the accuracy requirement (no worse than a bf16 state over tokens 385-512 of a 512-token decode) is "
          "checked by 'python -m leapquant.e2e'")
    return ok


def _demo_flush(args: argparse.Namespace, device, batch: int) -> bool:
    """Flush ``args.windows`` simulated windows of every program and judge each flush against the exact fp64 state
    by the criterion. True when every flush passes."""
    import torch

    import leapquant as lq
    from . import families, layout
    from .criterion import REL_SLACK, judge
    from .reference import compress, rebuild

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
    print(f"flush: {windows} of {layout.L} simulated updates per program, each flushed by {name} and judged against "
          f"the exact fp64 state by the criterion")
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
    _table(hdr, lines)
    win_bytes = layout.WINDOW_HEAD_BYTES_KDA if gate == "kda" else layout.WINDOW_HEAD_BYTES_GDN
    ck_b = layout.CHECKPOINT_BYTES
    print(f"\nbytes per head: checkpoint {ck_b} + window {win_bytes} = {ck_b + win_bytes} "
          f"(fp32 state {layout.FP32_STATE_BYTES}: {layout.FP32_STATE_BYTES / (ck_b + win_bytes):.2f}x; "
          f"bf16 state {layout.BF16_STATE_BYTES}: {layout.BF16_STATE_BYTES / (ck_b + win_bytes):.2f}x)")
    print(f"decode step reads checkpoint + window: {ck_b + win_bytes} B per head vs {2 * layout.FP32_STATE_BYTES} B "
          f"(fp32 read + write) for a stock step; one flush every {layout.L} tokens")
    print(f"err/ref: per-head mean |decode - fp64 state| over the fp32 reference's; the criterion allows {REL_SLACK:g}")
    times = [float(r[-1].split()[0]) for r in lines]
    print(f"median flush time {statistics.median(times):.2f} ms (wall clock, includes Python dispatch)")
    return all(r[6] == "pass" for r in lines)


# ---- the parser ----------------------------------------------------------------------------------------------------
def _package_version() -> str:
    from . import __version__
    return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="leapquant", description="LeapQuant decode-step and flush kernels for compressed KDA / GDN "
                                                   "recurrent states: 'info' lists the backends and why any cannot "
                                                   "serve, "
                                                   "'demo' runs the main job, 'bench' checks and times backends. "
                                                   "Bad arguments exit with status 2 and a one-line reason.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log the backend choice")
    parser.add_argument("--version", action="version", version=f"leapquant {_package_version()}")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="{info,demo,bench}")

    p = sub.add_parser("info", help="backends (available or not, with reasons), device, versions",
                       description="Device, package versions, LEAPQUANT_BACKEND (exit status 2 when it is invalid) "
                                   "and every backend of each op (flush, decode step), available or not, with the "
                                   "reasons it cannot serve a pool of the given geometry.")
    p.add_argument("--device", default=None, help="torch device to report on (default: cuda when available, else cpu)")
    p.add_argument("--heads", type=_count(1), default=DEFAULT_HEADS,
                   help=f"heads per sequence of the pool asked about (default {DEFAULT_HEADS})")
    p.add_argument("--gate", type=_word, choices=GATES, default="kda", help="gate variant (default kda)")
    p.add_argument("--batch", type=_count(1), default=256,
                   help="rows per call; the auto choice may depend on it (default 256)")
    p.set_defaults(fn=_info)

    p = sub.add_parser("demo", help="decode through the pool, then judge and time flushes",
                       description="Decode a batch of sequences through the pool (decode_inplace per token; every "
                                   "window's output error against the fp64 dense recurrence, beside fp32- and "
                                   "bf16-state recurrences), then flush simulated windows and judge every flush "
                                   "against the exact fp64 state by the criterion, timing both. On a CPU the default "
                                   "backend is the fp32 reference, the criterion's own yardstick.")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--backend", type=_word, default=None, choices=dispatch.CHOICES,
                   help="backend to step and flush with (default: LEAPQUANT_BACKEND, else auto: each op its own); "
                        "'triton' on a CPU runs its interpreter (slow: use a small --batch and --heads)")
    p.add_argument("--batch", type=_count(1), default=None, help="sequences (default 8 on a CPU, 64 on a GPU)")
    p.add_argument("--heads", type=_count(1), default=DEFAULT_HEADS, help=f"heads per sequence (default {DEFAULT_HEADS})")
    p.add_argument("--gate", type=_word, choices=GATES, default="kda", help="gate variant (default kda)")
    p.add_argument("--windows", type=_count(1), default=3,
                   help="windows of 16 tokens: decoded, and simulated windows flushed and judged (default 3)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the simulated layer, prefill states and tokens (default 0)")
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
