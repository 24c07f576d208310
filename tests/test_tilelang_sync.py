"""Synchronisation of the TileLang kernel, checked on its generated CUDA source (CPU: TileLang lowers it, no nvcc),
and the compute-sanitizer driver bench/sanitize.py (its arguments, its reading of the tools' output and its child's
flush on the CPU through the reference backend).

The barrier check walks one iteration of the program loop of the generated source, once per warp of a group, with the
program's successor present and absent, and records the named barriers each warp passes. Every warp of a group must
pass the same number of barriers between two group barriers: compute-sanitizer's racecheck pairs barriers by how many
each thread has passed, and with the staging warps one barrier ahead it reported the partials of S P (written before a
group barrier, read after it) as 1.38 M RAW hazards. Each barrier a warp passes must also be passed by as many threads
as it counts (what synccheck checks at run time).
"""
from __future__ import annotations

import json
import os
import re
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


# ---- the generated source ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tl_kernel():
    pytest.importorskip("tilelang")
    from leapquant.tilelang import kernel
    return kernel


def kernel_source(kernel, gate: str, heads: int = 32, sms: int = 132) -> str:
    """The kernel's CUDA source as TileLang generates it (lowered with the kernel's pass configs; nvcc not run)."""
    import tilelang  # noqa: F401  (puts its bundled tvm on the path)
    import tvm
    from tilelang.engine.lower import lower
    cfg = kernel.FlushConfig(num_heads=heads, gate=gate, arch="sm_90a", num_sms=sms)
    target = tvm.target.Target(cfg.target)
    with tvm.transform.PassContext(config=kernel.PASS_CONFIGS), target:
        return lower(kernel.make_flush_func(cfg), target=target).kernel_source


BARRIER = re.compile(r"tl::__sync_thread_partial\((.*),\s*(\d+)\);\s*$")


def program_loop(src: str) -> list[str]:
    """The body of the program loop (``for (int it = 0; ...) { ... }``), one statement per line."""
    lines = [ln.strip() for ln in src.splitlines()]
    start = next(i for i, ln in enumerate(lines) if ln.startswith("for (int it = 0;"))
    depth, body = 0, []
    for ln in lines[start:]:
        depth += ln.count("{") - ln.count("}")
        body.append(ln)
        if depth == 0:
            return body[1:-1]
    raise AssertionError("unbalanced braces after the program loop")


def parse_block(lines: list[str], i: int = 0):
    """Statements from ``lines[i]`` to the end of the block: ('bar', id expr, count), ('if', cond, then, else),
    ('for', header, body), ('other', text). Returns (statements, index after the block, whether the block ended in
    ``} else {``, i.e. was an if's then-branch followed by its else-branch)."""
    out = []
    while i < len(lines):
        ln = lines[i]
        if ln == "}":
            return out, i + 1, False
        if ln == "} else {":
            return out, i + 1, True
        if ln.startswith("if (") and ln.endswith(") {"):
            then, i, has_else = parse_block(lines, i + 1)
            other = []
            if has_else:
                other, i, nested = parse_block(lines, i)
                assert not nested, f"else-if chain after {ln!r}"
            out.append(("if", ln[len("if ("):-len(") {")], then, other))
            continue
        if ln.startswith("for (") and ln.endswith("{"):
            body, i, _ = parse_block(lines, i + 1)
            out.append(("for", ln, body))
            continue
        m = BARRIER.search(ln)
        if m:
            out.append(("bar", m.group(1), int(m.group(2))))
        elif "__syncthreads()" in ln:
            out.append(("bar", "0", 0))
        elif ln.endswith("{") or ln.startswith("}"):
            raise AssertionError(f"statement the barrier walk does not know: {ln!r}")
        else:
            out.append(("other", ln))
        i += 1
    return out, i, False


def has_barrier(stmts) -> bool:
    for s in stmts:
        if s[0] == "bar" or (s[0] == "if" and (has_barrier(s[2]) or has_barrier(s[3]))) or \
                (s[0] == "for" and has_barrier(s[2])):
            return True
    return False


def c_eval(expr: str, env: dict[str, int]) -> int:
    """A condition or barrier id of the generated source (integer arithmetic on the thread index, the program loop's
    counter and the round's size) evaluated for ``env``."""
    py = expr.replace("((int)threadIdx.x)", "tx").replace("((int)blockIdx.x)", "bid")
    py = re.sub(r"\(int64_t\)", "", py).replace("/", "//").replace("&&", " and ").replace("||", " or ")
    return int(eval(py, {"__builtins__": {}, "max": max, "min": min}, env))  # noqa: S307 - the kernel's own source


def walk(stmts, env, passed: list[tuple[int, int]]) -> None:
    """Append the barriers (id, thread count) that the thread of ``env`` passes through ``stmts``."""
    for s in stmts:
        if s[0] == "bar":
            passed.append((c_eval(s[1], env), s[2]))
        elif s[0] == "if" and has_barrier(s[2] + s[3]):
            walk(s[2] if c_eval(s[1], env) else s[3], env, passed)
        elif s[0] == "for" and has_barrier(s[2]):
            raise AssertionError(f"a barrier inside a loop of the program loop: {s[1]!r}")


def barrier_trace(src: str, tx: int, more: bool) -> list[tuple[int, int]]:
    """Barriers thread ``tx`` passes in one program-loop iteration, with (``more``) or without a next program."""
    body, _, _ = parse_block(program_loop(src))
    # block 0 of a round of 4 * 132 due programs holds 4: each group 2, so iteration 0 has a successor, 1 has not
    env = {"tx": tx, "bid": 0, "in_round": 4 * 132, "it": 0 if more else 1}
    passed: list[tuple[int, int]] = []
    walk(body, env, passed)
    return passed


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_every_warp_passes_the_same_barriers(tl_kernel, gate):
    src = kernel_source(tl_kernel, gate)
    group_threads, warp = tl_kernel.GROUP_THREADS, tl_kernel.WARP
    for g in range(tl_kernel.GROUPS):
        group_bar = (tl_kernel.FIRST_GROUP_BARRIER + g, group_threads)
        for more in (False, True):
            traces = {w: barrier_trace(src, g * group_threads + w * warp, more) for w in range(group_threads // warp)}
            # every warp: the same group barriers, and between two of them as many barriers of any kind
            shapes = {}
            for w, trace in traces.items():
                shape, n = [], 0
                for b in trace:
                    if b == group_bar:
                        shape.append(n)
                        n = 0
                    else:
                        n += 1
                shapes[w] = (tuple(shape), n)
            assert len(set(shapes.values())) == 1, (gate, g, more, shapes)
            assert shapes[0][0], "no group barrier in the program loop"
            # each barrier id: passed by as many threads as it counts, and by warps of this group only
            ids = {b for trace in traces.values() for b in trace}
            for bid, count in ids:
                assert 0 < bid < 16, f"barrier id {bid}"
                users = [w for w, trace in traces.items() if (bid, count) in trace]
                per_warp = {len([b for b in traces[w] if b == (bid, count)]) for w in users}
                assert len(per_warp) == 1 and len(users) * warp == count, (gate, g, more, bid, count, users)
            if more:       # the staging warps' barrier and its partner on warps 0-3
                assert len(ids) == 3, ids


def test_staging_barriers_are_disjoint(tl_kernel):
    k = tl_kernel
    ids = [k.FIRST_GROUP_BARRIER + g for g in range(k.GROUPS)] + [k.FIRST_STAGE_BARRIER + g for g in range(k.GROUPS)] \
        + [k.FIRST_ORTH_BARRIER + g for g in range(k.GROUPS)]
    assert len(set(ids)) == len(ids) and 0 not in ids and max(ids) < 16


# ---- bench/sanitize.py -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sanitize():
    sys.path.insert(0, BENCH)
    try:
        import sanitize
    finally:
        sys.path.remove(BENCH)
    return sanitize


def test_dry_run_lists_every_run(sanitize, capsys):
    assert sanitize.main(["--dry-run", "--sanitizer", sys.executable]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if not ln.startswith("#")]
    assert len(lines) == len(sanitize.TOOLS) * len(sanitize.BACKENDS) * len(sanitize.GATES)
    for tool in sanitize.TOOLS:
        mine = [ln for ln in lines if f"--tool {tool} " in ln]
        assert len(mine) == 4
        assert all("--error-exitcode 86" in ln and "--child" in ln and "--rows 32 --heads 32" in ln for ln in mine)
        assert all(("--racecheck-report analysis" in ln) == (tool == "racecheck") for ln in mine)


def test_dry_run_subset(sanitize, capsys):
    assert sanitize.main(["--dry-run", "--sanitizer", sys.executable, "--tools", "racecheck", "--backends", "tilelang",
                          "--gates", "gdn", "--racecheck-report", "all", "--no-warmup"]) == 0
    out = capsys.readouterr().out.splitlines()
    runs = [ln for ln in out if not ln.startswith("#")]
    assert len(runs) == 1 and "--racecheck-report all" in runs[0] and "--backend tilelang --gate gdn" in runs[0]
    assert not any("warm-up" in ln for ln in out)


def test_bad_arguments(sanitize):
    for argv in (["--tools", "nope", "--dry-run"], ["--rows", "1", "--dry-run"], ["--due", "0", "--dry-run"], []):
        with pytest.raises(SystemExit) as exc:
            sanitize.parse_args(argv)
        assert exc.value.code == 2


ANALYSIS_LOG = """========= COMPUTE-SANITIZER
[child] footprint ok
========= Error: Race reported between Write access at leapquant_flush_kernel+0xabc0 in tvm_kernels.cu:752
=========     and Read access at leapquant_flush_kernel+0xb750 in tvm_kernels.cu:762 [20224 hazards]
========= Error: Race reported between Write access at leapquant_flush_kernel+0xabd0 in tvm_kernels.cu:752
=========     and Read access at leapquant_flush_kernel+0xb760 in tvm_kernels.cu:762 [20224 hazards]
========= RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)
"""
HAZARD_LOG = """========= Error: Potential RAW hazard detected at __shared__ 0x6800 in block (5,0,0) :
=========     Write Thread (224,0,0) at leapquant_flush_kernel+0xabc0 in tvm_kernels.cu:752
=========     Read Thread (64,0,0) at leapquant_flush_kernel+0xb750 in tvm_kernels.cu:762
=========     Current Value : 15
[child] footprint ok
========= RACECHECK SUMMARY: 100 hazards displayed (1376288 errors, 0 warnings)
"""


def test_reads_racecheck_reports(sanitize):
    r = sanitize.Result("racecheck", "tilelang", "kda", [], returncode=86)
    sanitize.parse_output(ANALYSIS_LOG, r)
    assert (r.errors, r.warnings, r.hazards) == (2, 0, 40448)
    assert r.pairs == {"Write tvm_kernels.cu:752 / Read tvm_kernels.cu:762": 40448}
    assert sanitize.verdict(r) == "ERRORS"
    r = sanitize.Result("racecheck", "tilelang", "kda", [], returncode=86)
    sanitize.parse_output(HAZARD_LOG, r)
    assert (r.errors, r.displayed) == (1376288, 100)
    assert r.pairs == {"RAW: Write tvm_kernels.cu:752 / Read tvm_kernels.cu:762": 1}
    clean = "[child] footprint ok\n========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n"
    r = sanitize.Result("racecheck", "triton", "gdn", [], returncode=0)
    sanitize.parse_output(clean, r)
    assert (r.errors, r.hazards, sanitize.verdict(r)) == (0, 0, "clean")


def test_reads_other_tools_and_failures(sanitize):
    ok = "[child] footprint ok\n========= ERROR SUMMARY: 0 errors\n"
    r = sanitize.Result("memcheck", "triton", "kda", [], returncode=0)
    sanitize.parse_output(ok, r)
    assert (r.errors, r.hazards, sanitize.verdict(r)) == (0, None, "clean")
    r = sanitize.Result("initcheck", "tilelang", "kda", [], returncode=86)
    sanitize.parse_output("========= ERROR SUMMARY: 3 errors\n", r)
    assert sanitize.verdict(r) == "ERRORS"
    r = sanitize.Result("synccheck", "tilelang", "gdn", [], returncode=1)      # the child raised
    sanitize.parse_output("Traceback ...\n========= ERROR SUMMARY: 0 errors\n", r)
    assert sanitize.verdict(r) == "FAILED (exit 1)"
    r = sanitize.Result("synccheck", "tilelang", "gdn", [], returncode=0)      # no flush footprint seen
    sanitize.parse_output("========= ERROR SUMMARY: 0 errors\n", r)
    assert sanitize.verdict(r) == "NO FLUSH"
    r = sanitize.Result("memcheck", "tilelang", "gdn", [], timed_out=True)
    assert sanitize.verdict(r) == "TIMEOUT"


def test_outputs_merge(sanitize, tmp_path):
    args = sanitize.parse_args(["--out", str(tmp_path)])
    a = sanitize.Result("memcheck", "triton", "kda", ["cs", "a"], returncode=0, errors=0, verdict="clean", log="A")
    sanitize.write_outputs(str(tmp_path), args, [a], [], [{"commit": "x"}], "")
    runs, warm, headers = sanitize.load_previous(str(tmp_path))
    assert [sanitize.key(r) for r in runs] == [("memcheck", "triton", "kda")] and headers == [{"commit": "x"}]
    b = sanitize.Result("racecheck", "tilelang", "gdn", ["cs", "b"], returncode=86, errors=5, verdict="ERRORS",
                        pairs={"Write f:1 / Read f:2": 7}, log="B")
    old_log = (tmp_path / "sanitize.log").read_text()
    sanitize.write_outputs(str(tmp_path), args, runs + [b], warm, headers + [{"commit": "y"}], old_log)
    data = json.loads((tmp_path / "summary.json").read_text())
    assert [(r["tool"], r["verdict"]) for r in data["runs"]] == [("memcheck", "clean"), ("racecheck", "ERRORS")]
    md = (tmp_path / "summary.md").read_text()
    assert "| racecheck | tilelang | gdn | 5 |" in md and "Write f:1 / Read f:2: 7 racing accesses" in md
    log = (tmp_path / "sanitize.log").read_text()
    assert log.count("===== memcheck triton kda") == 1 and "===== racecheck tilelang gdn" in log


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_child_flush_on_cpu(sanitize, gate, capsys):
    """The child's pool, call and footprint check, through the reference backend on the CPU."""
    args = sanitize.parse_args(["--child", "--backend", "reference", "--gate", gate, "--device", "cpu",
                                "--rows", "3", "--heads", "4", "--seed", "1"])
    assert sanitize.child(args) == 0
    assert sanitize.CHILD_OK in capsys.readouterr().out


def test_child_pool_and_footprint_check(sanitize):
    from leapquant.layout import L
    pool, idx, due = sanitize.build_pool(5, 4, "kda", 0.5, seed=3)
    assert sorted(idx.tolist()) == [0, 1, 2, 3, 4] and not due[0].any() and due.any() and (~due[1:]).any()
    assert (pool.hcnt[due] == L).all() and (pool.hcnt[~due] < L).all()
    after = sanitize.pool_to(pool, "cpu")
    assert after.raw.data_ptr() != pool.raw.data_ptr()
    assert "no due checkpoint changed (did the kernel run?)" in sanitize.check_footprint(pool, after, due)
    after.w[~due] += 1.0
    assert "window tensor w of a program not due changed" in sanitize.check_footprint(pool, after, due)
    assert torch.equal(pool.hcnt, after.hcnt)
