"""The pool's buffers as the Gluon kernels (the flush's and the step's) address them: one named aggregate, built once
per program from the kernel's pointer arguments and handed to its phases; and the one import of Gluon's aggregates
that both kernels use for their named buffers."""
# (no ``from __future__ import annotations``: the aggregate's field annotations must be real types, which Triton
# checks each field's value against)

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
# Gluon's named aggregates (Triton 3.6 exports no public name for them; Gluon's own modules import this one)
from triton.language.core import _aggregate as aggregate


@aggregate
class PoolRefs:
    """Pointers into a pool (:class:`leapquant.layout.Pool`): its raw words as fp32, as uint8 (the codes' stores) and
    int8 (their loads), and as fp16 (the tokens); the window's kbuf and ubuf (bf16 [L, K] / [L, V] per program), w
    (fp32 [L]), the gate state (KDA pcum fp32 [K], GDN p fp32), gbuf (KDA fp16 [L, K]), the fill counts hcnt (int32);
    and the slot stride in fp32 words."""
    raw_f32: gl.tensor
    raw_u8: gl.tensor
    raw_i8: gl.tensor
    raw_f16: gl.tensor
    kbuf: gl.tensor
    ubuf: gl.tensor
    w: gl.tensor
    gate: gl.tensor
    gbuf: gl.tensor
    hcnt: gl.tensor
    slot_stride: gl.tensor

    @gluon.constexpr_function
    def __init__(self, raw_f32, raw_u8, raw_i8, raw_f16, kbuf, ubuf, w, gate, gbuf, hcnt, slot_stride):
        self.raw_f32 = raw_f32
        self.raw_u8 = raw_u8
        self.raw_i8 = raw_i8
        self.raw_f16 = raw_f16
        self.kbuf = kbuf
        self.ubuf = ubuf
        self.w = w
        self.gate = gate
        self.gbuf = gbuf
        self.hcnt = hcnt
        self.slot_stride = slot_stride
