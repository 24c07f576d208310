"""Compile-time probes of the Gluon kernel (leapquant/triton/gluon_kernel.py), run without a GPU by Triton's own
compiler and ptxas: the tests (tests/test_triton.py) and the PTX / SASS comparisons of a refactoring use them; the
shipped package does not carry them.

Gluon cannot compile under ``TRITON_INTERPRET=1`` (Triton's own library functions are then interpreted ones), so these
run in a Python started without it (tests/test_triton.py::_gluon_child).
"""
from __future__ import annotations

import contextlib
import io

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

from leapquant.triton import gluon_kernel
from leapquant.triton.gluon_kernel import (COLSUM1_XCHG_SMEM, COLSUM4_XCHG_SMEM, COLSUM_PARTS, COLSUM_PARTS4,
                                           KEYS_SMEM, PLAIN1_SMEM, ROWSUM1_XCHG_SMEM, ROWSUM4_XCHG_SMEM,
                                           ROWSUM_PARTS, ROWSUM_PARTS4, STATE, STATE_COLS, STATE_COLS4_XCHG_SMEM,
                                           STATE_ROWS, STATE_ROWS4_XCHG_SMEM, SUMS4_XCHG_SMEM, WARP_VEC4, WARPS,
                                           WINDOW, WORDS, _K, _L, _V, _own_columns, _own_rows, stacked4_layout)
from leapquant.triton.gluon_step_kernel import KVEC, _beta, _digits
from leapquant.triton.launch import SCAN_FLAGS


def compile_static(capability: int, gate: str = "kda", num_heads: int = 32, programs: int = 132):
    """The Gluon kernel (gluon_kernel.flush_due) compiled for compute capability ``capability`` (80, 90, 100, ...)
    without a GPU, with the compile-time arguments and pointer specialisation the launcher gives it: the check that
    the kernel builds for each target, and a way to read its PTX / SASS (``.asm["ptx"]``, ``.asm["sass"]``) or cubin
    ahead of time. Returns Triton's compiled-kernel object."""
    hp = triton.next_power_of_2(num_heads)
    kda = gate == "kda"
    sig = {"raw_f32": "*fp32", "raw_u8": "*u8", "raw_f16": "*fp16", "kbuf_ptr": "*bf16", "ubuf_ptr": "*bf16",
           "w_ptr": "*fp32", "gate_ptr": "*fp32", "gbuf_ptr": "*fp16" if kda else "*fp32", "q0_ptr": "*fp32",
           "idx_ptr": "*i32", "hcnt_ptr": "*i32", "due_ptr": "*i32", "N": "i32", "num_slots": "i32", "SS": "i32",
           "H": "constexpr", "HP": "constexpr", "G": "constexpr", "IS_KDA": "constexpr", "SCAN_FLAGS": "constexpr",
           "TW": "constexpr"}
    const = {"H": num_heads, "HP": hp, "G": programs, "IS_KDA": kda, "SCAN_FLAGS": SCAN_FLAGS, "TW": min(hp, 32)}
    names = list(sig)
    assert names == list(gluon_kernel.flush_due.arg_names), "the signature above must follow the kernel's"
    # the launch's specialisation: 16-byte aligned pool and window pointers (q0 and idx are not specialised)
    aligned = [i for i, n in enumerate(names) if sig[n].startswith("*") and n not in ("q0_ptr", "idx_ptr")]
    src = GluonASTSource(fn=gluon_kernel.flush_due, signature=sig,
                         constexprs={(names.index(k),): v for k, v in const.items()},
                         attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=dict(num_warps=WARPS, num_stages=1))


@gluon.jit
def _bank_report(name: gl.constexpr, x_type: gl.constexpr, buf):
    gl.static_print("leapquant-bank", name, gl.bank_conflicts(x_type, buf.type))


@gluon.jit
def _exchange_probe(out):
    """Prints, at compile time, the bank conflicts (gl.bank_conflicts: excess wavefronts per access) of every
    one-round exchange's writes and reads in its shared layout; run by :func:`exchange_bank_conflicts`."""
    S = gl.zeros([_V, _K], gl.float32, layout=STATE)
    by_rows = _own_rows(S, False)
    by_cols = _own_columns(S, False)
    col4 = gl.join(gl.join(by_rows, by_rows), gl.join(by_rows, by_rows))
    row4 = gl.join(gl.join(by_cols, by_cols), gl.join(by_cols, by_cols))
    buf = gl.allocate_shared_memory(gl.float32, [16, _K, 2, 2], COLSUM4_XCHG_SMEM)
    _bank_report("col4-write", col4.type, buf)
    _bank_report("col4-read", gl.distributed_type(gl.float32, [16, _K, 2, 2], COLSUM_PARTS4), buf)
    buf = gl.allocate_shared_memory(gl.float32, [_V, 16, 2, 2], ROWSUM4_XCHG_SMEM)
    _bank_report("row4-write", row4.type, buf)
    _bank_report("row4-read", gl.distributed_type(gl.float32, [_V, 16, 2, 2], ROWSUM_PARTS4), buf)
    buf = gl.allocate_shared_memory(gl.float32, [_V, 2, 2], SUMS4_XCHG_SMEM)
    _bank_report("vec-write-cols", gl.distributed_type(gl.float32, [_K, 2, 2], gl.SliceLayout(0, COLSUM_PARTS4)),
                 buf)
    _bank_report("vec-write-rows", gl.distributed_type(gl.float32, [_V, 2, 2], gl.SliceLayout(1, ROWSUM_PARTS4)),
                 buf)
    _bank_report("vec-read", gl.distributed_type(gl.float32, [_V, 2, 2], WARP_VEC4), buf)
    COLS4: gl.constexpr = stacked4_layout(gl.to_linear_layout(STATE_COLS, [_V]))
    ROWS4: gl.constexpr = stacked4_layout(gl.to_linear_layout(STATE_ROWS, [_V]))
    buf = gl.allocate_shared_memory(gl.float32, [_K, 2, 2], STATE_COLS4_XCHG_SMEM)
    _bank_report("cols-write", gl.distributed_type(gl.float32, [_K, 2, 2], WARP_VEC4), buf)
    _bank_report("cols-read", gl.distributed_type(gl.float32, [_K, 2, 2], COLS4), buf)
    buf = gl.allocate_shared_memory(gl.float32, [_V, 2, 2], STATE_ROWS4_XCHG_SMEM)
    _bank_report("rows-write", gl.distributed_type(gl.float32, [_V, 2, 2], WARP_VEC4), buf)
    _bank_report("rows-read", gl.distributed_type(gl.float32, [_V, 2, 2], ROWS4), buf)
    buf = gl.allocate_shared_memory(gl.float32, [16, _K], COLSUM1_XCHG_SMEM)
    _bank_report("col1-write", by_rows.type, buf)
    _bank_report("col1-read", gl.distributed_type(gl.float32, [16, _K], COLSUM_PARTS), buf)
    buf = gl.allocate_shared_memory(gl.float32, [_V, 16], ROWSUM1_XCHG_SMEM)
    _bank_report("row1-write", by_cols.type, buf)
    _bank_report("row1-read", gl.distributed_type(gl.float32, [_V, 16], ROWSUM_PARTS), buf)
    buf = gl.allocate_shared_memory(gl.float32, [_K], PLAIN1_SMEM)
    _bank_report("kvec-write", gl.distributed_type(gl.float32, [_K], gl.SliceLayout(0, COLSUM_PARTS)), buf)
    _bank_report("kvec-read", gl.distributed_type(gl.float32, [_K], STATE_COLS), buf)
    _bank_report("vvec-write", gl.distributed_type(gl.float32, [_V], gl.SliceLayout(1, ROWSUM_PARTS)), buf)
    _bank_report("vvec-read", gl.distributed_type(gl.float32, [_V], STATE_ROWS), buf)
    buf = gl.allocate_shared_memory(gl.bfloat16, [_K, _L], KEYS_SMEM)
    _bank_report("keys-write", gl.distributed_type(gl.bfloat16, [_K, _L], WINDOW), buf)
    gl.store(out + gl.arange(0, 32, layout=WORDS), gl.zeros([32], gl.float32, layout=WORDS))


def exchange_bank_conflicts(capability: int = 90) -> dict:
    """Bank conflicts of the Gluon kernel's one-round exchanges' shared layouts (the *_XCHG_SMEM layouts, the plain
    vectors, KEYS_SMEM) for their writes and reads, from Triton's own model (compiles a probe; no GPU):
    {"col4-write": 0, ...}; all zero by design."""
    printed = io.StringIO()
    knobs = triton.knobs.compilation
    always, knobs.always_compile = knobs.always_compile, True      # (the prints come from compiling, not the cache)
    try:
        with contextlib.redirect_stdout(printed):
            triton.compile(GluonASTSource(fn=_exchange_probe, signature={"out": "*fp32"}, constexprs={}, attrs={}),
                           target=GPUTarget("cuda", capability, 32), options=dict(num_warps=WARPS, num_stages=1))
    finally:
        knobs.always_compile = always
    found = {}
    for line in printed.getvalue().splitlines():
        if "leapquant-bank" in line:
            name, value = line.split("leapquant-bank", 1)[1].split()[:2]
            found[name] = int(value)
    return found


@gluon.jit
def beta_probe(b_ptr, out_ptr, BETA_BF16: gl.constexpr):
    """out[i] = the Gluon step kernel's beta of the bf16 b[i] (gluon_step_kernel._beta), one value per program as
    the kernel computes it: tests/test_triton_step.py runs it over every finite bf16 value on a GPU."""
    i = gl.program_id(0)
    gl.store(out_ptr + i, _beta(gl.load(b_ptr + i), BETA_BF16))


@gluon.jit
def digits_probe(x_ptr, digits_ptr, unit_ptr):
    """The Gluon step kernel's digits of one K-vector per program (gluon_step_kernel._digits, as phase (4) calls it):
    digits [4, K] int8 (d0 .. d3) and the unit; tests/test_triton_step.py checks them on a GPU. Launched with
    the step kernel's warps (gluon_step_kernel.WARPS), which its layout KVEC is written for."""
    i = gl.program_id(0)
    kk = gl.arange(0, _K, layout=KVEC)
    x = gl.load(x_ptr + i * _K + kk)
    d0, d1, d2, d3, unit = _digits(x)
    out = digits_ptr + i * 4 * _K + kk
    gl.store(out, d0)
    gl.store(out + _K, d1)
    gl.store(out + 2 * _K, d2)
    gl.store(out + 3 * _K, d3)
    gl.store(unit_ptr + i, unit)
