"""Clock-stamp profile of a TileLang kernel generator: cycles per program of each segment of the program loop.

    python bench/tilelang_clock.py build leapquant/tilelang/kernel.py OUT.py     # write the profiling build (CPU)
    python bench/tilelang_clock.py run OUT.py 256:all 256:sixteenth 4:all        # time it on the GPU

``build`` rewrites the generator's program loop so that thread 0 of each consumer group reads clock64() after every
statement of the loop (each phase, each group barrier) and adds the cycles since its previous stamp to a counter in
the pool's header words (``raw[0:2 * (segments + 1)]``: [programs of group 0, of group 1, then one pair per
segment]); the shipped kernel keeps no counters. ``run`` compiles the build on first use (to spare GPU time,
precompile it on the CPU with the same TILELANG_CACHE_DIR and carry the cache). A segment that ends at a group barrier
measures the group's critical path; one that does not (rebuild, the products) measures warp 0's own progress.
``batch 4`` (128 programs on 132 CTAs) leaves one group alone on its SM: the uncontended latency of a program.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

LOOP_START = "                        ph.stage_program(raw32"
LOOP_END = "                    T.sync_threads()\n\n    return leapquant_flush"
BODY_INDENT = 24
MARK = ("if t == 0:\n    T.evaluate(T.call_extern('handle', 'lq_mark', T.address_of(raw32[{k} * 2 + g]), "
        "T.address_of(stamp[0])))")
PRELUDE_MARK = ('__device__ __forceinline__ void lq_mark(int* ctr, int64_t* stamp) {\n'
                '  long long n = clock64(); atomicAdd(ctr, (int)(n - *stamp)); *stamp = n;\n}\n')


def build(src: str, dst: str) -> list[str]:
    """Write the profiling build of generator ``src`` to ``dst``; returns the segment names."""
    s = open(src).read()
    s = s.replace('PRELUDE = r"""\n', 'PRELUDE = r"""\n' + PRELUDE_MARK, 1)
    start, end = s.index(LOOP_START), s.index(LOOP_END)
    pad = " " * BODY_INDENT
    out = [pad + "if t == 0:", pad + "    stamp[0] = T.call_extern(I64, 'clock64')",
           pad + "    T.evaluate(T.call_extern('handle', 'atomicAdd', T.address_of(raw32[g]), 1))"]
    names, stmt = [], []
    for ln in s[start:end].split("\n"):
        out.append(ln)
        if not ln.strip():
            continue
        stmt.append(ln.strip())
        depth = sum(x.count("(") - x.count(")") for x in stmt)
        indent = len(ln) - len(ln.lstrip())
        if depth == 0 and not stmt[0].startswith(("if ", "for ", "#")) and indent >= BODY_INDENT:
            if indent == BODY_INDENT or len(stmt) > 1:    # a statement of the loop body, not of a nested block
                name = stmt[0].split("(")[0].replace("ph.", "")
                names.append(f"{len(names) + 1:02d}_{name}")
                out += [pad + m for m in MARK.format(k=len(names)).split("\n")]
            stmt = []
        elif depth == 0:
            stmt = []
    s = s[:start] + "\n".join(out) + s[end:]
    anchor = "            tx = T.get_thread_binding()\n"
    s = s.replace(anchor, anchor + "            stamp = T.alloc_local((1,), I64)\n", 1)
    with open(dst, "w") as f:
        f.write(s)
    with open(dst + ".segments", "w") as f:
        f.write("\n".join(names))
    return names


def run(path: str, points: list[str]) -> None:
    import torch

    import tilelang_dev as td
    names = open(path + ".segments").read().split("\n")
    mod = td.load_kernel_module(path)
    for point in points or ["256:all"]:
        batch, due = point.split(":")
        cfg, nsets, call = td._timing_pool(int(batch), "kda", due)
        pool = call.pool
        kern = mod.compile_flush(mod.FlushConfig(cfg.num_heads, cfg.gate, cfg.arch, cfg.num_sms))
        for s in range(nsets):                  # warm-up (first touch), then one counted call per slot set
            call(kern, s)
        torch.cuda.synchronize()
        counters = pool.raw.view(torch.int32)[: 2 * (len(names) + 1)]
        counters.zero_()
        for s in range(nsets):
            call(kern, s)
        torch.cuda.synchronize()
        c = counters.cpu().double().tolist()
        progs = c[0:2]
        print(f"\n{os.path.basename(path)} batch {batch} due {due}: programs per group {progs}")
        print("| segment | cycles/program, group 0 | group 1 |\n| --- | --- | --- |")
        tot = [0.0, 0.0]
        for k, n in enumerate(names, 1):
            v = [c[2 * k + i] / max(progs[i], 1) for i in range(2)]
            tot = [tot[i] + v[i] for i in range(2)]
            print(f"| {n} | {v[0]:.0f} | {v[1]:.0f} |")
        print(f"| total | {tot[0]:.0f} | {tot[1]:.0f} |")


if __name__ == "__main__":
    if sys.argv[1] == "build":
        print("\n".join(build(sys.argv[2], sys.argv[3])))
    else:
        run(sys.argv[2], sys.argv[3:])
