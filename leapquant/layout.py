"""The pool ABI, defined once: constants, byte layout of a checkpoint, and :class:`Pool`.

Every other module (kernels, tests, benchmark) imports its offsets and shapes from here; the math's sizes and
constants (V, K, L, R, QMAX, EPS) are :mod:`leapquant.numerics`'s, re-exported.

Geometry (SPEC section 4). The serving engine owns one flat fp32 buffer ``raw`` of ``NS * SS + OFF`` words with
``SS = (H + 1) * V * K`` (one spare head region per slot). The (slot, head) region of ``V * K`` fp32 words starts at
word ``OFF + slot * SS + head * V * K``; its first :data:`CHECKPOINT_BYTES` bytes are the checkpoint:

    bytes [0, 16384)        int8 codes, row-major [V, K]
    bytes [16384, 16896)    fp32 column scales s_k [K]
    bytes [16896, 17408)    fp32 row scales s_v [V]
    bytes [17408, 19456)    fp16 Compensator Tokens [R, K + V]: row r = (u[r, :K] | q[r, :V])

The window tensors are separate and dense ([NS, H, ...]). Slot 0 is reserved ("no sequence").
"""
from __future__ import annotations

import contextlib
import math
import operator
from dataclasses import dataclass
from typing import Sequence

import torch

from .numerics import DEFAULT_HEADS, EPS, FP16_MAX, GATES, K, L, QMAX, R, V  # noqa: F401  (re-exported)
from .numerics import Q0_MIN_EIGEN_RATIO, Q0_NORM_RANGE
from .devices import device_here
from .options import name_word
from .reference import compress, decode_checkpoint, default_q0, pool_writes, rebuild


# ---- the pool's geometry, in fp32 words unless said otherwise --------------------------------------------------------
OFF = 12288                      #: word offset of slot 0 inside ``raw`` (engines keep a header there)
REGION_WORDS = V * K             #: one (slot, head) region: 64 KB
CODES_BYTE = 0                   #: byte offset of the int8 codes inside a region
SK_BYTE = V * K                  #: byte offset of s_k (16384)
SV_BYTE = SK_BYTE + 4 * K        #: byte offset of s_v (16896)
TOK_BYTE = SV_BYTE + 4 * V       #: byte offset of the fp16 tokens (17408)
CHECKPOINT_BYTES = TOK_BYTE + 2 * R * (K + V)  #: 19456
SK_WORD = SK_BYTE // 4           #: s_k's offset in the region's fp32 words (s_v follows it: one run of K + V words)
SV_WORD = SV_BYTE // 4           #: s_v's offset in fp32 words
TOK_HALF = TOK_BYTE // 2         #: the tokens' offset in the region's fp16 halfwords
TOK_ROW = K + V                  #: halfwords per token row: u[r, :K] | q[r, :V]
#: every region starts on a multiple of this many fp32 words (OFF, the slot stride and the region size are)
REGION_ALIGN_WORDS = math.gcd(OFF, REGION_WORDS)
CHECKPOINT_WORDS = CHECKPOINT_BYTES // 4
#: A pool's buffers start on a 16-byte boundary (the GPU kernels copy checkpoints and windows in 16-byte pieces): a
#: fresh allocation does, and so must an engine's buffer carved out of a larger one. The exceptions are
#: :data:`LOOSE_ALIGNMENT`'s fields.
ALIGN_BYTES = 16
#: the window fields of 4 bytes per (slot, head) (the fill count, GDN's gate product): an engine that stacks them per
#: layer ([layers, NS, H]) puts a layer's view off a 16-byte boundary whenever NS * H % 4 != 0 (H = 2 per rank,
#: NS = 257). The pool accepts that (the Triton kernels read them an element at a time); TileLang declines it.
LOOSE_ALIGNMENT = ("hcnt", "p")

assert CHECKPOINT_BYTES == 19456 and SK_BYTE % 4 == 0 and TOK_BYTE % 4 == 0


def slot_stride(num_heads: int) -> int:
    """Words between two slots: ``num_heads`` regions plus one spare."""
    return (num_heads + 1) * REGION_WORDS


def raw_words(num_slots: int, num_heads: int) -> int:
    """Length of ``raw`` in fp32 words."""
    return num_slots * slot_stride(num_heads) + OFF


def region_word(slot: int, head: int, num_heads: int) -> int:
    """First fp32 word of the (slot, head) region in ``raw``."""
    return OFF + slot * slot_stride(num_heads) + head * REGION_WORDS


def _view(raw: torch.Tensor, dtype: torch.dtype, shape: Sequence[int], strides: Sequence[int], offset: int) -> torch.Tensor:
    """A strided view of ``raw`` as ``dtype``: offset (from raw's first word, which may lie anywhere in its storage)
    and strides in elements of ``dtype``."""
    assert (raw.storage_offset() * raw.element_size()) % dtype.itemsize == 0, "raw's start is 16-byte aligned"
    start = raw.storage_offset() * raw.element_size() // dtype.itemsize + offset
    out = torch.empty(0, dtype=dtype, device=raw.device)
    out.set_(raw.untyped_storage(), start, tuple(shape), tuple(strides))
    return out


# ---- the bulk helpers' arguments ------------------------------------------------------------------------------------
_SIZES = {"V": V, "K": K, "L": L, "R": R}


@dataclass(frozen=True)
class Field:
    """One per-(sequence, head) tensor the pool stores: its dims (names of the geometry constants), the dtype the
    pool keeps it in, and the values the format admits (checked after conversion to ``dtype``).

    An integer field must be given in exactly ``dtype``; a floating field in any floating dtype (it is converted, and
    a value that does not survive the conversion, e.g. an fp32 token above the fp16 range, fails the value check).
    Every floating value must be finite, but -inf where ``neg_inf`` admits it."""
    dims: tuple[str, ...]
    dtype: torch.dtype
    lo: float | None = None      #: smallest admitted value
    hi: float | None = None      #: largest admitted value
    lo_open: bool = False        #: ``lo`` itself is excluded
    #: the value of a new pool: an empty window's (a flush's window reset), a new sequence's checkpoint's
    #: (reset_slots: what a flush writes for a zero state)
    empty: float = 0.0
    neg_inf: bool = False        #: -inf is admitted as well (a log-decay that saturated)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(_SIZES[d] for d in self.dims)

    def domain(self) -> str:
        """The admitted values, in words."""
        finite = "" if not self.dtype.is_floating_point else "finite" + (" or -inf" if self.neg_inf else "")
        if self.lo is None and self.hi is None:
            return finite
        if self.hi is None:
            bound = f"{'>' if self.lo_open else '>='} {self.lo:g}"
        elif self.lo is None:
            bound = f"<= {self.hi:g}"
        else:
            bound = f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}]"
        return f"{finite} and {bound}" if finite else bound

    def bad_mask(self, t: torch.Tensor) -> torch.Tensor:
        """Element-wise: this value of ``t`` (already in ``dtype``) is not admitted."""
        parts = []
        if t.is_floating_point():
            parts.append(~torch.isfinite(t) & (t != float("-inf")) if self.neg_inf else ~torch.isfinite(t))
        if self.lo is not None:
            parts.append((t <= self.lo) if self.lo_open else (t < self.lo))
        if self.hi is not None:
            parts.append(t > self.hi)
        if not parts:
            return torch.zeros_like(t, dtype=torch.bool)
        for extra in parts[1:]:
            parts[0] |= extra
        return parts[0]


#: Every tensor a (sequence, head) owns in the pool, by the name the bulk helpers' arguments carry. Value ranges follow
#: the SPEC's domain, widened where a decode step can legitimately leave it: gbuf and p may underflow to 0 (a step
#: stores exp(g) rounded to fp16, and p shrinks by a factor per step), so they are checked in [0, 1], not (0, 1]; pcum
#: may be -inf (a gate pre-activation of +inf, or one whose softplus overflows fp32, saturates g to -inf, and the step
#: stores pcum + g), so that what :meth:`Pool.read_window` returns can always be written back.
FIELDS: dict[str, Field] = {
    "codes": Field(("V", "K"), torch.int8, -QMAX, QMAX),
    "s_k": Field(("K",), torch.float32, 0.0, lo_open=True, empty=EPS),
    "s_v": Field(("V",), torch.float32, 0.0, lo_open=True, empty=EPS),
    "u": Field(("R", "K"), torch.float16),
    "q": Field(("R", "V"), torch.float16),
    "kbuf": Field(("L", "K"), torch.bfloat16),
    "ubuf": Field(("L", "V"), torch.bfloat16),
    "w": Field(("L",), torch.float32, 0.0, 1.0),
    "pcum": Field(("K",), torch.float32, hi=0.0, neg_inf=True),
    "gbuf": Field(("L", "K"), torch.float16, 0.0, 1.0, empty=1.0),
    "p": Field((), torch.float32, 0.0, 1.0, empty=1.0),
    "hcnt": Field((), torch.int32, 0, L),
}
CHECKPOINT_FIELDS = ("codes", "s_k", "s_v", "u", "q")
#: the window tensors of each gate (dense [NS, H, ...]), and those a flush resets (the keys and values stay; the fill
#: count stays L)
WINDOW_FIELDS = {"kda": ("kbuf", "ubuf", "w", "pcum", "gbuf", "hcnt"), "gdn": ("kbuf", "ubuf", "w", "p", "hcnt")}
RESET_FIELDS = {"kda": ("w", "pcum", "gbuf"), "gdn": ("w", "p")}


def field_bytes(name: str) -> int:
    """Bytes of one (sequence, head)'s ``name``."""
    f = FIELDS[name]
    return math.prod(f.shape) * f.dtype.itemsize


# bytes per (sequence, head), for the README, the demo and the memory bound (the checkpoint's: CHECKPOINT_BYTES)
WINDOW_HEAD_BYTES_KDA = sum(map(field_bytes, WINDOW_FIELDS["kda"]))
WINDOW_HEAD_BYTES_GDN = sum(map(field_bytes, WINDOW_FIELDS["gdn"]))
FP32_STATE_BYTES = 4 * V * K
BF16_STATE_BYTES = 2 * V * K


def due_program_bytes(gate: str = "kda") -> int:
    """Fewest bytes one due program moves: checkpoint read and written, window and gate read, window reset."""
    window = sum(map(field_bytes, WINDOW_FIELDS[gate]))
    reset = sum(map(field_bytes, RESET_FIELDS[gate]))
    return CHECKPOINT_BYTES + window + CHECKPOINT_BYTES + reset


#: the window's per-entry rows (kbuf, ubuf, KDA's gbuf): a step reads only those its fill count needs
ENTRY_FIELDS = {"kda": ("kbuf", "ubuf", "gbuf"), "gdn": ("kbuf", "ubuf")}


def step_program_bytes(gate: str = "kda", fill: int | None = None) -> int:
    """Bytes one decode step program moves: the checkpoint, the window and this token (q, k, v, a, b in bf16) read;
    the output, the appended entry, its weight (GDN: the live weights it decays), the gate state and the fill count
    written. ``fill=None``: the whole window read and every weight written (SPEC section 7's memory bound, 34,894 B
    KDA). ``fill=h`` (``0 <= h < L``): only what a step at fill ``h`` needs, as the Triton step kernels read it: the
    keys and ubuf rows of entries ``0 .. h - 1``, KDA's decay factors of entries ``1 .. h - 1`` (entry j's decay is
    the product of the later entries' factors), the 16 weights (64 B: the Gluon kernel reads them whole), the gate
    state and the fill count; GDN writes the weights of entries ``0 .. h``."""
    token = 2 * (2 * K + V) + (2 * K if gate == "kda" else 2) + 2
    read = CHECKPOINT_BYTES + sum(map(field_bytes, WINDOW_FIELDS[gate])) + token
    if fill is not None:
        if not 0 <= fill < L:
            raise ValueError(f"fill: a step's fill count is in [0, {L}), got {fill}")
        read -= sum((L - (max(fill - 1, 0) if n == "gbuf" else fill)) * (field_bytes(n) // L)
                    for n in ENTRY_FIELDS[gate])
    entry = sum(field_bytes(n) // L for n in ENTRY_FIELDS[gate])
    if gate == "kda":
        weights = 4                                 # w[h] = 1
    else:                                           # the live weights decayed, and w[h]
        weights = field_bytes("w") if fill is None else 4 * (fill + 1)
    gate_state = field_bytes("pcum" if gate == "kda" else "p")
    written = 2 * V + entry + weights + gate_state + field_bytes("hcnt")
    return read + written


def check_and_convert(items: Sequence[tuple[str, object, Field, tuple[tuple[str, int], ...]]],
          device: torch.device, keep_apart: Sequence[torch.Tensor] = ()) -> list[torch.Tensor]:
    """Check and convert arguments before anything is written; raise ``ValueError`` naming the first bad one.

    ``items`` are ``(name, value, field, lead)`` with ``lead`` the leading dims as ``(symbol, size)`` pairs. Every
    value's type, dtype and shape are checked first, then all are converted to ``field.dtype`` on ``device`` (a copy
    where they differ, and where a value shares memory with one of ``keep_apart``: what the caller then writes, such
    as a pool's own slots passed to one of its writers) and their values checked with one host synchronisation for all
    of them. Returns the converted tensors, in order."""
    for name, t, f, lead in items:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.is_meta:
            raise ValueError(f"{name}: expected a tensor with data, got one on the meta device")
        if f.dtype.is_floating_point:
            if not t.is_floating_point():
                raise ValueError(f"{name}: expected a floating-point tensor (stored as {f.dtype}), got dtype {t.dtype}")
        elif t.dtype != f.dtype:
            raise ValueError(f"{name}: expected dtype {f.dtype}, got {t.dtype}")
        shape = tuple(size for _, size in lead) + f.shape
        if tuple(t.shape) != shape:
            dims = ", ".join([sym for sym, _ in lead] + list(f.dims))
            raise ValueError(f"{name}: expected shape ({dims}) = {shape}, got {tuple(t.shape)}")
    staged = [t.detach().to(device, f.dtype) for _, t, f, _ in items]
    spans = {str(i): byte_span(b) for i, b in enumerate(keep_apart) if b.device == device}
    staged = [s.clone() if spans and s.device == device and first_overlap(s, spans) is not None else s
              for s in staged]
    if not staged:
        return staged
    flags = torch.stack([f.bad_mask(s).any() for s, (_, _, f, _) in zip(staged, items)]).tolist()
    for s, (name, _, f, _), bad in zip(staged, items, flags):
        if bad:
            where = [tuple(i) for i in torch.nonzero(f.bad_mask(s))[:3].tolist()]
            vals = [s[i].item() for i in where]             # the first few offenders, with their indices
            raise ValueError(f"{name}: values must be {f.domain()}"
                             f"{f' (after conversion to {f.dtype})' if f.dtype.is_floating_point else ''}; "
                             f"got {', '.join(f'{v!r} at {i}' for v, i in zip(vals, where))}")
    return staged


def checked_start_matrix(q0: object, device: torch.device) -> torch.Tensor:
    """q0 [V, R] as a host path takes it (the functional forms, the deployment calls' value checks): converted to fp32
    on ``device``, its values finite (:func:`check_and_convert`) and a start matrix (:func:`check_start_matrix`)."""
    (q0,) = check_and_convert([("q0", q0, Field(("V", "R"), torch.float32), ())], device)
    check_start_matrix(q0)
    return q0


def check_start_matrix(q0: torch.Tensor) -> None:
    """q0's values (fp32 [V, R], finite, already checked and converted) where a host path reads them: column norms in
    :data:`Q0_NORM_RANGE` and independent columns (:data:`Q0_MIN_EIGEN_RATIO`); raises ``ValueError`` naming q0.
    One host synchronisation."""
    gram = (q0.t().double() @ q0.double()).cpu()
    norms = gram.diagonal().sqrt().tolist()
    lo, hi = Q0_NORM_RANGE
    if not all(lo <= n <= hi for n in norms):
        raise ValueError(f"q0: its columns' norms must lie in [{lo:g}, {hi:g}] (the subspace iteration's start, as "
                         f"leapquant.default_q0: unit columns), got {', '.join(f'{n:.3g}' for n in norms)}")
    eig = torch.linalg.eigvalsh(gram)
    if float(eig[0]) < Q0_MIN_EIGEN_RATIO * float(eig[-1]):
        values = ", ".join(f"{e:.3g}" for e in eig.tolist())
        raise ValueError(f"q0: its columns must be independent (the subspace iteration starts from R = {R} "
                         f"directions); its Gram matrix's eigenvalues are {values}")


def as_int(x: object) -> int | None:
    """``x`` as an int where it is a whole number of the host: a Python int or a numpy integer scalar (an engine's
    slot table); None for bools, floats, tensors (reading one may synchronise with a device) and anything else."""
    if isinstance(x, (bool, torch.Tensor)) or type(x).__name__ == "bool_":
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


def _slot_number(x: object, position: int, name: str = "slots") -> int:
    """One element of a slot list as an int (:func:`as_int`; a 0-dim integer tensor too: the helpers read values on
    the host anyway); bools, floats and anything else raise a ``ValueError`` naming the argument (``name``)."""
    scalar = isinstance(x, torch.Tensor) and x.dim() == 0 and not (x.is_floating_point() or x.is_complex())
    n = as_int(x.item() if scalar else x)
    if n is None:
        raise ValueError(f"{name}: expected integer slot numbers, got {x!r} at position {position}")
    return n


def capturing(device: torch.device) -> bool:
    """A CUDA graph is being captured on the current stream (and ``device`` is a GPU)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def same_objects(a: tuple | None, b: tuple) -> bool:
    """``a`` and ``b`` hold the same objects, in order (``a`` None: nothing held yet)."""
    return a is not None and len(a) == len(b) and all(x is y for x, y in zip(a, b))


def buffer_addresses(buffers: tuple) -> tuple:
    """Where each buffer's data starts and how it is laid out: a buffer object can be kept while its memory or its
    view is swapped (``t.data = ...``, ``t.set_(...)``, ``t.as_strided_(...)``), which a check of the objects alone
    would miss (None for an entry that is not a tensor)."""
    return tuple((t.data_ptr(), t.dtype, t.shape, t.stride()) if isinstance(t, torch.Tensor) else None
                 for t in buffers)


def on_pool_device(pool: "Pool") -> contextlib.AbstractContextManager:
    """The pool's GPU as the current device for a launch (Triton and TileLang launch on the current device, on its
    current stream): a pool on another GPU than the current one (an engine's ``cuda:1`` from a thread on ``cuda:0``)
    is served on its own; nothing to switch on a CPU or when it is current already."""
    if pool.device.type != "cuda" or pool.device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    if torch.cuda.is_current_stream_capturing():    # the switch would launch on a stream outside the capture
        raise ValueError(f"pool: on {pool.device}, but a CUDA graph is being captured on "
                         f"cuda:{torch.cuda.current_device()}; capture on the pool's device")
    return torch.cuda.device(pool.device)


class Pool:
    """Caller-owned slot pool: the checkpoints in one flat fp32 buffer, the windows in dense tensors.

    ``Pool(num_slots, num_heads=32, device=None, gate="kda")`` allocates everything in the state :meth:`reset_slots`
    gives a new sequence (checkpoints of a zero state: codes and tokens 0, scales :data:`EPS`; windows empty: ``w =
    0``, ``pcum = 0``, ``gbuf = 1``, ``p = 1``, ``hcnt = 0``; ``device=None``: the first given buffer's, raw's where
    given, else the CPU). An engine that owns its buffers passes them by keyword (``raw=``, ``kbuf=``, ...); they are
    checked against the geometry and used as they are (no copy, no initialisation: buffers of zeros are not empty
    windows, whose ``gbuf`` and ``p`` are 1, so :meth:`reset_slots` starts each slot's first sequence); each may be a
    view into a larger buffer (several layers' states in one allocation) and starts on a 16-byte boundary (all but
    :data:`LOOSE_ALIGNMENT`'s), and no two may share memory. Pools carved from one allocation (one per layer) must not
    overlap one another either: a pool checks its own buffers, not another pool's.

    The bulk helpers (:meth:`write_checkpoint`, :meth:`read_checkpoint`, :meth:`write_window`, :meth:`read_window`,
    :meth:`encode`, :meth:`decode`) and the life-cycle helpers (:meth:`reset_slots`: a new sequence;
    :meth:`copy_slots`: a fork) check every argument against :data:`FIELDS` before writing anything: a bad one raises
    a ``ValueError`` naming it and leaves the pool byte-identical.

    Attributes (NS = num_slots, H = num_heads):
        raw    fp32 [NS * (H + 1) * V * K + OFF]
        codes  int8 [NS, H, V, K]      view of raw
        s_k    fp32 [NS, H, K]         view of raw
        s_v    fp32 [NS, H, V]         view of raw
        tokens fp16 [NS, H, R, K + V]  view of raw; ``u = tokens[..., :K]``, ``q = tokens[..., K:]``
        kbuf   bf16 [NS, H, L, K]
        ubuf   bf16 [NS, H, L, V]
        w      fp32 [NS, H, L]
        pcum   fp32 [NS, H, K]         (KDA only)
        gbuf   fp16 [NS, H, L, K]      (KDA only)
        p      fp32 [NS, H]            (GDN only)
        hcnt   int32 [NS, H]
    """

    WINDOW_FIELDS = WINDOW_FIELDS

    def __init__(self, num_slots: int, num_heads: int = DEFAULT_HEADS, device: torch.device | str | None = None,
                 gate: str = "kda", **buffers: torch.Tensor) -> None:
        if not isinstance(gate, str) or name_word(gate) not in GATES:    # any case, as backend names
            raise ValueError(f"gate: expected one of {GATES}, got {gate!r}")
        gate = name_word(gate)
        ns, nh = as_int(num_slots), as_int(num_heads)
        if ns is None or ns < 2:
            raise ValueError(f"num_slots: expected an int >= 2 (slot 0 is reserved), got {num_slots!r}")
        if nh is None or nh < 1:
            raise ValueError(f"num_heads: expected an int >= 1, got {num_heads!r}")
        num_slots, num_heads = ns, nh
        if 4 * raw_words(num_slots, num_heads) >= 2 ** 62:
            raise ValueError(f"num_slots x num_heads: {num_slots} x {num_heads} programs need "
                             f"{4 * raw_words(num_slots, num_heads):.3g} bytes of checkpoints, more than any device "
                             f"holds")
        unknown = set(buffers) - {"raw", *self.WINDOW_FIELDS[gate]}
        if unknown:
            raise ValueError(f"unknown buffers for gate {gate!r}: {sorted(unknown)}")
        if device is None:                      # the first given buffer's (raw's where given), else the CPU
            device = next((t.device for n in ("raw", *self.WINDOW_FIELDS[gate])
                           if isinstance(t := buffers.get(n), torch.Tensor)), "cpu")
        self.device = device_here(device, "the pool's tensors")
        self.num_slots, self.num_heads, self.gate = num_slots, num_heads, gate
        NS, H = num_slots, num_heads
        self.slot_stride = slot_stride(H)

        # shapes, dtypes and empty values: FIELDS; every buffer the engine gives is checked before any is allocated
        want = {"raw": ((raw_words(NS, H),), torch.float32, 0.0)}
        want.update({n: ((NS, H) + FIELDS[n].shape, FIELDS[n].dtype, FIELDS[n].empty)
                     for n in self.WINDOW_FIELDS[gate]})
        given = {n: buffers[n] for n in want if buffers.get(n) is not None}
        for name, t in given.items():
            check_dense(name, t, want[name][0], want[name][1], self.device, aligned=name not in LOOSE_ALIGNMENT)
        check_disjoint(given)
        for name, (shape, dtype, fill) in want.items():
            setattr(self, name, given[name] if name in given else torch.full(shape, fill, dtype=dtype,
                                                                               device=self.device))
        self._make_views()
        if "raw" not in given:
            # every checkpoint as reset_slots leaves it: raw's zeros already are each field's empty value but the
            # scales' (EPS: a zero scale is outside the format)
            for name in CHECKPOINT_FIELDS:
                if FIELDS[name].empty != 0.0:
                    getattr(self, name).fill_(FIELDS[name].empty)

    # ---- views of raw ----------------------------------------------------------------------------------------------
    def _make_views(self) -> None:
        NS, H, SS, raw = self.num_slots, self.num_heads, self.slot_stride, self.raw
        self.codes = _view(raw, torch.int8, (NS, H, V, K), (4 * SS, 4 * REGION_WORDS, K, 1), 4 * OFF + CODES_BYTE)
        self.s_k = _view(raw, torch.float32, (NS, H, K), (SS, REGION_WORDS, 1), OFF + SK_WORD)
        self.s_v = _view(raw, torch.float32, (NS, H, V), (SS, REGION_WORDS, 1), OFF + SV_WORD)
        self.tokens = _view(raw, torch.float16, (NS, H, R, K + V), (2 * SS, 2 * REGION_WORDS, K + V, 1),
                            2 * OFF + TOK_HALF)
        self.checkpoint_words = _view(raw, torch.float32, (NS, H, CHECKPOINT_WORDS), (SS, REGION_WORDS, 1), OFF)

    @property
    def u(self) -> torch.Tensor:
        """fp16 [NS, H, R, K] view: the key-side Compensator Tokens."""
        return self.tokens[..., :K]

    @property
    def q(self) -> torch.Tensor:
        """fp16 [NS, H, R, V] view: the value-side Compensator Tokens."""
        return self.tokens[..., K:]

    def loose_alignment(self) -> tuple[int, ...]:
        """The start addresses modulo :data:`ALIGN_BYTES` of this pool's :data:`LOOSE_ALIGNMENT` buffers (every other
        buffer of a pool is aligned; a backend's capability check may read it)."""
        return tuple(getattr(self, n).data_ptr() % ALIGN_BYTES for n in LOOSE_ALIGNMENT
                     if n in WINDOW_FIELDS[self.gate])

    def check_buffers(self) -> None:
        """Raise a ``ValueError`` naming the first of the pool's buffers that no longer fits its geometry (an engine
        may have replaced one after the pool was made): ``raw`` and every window tensor dense, of its dtype and shape,
        on the pool's device and aligned (:data:`LOOSE_ALIGNMENT` aside); the checkpoint views still views of this
        ``raw``; no two buffers sharing memory. Reads metadata only. Every bulk helper runs it first; the deployment
        calls run it through :func:`leapquant.validate.check_pool`, once per set of buffers."""
        if self.gate not in GATES:
            raise ValueError(f"pool.gate: expected one of {GATES}, got {self.gate!r}")
        NS, H, dev = self.num_slots, self.num_heads, self.device
        if self.slot_stride != slot_stride(H):
            raise ValueError(f"pool.slot_stride: {self.slot_stride} does not match num_heads = {H}")
        check_dense("pool.raw", self.raw, (raw_words(NS, H),), torch.float32, dev, aligned=True)
        for name in self.WINDOW_FIELDS[self.gate]:
            f = FIELDS[name]
            check_dense(f"pool.{name}", getattr(self, name, None), (NS, H) + f.shape, f.dtype, dev,
                        aligned=name not in LOOSE_ALIGNMENT)
        if self.codes.data_ptr() != self.raw.data_ptr() + 4 * OFF + CODES_BYTE:
            raise ValueError("pool.raw: was replaced after the views were made; build a new Pool around it")
        check_disjoint({n: getattr(self, n) for n in ("raw", *self.WINDOW_FIELDS[self.gate])}, prefix="pool.")

    def window_tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.WINDOW_FIELDS[self.gate]}

    def __repr__(self) -> str:
        return (f"Pool(num_slots={self.num_slots}, num_heads={self.num_heads}, gate={self.gate!r}, "
                f"device={self.device})")

    # ---- bulk helpers ----------------------------------------------------------------------------------------------
    # Each helper checks every argument (slots, then each tensor's type, dtype and shape, then its values) before it
    # writes anything, so a bad call raises a ValueError naming the argument and leaves the pool byte-identical. The
    # per-head shapes, storage dtypes and value ranges come from FIELDS. Tensors may live on any device and in any
    # floating dtype where the pool stores floats: they are copied to the pool's device and dtype. These helpers read
    # values on the host (they synchronise): they are for loading and inspecting a pool, not for a captured graph.
    # Each first checks the pool's own buffers (check_buffers, through _slots), as the deployment calls do.

    def _slots(self, slots: object, distinct: bool = True, name: str = "slots") -> torch.Tensor:
        """``slots`` as a long tensor [n] on the pool's device. Accepts a list, tuple or range of ints, or a 1-D
        integer tensor on any device or numpy array; every slot must lie in [1, num_slots) (slot 0 is reserved). With
        ``distinct`` (every write) each slot must appear once: each sequence owns one slot, and two rows written
        to one slot would leave whichever the indexing happened to store last. Reads may repeat a slot (one row
        per program, say); they get one copy per mention. An empty selection is allowed (n = 0). Errors name the
        argument ``name``. The pool's buffers are checked first (:meth:`check_buffers`)."""
        self.check_buffers()
        if not isinstance(slots, (torch.Tensor, list, tuple, range)) and hasattr(slots, "__array__"):
            try:                                        # a numpy array of slot numbers (an engine's slot table)
                slots = torch.tensor(slots, device="cpu")  # (a copy: a read-only array is fine)
            except (TypeError, ValueError, RuntimeError) as e:
                raise ValueError(f"{name}: expected integer slot numbers, got an array that torch cannot read "
                                 f"({type(e).__name__}: {e})") from None
        if isinstance(slots, torch.Tensor):
            if slots.dtype == torch.bool or slots.is_floating_point() or slots.is_complex():
                raise ValueError(f"{name}: expected integer slot numbers, got a tensor of dtype {slots.dtype}")
            if slots.dim() != 1:
                raise ValueError(f"{name}: expected a 1-D tensor [n], got shape {tuple(slots.shape)}")
            if slots.device.type == "meta":
                raise ValueError(f"{name}: a tensor on the meta device holds no slot numbers")
            vals = slots.detach().to("cpu", torch.long).tolist()
        elif isinstance(slots, (list, tuple, range)):
            vals = [_slot_number(x, i, name) for i, x in enumerate(slots)]
        else:
            raise ValueError(f"{name}: expected a list, tuple or range of ints or a 1-D integer tensor, "
                             f"got {type(slots).__name__}")
        outside = [x for x in vals if not 1 <= x < self.num_slots]
        if outside:
            raise ValueError(f"{name}: expected values in [1, {self.num_slots}) (slot 0 is reserved), "
                             f"got {outside[:8]}{' ...' if len(outside) > 8 else ''}")
        seen: set[int] = set()
        for x in vals if distinct else ():
            if x in seen:
                raise ValueError(f"{name}: slot {x} appears more than once (each sequence owns one slot)")
            seen.add(x)
        # (made on the pool's device: not on a default device the caller may have set, `with torch.device(...)`)
        return torch.tensor(vals, dtype=torch.long, device=self.device)

    def _lead(self, s: torch.Tensor) -> tuple[tuple[str, int], ...]:
        """Leading dims of a per-slot argument: (n, H)."""
        return (("n", s.numel()), ("H", self.num_heads))

    def _stage_checkpoint(self, s: torch.Tensor, codes: object, s_k: object, s_v: object, u: object, q: object,
                          keep_apart: Sequence[torch.Tensor] = ()) -> list[torch.Tensor]:
        lead = self._lead(s)
        given = dict(codes=codes, s_k=s_k, s_v=s_v, u=u, q=q)
        return check_and_convert([(n, given[n], FIELDS[n], lead) for n in CHECKPOINT_FIELDS], self.device,
                                 keep_apart)

    def _buffers(self) -> list[torch.Tensor]:
        """raw and the window tensors: what a writer's arguments are kept apart from (a caller may pass views of the
        pool's own slots, moving them, which the writes would overwrite while they are read)."""
        return [self.raw, *self.window_tensors().values()]

    def _put_checkpoint(self, s: torch.Tensor, codes: torch.Tensor, s_k: torch.Tensor, s_v: torch.Tensor,
                        u: torch.Tensor, q: torch.Tensor) -> None:
        """Write already staged checkpoints (pool dtypes, pool device)."""
        self.codes[s] = codes
        self.s_k[s] = s_k
        self.s_v[s] = s_v
        self.tokens[s] = torch.cat([u, q], dim=-1)

    @pool_writes()
    def write_checkpoint(self, slots, codes: torch.Tensor, s_k: torch.Tensor, s_v: torch.Tensor,
                         u: torch.Tensor, q: torch.Tensor) -> None:
        """Store checkpoints into ``slots`` (n slots, see :meth:`_slots`). codes int8 [n, H, V, K] in [-127, 127];
        s_k [n, H, K] and s_v [n, H, V] finite and > 0 (stored fp32); u [n, H, R, K] and q [n, H, R, V] finite
        after rounding to fp16. Any floating dtype and any device are accepted for the floating arguments."""
        s = self._slots(slots)
        self._put_checkpoint(s, *self._stage_checkpoint(s, codes, s_k, s_v, u, q, self._buffers()))

    def read_checkpoint(self, slots) -> tuple[torch.Tensor, ...]:
        """Fresh copies ``(codes, s_k, s_v, u, q)`` of the checkpoints in ``slots``, shapes as in
        :meth:`write_checkpoint`, on the pool's device. A slot may be named more than once."""
        return self._read(self._slots(slots, distinct=False))

    def _read(self, s: torch.Tensor) -> tuple[torch.Tensor, ...]:
        tok = self.tokens[s]
        return self.codes[s], self.s_k[s], self.s_v[s], tok[..., :K].contiguous(), tok[..., K:].contiguous()

    def read_window(self, slots) -> tuple[torch.Tensor | None, ...]:
        """Fresh copies ``(kbuf, ubuf, w, gate, gbuf, fill)`` of the windows in ``slots``, shapes as in
        :meth:`write_window` (``gbuf`` None for GDN; ``fill`` the fill counts, int32 [n, H]), on the pool's device:
        with :meth:`read_checkpoint`, everything a sequence's slot holds, which :meth:`write_checkpoint` and
        :meth:`write_window` put back (an offload and its restore). A slot may be named more than once."""
        s = self._slots(slots, distinct=False)
        gate = self.pcum[s] if self.gate == "kda" else self.p[s]
        gbuf = self.gbuf[s] if self.gate == "kda" else None
        return self.kbuf[s], self.ubuf[s], self.w[s], gate, gbuf, self.hcnt[s]

    @pool_writes()
    def write_window(self, slots, kbuf: torch.Tensor, ubuf: torch.Tensor, w: torch.Tensor,
                     gate: torch.Tensor, gbuf: torch.Tensor | None = None, fill: int | torch.Tensor = L) -> None:
        """Store windows into ``slots`` (n slots): kbuf [n, H, L, K], ubuf [n, H, L, V] (finite), w [n, H, L] in
        [0, 1]; KDA: ``gate`` is pcum [n, H, K] (<= 0, finite or -inf) and ``gbuf`` [n, H, L, K] in [0, 1] is required;
        GDN: ``gate`` is p [n, H] in [0, 1] and ``gbuf`` must be None. Shapes must match exactly (nothing is
        broadcast); any floating dtype and any device are accepted and converted. ``hcnt`` of the slots is set to
        ``fill``: an int in [0, L] for every program (``L``: due at the next flush, or "flushed, empty" for the decode
        step), or int32 [n, H] in [0, L], a count per program (as :meth:`read_window` returns them).

        Restoring a sequence in the middle of a window (an offload, a snapshot) takes its fill counts as ``fill``: with
        the default ``L`` and a window that is not empty, the slot is due, and a decode step before the flush (as
        :func:`leapquant.decode_inplace` runs them) reads it as empty and drops the window without an error
        (``check_idx=True`` names it)."""
        s = self._slots(slots)
        lead = self._lead(s)
        if self.gate == "kda":
            if gbuf is None:
                raise ValueError("gbuf: required for a KDA pool (decay factors [n, H, L, K]), got None")
            gate_name, extra = "gate (pcum)", [("gbuf", gbuf, FIELDS["gbuf"], lead)]
        else:
            if gbuf is not None:
                raise ValueError(f"gbuf: a GDN pool has none (its gate p is passed as `gate`); expected None, "
                                 f"got {type(gbuf).__name__}")
            gate_name, extra = "gate (p)", []
        hc = FIELDS["hcnt"]
        if isinstance(fill, torch.Tensor):                 # a count per program, checked with the other arguments
            extra.append(("fill", fill, hc, lead))
            n_fill = None
        else:
            n_fill = as_int(fill)
            if n_fill is None or not hc.lo <= n_fill <= hc.hi:
                raise ValueError(f"fill: expected an int in [{hc.lo}, {hc.hi}] (the window's fill count; {L} = due) "
                                 f"or an int32 tensor of one per program, got {fill!r}")
        gate_field = FIELDS["pcum" if self.gate == "kda" else "p"]
        staged = check_and_convert([("kbuf", kbuf, FIELDS["kbuf"], lead), ("ubuf", ubuf, FIELDS["ubuf"], lead),
                        ("w", w, FIELDS["w"], lead), (gate_name, gate, gate_field, lead), *extra], self.device,
                        self._buffers())
        self.kbuf[s], self.ubuf[s], self.w[s] = staged[:3]
        if self.gate == "kda":
            self.pcum[s], self.gbuf[s] = staged[3:5]
        else:
            self.p[s] = staged[3]
        self.hcnt[s] = staged[-1] if n_fill is None else n_fill

    @pool_writes()
    def encode(self, slots, states: torch.Tensor, q0: torch.Tensor | None = None) -> None:
        """Compress dense states [n, H, V, K] (finite; any floating dtype, computed in fp32) into the checkpoints of
        ``slots`` (how a prefill state enters the pool) from the start matrix q0 [V, R] (finite, independent columns
        of norm in :data:`Q0_NORM_RANGE`; default :func:`leapquant.reference.default_q0`); their windows are left as
        they are (a new sequence's slot: :meth:`reset_slots`, then encode)."""
        s = self._slots(slots)
        q0 = default_q0(self.device) if q0 is None else q0
        S, q0 = check_and_convert([("states", states, Field(("V", "K"), torch.float32), self._lead(s)),
                       ("q0", q0, Field(("V", "R"), torch.float32), ())], self.device)
        check_start_matrix(q0)
        # compress's output goes through the same checks as a caller's checkpoint before anything is written; a state
        # too large for the format (finite, but its scales overflow fp32) fails there, and the error says so
        try:
            staged = self._stage_checkpoint(s, *compress(S, q0))
        except ValueError as e:
            raise ValueError(f"states: their compression does not fit the format ({e}); |states| is at most "
                             f"{float(S.abs().max()):.3g} (the format is for |S| < 1e4)") from None
        self._put_checkpoint(s, *staged)

    # ---- life cycle: a new sequence, a fork ------------------------------------------------------------------------
    @pool_writes()
    def reset_slots(self, slots: Sequence[int] | torch.Tensor) -> None:
        """Start new sequences in ``slots`` (n distinct slots in [1, num_slots)): a zero state and an empty window.

        The checkpoint becomes what a flush writes for an all-zero state (``compress(0)``): codes 0, tokens 0 and both
        scales :data:`EPS`, the scales' floor (positive, as the format requires; any positive scale decodes code 0 to
        exactly 0, and the floor is what the re-compression itself gives a zero residual). The window is emptied:
        keys and values 0 (so the slot's bytes do not depend on what it held before), ``w = 0``, KDA ``pcum = 0`` and
        ``gbuf = 1``, GDN ``p = 1``, ``hcnt = 0``. The bytes of the region past the checkpoint are not touched.
        Checks the slots before writing anything; synchronises with the host (a set-up tool, as the bulk helpers)."""
        s = self._slots(slots)
        for name in CHECKPOINT_FIELDS + self.WINDOW_FIELDS[self.gate]:
            getattr(self, name)[s] = FIELDS[name].empty

    @pool_writes()
    def copy_slots(self, src: Sequence[int] | torch.Tensor, dst: Sequence[int] | torch.Tensor) -> None:
        """Copy the sequences in ``src`` into ``dst`` (a fork, or a prefix-cache hit): checkpoint, window and fill
        count of every head, byte for byte (the checkpoint's 19,456 bytes per head; the rest of the region is not
        touched).

        ``src`` and ``dst`` are slot lists of one length n (see :meth:`_slots`): ``src`` may repeat a slot (one sequence
        forked into several), ``dst`` may not. Everything is read before anything is written, so a slot may be both a
        source and a destination: every destination gets its source as it was before the call. Checks both lists
        before writing anything; synchronises with the host."""
        s = self._slots(src, distinct=False, name="src")
        d = self._slots(dst, name="dst")
        if s.numel() != d.numel():
            raise ValueError(f"dst: expected as many slots as src ({s.numel()}), got {d.numel()}")
        # bitwise copies: through integer views, so that no value (a NaN's payload included) passes a float unit
        bufs = [self.checkpoint_words] + list(self.window_tensors().values())
        ints = [t.view(_SAME_SIZE_INT[t.dtype]) for t in bufs]
        taken = [t[s] for t in ints]                      # advanced indexing copies: all read before any write
        for t, v in zip(ints, taken):
            t[d] = v

    def decode(self, slots, with_window: bool = True) -> torch.Tensor:
        """Dense fp32 states [n, H, V, K] of ``slots``: the checkpoint, and (``with_window``, a bool) the window
        folded in as a flush would (whatever ``hcnt`` says). A slot may be named more than once."""
        s = self._slots(slots, distinct=False)
        if not isinstance(with_window, bool):
            raise ValueError(f"with_window: expected a bool, got {with_window!r}")
        ck = self._read(s)
        if not with_window:
            return decode_checkpoint(*ck)
        if self.gate == "kda":
            return rebuild(*ck, self.kbuf[s], self.ubuf[s], self.w[s], pcum=self.pcum[s], gbuf=self.gbuf[s])
        return rebuild(*ck, self.kbuf[s], self.ubuf[s], self.w[s], p=self.p[s])


#: the integer dtype of each buffer dtype's size (bitwise copies)
_SAME_SIZE_INT = {torch.float32: torch.int32, torch.int32: torch.int32, torch.bfloat16: torch.int16,
                  torch.float16: torch.int16, torch.int8: torch.int8}


def check_tensor(name: str, t: object, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | None, *,
                 dims: str | None = None, whose: str | None = None) -> torch.Tensor:
    """Raise ``ValueError`` naming ``name`` unless ``t`` is a tensor of this dtype, shape and device (``None``: any);
    ``dims`` names the shape's dimensions and ``whose`` the device's source in the messages. Returns ``t``."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        want = f"({dims}) = {tuple(shape)}" if dims else f"{tuple(shape)}"
        raise ValueError(f"{name}: expected shape {want}, got {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}{f' ({whose})' if whose else ''}, got {t.device}")
    return t


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) byte addresses that ``t``'s elements occupy (an empty tensor: an empty span)."""
    n = t.numel()
    if n == 0:
        return 0, 0
    start = t.data_ptr()
    if t.is_contiguous():
        return start, start + n * t.element_size()
    last = sum((size - 1) * st for size, st in zip(t.shape, t.stride()) if size > 1)
    return start, start + (last + 1) * t.element_size()


def first_overlap(x: torch.Tensor, others: dict[str, tuple[int, int]]) -> str | None:
    """The name of the first span in ``others`` that intersects ``x``'s bytes (all on one device: a device's
    allocations never share addresses, so intersecting spans are shared memory; two interleaved views whose spans
    intersect count as overlapping), or None."""
    a0, a1 = byte_span(x)
    for name, (b0, b1) in others.items():
        if a0 < b1 and b0 < a1:
            return name
    return None


def check_disjoint(buffers: dict[str, torch.Tensor], prefix: str = "") -> None:
    """Raise ``ValueError`` naming two of ``buffers`` (a pool's raw and window tensors, by name) whose bytes intersect:
    an engine's buffers must not share memory (a kbuf that is also the ubuf would take the step's u_new over its kn)."""
    spans: dict[str, tuple[int, int]] = {}
    for name, t in buffers.items():
        shared = first_overlap(t, spans)
        if shared is not None:
            (b0, b1), (a0, a1) = byte_span(t), spans[shared]
            raise ValueError(f"{prefix}{name}: shares memory with {prefix}{shared} (bytes {b0:#x}-{b1:#x} and "
                             f"{a0:#x}-{a1:#x}; every buffer of a pool needs its own)")
        spans[name] = byte_span(t)


def check_dense(name: str, t: object, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                aligned: bool = False) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``t`` is a dense (contiguous) tensor of this shape, dtype, device
    (and, where ``aligned``, starting on an :data:`ALIGN_BYTES` boundary: a pool's own buffers, which the GPU kernels
    copy in 16-byte pieces)."""
    t = check_tensor(name, t, shape, dtype, device)
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {tuple(t.stride())}")
    if aligned and t.data_ptr() % ALIGN_BYTES:
        raise ValueError(f"{name}: expected a start on a {ALIGN_BYTES}-byte boundary (the GPU kernels copy it in "
                         f"{ALIGN_BYTES}-byte pieces; an engine's buffer may be a view into a larger one at such an "
                         f"offset), got address {t.data_ptr():#x}")
