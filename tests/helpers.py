"""Test helpers shared by every backend's suite: poisoning, byte snapshots of a pool, due-region masks, the programs a
flush writes (due, with a window that is not empty) and pools with empty windows."""
from __future__ import annotations

import math

import torch

from leapquant.layout import CHECKPOINT_BYTES, K, L, OFF, REGION_WORDS, Pool

POISON_CODE = 0x7F  #: a code no flush can write (127 is legal, but a full region of it is not a flush's output)


def snapshot(pool: Pool) -> dict[str, torch.Tensor]:
    """Byte copies of every buffer of the pool (raw and the window tensors)."""
    out = {"raw": pool.raw.detach().cpu().view(torch.uint8).clone()}
    for name, t in pool.window_tensors().items():
        out[name] = t.detach().cpu().contiguous().view(torch.uint8).clone()
    return out


def checkpoint_byte_mask(pool: Pool, slots: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """bool [raw bytes]: the checkpoint bytes of the given (slot, head) programs."""
    mask = torch.zeros(pool.raw.numel() * 4, dtype=torch.bool)
    for s, h in zip(slots.tolist(), heads.tolist()):
        start = 4 * (OFF + s * pool.slot_stride + h * REGION_WORDS)
        mask[start:start + CHECKPOINT_BYTES] = True
    return mask


def poison_due_checkpoints(pool: Pool, slots: torch.Tensor, heads: torch.Tensor) -> None:
    """0x7f codes with scales and tokens that decode to zero in the given (due) programs: finite, because in the
    in-place form the checkpoint is also the flush's input; a flush must leave none of it behind."""
    s, h = slots.to(pool.device), heads.to(pool.device)
    pool.codes[s, h] = POISON_CODE
    pool.s_k[s, h] = 0.0
    pool.s_v[s, h] = 0.0
    pool.tokens[s, h] = 0.0


def fill_noise(pool: Pool, seed: int = 0) -> None:
    """Random bytes everywhere (including outside the checkpoints), then valid-looking scales, so any stray write
    shows in a byte comparison."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(-2**31, 2**31 - 1, (pool.raw.numel(),), generator=g, dtype=torch.int64).to(torch.int32)
    pool.raw.copy_(raw.view(torch.float32).to(pool.device))
    n = pool.num_slots
    pool.s_k.copy_(torch.rand(pool.s_k.shape, generator=g).add_(0.1).to(pool.device))
    pool.s_v.copy_(torch.rand(pool.s_v.shape, generator=g).add_(0.1).to(pool.device))
    pool.tokens.copy_((0.1 * torch.randn(pool.tokens.shape, generator=g)).to(pool.device, torch.float16))
    pool.kbuf.copy_(torch.randn(pool.kbuf.shape, generator=g).to(pool.device, torch.bfloat16))
    pool.ubuf.copy_(torch.randn(pool.ubuf.shape, generator=g).to(pool.device, torch.bfloat16))
    pool.w.copy_(torch.rand(pool.w.shape, generator=g).to(pool.device))
    if pool.gate == "kda":
        pool.pcum.copy_((-5 * torch.rand(pool.pcum.shape, generator=g)).to(pool.device))
        pool.gbuf.copy_(torch.rand(pool.gbuf.shape, generator=g).clamp_min(1e-3).to(pool.device, torch.float16))
    else:
        pool.p.copy_(torch.rand(pool.p.shape, generator=g).clamp_min(1e-3).to(pool.device))
    pool.hcnt.copy_(torch.randint(0, L + 1, (n, pool.num_heads), generator=g, dtype=torch.int32).to(pool.device))


def expected_resets(pool: Pool, before: dict[str, torch.Tensor], slots: torch.Tensor, heads: torch.Tensor
                    ) -> dict[str, torch.Tensor]:
    """The window tensors' bytes after a flush of the given programs: reset there, untouched elsewhere."""
    exp = {}
    for name, t in pool.window_tensors().items():
        val = before[name].clone().view(t.dtype).view(t.shape)
        if len(slots):
            if name == "w" or name == "pcum":
                val[slots, heads] = 0.0
            elif name == "gbuf" or name == "p":
                val[slots, heads] = 1.0
        exp[name] = val.contiguous().view(torch.uint8)
    return exp


def assert_flush_footprint(pool: Pool, before: dict[str, torch.Tensor], slots: torch.Tensor, heads: torch.Tensor,
                           finite: bool = True) -> None:
    """The programs (slots, heads) long [n] (those a flush writes: :func:`written_programs`) have their checkpoints
    rewritten (no poison left; finite unless ``finite`` is False) and their windows reset; every other byte of the pool
    is as it was in ``before`` (:func:`snapshot`), the due programs with an empty window included."""
    after = snapshot(pool)
    mask = checkpoint_byte_mask(pool, slots, heads)
    changed = (after["raw"] != before["raw"]) & ~mask
    if bool(changed.any()):
        first = int(changed.nonzero()[0])
        word = first // 4 - OFF
        raise AssertionError(f"{int(changed.sum())} bytes outside the due checkpoints changed; first at raw byte "
                             f"{first} (slot {word // pool.slot_stride}, region word {word % pool.slot_stride})")
    if len(slots) and finite:
        codes = pool.codes[slots, heads].cpu()
        assert not bool((codes == POISON_CODE).all(dim=(-1, -2)).any()), "a due program's codes were not written"
        for name in ("s_k", "s_v", "tokens"):
            vals = getattr(pool, name)[slots, heads].float().cpu()
            assert bool(torch.isfinite(vals).all()), f"{name}: non-finite values left in due programs (unwritten?)"
    for name, exp in expected_resets(pool, before, slots, heads).items():
        diff = after[name] != exp
        assert not bool(diff.any()), f"{name}: {int(diff.sum())} bytes differ from the expected reset/untouched state"
    assert torch.equal(after["hcnt"], before["hcnt"]), "hcnt changed"


# ---- shared by the kernel suites: the deployment form judged by the criterion ---------------------------------------
def written_programs(pool: Pool, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots, heads) long [n] (CPU) of the programs a flush of ``idx`` must rewrite: due (hcnt == L, slot in
    [1, NS)) with a window that is not empty (leapquant.reference_pool.written_programs, the one definition)."""
    from leapquant import reference_pool
    slots, heads = reference_pool.written_programs(pool, idx)
    return slots.cpu(), heads.cpu()


#: The decay of a window that holds no weight (:func:`empty_windows` with ``decay``). KDA: one channel of pcum at
#: -0.25, every other channel 0 or -0.0, so that a kernel which tests only some channels for a decay shows. GDN: the
#: gate product exp(-2) (sixteen steps of the families' typical gate). Such a flush re-compresses a multiple of a
#: stored checkpoint, so most of the stored tokens and codes come back and the error is set by the few fp16 tokens
#: that round the other way; the criterion's 1 % slack over the fp32 reference then measures that luck. Where the
#: multiple is a power of two (GDN p = 0.5 or 0.25) the re-compression is nearly idempotent:
#: the reference's algorithm in fp64 fails the criterion on 0.39 % of such heads (48 of 12,288), against 2 of 6,144 at
#: p = exp(-2) (0.02 % pooled over p = exp(-2), 0.6, 0.7, 0.8, 0.9); KDA's one-channel decay: 2 of 6,144, as at a GDN
#: p that is not a power of two. Measured over every family by bench/dev/decay_only_luck.py (bench/results/TESTS.md).
DECAY_ONLY_CHANNEL, DECAY_ONLY_PCUM = 7, -0.25
DECAY_ONLY_P = math.exp(-2.0)


def empty_windows(pool: Pool, slots: torch.Tensor, heads: torch.Tensor, decay: bool = False) -> None:
    """Make the windows of programs (slots, heads) long [n] hold no weight: w = 0 (every other entry -0.0, which
    counts as zero). ``decay`` False: no decay either (KDA pcum = 0, every other channel -0.0; GDN p = 1), an empty
    window a flush must leave alone. ``decay`` True: the gate still decays the checkpoint (KDA
    :data:`DECAY_ONLY_PCUM` on channel :data:`DECAY_ONLY_CHANNEL`, GDN :data:`DECAY_ONLY_P`), a window a flush must
    fold. Keys, values and gbuf keep what they hold (noise): a flush that reads them for an empty window, or writes
    them, shows."""
    if not len(slots):
        return
    s, h = slots.to(pool.device), heads.to(pool.device)
    alt = lambda n: torch.tensor([0.0, -0.0] * (n // 2), device=pool.device)  # noqa: E731
    pool.w[s, h] = alt(L).expand(len(slots), L)
    if pool.gate == "kda":
        pcum = alt(K).expand(len(slots), K).clone()
        if decay:
            pcum[:, DECAY_ONLY_CHANNEL] = DECAY_ONLY_PCUM
        pool.pcum[s, h] = pcum
    else:
        pool.p[s, h] = DECAY_ONLY_P if decay else 1.0


def mixed_windows(pool: Pool, idx: torch.Tensor, seed: int) -> None:
    """Of the due programs of ``idx``, about a third get an empty window and a sixth a window that only decays
    (:func:`empty_windows`); the others keep theirs. Programs not due are left as they are."""
    from leapquant import reference_pool
    slots, heads = (t.cpu() for t in reference_pool.due_programs(pool, idx))
    kind = torch.rand(len(slots), generator=torch.Generator().manual_seed(seed))
    empty, decay = kind < 1 / 3, (kind >= 1 / 3) & (kind < 1 / 2)
    empty_windows(pool, slots[empty], heads[empty])
    empty_windows(pool, slots[decay], heads[decay], decay=True)


def program_inputs(pool: Pool, slots: torch.Tensor, heads: torch.Tensor):
    """Copies of the checkpoint, window and gate of programs (slots[i], heads[i]), with a leading [1, n] dim."""
    s, h = slots.to(pool.device), heads.to(pool.device)
    tok = pool.tokens[s, h]
    ck = (pool.codes[s, h], pool.s_k[s, h], pool.s_v[s, h], tok[..., :K], tok[..., K:])
    win = (pool.kbuf[s, h], pool.ubuf[s, h], pool.w[s, h])
    gate = dict(pcum=pool.pcum[s, h], gbuf=pool.gbuf[s, h]) if pool.gate == "kda" else dict(p=pool.p[s, h])
    add = lambda t: t.clone().unsqueeze(0)  # noqa: E731
    return tuple(map(add, ck)), tuple(map(add, win)), {k: add(v) for k, v in gate.items()}


def judge_programs(pool: Pool, slots, heads, inputs, q0, name: str):
    """The criterion's verdict on the checkpoints now at (slots, heads), flushed from ``inputs``."""
    from leapquant import criterion, reference
    ck, win, gate = inputs
    S = criterion.exact_state(*ck, *win, **gate)
    ref = reference.compress(reference.rebuild(*ck, *win, **gate), q0)
    s, h = slots.to(pool.device), heads.to(pool.device)
    tok = pool.tokens[s, h]
    out = tuple(t.unsqueeze(0) for t in (pool.codes[s, h], pool.s_k[s, h], pool.s_v[s, h], tok[..., :K],
                                         tok[..., K:]))
    return criterion.judge(S, out, ref, name=name)


def noisy_pool(gate: str, heads: int, seed: int, device, num_slots: int = 7) -> tuple[Pool, torch.Tensor]:
    """Noise in every byte (so stray writes show), family data in slots 2, 3, 5, a mix of due and not-due programs;
    idx has skipped rows (0) and leaves out slot 4, whose programs are due; slot 0 is marked due and must never be
    flushed."""
    from leapquant import families
    pool = Pool(num_slots, heads, device=device, gate=gate)
    fill_noise(pool, seed=seed)
    families.make_case(3, heads, gate, seed=seed).to(device).load_into(pool, [2, 3, 5])
    g = torch.Generator().manual_seed(seed)
    pool.hcnt[2] = torch.where(torch.rand(heads, generator=g) < 0.5, L, L - 1).to(device, torch.int32)
    pool.hcnt[4] = L
    pool.hcnt[0] = L
    return pool, torch.tensor([3, 0, 2, 5, 0], dtype=torch.int32, device=device)


def check_graph_replay(backend: str, gate: str, heads: int, device) -> None:
    """The call captured once in a CUDA graph and replayed with different hcnt: each replay flushes exactly the
    programs due then (judged by the criterion), and a replay with nothing due changes nothing."""
    import leapquant as lq
    from leapquant import families
    pool = Pool(12, heads, device=device, gate=gate)
    fill_noise(pool, seed=1)
    idx = torch.tensor([3, 0, 7, 1, 11, 5], dtype=torch.int32, device=device)
    q0 = lq.default_q0(device)
    lq.warmup(pool, backend=backend)
    pool.hcnt.zero_()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            lq.flush_inplace(pool, idx, q0, backend=backend)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    none = torch.zeros(0, dtype=torch.long)
    assert_flush_footprint(pool, snapshot(pool), none, none)      # capturing ran nothing
    g = torch.Generator().manual_seed(2)
    for rep, frac in enumerate((0.0, 1.0 / 16, 0.5, 1.0)):
        case = families.make_case(4, heads, gate, seed=rep).to(device)
        case.load_into(pool, [3, 7, 11, 9])                       # slot 9 is not in idx: must stay untouched
        due = torch.rand(pool.num_slots, heads, generator=g) < frac
        pool.hcnt.copy_(torch.where(due, L, L - 1 - rep).to(device, torch.int32))
        mixed_windows(pool, idx, seed=rep)
        slots, hs = written_programs(pool, idx)
        inputs = program_inputs(pool, slots, hs)
        before = snapshot(pool)
        graph.replay()
        torch.cuda.synchronize()
        assert_flush_footprint(pool, before, slots, hs)
        if len(slots):
            v = judge_programs(pool, slots, hs, inputs, q0, backend)
            assert v.passed, f"replay {rep}: {v.message}"


def nothing_due_launches(backend: str, gate: str, heads: int, device) -> list[str]:
    """The CUDA kernels a warmed-up call of ``backend``'s flush launches with nothing due (torch's profiler). The
    backend's own flush, as a captured graph runs it: the API's checks of idx values, skipped under capture, launch
    reductions of their own. The deployment contract wants a call with nothing due to be one cheap launch."""
    import leapquant as lq
    from leapquant import dispatch
    pool, idx = noisy_pool(gate, heads, 0, device)
    pool.hcnt.fill_(L - 1)
    q0 = lq.default_q0(device)
    lq.flush_inplace(pool, idx, q0, backend=backend)          # warm: compiled, workspace made
    flush = dispatch.get_backend(backend).flush
    torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        flush(pool, idx, q0)
        torch.cuda.synchronize(device)
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
