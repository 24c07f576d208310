"""Test helpers shared by every backend's suite: poisoning, byte snapshots of a pool, due-region masks."""
from __future__ import annotations

import torch

from leapquant.layout import CHECKPOINT_BYTES, L, OFF, REGION_WORDS, Pool

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


def poison_checkpoints(pool: Pool, slots: torch.Tensor, heads: torch.Tensor) -> None:
    """NaN scales and tokens, 0x7f codes in the checkpoints of the given programs."""
    pool.codes[slots, heads] = POISON_CODE
    pool.s_k[slots, heads] = float("nan")
    pool.s_v[slots, heads] = float("nan")
    pool.tokens[slots, heads] = float("nan")


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


def assert_flush_footprint(pool: Pool, before: dict[str, torch.Tensor], slots: torch.Tensor, heads: torch.Tensor
                           ) -> None:
    """Every due checkpoint was rewritten (no poison left, finite), every other byte is as before, windows reset."""
    after = snapshot(pool)
    mask = checkpoint_byte_mask(pool, slots, heads)
    changed = (after["raw"] != before["raw"]) & ~mask
    if bool(changed.any()):
        first = int(changed.nonzero()[0])
        word = first // 4 - OFF
        raise AssertionError(f"{int(changed.sum())} bytes outside the due checkpoints changed; first at raw byte "
                             f"{first} (slot {word // pool.slot_stride}, region word {word % pool.slot_stride})")
    if len(slots):
        codes = pool.codes[slots, heads].cpu()
        assert not bool((codes == POISON_CODE).all(dim=(-1, -2)).any()), "a due program's codes were not written"
        for name in ("s_k", "s_v", "tokens"):
            vals = getattr(pool, name)[slots, heads].float().cpu()
            assert bool(torch.isfinite(vals).all()), f"{name}: non-finite values left in due programs (unwritten?)"
    for name, exp in expected_resets(pool, before, slots, heads).items():
        diff = after[name] != exp
        assert not bool(diff.any()), f"{name}: {int(diff.sum())} bytes differ from the expected reset/untouched state"
    assert torch.equal(after["hcnt"], before["hcnt"]), "hcnt changed"
