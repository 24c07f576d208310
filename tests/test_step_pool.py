"""The decode step on a caller's pool (step_inplace) and the pool's life cycle (reset_slots, copy_slots).

* Footprint: only entry h of kbuf / ubuf (/ gbuf), w[h] (GDN: the live weights too), pcum or p and hcnt of the
  stepped programs change, and ``out``; rows without a sequence get a zero output and change nothing; the checkpoint
  is only read. The expected bytes come from a row-by-row use of the functional reference, independent of the
  vectorised reference backend.
* Step then flush: L steps fill a window, the program is due, the flush folds it; the decoded state and every output
  are compared with the fp64 dense recurrence of the same tokens.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

import leapquant as lq
from leapquant import reference as ref, step_families as sf
from leapquant.layout import CHECKPOINT_BYTES, EPS, K, L, OFF, REGION_WORDS, V
from helpers import checkpoint_byte_mask, fill_noise, snapshot

NS, H = 7, 4
gates = st.sampled_from(["kda", "gdn"])


def _clone(pool: lq.Pool) -> lq.Pool:
    bufs = {name: t.clone() for name, t in dict(raw=pool.raw, **pool.window_tensors()).items()}
    return lq.Pool(pool.num_slots, pool.num_heads, device=pool.device, gate=pool.gate, **bufs)


def _token_rows(N: int, gate: str, hk: int, g: torch.Generator):
    """qkv bf16 [N, 2 hk K + H V], a, b, A_log, dt_bias for N rows of an H-head pool."""
    qkv = torch.randn(N, 2 * hk * K + H * V, generator=g).bfloat16()
    a = torch.randn((N, H, K) if gate == "kda" else (N, H), generator=g).bfloat16()
    b = (2 * torch.randn(N, H, generator=g)).bfloat16()
    A_log, dt_bias = sf.head_constants(H, gate, g)
    return qkv, a, b, A_log, dt_bias


def expected_after_step(pool: lq.Pool, idx, qkv, a, b, A_log, dt_bias, hk, beta_bf16):
    """A copy of ``pool`` stepped row by row with the functional reference (step_reference on one row's [1, H]
    inputs), and the expected out [N, H, V]."""
    exp = _clone(pool)
    out = torch.zeros(idx.numel(), H, V, dtype=torch.bfloat16)
    for r, slot in enumerate(idx.tolist()):
        if not 1 <= slot < pool.num_slots:
            continue
        ck = exp.read_checkpoint([slot])
        hc = exp.hcnt[slot:slot + 1].clone()
        h = torch.where(hc == L, 0, hc).long()
        tok = qkv[r]
        qx, kx = tok[:hk * K].reshape(1, hk, K), tok[hk * K:2 * hk * K].reshape(1, hk, K)
        vx = tok[2 * hk * K:].reshape(1, H, V)
        gate = (dict(gbuf=exp.gbuf[slot:slot + 1], pcum=exp.pcum[slot:slot + 1]) if pool.gate == "kda"
                else dict(p=exp.p[slot:slot + 1]))
        res = ref.step_reference(*ck, exp.kbuf[slot:slot + 1], exp.ubuf[slot:slot + 1], exp.w[slot:slot + 1], hc,
                                 qx, kx, vx, a[r:r + 1], b[r:r + 1], A_log, dt_bias, **gate, beta_bf16=beta_bf16)
        hd = torch.arange(H)
        exp.kbuf[slot, hd, h[0]] = res[1][0]
        exp.ubuf[slot, hd, h[0]] = res[2][0]
        if pool.gate == "kda":
            exp.gbuf[slot, hd, h[0]] = res[3][0]
            exp.w[slot] = res[4][0]
            exp.pcum[slot] = res[5][0]
        else:
            exp.w[slot] = res[3][0]
            exp.p[slot] = res[4][0]
        exp.hcnt[slot] = (h[0] + 1).to(torch.int32)
        out[r] = res[0][0]
    return exp, out


def assert_pools_equal(pool: lq.Pool, exp: lq.Pool) -> None:
    got, want = snapshot(pool), snapshot(exp)
    for name in want:
        diff = got[name] != want[name]
        assert not bool(diff.any()), f"{name}: {int(diff.sum())} bytes differ from the expected step"


def _noisy_step_pool(gate: str, seed: int, hk: int | None) -> lq.Pool:
    """Noise everywhere (any stray write shows), step-family data in slots 2, 3, 5."""
    pool = lq.Pool(NS, H, gate=gate)
    fill_noise(pool, seed=seed)
    sf.make_step_case(3, H, gate, seed=seed, num_k_heads=hk).load_into(pool, [2, 3, 5])
    return pool


@given(gate=gates, seed=st.integers(0, 2**16), hk_draw=st.sampled_from([1, 2, 4]), beta_bf16=st.booleans())
def test_step_inplace_footprint(gate, seed, hk_draw, beta_bf16):
    """Rows 3, (pad 0), 2, 5, (pad -1), 6 (noise, fill count anything in [0, L]); slots 1, 4 and 0 not stepped.
    Every byte of the pool matches the row-by-row expectation (the checkpoints only read), out's padding rows are
    zero."""
    hk = H if gate == "kda" else hk_draw
    pool = _noisy_step_pool(gate, seed, hk)
    g = torch.Generator().manual_seed(seed)
    idx = torch.tensor([3, 0, 2, 5, -1, 6], dtype=torch.int32)
    qkv, a, b, A_log, dt_bias = _token_rows(idx.numel(), gate, hk, g)
    exp, exp_out = expected_after_step(pool, idx, qkv, a, b, A_log, dt_bias, hk, beta_bf16)
    raw_before = pool.raw.clone().view(torch.int32)
    out = torch.full((idx.numel(), H, V), float("nan"), dtype=torch.bfloat16)
    got = lq.step_inplace(pool, idx, qkv, a, b, A_log, dt_bias, out, num_k_heads=hk if hk_draw != 4 else None,
                          beta_bf16=beta_bf16)
    assert got is out
    assert torch.equal(pool.raw.view(torch.int32), raw_before), "the step wrote into the checkpoints' buffer"
    assert_pools_equal(pool, exp)
    assert torch.equal(out.view(torch.int16), exp_out.view(torch.int16))
    assert not bool(out[[1, 4]].any())


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_rows_without_a_sequence_change_nothing(gate):
    """Only padding (0, -1, any negative) and, through the backend's own call (unchecked values, as under graph
    capture), slots >= num_slots: zero outputs, every byte of the pool as it was."""
    pool = _noisy_step_pool(gate, 3, None)
    before = snapshot(pool)
    g = torch.Generator().manual_seed(0)
    idx = torch.tensor([0, -1, 0, -7], dtype=torch.int32)
    qkv, a, b, A_log, dt_bias = _token_rows(4, gate, H, g)
    out = lq.step_inplace(pool, idx, qkv, a, b, A_log, dt_bias)
    assert out.shape == (4, H, V) and out.dtype == torch.bfloat16 and not bool(out.any())
    bad = torch.tensor([0, -1, NS, NS + 100, -(2**31)], dtype=torch.int32)
    qkv, a, b, _, _ = _token_rows(5, gate, H, g)
    out = torch.full((5, H, V), 1.0, dtype=torch.bfloat16)
    lq.dispatch.get_backend("reference").step(pool, bad, qkv, a, b, A_log, dt_bias, out, H, True)
    assert not bool(out.any())
    after = snapshot(pool)
    for name in before:
        assert torch.equal(before[name], after[name]), name


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_strided_rows(gate):
    """qkv, a and b as slices of wider rows (an engine's projection output) give the same step as dense copies."""
    hk = H if gate == "kda" else 2
    g = torch.Generator().manual_seed(1)
    qkv, a, b, A_log, dt_bias = _token_rows(3, gate, hk, g)
    qkv_view = torch.randn(3, qkv.shape[1] + 40, generator=g).bfloat16()[:, 8:8 + qkv.shape[1]]
    # a: KDA rows of H + 1 heads (the first H used), GDN rows of H + 3 gates (an offset slice)
    a_view = (torch.randn(3, H + 1, K, generator=g).bfloat16()[:, :H] if gate == "kda"
              else torch.randn(3, H + 3, generator=g).bfloat16()[:, 2:2 + H])
    b_view = torch.randn(3, 2 * H, generator=g).bfloat16()[:, H:]
    for view, dense in ((qkv_view, qkv), (a_view, a), (b_view, b)):
        view.copy_(dense)
    idx = torch.tensor([2, 3, 5], dtype=torch.int32)
    p1, p2 = _noisy_step_pool(gate, 4, hk), _noisy_step_pool(gate, 4, hk)
    o1 = lq.step_inplace(p1, idx, qkv, a, b, A_log, dt_bias, num_k_heads=hk)
    o2 = lq.step_inplace(p2, idx, qkv_view, a_view, b_view, A_log, dt_bias, num_k_heads=hk)
    assert not (qkv_view.is_contiguous() or a_view.is_contiguous() or b_view.is_contiguous())
    assert torch.equal(o1, o2)
    assert_pools_equal(p1, p2)


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_just_flushed_reads_as_empty(gate):
    """A fill count of L ("just flushed, empty") appends entry 0 and leaves hcnt = 1; the flush's stale keys are
    overwritten only at entry 0 and ignored elsewhere."""
    pool = lq.Pool(3, H, gate=gate)
    case = sf.make_step_case(1, H, gate, seed=2, families=["just_flushed"])
    case.load_into(pool, [1])
    assert bool((pool.hcnt[1] == L).all())
    idx = torch.tensor([1], dtype=torch.int32)
    out = lq.step_inplace(pool, idx, case.qkv(), case.tensors["a"], case.tensors["b"], case.tensors["A_log"],
                          case.tensors["dt_bias"])
    ref_out = case.reference()
    assert torch.equal(out, ref_out[0])
    assert bool((pool.hcnt[1] == 1).all())
    assert torch.equal(pool.kbuf[1, :, 0], ref_out[1][0]) and bool((pool.w[1, :, 0] == 1).all())
    assert torch.equal(pool.kbuf[1, :, 1:], case.tensors["kbuf"][0, :, 1:])


# ---- step then flush: the fp64 dense recurrence ---------------------------------------------------------------------
def dense_recurrence(S: torch.Tensor, tokens: list[dict], A_log, dt_bias, gate: str, beta_bf16: bool = True):
    """The gated delta rule in fp64 on dense states S [n, H, V, K]: per token decay, u = beta (v - S kn),
    o = S qn + (kn . qn) u, S += u kn^T. Returns (final S, outputs [T, n, H, V])."""
    outs = []
    for tok in tokens:
        kn = ref.l2_normalise(ref.expand_key_heads(tok["kx"], H), torch.float64)
        qn = ref.l2_normalise(ref.expand_key_heads(tok["qx"], H), torch.float64) * K ** -0.5
        g = ref.log_gate(tok["a"], A_log, dt_bias, torch.float64)
        S = S * (torch.exp(g).unsqueeze(-2) if gate == "kda" else torch.exp(g)[..., None, None])
        u, o = ref.delta_rule(S, kn, qn, tok["vx"], ref.step_beta(tok["b"], beta_bf16, torch.float64))
        S = S + u.unsqueeze(-1) * kn.unsqueeze(-2)
        outs.append(o)
    return S, torch.stack(outs)


def _new_sequences(gate: str, noise_seed: int) -> tuple[int, lq.Pool, list[int]]:
    """(key heads, a pool of 4 slots filled with noise, slots [1, 3] reset for two new sequences)."""
    pool = lq.Pool(4, H, gate=gate)
    fill_noise(pool, seed=noise_seed)
    slots = [1, 3]
    pool.reset_slots(slots)
    return (H if gate == "kda" else 2), pool, slots


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_steps_then_flush_match_the_dense_recurrence(gate):
    """A new sequence (reset_slots, then a prefill's encode) takes L steps: after them the programs are due, and the
    flush folds the window. Against the fp64 dense recurrence of the same tokens from the encoded checkpoint:
    each step's output within 1 % (relative L2 over the program; bf16 outputs and window entries, fp16 decays), the
    state before the flush (checkpoint + window) within the window's rounding, and after the flush within the format's
    own error on that state plus the window's (the fp32 reference's compression of the exact state, x 1.5)."""
    hk, pool, slots = _new_sequences(gate, noise_seed=7)
    g = torch.Generator().manual_seed(11)
    a_ = torch.randn(2, H, V, 4, generator=g)
    prefill = (a_ @ torch.randn(2, H, 4, K, generator=g)) * 0.05 + 0.01 * torch.randn(2, H, V, K, generator=g)
    pool.encode(slots, prefill)
    S = pool.decode(slots, with_window=False).double()
    idx = torch.tensor([3, -1, 1], dtype=torch.int32)
    A_log, dt_bias = sf.head_constants(H, gate, g)
    tokens, outs = [], []
    for t in range(L):
        assert bool((pool.hcnt[slots] == t).all())
        qkv, a, b, _, _ = _token_rows(3, gate, hk, g)
        out = lq.step_inplace(pool, idx, qkv, a, b, A_log, dt_bias, num_k_heads=hk)
        rows = [2, 0]                                      # idx rows of slots 1 and 3
        tokens.append(dict(qx=qkv[rows, :hk * K].reshape(2, hk, K), kx=qkv[rows, hk * K:2 * hk * K].reshape(2, hk, K),
                           vx=qkv[rows, 2 * hk * K:].reshape(2, H, V), a=a[rows], b=b[rows]))
        outs.append(out[rows].double())
    assert bool((pool.hcnt[slots] == L).all())             # due
    S_dense, o_dense = dense_recurrence(S, tokens, A_log, dt_bias, gate)
    o_err = (torch.stack(outs) - o_dense).norm(dim=-1) / o_dense.norm(dim=-1)
    assert float(o_err.max()) < 1e-2, float(o_err.max())
    scale = S_dense.abs().mean(dim=(-1, -2))
    window_err = (pool.decode(slots).double() - S_dense).abs().mean(dim=(-1, -2))
    assert float((window_err / scale).max()) < 5e-3, float((window_err / scale).max())
    before = snapshot(pool)
    lq.flush_inplace(pool, idx, lq.default_q0())
    after = snapshot(pool)
    assert torch.equal(before["hcnt"], after["hcnt"])
    assert bool((pool.w[slots] == 0).all())
    flushed_err = (pool.decode(slots).double() - S_dense).abs().mean(dim=(-1, -2))
    fmt = ref.compress(S_dense.float(), lq.default_q0())
    format_err = (ref.decode_checkpoint(*fmt).double() - S_dense).abs().mean(dim=(-1, -2))
    assert bool((flushed_err <= 1.5 * format_err + window_err).all()), (flushed_err / format_err)
    # the next step reads the flushed window as empty: entry 0 again
    qkv, a, b, _, _ = _token_rows(3, gate, hk, g)
    lq.step_inplace(pool, idx, qkv, a, b, A_log, dt_bias, num_k_heads=hk)
    assert bool((pool.hcnt[slots] == 1).all())


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_offload_and_restore_mid_window(gate):
    """An engine offloads a sequence in the middle of a window (read_checkpoint + read_window) and restores it into
    another pool's slot (write_checkpoint + write_window with the fill counts read): the next decode tokens are bitwise
    those of the sequence that stayed, and so is the slot."""
    hk, pool, slots = _new_sequences(gate, noise_seed=9)
    g = torch.Generator().manual_seed(21)
    pool.encode(slots, 0.05 * torch.randn(2, H, V, K, generator=g))
    q0 = lq.default_q0()
    idx = torch.tensor([1, 3], dtype=torch.int32)
    A_log, dt_bias = sf.head_constants(H, gate, g)
    for _ in range(5):
        lq.decode_inplace(pool, idx, *_token_rows(2, gate, hk, g)[:3], A_log, dt_bias, q0, num_k_heads=hk)
    checkpoint, window = pool.read_checkpoint([3]), pool.read_window([3])
    assert bool((window[-1] == 5).all()) and (window[4] is None) == (gate == "gdn")
    other = lq.Pool(3, H, gate=gate)
    fill_noise(other, seed=2)
    other.write_checkpoint([2], *checkpoint)
    kbuf, ubuf, w, gate_state, gbuf, fill = window
    other.write_window([2], kbuf, ubuf, w, gate_state, gbuf, fill=fill)
    for _ in range(L):                                    # across the flush the window's fill makes due
        qkv, a, b, _, _ = _token_rows(2, gate, hk, g)
        out = lq.decode_inplace(pool, idx, qkv, a, b, A_log, dt_bias, q0, num_k_heads=hk)
        out2 = lq.decode_inplace(other, torch.tensor([2], dtype=torch.int32), qkv[1:], a[1:], b[1:], A_log, dt_bias,
                                 q0, num_k_heads=hk)
        assert torch.equal(out[1:], out2)
    for mine, theirs in zip(pool.read_checkpoint([3]) + pool.read_window([3]),
                            other.read_checkpoint([2]) + other.read_window([2])):
        assert (mine is None and theirs is None) or torch.equal(mine, theirs)


def test_saturated_decay_round_trips_through_the_bulk_helpers():
    """A KDA gate pre-activation of +inf saturates g to -inf, and the step stores pcum = -inf on that channel: the
    window read back (read_window) writes into another slot (write_window admits -inf for pcum), the functional step
    takes it, and the next step from either slot is the same."""
    hk, pool, slots = _new_sequences("kda", noise_seed=4)
    g = torch.Generator().manual_seed(8)
    pool.encode(slots, 0.05 * torch.randn(2, H, V, K, generator=g))
    A_log, dt_bias = sf.head_constants(H, "kda", g)
    qkv, a, b, _, _ = _token_rows(1, "kda", hk, g)
    a[0, 1, 5] = float("inf")
    lq.step_inplace(pool, torch.tensor([1], dtype=torch.int32), qkv, a, b, A_log, dt_bias)
    assert float(pool.pcum[1, 1, 5]) == float("-inf") and bool(torch.isfinite(pool.pcum[1, 0]).all())
    pool.write_checkpoint([3], *pool.read_checkpoint([1]))
    kbuf, ubuf, w, pcum, gbuf, fill = pool.read_window([1])
    pool.write_window([3], kbuf, ubuf, w, pcum, gbuf, fill=fill)
    qkv, a, b, _, _ = _token_rows(2, "kda", hk, g)
    qkv[1], a[1], b[1] = qkv[0], a[0], b[0]
    out = lq.step_inplace(pool, torch.tensor([1, 3], dtype=torch.int32), qkv, a, b, A_log, dt_bias)
    assert torch.equal(out[0], out[1]) and bool(torch.isfinite(out.float()).all())
    ck = pool.read_checkpoint([1])
    kbuf, ubuf, w, pcum, gbuf, fill = pool.read_window([1])
    res = lq.step(*ck, kbuf, ubuf, gbuf, w, pcum, fill, qkv[:1, :hk * K].reshape(1, hk, K),
                  qkv[:1, hk * K:2 * hk * K].reshape(1, hk, K), qkv[:1, 2 * hk * K:].reshape(1, H, V), a[:1], b[:1],
                  A_log, dt_bias)
    assert bool(torch.isfinite(res[0].float()).all()) and float(res[-1][0, 1, 5]) == float("-inf")


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_decode_inplace_flushes_the_windows_it_fills(gate):
    """decode_inplace = step, then the flush of the windows that step filled: over 2 L + 3 tokens every stepped
    program is flushed exactly when its fill count reaches L (its window is reset and the next token takes entry 0),
    rows of padding change nothing, and the outputs stay within 1 % of the fp64 dense recurrence (the state crosses
    two flushes)."""
    hk, pool, slots = _new_sequences(gate, noise_seed=5)
    g = torch.Generator().manual_seed(13)
    pool.encode(slots, 0.05 * torch.randn(2, H, V, K, generator=g))
    S = pool.decode(slots, with_window=False).double()
    idx = torch.tensor([3, -1, 1], dtype=torch.int32)
    A_log, dt_bias = sf.head_constants(H, gate, g)
    q0 = lq.default_q0()
    untouched = snapshot(pool)
    tokens, outs = [], []
    for t in range(2 * L + 3):
        qkv, a, b, _, _ = _token_rows(3, gate, hk, g)
        out = lq.decode_inplace(pool, idx, qkv, a, b, A_log, dt_bias, q0, num_k_heads=hk)
        filled = (t + 1) % L == 0
        assert bool((pool.hcnt[slots] == (L if filled else (t + 1) % L)).all())
        if filled:
            assert bool((pool.w[slots] == 0).all()), "the window the step filled was not flushed"
        rows = [2, 0]
        tokens.append(dict(qx=qkv[rows, :hk * K].reshape(2, hk, K), kx=qkv[rows, hk * K:2 * hk * K].reshape(2, hk, K),
                           vx=qkv[rows, 2 * hk * K:].reshape(2, H, V), a=a[rows], b=b[rows]))
        outs.append(out[rows].double())
        assert not bool(out[1].any())
    after = snapshot(pool)
    for name in after:                                    # slots 0 and 2 (not stepped) stay as they were
        if name != "raw":
            assert torch.equal(before_rows(untouched[name], [0, 2]), before_rows(after[name], [0, 2])), name
    _, o_dense = dense_recurrence(S, tokens, A_log, dt_bias, gate)
    o_err = (torch.stack(outs) - o_dense).norm(dim=-1) / o_dense.norm(dim=-1)
    assert float(o_err.max()) < 1e-2, float(o_err.max())


def before_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Rows (slots) of a byte snapshot of a window tensor [NS, ...] (bytes viewed per slot)."""
    return t.reshape(4, -1)[rows]


# ---- the pool's life cycle -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_reset_slots(gate):
    """A reset slot decodes to exactly zero with an empty window (and its checkpoint is the flush's output for a
    zero state, bit for bit); other slots and the bytes past the reset checkpoints are untouched."""
    pool = lq.Pool(5, H, gate=gate)
    fill_noise(pool, seed=2)
    before = snapshot(pool)
    pool.reset_slots([3, 1])
    assert not bool(pool.decode([1, 3]).any())
    assert bool((pool.s_k[[1, 3]] == EPS).all()) and bool((pool.s_v[[1, 3]] == EPS).all())
    zero_ck = ref.compress(torch.zeros(1, 1, V, K), lq.default_q0())
    for x, y in zip(pool.read_checkpoint([1]), zero_ck):
        assert torch.equal(x[0, 0], y[0, 0])
    assert bool((pool.hcnt[[1, 3]] == 0).all()) and not bool(pool.w[[1, 3]].any())
    assert not bool(pool.kbuf[[1, 3]].any()) and not bool(pool.ubuf[[1, 3]].any())
    if gate == "kda":
        assert not bool(pool.pcum[[1, 3]].any()) and bool((pool.gbuf[[1, 3]] == 1).all())
    else:
        assert bool((pool.p[[1, 3]] == 1).all())
    after = snapshot(pool)
    mask = checkpoint_byte_mask(pool, torch.tensor([1] * H + [3] * H), torch.arange(H).repeat(2))
    assert torch.equal(after["raw"][~mask], before["raw"][~mask])
    for name in pool.window_tensors():
        t = getattr(pool, name)
        b = before[name].view(t.dtype).view(t.shape)
        keep = [0, 2, 4]
        assert torch.equal(t[keep].contiguous().view(torch.uint8), b[keep].contiguous().view(torch.uint8)), name


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_copy_slots(gate):
    """A fork (one source into two) and a shift through an overlapping slot (2 -> 3 while 3 -> 4): every destination
    gets its source's checkpoint, window and fill count as they were before the call, byte for byte; nothing else
    moves (the rest of each region included)."""
    pool = lq.Pool(6, H, gate=gate)
    fill_noise(pool, seed=3)
    before = snapshot(pool)
    pool.copy_slots([1, 1, 2, 3], [5, 2, 3, 4])
    after = snapshot(pool)
    raw_b = before["raw"].view(torch.int32)
    raw_a = after["raw"].view(torch.int32)
    ck_words = CHECKPOINT_BYTES // 4
    for src, dst in ((1, 5), (1, 2), (2, 3), (3, 4)):
        for hd in range(H):
            s0 = OFF + src * pool.slot_stride + hd * REGION_WORDS
            d0 = OFF + dst * pool.slot_stride + hd * REGION_WORDS
            assert torch.equal(raw_a[d0:d0 + ck_words], raw_b[s0:s0 + ck_words])
        for name in pool.window_tensors():
            t = getattr(pool, name)
            b = before[name].view(t.dtype).view(t.shape)
            assert torch.equal(t[dst].contiguous().view(torch.uint8), b[src].contiguous().view(torch.uint8)), name
    mask = checkpoint_byte_mask(pool, torch.tensor([d for d in (5, 2, 3, 4) for _ in range(H)]),
                                torch.arange(H).repeat(4))
    assert torch.equal(after["raw"][~mask], before["raw"][~mask])
    for name in pool.window_tensors():
        t = getattr(pool, name)
        b = before[name].view(t.dtype).view(t.shape)
        assert torch.equal(t[[0, 1]].contiguous().view(torch.uint8), b[[0, 1]].contiguous().view(torch.uint8))


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_forked_sequences_step_alike(gate):
    """A forked slot steps exactly as its source does with the same token."""
    pool = _noisy_step_pool(gate, 5, None)
    pool.copy_slots([2], [4])
    g = torch.Generator().manual_seed(3)
    qkv, a, b, A_log, dt_bias = _token_rows(1, gate, H, g)
    qkv, a, b = qkv.repeat(2, 1), a.repeat(2, *[1] * (a.dim() - 1)), b.repeat(2, 1)
    out = lq.step_inplace(pool, torch.tensor([2, 4], dtype=torch.int32), qkv, a, b, A_log, dt_bias)
    assert torch.equal(out[0], out[1])
    for name in pool.window_tensors():
        t = getattr(pool, name)
        assert torch.equal(t[2].contiguous().view(torch.uint8), t[4].contiguous().view(torch.uint8)), name


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_step_program_bytes_counts_the_live_entries(gate):
    """The step's byte count: SPEC section 7's bound reads the whole window (34,894 B KDA, SPEC's 34.1 KiB); at fill h
    a step reads the keys and ubuf rows of entries 0 .. h - 1, KDA's decay factors of entries 1 .. h - 1 and the 16
    weights whole, and GDN writes the weights of entries 0 .. h. The figures the design note and the records quote
    are pinned."""
    from leapquant.layout import step_program_bytes
    pinned = {"kda": {None: 34894, 0: 22606, 1: 23118, 8: 28494, 15: 33870},
              "gdn": {None: 29332, 0: 21080, 1: 21596, 8: 25208, 15: 28820}}[gate]
    for h, n in pinned.items():
        assert step_program_bytes(gate, h) == n, h
    key, value = 2 * K, 2 * V                                     # one entry's kbuf row and ubuf row (bf16)
    for h in range(1, L):
        # one more live entry: its key and ubuf rows, KDA's decay factor row (from h = 2), GDN's written weight
        more = key + value + (2 * K if gate == "kda" and h > 1 else 0) + (4 if gate == "gdn" else 0)
        assert step_program_bytes(gate, h) - step_program_bytes(gate, h - 1) == more, h
    for bad in (-1, L):
        with pytest.raises(ValueError, match="fill"):
            step_program_bytes(gate, bad)
