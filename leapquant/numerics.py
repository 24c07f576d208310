"""The numbers of the math, defined once: the sizes of a program, the format's constants, and the settings of the
re-compression that every implementation shares (the reference, the Triton kernels, the TileLang kernel).

Sizes (docs/spec.md section 2): one program is a V x K state, a window of L entries and R Compensator Tokens.
"""
from __future__ import annotations

# ---- sizes ----------------------------------------------------------------------------------------------------------
V = 128          #: value dimension (rows of the state)
K = 128          #: key dimension (columns of the state)
L = 16           #: window length: updates buffered between two flushes
R = 4            #: rank of the fp16 part (number of Compensator Tokens)
DEFAULT_HEADS = 32  #: heads per sequence where a caller gives none (Kimi-Linear's KDA layers: 32 heads)
GATES = ("kda", "gdn")  #: the gate variants: per key channel (Kimi Delta Attention), one per head (Gated DeltaNet)

# ---- the format -------------------------------------------------------------------------------------------------------
QMAX = 127       #: largest code magnitude; codes live in [-QMAX, QMAX]
EPS = 1e-12      #: floor of both smoothing scales (an all-zero column or row keeps finite scales)
FP16_MAX = 65504.0  #: largest finite fp16: the tokens are clamped to it (|S| < 1e4 can give |U| ~ 1e5)

# ---- orthonormalisation -----------------------------------------------------------------------------------------------
#: The reference orthonormalises by Gram-Schmidt with every projection applied twice; a column whose norm after
#: projection is at most this is numerically absent (an all-zero or rank-deficient head) and becomes a zero column
#: instead of 0 / 0. fp32's smallest normal is 1.2e-38, so any real direction is far above it.
GS_ABS_FLOOR = 1e-30

#: The kernels orthonormalise by CholeskyQR: X <- X L^-T with L L^T = X^T X (the 4 x 4 Gram matrix), repeated. The
#: first pass leaves the columns orthonormal to about eps * cond(X)^2 (bounded by the floors below), a second to working
#: precision. P = S^T q0 only seeds the iteration (S P spans the same space for any basis of P's span, and Q's passes
#: orthonormalise what S P leaves), so it gets one pass; Q two. A CPU emulation of exactly this inside the reference's
#: compression passes the criterion on every family (8 x 128 heads per gate, worst head 0.9911 of its bound, as with two
#: passes for P).
P_CHOLQR_PASSES = 1
Q_CHOLQR_PASSES = 2
#: Pivot floor relative to the column's own squared norm G_jj: the Schur complement G_jj - sum_i L_ji^2 comes out of
#: fp32 dot products of 128 terms, so its rounding is about sqrt(128) 2^-24 ~ 7e-7 of G_jj; a pivot below that carries
#: no direction (a rank-deficient head), and flooring it keeps L^-1 finite: the column becomes small noise that the next
#: pass orthonormalises, as Gram-Schmidt makes a direction of its rounding noise.
CHOLQR_RELATIVE_FLOOR = 1e-6
#: Absolute pivot floor, in squared-norm units: a column with G_jj below it (norm < 1e-18) is absent. It is a normal fp32
#: (the smallest is 1.2e-38), so its reciprocal square root is finite, and an all-zero column stays exactly zero
#: (0 * 1e18): an all-zero head decodes to 0.
CHOLQR_ABS_FLOOR = 1e-36

#: The start matrix q0 [V, R] seeds that iteration (P = S^T q0) and serves every program. Where a host path reads its
#: values anyway (Pool.encode, the functional flush), a q0 whose column norms lie outside this range or whose columns
#: are not independent (the smallest eigenvalue of its Gram matrix below Q0_MIN_EIGEN_RATIO of the largest) is refused:
#: a zero, tiny or repeated column seeds fewer than R directions (encode's error grew 25-150x without a word), and the
#: kernels' fp32 Gram matrix of S^T q0 overflows at column norms near 1e19. default_q0's columns have unit norm and an
#: eigenvalue ratio near 0.9; a Gaussian's (norm ~11) pass as well.
Q0_NORM_RANGE = (2.0 ** -10, 2.0 ** 10)
Q0_MIN_EIGEN_RATIO = 1e-6

# ---- the decode step (docs/spec.md section 7) ---------------------------------------------------------------------------
#: added to the squared norm of a key / query before the square root (an all-zero key normalises to zero)
NORM_EPS = 1e-6
#: softplus(x) = x above this (as torch's and the models' softplus): log1p(exp(x)) differs from x by < 2.1e-9 there
SOFTPLUS_THRESHOLD = 20.0

# ---- rounding -----------------------------------------------------------------------------------------------------------
#: 1.5 * 2^23: adding it to an fp32 |y| < 2^22 rounds y to the nearest integer, ties to even (the adder's own rounding),
#: and leaves that integer in the low mantissa bits, whose low byte is then the int8 code in two's complement: codes
#: without a rounding or float-to-int instruction (both issue at a quarter of the FMA rate on NVIDIA GPUs)
RINT_MAGIC = 12582912.0
#: the exact dequantisation of a code byte without an integer-to-float instruction: the byte with its sign bit flipped
#: (code + 128, in 0..255) placed as the low mantissa byte of the float 2^23 (bits CODE_BIAS_BITS) reads
#: 2^23 + 128 + code, and subtracting CODE_BIAS = 2^23 + 128 leaves the code exactly
CODE_BIAS_BITS = 0x4B000000
CODE_SIGN = 0x80  #: a code byte's sign bit: XOR with it turns the int8 code into code + 128, an unsigned byte
CODE_BIAS = 2.0 ** 23 + CODE_SIGN
