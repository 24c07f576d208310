"""TileLang generator of the flush kernel: the kernel's buffers, its program loop, and the build.

One persistent CTA per SM. Every CTA first ranks the due programs of the call; it then runs :data:`GROUPS` independent
consumer groups of :data:`GROUP_THREADS` threads, each flushing one program at a time and synchronising on its own
named barrier. While warps 0-3 of a group orthonormalise (warps 4-7 would only wait at its barriers), warps 4-7 copy
and stage the group's next program, so that its staging is off the critical path (the round's first program is
staged by the whole group before its flush). The phases, in the vocabulary of docs/spec.md section 2, and the module
of each:

    ranking             ranking.ranking: every CTA ranks the call's due programs and keeps its share
    staging             staging: prefetch / prefetch_first (a program's checkpoint, window and gate copied into the
                        group's shared-memory prefetch buffers by cp.async), load_codes, stage (scales, gate, tokens,
                        window values and keys as mma operands; pieces: stage_column, stage_row, stage_window_half)
    (1) rebuild         rebuild.rebuild: S = (codes s_k s_v / 127 + q^T u) * gate + sum_j ubuf_j (w_j kbuf_j D_j), an
                        8 x 8 fp32 block per thread in the mma accumulator layout, in registers until the codes
    (2) project         project.project_t (S^T x for x = q0, then Q) and project.project (S x for x = P, tensor cores),
                        partials reduce-scattered over lanes into reduction planes, summed by project.sum_partials
    (3) orthonormalise  orthonormalise.gram + orthonormalise.cholesky: CholeskyQR on warps 0-3, one row per thread;
                        one pass for P, two for Q (leapquant.numerics), in five intervals between group barriers in
                        which warps 4-7 stage the next program
    (4) tokens          encode.tokens: u = fp16(clamp(U^T)), q = fp16(Q^T) to the pool and as mma operands
    (5) residual        encode.residual: E = S - q^T u on the tensor cores (exact fp16 products)
    (6) scales          encode.scales_k: s_k = max(sqrt(mean_v |E|), EPS); encode.scales_v: s_v = max(max_k |E| / s_k,
                        EPS)
    (7) codes           encode.codes: round_half_even(127 E / (s_k s_v)), packed four to a word
    (8) window reset    staging.window_reset: w = 0, pcum = 0, gbuf = 1 (GDN: p = 1), done with the staging

A program whose window is empty (every w = 0 and no decay: leapquant.reference.empty_window) is not flushed. The
warps that reset its window test the prefetched weights and gate first (staging.window_live: one vote per warp) and
reset only a window that holds something; the test's flag, left in shared memory, rides into the program's own
iteration as the sign bit of its code, and the checkpoint's stores are predicated on it (prelude's lq_st_*_if). The
program is otherwise computed like any other: every warp passes the same barriers, so their counts stay as the
racecheck needs them, and its bytes stay as they were.

Every value of the state and every sum is fp32; the tensor cores see operands that are exact in their input type
(the tokens, the window values), the window keys split into two bf16 parts (16 significant bits: 2^-16 relative) or
fp32 values split into two tf32 parts (S P: ~21 of 24 significant bits), so the kernel computes the reference's
arithmetic up to the order of the sums, the keys to 2^-16 and S P to ~2^-20 relative per product term.

The phases are TileLang macros; the program loop calls them through a :class:`Phases` object, so that a profiling
build (bench/dev/tilelang_dev.py) can replace one by a variant without a switch in the shipped kernel. Clock stamps
are a build option (``FlushConfig.clock``, :mod:`leapquant.tilelang.clock`). The buffers the phases share are
allocated once, at the top of the kernel, and passed as the named aggregates of :mod:`leapquant.tilelang.buffers`.
PTX that TileLang does not spell is in :mod:`leapquant.tilelang.prelude`. Importing this module imports tilelang.
"""

from dataclasses import dataclass

import tilelang
import tilelang.language as T

from ..layout import CHECKPOINT_WORDS
from ..numerics import Q_CHOLQR_PASSES, K, L, R, V
from .buffers import GroupBuffers, PoolTensors, PrefetchBuffers, RankingBuffers, Thread, region_word
from .clock import Clock
from .config import (BF16, CHUNK_HALVES, COLS_PER_BAND, CTA_THREADS, CTA_WARPS, F16, F32, FIRST_GROUP_BARRIER,
                     FIRST_ORTH_BARRIER, FIRST_STAGE_BARRIER, GRAM_SLOT, GROUP_THREADS, GROUPS, HALVES_PER_WORD, I32,
                     KEY_PARTS, LIST_CAP, ORTH_WARPS, P_SPLIT_STRIDE, PASS_CONFIGS, PROJECT_LAYOUT, PROJECT_T_LAYOUT,
                     QUADS, ROW_STEP, ROWS_PER_BAND, STAGE_THREADS, STATE_COL_BANDS, STATE_ROW_BANDS, TILE, TILE_WORDS,
                     TILES_PER_SIDE, TOKEN_PAIRS, U32, WARP, WINDOW_PAIRS, FlushConfig)
from .encode import codes, residual, scales_k, scales_v, tokens
from .orthonormalise import cholesky, gram, store_basis
from .prelude import prelude
from .project import project, project_t, sum_partials
from .ranking import ranking
from .rebuild import rebuild
from .staging import (load_codes, prefetch, prefetch_first, stage, stage_column, stage_row, stage_window_half,
                      window_live, window_reset)


@dataclass
class Phases:
    """The kernel's units (TileLang macros) that the program loop of :func:`make_flush_func` calls. A profiling build
    passes one with some fields replaced; only the loop's calls change (a unit that calls another, as ``stage`` calls
    ``stage_window_half``, calls the shipped one)."""
    ranking: object = ranking
    prefetch_first: object = prefetch_first
    prefetch: object = prefetch
    stage: object = stage
    load_codes: object = load_codes
    stage_column: object = stage_column
    stage_row: object = stage_row
    stage_window_half: object = stage_window_half
    window_live: object = window_live
    window_reset: object = window_reset
    rebuild: object = rebuild
    project_t: object = project_t
    project: object = project
    sum_partials: object = sum_partials
    gram: object = gram
    cholesky: object = cholesky
    store_basis: object = store_basis
    tokens: object = tokens
    residual: object = residual
    scales_k: object = scales_k
    scales_v: object = scales_v
    codes: object = codes


#: the sign bit of a program's code (slot * H + head, int32) in the program loop: set where its window is empty
EMPTY_CODE_BIT = -(2 ** 31)


def make_flush_func(cfg: FlushConfig, phases: Phases | None = None):
    """The TileLang PrimFunc of the flush for ``cfg`` (``phases``: a profiling build's variants)."""
    return _trace(cfg, phases)[0]


def clock_segments(cfg: FlushConfig) -> list[str]:
    """The names of the program loop's steps that a ``clock="phases"`` build counts, in order (its counter k + 1)."""
    return _trace(cfg)[1].segments


def _trace(cfg: FlushConfig, phases: Phases | None = None):
    """(the PrimFunc, its :class:`~leapquant.tilelang.clock.Clock`)."""
    ph = phases or Phases()
    clock = Clock(cfg.clock)
    H, G, KDA = cfg.num_heads, cfg.num_sms, cfg.kda
    N = T.dynamic("n_rows")
    NS = T.dynamic("num_slots")
    NW = T.dynamic("raw_words")
    NH = T.dynamic("raw_halves")
    n_pcum = (NS, H, K) if KDA else (1, 1, 1)
    n_gbuf = (NS, H, L, K) if KDA else (1, 1, 1, 1)
    n_p = (1, 1) if KDA else (NS, H)

    @T.prim_func
    def leapquant_flush(raw32: T.Tensor((NW,), I32), rawf: T.Tensor((NW,), F32), rawh: T.Tensor((NH,), F16),
                        kbuf: T.Tensor((NS, H, L, K), BF16), ubuf: T.Tensor((NS, H, L, V), BF16),
                        w: T.Tensor((NS, H, L), F32), pcum: T.Tensor(n_pcum, F32), gbuf: T.Tensor(n_gbuf, F16),
                        p: T.Tensor(n_p, F32), hcnt: T.Tensor((NS, H), I32), q0: T.Tensor((V, R), F32),
                        idx: T.Tensor((N,), I32)):
        with T.Kernel(G, threads=CTA_THREADS, prelude=prelude(cfg.clock)) as bid:
            # ranking
            slot_s = T.alloc_shared((cfg.rows_per_scan_step,), I32)
            mask_s = T.alloc_shared((CTA_THREADS,), U32)
            wsum_s = T.alloc_shared((CTA_WARPS,), I32)
            dlist = T.alloc_shared((LIST_CAP,), I32)
            q0_s = T.alloc_shared((1, V, R), F32)
            # per consumer group
            kw_s = T.alloc_shared((GROUPS, KEY_PARTS, WINDOW_PAIRS, K), U32)
            ubw_s = T.alloc_shared((GROUPS, WINDOW_PAIRS, V), U32)
            # rank-4 tokens as fp16 mma pairs, [u side (columns), q side (rows)]: the old ones (staged while the
            # previous program is still being flushed) and the new ones (the residual's)
            tok_old_s = T.alloc_shared((GROUPS, 2, TOKEN_PAIRS, V), U32)
            tok_new_s = T.alloc_shared((GROUPS, 2, TOKEN_PAIRS, V), U32)
            red_s = T.alloc_shared((GROUPS, TILES_PER_SIDE * V, R), F32)
            flat_s = T.view(red_s, (GROUPS, TILES_PER_SIDE * V * R), F32)
            pv_s = T.alloc_shared((GROUPS, K, P_SPLIT_STRIDE), F32)
            qv_s = T.alloc_shared((GROUPS, V, R), F32)
            sko_s = T.alloc_shared((GROUPS, K), F32)
            svo_s = T.alloc_shared((GROUPS, V), F32)
            gate_s = T.alloc_shared((GROUPS, K), F32)
            skn_s = T.alloc_shared((GROUPS, K), F32)
            rsv_s = T.alloc_shared((GROUPS, V), F32)
            gram_s = T.alloc_shared((GROUPS, Q_CHOLQR_PASSES, ORTH_WARPS, GRAM_SLOT), F32)
            live_s = T.alloc_shared((GROUPS,), I32)
            pf_ck = T.alloc_shared((GROUPS, CHECKPOINT_WORDS), I32)
            pf_ckf = T.view(pf_ck, (GROUPS, CHECKPOINT_WORDS), F32)
            pf_ckh = T.view(pf_ck, (GROUPS, CHECKPOINT_WORDS * HALVES_PER_WORD), F16)
            pf_kb = T.alloc_shared((GROUPS, L, K), BF16)
            pf_ub = T.alloc_shared((GROUPS, L, V), BF16)
            pf_gb = T.alloc_shared((GROUPS, L, K) if KDA else (GROUPS, 1, CHUNK_HALVES), F16)   # GDN: unused
            pf_w = T.alloc_shared((GROUPS, L), F32)
            pf_pc = T.alloc_shared((GROUPS, K), F32)

            tx = T.get_thread_binding()
            ranked = T.alloc_local((1,), I32)
            total = T.alloc_local((1,), I32)
            S = T.alloc_local((TILE * TILE,), F32)
            cw = T.alloc_local((TILE * TILE_WORDS,), I32)
            x4 = T.alloc_local((R,), F32)          # one row of P, then of Q (threads t < V)
            live = T.alloc_local((1,), I32)        # the window about to be reset holds something (window_live)

            g = tx // GROUP_THREADS
            t = tx % GROUP_THREADS
            lane = tx % WARP
            wr = (t // WARP) // STATE_COL_BANDS
            wc = (t // WARP) % STATE_COL_BANDS
            grp = lane // QUADS
            quad = lane % QUADS
            band_r = wr * ROWS_PER_BAND
            band_c = wc * COLS_PER_BAND
            rbase = band_r + grp                    # the thread's rows: rbase + ROW_STEP * i
            col0 = band_c + TILE * quad             # its columns: col0 + j
            tr = wr * ROW_STEP + grp                # reduction plane of its column partials (one per row set)
            tc = wc * QUADS + quad                  # reduction plane of its row partials (one per column octet)
            bar = FIRST_GROUP_BARRIER + g
            stage_bar = FIRST_STAGE_BARRIER + g
            orth_bar = FIRST_ORTH_BARRIER + g
            st = t - V                              # index of a staging thread (t >= V)

            pool = PoolTensors(raw32=raw32, rawf=rawf, rawh=rawh, kbuf=kbuf, ubuf=ubuf, w=w, pcum=pcum, gbuf=gbuf,
                               p=p, hcnt=hcnt, q0=q0, idx=idx, n_rows=N, num_slots=NS)
            rk = RankingBuffers(slot_s=slot_s, mask_s=mask_s, wsum_s=wsum_s, dlist=dlist, ranked=ranked)
            pf = PrefetchBuffers(ck=pf_ck, ckf=pf_ckf, ckh=pf_ckh, kb=pf_kb, ub=pf_ub, gb=pf_gb, w=pf_w, pc=pf_pc)
            sh = GroupBuffers(kw_s=kw_s, ubw_s=ubw_s, tok_old_s=tok_old_s, tok_new_s=tok_new_s, red_s=red_s,
                              flat_s=flat_s, pv_s=pv_s, qv_s=qv_s, sko_s=sko_s, svo_s=svo_s, gate_s=gate_s,
                              skn_s=skn_s, rsv_s=rsv_s, gram_s=gram_s, live_s=live_s, q0_s=q0_s)
            th = Thread(tx=tx, g=g, t=t, lane=lane, wr=wr, wc=wc, grp=grp, quad=quad, band_r=band_r, band_c=band_c,
                        rbase=rbase, col0=col0, tr=tr, tc=tc, bar=bar)
            clock.attach(raw32, bid, th)
            clock.kernel_start()

            q0_s[0, tx // R, tx % R] = q0[tx // R, tx % R]
            if t < V:                               # the token pairs past rank 4 are the mma's zero padding
                for side in T.unroll(2):
                    for pr in T.unroll(R // 2, TOKEN_PAIRS):
                        tok_old_s[g, side, pr, t] = T.uint32(0)
                        tok_new_s[g, side, pr, t] = T.uint32(0)
            total[0] = 0
            clock.prologue_cta(16)
            for rnd in T.serial(T.ceildiv(N * H, G * LIST_CAP)):
                if (rnd == 0) | (rnd * G * LIST_CAP < total[0]):
                    rank_lo = rnd * G * LIST_CAP
                    ph.ranking(cfg, pool, rk, rank_lo, bid, tx, clock)
                    total[0] = ranked[0]
                    clock.prologue_cta(1)
                    in_round = T.min(ranked[0] - rank_lo, G * LIST_CAP)
                    mine = T.max(T.ceildiv(in_round - bid, G), 0)
                    n_mine = T.ceildiv(mine - g, GROUPS)     # this group's programs: dlist[g + GROUPS * it]
                    if n_mine > 0:                  # the round's first program: fetched and staged by the group
                        first = dlist[g]
                        ph.prefetch_first(cfg, pool, pf, g, first // H, first % H, t)
                        T.evaluate(T.call_extern("handle", "lq_cp_wait_but_last"))
                        T.sync_threads(bar, GROUP_THREADS)      # every thread's staging inputs landed
                        clock.prologue_group(0)
                        ph.window_live(cfg, pf, sh, g, t, live)
                        ph.stage(cfg, pool, pf, sh, g, first // H, first % H, t, live[0] != 0)
                        clock.prologue_group(1)
                        T.evaluate(T.call_extern("handle", "lq_cp_wait_all"))
                        T.sync_threads(bar, GROUP_THREADS)      # and every thread's codes
                        clock.prologue_group(2)
                    for it in T.serial(n_mine):
                        # the program's code (slot * H + head), its sign bit set where its window is empty (the flag
                        # window_live left when it was staged): one value carries both to the stores, which test its
                        # sign (a flag of its own held through the iteration made ptxas spill more: design note)
                        code = T.if_then_else(sh.live_s[g] != 0, dlist[g + GROUPS * it],
                                              dlist[g + GROUPS * it] | EMPTY_CODE_BIT)
                        prog = code & ~EMPTY_CODE_BIT
                        slot = prog // H
                        head = prog % H
                        base = region_word(slot, head, H)
                        more = it + 1 < n_mine
                        nxt = dlist[g + GROUPS * T.min(it + 1, n_mine - 1)]
                        clock.program_start(it)
                        # the program's codes into registers; then the buffers are free for the next program's
                        # copies, issued by the staging warps, which stage it while this one is orthonormalised
                        ph.load_codes(pf, th, cw)
                        clock.segment("load_codes")
                        T.sync_threads(bar, GROUP_THREADS)
                        clock.segment("barrier: codes loaded")
                        if more & (t >= V):
                            ph.prefetch(cfg, pool, pf, g, nxt // H, nxt % H, st, STAGE_THREADS)
                        clock.segment("prefetch (next program, staging warps)")
                        ph.rebuild(sh, th, S, cw)
                        clock.segment("rebuild")
                        # P = orth(S^T q0), Q = orth(S P): CholeskyQR on warps 0-3 (one row per thread) in five
                        # intervals between group barriers; meanwhile warps 4-7 stage the next program (its copies were
                        # issued before the rebuild): the cheap pieces in the first interval (the copies may still be
                        # landing), the keys' halves in the next two, the window's reset in the last (the fastest of
                        # seven placements, H200: docs/design-tilelang.md)
                        ph.project_t(sh, th, S, q0_s, 0)
                        clock.segment("project_t (S^T q0)")
                        T.sync_threads(bar, GROUP_THREADS)
                        clock.segment("barrier: S^T q0 partials")
                        if t < V:
                            ph.sum_partials(sh, g, t, x4, STATE_ROW_BANDS, PROJECT_T_LAYOUT)
                            ph.gram(sh, th, x4, 0)
                            # Warps 0-3 pass a barrier of their own where the staging warps pass theirs (below).
                            # The kernel is race-free without it: every access to a group's buffers in this loop
                            # is ordered by a group barrier that both the writer and the reader pass (bar.sync 1 + g,
                            # 256: all 8 warps, in the same program order; a barrier orders the shared-memory
                            # accesses of the threads that take part in it), and the staging warps' barrier only
                            # orders their own cp.async data among themselves. compute-sanitizer's racecheck, though,
                            # matches barriers by how many each thread has passed, not by their id: a probe (4 warps
                            # on one barrier, 2 of them passing an extra one) gets RAW hazards reported across a
                            # barrier all 4 pass, and none once the other 2 pass one too. Here, with the staging
                            # warps one barrier ahead, it reported S P's partials (project's store by warps 4-7,
                            # sum_partials' read by warps 0-3 after the group barrier between them): 1.38 M RAW
                            # hazards in one KDA flush of 32 rows x 32 heads, 2/3 due, and none with this barrier,
                            # both gates (H200). It costs one bar.sync per program among warps 0-3, which wait for the
                            # staging warps at the group barrier that ends this window anyway
                            if more:
                                T.sync_threads(orth_bar, STAGE_THREADS)
                        elif more:
                            T.evaluate(T.call_extern("handle", "lq_cp_wait_all"))
                            T.sync_threads(stage_bar, STAGE_THREADS)    # every staging thread's copies landed
                            ph.stage_column(cfg, pf, sh, g, st)
                            ph.stage_row(pf, sh, g, st)
                        clock.segment("interval 1: P's Gram | stage scales, gate, tokens")
                        T.sync_threads(bar, GROUP_THREADS)
                        clock.segment("barrier: interval 1")
                        if t < V:
                            ph.cholesky(sh, th, x4, 0)
                            ph.store_basis(pv_s, th, x4, True)
                        elif more:
                            ph.stage_window_half(cfg, pf, sh, g, st, 1)
                        clock.segment("interval 2: P's factor | stage newer keys")
                        T.sync_threads(bar, GROUP_THREADS)
                        clock.segment("barrier: interval 2")
                        ph.project(sh, th, S)
                        clock.segment("project (S P)")
                        T.sync_threads(bar, GROUP_THREADS)      # S P's partials (all 8 warps) before warps 0-3 sum them
                        clock.segment("barrier: S P partials")
                        if t < V:
                            ph.sum_partials(sh, g, t, x4, STATE_COL_BANDS, PROJECT_LAYOUT)
                            ph.gram(sh, th, x4, 0)
                        elif more:
                            ph.stage_window_half(cfg, pf, sh, g, st, 0)
                        clock.segment("interval 3: Q's first Gram | stage older keys")
                        T.sync_threads(bar, GROUP_THREADS)
                        clock.segment("barrier: interval 3")
                        if t < V:
                            ph.cholesky(sh, th, x4, 0)
                            ph.gram(sh, th, x4, 1)
                        clock.segment("interval 4: Q's first factor, second Gram")
                        T.sync_threads(bar, GROUP_THREADS)
                        clock.segment("barrier: interval 4")
                        if t < V:
                            ph.cholesky(sh, th, x4, 1)
                            ph.store_basis(qv_s, th, x4, False)
                        elif more:
                            ph.window_live(cfg, pf, sh, g, st, live)
                            ph.window_reset(cfg, pool, nxt // H, nxt % H, st, STAGE_THREADS, live[0] != 0)
                        clock.segment("interval 5: Q's second factor | window reset")
                        T.sync_threads(bar, GROUP_THREADS)
                        clock.segment("barrier: interval 5")
                        # U = S^T Q, the fp16 tokens
                        ph.project_t(sh, th, S, qv_s, g)
                        clock.segment("project_t (S^T Q)")
                        T.sync_threads(bar, GROUP_THREADS)
                        clock.segment("barrier: S^T Q partials")
                        ph.tokens(pool, sh, th, base, code)
                        clock.segment("tokens")
                        T.sync_threads(bar, GROUP_THREADS)
                        clock.segment("barrier: tokens")
                        ph.residual(sh, th, S)
                        clock.segment("residual")
                        ph.scales_k(pool, sh, th, S, base, code)
                        clock.segment("scales_k")
                        ph.scales_v(pool, sh, th, S, base, code)
                        clock.segment("scales_v")
                        ph.codes(pool, sh, th, S, base, code)
                        clock.segment("codes")
                    clock.group_end()
                    T.sync_threads()
                    clock.kernel_end()

    return leapquant_flush, clock


def compile_flush(cfg: FlushConfig, phases: Phases | None = None):
    """Lower and build the kernel for ``cfg`` (no GPU needed: nvcc builds for cfg.arch)."""
    return tilelang.compile(make_flush_func(cfg, phases), target=cfg.target, pass_configs=PASS_CONFIGS)
