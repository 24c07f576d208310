"""Pool's bulk helpers (write_checkpoint, read_checkpoint, write_window, encode, decode) check every argument before
they write anything: a bad one raises a ValueError naming it, and every byte of the pool stays as it was."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import leapquant as lq
from leapquant import families
from leapquant.layout import FIELDS, K, L, QMAX, R, V
from helpers import checkpoint_byte_mask, fill_noise, snapshot

NS, H = 5, 2            # slots 1 and 3 are written; 2 and 4 are witnesses that must not move
SLOTS = [1, 3]
GATES = ("kda", "gdn")


_NOISE: dict[str, lq.Pool] = {}


def make_pool(gate: str, device: torch.device | str = "cpu") -> lq.Pool:
    """A pool full of noise (so any stray write shows in a byte comparison); the noise is drawn once per gate."""
    if gate not in _NOISE:
        _NOISE[gate] = lq.Pool(NS, H, gate=gate)
        fill_noise(_NOISE[gate], seed=5)
    src = _NOISE[gate]
    bufs = {name: t.clone().to(device) for name, t in dict(raw=src.raw, **src.window_tensors()).items()}
    return lq.Pool(NS, H, device=device, gate=gate, **bufs)


def checkpoint_args(n: int = len(SLOTS), seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(codes=torch.randint(-QMAX, QMAX + 1, (n, H, V, K), generator=g, dtype=torch.int8),
                s_k=torch.rand(n, H, K, generator=g) + 0.1, s_v=torch.rand(n, H, V, generator=g) + 0.1,
                u=torch.randn(n, H, R, K, generator=g).half(), q=torch.randn(n, H, R, V, generator=g).half())


def window_args(gate: str, n: int = len(SLOTS), seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    args = dict(kbuf=torch.randn(n, H, L, K, generator=g).bfloat16(),
                ubuf=torch.randn(n, H, L, V, generator=g).bfloat16(), w=torch.rand(n, H, L, generator=g))
    if gate == "kda":
        args.update(gate=-5.0 * torch.rand(n, H, K, generator=g), gbuf=torch.rand(n, H, L, K, generator=g).half())
    else:
        args.update(gate=torch.rand(n, H, generator=g), gbuf=None)
    return args


def encode_args(n: int = len(SLOTS), seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(n, H, V, 3, generator=g), torch.randn(n, H, 3, K, generator=g)
    return dict(states=a @ b + 0.01 * torch.randn(n, H, V, K, generator=g), q0=lq.default_q0())


def call(pool: lq.Pool, helper: str, slots, args: dict):
    if helper == "write_checkpoint":
        return pool.write_checkpoint(slots, **args)
    if helper == "write_window":
        return pool.write_window(slots, **args)
    if helper == "encode":
        return pool.encode(slots, **args)
    if helper == "read_checkpoint":
        return pool.read_checkpoint(slots, **args)
    if helper == "read_window":
        return pool.read_window(slots, **args)
    return pool.decode(slots, **args)


def valid_args(helper: str, gate: str, n: int = len(SLOTS)) -> dict:
    if helper == "write_checkpoint":
        return checkpoint_args(n)
    if helper == "write_window":
        return window_args(gate, n)
    if helper == "encode":
        return encode_args(n)
    return {}


def assert_untouched(pool: lq.Pool, before: dict) -> None:
    after = snapshot(pool)
    expected = {"raw", "kbuf", "ubuf", "w", "hcnt"} | ({"pcum", "gbuf"} if pool.gate == "kda" else {"p"})
    assert set(after) == expected
    for name in expected:
        assert torch.equal(after[name], before[name]), f"pool.{name} changed"


def expect_rejected(pool: lq.Pool, helper: str, slots, args: dict, match: str) -> None:
    before = snapshot(pool)
    with pytest.raises(ValueError, match=match):
        call(pool, helper, slots, args)
    assert_untouched(pool, before)


def _set(name, value):
    return lambda a: a.__setitem__(name, value(a) if callable(value) else value)


def _poke(name, value, at=0):
    """Set one element of argument ``name`` (flat position ``at``) to ``value``, in a copy."""
    def f(a):
        t = a[name].clone()
        t.view(-1)[at] = value
        a[name] = t
    return f


# ---- the bad arguments: (id, gates it applies to, change to valid arguments, message) -------------------------------
SHAPE_MSG = r"expected shape \(n, H, {}\) = \({}\), got \({}\)"
WINDOW_CASES = [
    ("kbuf broadcast [L, K]", GATES, _set("kbuf", lambda a: a["kbuf"][0, 0]),
     r"kbuf: " + SHAPE_MSG.format("L, K", "2, 2, 16, 128", "16, 128")),
    ("kbuf one head short", GATES, _set("kbuf", lambda a: a["kbuf"][:, :1]), r"kbuf: expected shape"),
    ("kbuf one slot short", GATES, _set("kbuf", lambda a: a["kbuf"][:1]), r"kbuf: expected shape"),
    ("kbuf integer", GATES, _set("kbuf", torch.zeros(2, H, L, K, dtype=torch.int32)),
     r"kbuf: expected a floating-point tensor \(stored as torch.bfloat16\), got dtype torch.int32"),
    ("kbuf complex", GATES, _set("kbuf", torch.zeros(2, H, L, K, dtype=torch.complex64)),
     r"kbuf: expected a floating-point tensor"),
    ("kbuf list", GATES, _set("kbuf", lambda a: a["kbuf"].float().tolist()),
     r"kbuf: expected a torch.Tensor, got list"),
    ("kbuf meta", GATES, _set("kbuf", torch.empty(2, H, L, K, device="meta")), r"kbuf: expected a tensor with data"),
    ("kbuf nan", GATES, _poke("kbuf", float("nan"), 77), r"kbuf: values must be finite"),
    ("ubuf value dim 64 after a good kbuf", GATES, _set("ubuf", lambda a: a["ubuf"][..., :64]),
     r"ubuf: " + SHAPE_MSG.format("L, V", "2, 2, 16, 128", "2, 2, 16, 64")),
    ("ubuf inf", GATES, _poke("ubuf", float("inf"), 5), r"ubuf: values must be finite"),
    ("ubuf fp64 beyond bf16", GATES, _set("ubuf", torch.full((2, H, L, V), 3.5e38, dtype=torch.float64)),
     r"ubuf: values must be finite \(after conversion to torch.bfloat16\)"),
    ("w above 1", GATES, _poke("w", 1.5), r"w: values must be finite and in \[0, 1\]"),
    ("w negative", GATES, _poke("w", -0.25, 9), r"w: values must be finite and in \[0, 1\]"),
    ("w nan", GATES, _poke("w", float("nan")), r"w: values must be finite and in \[0, 1\]"),
    ("w missing L", GATES, _set("w", lambda a: a["w"][..., 0]), r"w: " + SHAPE_MSG.format("L", "2, 2, 16", "2, 2")),
    ("w integer", GATES, _set("w", torch.ones(2, H, L, dtype=torch.int64)), r"w: expected a floating-point tensor"),
    ("gate extra dim", GATES, _set("gate", lambda a: a["gate"].unsqueeze(-1)), r"gate \((pcum|p)\): expected shape"),
    ("gate out of range", GATES, _poke("gate", 1.5), r"gate \((pcum|p)\): values must be finite( or -inf)? and"),
    ("gate nan", GATES, _poke("gate", float("nan")), r"gate \((pcum|p)\): values must be finite"),
    ("gate integer", GATES, _set("gate", lambda a: a["gate"].long()), r"gate \((pcum|p)\): expected a floating-point"),
    ("gate None", GATES, _set("gate", None), r"gate \((pcum|p)\): expected a torch.Tensor, got NoneType"),
    ("kda pcum positive", ("kda",), _poke("gate", 1e-3, 3), r"gate \(pcum\): values must be finite or -inf and <= 0"),
    ("kda pcum +inf", ("kda",), _poke("gate", float("inf"), 3), r"gate \(pcum\): values must be finite or -inf and"),
    ("gdn p negative", ("gdn",), _poke("gate", -1e-3, 1), r"gate \(p\): values must be finite and in \[0, 1\]"),
    ("gdn p per head missing", ("gdn",), _set("gate", lambda a: a["gate"][:, 0]),
     r"gate \(p\): expected shape \(n, H\) = \(2, 2\), got \(2,\)"),
    ("kda gbuf missing", ("kda",), _set("gbuf", None), r"gbuf: required for a KDA pool"),
    ("kda gbuf broadcast", ("kda",), _set("gbuf", lambda a: a["gbuf"][0, 0]), r"gbuf: expected shape"),
    ("kda gbuf above 1", ("kda",), _poke("gbuf", 1.5, 11), r"gbuf: values must be finite and in \[0, 1\]"),
    ("kda gbuf negative", ("kda",), _poke("gbuf", -0.5), r"gbuf: values must be finite and in \[0, 1\]"),
    ("kda gbuf inf", ("kda",), _poke("gbuf", float("inf")), r"gbuf: values must be finite"),
    ("gdn gbuf given", ("gdn",), _set("gbuf", torch.ones(2, H, L, K, dtype=torch.float16)),
     r"gbuf: a GDN pool has none"),
    ("fill 17", GATES, _set("fill", 17), r"fill: expected an int in \[0, 16\]"),
    ("fill -1", GATES, _set("fill", -1), r"fill: expected an int in \[0, 16\]"),
    ("fill float", GATES, _set("fill", 16.0), r"fill: expected an int in \[0, 16\]"),
    ("fill bool", GATES, _set("fill", True), r"fill: expected an int in \[0, 16\]"),
    ("fill str", GATES, _set("fill", "16"), r"fill: expected an int in \[0, 16\]"),
    ("fill tensor int64", GATES, _set("fill", torch.full((2, H), 3)), r"fill: expected dtype torch.int32, got torch.int64"),
    ("fill tensor 0-dim", GATES, _set("fill", torch.tensor(16, dtype=torch.int32)),
     r"fill: expected shape \(n, H\) = \(2, 2\), got \(\)"),
    ("fill tensor 17", GATES, _set("fill", torch.full((2, H), 17, dtype=torch.int32)),
     r"fill: values must be in \[0, 16\]"),
]
CHECKPOINT_CASES = [
    ("codes int16", GATES, _set("codes", lambda a: a["codes"].short()),
     r"codes: expected dtype torch.int8, got torch.int16"),
    ("codes float", GATES, _set("codes", lambda a: a["codes"].float()), r"codes: expected dtype torch.int8"),
    ("codes -128", GATES, _poke("codes", -128, 1000),
     r"codes: values must be in \[-127, 127\]; got -128 at \(0, 0, 7, 104\)"),
    ("codes one head short", GATES, _set("codes", lambda a: a["codes"][:, :1]),
     r"codes: " + SHAPE_MSG.format("V, K", "2, 2, 128, 128", "2, 1, 128, 128")),
    ("codes tuple", GATES, _set("codes", (1, 2)), r"codes: expected a torch.Tensor, got tuple"),
    ("s_k zero", GATES, _poke("s_k", 0.0, 4), r"s_k: values must be finite and > 0"),
    ("s_k negative", GATES, _poke("s_k", -1.0), r"s_k: values must be finite and > 0"),
    ("s_k nan", GATES, _poke("s_k", float("nan")), r"s_k: values must be finite and > 0"),
    ("s_k inf", GATES, _poke("s_k", float("inf")), r"s_k: values must be finite and > 0"),
    ("s_k integer", GATES, _set("s_k", torch.ones(2, H, K, dtype=torch.int32)), r"s_k: expected a floating-point"),
    ("s_v underflows fp32", GATES, _set("s_v", lambda a: torch.full((2, H, V), 1e-60, dtype=torch.float64)),
     r"s_v: values must be finite and > 0 \(after conversion to torch.float32\)"),
    ("s_v shape of s_k with K", GATES, _set("s_v", lambda a: a["s_v"][..., :-1]), r"s_v: expected shape"),
    ("u beyond fp16", GATES, _set("u", lambda a: a["u"].float() * 1e5), r"u: values must be finite \(after conversion"),
    ("u nan", GATES, _poke("u", float("nan")), r"u: values must be finite"),
    ("u rank 5", GATES, _set("u", torch.zeros(2, H, R + 1, K, dtype=torch.float16)),
     r"u: " + SHAPE_MSG.format("R, K", "2, 2, 4, 128", "2, 2, 5, 128")),
    ("q tokens concatenated", GATES, _set("q", torch.zeros(2, H, R, K + V, dtype=torch.float16)), r"q: expected shape"),
    ("q inf", GATES, _poke("q", float("inf")), r"q: values must be finite"),
]
ENCODE_CASES = [
    ("states one head short", GATES, _set("states", lambda a: a["states"][:, :1]),
     r"states: " + SHAPE_MSG.format("V, K", "2, 2, 128, 128", "2, 1, 128, 128")),
    ("states one head too many", GATES, _set("states", torch.zeros(2, H + 1, V, K)), r"states: expected shape"),
    ("states unbatched", GATES, _set("states", lambda a: a["states"][0, 0]), r"states: expected shape"),
    ("states nan", GATES, _poke("states", float("nan"), 123), r"states: values must be finite"),
    ("states inf", GATES, _poke("states", float("-inf")), r"states: values must be finite"),
    ("states fp64 beyond fp32", GATES, _set("states", lambda a: a["states"].double() * 1e300),
     r"states: values must be finite \(after conversion to torch.float32\)"),
    ("states integer", GATES, _set("states", torch.zeros(2, H, V, K, dtype=torch.int32)),
     r"states: expected a floating"),
    ("q0 rank 5", GATES, _set("q0", torch.randn(V, R + 1)),
     r"q0: expected shape \(V, R\) = \(128, 4\), got \(128, 5\)"),
    ("q0 nan", GATES, _poke("q0", float("nan")), r"q0: values must be finite"),
    ("q0 integer", GATES, _set("q0", torch.ones(V, R, dtype=torch.int64)), r"q0: expected a floating-point"),
    ("q0 list", GATES, _set("q0", [[0.0] * R] * V), r"q0: expected a torch.Tensor"),
    ("q0 zero", GATES, _set("q0", torch.zeros(V, R)), r"q0: its columns' norms must lie in \[0.000976562, 1024\]"),
    ("q0 one zero column", GATES, _set("q0", lambda a: torch.cat([a["q0"][:, :3], torch.zeros(V, 1)], 1)),
     r"q0: its columns' norms must lie in"),
    ("q0 huge", GATES, _set("q0", lambda a: a["q0"] * 1e19), r"q0: its columns' norms must lie in"),
    ("q0 one column repeated", GATES, _set("q0", lambda a: a["q0"][:, [0, 1, 2, 0]]),
     r"q0: its columns must be independent"),
]
INT_SLOTS = r"slots: expected integer slot numbers"
# slot selections every helper rejects, and those only the writers reject (reads may repeat a slot)
SLOT_CASES = [
    ("slot 0 (reserved)", [0, 1], r"slots: expected values in \[1, 5\) \(slot 0 is reserved\), got \[0\]"),
    ("slot = num_slots", [1, NS], r"slots: expected values in \[1, 5\)"),
    ("negative slot", [-1, 3], r"slots: expected values in \[1, 5\)"),
    ("huge slot", [1, 2**70], r"slots: expected values in \[1, 5\)"),
    ("float slots", [1.0, 3.0], INT_SLOTS + r", got 1.0 at position 0"),
    ("bool slot", [1, True], INT_SLOTS + r", got True at position 1"),
    ("float tensor", torch.tensor([1.0, 3.0]), INT_SLOTS + r", got a tensor of dtype torch.float32"),
    ("bool tensor", torch.tensor([True, False]), INT_SLOTS + r", got a tensor of dtype torch.bool"),
    ("2-D tensor", torch.tensor([[1, 3]]), r"slots: expected a 1-D tensor \[n\], got shape \(1, 2\)"),
    ("bare int", 1, r"slots: expected a list, tuple or range of ints or a 1-D integer tensor, got int"),
    ("None", None, r"slots: expected a list, tuple or range"),
    ("str", "13", r"slots: expected a list, tuple or range"),
]
REPEAT_CASES = [
    ("repeated slot", [3, 3], r"slots: slot 3 appears more than once \(each sequence owns one slot\)"),
    ("repeated slot tensor", torch.tensor([1, 1], dtype=torch.int32), r"slots: slot 1 appears more than once"),
]
WRITERS = ("write_checkpoint", "write_window", "encode")
READERS = ("read_checkpoint", "read_window", "decode")


def _params(helper, cases):
    return [pytest.param(gate, helper, change, match, id=f"{gate}-{helper}-{name}")
            for name, gates, change, match in cases for gate in gates]


@pytest.fixture(params=GATES)
def gate(request):
    return request.param


@pytest.mark.parametrize("gate, helper, change, match", _params("write_window", WINDOW_CASES)
                         + _params("write_checkpoint", CHECKPOINT_CASES) + _params("encode", ENCODE_CASES))
def test_bad_argument_is_named_and_pool_untouched(gate, helper, change, match):
    pool = make_pool(gate)
    args = valid_args(helper, gate)
    change(args)
    expect_rejected(pool, helper, SLOTS, args, match)


@pytest.mark.parametrize("helper", WRITERS + READERS)
@pytest.mark.parametrize("slots, match", [pytest.param(s, m, id=n) for n, s, m in SLOT_CASES + REPEAT_CASES])
def test_bad_slots_are_named_and_pool_untouched(gate, helper, slots, match):
    pool = make_pool(gate)
    if helper in READERS and "more than once" in match:
        before = snapshot(pool)
        out = call(pool, helper, slots, {})                     # reads may name a slot twice: one copy each
        first = out[0] if helper in ("read_checkpoint", "read_window") else out
        assert first.shape[0] == 2 and torch.equal(first[0], first[1])
        assert_untouched(pool, before)
        return
    expect_rejected(pool, helper, slots, valid_args(helper, gate), match)


@pytest.mark.parametrize("helper", WRITERS)
def test_slot_count_must_match_the_arguments(gate, helper):
    """Three slots for arguments of two: the first tensor argument is named with the expected n."""
    first = {"write_checkpoint": "codes", "write_window": "kbuf", "encode": "states"}[helper]
    pool = make_pool(gate)
    match = rf"{first}: expected shape \(n, H, .*\) = \(3, 2,"
    expect_rejected(pool, helper, [1, 2, 3], valid_args(helper, gate), match)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_decode_with_window_must_be_a_bool(gate, value):
    expect_rejected(make_pool(gate), "decode", SLOTS, dict(with_window=value), r"with_window: expected a bool")


# ---- any single wrong dimension, drawn ---------------------------------------------------------------------------
_TENSOR_ARGS = {
    "write_checkpoint": ("codes", "s_k", "s_v", "u", "q"),
    "write_window": ("kbuf", "ubuf", "w", "gate", "gbuf"),
    "encode": ("states", "q0"),
}


@given(gate=st.sampled_from(GATES), data=st.data())
def test_any_wrong_dimension_is_named(gate, data):
    """One dimension of one tensor argument resized (or dropped, or one added): ValueError naming that argument."""
    helper = data.draw(st.sampled_from(WRITERS), label="helper")
    names = [n for n in _TENSOR_ARGS[helper] if not (n == "gbuf" and gate == "gdn")]
    name = data.draw(st.sampled_from(names), label="argument")
    pool = make_pool(gate)
    args = valid_args(helper, gate)
    t = args[name]
    how = data.draw(st.sampled_from(["resize", "drop", "add"]), label="how")
    if how == "resize" or t.dim() == 0:
        d = data.draw(st.integers(0, t.dim() - 1), label="dim")
        size = data.draw(st.integers(0, t.shape[d] + 2).filter(lambda x: x != t.shape[d]), label="size")
        shape = list(t.shape)
        shape[d] = size
        args[name] = torch.zeros(shape, dtype=t.dtype)
    elif how == "drop":
        args[name] = t[0]
    else:
        args[name] = t.unsqueeze(data.draw(st.integers(0, t.dim()), label="at"))
    label = {"gate": r"gate \((pcum|p)\)"}.get(name, name)
    expect_rejected(pool, helper, SLOTS, args, rf"^{label}: expected shape")


# ---- what valid calls do ------------------------------------------------------------------------------------------
SLOT_FORMS = {
    "list": [1, 3], "tuple": (1, 3), "range": range(1, 5, 2),
    "int32 tensor": torch.tensor([1, 3], dtype=torch.int32), "int64 tensor": torch.tensor([1, 3]),
    "uint8 tensor": torch.tensor([1, 3], dtype=torch.uint8),
    "list of 0-dim tensors": [torch.tensor(1), torch.tensor(3)],
}


def _changed_outside(pool: lq.Pool, before: dict, slots: list[int]) -> None:
    """Only the checkpoints of ``slots`` (every head) may differ from ``before`` in raw."""
    s = torch.tensor(slots).repeat_interleave(H)
    h = torch.arange(H).repeat(len(slots))
    mask = checkpoint_byte_mask(pool, s, h)
    moved = (snapshot(pool)["raw"] != before["raw"]) & ~mask
    assert not bool(moved.any()), f"{int(moved.sum())} raw bytes outside the written checkpoints changed"


@pytest.mark.parametrize("form", list(SLOT_FORMS))
def test_checkpoint_round_trip(gate, form):
    pool = make_pool(gate)
    before = snapshot(pool)
    args = checkpoint_args(seed=1)
    pool.write_checkpoint(SLOT_FORMS[form], **args)
    out = pool.read_checkpoint(SLOT_FORMS[form])
    for name, got in zip(("codes", "s_k", "s_v", "u", "q"), out):
        assert got.dtype == FIELDS[name].dtype and torch.equal(got, args[name]), name
    _changed_outside(pool, before, SLOTS)
    after = snapshot(pool)
    for name in pool.window_tensors():
        assert torch.equal(after[name], before[name]), f"{name}: a checkpoint write touched the window"


def test_checkpoint_accepts_any_floating_dtype(gate):
    """Floating arguments are converted to the pool's dtypes (documented); codes must be int8 as they are."""
    pool = make_pool(gate)
    args = checkpoint_args(seed=2)
    wide = dict(args, s_k=args["s_k"].double(), s_v=args["s_v"].bfloat16(), u=args["u"].float(), q=args["q"].double())
    pool.write_checkpoint(SLOTS, **wide)
    codes, s_k, s_v, u, q = pool.read_checkpoint(SLOTS)
    assert torch.equal(codes, args["codes"]) and torch.equal(s_k, wide["s_k"].float())
    assert torch.equal(s_v, wide["s_v"].float()) and torch.equal(u, args["u"]) and torch.equal(q, args["q"])


def test_codes_at_the_format_limits_are_accepted(gate):
    pool = make_pool(gate)
    args = checkpoint_args()
    args["codes"] = torch.full_like(args["codes"], -QMAX)
    args["codes"][1] = QMAX
    pool.write_checkpoint(SLOTS, **args)
    assert torch.equal(pool.read_checkpoint(SLOTS)[0], args["codes"])


@pytest.mark.parametrize("fill", [None, 0, 5, L, "per program"])
def test_write_window_stores_and_sets_hcnt(gate, fill):
    pool = make_pool(gate)
    before = snapshot(pool)
    hcnt0 = pool.hcnt.clone()
    args = window_args(gate, seed=3)
    args["kbuf"] = args["kbuf"].float()                     # any floating dtype: converted to bf16
    if fill == "per program":                               # int32 [n, H], as read_window returns them
        fill = torch.arange(2 * H, dtype=torch.int32).view(2, H) * 3
    pool.write_window(SLOTS, **args, **({} if fill is None else dict(fill=fill)))
    s = torch.tensor(SLOTS)
    assert torch.equal(pool.kbuf[s], args["kbuf"].bfloat16()) and torch.equal(pool.ubuf[s], args["ubuf"])
    assert torch.equal(pool.w[s], args["w"])
    if gate == "kda":
        assert torch.equal(pool.pcum[s], args["gate"]) and torch.equal(pool.gbuf[s], args["gbuf"])
    else:
        assert torch.equal(pool.p[s], args["gate"])
    assert bool((pool.hcnt[s] == (L if fill is None else fill)).all())
    kbuf, ubuf, w, gate_state, gbuf, hcnt = pool.read_window(SLOTS)
    assert torch.equal(kbuf, pool.kbuf[s]) and torch.equal(ubuf, pool.ubuf[s]) and torch.equal(w, pool.w[s])
    assert torch.equal(gate_state, pool.pcum[s] if gate == "kda" else pool.p[s]) and torch.equal(hcnt, pool.hcnt[s])
    assert (gbuf is None) if gate == "gdn" else torch.equal(gbuf, pool.gbuf[s])
    others = torch.tensor([0, 2, 4])
    assert torch.equal(pool.hcnt[others], hcnt0[others])
    for name, t in pool.window_tensors().items():
        old = before[name].view(t.dtype).view(t.shape)
        assert torch.equal(t[others].view(torch.uint8), old[others].view(torch.uint8)), f"{name}: other slots moved"
    assert torch.equal(snapshot(pool)["raw"], before["raw"]), "a window write touched raw"


def test_window_values_at_the_domain_edges_are_accepted(gate):
    """w in {0, 1}; gbuf and p may be exactly 0 (a decode step's fp16 exp(g) / running product can underflow) or 1;
    pcum far below -1000."""
    pool = make_pool(gate)
    args = window_args(gate)
    args["w"][0], args["w"][1] = 0.0, 1.0
    if gate == "kda":
        args["gate"][0], args["gate"][1] = 0.0, -5e4
        args["gbuf"][0], args["gbuf"][1] = 0.0, 1.0
    else:
        args["gate"][0], args["gate"][1] = 0.0, 1.0
    pool.write_window(SLOTS, **args)
    assert torch.equal(pool.w[torch.tensor(SLOTS)], args["w"])


def test_empty_selection_writes_nothing(gate):
    pool = make_pool(gate)
    before = snapshot(pool)
    pool.write_window([], **window_args(gate, n=0))
    pool.write_checkpoint([], **checkpoint_args(n=0))
    pool.encode([], **encode_args(n=0))
    assert pool.read_checkpoint([])[0].shape == (0, H, V, K)
    assert_untouched(pool, before)


def test_a_new_pools_slots_read_back_and_write_back(gate):
    """A new pool's slots hold what reset_slots gives a new sequence (scales EPS, not 0, which the format excludes):
    every slot's checkpoint and window read back write back (an engine's snapshot of the whole pool)."""
    pool = lq.Pool(3, H, gate=gate)
    reset = lq.Pool(3, H, gate=gate, raw=torch.zeros_like(pool.raw))     # a caller's raw is used as it is
    assert not bool(reset.s_k.any())
    reset.reset_slots([1, 2])
    for mine, theirs in zip(pool.read_checkpoint([1, 2]) + pool.read_window([1, 2]),
                            reset.read_checkpoint([1, 2]) + reset.read_window([1, 2])):
        assert (mine is None and theirs is None) or torch.equal(mine, theirs)
    before = snapshot(pool)
    pool.write_checkpoint([1, 2], *pool.read_checkpoint([1, 2]))
    pool.write_window([1, 2], *pool.read_window([1, 2])[:5], fill=pool.read_window([1, 2])[5])
    assert_untouched(pool, before)


def test_encode_decode_round_trip(gate):
    """A dense state goes in through encode (fp64 accepted, computed in fp32) and comes back through decode within
    the format's error; only the slots' checkpoints change."""
    pool = make_pool(gate)
    before = snapshot(pool)
    args = encode_args(seed=4)
    pool.encode(SLOTS, args["states"].double(), args["q0"])
    dec = pool.decode(SLOTS, with_window=False)
    err = (dec - args["states"]).abs().mean(dim=(-1, -2))
    assert bool((err <= 1e-2 * args["states"].abs().mean(dim=(-1, -2))).all()), err
    _changed_outside(pool, before, SLOTS)
    codes, s_k, s_v, u, q = pool.read_checkpoint(SLOTS)
    assert bool((codes.abs() <= QMAX).all()) and bool((s_k > 0).all()) and bool((s_v > 0).all())


def test_decode_folds_the_window_written(gate):
    """decode(with_window) is the state write_checkpoint + write_window describe."""
    from leapquant.reference import rebuild
    pool = make_pool(gate)
    ck, win = checkpoint_args(seed=6), window_args(gate, seed=6)
    pool.write_checkpoint(SLOTS, **ck)
    pool.write_window(SLOTS, **win)
    gk = dict(pcum=win["gate"], gbuf=win["gbuf"]) if gate == "kda" else dict(p=win["gate"])
    want = rebuild(*(ck[n] for n in ("codes", "s_k", "s_v", "u", "q")), win["kbuf"], win["ubuf"], win["w"], **gk)
    assert torch.allclose(pool.decode(SLOTS), want, rtol=1e-5, atol=1e-6)


def test_every_input_family_is_admitted(gate):
    """The value checks admit every input family the suites load through the helpers (families.Case.load_into)."""
    pool = lq.Pool(3, len(families.FAMILIES), gate=gate)
    case = families.make_case(2, len(families.FAMILIES), gate, seed=1)
    case.load_into(pool, [1, 2])
    assert bool((pool.hcnt[1:] == L).all())


def test_inputs_on_another_device_are_copied(gate, cuda_device):
    """A CUDA pool takes CPU tensors (copied to its device); a bad one is still caught before any write."""
    pool = make_pool(gate, cuda_device)
    args = checkpoint_args(seed=7)
    pool.write_checkpoint(torch.tensor(SLOTS), **args)
    out = pool.read_checkpoint(SLOTS)
    assert out[0].device == pool.device and torch.equal(out[0].cpu(), args["codes"])
    win = window_args(gate, seed=7)
    pool.write_window(SLOTS, **win)
    assert torch.equal(pool.kbuf[torch.tensor(SLOTS, device=pool.device)].cpu(), win["kbuf"])
    bad = dict(win, ubuf=win["ubuf"][..., :64])
    expect_rejected(pool, "write_window", torch.tensor(SLOTS, device=pool.device), bad, r"ubuf: expected shape")


# ---- the pool's own buffers, views of them, and host integers ---------------------------------------------------------
def _life_cycle(pool: lq.Pool, helper: str) -> None:
    if helper == "reset_slots":
        pool.reset_slots(SLOTS)
    else:
        pool.copy_slots([2, 4], SLOTS)


SWAPS = [
    ("raw replaced", "raw", lambda t: t.clone(), r"pool.raw: was replaced after the views were made"),
    ("hcnt int64", "hcnt", lambda t: t.long(), r"pool.hcnt: expected dtype torch.int32"),
    ("kbuf one head short", "kbuf", lambda t: t[:, :1].clone(), r"pool.kbuf: expected shape"),
    ("w shares kbuf's memory", "w", None, r"pool.w: shares memory with pool.kbuf"),
]


@pytest.mark.parametrize("helper", WRITERS + READERS + ("reset_slots", "copy_slots"))
@pytest.mark.parametrize("field, swap, match", [pytest.param(*c[1:], id=c[0]) for c in SWAPS])
def test_helpers_check_the_pools_buffers(gate, helper, field, swap, match):
    """A buffer an engine replaced after making the pool is named by every helper, as by the deployment calls, before
    anything is written (through the stale views, or into the replacement)."""
    pool = make_pool(gate)
    before, kept = snapshot(pool), getattr(pool, field)
    replacement = swap(kept) if swap is not None else pool.kbuf.view(torch.float32).view(-1)[:kept.numel()].view(
        kept.shape)
    witness = replacement.clone().view(torch.uint8)
    setattr(pool, field, replacement)
    with pytest.raises(ValueError, match=match):
        if helper in ("reset_slots", "copy_slots"):
            _life_cycle(pool, helper)
        else:
            call(pool, helper, SLOTS, valid_args(helper, gate))
    assert torch.equal(replacement.view(torch.uint8), witness), f"the replacement pool.{field} was written"
    setattr(pool, field, kept)
    assert_untouched(pool, before)


def _valid_slots(pool: lq.Pool, gate: str, slots) -> tuple[dict, dict]:
    ck, win = checkpoint_args(len(slots), seed=11), window_args(gate, len(slots), seed=11)
    pool.write_checkpoint(slots, **ck)
    pool.write_window(slots, **win, fill=5)
    return ck, win


def test_writers_take_views_of_the_pools_own_slots(gate):
    """Moving slots 2, 3 into 1, 2 by passing the pool's own views: every destination gets its source as it was before
    the call (the writers copy their arguments before writing; without that, slot 1's codes read slot 3's)."""
    pool = make_pool(gate)
    ck, win = _valid_slots(pool, gate, [2, 3])
    src = torch.tensor([2, 3])
    views = dict(codes=pool.codes[2:4], s_k=pool.s_k[2:4], s_v=pool.s_v[2:4], u=pool.u[2:4], q=pool.q[2:4])
    pool.write_checkpoint([1, 2], **views)
    for got, want in zip(pool.read_checkpoint([1, 2]), (ck[n] for n in ("codes", "s_k", "s_v", "u", "q"))):
        assert torch.equal(got, want.to(got.dtype))
    gate_view = pool.pcum[2:4] if gate == "kda" else pool.p[2:4]
    pool.write_window([1, 2], pool.kbuf[2:4], pool.ubuf[2:4], pool.w[2:4], gate_view,
                      pool.gbuf[2:4] if gate == "kda" else None, fill=5)
    for name, want in (("kbuf", win["kbuf"]), ("ubuf", win["ubuf"]), ("w", win["w"])):
        assert torch.equal(getattr(pool, name)[torch.tensor([1, 2])], want.to(getattr(pool, name).dtype)), name
    assert torch.equal((pool.pcum if gate == "kda" else pool.p)[torch.tensor([1, 2])], win["gate"].float())
    assert src.tolist() == [2, 3]


def test_host_integers_of_numpy_are_accepted(gate):
    """Engines keep slot tables and sizes in numpy: numpy integers pass wherever an int is asked for, and a numpy
    array of slots wherever a slot list is; numpy bools do not."""
    np = pytest.importorskip("numpy")
    pool = lq.Pool(np.int64(NS), np.int32(H), gate=gate)
    assert (pool.num_slots, pool.num_heads) == (NS, H) and type(pool.num_slots) is int
    win = window_args(gate)
    pool.write_window(np.array(SLOTS), **win, fill=np.int64(L))
    assert bool((pool.hcnt[torch.tensor(SLOTS)] == L).all())
    pool.reset_slots(np.array(SLOTS, dtype=np.int32))
    assert bool((pool.hcnt[torch.tensor(SLOTS)] == 0).all())
    expect_rejected(pool, "write_window", SLOTS, dict(win, fill=np.bool_(True)), r"fill: expected an int")
    expect_rejected(pool, "write_window", np.array([1.0, 3.0]), win, INT_SLOTS)
    expect_rejected(pool, "write_window", np.array([1, None], dtype=object), win, INT_SLOTS)


def test_arguments_are_copied_only_where_they_share_the_pools_memory(gate):
    """The writers copy an argument already in the pool's dtype and device only when it shares memory with the pool
    (a restore of many slots from read_checkpoint's fresh copies takes no second copy of them)."""
    from leapquant.layout import check_and_convert
    pool = make_pool(gate)
    lead = (("n", 1), ("H", H))
    fresh, view = pool.kbuf[1:2].clone(), pool.kbuf[2:3]
    staged = check_and_convert([("a", fresh, FIELDS["kbuf"], lead), ("b", view, FIELDS["kbuf"], lead)], pool.device,
                               pool._buffers())
    assert staged[0].data_ptr() == fresh.data_ptr() and staged[1].data_ptr() != view.data_ptr()


def test_encode_names_states_too_large_for_the_format(gate):
    """A finite state whose compression overflows fp32 (|S| ~ 3e38, far outside the format's |S| < 1e4) is refused
    naming ``states``, not the internal checkpoint it produced."""
    pool = make_pool(gate)
    S = torch.full((len(SLOTS), H, V, K), 3e38)
    S[..., ::2, :] *= -1
    S[..., 0] = 0
    expect_rejected(pool, "encode", SLOTS, dict(states=S), r"states: their compression does not fit the format")
