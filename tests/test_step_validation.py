"""The step's bad input raises a ValueError naming the argument before anything is written (the pool byte-identical),
from metadata only; the life-cycle helpers likewise; the dispatch's step op (reasons, forcing, auto)."""
from __future__ import annotations

import pytest
import torch

import leapquant as lq
from leapquant import dispatch, step_families as sf
from leapquant.layout import K, L, V
from helpers import fill_noise, snapshot

H, N = 4, 3


@pytest.fixture(params=["kda", "gdn"])
def pool(request):
    p = lq.Pool(5, H, gate=request.param)
    fill_noise(p, seed=1)
    return p


def good_args(gate: str, hk: int = H) -> dict:
    g = torch.Generator().manual_seed(0)
    A_log, dt_bias = sf.head_constants(H, gate, g)
    return dict(idx=torch.tensor([1, 0, 3], dtype=torch.int32),
                qkv=torch.randn(N, 2 * hk * K + H * V, generator=g).bfloat16(),
                a=torch.randn((N, H, K) if gate == "kda" else (N, H), generator=g).bfloat16(),
                b=torch.randn(N, H, generator=g).bfloat16(), A_log=A_log, dt_bias=dt_bias,
                out=torch.empty(N, H, V, dtype=torch.bfloat16))


def _expect_rejected(pool, match, **changes):
    args = good_args(pool.gate)
    kw = {k: changes.pop(k) for k in ("num_k_heads", "beta_bf16", "check_idx") if k in changes}
    args.update(changes)
    before = snapshot(pool)
    out_before = args["out"].clone() if isinstance(args["out"], torch.Tensor) else None
    with pytest.raises(ValueError, match=match):
        lq.step_inplace(pool, args["idx"], args["qkv"], args["a"], args["b"], args["A_log"], args["dt_bias"],
                        args["out"], **kw)
    after = snapshot(pool)
    for name in before:
        assert torch.equal(before[name], after[name]), f"{name} changed by a rejected call"
    if out_before is not None and out_before.shape == args["out"].shape and out_before.dtype == args["out"].dtype:
        assert torch.equal(out_before.view(torch.int16), args["out"].view(torch.int16)), "out written"


W = 2 * H * K + H * V


@pytest.mark.parametrize("change, match", [
    (dict(idx=torch.tensor([1, 2, 3], dtype=torch.int64)), "idx: expected dtype torch.int32"),
    (dict(idx=torch.tensor([[1, 2, 3]], dtype=torch.int32)), "idx: expected a 1-D tensor"),
    (dict(idx=torch.tensor([1, 0, 2, 0, 3, 0], dtype=torch.int32)[::2]), "idx: expected a contiguous tensor"),
    (dict(idx=[1, 2, 3]), "idx: expected a torch.Tensor"),
    (dict(qkv=torch.zeros(N, W)), "qkv: expected dtype torch.bfloat16"),
    (dict(qkv=torch.zeros(N + 1, W, dtype=torch.bfloat16)), r"qkv: expected shape \(N, 2 Hk K \+ H V\) with N = 3"),
    (dict(qkv=torch.zeros(N, W + 1, dtype=torch.bfloat16)), "qkv: width"),
    (dict(qkv=torch.zeros(W, N, dtype=torch.bfloat16).t()), "qkv: each row must be dense"),
    (dict(qkv=torch.zeros(N, W, dtype=torch.bfloat16, device="meta")), "qkv: expected device cpu"),
    (dict(b=torch.zeros(N, H)), "b: expected dtype torch.bfloat16"),
    (dict(b=torch.zeros(N, H + 1, dtype=torch.bfloat16)), r"b: expected shape \(N, H\)"),
    (dict(b=torch.zeros(H, N, dtype=torch.bfloat16).t()), "b: each row must be dense"),
    (dict(A_log=torch.zeros(H, dtype=torch.float64)), "A_log: expected dtype torch.float32"),
    (dict(A_log=torch.zeros(H + 1)), r"A_log: expected shape \(H\)"),
    (dict(A_log=torch.zeros(2 * H)[::2]), "A_log: expected a contiguous tensor"),
    (dict(out=torch.empty(N, H, V)), "out: expected dtype torch.bfloat16"),
    (dict(out=torch.empty(N, H, V + 1, dtype=torch.bfloat16)), r"out: expected shape \(N, H, V\)"),
    (dict(out=torch.empty(N, V, H, dtype=torch.bfloat16).transpose(1, 2)), "out: expected a contiguous tensor"),
    (dict(num_k_heads=0), "num_k_heads: expected a positive int"),
    (dict(num_k_heads=True), "num_k_heads: expected a positive int"),
    (dict(num_k_heads=2), "num_k_heads: 2 disagrees with qkv: its width"),
    (dict(num_k_heads=torch.tensor(H)), "num_k_heads: expected a positive int"),      # reading it could synchronise
    (dict(beta_bf16=1), "beta_bf16: expected a bool"),
    (dict(check_idx="no"), "check_idx: expected a bool"),
    (dict(idx=torch.tensor([1, 5, 3], dtype=torch.int32), check_idx=True), "idx: slots must be < num_slots = 5"),
    (dict(idx=torch.tensor([3, -1, 3], dtype=torch.int32), check_idx=True), "idx: a slot appears more than once"),
])
def test_bad_arguments(pool, change, match):
    _expect_rejected(pool, match, **change)


def test_num_k_heads_as_a_numpy_integer(pool):
    """An engine's head counts may be numpy integers: they serve as the int they hold."""
    np = pytest.importorskip("numpy")
    args = good_args(pool.gate)
    outs = []
    for hk in (H, np.int64(H)):
        p = lq.Pool(5, H, gate=pool.gate)
        out = torch.empty(N, H, V, dtype=torch.bfloat16)
        lq.step_inplace(p, args["idx"], args["qkv"], args["a"], args["b"], args["A_log"], args["dt_bias"], out,
                        num_k_heads=hk)
        outs.append((out, snapshot(p)))
    assert torch.equal(outs[0][0], outs[1][0]) and all(torch.equal(v, outs[1][1][k]) for k, v in outs[0][1].items())


def test_gate_specific_shapes(pool):
    if pool.gate == "kda":
        _expect_rejected(pool, r"a: expected shape \(N, H, K\)", a=torch.zeros(N, H, dtype=torch.bfloat16))
        _expect_rejected(pool, r"dt_bias: expected shape \(H, K\)", dt_bias=torch.zeros(H))
        _expect_rejected(pool, "a: each row must be dense",
                         a=torch.zeros(N, K, H, dtype=torch.bfloat16).transpose(1, 2))
        # KDA has one key head per head: a GQA-shaped row is refused
        args = good_args("gdn", hk=2)
        _expect_rejected(pool, r"qkv: its width 1024 gives 2 key heads, but KDA has one key head per head \(4\)",
                         qkv=args["qkv"])
        _expect_rejected(pool, "num_k_heads: KDA has one key head per head", qkv=args["qkv"], num_k_heads=2)
    else:
        _expect_rejected(pool, r"a: expected shape \(N, H\)", a=torch.zeros(N, H, K, dtype=torch.bfloat16))
        _expect_rejected(pool, r"dt_bias: expected shape \(H\)", dt_bias=torch.zeros(H, K))
        # 3 key heads do not divide 4 value heads
        _expect_rejected(pool, "qkv: its width 1280 gives 3 key heads, but the 4 heads must split evenly",
                         qkv=torch.zeros(N, 2 * 3 * K + H * V, dtype=torch.bfloat16))
        _expect_rejected(pool, "num_k_heads: got 3, but the 4 heads must split evenly",
                         qkv=torch.zeros(N, 2 * 3 * K + H * V, dtype=torch.bfloat16), num_k_heads=3)


def _sharing(base: torch.Tensor, n: int, offset: int) -> torch.Tensor:
    """n bf16 elements of ``base``'s storage from element ``offset`` on."""
    return base.reshape(-1)[offset:offset + n]


@pytest.mark.parametrize("what", ["qkv", "a", "b", "pool.ubuf", "pool.raw"])
def test_out_may_not_share_memory_with_what_the_step_reads(pool, what):
    """out written while the step reads qkv, a, b or the pool (by the kernels' programs in any order) would make
    the result depend on that order: a shared byte is refused before anything is written."""
    args = good_args(pool.gate)
    n_out = N * H * V
    if what in ("qkv", "a", "b"):
        base = torch.zeros(n_out + args[what].numel(), dtype=torch.bfloat16)
        view = _sharing(base, args[what].numel(), n_out - 1).view(args[what].shape)   # one element in common
        view.copy_(args[what])
        changes = {what: view, "out": _sharing(base, n_out, 0).view(N, H, V)}
    elif what == "pool.ubuf":
        changes = {"out": _sharing(pool.ubuf, n_out, 0).view(N, H, V)}
    else:
        changes = {"out": pool.raw.view(torch.bfloat16)[:n_out].view(N, H, V)}
    _expect_rejected(pool, f"out: shares memory with {what}", **changes)


def test_a_buffer_whose_memory_is_swapped_is_checked_again(pool):
    """An engine may keep a buffer object and swap the memory or the view behind it (``t.data = ...``,
    ``t.as_strided_(...)``): the checks see the new one, not what they saw before."""
    args = good_args(pool.gate)
    lq.step_inplace(pool, args["idx"], args["qkv"], args["a"], args["b"], args["A_log"], args["dt_bias"],
                    args["out"], backend="reference")
    old_ubuf = pool.ubuf.data
    pool.ubuf.data = old_ubuf.clone()
    inside_new = pool.ubuf.reshape(-1)[:N * H * V].view(N, H, V)
    _expect_rejected(pool, "out: shares memory with pool.ubuf", out=inside_new)
    lq.step_inplace(pool, args["idx"], args["qkv"], args["a"], args["b"], args["A_log"], args["dt_bias"],
                    old_ubuf.reshape(-1)[:N * H * V].view(N, H, V), backend="reference")
    # the same object and address, another view: checked again
    ns, h, l, k = pool.kbuf.shape
    pool.kbuf.as_strided_(pool.kbuf.shape, (h * l * k, l * k, 1, l))          # each [L, K] tile transposed in place
    _expect_rejected(pool, "pool.kbuf: expected a contiguous tensor")


def test_out_next_to_an_input_is_accepted(pool):
    """Adjacent, not overlapping: one buffer holding out and then qkv (an engine's arena) is fine."""
    args = good_args(pool.gate)
    n_out = N * H * V
    base = torch.zeros(n_out + args["qkv"].numel(), dtype=torch.bfloat16)
    qkv = _sharing(base, args["qkv"].numel(), n_out).view(args["qkv"].shape)
    qkv.copy_(args["qkv"])
    out = _sharing(base, n_out, 0).view(N, H, V)
    lq.step_inplace(pool, args["idx"], qkv, args["a"], args["b"], args["A_log"], args["dt_bias"], out,
                    backend="reference")
    assert not bool(out[1].any()), "the padding row's output"


def test_a_step_before_the_flush_is_caught_by_the_idx_checks(pool):
    """A full window that no flush has folded reads as "just flushed, empty" to the next step, which would drop it:
    the host-synchronising checks (check_idx) name the program; the unchecked path is the caller's contract."""
    args = good_args(pool.gate)
    pool.hcnt[[1, 3]] = 3                                # the rows' programs mid-window (the noise has full ones)
    pool.hcnt[3, 2] = L
    pool.w[3, 2] = 0.5
    _expect_rejected(pool, f"idx: slot 3, head 2 is due \\(fill count {L}\\) with a window the flush has not folded",
                     check_idx=True)
    pool.w[3, 2] = 0.0                                   # folded: every weight 0 and no decay
    if pool.gate == "kda":
        pool.pcum[3, 2] = 0.0
    else:
        pool.p[3, 2] = 1.0
    lq.step_inplace(pool, args["idx"], args["qkv"], args["a"], args["b"], args["A_log"], args["dt_bias"],
                    args["out"], check_idx=True)


def test_a_fill_count_outside_the_window_is_caught_by_the_idx_checks(pool):
    """A fill count outside [0, L] would be read as the nearest end of the range (a count below 0 as an empty window,
    whose live entries the step then overwrites): the host-synchronising checks name the program."""
    pool.hcnt[[1, 3]] = 3
    pool.hcnt[1, 0] = -1
    _expect_rejected(pool, r"hcnt: slot 1, head 0 has fill count -1, outside \[0, 16\]", check_idx=True)
    pool.hcnt[1, 0] = L + 1
    _expect_rejected(pool, r"hcnt: slot 1, head 0 has fill count 17, outside \[0, 16\]", check_idx=True)


def test_not_a_pool():
    args = good_args("kda")
    with pytest.raises(ValueError, match="pool: expected a leapquant.Pool"):
        lq.step_inplace(object(), args["idx"], args["qkv"], args["a"], args["b"], args["A_log"], args["dt_bias"])


def test_validation_reads_no_values(pool, monkeypatch):
    """Without check_idx the call reads no idx value on the host in its checks (the reference backend itself
    synchronises, as for the flush)."""
    from leapquant import validate

    def host_read(*a, **k):
        raise AssertionError("idx values were read on the host without check_idx")
    monkeypatch.setattr(validate, "check_idx_values", host_read)
    args = good_args(pool.gate)
    lq.step_inplace(pool, torch.tensor([1, 7, -1], dtype=torch.int32), args["qkv"], args["a"], args["b"],
                    args["A_log"], args["dt_bias"], args["out"])
    assert not bool(args["out"][1:].any())


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_functional_form_names_the_bad_argument(gate):
    case = sf.make_step_case(1, 4, gate, seed=1, families=["random"], num_k_heads=2 if gate == "gdn" else None)
    fn = lq.step if gate == "kda" else lq.step_gdn
    names = ("codes", "s_k", "s_v", "u", "q", "kbuf", "ubuf") + (("gbuf", "w", "pcum") if gate == "kda"
                                                                  else ("w", "p")) + (
        "h", "qx", "kx", "vx", "a", "b", "A_log", "dt_bias")
    args = list(case.args())
    pos = {n: i for i, n in enumerate(names)}
    for name, bad, match in [
        ("s_k", lambda t: t.double(), "s_k: expected dtype torch.float32"),
        ("h", lambda t: t.long(), "h: expected dtype torch.int32"),
        ("h", lambda t: t + L + 1, r"h: expected fill counts in \[0, 16\]"),
        ("vx", lambda t: t[..., :8], r"vx: expected shape \(B, H, V\)"),
        ("kx", lambda t: t[:, :1] if gate == "gdn" else t.float(), "kx: expected"),
        ("qx", lambda t: t[0], "qx: expected a bf16 tensor"),
        ("dt_bias", lambda t: t[..., :1], "dt_bias: expected shape"),
        ("w", lambda t: t.clamp_min(0) + 2.0, r"w: values must be finite and in \[0, 1\]"),
    ]:
        bad_args = list(args)
        bad_args[pos[name]] = bad(args[pos[name]])
        with pytest.raises(ValueError, match=match):
            fn(*bad_args)
    if gate == "gdn":
        with pytest.raises(ValueError, match="num_k_heads: 4 disagrees with qx: its shape"):
            fn(*args, num_k_heads=4)
    with pytest.raises(ValueError, match="beta_bf16: expected a bool"):
        fn(*args, beta_bf16=None)
    with pytest.raises(ValueError, match="codes: expected a tensor with data, got one on the meta device"):
        fn(*[x.to("meta") for x in args])


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_functional_form_takes_any_layout(gate):
    """The functional step takes a, b, A_log and dt_bias in any layout (strided, expanded), as its other inputs: the
    same results as contiguous copies give."""
    case = sf.make_step_case(2, 4, gate, seed=3, families=["random"], num_k_heads=2 if gate == "gdn" else None)
    fn = lq.step if gate == "kda" else lq.step_gdn
    args = list(case.args())
    a, b, A_log, dt_bias = args[-4:]
    odd = [torch.stack([a, a], -1)[..., 0], b.t().contiguous().t(), A_log[:1].expand_as(A_log),
           dt_bias[..., :1].expand_as(dt_bias)]
    same = [x.contiguous() for x in odd]
    for got, ref in zip(fn(*args[:-4], *odd), fn(*args[:-4], *same)):
        assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))


# ---- the life-cycle helpers ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("call, match", [
    (lambda p: p.reset_slots([0]), r"slots: expected values in \[1, 5\)"),
    (lambda p: p.reset_slots([1, 1]), "slots: slot 1 appears more than once"),
    (lambda p: p.reset_slots([1.0]), "slots: expected integer slot numbers"),
    (lambda p: p.reset_slots(3), "slots: expected a list"),
    (lambda p: p.copy_slots([1, 2], [3]), r"dst: expected as many slots as src \(2\), got 1"),
    (lambda p: p.copy_slots([1, 5], [2, 3]), r"src: expected values in \[1, 5\)"),
    (lambda p: p.copy_slots([1, 2], [3, 3]), "dst: slot 3 appears more than once"),
    (lambda p: p.copy_slots([1], [torch.tensor(0.5)]), "dst: expected integer slot numbers"),
    (lambda p: p.copy_slots(torch.tensor([[1]]), [2]), "src: expected a 1-D tensor"),
])
def test_life_cycle_helpers_check_before_writing(pool, call, match):
    before = snapshot(pool)
    with pytest.raises(ValueError, match=match):
        call(pool)
    after = snapshot(pool)
    for name in before:
        assert torch.equal(before[name], after[name]), f"{name} changed by a rejected call"


# ---- the dispatch's step op ------------------------------------------------------------------------------------------
@pytest.fixture
def fresh_choices(monkeypatch):
    monkeypatch.setattr(dispatch, "_CHOSEN", {})


def test_step_reasons_and_forcing(pool, fresh_choices):
    """The reference serves the step; a backend without a step kernel says so (and still serves the flush where it
    can), and forcing it for the step raises with that reason, before anything is written."""
    assert dispatch.reasons("reference", pool, op="step") == []
    for name in ("triton", "tilelang"):
        b = dispatch.get_backend(name)
        if b is not None and b.step is None:
            assert any("has no step kernel" in r for r in dispatch.reasons(name, pool, op="step"))
    assert dispatch.reasons("reference", pool) == dispatch.reasons("reference", pool, op="flush") == []
    for name in ("triton", "tilelang"):
        b = dispatch.get_backend(name)
        if b is None or b.step is not None:
            continue
        args = good_args(pool.gate)
        before = snapshot(pool)
        with pytest.raises(lq.BackendUnavailable, match=f"(?s)'{name}' was forced but cannot serve the step op.*"
                                                       "has no step kernel"):
            lq.step_inplace(pool, args["idx"], args["qkv"], args["a"], args["b"], args["A_log"], args["dt_bias"],
                            backend=name)
        assert all(torch.equal(before[n], t) for n, t in snapshot(pool).items())
    with pytest.raises(ValueError, match="unknown op 'decode'"):
        dispatch.select(pool, 2, op="decode")
    with pytest.raises(ValueError, match="unknown op"):
        dispatch.reasons("reference", pool, op="decode")


def test_step_auto_choice(pool, fresh_choices, monkeypatch):
    """auto picks the reference for the step on a CPU; a registered backend with a step kernel is chosen by the
    step's order where it serves, while the flush's choice is separate (cached per op)."""
    assert dispatch.auto_order(pool, 2, op="step") == ["reference"]
    assert dispatch.select(pool, 2, backend="auto", op="step").name == "reference"
    ran = []
    fake = dispatch.Backend("tilelang", flush=lambda *a: None, reasons=lambda p: [],
                            step=lambda *a: ran.append("step"))
    monkeypatch.setitem(dispatch._REGISTRY, "tilelang", fake)
    monkeypatch.setattr(dispatch, "auto_order", lambda p, n, op="flush": ["tilelang", "reference"] if op == "step"
                        else ["reference"])
    monkeypatch.setattr(dispatch, "_CHOSEN", {})
    assert dispatch.select(pool, 2, backend="auto", op="step") is fake
    assert dispatch.select(pool, 2, backend="auto").name == "reference"
    args = good_args(pool.gate)
    lq.step_inplace(pool, args["idx"], args["qkv"], args["a"], args["b"], args["A_log"], args["dt_bias"],
                    args["out"], backend="tilelang")
    assert ran == ["step"]
    fake.step_reasons = lambda p: ["fake: no step for this geometry"]
    monkeypatch.setattr(dispatch, "_CHOSEN", {})
    assert dispatch.reasons("tilelang", pool, op="step") == ["fake: no step for this geometry"]
    assert dispatch.reasons("tilelang", pool) == []
    assert dispatch.select(pool, 2, backend="auto", op="step").name == "reference"


def test_backend_info_per_op():
    rows = {r["name"]: r for r in lq.backend_info("cpu", num_heads=4, op="step")}
    assert rows["reference"]["available"] and rows["reference"]["auto_rank"] == 1
    assert not rows["tilelang"]["available"] and rows["tilelang"]["reasons"]       # no step kernel (and no CUDA)
    from leapquant.triton.launch import INTERPRETED
    assert rows["triton"]["available"] == INTERPRETED                               # the interpreter runs its step
