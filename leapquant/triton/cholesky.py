"""The 4 x 4 Cholesky factor of CholeskyQR, written once for both Triton flush kernels (the ``tl`` kernel and the
Gluon kernel, whose functions can call a ``triton.jit`` function on their tensors): elementwise arithmetic on the ten
entries of a Gram matrix G = X^T X, in whatever layout the caller holds them."""
from __future__ import annotations

import triton
import triton.language as tl

from ..numerics import CHOLQR_ABS_FLOOR, CHOLQR_RELATIVE_FLOOR

_REL_FLOOR = tl.constexpr(CHOLQR_RELATIVE_FLOOR)
_ABS_FLOOR = tl.constexpr(CHOLQR_ABS_FLOOR)


@triton.jit
def inv_pivot(d, g):
    """1 / sqrt of the Cholesky pivot d (column j's squared norm left after the earlier columns), the pivot floored at
    CHOLQR_RELATIVE_FLOOR * g (g = G_jj: the column's own squared norm) and at CHOLQR_ABS_FLOOR. One MUFU.RSQ (~2 ulp):
    a second CholeskyQR pass renormalises whatever the first leaves, and its own ulps are far below the fp16 tokens'
    rounding."""
    return tl.math.rsqrt(tl.maximum(tl.maximum(d, _REL_FLOOR * g), _ABS_FLOOR))


@triton.jit
def cholesky4(g00, g10, g11, g20, g21, g22, g30, g31, g32, g33):
    """G = L L^T for the Gram entries g_ji (j >= i): the inverse pivots i_jj = 1 / L_jj (floored: :func:`inv_pivot`)
    and the off-diagonal L_ji = (G_ji - sum_{m<i} L_jm L_im) / L_ii, returned as (i00, l10, l20, l30, i11, l21, l31,
    i22, l32, i33): what the forward substitution X L^-T needs."""
    i00 = inv_pivot(g00, g00)
    l10 = g10 * i00
    l20 = g20 * i00
    l30 = g30 * i00
    i11 = inv_pivot(g11 - l10 * l10, g11)
    l21 = (g21 - l20 * l10) * i11
    l31 = (g31 - l30 * l10) * i11
    i22 = inv_pivot(g22 - l20 * l20 - l21 * l21, g22)
    l32 = (g32 - l30 * l20 - l31 * l21) * i22
    i33 = inv_pivot(g33 - l30 * l30 - l31 * l31 - l32 * l32, g33)
    return i00, l10, l20, l30, i11, l21, l31, i22, l32, i33
