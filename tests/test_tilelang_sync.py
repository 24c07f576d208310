"""Synchronisation of the TileLang kernel, checked on its generated CUDA source (CPU: TileLang lowers it, no nvcc).

The barrier check walks one iteration of the program loop of the generated source, once per warp of a group, with the
program's successor present and absent, and records the named barriers each warp passes. Every warp of a group must
pass the same number of barriers between two group barriers: compute-sanitizer's racecheck pairs barriers by how many
each thread has passed, and with the staging warps one barrier ahead it reported the partials of S P (written before a
group barrier, read after it) as 1.38 M RAW hazards. Each barrier a warp passes must also be passed by as many threads
as it counts (what synccheck checks at run time).
"""
from __future__ import annotations

import re

import pytest

from leapquant.tilelang import config as tl_config     # no tilelang import: the kernel's geometry


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
    cfg = tl_config.FlushConfig(num_heads=heads, gate=gate, arch="sm_90a", num_sms=sms)
    target = tvm.target.Target(cfg.target)
    with tvm.transform.PassContext(config=tl_config.PASS_CONFIGS), target:
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
    group_threads, warp = tl_config.GROUP_THREADS, tl_config.WARP
    for g in range(tl_config.GROUPS):
        group_bar = (tl_config.FIRST_GROUP_BARRIER + g, group_threads)
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


def test_staging_barriers_are_disjoint():
    k = tl_config
    ids = [k.FIRST_GROUP_BARRIER + g for g in range(k.GROUPS)] + [k.FIRST_STAGE_BARRIER + g for g in range(k.GROUPS)] \
        + [k.FIRST_ORTH_BARRIER + g for g in range(k.GROUPS)]
    assert len(set(ids)) == len(ids) and 0 not in ids and max(ids) < 16
