"""Development bench of the TileLang backend: precompile, criterion sweep, per-phase time estimates, A/B of versions.

    python bench/dev/tilelang_dev.py precompile --arch sm_90a --sms 132     # fill TileLang's disk cache (no GPU needed)
    python bench/dev/tilelang_dev.py check [--batches 16 64 256 512]        # the criterion, every family, both gates
    python bench/dev/tilelang_dev.py phases [--batch 256] [--gate kda]      # profiling builds: one phase doubled each
    python bench/dev/tilelang_dev.py ab OLD NEW [--verify kda gdn]          # A/B of kernel versions, one run
    python bench/dev/tilelang_dev.py counts [--gates kda gdn]               # static instructions per phase (no GPU)

``phases`` builds variants of the kernel in which one phase runs twice or not at all (a *profiling build*: the
program loop calls its phases through a ``Phases`` object, :mod:`leapquant.tilelang.kernel`, and a variant replaces
some; the shipped kernel has no switches), times them like the benchmark (L2-cold, 8 rotated slot sets, CUDA graph
replay, CUDA events, median), and reports variant - full as the phase's cost. Phases overlap across the two consumer
groups and with memory traffic, so the differences are an estimate, not an exact partition.

``counts`` compiles the clock-stamp build (``FlushConfig.clock="phases"``, no GPU needed: TileLang and nvcc) and
counts the SASS instructions between consecutive stamps (each stamp reads SR_CLOCKLO once): the static instructions
per thread of each segment of the program loop (:func:`leapquant.tilelang.kernel.clock_segments`), with the loops
(backward branches) in it. A segment whose warps take different branches (the intervals: warps 0-3 orthonormalise,
4-7 stage) counts both paths.

``ab`` takes kernel generators of several versions: a copy of the package directory leapquant/tilelang/ (e.g.
``mkdir OLD && git archive REV leapquant/tilelang | tar -x -C OLD``, then ``OLD/leapquant/tilelang``) or, for
versions whose generator was one file, that file (``git show REV:leapquant/tilelang/kernel.py > OLD.py``). Each is
imported inside the installed leapquant package (its ``..layout`` and ``..numerics`` are the installed ones) and
called with the installed backend's arguments.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

#: the staging's units (the round's first program: stage; the others: the pieces the staging warps run)
STAGING = ("stage", "stage_window_half", "stage_column", "stage_row")
PROFILE_VARIANTS = {
    # name: (phases run twice, phases replaced by empty units). Only phases that are idempotent are repeated (the
    # program's data stays the same, so no variant wanders into NaN/denormal slow paths); a phase's cost is
    # variant - full. ranking_only keeps the due-program ranking and nothing else (nothing is written).
    "full": ((), ()),
    "x2_rebuild": (("rebuild",), ()),
    "x2_project": (("project_t", "project", "sum_partials"), ()),
    "x2_gram": (("gram",), ()),
    "x2_tokens": (("tokens",), ()),
    "x2_scales_v": (("scales_v",), ()),
    "x2_codes": (("codes",), ()),
    # not idempotent but numerically harmless (the second pass works on finite data of the same scale)
    "x2_residual": (("residual",), ()),
    "x2_scales_k": (("scales_k",), ()),
    # the staging left out: the flush computes on whatever the shared memory holds (its cost: full - no_stage)
    "no_stage": ((), STAGING),
    "ranking_only": ((), STAGING + ("load_codes", "rebuild", "project_t", "project", "sum_partials", "gram",
                                    "cholesky", "store_basis", "tokens", "residual", "scales_k", "scales_v",
                                    "codes")),
}
PRECOMPILE_HEADS = (32, 16, 8)


def profiling_phases(variant):
    """The kernel's phases with those of ``variant`` (see PROFILE_VARIANTS) repeated or emptied."""
    import tilelang.language as T

    from leapquant.tilelang.kernel import Phases
    twice, skip = variant
    ph = Phases()

    @T.macro
    def empty(*args):
        T.evaluate(0)

    def doubled(unit):
        @T.macro
        def run_twice(*args):
            unit(*args)
            unit(*args)
        return run_twice

    for name in twice:
        setattr(ph, name, doubled(getattr(ph, name)))
    for name in skip:
        setattr(ph, name, empty)
    return ph


def cmd_precompile(args) -> None:
    from leapquant.tilelang.config import FlushConfig
    from leapquant.tilelang.kernel import compile_flush
    for heads in args.heads:
        for gate in args.gates:
            t0 = time.time()
            compile_flush(FlushConfig(heads, gate, args.arch, args.sms))
            print(f"built heads={heads} gate={gate} arch={args.arch} sms={args.sms}: {time.time() - t0:.1f} s",
                  flush=True)
    if args.profile:
        for name, variant in PROFILE_VARIANTS.items():
            if name != "full":
                cfg = FlushConfig(32, args.profile_gate, args.arch, args.sms)
                t0 = time.time()
                compile_flush(cfg, profiling_phases(variant))
                print(f"built profiling variant {name}: {time.time() - t0:.1f} s", flush=True)


def cmd_check(args) -> int:
    import leapquant as lq
    from leapquant import criterion, families
    from leapquant.bench import CheckData
    dev = torch.device("cuda")
    lines, failed = [], 0
    for gate in args.gates:
        data = CheckData(gate, 32, args.rows, args.seed, dev)
        for batch in args.batches:
            t, exact, ref, labels = data.batch(batch)
            fn = lq.run if gate == "kda" else lq.run_gdn
            names = ("codes", "s_k", "s_v", "u", "q", "kbuf", "ubuf") + (
                ("gbuf", "w", "pcum") if gate == "kda" else ("w", "p"))
            out = fn(*(t[n] for n in names), data.q0, backend="tilelang")
            v = criterion.judge(exact, list(out), list(ref), labels=labels, name=f"tilelang {gate} b{batch}")
            failed += not v.passed
            lines.append(f"families {gate} batch={batch}x32: worst score {v.worst_score:.4f} :: {v.message}")
            print(lines[-1], flush=True)
        hard = [(f"{fam} {gate} 8x32", families.make_case(8, 32, gate, seed=3, families=[fam]))
                for fam in ("tiny", "pcum_below_1000", "window_rank2", "rank1_noise", "zero", "huge")]
        hard += [(f"heads={heads} {gate} 32 rows", families.make_case(32, heads, gate, seed=heads))
                 for heads in (16, 8)]
        for name, case in hard:
            v = _judge_case(case.to(dev), f"tilelang {name}")
            failed += not v.passed
            lines.append(f"{name}: worst score {v.worst_score:.4f} :: {v.message}")
            print(lines[-1], flush=True)
    print(f"CHECK {'PASS' if not failed else f'FAIL ({failed})'}")
    return 1 if failed else 0


def _timing_pool(batch, gate, due):
    """A pool of 8 disjoint slot sets of ``batch`` rows x 32 heads filled with in-domain noise, the sets' idx
    tensors, and the kernel call for one set (everything the phase and A/B timings share)."""
    from leapquant.bench import due_pattern
    from leapquant.layout import QMAX, Pool
    from leapquant.reference import default_q0
    from leapquant.tilelang import _call_args, config_for
    dev = torch.device("cuda")
    nsets, heads = 8, 32
    pool = Pool(nsets * batch + 1, heads, device=dev, gate=gate)
    g = torch.Generator().manual_seed(0)
    pool.raw.copy_(torch.randn(pool.raw.shape, generator=g).to(dev))
    pool.s_k.copy_(torch.rand(pool.s_k.shape, generator=g).add_(0.1).to(dev))
    pool.s_v.copy_(torch.rand(pool.s_v.shape, generator=g).add_(0.1).to(dev))
    pool.tokens.copy_((0.1 * torch.randn(pool.tokens.shape, generator=g)).to(dev, torch.float16))
    pool.codes.copy_(torch.randint(-int(QMAX), int(QMAX) + 1, pool.codes.shape, generator=g, dtype=torch.int8).to(dev))
    pool.kbuf.copy_(torch.randn(pool.kbuf.shape, generator=g).to(dev, torch.bfloat16))
    pool.ubuf.copy_(torch.randn(pool.ubuf.shape, generator=g).to(dev, torch.bfloat16))
    q0 = default_q0(dev)
    sets = [torch.arange(1 + s * batch, 1 + (s + 1) * batch, dtype=torch.int32, device=dev) for s in range(nsets)]
    hc, _ = due_pattern(nsets, batch, heads, due, 0, dev)
    for s in range(nsets):                  # hcnt set once per set (the flush never changes it)
        pool.hcnt[sets[s].long()] = hc[s]
    _, args = _call_args(pool)

    def call(kern, s):
        kern(*args, q0, sets[s])
    call.pool = pool                        # for tools that read the pool back (tilelang_clock.py)
    call.sets = sets                        # the slot sets' idx (ncu_profile.py calls other backends on them)
    return config_for(pool), nsets, call


def _time_kernels(kernels, args):
    """Median CUDA-event time per call of each (name, compiled kernel), L2-cold in rotation over the slot sets."""
    from leapquant.bench_common import time_calls
    results = {}
    for name, kern in kernels:
        times, method = time_calls(lambda s, kern=kern: args.call(kern, s), args.nsets, args.repeats,
                                   torch.device("cuda"), 10.0, capture=True)
        times.sort()
        results[name] = times[len(times) // 2]
        print(f"{name:20s} {results[name]:9.1f} us  ({method})", flush=True)
    return results


def cmd_phases(args) -> int:
    from leapquant.tilelang.kernel import compile_flush
    cfg, args.nsets, args.call = _timing_pool(args.batch, args.gate, args.due)
    kernels = ((name, compile_flush(cfg, profiling_phases(v) if name != "full" else None))
               for name, v in PROFILE_VARIANTS.items())
    results = _time_kernels(kernels, args)
    full = results["full"]
    print("\n| variant | median us | variant - full (phase estimate) us |")
    print("| --- | --- | --- |")
    for name, t in results.items():
        print(f"| {name} | {t:.1f} | {t - full:+.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(batch=args.batch, heads=32, gate=args.gate, due=args.due, results_us=results), f, indent=1)
    return 0


def load_kernel_module(path, package="leapquant"):
    """The kernel generator module of another version: ``path`` a copy of the package directory leapquant/tilelang/
    (its ``kernel`` module is returned) or a single generator file. It is imported as a module (directory: a package)
    inside ``package``, under a name of its own, so that its relative imports of the package's other modules work
    (``..layout``, ``..numerics``: the installed ones) and nothing of the installed backend is replaced; a directory's
    ``__init__`` is not run (it would register a second backend)."""
    import hashlib
    import importlib
    import importlib.util
    import types

    importlib.import_module(package)                  # the parent package of the loaded module
    stem = os.path.basename(os.path.normpath(path)).replace(".", "_").replace("-", "_")
    if os.path.isdir(path):
        digest = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:8]
        name = f"{package}._ab_{stem}_{digest}"
        if name not in sys.modules:
            pkg = types.ModuleType(name)
            pkg.__path__ = [os.path.abspath(path)]
            pkg.__package__ = name
            sys.modules[name] = pkg
        return importlib.import_module(name + ".kernel")
    if package == "leapquant":                      # a single file's relative imports are ``..layout``
        package = "leapquant.tilelang"
        importlib.import_module(package)
    name = f"{package}._ab_{stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def label(path):
    """A kernel version's name in the tables: a file's name, a directory's path."""
    return os.path.basename(path) if os.path.isfile(path) else os.path.normpath(path)


def _judge_case(case, name):
    """The TileLang backend's flush of ``case`` (on the GPU) judged by the SPEC criterion."""
    from leapquant import criterion
    S = criterion.exact_state(*case.checkpoint(), case.tensors["kbuf"], case.tensors["ubuf"], case.tensors["w"],
                              **case.gate_kwargs())
    return criterion.judge(S, case.run(backend="tilelang"), case.reference(), labels=case.labels, name=name)


def _verify_variant(mod, path, gates) -> bool:
    """Judge a kernel generator from a file by the SPEC criterion before it is timed: its kernel, in place of the
    shipped one, flushes every family (8 rows x 32 heads, both gates) through the public API."""
    import leapquant.tilelang as lt
    from leapquant import families
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    ok = True
    for gate in gates:
        cfg = lt.FlushConfig(32, gate, lt.ARCHS[(props.major, props.minor)], props.multi_processor_count)
        with lt.use_kernel(cfg, mod.compile_flush(mod.FlushConfig(32, gate, cfg.arch, cfg.num_sms))):
            v = _judge_case(families.make_case(8, 32, gate, seed=5).to(dev), f"{label(path)} {gate}")
        ok &= v.passed
        print(f"verify {label(path)} {gate}: {'PASS' if v.passed else 'FAIL'} worst score "
              f"{v.worst_score:.4f} :: {v.message}", flush=True)
    return ok


def cmd_ab(args) -> int:
    """Time kernel generators from files (A/B of kernel versions in one run, same pool and method)."""
    rows = []
    if args.verify:                             # a kernel that fails the criterion is not timed
        failed = [p for p in dict.fromkeys(args.kernels) if not _verify_variant(load_kernel_module(p), p, args.verify)]
        args.kernels = [p for p in args.kernels if p not in failed]
    for due in args.due:
        cfg, args.nsets, args.call = _timing_pool(args.batch, args.gate, due)
        kernels = []
        for i, path in enumerate(args.kernels):
            mod = load_kernel_module(path)
            rep = args.kernels[:i].count(path)          # a file named twice (ABAB) is timed twice, reported twice
            kernels.append((f"{label(path)}{f'#{rep + 1}' if rep else ''}:{due}", mod.compile_flush(
                mod.FlushConfig(cfg.num_heads, cfg.gate, cfg.arch, cfg.num_sms))))
        rows += _time_kernels(kernels, args).items()
    print("\n| kernel:due | median us |\n| --- | --- |")
    for name, t in rows:
        print(f"| {name} | {t:.1f} |")
    return 0


def segment_counts(sass: str) -> list[dict]:
    """Per segment between consecutive SR_CLOCKLO reads of an nvdisasm listing: {"instructions", "loops" (backward
    branches), "ops" (a Counter of opcodes)}."""
    import collections
    import re
    ins, labels = [], {}
    for line in sass.splitlines():
        m = re.match(r"^\s*\.(L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = re.match(r"\s+/\*[0-9a-f]{4,5}\*/\s+(.*?);?\s*(/\*.*)?$", line)
        if m:
            ins.append(m.group(1).strip())
    clocks = [i for i, text in enumerate(ins) if "SR_CLOCKLO" in text]
    out = []
    for a, b in zip(clocks, clocks[1:]):
        ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in ins[a:b])
        loops = 0
        for i in range(a, b):
            m = re.search(r"BRA\s+`?\(?\.?(L_x_\d+)", ins[i])
            loops += bool(m and labels.get(m.group(1), i + 1) <= i)
        out.append({"instructions": b - a, "loops": loops, "ops": ops})
    return out


def clock_build_sass(gate: str, arch: str, sms: int) -> str:
    """The nvdisasm listing of the clock-stamp build for ``gate`` (32 heads), compiled in a child process with its own
    TileLang cache (where the cubin is found)."""
    import glob
    import subprocess
    import tempfile
    import triton.backends.nvidia as nv
    nvdisasm = shutil.which("nvdisasm") or os.path.join(os.path.dirname(nv.__file__), "bin", "nvdisasm")
    with tempfile.TemporaryDirectory() as cache:
        code = ("from leapquant.tilelang import config, kernel; "
                f"kernel.compile_flush(config.FlushConfig(32, {gate!r}, {arch!r}, {sms}, clock='phases'))")
        env = dict(os.environ, TILELANG_CACHE_DIR=cache)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
        subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
        cubin = glob.glob(os.path.join(cache, "**", "kernel.cubin"), recursive=True)
        assert len(cubin) == 1, cubin
        run = subprocess.run([nvdisasm, "-c", cubin[0]], check=True, capture_output=True, text=True)
    return run.stdout


def cmd_counts(args) -> int:
    from leapquant.tilelang.config import FlushConfig
    from leapquant.tilelang.kernel import clock_segments
    for gate in args.gates:
        names = clock_segments(FlushConfig(32, gate, args.arch, args.sms, clock="phases"))
        counts = segment_counts(clock_build_sass(gate, args.arch, args.sms))
        assert len(counts) == len(names), (len(counts), len(names))
        print(f"\n{gate}, {args.arch}: static SASS instructions per thread between clock stamps\n")
        print("| segment | instructions | loops | most frequent |\n| --- | --- | --- | --- |")
        for name, c in zip(names, counts):
            top = ", ".join(f"{op} {n}" for op, n in c["ops"].most_common(4))
            print(f"| {name.replace('|', '/')} | {c['instructions']} | {c['loops']} | {top} |")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("precompile")
    p.add_argument("--arch", default="sm_90a")
    p.add_argument("--sms", type=int, default=132)
    p.add_argument("--heads", type=int, nargs="*", default=list(PRECOMPILE_HEADS))
    p.add_argument("--gates", nargs="*", default=["kda", "gdn"])
    p.add_argument("--profile", action="store_true", help="also the profiling variants (32 heads)")
    p.add_argument("--profile-gate", default="kda")
    c = sub.add_parser("check")
    c.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256, 512])
    c.add_argument("--gates", nargs="+", default=["kda", "gdn"])
    c.add_argument("--rows", type=int, default=16)
    c.add_argument("--seed", type=int, default=0)
    f = sub.add_parser("phases")
    f.add_argument("--batch", type=int, default=256)
    f.add_argument("--gate", default="kda")
    f.add_argument("--due", default="all")
    f.add_argument("--repeats", type=int, default=50)
    f.add_argument("--json", default=None)
    ab = sub.add_parser("ab")
    ab.add_argument("kernels", nargs="+", help="kernel generators: copies of leapquant/tilelang/ or single files")
    ab.add_argument("--batch", type=int, default=256)
    ab.add_argument("--gate", default="kda")
    ab.add_argument("--due", nargs="+", default=["all", "sixteenth"])
    ab.add_argument("--repeats", type=int, default=50)
    ab.add_argument("--verify", nargs="*", default=[], help="gates to judge each kernel on first (SPEC criterion)")
    n = sub.add_parser("counts")
    n.add_argument("--gates", nargs="+", default=["kda", "gdn"])
    n.add_argument("--arch", default="sm_90a")
    n.add_argument("--sms", type=int, default=132)
    args = ap.parse_args()
    if args.cmd == "counts":
        return cmd_counts(args)
    if args.cmd == "precompile":
        cmd_precompile(args)
        return 0
    if args.cmd == "check":
        return cmd_check(args)
    if args.cmd == "ab":
        return cmd_ab(args)
    return cmd_phases(args)


if __name__ == "__main__":
    sys.exit(main())
