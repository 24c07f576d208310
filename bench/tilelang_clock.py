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
The stamps change the kernel's code: two builds' totals can differ by 5-7 % where the shipped kernels do not (session
5, bench/notes/tilelang.md), so compare kernels by A/B or with the CTA build, not by clock profiles.

    python bench/tilelang_clock.py cta-build leapquant/tilelang/kernel.py OUT.py     # per-CTA timestamp build
    python bench/tilelang_clock.py cta-run OUT.py 256:all 256:sixteenth
    python bench/tilelang_clock.py pro-build leapquant/tilelang/kernel.py OUT.py     # the round's prologue, stamped
    python bench/tilelang_clock.py pro-run OUT.py 256:sixteenth

``cta-build`` stamps (globaltimer, clock64, SM id) only outside the program loop: when each CTA starts, when each
group leaves its program loop and when the CTA ends, into the pool's header words from :data:`CTA_WORD` on.
``cta-run`` prints per call the span, the CTAs' start skew, their mean / max / min duration and the group loops'
cycles, and the slowest and fastest CTAs (block, SM, us): how evenly the persistent grid ends.

``pro-build`` stamps clock64 where a round's prologue passes its milestones (CTA start, ranking done; per group: the
first fetch's staging inputs landed, the first program staged, the barrier after it, the start of programs 0, 1, 2
and the loop's end); ``pro-run`` prints the mean cycles of each milestone after the CTA's start over the groups
that flush at least two programs: where the first program's extra cost goes at low load.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

LOOP_START = '                        ph.load_codes(cw, g, rbase, col0, pf_ck)'     # the program loop's first statement
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
        if depth == 0 and not stmt[0].startswith(("if ", "elif ", "else", "for ", "#")) and indent >= BODY_INDENT:
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


def _warm_points(path: str, points: list[str]):
    """For each "batch:due" point (default 256:all): the timing pool of bench/tilelang_dev.py and the build at
    ``path`` compiled for it, after one warm-up call per slot set (first touch)."""
    import torch

    import tilelang_dev as td
    mod = td.load_kernel_module(path)
    for point in points or ["256:all"]:
        batch, due = point.split(":")
        cfg, nsets, call = td._timing_pool(int(batch), "kda", due)
        kern = mod.compile_flush(mod.FlushConfig(cfg.num_heads, cfg.gate, cfg.arch, cfg.num_sms))
        for s in range(nsets):
            call(kern, s)
        torch.cuda.synchronize()
        yield batch, due, cfg, nsets, call, kern


CTA_WORD = 2048                 #: first header word of the CTA stamps (3 int64 per stamp, 4 stamps per CTA)
CTA_STAMP_WORDS = 6
CTA_WORDS = 4 * CTA_STAMP_WORDS
PRELUDE_CTA = ('__device__ __forceinline__ void lq_cta_stamp(int* p) {\n'
               '  long long* d = (long long*)p; long long t; unsigned sm;\n'
               '  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));\n'
               '  d[0] = t; d[1] = clock64(); d[2] = sm;\n}\n')


def _cta_stamp(word: str) -> str:
    return f"T.evaluate(T.call_extern('handle', 'lq_cta_stamp', T.address_of(raw32[{CTA_WORD} + bid * {CTA_WORDS}{word}])))"


def build_cta(src: str, dst: str) -> None:
    """Write the per-CTA timestamp build of generator ``src`` to ``dst``: stamp 0 at the CTA's start, 1 + g when
    group g leaves its program loop, 3 at the CTA's end (after the round's CTA-wide barrier)."""
    s = open(src).read()
    s = s.replace('PRELUDE = r"""\n', 'PRELUDE = r"""\n' + PRELUDE_CTA, 1)
    start = "            bar = FIRST_GROUP_BARRIER + g\n"
    assert start in s and LOOP_END in s
    s = s.replace(start, start + "            if tx == 0:\n                " + _cta_stamp("") + "\n", 1)
    pad = " " * (BODY_INDENT - 4)
    end = (f"{pad}if t == 0:\n{pad}    {_cta_stamp(f' + {CTA_STAMP_WORDS} + {CTA_STAMP_WORDS} * g')}\n"
           f"{pad}T.sync_threads()\n{pad}if tx == 0:\n{pad}    {_cta_stamp(f' + {3 * CTA_STAMP_WORDS}')}\n"
           "\n    return leapquant_flush")
    s = s.replace(LOOP_END, end, 1)
    with open(dst, "w") as f:
        f.write(s)


def _stamped_calls(path: str, points: list[str], words_per_cta: int, calls: int):
    """Per point: (batch, due, grid, stamps of each call), the stamps an int64 tensor [grid, words_per_cta / 2] read
    from the pool's header after the call (zeroed before it)."""
    import torch

    for batch, due, cfg, nsets, call, kern in _warm_points(path, points):
        grid = cfg.num_sms
        words = call.pool.raw[CTA_WORD:CTA_WORD + words_per_cta * grid]

        def each_call():
            for c in range(calls):
                words.zero_()
                call(kern, c % nsets)
                torch.cuda.synchronize()
                yield words.view(torch.int64).view(grid, words_per_cta // 2).cpu()
        yield batch, due, grid, each_call()


def run_cta(path: str, points: list[str], calls: int = 6) -> None:
    import torch

    for batch, due, grid, stamps in _stamped_calls(path, points, CTA_WORDS, calls):
        print(f"\n{os.path.basename(path)} batch {batch} due {due}, {grid} CTAs, us (globaltimer) and kcycles (clock64):")
        for c, flat in enumerate(stamps):
            d = flat.view(grid, 4, 3)
            t0 = d[:, 0, 0].min()
            dur = (d[:, 3, 0] - d[:, 0, 0]).double() / 1e3
            loops = torch.stack([d[:, 1, 1] - d[:, 0, 1], d[:, 2, 1] - d[:, 0, 1]], 1).double() / 1e3
            print(f"call {c}: span {(d[:, 3, 0].max() - t0).item() / 1e3:.1f} us, start skew "
                  f"{(d[:, 0, 0].max() - t0).item() / 1e3:.2f} us, CTA duration mean / max / min "
                  f"{dur.mean():.1f} / {dur.max():.1f} / {dur.min():.1f} us, group loop mean / max / min "
                  f"{loops.mean():.1f} / {loops.max():.1f} / {loops.min():.1f} kcycles")
        order = dur.argsort()
        print("slowest CTAs (block, SM, us):", [(int(b), int(d[b, 0, 2]), round(dur[b].item(), 1)) for b in order[-6:]])
        print("fastest CTAs (block, SM, us):", [(int(b), int(d[b, 0, 2]), round(dur[b].item(), 1)) for b in order[:6]])


PRO_WORDS = 48                  #: 24 int64 clock64 stamps per CTA: 0 start, 1 ranked, 2 + 7 g + k per group g,
                                #: 16 + k inside the ranking
PRO_GROUP = ("first inputs landed", "first staged", "barrier after staging", "program 0 starts", "program 1 starts",
             "program 2 starts (if any)", "loop end")
PRO_RANKING = ("q0 and token padding", "idx landed (slots)", "hcnt landed (ballots)", "counts scanned")
PRELUDE_PRO = ('__device__ __forceinline__ void lq_pro_stamp(int* p) {\n'
               '  *(long long*)p = clock64();\n}\n')


def _pro_stamp(k: str, cond: str, pad: str) -> str:
    return (f"{pad}if {cond}:\n{pad}    T.evaluate(T.call_extern('handle', 'lq_pro_stamp', "
            f"T.address_of(raw32[{CTA_WORD} + bid * {PRO_WORDS} + 2 * ({k})])))\n")


def build_pro(src: str, dst: str) -> None:
    """Write the prologue-stamp build of generator ``src`` to ``dst`` (see ``pro-build`` above)."""
    s = open(src).read()
    s = s.replace('PRELUDE = r"""\n', 'PRELUDE = r"""\n' + PRELUDE_PRO, 1)

    def after(anchor: str, text: str) -> None:
        nonlocal s
        assert s.count(anchor) == 1, anchor
        s = s.replace(anchor, anchor + text, 1)

    def after_line(i: int, text: str) -> int:
        """Insert ``text`` after the line holding position ``i``; returns where the text ends."""
        nonlocal s
        i = s.index("\n", i) + 1
        s = s[:i] + text + s[i:]
        return i + len(text)

    p12, p24 = " " * 12, " " * 24
    after("            bar = FIRST_GROUP_BARRIER + g\n", _pro_stamp("0", "tx == 0", p12))
    after("                    total[0] = ranked[0]\n", _pro_stamp("1", "tx == 0", " " * 20))
    after("            total[0] = 0\n", _pro_stamp("16", "tx == 0", p12))
    sig = s.index("def find_due_programs(")
    if "raw32" not in s[sig:s.index("):", sig)]:      # the ranking's stamps need the pool
        s = s.replace("def find_due_programs(idx, hcnt,", "def find_due_programs(raw32, idx, hcnt,", 1)
        s = s.replace("ph.find_due_programs(idx, hcnt,", "ph.find_due_programs(raw32, idx, hcnt,", 1)
    i = s.index("def find_due_programs(")
    for k in range(3):                  # the ranking's first three CTA barriers
        i = after_line(s.index("            T.sync_threads()\n", i), _pro_stamp(str(17 + k), "tx == 0", p12))
    after("# every thread's staging inputs landed\n", _pro_stamp("2 + 7 * g", "t == 0", p24))
    i, depth = s.index("ph.stage_program("), 0             # the end of the first program's staging call
    while True:
        depth += {"(": 1, ")": -1}.get(s[i], 0)
        i += 1
        if depth == 0 and s[i - 1] == ")":
            break
    i = after_line(i, _pro_stamp("2 + 7 * g + 1", "t == 0", p24))
    after_line(s.index("T.sync_threads(bar, GROUP_THREADS)", i), _pro_stamp("2 + 7 * g + 2", "t == 0", p24))
    after("                    for it in T.serial(n_mine):\n",
          _pro_stamp("2 + 7 * g + 3 + it", "(t == 0) & (it < 3)", " " * 24))
    pad = " " * (BODY_INDENT - 4)
    s = s.replace(LOOP_END, _pro_stamp("2 + 7 * g + 6", "t == 0", pad) + LOOP_END, 1)
    with open(dst, "w") as f:
        f.write(s)


def run_pro(path: str, points: list[str], calls: int = 6) -> None:
    import torch

    for batch, due, grid, stamps in _stamped_calls(path, points, PRO_WORDS, calls):
        rows = []
        for flat in stamps:
            d = flat.double()
            rel = (d - d[:, :1]) / 1e3
            rel[d == 0] = float("nan")          # a milestone this CTA never passed
            for g in range(2):
                grp = rel[:, 2 + 7 * g: 9 + 7 * g]
                two = d[:, 2 + 7 * g + 4] > 0          # the group started a second program
                rows.append(torch.cat([rel[two, 16:20], rel[two, 1:2], grp[two]], 1))
        m = torch.cat(rows).nanmean(0).tolist()
        print(f"\n{os.path.basename(path)} batch {batch} due {due}: kcycles after the CTA's start (mean over groups "
              f"with >= 2 programs, {calls} calls)")
        print("| milestone | kcycles |\n| --- | --- |")
        for name, v in zip(PRO_RANKING + ("ranked",) + PRO_GROUP, m):
            print(f"| {name} | {v:.2f} |")


def run(path: str, points: list[str]) -> None:
    import torch

    names = open(path + ".segments").read().split("\n")
    for batch, due, cfg, nsets, call, kern in _warm_points(path, points):
        pool = call.pool                        # after the warm-up: one counted call per slot set
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
    elif sys.argv[1] == "cta-build":
        build_cta(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "cta-run":
        run_cta(sys.argv[2], sys.argv[3:])
    elif sys.argv[1] == "pro-build":
        build_pro(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "pro-run":
        run_pro(sys.argv[2], sys.argv[3:])
    else:
        run(sys.argv[2], sys.argv[3:])
