"""leapquant's KDA decode step as a candidate of the step request's own benchmark.

The public request ``conless-leapquant-kda-step`` (Conless/kda, ``requests/conless-leapquant-kda-step``: its
``benchmark.py`` and its TileLang kernel ``baseline.py``, never copied into this repository) checks and times a module
given as ``--impl FILE``. It asks the module for

    run(codes, s_k, s_v, u, q, kbuf, ubuf, gbuf, w, pcum, h, qx, kx, vx, a, b, A_log, dt_bias)
        -> (o, k_row, u_row, g_row, w_new, pcum_new)          its correctness inputs, leading dims [B, 32]
    Pool(num_slots, device)                                     a pool of 32 KDA heads with the attributes raw, uq,
                                                                kbuf, ubuf, w, hcnt (its timing fills them)
    step_inplace(pool, idx, mixed, a, b, A_log, dt_bias, o)     the deployment call it times

which are leapquant's :func:`leapquant.step`, a :class:`leapquant.Pool` whose Compensator Tokens are also named
``uq``, and :func:`leapquant.step_inplace`, in the same argument order. So both kernels, the request's TileLang one
and ours, can be timed by the request's own harness in one run on one GPU:

    python benchmark.py                                    # the request's kernel (baseline.py beside it)
    python benchmark.py --impl bench/dev/request_step.py   # ours (LEAPQUANT_BACKEND picks the backend; default auto)

(the benchmark asserts a B200 or B300 by name; on another GPU that line of a local copy has to go).
"""
from __future__ import annotations

import leapquant

#: the request's geometry: 32 heads, one key head per head (KDA)
HEADS = 32


class Pool(leapquant.Pool):
    """A KDA pool of :data:`HEADS` heads, with the request's name ``uq`` for the Compensator Tokens ``tokens``
    (fp16 [NS, H, R, K + V], a view of raw)."""

    def __init__(self, num_slots: int, device=None) -> None:
        super().__init__(num_slots, HEADS, device=device, gate="kda")

    @property
    def uq(self):
        return self.tokens


def run(codes, s_k, s_v, u, q, kbuf, ubuf, gbuf, w, pcum, h, qx, kx, vx, a, b, A_log, dt_bias):
    """The request's functional form: :func:`leapquant.step` (the same inputs and outputs, in the same order)."""
    return leapquant.step(codes, s_k, s_v, u, q, kbuf, ubuf, gbuf, w, pcum, h, qx, kx, vx, a, b, A_log, dt_bias)


def step_inplace(pool: Pool, idx, mixed, a, b, A_log, dt_bias, o) -> None:
    """The request's deployment call: :func:`leapquant.step_inplace` with ``o`` as ``out``."""
    leapquant.step_inplace(pool, idx, mixed, a, b, A_log, dt_bias, o)
