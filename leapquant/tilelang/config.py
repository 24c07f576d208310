"""What a build of the TileLang flush kernel depends on, and the fixed geometry of its threads and buffers.

This module does not import tilelang (importing it takes seconds), so the backend's checks (``reasons``) and the
shared-memory budget are available without it. The math's sizes and constants are :mod:`leapquant.numerics`'s, the
pool's byte layout :mod:`leapquant.layout`'s; everything here is how this kernel maps them onto threads.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..layout import ALIGN_BYTES, CHECKPOINT_BYTES, CHECKPOINT_WORDS, GATES, TOK_BYTE, TOK_ROW
from ..numerics import CODE_SIGN, K, L, P_CHOLQR_PASSES, Q_CHOLQR_PASSES, QMAX, R, V

F32, F16, BF16, I32, U32, I64 = "float32", "float16", "bfloat16", "int32", "uint32", "int64"

# ---- threads -------------------------------------------------------------------------------------------------------
WARP = 32
WARP_LEVELS = 5                         # butterfly levels of a reduction over the 32 lanes of a warp
#: threads of one consumer group: 8 warps, each thread owning 8 rows x 8 columns of the 128 x 128 state
GROUP_THREADS = 256
#: consumer groups per CTA: 2 x 256 threads = 512, so __launch_bounds__(512) caps registers at 128 per thread and
#: exactly one CTA fits an SM (the grid is one CTA per SM: the persistent design needs every CTA resident)
GROUPS = 2
CTA_THREADS = GROUPS * GROUP_THREADS
CTA_WARPS = CTA_THREADS // WARP
#: the staging warps of a group (its warps 4-7) stage its next program while warps 0-3 orthonormalise the current one
STAGE_THREADS = GROUP_THREADS // 2
ORTH_WARPS = V // WARP                  # 4: the warps whose threads hold one row each of P (K rows) or Q (V rows)

#: named barriers: 0 is __syncthreads; FIRST_GROUP_BARRIER + g synchronises group g (256 threads);
#: FIRST_STAGE_BARRIER + g its staging warps among themselves (128 threads)
FIRST_GROUP_BARRIER = 1
FIRST_STAGE_BARRIER = FIRST_GROUP_BARRIER + GROUPS
#: warps 0-3 of a group pass a barrier of their own (FIRST_ORTH_BARRIER + group, 128 threads) wherever its staging
#: warps pass theirs, so that every thread of a group has passed the same number of barriers at each group barrier:
#: the hardware does not need it, compute-sanitizer's racecheck does (the first staging interval in
#: :func:`leapquant.tilelang.kernel.make_flush_func` says why; tests/test_tilelang_sync.py checks the counts on the
#: generated source)
FIRST_ORTH_BARRIER = FIRST_STAGE_BARRIER + GROUPS
assert FIRST_ORTH_BARRIER + GROUPS <= 16            # named barriers per CTA

# ---- the state tile of a thread ------------------------------------------------------------------------------------
#: The state lives in the accumulator layout of the tensor cores' mma.m16n8 (fp32 C fragments), so that the rank
#: updates (old tokens, window, new tokens) run as mma.sync. A group's 8 warps form 2 row bands x 4 column bands;
#: a warp's 64 x 32 block is 4 x 4 mma tiles of 16 x 8. Lane = 4 * grp + quad: the thread holds rows
#: band + grp + 8 i (i < 8: two rows per 16-row mma tile) and, because the columns of an n-tile are free to be any
#: physical columns (B's columns are staged in the same order), eight *contiguous* columns 32 wc + 8 quad + j: its
#: n-tile nt holds columns j = 2 nt, 2 nt + 1. Contiguous columns keep the int8 codes at 8 bytes per row and thread.
TILE = 8                                # a thread's state block is TILE x TILE
TILE_BITS = 3                           # log2(TILE)
TILES_PER_SIDE = V // TILE              # 16: partial sums per output of a scale (reduction planes)
MMA_M = 16                              # rows of an mma.m16n8 tile
STATE_ROW_BANDS, STATE_COL_BANDS = 2, 4     # warps of a group down the state's rows, across its columns
ROWS_PER_BAND = V // STATE_ROW_BANDS    # 64
COLS_PER_BAND = K // STATE_COL_BANDS    # 32
QUADS = 4                               # lanes sharing an mma row (threadID_in_group of the PTX fragment tables)
ROW_STEP = MMA_M // 2                   # 8: a thread's rows are grp + 8 i
M_TILES = ROWS_PER_BAND // MMA_M        # 4 mma tiles down a warp's rows
N_TILES = TILE // 2                     # 4 mma n-tiles per thread column octet (two columns each)

# ---- mma operands --------------------------------------------------------------------------------------------------
#: bf16 parts of an fp32 window key: hi (the top 8 significant bits, truncated) + lo (the remainder rounded to bf16)
#: carries the key to 2^-16 relative (ubuf is bf16 already; bf16 x bf16 products are exact in fp32), a third fewer
#: window mma and key stores than three exact parts; the criterion's worst head stays at 0.9913 (KDA) / 0.9908 (GDN)
#: of its bound, as with three parts (H200; docs/design-tilelang.md, variants)
KEY_PARTS = 2
HALF_WINDOW = L // 2                    # window entries per staging thread (two threads per column and row)
WINDOW_PAIRS = L // 2                   # bf16 / fp16 pairs along the window (k of the mma): one 32-bit word each
TOKEN_PAIRS = 4                         # rank-4 tokens as the k = 8 operand of mma.m16n8k8: pairs 2, 3 stay zero
#: P in shared memory as the B operand of S P on the tensor cores: row k holds (big parts of P[k, :R], small parts);
#: the 8 columns are the mma's n = 8, so C's columns r and R + r add up to (S P)[:, r]. A stride of 2R + 1 words puts
#: the four quads of a B load (rows 8 apart) on four different bank octets
P_SPLIT_COLS = 2 * R
P_SPLIT_STRIDE = P_SPLIT_COLS + 1

# ---- orthonormalisation --------------------------------------------------------------------------------------------
#: The program loop lays CholeskyQR (leapquant.numerics: passes and pivot floors) into five intervals between group
#: barriers: P's one pass (two intervals), Q's two passes (three intervals); the staging warps fill the intervals.
assert P_CHOLQR_PASSES == 1 and Q_CHOLQR_PASSES == 2, "the program loop's staging intervals are laid out for 1 + 2 passes"
GRAM_ENTRIES = R * (R + 1) // 2         # 10: the lower triangle of the 4 x 4 Gram matrix, packed row by row
GRAM_SLOT = 12                          # one warp's Gram partial in shared memory, padded to three 16-byte chunks

# ---- reduction planes ----------------------------------------------------------------------------------------------
#: the two layouts of the products' reduction planes (``sum_partials``' ``layout``): S^T x's (one plane per row band,
#: written by ``project_t``) and S x's (one plane per column band, written by ``project``)
PROJECT_T_LAYOUT, PROJECT_LAYOUT = "project_t", "project"
#: stride (floats) of the scales' partial planes: padded so that the 32 writers of one 4-byte store hit 32 banks
#: (column sums: lane grp writes plane 8 wr + grp, quad its 8 columns 8 quad + j: one float of padding per plane puts
#: grp on the bank's low bits; the 32-byte partial row as 16-byte stores instead was split by ptxas into a 16-byte
#: and four 4-byte stores, 4-way conflicted. Row maxima: the four quads write consecutive planes, 8 floats of padding
#: put them 8 banks apart, beside the 8 rows of a quad)
SCALE_K_STRIDE = K + 1
SCALE_V_STRIDE = V + TILE
assert TILES_PER_SIDE * max(SCALE_K_STRIDE, SCALE_V_STRIDE) <= TILES_PER_SIDE * V * R   # in the products' buffer

# ---- the pool, in the units of the views that read it --------------------------------------------------------------
#: every pool tensor starts on a 16-byte boundary (layout.ALIGN_BYTES; hcnt and p: see reasons()): the
#: prefetch copies (cp.async) and the fill counters' loads move 16 bytes at a time (row strides are multiples of 16
#: bytes for every supported geometry)
WORD_BYTES, HALVES_PER_WORD = 4, 2      # the fp32 / int32 views count words, the fp16 view halfwords
CHUNK_WORDS = ALIGN_BYTES // WORD_BYTES     # 4: 32-bit words per 16-byte chunk
CHUNK_HALVES = ALIGN_BYTES // 2         # 8: 16-bit values per 16-byte chunk (the reset's stores, the copies)
WINDOW_CHUNKS = L * K // CHUNK_HALVES   # 256 such chunks in an [L, 128] 16-bit window tensor (kbuf, ubuf, gbuf)
CODES_PER_WORD = WORD_BYTES             # int8 codes read and written as int32 words
CODE_WORDS_PER_ROW = K // CODES_PER_WORD
TILE_WORDS = TILE // CODES_PER_WORD     # 2: the code words of one row of a thread's tile
CODE_SIGN_BITS = CODE_SIGN * 0x01010101  # XOR of a code word: every int8 code + 128 as an unsigned byte (lq_code)
QMAXF = float(QMAX)
#: A group's next program's inputs (checkpoint, window, gate: ~32 KB) are copied into its shared-memory prefetch
#: buffers by cp.async, 16-byte chunks, while the current program is flushed; the staging then reads shared memory.
#: The codes' chunks are XOR-swizzled by row (chunk c of row v at c ^ (v % 8)), so that a quarter-warp's 8-byte reads
#: (8 rows at one column offset) hit 8 different bank quads
CK_CHUNKS = CHECKPOINT_WORDS // CHUNK_WORDS     # 1216 16-byte chunks of the checkpoint
ROW_CHUNKS = K // (CODES_PER_WORD * CHUNK_WORDS)    # 8 chunks per row of codes
CODE_CHUNKS = V * ROW_CHUNKS            # 1024: the codes' chunks come first
assert CHECKPOINT_BYTES == TOK_BYTE + 2 * R * TOK_ROW and R == 4 and V == K == 128 and L == 16
#: one warp reads all of a program's weights (L / CHUNK_WORDS 16-byte chunks) and its gate (KDA's pcum: K / CHUNK_WORDS
#: chunks; GDN's p: one word), a chunk per lane, to test its window for emptiness (staging.window_live)
assert L // CHUNK_WORDS <= WARP and K // CHUNK_WORDS <= WARP

# ---- ranking -------------------------------------------------------------------------------------------------------
#: due flags ranked per step of the scan over the call's rows: one 32-program mask word per CTA thread
PROGRAMS_PER_SCAN_STEP = CTA_THREADS * WARP
#: due programs one CTA keeps per ranking round (512 B of shared memory); a call with more than
#: grid * LIST_CAP due programs (more than 528 rows of 32 heads on 132 SMs) ranks again for the next round
LIST_CAP = 128
#: ranks (per CTA thread) that a mask word can hand to one CTA: one, since the grid has >= 32 CTAs
MIN_GRID = WARP
SUPPORTED_HEADS = (8, 16, 32)

#: clock-stamp instrumentation of a build (:attr:`FlushConfig.clock`; :mod:`leapquant.tilelang.clock` says what each
#: mode records and where). ``None``, the default, is the shipped kernel, which has no stamps.
CLOCK_MODES = (None, "phases", "ctas", "prologue")


@dataclass(frozen=True)
class FlushConfig:
    """Everything a compiled kernel depends on (the cache key)."""
    num_heads: int
    gate: str                   # "kda" | "gdn"
    arch: str                   # "sm_90a" | "sm_100a"
    num_sms: int                # grid size: one persistent CTA per SM
    #: a profiling build with clock stamps (one of CLOCK_MODES); None: the shipped kernel
    clock: str | None = None

    def __post_init__(self) -> None:
        if self.num_heads not in SUPPORTED_HEADS:
            raise ValueError(f"num_heads {self.num_heads} not in {SUPPORTED_HEADS}")
        if self.gate not in GATES:
            raise ValueError(f"gate {self.gate!r}")
        if self.num_sms < MIN_GRID:
            raise ValueError(f"num_sms {self.num_sms} < {MIN_GRID}")
        if self.clock not in CLOCK_MODES:
            raise ValueError(f"clock {self.clock!r} not in {CLOCK_MODES}")

    @property
    def kda(self) -> bool:
        return self.gate == "kda"

    @property
    def rows_per_scan_step(self) -> int:
        return PROGRAMS_PER_SCAN_STEP // self.num_heads

    @property
    def target(self) -> dict:
        return {"kind": "cuda", "arch": self.arch}


def shared_bytes(cfg: FlushConfig) -> int:
    """Static shared memory of the kernel (checked against the device's limit by ``reasons``)."""
    per_group = 4 * (KEY_PARTS * WINDOW_PAIRS * K   # window keys, bf16 parts, packed in pairs
                     + WINDOW_PAIRS * V         # window values, bf16 pairs
                     + 2 * 2 * TOKEN_PAIRS * V  # tokens (old and new, both sides), fp16 pairs
                     + TILES_PER_SIDE * R * V   # reduction partials (products: 2 or 4 planes; scales: 16)
                     + K * P_SPLIT_STRIDE + V * R    # P (split) and Q
                     + 6 * V                    # old s_k, old s_v, gate, new s_k, 127 / s_v, spare
                     + Q_CHOLQR_PASSES * ORTH_WARPS * GRAM_SLOT    # Gram partials of the orthonormalisation
                     + 1                        # the next program's empty-window flag
                     + CHECKPOINT_WORDS         # prefetch buffers: the checkpoint,
                     + L * (K + V) // HALVES_PER_WORD + L + K)  # kbuf, ubuf, w, pcum (GDN: p)
    if cfg.kda:
        per_group += 4 * L * K // HALVES_PER_WORD   # and gbuf
    scan = 4 * (cfg.rows_per_scan_step + CTA_THREADS + CTA_WARPS + LIST_CAP + 4)
    return GROUPS * per_group + 4 * V * R + scan


PASS_CONFIGS = {
    # every barrier is placed by hand: the two consumer groups synchronise on their own named barriers, and an
    # automatically inserted __syncthreads inside a group's branch would deadlock the CTA
    "tl.disable_thread_storage_sync": True,
    # the indices are in range by construction (slots are checked in the ranking); the bounds guards TileLang would
    # add around every access to the symbolically sized buffers also break the 8- and 16-byte vector accesses
    "tl.disable_safe_memory_legalize": True,
}
