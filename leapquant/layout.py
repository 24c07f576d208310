"""The pool ABI, defined once: constants, byte layout of a checkpoint, and :class:`Pool`.

Every other module (reference, kernels, tests, benchmark) imports its offsets and shapes from here.

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

from typing import Iterable, Sequence

import torch

# ---- the math's sizes (SPEC section 2) -----------------------------------------------------------------------------
V = 128          #: value dimension (rows of the state)
K = 128          #: key dimension (columns of the state)
L = 16           #: window length: updates buffered between two flushes
R = 4            #: rank of the fp16 part (number of Compensator Tokens)
QMAX = 127       #: largest code magnitude; codes live in [-QMAX, QMAX]
EPS = 1e-12      #: floor of both smoothing scales (an all-zero column or row keeps finite scales)
FP16_MAX = 65504.0  #: largest finite fp16: the reference clamps the tokens to it (|S| < 1e4 can give |U| ~ 1e5)

DEFAULT_HEADS = 32
GATES = ("kda", "gdn")

# ---- the pool's geometry, in fp32 words unless said otherwise --------------------------------------------------------
OFF = 12288                      #: word offset of slot 0 inside ``raw`` (engines keep a header there)
REGION_WORDS = V * K             #: one (slot, head) region: 64 KB
CODES_BYTE = 0                   #: byte offset of the int8 codes inside a region
SK_BYTE = V * K                  #: byte offset of s_k (16384)
SV_BYTE = SK_BYTE + 4 * K        #: byte offset of s_v (16896)
TOK_BYTE = SV_BYTE + 4 * V       #: byte offset of the fp16 tokens (17408)
CHECKPOINT_BYTES = TOK_BYTE + 2 * R * (K + V)  #: 19456
CHECKPOINT_WORDS = CHECKPOINT_BYTES // 4

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


# bytes per (sequence, head), for the README and the demo
CHECKPOINT_HEAD_BYTES = CHECKPOINT_BYTES
WINDOW_HEAD_BYTES_KDA = 2 * L * K + 2 * L * V + 4 * L + 4 * K + 2 * L * K + 4  # kbuf, ubuf, w, pcum, gbuf, hcnt
WINDOW_HEAD_BYTES_GDN = 2 * L * K + 2 * L * V + 4 * L + 4 + 4                  # kbuf, ubuf, w, p, hcnt
FP32_STATE_BYTES = 4 * V * K
BF16_STATE_BYTES = 2 * V * K


def due_program_bytes(gate: str = "kda") -> int:
    """Fewest bytes one due program moves: checkpoint read and written, window and gate read, window reset."""
    if gate == "kda":
        read = CHECKPOINT_BYTES + 2 * L * K + 2 * L * V + 4 * L + 4 * K + 2 * L * K + 4
        reset = 4 * L + 4 * K + 2 * L * K
    else:
        read = CHECKPOINT_BYTES + 2 * L * K + 2 * L * V + 4 * L + 4 + 4
        reset = 4 * L + 4
    return read + CHECKPOINT_BYTES + reset


def _view(raw: torch.Tensor, dtype: torch.dtype, shape: Sequence[int], strides: Sequence[int], offset: int) -> torch.Tensor:
    """A strided view of ``raw``'s storage as ``dtype`` (offset and strides in elements of ``dtype``)."""
    out = torch.empty(0, dtype=dtype, device=raw.device)
    out.set_(raw.untyped_storage(), offset, tuple(shape), tuple(strides))
    return out


class Pool:
    """Caller-owned slot pool: the checkpoints in one flat fp32 buffer, the windows in dense tensors.

    ``Pool(num_slots, num_heads=32, device=None, gate="kda")`` allocates everything (windows empty: ``w = 0``,
    ``pcum = 0``, ``gbuf = 1``, ``p = 1``, ``hcnt = 0``). An engine that owns its buffers passes them by keyword
    (``raw=``, ``kbuf=``, ...); they are checked against the geometry and used as they are (no copy).

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

    WINDOW_FIELDS = {
        "kda": ("kbuf", "ubuf", "w", "pcum", "gbuf", "hcnt"),
        "gdn": ("kbuf", "ubuf", "w", "p", "hcnt"),
    }

    def __init__(self, num_slots: int, num_heads: int = DEFAULT_HEADS, device: torch.device | str | None = None,
                 gate: str = "kda", **buffers: torch.Tensor) -> None:
        if gate not in GATES:
            raise ValueError(f"gate: expected one of {GATES}, got {gate!r}")
        if not isinstance(num_slots, int) or num_slots < 2:
            raise ValueError(f"num_slots: expected an int >= 2 (slot 0 is reserved), got {num_slots!r}")
        if not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"num_heads: expected an int >= 1, got {num_heads!r}")
        unknown = set(buffers) - {"raw", *self.WINDOW_FIELDS[gate]}
        if unknown:
            raise ValueError(f"unknown buffers for gate {gate!r}: {sorted(unknown)}")
        if device is None:
            device = buffers["raw"].device if "raw" in buffers else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_slots, self.num_heads, self.gate = num_slots, num_heads, gate
        NS, H = num_slots, num_heads
        self.slot_stride = slot_stride(H)

        def take(name: str, shape: tuple[int, ...], dtype: torch.dtype, fill: float) -> torch.Tensor:
            t = buffers.get(name)
            if t is None:
                return torch.full(shape, fill, dtype=dtype, device=self.device)
            check_dense(name, t, shape, dtype, self.device)
            return t

        self.raw = take("raw", (raw_words(NS, H),), torch.float32, 0.0)
        self.kbuf = take("kbuf", (NS, H, L, K), torch.bfloat16, 0.0)
        self.ubuf = take("ubuf", (NS, H, L, V), torch.bfloat16, 0.0)
        self.w = take("w", (NS, H, L), torch.float32, 0.0)
        self.hcnt = take("hcnt", (NS, H), torch.int32, 0)
        if gate == "kda":
            self.pcum = take("pcum", (NS, H, K), torch.float32, 0.0)
            self.gbuf = take("gbuf", (NS, H, L, K), torch.float16, 1.0)
        else:
            self.p = take("p", (NS, H), torch.float32, 1.0)
        self._make_views()

    # ---- views of raw ----------------------------------------------------------------------------------------------
    def _make_views(self) -> None:
        NS, H, SS, raw = self.num_slots, self.num_heads, self.slot_stride, self.raw
        self.codes = _view(raw, torch.int8, (NS, H, V, K), (4 * SS, 4 * REGION_WORDS, K, 1), 4 * OFF + CODES_BYTE)
        self.s_k = _view(raw, torch.float32, (NS, H, K), (SS, REGION_WORDS, 1), OFF + SK_BYTE // 4)
        self.s_v = _view(raw, torch.float32, (NS, H, V), (SS, REGION_WORDS, 1), OFF + SV_BYTE // 4)
        self.tokens = _view(raw, torch.float16, (NS, H, R, K + V), (2 * SS, 2 * REGION_WORDS, K + V, 1),
                            2 * OFF + TOK_BYTE // 2)
        self.checkpoint_words = _view(raw, torch.float32, (NS, H, CHECKPOINT_WORDS), (SS, REGION_WORDS, 1), OFF)

    @property
    def u(self) -> torch.Tensor:
        """fp16 [NS, H, R, K] view: the key-side Compensator Tokens."""
        return self.tokens[..., :K]

    @property
    def q(self) -> torch.Tensor:
        """fp16 [NS, H, R, V] view: the value-side Compensator Tokens."""
        return self.tokens[..., K:]

    def window_tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.WINDOW_FIELDS[self.gate]}

    def __repr__(self) -> str:
        return (f"Pool(num_slots={self.num_slots}, num_heads={self.num_heads}, gate={self.gate!r}, "
                f"device={self.device})")

    # ---- bulk helpers ----------------------------------------------------------------------------------------------
    def _slots(self, slots: Iterable[int] | torch.Tensor) -> torch.Tensor:
        s = torch.as_tensor(slots, dtype=torch.long).reshape(-1).to(self.device)
        if s.numel() and (int(s.min()) < 1 or int(s.max()) >= self.num_slots):
            raise ValueError(f"slots: expected values in [1, {self.num_slots}), got {s.tolist()}")
        return s

    def write_checkpoint(self, slots, codes: torch.Tensor, s_k: torch.Tensor, s_v: torch.Tensor,
                         u: torch.Tensor, q: torch.Tensor) -> None:
        """Store checkpoints into ``slots`` ([n] ints). codes int8 [n, H, V, K]; s_k fp32 [n, H, K]; s_v fp32
        [n, H, V]; u fp16 [n, H, R, K]; q fp16 [n, H, R, V]."""
        s = self._slots(slots)
        self.codes[s] = codes.to(self.device, torch.int8)
        self.s_k[s] = s_k.to(self.device, torch.float32)
        self.s_v[s] = s_v.to(self.device, torch.float32)
        self.tokens[s] = torch.cat([u, q], dim=-1).to(self.device, torch.float16)

    def read_checkpoint(self, slots) -> tuple[torch.Tensor, ...]:
        """Fresh copies ``(codes, s_k, s_v, u, q)`` of the checkpoints in ``slots``, shapes as in
        :meth:`write_checkpoint`."""
        s = self._slots(slots)
        tok = self.tokens[s]
        return self.codes[s], self.s_k[s], self.s_v[s], tok[..., :K].contiguous(), tok[..., K:].contiguous()

    def write_window(self, slots, kbuf: torch.Tensor, ubuf: torch.Tensor, w: torch.Tensor,
                     gate: torch.Tensor, gbuf: torch.Tensor | None = None, fill: int = L) -> None:
        """Store full windows into ``slots``: kbuf [n, H, L, K], ubuf [n, H, L, V], w [n, H, L]; KDA: ``gate`` is
        pcum [n, H, K] and ``gbuf`` [n, H, L, K]; GDN: ``gate`` is p [n, H]. ``hcnt`` is set to ``fill``."""
        s = self._slots(slots)
        self.kbuf[s] = kbuf.to(self.device, torch.bfloat16)
        self.ubuf[s] = ubuf.to(self.device, torch.bfloat16)
        self.w[s] = w.to(self.device, torch.float32)
        if self.gate == "kda":
            if gbuf is None:
                raise ValueError("gbuf: required for a KDA pool")
            self.pcum[s] = gate.to(self.device, torch.float32)
            self.gbuf[s] = gbuf.to(self.device, torch.float16)
        else:
            self.p[s] = gate.to(self.device, torch.float32)
        self.hcnt[s] = fill

    def encode(self, slots, states: torch.Tensor, q0: torch.Tensor | None = None) -> None:
        """Compress dense fp32 states [n, H, V, K] into the checkpoints of ``slots`` (how a prefill state enters
        the pool); their windows are left as they are."""
        from .reference import compress, default_q0
        q0 = default_q0(self.device) if q0 is None else q0
        self.write_checkpoint(slots, *compress(states.to(self.device, torch.float32), q0.to(self.device)))

    def decode(self, slots, with_window: bool = True) -> torch.Tensor:
        """Dense fp32 states [n, H, V, K] of ``slots``: the checkpoint, and (``with_window``) the window folded in
        as a flush would (whatever ``hcnt`` says)."""
        from .reference import decode_checkpoint, rebuild
        s = self._slots(slots)
        ck = self.read_checkpoint(s)
        if not with_window:
            return decode_checkpoint(*ck)
        if self.gate == "kda":
            return rebuild(*ck, self.kbuf[s], self.ubuf[s], self.w[s], pcum=self.pcum[s], gbuf=self.gbuf[s])
        return rebuild(*ck, self.kbuf[s], self.ubuf[s], self.w[s], p=self.p[s])


def check_dense(name: str, t: object, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``t`` is a dense (contiguous) tensor of this shape, dtype, device."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {tuple(t.stride())}")
    if t.storage_offset() != 0 and name == "raw":
        raise ValueError(f"{name}: expected storage offset 0, got {t.storage_offset()}")
