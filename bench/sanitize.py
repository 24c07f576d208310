"""Run NVIDIA compute-sanitizer's four tools over one flush of each GPU kernel, both gates.

Every (tool, backend, gate) is its own ``compute-sanitizer --tool TOOL --error-exitcode 86`` process around a small
child (this file with ``--child``) that builds a pool on the host, copies it to the GPU, makes one
``leapquant.flush_inplace`` call and checks the call's footprint on the host. The child's call: ``--rows`` rows (one
of them 0, "no sequence", the others distinct slots in shuffled order) x ``--heads`` heads of
``leapquant.families.make_case`` (every input family), about ``--due`` of the programs due (``hcnt = L``), the others
at a fill count in [0, L). Every byte the kernel may read was written by a host-to-device copy, which initcheck sees.

Before the sanitized runs, one plain child per (backend, gate) builds the kernels into the TileLang and Triton disk
caches (``--cache-dir``), so the sanitized processes load them instead of compiling them under the tool, and checks
that the call runs and leaves the right footprint.

    PYTHONPATH=. python bench/sanitize.py --out sanitize-out            # 4 tools x 2 backends x 2 gates
    PYTHONPATH=. python bench/sanitize.py --tools racecheck --backends tilelang --gates kda --out sanitize-out
    python bench/sanitize.py --dry-run                                  # print the commands, run nothing

racecheck runs with ``--racecheck-report analysis`` by default: one report per pair of racing instructions with the
number of racing accesses (``[N hazards]``), which the table sums. ``--racecheck-report all`` adds one report per
racing byte, which takes far longer when there are many (1.38 M of them took 141 s against 1.4 s) and, cut at
``--print-limit``, leaves the per-pair reports out.

Output in ``--out``: ``summary.md`` (the header, the table, racecheck's pairs of source lines, the commands),
``summary.json`` and ``sanitize.log`` (every run's full output under a header line); ``--split-logs`` also writes
``<tool>_<backend>_<gate>.log``. ``--merge`` keeps the runs of an earlier invocation with the same ``--out`` that this
one does not repeat (to spread the runs over several sessions of a time-limited machine). The table: tool, backend,
gate, the tool's error count (ERROR SUMMARY; racecheck: the errors of its RACECHECK SUMMARY), racecheck's warnings and
racing accesses, the exit status, the wall seconds and a verdict (``clean``: the tool's summary says 0, the exit
status is 0 and the child saw its flush's footprint). Exit status: 0 when every run is clean, 1 when any is not, 2 on
bad arguments or without compute-sanitizer.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields

from leapquant.numerics import DEFAULT_HEADS, GATES

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
GPU_BACKENDS = ("tilelang", "triton")
#: the exit status compute-sanitizer gives when its tool found an error (--error-exitcode); the child never uses it
SANITIZER_ERROR_EXIT = 86
#: the child's exit status when the flush ran but its footprint on the pool is wrong
FOOTPRINT_EXIT = 3
CHILD_OK = "[child] footprint ok"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- the child: one flush ----------------------------------------------------------------------------------------
def build_pool(rows: int, heads: int, gate: str, due: float, seed: int):
    """Host pool of ``rows`` slots (1 .. rows - 1 loaded) and idx [rows] holding those slots and one 0, shuffled;
    about ``due`` of the loaded programs due, the others at a fill count in [0, L).

    Returns (pool, idx, due_mask [slots, heads]), all on the host."""
    import torch

    from leapquant import families
    from leapquant.layout import L, Pool

    pool = Pool(rows, heads, device="cpu", gate=gate)
    live = torch.arange(1, rows)
    families.make_case(rows - 1, heads, gate, seed=seed).load_into(pool, live)
    g = torch.Generator().manual_seed(seed)
    due_mask = torch.zeros(rows, heads, dtype=torch.bool)
    due_mask[1:] = torch.rand(rows - 1, heads, generator=g) < due
    phases = torch.randint(0, L, (rows, heads), generator=g, dtype=torch.int32)
    pool.hcnt.copy_(torch.where(due_mask, torch.full_like(phases, L), phases))
    idx = torch.cat([live, torch.zeros(1, dtype=live.dtype)])[torch.randperm(rows, generator=g)].to(torch.int32)
    return pool, idx, due_mask


def pool_to(pool, device):
    """A copy of ``pool`` on ``device`` (plain copies: what initcheck counts as initialised)."""
    from leapquant.layout import Pool
    bufs = {"raw": pool.raw.to(device, copy=True)}
    bufs.update({name: t.to(device, copy=True) for name, t in pool.window_tensors().items()})
    return Pool(pool.num_slots, pool.num_heads, device=device, gate=pool.gate, **bufs)


def check_footprint(before, after, due_mask) -> list[str]:
    """What is wrong with the flush's footprint: due programs get a new, finite checkpoint with codes in [-QMAX, QMAX]
    and positive scales and a reset window (hcnt stays L); every other program stays bitwise untouched."""
    import torch

    from leapquant.layout import L, QMAX
    problems = []
    nd = ~due_mask

    def same(a, b):
        return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))

    for name in ("codes", "s_k", "s_v", "tokens"):
        if not same(getattr(before, name)[nd], getattr(after, name)[nd]):
            problems.append(f"{name} of a program not due changed")
    for name, t in before.window_tensors().items():
        if not same(t[nd], getattr(after, name)[nd]):
            problems.append(f"window tensor {name} of a program not due changed")
    if int(due_mask.sum()) == 0:
        return problems + ["no program was due (nothing checked)"]
    for name in ("s_k", "s_v", "tokens"):
        if not torch.isfinite(getattr(after, name)[due_mask].float()).all():
            problems.append(f"{name} of a due program is not finite")
    if (after.codes[due_mask].abs() > QMAX).any():
        problems.append(f"a due program has a code outside [-{QMAX:g}, {QMAX:g}]")
    if (after.s_k[due_mask] <= 0).any() or (after.s_v[due_mask] <= 0).any():
        problems.append("a due program has a scale <= 0")
    if not (after.w[due_mask] == 0).all():
        problems.append("w of a due program not reset")
    if not (after.hcnt[due_mask] == L).all():
        problems.append("hcnt of a due program changed")
    if after.gate == "kda":
        if not (after.pcum[due_mask] == 0).all():
            problems.append("pcum of a due program not reset")
        if not (after.gbuf[due_mask] == 1).all():
            problems.append("gbuf of a due program not reset")
    elif not (after.p[due_mask] == 1).all():
        problems.append("p of a due program not reset")
    if same(before.codes[due_mask], after.codes[due_mask]) and same(before.s_k[due_mask], after.s_k[due_mask]):
        problems.append("no due checkpoint changed (did the kernel run?)")
    return problems


def child(args) -> int:
    import torch

    import leapquant as lq

    t0 = time.time()
    host, idx, due_mask = build_pool(args.rows, args.heads, args.gate, args.due, args.seed)
    device = torch.device(args.device)
    pool = pool_to(host, device)
    idx_dev = idx.to(device)
    q0 = lq.default_q0(device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"[child] {args.backend} {args.gate}: {args.rows} rows (one 0) x {args.heads} heads, {int(due_mask.sum())} "
          f"of {(args.rows - 1) * args.heads} programs due; pool ready in {time.time() - t0:.1f} s", flush=True)
    t1 = time.time()
    name = lq.warmup(pool, backend=args.backend)
    print(f"[child] backend {name} ready in {time.time() - t1:.1f} s", flush=True)
    t2 = time.time()
    lq.flush_inplace(pool, idx_dev, q0, backend=args.backend)
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"[child] flush returned in {time.time() - t2:.1f} s", flush=True)
    problems = check_footprint(host, pool_to(pool, "cpu"), due_mask)
    for p in problems:
        print(f"[child] FOOTPRINT: {p}", flush=True)
    if problems:
        return FOOTPRINT_EXIT
    print(CHILD_OK, flush=True)
    return 0


# ---- reading compute-sanitizer's output --------------------------------------------------------------------------
@dataclass
class Result:
    tool: str
    backend: str
    gate: str
    command: list[str]
    returncode: int | None = None
    seconds: float = 0.0
    errors: int | None = None             # ERROR SUMMARY; racecheck: the errors of its RACECHECK SUMMARY
    warnings: int | None = None           # racecheck's warnings
    displayed: int | None = None          # racecheck: reports printed
    hazards: int | None = None            # racecheck: racing accesses summed over its analysis reports
    timed_out: bool = False
    child_ok: bool = False                # the child saw its flush's footprint
    verdict: str = ""
    #: racecheck: 'Write f:l / Read f:l' -> racing accesses (analysis reports), 'RAW: Write f:l / Read f:l' ->
    #: hazard reports printed
    pairs: dict[str, int] = field(default_factory=dict)
    log: str = ""


ERROR_SUMMARY = re.compile(r"ERROR SUMMARY:\s*(\d+)\s+errors?")
RACE_SUMMARY = re.compile(
    r"RACECHECK SUMMARY:\s*(\d+)\s+hazards?\s+displayed\s*\((\d+)\s+errors?,\s*(\d+)\s+warnings?\)")
RACE_FIRST = re.compile(r"Race reported between (\w+) access at .*? in (\S+:\d+)")
RACE_SECOND = re.compile(r"and (\w+) access at .*? in (\S+:\d+)\s*\[(\d+) hazards?\]")
HAZARD = re.compile(r"Potential (\w+) hazard detected")
THREAD_ACCESS = re.compile(r"(Read|Write) Thread .*? in (\S+:\d+)")


def parse_output(text: str, res: Result) -> None:
    """Fill the counts of ``res`` from a compute-sanitizer log: the tool's summary line; for racecheck, its analysis
    reports (a pair of racing instructions with the number of racing accesses) and its hazard reports (counted per
    pair of source lines)."""
    m = ERROR_SUMMARY.findall(text)            # one per process the tool followed: the worst counts
    res.errors = max(int(x) for x in m) if m else None
    m = RACE_SUMMARY.findall(text)
    if m:
        worst = max(m, key=lambda x: (int(x[1]), int(x[2])))
        res.displayed, errors, res.warnings = (int(x) for x in worst)
        if res.errors is None:
            res.errors = errors
    res.child_ok = CHILD_OK in text
    if res.tool != "racecheck":
        return
    analysis: dict[str, int] = {}
    printed: dict[str, int] = {}
    first = kind = None
    accesses: list[str] = []
    for line in text.splitlines():
        if a := RACE_FIRST.search(line):
            first = f"{a.group(1)} {a.group(2)}"
        elif (b := RACE_SECOND.search(line)) and first:
            key = f"{first} / {b.group(1)} {b.group(2)}"
            analysis[key] = analysis.get(key, 0) + int(b.group(3))
            first = None
        elif h := HAZARD.search(line):
            kind, accesses = h.group(1), []
        elif (t := THREAD_ACCESS.search(line)) and kind:
            accesses.append(f"{t.group(1)} {t.group(2)}")
            if len(accesses) == 2:
                key = f"{kind}: {accesses[0]} / {accesses[1]}"
                printed[key] = printed.get(key, 0) + 1
                kind = None
    res.hazards = sum(analysis.values()) if analysis or res.errors == 0 else None
    res.pairs = {**analysis, **printed}


def verdict(res: Result) -> str:
    if res.timed_out:
        return "TIMEOUT"
    if res.returncode == SANITIZER_ERROR_EXIT or (res.errors or 0) > 0:
        return "ERRORS"
    if (res.warnings or 0) > 0:
        return "WARNINGS"
    if res.returncode != 0:
        return f"FAILED (exit {res.returncode})"
    if res.errors is None:
        return "NO SUMMARY"
    if not res.child_ok:
        return "NO FLUSH"
    return "clean"


# ---- running it ---------------------------------------------------------------------------------------------------
def find_sanitizer(explicit: str | None) -> str | None:
    if explicit:
        return explicit if (os.path.isfile(explicit) or shutil.which(explicit)) else None
    for cand in (os.environ.get("COMPUTE_SANITIZER"), shutil.which("compute-sanitizer"),
                 "/usr/local/cuda/bin/compute-sanitizer",
                 *(os.path.join(os.environ[v], "bin", "compute-sanitizer") for v in ("CUDA_HOME", "CUDA_PATH")
                   if os.environ.get(v)),
                 *sorted(glob.glob("/usr/local/cuda-*/bin/compute-sanitizer"), reverse=True)):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def child_command(args, backend: str, gate: str) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--child", "--backend", backend, "--gate", gate,
            "--rows", str(args.rows), "--heads", str(args.heads), "--due", f"{args.due:.6g}", "--seed", str(args.seed)]


def sanitizer_command(sanitizer: str, tool: str, args, backend: str, gate: str) -> list[str]:
    cmd = [sanitizer, "--tool", tool, "--error-exitcode", str(SANITIZER_ERROR_EXIT),
           "--print-limit", str(args.print_limit), "--show-backtrace", args.show_backtrace]
    if tool == "racecheck":
        cmd += ["--racecheck-report", args.racecheck_report]
    return cmd + shlex.split(args.sanitizer_args or "") + child_command(args, backend, gate)


def child_env(cache_dir: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TILELANG_CACHE_DIR", os.path.join(cache_dir, "tilelang"))
    env.setdefault("TRITON_CACHE_DIR", os.path.join(cache_dir, "triton"))
    env.pop("LEAPQUANT_BACKEND", None)          # each child names its backend
    env.pop("TILELANG_DISABLE_CACHE", None)     # the sanitized children load what the warm-up built
    return env


def run_one(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int | None, str, float, bool]:
    t0 = time.time()
    try:
        p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout, cwd=REPO)
        return p.returncode, p.stdout.decode(errors="replace"), time.time() - t0, False
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return None, out + f"\n[sanitize] killed after {timeout:.0f} s\n", time.time() - t0, True


def versions(sanitizer: str) -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for mod in ("torch", "triton", "tilelang"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            out[mod] = f"not importable ({type(exc).__name__})"
    try:
        import torch
        if torch.cuda.is_available():
            out["device"] = torch.cuda.get_device_name(0)
            out["cuda"] = str(torch.version.cuda)
    except Exception:  # noqa: BLE001
        pass
    try:
        lines = subprocess.run([sanitizer, "--version"], capture_output=True, text=True, timeout=60).stdout.split("\n")
        out["compute-sanitizer"] = next((ln.strip() for ln in lines if ln.strip().startswith("Version")), lines[-1])
    except Exception:  # noqa: BLE001
        pass
    return out


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("-dirty" if dirty else "") if sha else "unknown"
    except Exception:  # noqa: BLE001
        return "unknown"


def fmt(x) -> str:
    return "-" if x is None else str(x)


def table(results: list[Result]) -> list[str]:
    rows = ["| tool | backend | gate | errors | warnings | hazards | exit | seconds | verdict |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        rows.append(f"| {r.tool} | {r.backend} | {r.gate} | {fmt(r.errors)} | {fmt(r.warnings)} | {fmt(r.hazards)} | "
                    f"{'timeout' if r.timed_out else fmt(r.returncode)} | {r.seconds:.1f} | {r.verdict} |")
    return rows


def key(r) -> tuple[str, str, str]:
    return (r.tool, r.backend, r.gate) if isinstance(r, Result) else (r["tool"], r["backend"], r["gate"])


def load_previous(out: str) -> tuple[list[Result], list[dict], list[dict]]:
    """The runs, warm-ups and headers of an earlier invocation in ``out`` (for --merge)."""
    path = os.path.join(out, "summary.json")
    if not os.path.isfile(path):
        return [], [], []
    with open(path) as f:
        data = json.load(f)
    names = {f.name for f in fields(Result)}
    runs = [Result(**{k: v for k, v in r.items() if k in names}) for r in data.get("runs", [])]
    return runs, data.get("warmup", []), data.get("headers", [])


ORDER = {name: i for i, name in enumerate(TOOLS + GPU_BACKENDS + GATES)}


def write_outputs(out: str, args, results: list[Result], warm: list[dict], headers: list[dict],
                  old_log: str) -> None:
    os.makedirs(out, exist_ok=True)
    results = sorted(results, key=lambda r: tuple(ORDER[k] for k in key(r)))
    lines = ["# compute-sanitizer: the flush kernels, both gates", ""]
    for i, h in enumerate(headers):
        if len(headers) > 1:
            lines.append(f"Invocation {i + 1}:")
        lines += [f"- {k}: {v}" for k, v in h.items()] + [""]
    lines += table(results) + [""]
    for r in results:
        for pair, n in r.pairs.items():
            what = "reports printed" if ":" in pair.split(" ")[0] else "racing accesses"
            lines.append(f"- {r.tool} {r.backend} {r.gate}: {pair}: {n} {what}")
    lines += ["", "Warm-up (plain runs that build the kernels into the caches and check the footprint):", ""]
    lines += [f"- {w['backend']} {w['gate']}: exit {w['returncode']}, {w['seconds']:.1f} s, "
              f"{'footprint ok' if w['ok'] else 'NOT OK'}" for w in warm]
    lines += ["", "Commands:", "", "```"] + [shlex.join(r.command) for r in results] + ["```", ""]
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("\n".join(lines))
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump({"headers": headers, "warmup": [{k: v for k, v in w.items() if k != "log"} for w in warm],
                   "runs": [{k: v for k, v in asdict(r).items() if k != "log"} for r in results]}, f, indent=1)
    with open(os.path.join(out, "sanitize.log"), "w") as f:
        f.write(old_log)
        for w in warm:
            if w.get("log") is not None:
                f.write(f"===== warm-up {w['backend']} {w['gate']}: {shlex.join(w['command'])}\n{w['log']}\n")
        for r in results:
            if r.log:
                f.write(f"===== {r.tool} {r.backend} {r.gate}: {shlex.join(r.command)}\n{r.log}\n")
    if args.split_logs:
        for r in results:
            if r.log:
                with open(os.path.join(out, f"{r.tool}_{r.backend}_{r.gate}.log"), "w") as f:
                    f.write(f"$ {shlex.join(r.command)}\n{r.log}")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tools", nargs="+", choices=TOOLS, default=list(TOOLS))
    ap.add_argument("--backends", nargs="+", choices=GPU_BACKENDS, default=list(GPU_BACKENDS))
    ap.add_argument("--gates", nargs="+", choices=GATES, default=list(GATES))
    ap.add_argument("--out", help="folder for summary.md, summary.json and sanitize.log (required unless --dry-run)")
    ap.add_argument("--merge", action="store_true", help="keep the runs of an earlier invocation in --out")
    ap.add_argument("--rows", type=int, default=32, help="rows of the call, one of them 0 (default 32)")
    ap.add_argument("--heads", type=int, default=DEFAULT_HEADS, help=f"heads (default {DEFAULT_HEADS})")
    ap.add_argument("--due", type=float, default=2 / 3, help="fraction of the programs due (default 2/3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per sanitized run (default 300)")
    ap.add_argument("--print-limit", type=int, default=100,
                    help="compute-sanitizer --print-limit: reports printed per run (default 100; counts stay whole)")
    ap.add_argument("--racecheck-report", default="analysis", choices=("analysis", "all", "hazard"),
                    help="racecheck's report (default analysis: one report per racing pair of instructions)")
    ap.add_argument("--show-backtrace", default="device", choices=("yes", "no", "host", "device"),
                    help="compute-sanitizer --show-backtrace (default device: the host frames are the launcher's)")
    ap.add_argument("--sanitizer", help="compute-sanitizer binary (default: $COMPUTE_SANITIZER, PATH, "
                                        "/usr/local/cuda*/bin)")
    ap.add_argument("--sanitizer-args", default="", help="more compute-sanitizer options, one string")
    ap.add_argument("--cache-dir", help="kernel caches shared by the warm-up and the sanitized runs (default: a "
                                        "temporary folder; TILELANG_CACHE_DIR / TRITON_CACHE_DIR, when set, win)")
    ap.add_argument("--no-warmup", action="store_true", help="skip the plain warm-up runs")
    ap.add_argument("--split-logs", action="store_true", help="also one log file per run")
    ap.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    # the child
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--backend", choices=GPU_BACKENDS + ("reference",), help=argparse.SUPPRESS)
    ap.add_argument("--gate", choices=GATES, help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rows < 2 or args.heads < 1 or not 0.0 < args.due <= 1.0:
        ap.error("need --rows >= 2, --heads >= 1 and 0 < --due <= 1")
    if args.child and not (args.backend and args.gate):
        ap.error("--child needs --backend and --gate")
    if not args.child and not args.dry_run and not args.out:
        ap.error("--out is required")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child(args)
    sanitizer = find_sanitizer(args.sanitizer)
    if sanitizer is None and not args.dry_run:
        print("compute-sanitizer not found ($COMPUTE_SANITIZER, PATH, /usr/local/cuda*/bin); pass --sanitizer",
              file=sys.stderr)
        return 2
    sanitizer = sanitizer or "compute-sanitizer"
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="leapquant-sanitize-")
    env = child_env(cache_dir)
    pairs = [(b, g) for b in args.backends for g in args.gates]
    runs = [(t, b, g) for t in args.tools for b, g in pairs]
    if args.dry_run:
        print(f"# TILELANG_CACHE_DIR={env['TILELANG_CACHE_DIR']} TRITON_CACHE_DIR={env['TRITON_CACHE_DIR']}")
        if not args.no_warmup:
            for b, g in pairs:
                print("# warm-up: " + shlex.join(child_command(args, b, g)))
        for t, b, g in runs:
            print(shlex.join(sanitizer_command(sanitizer, t, args, b, g)))
        return 0

    header = {"commit": git_commit(), "sanitizer": sanitizer, **versions(sanitizer),
              "call": f"{args.rows} rows (one 0) x {args.heads} heads, ~{args.due:.3g} of the programs due, "
                      f"seed {args.seed}",
              "command": shlex.join(["python", os.path.relpath(os.path.abspath(__file__), REPO), *sys.argv[1:]])}
    print("\n".join(f"{k}: {v}" for k, v in header.items()), flush=True)
    old_runs, old_warm, old_headers, old_log = [], [], [], ""
    if args.merge:
        old_runs, old_warm, old_headers = load_previous(args.out)
        log_path = os.path.join(args.out, "sanitize.log")
        if os.path.isfile(log_path):
            with open(log_path) as f:
                old_log = f.read()
    headers = old_headers + [header]
    new_keys = set(runs)
    kept = [r for r in old_runs if key(r) not in new_keys]

    warm = [w for w in old_warm if (w["backend"], w["gate"]) not in pairs]
    if not args.no_warmup:
        for b, g in pairs:
            cmd = child_command(args, b, g)
            rc, log, secs, _ = run_one(cmd, env, max(args.timeout, 600.0))
            ok = rc == 0 and CHILD_OK in log
            warm.append({"backend": b, "gate": g, "command": cmd, "returncode": rc, "seconds": round(secs, 1),
                         "ok": ok, "log": log})
            print(f"warm-up {b} {g}: exit {rc}, {secs:.1f} s, {'footprint ok' if ok else 'NOT OK'}", flush=True)
            if not ok:
                print(log[-3000:], flush=True)

    results: list[Result] = []
    for t, b, g in runs:
        cmd = sanitizer_command(sanitizer, t, args, b, g)
        res = Result(t, b, g, cmd)
        res.returncode, res.log, res.seconds, res.timed_out = run_one(cmd, env, args.timeout)
        res.seconds = round(res.seconds, 1)
        parse_output(res.log, res)
        res.verdict = verdict(res)
        results.append(res)
        print(table([res])[-1], flush=True)
        write_outputs(args.out, args, kept + results, warm, headers, old_log)   # what ran so far survives a kill
    everything = sorted(kept + results, key=lambda r: tuple(ORDER[k] for k in key(r)))
    print("\n".join(table(everything)))
    print(f"written: {os.path.abspath(args.out)}/summary.md, summary.json, sanitize.log")
    bad = [r for r in everything if r.verdict != "clean"] + [w for w in warm if not w["ok"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
