"""Clock stamps: the instrumentation of a profiling build (``FlushConfig(..., clock=MODE)``).

The kernel calls a :class:`Clock`'s methods at fixed points (kernel start, ranking, the first program, every step of
the program loop, loop end, kernel end); in the shipped build (``clock=None``) every method is a no-op that emits
nothing, so the shipped kernel's code is that of a generator without them. The stamps are written to the pool's
header words (``raw[0:OFF]``, which no program owns). The modes:

    "phases"    thread 0 of each group reads clock64 at the start of each program and after every step of the
                program loop (each phase, each group barrier), and adds the cycles since its previous stamp to the
                step's counter: int32 words ``raw[2 k + g]``, k = 0 the programs counted, k >= 1 the step named
                ``segments[k - 1]`` (the names, in loop order, are recorded while the kernel is traced:
                :func:`leapquant.tilelang.kernel.clock_segments`). A step that ends at a group barrier measures the
                group's critical path; one that does not (rebuild, the products) measures warp 0's own progress.
    "ctas"      (globaltimer, clock64, SM id) as int64 at CTA start, when each group leaves its program loop, and at
                CTA end: :data:`CTA_WORDS` words per CTA from word :data:`CTA_WORD` (stamp s at word
                ``CTA_WORD + bid * CTA_WORDS + CTA_STAMP_WORDS * s``: 0 start, 1 + g group g's loop end, 3 end).
    "prologue"  clock64 as int64 at the milestones of a round's prologue, :data:`PRO_WORDS` words per CTA from
                word :data:`CTA_WORD` (stamp k at word ``CTA_WORD + bid * PRO_WORDS + 2 k``): 0 CTA start,
                1 ranked, 2 + 7 g + m group g's milestone m (:data:`PRO_GROUP`), 16 + m inside the ranking
                (:data:`PRO_RANKING`).

The stamps change the kernel's code (two instrumented builds' totals differed by 5-7 % where the shipped kernels did
not, H200), so they show where a program's time goes, not A/B differences between kernels.
"""
from __future__ import annotations

import tilelang.language as T

from ..layout import OFF
from .config import I64

CTA_WORD = 2048                 #: first header word of the "ctas" and "prologue" stamps
CTA_STAMP_WORDS = 6             #: one "ctas" stamp: 3 int64
CTA_WORDS = 4 * CTA_STAMP_WORDS     #: "ctas" words per CTA: start, group 0's loop end, group 1's loop end, end
PRO_WORDS = 48                  #: "prologue" words per CTA: 24 int64 stamps
#: the "prologue" build's per-group milestones, m = 0..6 (stamps 2 + 7 g + m)
PRO_GROUP = ("first inputs landed", "first staged", "barrier after staging", "program 0 starts", "program 1 starts",
             "program 2 starts (if any)", "loop end")
#: the "prologue" build's CTA-wide milestones from stamp 16 on: before the ranking, then after each of the ranking's
#: first three barriers (of the ranking's last scan step)
PRO_RANKING = ("q0 and token padding", "idx landed (slots)", "hcnt landed (ballots)", "counts scanned")
#: largest grid whose stamps fit the header
MAX_STAMPED_CTAS = (OFF - CTA_WORD) // max(CTA_WORDS, PRO_WORDS)


@T.macro
def _program_start(raw32, g, t, stamp):
    if t == 0:
        stamp[0] = T.call_extern(I64, "clock64")
        T.evaluate(T.call_extern("handle", "atomicAdd", T.address_of(raw32[g]), 1))


@T.macro
def _mark(raw32, word, t, stamp):
    if t == 0:
        T.evaluate(T.call_extern("handle", "lq_mark", T.address_of(raw32[word]), T.address_of(stamp[0])))


@T.macro
def _cta_stamp(raw32, word, who):
    if who == 0:
        T.evaluate(T.call_extern("handle", "lq_cta_stamp", T.address_of(raw32[word])))


@T.macro
def _pro_stamp(raw32, word, cond):
    if cond:
        T.evaluate(T.call_extern("handle", "lq_pro_stamp", T.address_of(raw32[word])))


@T.macro
def _stamp_register():
    stamp = T.alloc_local((1,), I64)
    return stamp


class Clock:
    """The stamps of one traced kernel (``mode``: one of config.CLOCK_MODES). :meth:`attach` gives it the pool and
    the thread's place once the kernel knows them; every other method emits the stamps of its place in the kernel for
    the modes that record there, and nothing otherwise."""

    def __init__(self, mode: str | None) -> None:
        self.mode = mode
        self.segments: list[str] = []       #: "phases": the program loop's steps, in order (counter k + 1)

    def attach(self, raw32, bid, th) -> None:
        self.raw32, self.bid, self.th = raw32, bid, th
        if self.mode == "phases":
            self.stamp = _stamp_register()

    def _pro_word(self, k):
        return CTA_WORD + self.bid * PRO_WORDS + 2 * k

    def _cta_word(self, s):
        return CTA_WORD + self.bid * CTA_WORDS + CTA_STAMP_WORDS * s

    def kernel_start(self) -> None:
        if self.mode == "ctas":
            _cta_stamp(self.raw32, self._cta_word(0), self.th.tx)
        elif self.mode == "prologue":
            _pro_stamp(self.raw32, self._pro_word(0), self.th.tx == 0)

    def prologue_cta(self, k: int) -> None:
        """CTA-wide prologue milestone ``k`` (stamped by thread 0)."""
        if self.mode == "prologue":
            _pro_stamp(self.raw32, self._pro_word(k), self.th.tx == 0)

    def prologue_group(self, m: int) -> None:
        """Milestone ``m`` of PRO_GROUP for the thread's group (stamped by its thread 0)."""
        if self.mode == "prologue":
            _pro_stamp(self.raw32, self._pro_word(2 + 7 * self.th.g + m), self.th.t == 0)

    def program_start(self, it) -> None:
        """The start of the group's program ``it`` of the round."""
        if self.mode == "phases":
            _program_start(self.raw32, self.th.g, self.th.t, self.stamp)
        elif self.mode == "prologue":
            _pro_stamp(self.raw32, self._pro_word(2 + 7 * self.th.g + 3 + it), (self.th.t == 0) & (it < 3))

    def segment(self, name: str) -> None:
        """The end of the program loop's step ``name``."""
        if self.mode == "phases":
            self.segments.append(name)
            _mark(self.raw32, 2 * len(self.segments) + self.th.g, self.th.t, self.stamp)

    def group_end(self) -> None:
        """The group left its program loop (before the round's CTA barrier)."""
        if self.mode == "ctas":
            _cta_stamp(self.raw32, self._cta_word(1 + self.th.g), self.th.t)
        elif self.mode == "prologue":
            self.prologue_group(6)

    def kernel_end(self) -> None:
        """After the round's CTA barrier."""
        if self.mode == "ctas":
            _cta_stamp(self.raw32, self._cta_word(3), self.th.tx)
