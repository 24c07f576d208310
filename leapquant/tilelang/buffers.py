"""The named aggregates the flush kernel's phases share, and the index functions of their shared-memory layouts.

:func:`leapquant.tilelang.kernel.make_flush_func` allocates every buffer once, at the top of the kernel, and bundles
them here; each phase (a TileLang macro) takes the aggregates it reads and writes instead of a long list of buffers.
A macro reads a field as a plain Python attribute while it is traced, so the generated code is that of the buffers
themselves. The index functions are plain Python on TileLang expressions (no tilelang import needed here).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..layout import OFF, REGION_WORDS, slot_stride
from .config import I64, QUADS, ROW_CHUNKS


@dataclass(frozen=True)
class PoolTensors:
    """The kernel's arguments: the pool (``raw`` as int32 / fp32 / fp16 views, the window tensors), q0, idx and the
    run-time sizes."""
    raw32: object
    rawf: object
    rawh: object
    kbuf: object
    ubuf: object
    w: object
    pcum: object                # KDA (a one-element stand-in for GDN)
    gbuf: object                # KDA (a one-element stand-in for GDN)
    p: object                   # GDN (a one-element stand-in for KDA)
    hcnt: object
    q0: object
    idx: object
    n_rows: object              # rows of idx
    num_slots: object


@dataclass(frozen=True)
class RankingBuffers:
    """The ranking's shared memory: the scan step's slots, its due-flag mask words, the warps' counts, this CTA's list of
    due programs (slot * H + head); and the running count of ranked programs (a register)."""
    slot_s: object
    mask_s: object
    wsum_s: object
    dlist: object
    ranked: object


@dataclass(frozen=True)
class PrefetchBuffers:
    """A group's copy of its next program's inputs (cp.async): the checkpoint (int32 words, with fp32 and fp16
    views; the codes' chunks swizzled by :func:`code_chunk`), kbuf, ubuf, gbuf (KDA), w and pcum (GDN: p)."""
    ck: object
    ckf: object
    ckh: object
    kb: object
    ub: object
    gb: object
    w: object
    pc: object


@dataclass(frozen=True)
class GroupBuffers:
    """The groups' shared memory between phases, ``[group, ...]``: the staged mma operands (window keys and values,
    old tokens), the new tokens, the reduction planes (``red_s``, viewed flat as ``flat_s`` by the scales), P (split
    into tf32 parts) and Q, the old and new scales, the gate, the Gram partials, the empty-window flags; and q0 (one
    copy per CTA)."""
    kw_s: object                # window keys, KEY_PARTS bf16 parts, pairs along the window, swizzled (col_word)
    ubw_s: object               # window values, bf16 pairs, swizzled (row_word)
    tok_old_s: object           # old tokens as fp16 mma pairs, [u side (columns), q side (rows)]
    tok_new_s: object           # new tokens likewise (q negated: the residual's operands)
    red_s: object               # the products' reduction planes
    flat_s: object              # the same memory, flat: the scales' partial planes
    pv_s: object                # P, tf32 big and small parts (the B operand of S P)
    qv_s: object                # Q
    sko_s: object               # old s_k / 127
    svo_s: object               # old s_v
    gate_s: object              # exp(pcum) (GDN: p)
    skn_s: object               # 1 / new s_k
    rsv_s: object               # 127 / new s_v
    gram_s: object              # Gram partials per pass and orthonormalising warp
    live_s: object              # [group]: the next program's window holds something (1) or is empty (0):
    #                             staging.window_live
    q0_s: object


@dataclass(frozen=True)
class Thread:
    """A thread's place: its index ``tx`` in the CTA, its group ``g`` and index ``t`` in it, its lane, its warp's band
    (``wr``, ``wc``), its mma fragment position (``grp``, ``quad``), its state rows ``rbase + ROW_STEP i`` and columns
    ``col0 + j``, its reduction planes (``tr`` for column partials, ``tc`` for row partials) and its group's barrier."""
    tx: object
    g: object
    t: object
    lane: object
    wr: object
    wc: object
    grp: object
    quad: object
    band_r: object
    band_c: object
    rbase: object
    col0: object
    tr: object
    tc: object
    bar: object                 # the group's named barrier (256 threads)


def region_word(slot, head, num_heads):
    """First fp32 word of the (slot, head) region of the pool (int64: a large pool exceeds 2^31 halfwords): the kernel's
    form of :func:`leapquant.layout.region_word`, from the same constants."""
    import tilelang.language as T
    return T.cast(slot, I64) * slot_stride(num_heads) + T.cast(head * REGION_WORDS + OFF, I64)


def row_word(pair, v):
    """Shared-memory index of row ``v`` in a plane of row-side operand words (window values, q tokens): XOR of bits 3-4
    by the pair, so that an A fragment (8 rows x 4 pairs per load) hits 32 different banks."""
    return v ^ ((pair % QUADS) << 3)


def col_word(pair, c):
    """Index of column ``c`` in a plane of column-side operand words (window keys, u tokens): XOR of bits 1-2 by the
    pair, so that a B fragment (8 columns x 4 pairs per load) hits 32 different banks."""
    return c ^ ((pair % QUADS) << 1)


def code_chunk(row, c):
    """Prefetch-buffer chunk of the codes' 16-byte chunk c of row ``row`` (XOR-swizzled by the row)."""
    return row * ROW_CHUNKS + (c ^ (row % ROW_CHUNKS))
