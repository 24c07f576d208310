"""Bad input raises a ValueError naming the argument, before any launch, and leaves the pool untouched."""
from __future__ import annotations

import pytest
import torch

import leapquant as lq
from leapquant import families
from helpers import fill_noise, snapshot


@pytest.fixture(params=["kda", "gdn"])
def pool(request):
    p = lq.Pool(4, 3, gate=request.param)
    fill_noise(p)
    p.hcnt.fill_(lq.L)
    return p


def _expect_rejected(pool, idx, q0, match, **kw):
    before = snapshot(pool)
    with pytest.raises(ValueError, match=match):
        lq.flush_inplace(pool, idx, q0, **kw)
    after = snapshot(pool)
    for name in before:
        assert torch.equal(before[name], after[name]), f"{name} changed by a rejected call"


IDX = torch.tensor([1, 2], dtype=torch.int32)


@pytest.mark.parametrize("idx, match", [
    (torch.tensor([1, 2], dtype=torch.int64), "idx: expected dtype torch.int32"),
    (torch.tensor([[1, 2]], dtype=torch.int32), "idx: expected a 1-D tensor"),
    (torch.tensor([1, 0, 2, 0], dtype=torch.int32)[::2], "idx: expected a contiguous tensor"),
    (torch.tensor([1, 2], dtype=torch.int32, device="meta"), "idx: expected device cpu"),
    ([1, 2], "idx: expected a torch.Tensor"),
])
def test_bad_idx(pool, idx, match):
    _expect_rejected(pool, idx, lq.default_q0(), match)


@pytest.mark.parametrize("idx, match", [
    (torch.tensor([1, 4], dtype=torch.int32), r"idx: slots must be < num_slots = 4"),
    (torch.tensor([2, 0, 2], dtype=torch.int32), "idx: a slot appears more than once"),
    (torch.tensor([-1, 3, -1, 3], dtype=torch.int32), "idx: a slot appears more than once"),
])
def test_bad_idx_values_when_checked(pool, idx, match, monkeypatch):
    """The host-synchronising value checks run with check_idx=True, or with LEAPQUANT_CHECK_IDX set."""
    _expect_rejected(pool, idx, lq.default_q0(), match, check_idx=True)
    from leapquant import validate
    monkeypatch.setattr(validate, "CHECK_IDX", True)
    _expect_rejected(pool, idx, lq.default_q0(), match)
    _expect_rejected(pool, idx, lq.default_q0(), match, check_idx=True)


@pytest.mark.parametrize("count", [-1, lq.L + 1, 2 ** 31 - 1])
def test_fill_count_outside_the_window_when_checked(pool, count):
    """A fill count outside [0, L] (an engine's own hcnt buffer never initialised) is named by the value checks,
    among the programs of idx's slots only."""
    pool.hcnt[2, 1] = count
    _expect_rejected(pool, IDX, lq.default_q0(), rf"hcnt: slot 2, head 1 has fill count {count}, outside \[0, {lq.L}\]",
                     check_idx=True)
    lq.flush_inplace(pool, torch.tensor([1, -1, 3], dtype=torch.int32), lq.default_q0(), check_idx=True)


@pytest.mark.parametrize("text, checked", [("1", True), (" On ", True), ("YES", True), ("", False), ("off", False),
                                           ("0", False), ("2", None), ("enable", None)])
def test_the_idx_switch_names_a_value_it_does_not_know(pool, monkeypatch, text, checked):
    """LEAPQUANT_CHECK_IDX: a value that is neither on nor off makes the first call that reads the switch raise,
    before any write (a typo would otherwise turn the debugging checks off without a word); check_idx given to the
    call overrides the switch."""
    from leapquant import validate
    value = validate.switch_value(text)
    assert value is checked if checked is not None else value == text
    monkeypatch.setattr(validate, "CHECK_IDX", value)
    twice = torch.tensor([2, 2], dtype=torch.int32)
    if checked is None:
        _expect_rejected(pool, twice, lq.default_q0(), f"LEAPQUANT_CHECK_IDX: expected one of .* got {text!r}")
    elif checked:
        _expect_rejected(pool, twice, lq.default_q0(), "idx: a slot appears more than once")
    lq.flush_inplace(pool, IDX, lq.default_q0(), check_idx=False)


def test_idx_values_unchecked_by_default(pool, monkeypatch):
    """Without the debug switch the call reads no idx value on the host: rows whose slot is <= 0 (vLLM pads with -1,
    SGLang with 0) or >= num_slots are skipped by the backend; only the valid rows' due programs change."""
    from leapquant import validate

    def host_read(*a, **k):
        raise AssertionError("idx values were read on the host without check_idx")
    monkeypatch.setattr(validate, "check_idx_values", host_read)
    before = snapshot(pool)
    lq.flush_inplace(pool, torch.tensor([-1, 2, 0, 7, -5], dtype=torch.int32), lq.default_q0())
    after = snapshot(pool)
    changed = (before["raw"] != after["raw"]).nonzero().flatten() // 4            # fp32 words
    slots = torch.unique((changed - lq.OFF) // pool.slot_stride)
    assert slots.tolist() == [2], f"slots written: {slots.tolist()}"
    assert torch.equal(before["hcnt"], after["hcnt"])


def test_negative_idx_is_no_sequence_when_checked(pool):
    """idx <= 0 is "no sequence" for the value checks too: -1 padding passes them."""
    lq.flush_inplace(pool, torch.tensor([-1, 1, -1, 0], dtype=torch.int32), lq.default_q0(), check_idx=True)
    assert bool((pool.w[1] == 0).all()) and not bool((pool.w[2] == 0).all())


@pytest.mark.parametrize("q0, match", [
    (torch.randn(lq.V, lq.R, dtype=torch.float64), "q0: expected dtype torch.float32"),
    (torch.randn(lq.V, lq.R + 1), r"q0: expected shape \(128, 4\)"),
    (torch.randn(lq.R, lq.V).t(), "q0: expected a contiguous tensor"),
])
def test_bad_q0(pool, q0, match):
    _expect_rejected(pool, IDX, q0, match)


@pytest.mark.parametrize("field, bad, match", [
    ("w", lambda t: t.double(), "pool.w: expected dtype torch.float32"),
    ("kbuf", lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2), "pool.kbuf: expected a contiguous"),
    ("ubuf", lambda t: t[:, :2], r"pool.ubuf: expected shape"),
    ("hcnt", lambda t: t.long(), "pool.hcnt: expected dtype torch.int32"),
])
@pytest.mark.parametrize("checked_before", [False, True])
def test_swapped_pool_buffers(pool, field, bad, match, checked_before):
    """A buffer replaced by the caller is re-checked, also after the pool passed its checks once (they are cached per
    set of buffers)."""
    if checked_before:
        lq.flush_inplace(pool, IDX, lq.default_q0())
    setattr(pool, field, bad(getattr(pool, field)))
    with pytest.raises(ValueError, match=match):
        lq.flush_inplace(pool, IDX, lq.default_q0())


def test_gate_specific_buffers(pool):
    if pool.gate == "kda":
        pool.gbuf = pool.gbuf.to(torch.bfloat16)
        match = "pool.gbuf: expected dtype torch.float16"
    else:
        pool.p = pool.p[:, :1]
        match = "pool.p: expected shape"
    with pytest.raises(ValueError, match=match):
        lq.flush_inplace(pool, IDX, lq.default_q0())


def test_not_a_pool_and_mismatched_geometry(pool):
    from leapquant.validate import check_pool
    with pytest.raises(ValueError, match="pool: expected a leapquant.Pool"):
        lq.flush_inplace(object(), IDX, lq.default_q0())
    with pytest.raises(ValueError, match="pool: num_heads mismatch"):
        check_pool(pool, num_heads=32)
    with pytest.raises(ValueError, match="pool: gate mismatch"):
        check_pool(pool, gate="gdn" if pool.gate == "kda" else "kda")


def test_caller_owned_buffers_are_checked():
    with pytest.raises(ValueError, match="raw: expected shape"):
        lq.Pool(4, 2, raw=torch.zeros(10))
    with pytest.raises(ValueError, match="unknown buffers for gate 'gdn'"):
        lq.Pool(4, 2, gate="gdn", pcum=torch.zeros(4, 2, lq.K))
    with pytest.raises(ValueError, match="gate: expected one of"):
        lq.Pool(4, 2, gate="mamba")
    with pytest.raises(ValueError, match="num_slots"):
        lq.Pool(1, 2)
    raw = torch.zeros(4 * 3 * lq.V * lq.K + lq.OFF)
    p = lq.Pool(4, 2, raw=raw)
    assert p.raw is raw and p.codes.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_functional_form_names_the_bad_argument(gate):
    case = families.make_case(1, 2, gate, families=["random"])
    args = list(case.args())
    fn = lq.run if gate == "kda" else lq.run_gdn
    bad = list(args)
    bad[1] = args[1].double()
    with pytest.raises(ValueError, match="s_k: expected dtype torch.float32"):
        fn(*bad)
    bad = list(args)
    bad[5] = args[5][:, :, :8]
    with pytest.raises(ValueError, match=r"kbuf: expected shape \(1, 2, 16, 128\)"):
        fn(*bad)
    bad = list(args)
    bad[-1] = args[-1][:, :3]
    with pytest.raises(ValueError, match="q0: expected shape"):
        fn(*bad)
    bad = list(args)
    bad[-1] = torch.full_like(args[-1], float("nan"))               # an uninitialised start matrix, say
    with pytest.raises(ValueError, match="q0: values must be finite"):
        fn(*bad)
    for q0, match in [(torch.zeros_like(args[-1]), "q0: its columns' norms must lie in"),       # a buffer never set
                      (args[-1] * 1e19, "q0: its columns' norms must lie in"),
                      (args[-1][:, [0, 0, 1, 2]], "q0: its columns must be independent")]:
        bad = list(args)
        bad[-1] = q0.contiguous()
        with pytest.raises(ValueError, match=match):
            fn(*bad)
    bad = [x.to("meta") for x in args]
    with pytest.raises(ValueError, match="codes: expected a tensor with data, got one on the meta device"):
        fn(*bad)
