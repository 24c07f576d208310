"""The Triton backend's GPU kernel, written in Gluon (Triton's explicit-layout dialect) for sm_80 and newer.

Same contract, ranking and algorithm as the ``tl`` kernel (:mod:`leapquant.triton.tl_kernel`, which the interpreter
runs and which serves where Gluon cannot); what differs is that every tensor here has a layout chosen for the
algorithm instead of one Triton picks. One persistent program of 8 warps per SM (255 registers), items pid, pid + G,
... of the call's ranked due programs. The phases, as docs/spec.md section 2 names them:

    ranking             _rank_due: the due programs ranked in flag order (as the tl kernel's ranking)
    staging             _stage_inputs: the next item's checkpoint, window and gate copied into shared memory
                        (cp.async, 16-byte pieces, into :class:`StagedInputs`) while this item computes: its loads are
                        off the item's critical path
    (1) rebuild         _rebuild: S = (codes s_k s_v / 127 + q^T u) * gate + ubuf^T keys; S lives in the accumulator
                        layout of mma.m16n8 (:data:`STATE`: 2 row bands x 4 column bands of warps, 8 x 8 values per
                        thread), so both rank updates run on the tensor cores with exact operands (fp16 tokens; bf16
                        window values times the fp32 keys split into two bf16 parts, 2^-17 relative), accumulating in
                        fp32
    (2) project         _project_t_partials, _project_partials, _sum4, _get4: S^T x and S x for four vectors at once:
                        each thread sums its own 8 rows (columns) of S x as one FMA chain, then the 16 partials of an
                        output meet in two threads through one exchange in shared memory (a reduce-scatter: no
                        shuffle tree over the lanes of every partial), and the sums go to every warp through one more.
                        Every exchange but the codes' goes through a buffer of its own (:class:`ExchangeBuffers`) in
                        one round (the *_XCHG_SMEM layouts: hand-built, free of bank conflicts), its write and its
                        read on either side of a barrier the caller places
    (3) orthonormalise  _orthonormalise: CholeskyQR (passes and pivot floors: leapquant.numerics) on the vectors held
                        whole by every warp (:data:`WARP_VEC`): the Gram matrices are warp-local reduce-scatters over
                        the lanes (:data:`_GRAM_ASM`), no barrier
    (4) tokens          _store_tokens: u = fp16(clamp(U^T)), q = fp16(Q^T) to the pool and to shared memory
    (5) residual        _residual: E = S - q^T u on the tensor cores with exactly the stored tokens
    (6) scales          _scale_k_partials, _scale_k, _scale_v_and_codes: s_k, s_v, reduce-scattered like the products
    (7) codes           round_half_even(127 E / (s_k s_v)), stored as 16-byte vectors after one exchange through
                        shared memory (_store_codes_and_reset)
    (8) window reset    w = 0, pcum = 0, gbuf = 1; GDN: p = 1

Phases (6)-(8), the item's tail, of item i run during item i + 1 (:func:`_flush_item`): beside its rebuild, P and Q,
at the same barriers.

An item whose window is empty (every w_j = 0 and no decay: :func:`_window_live`, leapquant.reference.empty_window's
test on the staged weights and gate) is computed like any other, so that every warp passes the same barriers, but
none of its stores happen (tokens, scales, codes, window reset): its checkpoint and window stay bitwise as they were.

Every value of the state and every sum is fp32; the tensor cores only see operands exact in their input type (or
the keys to 2^-17), so the kernel computes the reference's arithmetic up to the order of the sums, the rounding of
1 / s_v (one ulp) and of 2^15 s_k / 127 (one ulp: _CODE_SCALE). The measurements behind each choice and what limits
the kernel: docs/design-triton.md.
"""
# (no ``from __future__ import annotations``: the aggregates' field annotations must be real types, which Triton
# checks each field's value against)

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from ..layout import CODES_BYTE, OFF, REGION_ALIGN_WORDS, REGION_WORDS, SK_WORD, SV_WORD, TOK_HALF, TOK_ROW
from ..numerics import CODE_SIGN, EPS, FP16_MAX, P_CHOLQR_PASSES, Q_CHOLQR_PASSES, QMAX, RINT_MAGIC, K, L, R, V
from .cholesky import cholesky4
from .gluon_pool import PoolRefs, aggregate

assert R == 4 and V == 128 and K == 128 and L == 16, "the layouts below are written for a 128 x 128 state"

#: warps of one program: the 128 x 128 fp32 state is 64 registers per thread (16 warps measured 31 % slower on the
#: H200: every thread then still runs the replicated vector work; docs/design-triton.md)
WARPS = 8

_V = gl.constexpr(V)
_K = gl.constexpr(K)
_L = gl.constexpr(L)
_R = gl.constexpr(R)
#: the rank-4 tokens padded to the k = 16 of an fp16 mma (the padding ranks are zeros, so they add exact zeros)
_RPAD = gl.constexpr(16)
_TOK_ROW = gl.constexpr(TOK_ROW)
_QMAX = gl.constexpr(float(QMAX))
_EPS = gl.constexpr(EPS)
_FP16_MAX = gl.constexpr(FP16_MAX)
_OFF = gl.constexpr(OFF)
_REGION_WORDS = gl.constexpr(REGION_WORDS)
_CODES_BYTE = gl.constexpr(CODES_BYTE)
_SK_WORD = gl.constexpr(SK_WORD)            # s_k, then s_v right after it: one copy of K + V words
_TOK_HALF = gl.constexpr(TOK_HALF)
_ALIGN = gl.constexpr(REGION_ALIGN_WORDS)
assert SV_WORD == SK_WORD + K
#: CholeskyQR pivot floors and passes, and the rounding constant: leapquant.numerics (shared by every kernel)
_P_PASSES = gl.constexpr(P_CHOLQR_PASSES)
_Q_PASSES = gl.constexpr(Q_CHOLQR_PASSES)
_RINT_MAGIC = gl.constexpr(RINT_MAGIC)
#: the dequantisation, exact for every code: a code byte c with its sign bit flipped is u = c + 128, and one byte
#: permute puts u into bits 8..15 of the float 1.0, which makes x = 1 + u 2^-15 (_CODE_BYTES_ASM, two codes per call:
#: the xor flips both sign bits of the pair's 16-bit word); x - (1 + 2^-8) = c 2^-15 exactly (both in [1, 2)), and one
#: multiplication by A = 2^15 s_k / 127 rounds c s_k / 127 once. Folding the subtraction into an FMA with the rounded
#: B = (1 + 2^-8) A saves the FADD but leaves code 0 at B's rounding error instead of 0: an all-zero state (zero codes,
#: positive scales: a caller's checkpoint can be so) then decodes to ~1e-8 noise, which the criterion rejects
_CODE_SCALE = gl.constexpr(2.0 ** 15 / QMAX)
_CODE_SHIFT = gl.constexpr(1.0 + CODE_SIGN * 2.0 ** -15)
_CODE_BYTES_ASM = gl.constexpr(
    f"{{ .reg .b32 t, one; xor.b32 t, $2, {CODE_SIGN * 0x0101:#x}; mov.b32 one, 0x3F800000; "
    "prmt.b32 $0, t, one, 0x7604; prmt.b32 $1, t, one, 0x7614; }")
_BYTE = gl.constexpr(0xFF)

# ---- layouts (8 warps) ---------------------------------------------------------------------------------------------
# Distributed layouts are named by what they hold (STATE, STATE_ROWS, WARP_VEC, ...), shared ones end in _SMEM.
#: S and every [V, K] tensor: mma.m16n8 accumulators, warps as 2 row bands x 4 column bands. A thread holds rows
#: 32 m + 16 wr + 8 h + grp (m < 4 repeats, wr its row band, h < 2 the halves of an mma tile, grp = lane / 4) and
#: columns 32 n + 8 wc + 2 quad + j (n < 4 repeats, wc its column band, quad = lane % 4, j < 2)
STATE = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[2, 4], instr_shape=[16, 8]))
#: a V-vector (one value per row of S) as the state layout slices it, broadcast along the rows of S
STATE_ROWS = gl.constexpr(gl.SliceLayout(1, STATE))
#: a K-vector (one value per column of S), broadcast along the columns of S
STATE_COLS = gl.constexpr(gl.SliceLayout(0, STATE))
A_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=STATE, k_width=2))   #: [V, 16] 16-bit operands
B_OP = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=STATE, k_width=2))   #: [16, K] 16-bit operands
#: a 128-vector (a column of P, Q, U) whole in every warp, 4 per lane: the orthonormalisation's reductions stay in a
#: warp (shuffles, no barrier); the state's slice layouts would repeat that work on 16 times the registers
WARP_VEC = gl.constexpr(gl.BlockedLayout([4], [32], [WARPS], [0]))
#: four WARP_VEC vectors stacked [V, 2, 2]
WARP_VEC4 = gl.constexpr(gl.BlockedLayout([4, 2, 2], [32, 1, 1], [WARPS, 1, 1], [0, 1, 2]))
#: the partials of four column sums [16, K, 2, 2] (or of one, [16, K]) as the reduce-scatter gathers them: 8 of a
#: column's 16 partials per thread, two lanes per column; of row sums [V, 16, 2, 2] (or [V, 16]) alike
COLSUM_PARTS4 = gl.constexpr(gl.BlockedLayout([8, 1, 2, 2], [2, 16, 1, 1], [1, WARPS, 1, 1], [3, 2, 0, 1]))
ROWSUM_PARTS4 = gl.constexpr(gl.BlockedLayout([1, 8, 2, 2], [16, 2, 1, 1], [WARPS, 1, 1, 1], [3, 2, 1, 0]))
COLSUM_PARTS = gl.constexpr(gl.BlockedLayout([8, 1], [2, 16], [1, WARPS], [0, 1]))
ROWSUM_PARTS = gl.constexpr(gl.BlockedLayout([1, 8], [16, 2], [WARPS, 1], [1, 0]))
#: [K, L] window tiles, transposed: half a column of the window (8 entries) in one thread, four warps the lower halves
#: and four the upper ones, so that the decay products D_j are multiplications inside a thread and no warp repeats
#: another's keys (a whole column per thread, warps 4-7 repeating 0-3, measured +1.3 % KDA, +2.9 % GDN)
WINDOW = gl.constexpr(gl.BlockedLayout([1, L // 2], [32, 1], [WARPS // 2, 2], [1, 0]))
#: 16-byte pieces: [V, K] int8 codes (16 of a row per thread), [L, K] 16-bit window tensors (8 of a row)
BYTES = gl.constexpr(gl.BlockedLayout([1, 16], [4, 8], [WARPS, 1], [1, 0]))
HALVES = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0]))
#: [R, K + V] fp16 token rows: 8 bytes per thread, one row per two warps
TOKENS = gl.constexpr(gl.BlockedLayout([1, 4], [1, 32], [WARPS // 2, 2], [1, 0]))
WORDS = gl.constexpr(gl.BlockedLayout([1], [32], [WARPS], [0]))    #: one 4-byte word per thread
#: shared memory: plain row-major; the codes' 16-byte chunks XOR-swizzled by row, so that the state layout's reads
#: down 8 rows (128 bytes apart) hit 8 different banks
PLAIN1_SMEM = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))
PLAIN2_SMEM = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
CODES_SMEM = gl.constexpr(gl.SwizzledSharedLayout(16, 1, 8, [1, 0]))
#: the 16-bit mma operands read by ldmatrix (tokens, window values): 16-byte chunks XOR-swizzled by row, so that the
#: 8 rows of an 8 x 8 matrix (rows 256 or 512 bytes apart) hit 8 different banks (plain rows ran at 8-way bank
#: conflicts: measured 18 % slower on the H200, docs/design-triton.md)
OPERAND_SMEM = gl.constexpr(gl.SwizzledSharedLayout(8, 1, 8, [1, 0]))


#: the exchange of four row sums' partials ([V, 16, 2, 2] fp32, from the state layout to ROWSUM_PARTS4) in one round
#: through its own buffer (Triton's convert_layout moved it in four rounds of two barriers). 16-byte vectors of the four
#: sums; the vector index c is a linear map of the row v and partial p bits: c0 = v0, c1 = p0 ^ p3, c2 = p1 ^ v1 (the
#: bank group, distinct within each 8-lane phase of the writes, which vary p0 p1 v0, and of the reads, which vary
#: p3 v0 v1), then p3, v1, p2, v2..v6. Listed: the tensor index [v, p, 2, 2] of each offset bit
ROWSUM4_XCHG_SMEM = gl.constexpr(gl.SharedLinearLayout(
    [[0, 0, 0, 1], [0, 0, 1, 0], [1, 0, 0, 0], [0, 1, 0, 0], [0, 2, 0, 0], [0, 9, 0, 0], [2, 2, 0, 0], [0, 4, 0, 0],
     [4, 0, 0, 0], [8, 0, 0, 0], [16, 0, 0, 0], [32, 0, 0, 0], [64, 0, 0, 0]]))
#: P's four vectors [K, 2, 2] fp32 from WARP_VEC4 to the stacked STATE_COLS layout in one round (Triton's took two):
#: vector index c0 = k2, c1 = k3 ^ k1, c2 = k4 (distinct within the writes' 8-lane phases, which vary k2 k3 k4, and
#: within the reads', which vary k1 k2), then k1, k0, k5, k6. Listed: the tensor index [k, 2, 2] of each offset bit
STATE_COLS4_XCHG_SMEM = gl.constexpr(gl.SharedLinearLayout(
    [[0, 0, 1], [0, 1, 0], [4, 0, 0], [8, 0, 0], [16, 0, 0], [10, 0, 0], [1, 0, 0], [32, 0, 0], [64, 0, 0]]))
#: the partials of four column sums [16, K, 2, 2] fp32 (state layout -> COLSUM_PARTS4) in one round: vector index
#: c0 = k1, c1 = k2 ^ k0, c2 = p0 ^ p3 (writes' phases vary k1 k2 p0, reads' p3 k0 k1), then k0, p3, p1, p2, k3..k6
COLSUM4_XCHG_SMEM = gl.constexpr(gl.SharedLinearLayout(
    [[0, 0, 0, 1], [0, 0, 1, 0], [0, 2, 0, 0], [0, 4, 0, 0], [1, 0, 0, 0], [0, 5, 0, 0], [9, 0, 0, 0], [2, 0, 0, 0],
     [4, 0, 0, 0], [0, 8, 0, 0], [0, 16, 0, 0], [0, 32, 0, 0], [0, 64, 0, 0]]))
#: four reduce-scattered sums [n, 2, 2] (an output per lane pair) to every warp (WARP_VEC4) in one round: vector index
#: c0 = n2 ^ n0, c1 = n3 ^ n1, c2 = n4 (writes vary n0 n1 in a phase, reads n2 n3 n4), then n0, n1, n5, n6
SUMS4_XCHG_SMEM = gl.constexpr(gl.SharedLinearLayout(
    [[0, 0, 1], [0, 1, 0], [4, 0, 0], [8, 0, 0], [16, 0, 0], [5, 0, 0], [10, 0, 0], [32, 0, 0], [64, 0, 0]]))
#: Q's four vectors [V, 2, 2] from WARP_VEC4 to the stacked STATE_ROWS layout in one round: c0 = v2 ^ v0, c1 = v3,
#: c2 = v4 (writes vary v2 v3 v4, reads v0), then v0, v1, v5, v6
STATE_ROWS4_XCHG_SMEM = gl.constexpr(gl.SharedLinearLayout(
    [[0, 0, 1], [0, 1, 0], [4, 0, 0], [8, 0, 0], [16, 0, 0], [5, 0, 0], [2, 0, 0], [32, 0, 0], [64, 0, 0]]))
#: the partials of one column sum [16, K] fp32 (state layout -> COLSUM_PARTS) in one round, 4-byte words: bank bits
#: k1, k2, p0 ^ k0, p1 ^ k3, p2 ^ p3 (writes vary k1 k2 p0 p1 p2, reads p3 k0 k1 k2 k3), then k0, k3, p3, k4..k6
COLSUM1_XCHG_SMEM = gl.constexpr(gl.SharedLinearLayout(
    [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0], [1, 1], [2, 8], [12, 0], [0, 16], [0, 32], [0, 64]]))
#: of one row sum [V, 16]: bank bits v0, v1, v2, p0 ^ p3, p1 ^ v3 (writes vary p0 p1 v0 v1 v2, reads p3 v0..v3),
#: then p3, v3, p2, v4..v6
ROWSUM1_XCHG_SMEM = gl.constexpr(gl.SharedLinearLayout(
    [[1, 0], [2, 0], [4, 0], [0, 1], [0, 2], [0, 9], [8, 2], [0, 4], [16, 0], [32, 0], [64, 0]]))
#: the window keys' bf16 parts [K, L] (a column of the window per thread, 2 x 16 bytes) read back transposed by
#: ldmatrix as the mma's B operand: 16-byte chunks XOR-swizzled by row
KEYS_SMEM = gl.constexpr(gl.SwizzledSharedLayout(8, 4, 2, [1, 0]))


@gluon.constexpr_function
def stacked4_layout(vector):
    """Four stacked copies [n, 2, 2] of a 1-D layout given as its linear layout (``gl.to_linear_layout``), the two new
    dimensions in registers: splitting them gives four tensors of the original distribution."""
    def lift(bases):
        return [[b[0], 0, 0] for b in bases]
    return gl.DistributedLinearLayout(reg_bases=[[0, 1, 0], [0, 0, 1]] + lift(vector.reg_bases),
                                      lane_bases=lift(vector.lane_bases), warp_bases=lift(vector.warp_bases),
                                      block_bases=lift(vector.block_bases), shape=[vector.shape[0], 2, 2])


# ---- the shared buffers, by name -------------------------------------------------------------------------------------
@aggregate
class StagedInputs:
    """One item's inputs in shared memory (:func:`_stage_inputs` copies them): codes [V, K] int8 (CODES_SMEM), the
    scales s_k | s_v [K + V] fp32, the tokens [16, K + V] fp16 (ranks R.. zero: the mma's k padding), the window's
    kbuf [L, K] bf16, ubuf [L, V] bf16, gbuf [L, K] fp16 and w [L] fp32, and the gate's pcum [K] fp32 (KDA)."""
    codes: gl.shared_memory_descriptor
    scales: gl.shared_memory_descriptor
    tokens: gl.shared_memory_descriptor
    kbuf: gl.shared_memory_descriptor
    ubuf: gl.shared_memory_descriptor
    gbuf: gl.shared_memory_descriptor
    w: gl.shared_memory_descriptor
    pcum: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, codes, scales, tokens, kbuf, ubuf, gbuf, w, pcum):
        self.codes = codes
        self.scales = scales
        self.tokens = tokens
        self.kbuf = kbuf
        self.ubuf = ubuf
        self.gbuf = gbuf
        self.w = w
        self.pcum = pcum


@aggregate
class ExchangeBuffers:
    """The exchanges' own buffers, each exchange in one round: the partials of four column sums [16, K, 2, 2]
    (COLSUM4_XCHG_SMEM) and of four row sums [V, 16, 2, 2] (ROWSUM4_XCHG_SMEM); four sums to every warp [V, 2, 2]
    (SUMS4_XCHG_SMEM); P's and Q's four vectors redistributed to STATE_COLS / STATE_ROWS [128, 2, 2]; the partials of
    one column sum [16, K] and of one row sum [V, 16], and those sums [K], [V]; the window keys' bf16 parts [K, L];
    the item's window flag [1] int32 (:func:`_window_live`)."""
    colsum4: gl.shared_memory_descriptor
    rowsum4: gl.shared_memory_descriptor
    sums4: gl.shared_memory_descriptor
    to_cols4: gl.shared_memory_descriptor
    to_rows4: gl.shared_memory_descriptor
    colsum1: gl.shared_memory_descriptor
    rowsum1: gl.shared_memory_descriptor
    kvec: gl.shared_memory_descriptor
    vvec: gl.shared_memory_descriptor
    keys_hi: gl.shared_memory_descriptor
    keys_lo: gl.shared_memory_descriptor
    live: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, colsum4, rowsum4, sums4, to_cols4, to_rows4, colsum1, rowsum1, kvec, vvec, keys_hi, keys_lo,
                 live):
        self.colsum4 = colsum4
        self.rowsum4 = rowsum4
        self.sums4 = sums4
        self.to_cols4 = to_cols4
        self.to_rows4 = to_rows4
        self.colsum1 = colsum1
        self.rowsum1 = rowsum1
        self.kvec = kvec
        self.vvec = vvec
        self.keys_hi = keys_hi
        self.keys_lo = keys_lo
        self.live = live


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _mul(a, b):
    return a * b


# ---- ranking -------------------------------------------------------------------------------------------------------
@gluon.jit
def _rank_due(idx_ptr, hcnt_ptr, due_ptr, N, num_slots, pid, H: gl.constexpr, HP: gl.constexpr, G: gl.constexpr,
              SCAN_FLAGS: gl.constexpr, TW: gl.constexpr):
    """Rank the call's due programs in flag order (row, head) and write the code ``slot * H + head`` of each one whose
    rank r is ``pid (mod G)`` to ``due[r]``; return their total. As the tl kernel's ranking, with a [rows, HP] tile of
    TW lanes along the heads (TW = min(HP, 32))."""
    FLAGS: gl.constexpr = gl.BlockedLayout([1, HP // TW], [32 // TW, TW], [gl.num_warps(), 1], [1, 0])
    SCAN_ROWS: gl.constexpr = SCAN_FLAGS // HP
    heads = gl.arange(0, HP, layout=gl.SliceLayout(0, FLAGS))
    rows0 = gl.arange(0, SCAN_ROWS, layout=gl.SliceLayout(1, FLAGS))
    total = 0
    r0 = 0
    while r0 < N:
        rows = r0 + rows0
        slot = gl.load(idx_ptr + rows, mask=rows < N, other=0)
        ok = (rows < N) & (slot > 0) & (slot < num_slots)      # out-of-range slots are skipped (graph capture)
        live = ok[:, None] & (heads[None, :] < H)
        fill = gl.load(hcnt_ptr + slot.to(gl.int64)[:, None] * H + heads[None, :], mask=live, other=0)
        due = (live & (fill == _L)).to(gl.int32)
        per_row = gl.sum(due, 1)
        n = gl.sum(per_row, 0)
        if n > 0:                                   # (a step with nothing due skips the prefix sums)
            # (Triton scans 1-D tensors of a blocked layout only: the row totals go through WORDS and back)
            flat = gl.convert_layout(per_row, WORDS)
            before = gl.convert_layout(gl.associative_scan(flat, 0, _add) - flat, gl.SliceLayout(1, FLAGS))
            rank = total + before[:, None] + gl.associative_scan(due, 1, _add) - 1
            gl.store(due_ptr + rank, slot[:, None] * H + heads[None, :], mask=(due > 0) & (rank % G == pid))
        total += n
        r0 += SCAN_ROWS
    return total


# ---- staging: the next item's inputs into shared memory --------------------------------------------------------------
#: the flag an item's code carries when its window is empty (:func:`_flush_item`): codes are slot * H + head < 2^62
_EMPTY_FLAG = gl.constexpr(1 << 62)


@gluon.jit
def _region(code, H, SS):
    """An item code slot * H + head (int64) -> (first fp32 word of its pool region, its row of the window tensors)."""
    slot = code // H
    head = code % H
    return gl.multiple_of(_OFF + slot * SS + head * _REGION_WORDS, _ALIGN), slot * H + head


@gluon.jit
def _stage_inputs(staged, pool, code, valid, H, IS_KDA: gl.constexpr):
    """Start copying item ``code``'s old checkpoint, window and gate into ``staged`` (:class:`StagedInputs`; cp.async,
    one commit group; 16-byte pieces where the data allows). Nothing is read where ``valid`` is false."""
    region, prog = _region(code, H, pool.slot_stride)
    cv = gl.arange(0, _V, layout=gl.SliceLayout(1, BYTES))
    ck = gl.arange(0, _K, layout=gl.SliceLayout(0, BYTES))
    async_copy.async_copy_global_to_shared(staged.codes,
                                           pool.raw_i8 + region * 4 + _CODES_BYTE + cv[:, None] * _K + ck[None, :],
                                           mask=valid)
    async_copy.async_copy_global_to_shared(staged.scales,
                                           pool.raw_f32 + region + _SK_WORD + gl.arange(0, _K + _V, layout=WORDS),
                                           mask=valid)
    # the token rows into rows 0..7 of the swizzled token buffer (whose rows split only at multiples of 8): ranks
    # R..7 masked, i.e. zero-filled by the copy itself
    tr = gl.arange(0, 2 * _R, layout=gl.SliceLayout(1, TOKENS))
    tc = gl.arange(0, _TOK_ROW, layout=gl.SliceLayout(0, TOKENS))
    async_copy.async_copy_global_to_shared(staged.tokens.slice(0, 2 * _R), pool.raw_f16 + region * 2 + _TOK_HALF
                                           + tr[:, None] * _TOK_ROW + tc[None, :], mask=valid & (tr[:, None] < _R))
    wl = gl.arange(0, _L, layout=gl.SliceLayout(1, HALVES))
    wk = gl.arange(0, _K, layout=gl.SliceLayout(0, HALVES))
    window = gl.multiple_of(prog * (_L * _K), _L * _K) + wl[:, None] * _K + wk[None, :]
    async_copy.async_copy_global_to_shared(staged.kbuf, pool.kbuf + window, mask=valid)
    async_copy.async_copy_global_to_shared(staged.ubuf, pool.ubuf + window, mask=valid)
    async_copy.async_copy_global_to_shared(staged.w, pool.w + prog * _L + gl.arange(0, _L, layout=WORDS), mask=valid)
    if IS_KDA:
        async_copy.async_copy_global_to_shared(staged.gbuf, pool.gbuf + window, mask=valid)
        async_copy.async_copy_global_to_shared(staged.pcum, pool.gate + prog * _K + gl.arange(0, _K, layout=WORDS),
                                               mask=valid)
    async_copy.commit_group()


# ---- (1) rebuild ---------------------------------------------------------------------------------------------------
@gluon.jit
def _token_operands(tok_s):
    """Tokens in shared memory [16, K + V] fp16 (ranks R.. zero) as mma operands: q^T [V, 16] and u [16, K]."""
    return tok_s.slice(_K, _V, dim=1).permute([1, 0]).load(A_OP), tok_s.slice(0, _K, dim=1).load(B_OP)


@gluon.jit
def _eighths(x):
    """[K, 2, 8] (the last axis in a thread's registers) -> its 8 slices [K, 2] along that axis (no data moves)."""
    x = gl.reshape(x, [_K, 2, 2, 2, 2])          # e = 4 e2 + 2 e1 + e0
    x0, x1 = gl.split(x)
    x00, x01 = gl.split(x0)
    x10, x11 = gl.split(x1)
    a0, a4 = gl.split(x00)
    a2, a6 = gl.split(x01)
    a1, a5 = gl.split(x10)
    a3, a7 = gl.split(x11)
    return a0, a1, a2, a3, a4, a5, a6, a7


@gluon.jit
def _from_eighths(a0, a1, a2, a3, a4, a5, a6, a7):
    """The inverse of :func:`_eighths`."""
    x0 = gl.join(gl.join(a0, a4), gl.join(a2, a6))
    x1 = gl.join(gl.join(a1, a5), gl.join(a3, a7))
    return gl.reshape(gl.join(x0, x1), [_K, 2, 8])


@gluon.jit
def _decay_products(g, top):
    """D_j = prod_{i > j} g_i [K, 2, 8] for the window's gates g [K, 2, 8] (entry j = 8 h + e at [:, h, e], each half h
    in one warp's registers): within a half, a chain of 7 multiplications from ``top`` [K, 2] (the product of the
    upper half's gates for h = 0, 1 for h = 1)."""
    g0, g1, g2, g3, g4, g5, g6, g7 = _eighths(g)
    d7 = gl.convert_layout(top, g7.type.layout, assert_trivial=True)
    d6 = d7 * g7
    d5 = d6 * g6
    d4 = d5 * g5
    d3 = d4 * g4
    d2 = d3 * g3
    d1 = d2 * g2
    d0 = d1 * g1
    return _from_eighths(d0, d1, d2, d3, d4, d5, d6, d7)


@gluon.jit
def _stage_keys(staged, hi_s, lo_s, IS_KDA: gl.constexpr):
    """The window keys w_j kbuf_j D_j [K, L] in fp32 from the staged window, split into bf16 hi + lo (hi = round(key),
    lo = round(key - hi): 2^-17 relative; bf16 x bf16 products are exact in fp32) into ``hi_s`` / ``lo_s``: the
    rebuild's mma operand. Each warp makes half of a column's entries (:data:`WINDOW`)."""
    keys = staged.kbuf.permute([1, 0]).load(WINDOW).to(gl.float32) * staged.w.load(gl.SliceLayout(0, WINDOW))[None, :]
    if IS_KDA:
        g = gl.reshape(staged.gbuf.permute([1, 0]).load(WINDOW).to(gl.float32), [_K, 2, _L // 2])
        # the upper half's product, in every warp: the lower half's chain starts from it
        upper = staged.gbuf.slice(_L // 2, _L // 2).permute([1, 0]).load(WINDOW).to(gl.float32)
        p = gl.reduce(upper, 1, _mul)
        h = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, g.type.layout)))
        p = gl.convert_layout(p, gl.SliceLayout(1, gl.SliceLayout(2, g.type.layout)), assert_trivial=True)
        top = gl.where(h[None, :] == 0, p[:, None], 1.0)
        keys = keys * gl.convert_layout(gl.reshape(_decay_products(g, top), [_K, _L]), WINDOW)
    hi = keys.to(gl.bfloat16)
    hi_s.store(hi)
    lo_s.store((keys - hi.to(gl.float32)).to(gl.bfloat16))


@gluon.jit
def _rebuild(staged, hi_s, lo_s, p, IS_KDA: gl.constexpr):
    """S [V, K] fp32 (STATE) = (codes s_k / 127 s_v + q^T u) * gate + ubuf^T keys, keys_j = w_j kbuf_j D_j, from the
    staged inputs (the gate: exp(pcum) for KDA, the loaded scalar ``p`` for GDN): the dequantisation on the CUDA
    cores, both rank updates on the tensor cores (the keys as bf16 parts through hi_s / lo_s)."""
    a = staged.scales.slice(0, _K).load(STATE_COLS) * _CODE_SCALE
    s_v = staged.scales.slice(_K, _V).load(STATE_ROWS)
    x = gl.inline_asm_elementwise(_CODE_BYTES_ASM, "=r,=r,r", [staged.codes.load(STATE)], dtype=gl.float32,
                                  is_pure=True, pack=2)
    S = (x - _CODE_SHIFT) * a[None, :] * s_v[:, None]                           # codes s_k / 127 s_v
    qT, u = _token_operands(staged.tokens)
    S = mma_v2(qT, u, S)                        # fp16 x fp16 products are exact in the fp32 accumulator
    if IS_KDA:
        S = S * gl.exp(staged.pcum.load(STATE_COLS))[None, :]
    else:
        S = S * p
    # the window: keys_j = w_j kbuf_j D_j as bf16 parts in hi_s / lo_s, made here rather than one item ahead (ahead
    # they measured 2.1 % faster for KDA without the tail overlap, 1.5 % slower beside the previous item's tail)
    _stage_keys(staged, hi_s, lo_s, IS_KDA)
    gl.thread_barrier()                         # (both parts in one round: Triton's convert_layout took 3 + 4 barriers)
    ubT = staged.ubuf.permute([1, 0]).load(A_OP)
    S = mma_v2(ubT, hi_s.permute([1, 0]).load(B_OP), S)
    S = mma_v2(ubT, lo_s.permute([1, 0]).load(B_OP), S)
    return S


# ---- the empty window: nothing to fold -------------------------------------------------------------------------------
@gluon.jit
def _window_live(staged, p, live_s, IS_KDA: gl.constexpr):
    """Writes to ``live_s`` ([1] int32) whether the staged window holds anything to fold (1) or not (0): some weight
    w_j is not 0, or the gate decays the checkpoint (KDA: some pcum is not 0; GDN: the loaded ``p`` is not 1). A NaN
    counts as something, -0.0 as zero: the complement of leapquant.reference.empty_window. Both vectors are read whole
    by every warp (WARP_VEC: one 16-byte load per thread each), so the reductions stay inside each warp (shuffles, an
    integer redux): no barrier. The flag goes to shared memory, read back where the stores need it
    (:func:`_window_flag`): a store cannot move past the caller's next barrier, so the test runs while the staged
    vectors are in hand; a flag kept in registers instead was computed by ptxas near its use, the loaded vectors held
    across the item (KDA spilled 28-104 bytes)."""
    w = staged.w.load(WARP_VEC)
    live = gl.max((w != 0.0).to(gl.int32), 0)
    if IS_KDA:
        pc = staged.pcum.load(WARP_VEC)
        live = gl.maximum(live, gl.max((pc != 0.0).to(gl.int32), 0))
    else:
        live = gl.maximum(live, (p != 1.0).to(gl.int32))
    live_s.store(gl.zeros([1], gl.int32, layout=WORDS) + live)


@gluon.jit
def _window_flag(live_s):
    """After a barrier: the flag :func:`_window_live` wrote, as a scalar bool."""
    return gl.max(live_s.load(WORDS), 0) != 0


# ---- (2) project: the products S^T x, S x (and the other reductions over S) ----------------------------------------
@gluon.jit
def _own_rows(T, IS_MAX: gl.constexpr):
    """[16, K]: each thread's sum (max) over its own 8 rows of T [V, K] (STATE) for its (row band, lane group);
    nothing crosses threads. Its rows' indices m and h are brought together, so that a sum of products is one chain
    of 8 FMAs."""
    part = gl.reshape(gl.permute(gl.reshape(T, [4, 2, 2, 8, _K]), [0, 2, 1, 3, 4]), [8, 16, _K])
    if IS_MAX:
        return gl.max(part, 0)
    return gl.sum(part, 0)


@gluon.jit
def _own_columns(T, IS_MAX: gl.constexpr):
    """[V, 16]: each thread's sum (max) over its own 8 columns of T [V, K] (STATE) for its (column band, quad)."""
    part = gl.reshape(gl.permute(gl.reshape(T, [_V, 4, 4, 4, 2]), [0, 1, 4, 2, 3]), [_V, 8, 16])
    if IS_MAX:
        return gl.max(part, 1)
    return gl.sum(part, 1)


# Every exchange below is split into the write of its buffer and the read after the next barrier, so that the caller
# places the barriers: one barrier then serves the exchanges of two items in flight (see _flush_item). Each buffer is
# written once per phase that uses it, and a barrier lies between its previous reads and that write.
@gluon.jit
def _put4(a, b, c, d, xs):
    """Four tensors stacked into their exchange buffer ``xs`` in one round: the partials of four column sums [16, K]
    or row sums [V, 16] (COLSUM4_XCHG_SMEM, ROWSUM4_XCHG_SMEM), or four WARP_VEC vectors to redistribute
    (STATE_COLS4_XCHG_SMEM, STATE_ROWS4_XCHG_SMEM; read back by :func:`_spread_get`)."""
    xs.store(gl.join(gl.join(a, b), gl.join(c, d)))


@gluon.jit
def _sum4(xs, vs, AXIS: gl.constexpr):
    """After a barrier: the four sums' partials read from ``xs`` by the threads that own an output (8 + 8 partials in
    two lanes: a reduce-scatter), summed along AXIS and written to ``vs`` (SUMS4_XCHG_SMEM)."""
    if AXIS == 0:
        four = xs.load(COLSUM_PARTS4)
    else:
        four = xs.load(ROWSUM_PARTS4)
    vs.store(gl.sum(four, AXIS))


@gluon.jit
def _split4(four, OUT: gl.constexpr):
    ab, cd = gl.split(four)
    a, b = gl.split(ab)
    c, d = gl.split(cd)
    return (gl.convert_layout(a, OUT, assert_trivial=True), gl.convert_layout(b, OUT, assert_trivial=True),
            gl.convert_layout(c, OUT, assert_trivial=True), gl.convert_layout(d, OUT, assert_trivial=True))


@gluon.jit
def _get4(vs):
    """After a barrier: the four sums of :func:`_sum4`, whole in every warp (four WARP_VEC vectors)."""
    return _split4(vs.load(WARP_VEC4), WARP_VEC)


@gluon.jit
def _project_t_partials(S, x0, x1, x2, x3, xs):
    """The partials of S^T x for four V-vectors x (STATE_ROWS) into ``xs``: each thread's own 8 rows, one FMA chain
    each."""
    _put4(_own_rows(S * x0[:, None], False), _own_rows(S * x1[:, None], False), _own_rows(S * x2[:, None], False),
          _own_rows(S * x3[:, None], False), xs)


@gluon.jit
def _project_partials(S, y0, y1, y2, y3, xs):
    """The partials of S y for four K-vectors y (STATE_COLS) into ``xs``."""
    _put4(_own_columns(S * y0[None, :], False), _own_columns(S * y1[None, :], False),
          _own_columns(S * y2[None, :], False), _own_columns(S * y3[None, :], False), xs)


@gluon.jit
def _spread_get(xs, OUT: gl.constexpr):
    """After a barrier: four WARP_VEC vectors written to ``xs`` by :func:`_put4` read back in layout OUT (STATE_ROWS
    or STATE_COLS): one exchange for four redistributions."""
    OUT4: gl.constexpr = stacked4_layout(gl.to_linear_layout(OUT, [_V]))
    return _split4(xs.load(OUT4), OUT)


# ---- (3) orthonormalise --------------------------------------------------------------------------------------------
#: the ten sums over a warp's 32 lanes of a Gram matrix's partials (one per lane), every lane getting all ten: a
#: reduce-scatter - at each butterfly level a lane keeps half of its sums and sends the other half (10 -> 5 -> 3 ->
#: 2 -> 1 values; the lane's bits 4..1 choose which) - then each sum read from a lane that holds it (index
#: b1 ? 2 + 5 b4 : b2 + 3 b3 + 5 b4): 23 shuffles and 12 adds where a butterfly per sum takes 50 of each (-2.3 % GDN
#: batch 256 on the H200, KDA equal; a CPU test runs the asm text through an emulator of its instructions)
_GRAM_ASM = gl.constexpr(
    "{ .reg .pred b4, b3, b2, b1; .reg .b32 lane, t; .reg .f32 s, k, r, w0, w1, w2, w3, w4, x0, x1, x2, y0, z; "
    "mov.u32 lane, %laneid; and.b32 t, lane, 16; setp.ne.u32 b4, t, 0; and.b32 t, lane, 8; setp.ne.u32 b3, t, 0; "
    "and.b32 t, lane, 4; setp.ne.u32 b2, t, 0; and.b32 t, lane, 2; setp.ne.u32 b1, t, 0; "
    "selp.f32 s, $10, $15, b4; selp.f32 k, $15, $10, b4; shfl.sync.bfly.b32 r, s, 16, 0x1f, -1; add.f32 w0, k, r; "
    "selp.f32 s, $11, $16, b4; selp.f32 k, $16, $11, b4; shfl.sync.bfly.b32 r, s, 16, 0x1f, -1; add.f32 w1, k, r; "
    "selp.f32 s, $12, $17, b4; selp.f32 k, $17, $12, b4; shfl.sync.bfly.b32 r, s, 16, 0x1f, -1; add.f32 w2, k, r; "
    "selp.f32 s, $13, $18, b4; selp.f32 k, $18, $13, b4; shfl.sync.bfly.b32 r, s, 16, 0x1f, -1; add.f32 w3, k, r; "
    "selp.f32 s, $14, $19, b4; selp.f32 k, $19, $14, b4; shfl.sync.bfly.b32 r, s, 16, 0x1f, -1; add.f32 w4, k, r; "
    "selp.f32 s, w0, w3, b3; selp.f32 k, w3, w0, b3; shfl.sync.bfly.b32 r, s, 8, 0x1f, -1; add.f32 x0, k, r; "
    "selp.f32 s, w1, w4, b3; selp.f32 k, w4, w1, b3; shfl.sync.bfly.b32 r, s, 8, 0x1f, -1; add.f32 x1, k, r; "
    "shfl.sync.bfly.b32 r, w2, 8, 0x1f, -1; add.f32 x2, w2, r; "
    "selp.f32 s, x0, x1, b2; selp.f32 k, x1, x0, b2; shfl.sync.bfly.b32 r, s, 4, 0x1f, -1; add.f32 y0, k, r; "
    "shfl.sync.bfly.b32 r, x2, 4, 0x1f, -1; add.f32 x2, x2, r; "
    "selp.f32 s, y0, x2, b1; selp.f32 k, x2, y0, b1; shfl.sync.bfly.b32 r, s, 2, 0x1f, -1; add.f32 z, k, r; "
    "shfl.sync.bfly.b32 r, z, 1, 0x1f, -1; add.f32 z, z, r; "
    "shfl.sync.idx.b32 $0, z, 0, 0x1f, -1; "
    "shfl.sync.idx.b32 $1, z, 4, 0x1f, -1; "
    "shfl.sync.idx.b32 $2, z, 2, 0x1f, -1; "
    "shfl.sync.idx.b32 $3, z, 8, 0x1f, -1; "
    "shfl.sync.idx.b32 $4, z, 12, 0x1f, -1; "
    "shfl.sync.idx.b32 $5, z, 16, 0x1f, -1; "
    "shfl.sync.idx.b32 $6, z, 20, 0x1f, -1; "
    "shfl.sync.idx.b32 $7, z, 18, 0x1f, -1; "
    "shfl.sync.idx.b32 $8, z, 24, 0x1f, -1; "
    "shfl.sync.idx.b32 $9, z, 28, 0x1f, -1; }")


@gluon.jit
def _gram(x0, x1, x2, x3):
    """G = X^T X (ten entries, lower triangle by rows) of four WARP_VEC vectors: each lane's own 4 rows summed in the
    thread, then :data:`_GRAM_ASM` over the lanes (every warp holds the vectors whole: no barrier). The entries come
    as [32] tensors (a lane's one element each, all lanes equal) in the layout of the vectors' [32, 4] view."""
    x0 = gl.reshape(x0, [32, 4])
    x1 = gl.reshape(x1, [32, 4])
    x2 = gl.reshape(x2, [32, 4])
    x3 = gl.reshape(x3, [32, 4])
    return gl.inline_asm_elementwise(
        _GRAM_ASM, "=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,f,f,f,f,f,f,f,f,f,f",
        [gl.sum(x0 * x0, 1), gl.sum(x1 * x0, 1), gl.sum(x1 * x1, 1), gl.sum(x2 * x0, 1), gl.sum(x2 * x1, 1),
         gl.sum(x2 * x2, 1), gl.sum(x3 * x0, 1), gl.sum(x3 * x1, 1), gl.sum(x3 * x2, 1), gl.sum(x3 * x3, 1)],
        dtype=(gl.float32,) * 10, is_pure=True, pack=1)


@gluon.jit
def _cholqr(x0, x1, x2, x3):
    """One CholeskyQR pass over four WARP_VEC vectors: G = X^T X (:func:`_gram`, warp-local), its Cholesky factor
    (floored pivots; the same arithmetic in every lane), X L^-T by forward substitution. A zero column comes out
    zero."""
    i00, l10, l20, l30, i11, l21, l31, i22, l32, i33 = cholesky4(*_gram(x0, x1, x2, x3))
    x0 = gl.reshape(x0, [32, 4])
    x1 = gl.reshape(x1, [32, 4])
    x2 = gl.reshape(x2, [32, 4])
    x3 = gl.reshape(x3, [32, 4])
    y0 = x0 * i00[:, None]
    y1 = (x1 - l10[:, None] * y0) * i11[:, None]
    y2 = (x2 - l20[:, None] * y0 - l21[:, None] * y1) * i22[:, None]
    y3 = (x3 - l30[:, None] * y0 - l31[:, None] * y1 - l32[:, None] * y2) * i33[:, None]
    return (gl.convert_layout(gl.reshape(y0, [_V]), WARP_VEC, assert_trivial=True),
            gl.convert_layout(gl.reshape(y1, [_V]), WARP_VEC, assert_trivial=True),
            gl.convert_layout(gl.reshape(y2, [_V]), WARP_VEC, assert_trivial=True),
            gl.convert_layout(gl.reshape(y3, [_V]), WARP_VEC, assert_trivial=True))


@gluon.jit
def _orthonormalise(c0, c1, c2, c3, PASSES: gl.constexpr):
    """CholeskyQR with PASSES passes (leapquant.numerics: one for P, two for Q)."""
    for _ in gl.static_range(PASSES):
        c0, c1, c2, c3 = _cholqr(c0, c1, c2, c3)
    return c0, c1, c2, c3


# ---- (4) tokens ----------------------------------------------------------------------------------------------------
@gluon.jit
def _store_tokens(tok, new_s, U4, Q4, valid):
    """u = fp16(clamp(U^T)), q = fp16(Q^T) from U, Q stacked [V, 2, 2] (rank i + 2 j at [:, i, j], as two joins of
    WARP_VEC vectors build them) to the pool's token rows where ``valid`` and to ``new_s`` [16, K + V] fp16 (rows
    0..7; 8..15 stay zero)."""
    u16 = gl.convert_layout(gl.minimum(gl.maximum(U4, -_FP16_MAX), _FP16_MAX).to(gl.float16), WARP_VEC4)
    q16 = gl.convert_layout(Q4.to(gl.float16), WARP_VEC4)
    v = gl.arange(0, _V, layout=gl.SliceLayout(1, gl.SliceLayout(2, WARP_VEC4)))
    i = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, WARP_VEC4)))
    j = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, WARP_VEC4)))
    at = tok + (i[None, :, None] + 2 * j[None, None, :]) * _TOK_ROW + v[:, None, None]
    gl.store(at, u16, mask=valid)
    gl.store(at + _K, q16, mask=valid)
    # rank i + 2 j = row of new_s: [V, i, j] -> [j, i, V] -> [R, V], then ranks R..7 zero (the swizzled buffer's
    # rows split only at multiples of 8)
    u8 = gl.reshape(gl.permute(u16, [2, 1, 0]), [_R, _K])
    q8 = gl.reshape(gl.permute(q16, [2, 1, 0]), [_R, _V])
    u8 = gl.reshape(gl.permute(gl.join(u8, gl.zeros_like(u8)), [2, 0, 1]), [2 * _R, _K])
    q8 = gl.reshape(gl.permute(gl.join(q8, gl.zeros_like(q8)), [2, 0, 1]), [2 * _R, _V])
    new_s.slice(0, 2 * _R).slice(0, _K, dim=1).store(u8)
    new_s.slice(0, 2 * _R).slice(_K, _V, dim=1).store(q8)


# ---- (5) residual --------------------------------------------------------------------------------------------------
@gluon.jit
def _residual(S, new_s):
    """E = S - q^T u [V, K] (STATE) on the tensor cores, with exactly the stored fp16 tokens (their mma operands read
    back from ``new_s``, after a barrier the caller places)."""
    qT, u = _token_operands(new_s)
    return mma_v2(-qT, u, S)


# ---- (6) scales, (7) codes, (8) window reset: an item's tail ---------------------------------------------------------
# Four exchanges, so four barriers: _flush_item runs them for the previous item at barriers of its own (loads first,
# then arithmetic, then stores: ptxas keeps shared-memory accesses it cannot tell apart in program order, so a store
# of one item written before a load of the other would serialise their latencies); _flush_tail for the last item.
@gluon.jit
def _scale_k_partials(E, colsum1_xs):
    """The partials of sum_v |E| per column (E [V, K], STATE) into ``colsum1_xs`` (COLSUM1_XCHG_SMEM)."""
    colsum1_xs.store(_own_rows(gl.abs(E), False))


@gluon.jit
def _scale_k(E, colsum, rowsum1_xs, s_k_ptr, valid):
    """From the column sums of |E| (STATE_COLS): s_k = max(sqrt(mean_v |E|), eps) by one rsqrt (m * rsqrt(m) is
    sqrt(m) to ~2 ulp; m floored at eps^2 first, so a zero column gets s_k = eps) stored to ``s_k_ptr`` [K] where
    ``valid``; returns x = E / s_k [V, K] (STATE) and writes the partials of max_k |x| per row into ``rowsum1_xs``."""
    m = gl.maximum(colsum * (1.0 / _V), _EPS * _EPS)
    inv_sk = gl.rsqrt(m)
    gl.store(s_k_ptr + gl.arange(0, _K, layout=STATE_COLS), gl.maximum(m * inv_sk, _EPS), mask=valid)
    x = E * inv_sk[None, :]
    rowsum1_xs.store(_own_columns(gl.abs(x), True))
    return x


@gluon.jit
def _scale_v_and_codes(x, rowmax):
    """From max_k |x| per row (STATE_ROWS): s_v = max(max_k |x|, eps) and the codes round_half_even(127 x / s_v)
    (|x| <= s_v: inside [-127, 127] without a clamp, 1 / s_v's rounding included) as bytes [V, K] (STATE)."""
    s_v = gl.maximum(rowmax, _EPS)
    # 1 / s_v to one ulp in two instructions (s_v >= eps is a normal number); fp32 division took ~9 each
    inv = gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [s_v], dtype=gl.float32, is_pure=True,
                                    pack=1)
    y = x * (_QMAX * inv)[:, None]
    return s_v, ((y + _RINT_MAGIC).to(gl.int32, bitcast=True) & _BYTE).to(gl.uint8)


@gluon.jit
def _store_codes_and_reset(s_v, codes, pool, region, prog, valid, IS_KDA: gl.constexpr):
    """s_v and the codes to the pool region, the codes as 16-byte vectors after one exchange through shared memory
    (the state layout's 2-byte pieces were 32 stores per thread, and the store queue throttled the end of every
    item); then the window reset (hcnt stays L: "flushed, empty"). Nothing is written where ``valid`` is false."""
    gl.store(pool.raw_f32 + region + _SK_WORD + _K + gl.arange(0, _V, layout=STATE_ROWS), s_v, mask=valid)
    codes = gl.convert_layout(codes, BYTES)
    cv = gl.arange(0, _V, layout=gl.SliceLayout(1, BYTES))
    ck = gl.arange(0, _K, layout=gl.SliceLayout(0, BYTES))
    gl.store(pool.raw_u8 + region * 4 + _CODES_BYTE + cv[:, None] * _K + ck[None, :], codes, mask=valid)
    # (8) window reset
    gl.store(pool.w + prog * _L + gl.arange(0, _L, layout=WORDS), gl.zeros([_L], gl.float32, layout=WORDS),
             mask=valid)
    if IS_KDA:
        gl.store(pool.gate + prog * _K + gl.arange(0, _K, layout=WORDS), gl.zeros([_K], gl.float32, layout=WORDS),
                 mask=valid)
        rl = gl.arange(0, _L, layout=gl.SliceLayout(1, HALVES))
        rh = gl.arange(0, _K, layout=gl.SliceLayout(0, HALVES))
        gl.store(pool.gbuf + prog * (_L * _K) + rl[:, None] * _K + rh[None, :],
                 gl.full([_L, _K], 1.0, gl.float16, layout=HALVES), mask=valid)
    else:
        gl.store(pool.gate + prog, 1.0, mask=valid)


@gluon.jit
def _flush_tail(E, xb, pool, code, H, IS_KDA: gl.constexpr):
    """The last item's tail on its own (its column partials already written by :func:`_flush_item`); ``xb``:
    :class:`ExchangeBuffers`; ``code``: the item's code as :func:`_flush_item` returns it (flagged: nothing is
    stored)."""
    region, prog = _region(code & (_EMPTY_FLAG - 1), H, pool.slot_stride)
    live = code < _EMPTY_FLAG
    gl.thread_barrier()
    xb.kvec.store(gl.sum(xb.colsum1.load(COLSUM_PARTS), 0))
    gl.thread_barrier()
    x = _scale_k(E, xb.kvec.load(STATE_COLS), xb.rowsum1, pool.raw_f32 + region + _SK_WORD, live)
    gl.thread_barrier()
    xb.vvec.store(gl.max(xb.rowsum1.load(ROWSUM_PARTS), 1))
    gl.thread_barrier()
    s_v, codes = _scale_v_and_codes(x, xb.vvec.load(STATE_ROWS))
    _store_codes_and_reset(s_v, codes, pool, region, prog, live, IS_KDA)


# ---- one item, phase by phase, beside the previous item's tail ---------------------------------------------------
@gluon.jit
def _flush_item(staged, xb, new_s, q0_s, pool, code, code_next, has_next, E_prev, code_prev, has_prev, H,
                IS_KDA: gl.constexpr):
    """Flush item ``code`` (its inputs already in ``staged``, :class:`StagedInputs`) up to its residual E [V, K]
    (STATE), returned with the partials of its first scale written (the next call or :func:`_flush_tail` finishes
    it), and start copying ``code_next``'s inputs as soon as the buffers are read. Also returned: ``code``, with
    _EMPTY_FLAG set where its window is empty (:func:`_window_live`): then none of its stores happen, neither its
    tokens here nor its tail there (the flag rides on the code, which the loop carries anyway). Beside its rebuild,
    P and Q it finishes the previous item ``code_prev`` (as returned for it) from its residual ``E_prev`` (stores
    only where ``has_prev`` and its code is not flagged): the two items share their barriers (``xb``:
    :class:`ExchangeBuffers`), and each one's exchanges and reductions fill the other's waits - one 8-warp program
    per SM has no other warps to hide them (measured 6.0 % faster all due for KDA, 6.6 % for GDN at batch 256 on the
    H200 than the same loop without the overlap; docs/design-triton.md)."""
    region_prev, prog_prev = _region(code_prev & (_EMPTY_FLAG - 1), H, pool.slot_stride)
    if IS_KDA:
        p = 1.0                                 # (GDN's gate; KDA's is pcum, staged)
    else:
        p = gl.load(pool.gate + code)            # (an item's code is its row of the window tensors)
    # an empty window (every w_j = 0, no decay) is not flushed: the item computes as any other (every warp passes the
    # same barriers) and its stores are masked
    _window_live(staged, p, xb.live, IS_KDA)
    has_prev = has_prev & (code_prev < _EMPTY_FLAG)

    # (1) rebuild, from the staged inputs, which then take the next item's copies | previous: column sums of |E|
    part = xb.colsum1.load(COLSUM_PARTS)
    S = _rebuild(staged, xb.keys_hi, xb.keys_lo, p, IS_KDA)
    xb.kvec.store(gl.sum(part, 0))
    gl.thread_barrier()
    _stage_inputs(staged, pool, code_next, has_next, H, IS_KDA)

    # (2) project, (3) orthonormalise: one subspace iteration from q0, P = orth(S^T q0), Q = orth(S P), U = S^T Q
    #     | previous: (6) s_k, x = E / s_k, the row maxima of |x|, s_v and (7) the codes, (8) its window reset
    colsum = xb.kvec.load(STATE_COLS)
    _project_t_partials(S, q0_s.slice(0, _V).load(STATE_ROWS), q0_s.slice(_V, _V).load(STATE_ROWS),
                        q0_s.slice(2 * _V, _V).load(STATE_ROWS), q0_s.slice(3 * _V, _V).load(STATE_ROWS), xb.colsum4)
    x_prev = _scale_k(E_prev, colsum, xb.rowsum1, pool.raw_f32 + region_prev + _SK_WORD, has_prev)
    gl.thread_barrier()
    four = xb.colsum4.load(COLSUM_PARTS4)
    part = xb.rowsum1.load(ROWSUM_PARTS)
    xb.sums4.store(gl.sum(four, 0))
    xb.vvec.store(gl.max(part, 1))
    gl.thread_barrier()
    p0, p1, p2, p3 = _get4(xb.sums4)
    p0, p1, p2, p3 = _orthonormalise(p0, p1, p2, p3, _P_PASSES)
    _put4(p0, p1, p2, p3, xb.to_cols4)
    gl.thread_barrier()
    p0, p1, p2, p3 = _spread_get(xb.to_cols4, STATE_COLS)
    _project_partials(S, p0, p1, p2, p3, xb.rowsum4)
    gl.thread_barrier()
    _sum4(xb.rowsum4, xb.sums4, 1)
    gl.thread_barrier()
    c0, c1, c2, c3 = _get4(xb.sums4)
    rowmax = xb.vvec.load(STATE_ROWS)
    c0, c1, c2, c3 = _orthonormalise(c0, c1, c2, c3, _Q_PASSES)     # (a latency chain: the codes' arithmetic fills it)
    s_v_prev, codes_prev = _scale_v_and_codes(x_prev, rowmax)
    _put4(c0, c1, c2, c3, xb.to_rows4)
    _store_codes_and_reset(s_v_prev, codes_prev, pool, region_prev, prog_prev, has_prev, IS_KDA)
    gl.thread_barrier()
    r0, r1, r2, r3 = _spread_get(xb.to_rows4, STATE_ROWS)
    _project_t_partials(S, r0, r1, r2, r3, xb.colsum4)
    gl.thread_barrier()
    _sum4(xb.colsum4, xb.sums4, 0)
    gl.thread_barrier()
    U0, U1, U2, U3 = _get4(xb.sums4)

    # (4) tokens; (5) residual, with exactly the stored tokens (read back from shared memory after a barrier)
    live = _window_flag(xb.live)
    region, _ = _region(code, H, pool.slot_stride)
    _store_tokens(pool.raw_f16 + region * 2 + _TOK_HALF, new_s, gl.join(gl.join(U0, U1), gl.join(U2, U3)),
                  gl.join(gl.join(c0, c1), gl.join(c2, c3)), live)
    gl.thread_barrier()
    E = _residual(S, new_s)
    # (6) the first step of the scales, read after the next barrier (the next item's or _flush_tail's)
    _scale_k_partials(E, xb.colsum1)
    return E, gl.where(live, code, code | _EMPTY_FLAG)


# ---- the kernel ----------------------------------------------------------------------------------------------------
@gluon.jit(do_not_specialize=["N", "num_slots", "SS"], do_not_specialize_on_alignment=["q0_ptr", "idx_ptr"])
def flush_due(raw_f32, raw_u8, raw_f16, kbuf_ptr, ubuf_ptr, w_ptr, gate_ptr, gbuf_ptr, q0_ptr, idx_ptr, hcnt_ptr,
              due_ptr, N, num_slots, SS, H: gl.constexpr, HP: gl.constexpr, G: gl.constexpr,
              IS_KDA: gl.constexpr, SCAN_FLAGS: gl.constexpr, TW: gl.constexpr):
    """Persistent program ``pid`` of ``G`` (8 warps): ranks the due programs, then flushes its items pid, pid + G,
    ..., each item's inputs copied into shared memory while the previous one computes. The arguments of the tl
    kernel (tl_kernel._flush_due), plus TW (lanes along the heads in the ranking: min(HP, 32))."""
    pid = gl.program_id(0)
    total = _rank_due(idx_ptr, hcnt_ptr, due_ptr, N, num_slots, pid, H, HP, G, SCAN_FLAGS, TW)
    # every thread reads the list entries other threads of this program wrote in the ranking's last step: the barrier
    # makes those global stores visible to them (without it a warp could read an entry before its writer stored it:
    # under compute-sanitizer's racecheck, which reorders warps, the flush then rewrote programs that were not due)
    gl.thread_barrier()

    # one item's inputs (StagedInputs); the new tokens (flat, ranks R.. zero); q0 column by column
    # (q0_s[r V + v] = q0[v, r]); the exchanges' own buffers (ExchangeBuffers)
    staged = StagedInputs(gl.allocate_shared_memory(gl.int8, [_V, _K], CODES_SMEM),
                          gl.allocate_shared_memory(gl.float32, [_K + _V], PLAIN1_SMEM),
                          gl.allocate_shared_memory(gl.float16, [_RPAD, _TOK_ROW], OPERAND_SMEM),
                          gl.allocate_shared_memory(gl.bfloat16, [_L, _K], PLAIN2_SMEM),
                          gl.allocate_shared_memory(gl.bfloat16, [_L, _V], OPERAND_SMEM),
                          gl.allocate_shared_memory(gl.float16, [_L, _K], PLAIN2_SMEM),
                          gl.allocate_shared_memory(gl.float32, [_L], PLAIN1_SMEM),
                          gl.allocate_shared_memory(gl.float32, [_K], PLAIN1_SMEM))
    new_s = gl.allocate_shared_memory(gl.float16, [_RPAD, _TOK_ROW], OPERAND_SMEM)
    q0_s = gl.allocate_shared_memory(gl.float32, [_R * _V], PLAIN1_SMEM)
    xb = ExchangeBuffers(gl.allocate_shared_memory(gl.float32, [16, _K, 2, 2], COLSUM4_XCHG_SMEM),
                         gl.allocate_shared_memory(gl.float32, [_V, 16, 2, 2], ROWSUM4_XCHG_SMEM),
                         gl.allocate_shared_memory(gl.float32, [_V, 2, 2], SUMS4_XCHG_SMEM),
                         gl.allocate_shared_memory(gl.float32, [_K, 2, 2], STATE_COLS4_XCHG_SMEM),
                         gl.allocate_shared_memory(gl.float32, [_V, 2, 2], STATE_ROWS4_XCHG_SMEM),
                         gl.allocate_shared_memory(gl.float32, [16, _K], COLSUM1_XCHG_SMEM),
                         gl.allocate_shared_memory(gl.float32, [_V, 16], ROWSUM1_XCHG_SMEM),
                         gl.allocate_shared_memory(gl.float32, [_K], PLAIN1_SMEM),
                         gl.allocate_shared_memory(gl.float32, [_V], PLAIN1_SMEM),
                         gl.allocate_shared_memory(gl.bfloat16, [_K, _L], KEYS_SMEM),
                         gl.allocate_shared_memory(gl.bfloat16, [_K, _L], KEYS_SMEM),
                         gl.allocate_shared_memory(gl.int32, [1], PLAIN1_SMEM))
    pool = PoolRefs(raw_f32, raw_u8, raw_u8.to(gl.pointer_type(gl.int8)), raw_f16, kbuf_ptr, ubuf_ptr, w_ptr, gate_ptr,
                    gbuf_ptr, hcnt_ptr, SS)

    t = pid
    if t < total:                                # (a program without items exits after the ranking)
        code = gl.load(due_ptr + t).to(gl.int64)
        _stage_inputs(staged, pool, code, t < total, H, IS_KDA)
        # while the first copies fly: the zero padding and q0
        staged.tokens.slice(2 * _R, 2 * _R).store(gl.zeros([2 * _R, _TOK_ROW], gl.float16, layout=TOKENS))
        new_s.slice(2 * _R, 2 * _R).store(gl.zeros([2 * _R, _TOK_ROW], gl.float16, layout=TOKENS))
        qi = gl.arange(0, _R * _V, layout=WORDS)
        q0_s.store(gl.load(q0_ptr + (qi % _V) * _R + qi // _V))
        # one loop body for every item: the first one finishes a zero "previous item" with its stores masked (a
        # separate first-item copy of the body measured +18 % at 1/16 due: its code is fetched cold)
        E = gl.zeros([_V, _K], gl.float32, layout=STATE)
        _scale_k_partials(E, xb.colsum1)
        code_prev = code + 0                     # (a value of its own: Triton carries a loop variable only if the
        #                                          body changes its handle, which `code_prev = code` would not)
        while t < total:
            t_next = t + G
            code_next = gl.load(due_ptr + t_next, mask=t_next < total, other=0).to(gl.int64)
            async_copy.wait_group(0)
            gl.thread_barrier()                  # this item's copies (every thread's) landed and are visible
            E, kept = _flush_item(staged, xb, new_s, q0_s, pool, code, code_next, t_next < total, E, code_prev, t > pid,
                                  H, IS_KDA)
            if t_next >= total:                  # the last item's tail now, with nothing beside it
                _flush_tail(E, xb, pool, kept, H, IS_KDA)
            code_prev = kept                     # (flagged where its window was empty: its tail stores nothing)
            code = code_next
            t = t_next
