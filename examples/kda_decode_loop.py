"""A KDA layer's decode loop written as a serving engine writes it, on a leapquant pool.

    python examples/kda_decode_loop.py                      # CPU: the reference backend, eagerly
    python examples/kda_decode_loop.py --device cuda        # GPU: the Triton kernels replayed from a CUDA graph

What an engine does, in order:

1. owns one :class:`leapquant.Pool` per linear-attention layer (slot 0 reserved; a slot per running sequence);
2. on admission, gives each sequence a slot (here: shuffled, as an allocator hands them out), starts it with
   ``pool.reset_slots`` and puts the prefill's dense fp32 state [n, H, V, K] in with ``pool.encode(slots, states)``;
3. per decode token, fills its static input buffers: ``idx`` int32 [N] (the slot of each row; vLLM pads the batch to a
   captured size with -1 rows), the q | k | v projection of each row (bf16; here a slice of a wider projection
   output that also carries beta's pre-activation, so the row stride is larger than the row), the gate
   pre-activation ``a`` bf16 [N, H, K], and calls ``leapquant.decode_inplace`` (the step, then the flush of the windows
   it filled), which writes ``out`` bf16 [N, H, V];
4. on a GPU, captures that call once in a CUDA graph (after ``leapquant.warmup(pool)`` and one warm-up call, both
   outside the capture: kernels are compiled and bound there) and replays the graph per token.

The model's per-head constants (``A_log`` fp32 [H], ``dt_bias`` fp32 [H, K]) and the tokens are random here. At the
end the outputs are checked against the dense fp32 recurrence of the same tokens from the same prefill states.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

import leapquant as lq
from leapquant.e2e import dense_step

K, V = lq.K, lq.V                                          # the state's key and value sizes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4, help="sequences decoded together (default 4)")
    p.add_argument("--tokens", type=int, default=40, help="decode tokens per sequence (default 40: two flushes)")
    p.add_argument("--heads", type=int, default=8, help="KDA heads of the layer on this GPU (default 8)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--backend", default=None, choices=("auto", *lq.BACKENDS),
                   help="leapquant backend (default: triton on a GPU, the reference on a CPU)")
    p.add_argument("--eager", action="store_true", help="on a GPU, call eagerly instead of replaying a CUDA graph")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if min(args.batch, args.tokens, args.heads) < 1:
        p.error("--batch, --tokens and --heads must be positive")
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as e:
        p.error(f"--device {args.device}: {e}")
    if device.type not in ("cpu", "cuda") or (device.type == "cuda" and not torch.cuda.is_available()):
        p.error(f"--device {args.device}: this machine runs cpu{' or cuda' if torch.cuda.is_available() else ''}")
    on_cpu = device.type == "cpu"
    if args.backend == "triton" and on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--backend triton on a CPU runs Triton's interpreter: set TRITON_INTERPRET=1 before starting (slow: "
                "e.g. --batch 1 --heads 2 --tokens 17)")
    if args.backend == "tilelang" and on_cpu:
        p.error("--backend tilelang needs a GPU (sm_90a / sm_100a)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    backend = args.backend or ("triton" if device.type == "cuda" else "reference")
    # the reference synchronises with the host, so it cannot be captured
    use_graph = device.type == "cuda" and backend != "reference" and not args.eager
    B, H, T = args.batch, args.heads, args.tokens
    g = torch.Generator().manual_seed(args.seed)

    # ---- the layer: constants of the model, one pool ----------------------------------------------------------------
    A_log = torch.log(1.0 + 15.0 * torch.rand(H, generator=g)).to(device)               # fp32 [H]
    dt = torch.exp(math.log(1e-3) + math.log(100.0) * torch.rand(H, K, generator=g))
    dt_bias = (dt + torch.log(-torch.expm1(-dt))).to(device)                            # fp32 [H, K]
    num_slots = 2 * B + 1                                                                 # slot 0 is reserved
    pool = lq.Pool(num_slots, num_heads=H, device=device, gate="kda")
    q0 = lq.default_q0(device)

    # ---- admission: a slot per sequence, the prefill state into the pool --------------------------------------------
    slots = (torch.randperm(num_slots - 1, generator=g)[:B] + 1).tolist()
    prefill = (0.05 * torch.randn(B, H, V, 4, generator=g) @ torch.randn(B, H, 4, K, generator=g)
               + 0.01 * torch.randn(B, H, V, K, generator=g))                            # dense fp32 [B, H, V, K]
    pool.reset_slots(slots)
    pool.encode(slots, prefill)

    # ---- static buffers of the decode batch: B sequences padded to N = B + 1 rows -------------------------------------
    N = B + 1
    W = 2 * H * K + H * V                                   # q | k | v of one row
    idx = torch.tensor(slots + [-1], dtype=torch.int32, device=device)
    proj = torch.zeros(N, W + H, dtype=torch.bfloat16, device=device)   # projection output: q | k | v | b
    qkv, b = proj[:, :W], proj[:, W:]                                    # row stride W + H: wider than the rows
    a = torch.zeros(N, H, K, dtype=torch.bfloat16, device=device)
    out = torch.zeros(N, H, V, dtype=torch.bfloat16, device=device)

    # every token's projection outputs (what the model's projections would produce), made before the timed loop
    tok_proj = torch.randn(T, N, W + H, generator=g)
    tok_proj[:, :, W:] *= 2.0                                            # beta = sigmoid(b): spread over (0, 1)
    tok_proj = tok_proj.to(device, torch.bfloat16)
    tok_a = torch.randn(T, N, H, K, generator=g).to(device, torch.bfloat16)

    def decode() -> None:
        lq.decode_inplace(pool, idx, qkv, a, b, A_log, dt_bias, q0, out, backend=backend)

    graph = None
    if not use_graph:
        # eager: one call of the same shapes with every row padding first, so that the timed loop holds no one-time
        # set-up (the backend's first use, the kernels' compilation); it writes nothing
        lq.decode_inplace(pool, torch.full_like(idx, -1), qkv, a, b, A_log, dt_bias, q0, out, backend=backend)
    if use_graph:
        lq.warmup(pool, backend=backend)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            # a warm-up call of the same shapes with every row padding: compiles the step kernel, writes nothing
            lq.decode_inplace(pool, torch.full_like(idx, -1), qkv, a, b, A_log, dt_bias, q0, out, backend=backend)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                decode()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    # ---- the decode loop ------------------------------------------------------------------------------------------
    outs = torch.empty(T, N, H, V, dtype=torch.bfloat16, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        for t in range(T):
            proj.copy_(tok_proj[t])                 # the new token's inputs into the static buffers
            a.copy_(tok_a[t])
            if graph is not None:
                graph.replay()
            else:
                decode()
            outs[t].copy_(out)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0

    # ---- the check: the dense fp32 recurrence of the same tokens from the same prefill states ---------------------------
    S = prefill.to(device)
    dense = []
    with torch.no_grad():
        for t in range(T):
            row = tok_proj[t, :B]
            tok = dict(qx=row[:, :H * K].reshape(B, H, K), kx=row[:, H * K:2 * H * K].reshape(B, H, K),
                       vx=row[:, 2 * H * K:W].reshape(B, H, V), a=tok_a[t, :B], b=row[:, W:])
            dense.append(dense_step(S, tok, A_log, dt_bias, "kda"))
    dense_o = torch.stack(dense).double()
    got = outs[:, :B].double()
    rel = float((got - dense_o).norm() / dense_o.norm())
    padding_zero = not bool(outs[:, B:].any())
    ok = rel < 1e-2 and padding_zero and bool(torch.isfinite(got).all())

    print(f"device: {lq.device_description(device)}")
    print(f"backend: {backend} ({'CUDA graph replay' if graph is not None else 'eager'}); "
          f"{B} sequences in slots {slots} + 1 padding row, {H} heads, {T} tokens ({T // lq.L} flushes)")
    print(f"tokens/s: {B * T / seconds:.1f} (one layer, {1e3 * seconds / T:.2f} ms per decode call)")
    print(f"output norm: {float(outs[:, :B].float().norm()):.4f}")
    print(f"check vs dense fp32 recurrence: relative error {rel:.2e} (limit 1e-2), padding rows zero: "
          f"{padding_zero}: {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
