"""Writes definition.json and workloads.jsonl of the KDA and GDN flush and decode-step ops (FlashInfer-Bench schema).

    python -m leapquant.definitions.make      # regenerate; tests/test_definitions.py checks the files match

Each definition embeds a self-contained plain-torch ``run`` (the fp32 reference, written out again without the
package) that tests/test_definitions.py compares with leapquant.reference and judges by the op's criterion.
"""
from __future__ import annotations

import json
import uuid
from pathlib import Path

from ..criterion import ABS_BOUND, REL_FLOOR, REL_SLACK, STEP_REL
from ..numerics import DEFAULT_HEADS, EPS, FP16_MAX, GS_ABS_FLOOR, NORM_EPS, QMAX, SOFTPLUS_THRESHOLD, K, L, R, V

HERE = Path(__file__).parent
BATCHES = (16, 32, 64, 128, 256, 512)

# the constants are leapquant.numerics' (the text written out is self-contained)
_COMMON = f'''import torch

V, K, L, R, QMAX, EPS, FP16_MAX = {V}, {K}, {L}, {R}, {QMAX}, {EPS!r}, {FP16_MAX!r}


def _orth(x):
    # Gram-Schmidt, each projection applied twice; empty columns (norm <= {GS_ABS_FLOOR!r}) become zero
    cols = []
    for j in range(x.shape[-1]):
        c = x[..., j]
        for _ in range(2):
            for p in cols:
                c = c - p * (p * c).sum(-1, keepdim=True)
        n = c.norm(dim=-1, keepdim=True)
        cols.append(torch.where(n > {GS_ABS_FLOOR!r}, c / n.clamp_min({GS_ABS_FLOOR!r}), torch.zeros_like(c)))
    return torch.stack(cols, -1)


def _compress(S, q0):
    St = S.transpose(-1, -2)
    Q = _orth(S @ _orth(St @ q0))
    u = (St @ Q).transpose(-1, -2).clamp(-FP16_MAX, FP16_MAX).half()
    q = Q.transpose(-1, -2).half()
    E = S - q.float().transpose(-1, -2) @ u.float()
    s_k = E.abs().mean(-2).sqrt().clamp_min(EPS)
    x = E / s_k.unsqueeze(-2)
    s_v = x.abs().amax(-1).clamp_min(EPS)
    codes = torch.round(x * (QMAX / s_v).unsqueeze(-1)).clamp(-QMAX, QMAX).to(torch.int8)
    return codes, s_k, s_v, u, q


def _decode(codes, s_k, s_v, u, q):
    return q.float().transpose(-1, -2) @ u.float() + codes.float() * (s_k / QMAX).unsqueeze(-2) * s_v.unsqueeze(-1)


def _keep_empty(empty, new, old):
    # a head whose window is empty (every w = 0, no decay) keeps its checkpoint: nothing to fold, no re-compression
    return tuple(torch.where(empty.reshape(empty.shape + (1,) * (n.dim() - empty.dim())), o, n)
                 for n, o in zip(new, old))
'''

KDA_REF = _COMMON + '''

@torch.no_grad()
def run(codes, s_k, s_v, u, q, kbuf, ubuf, gbuf, w, pcum, q0):
    g = gbuf.float()
    after = torch.flip(torch.cumprod(torch.flip(g, [-2]), -2), [-2])          # prod_{i >= j}
    D = torch.cat([after[..., 1:, :], torch.ones_like(g[..., :1, :])], -2)    # prod_{i > j}
    keys = kbuf.float() * w.unsqueeze(-1) * D
    S = _decode(codes, s_k, s_v, u, q) * torch.exp(pcum).unsqueeze(-2) + ubuf.float().transpose(-1, -2) @ keys
    empty = (w == 0).all(-1) & (pcum == 0).all(-1)
    return _keep_empty(empty, _compress(S, q0), (codes, s_k, s_v, u, q))
'''

GDN_REF = _COMMON + '''

@torch.no_grad()
def run(codes, s_k, s_v, u, q, kbuf, ubuf, w, p, q0):
    keys = kbuf.float() * w.unsqueeze(-1)
    S = _decode(codes, s_k, s_v, u, q) * p[..., None, None] + ubuf.float().transpose(-1, -2) @ keys
    empty = (w == 0).all(-1) & (p == 1)
    return _keep_empty(empty, _compress(S, q0), (codes, s_k, s_v, u, q))
'''

# the decode step (docs/spec.md section 7): what a step reads of its program, the token, and its outputs
#: the step definitions' names by gate (GDN: Qwen3-Next's key heads, half the value heads)
STEP_NAMES = {"kda": f"leapquant_kda_step_h{DEFAULT_HEADS}",
              "gdn": f"leapquant_gdn_step_h{DEFAULT_HEADS}k{DEFAULT_HEADS // 2}"}
_STEP_COMMON = f'''import torch

V, K, L, QMAX, NORM_EPS, SOFTPLUS_THRESHOLD = {V}, {K}, {L}, {QMAX}, {NORM_EPS!r}, {SOFTPLUS_THRESHOLD!r}


def _decode(codes, s_k, s_v, u, q):
    return q.float().transpose(-1, -2) @ u.float() + codes.float() * (s_k / QMAX).unsqueeze(-2) * s_v.unsqueeze(-1)


def _unit(x):
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + NORM_EPS)


def _token(qx, kx, a, b, A_log, dt_bias, H):
    # value head j reads key head j // (H // Hk); beta rounded to bf16, as the models carry it
    group = H // kx.shape[-2]
    kn = _unit(kx.repeat_interleave(group, dim=-2))
    qn = _unit(qx.repeat_interleave(group, dim=-2)) * K ** -0.5
    x = a.float() + dt_bias
    softplus = torch.where(x > SOFTPLUS_THRESHOLD, x, torch.log1p(torch.exp(x.clamp_max(SOFTPLUS_THRESHOLD))))
    g = -torch.exp(A_log).reshape(A_log.shape + (1,) * (dt_bias.dim() - 1)) * softplus
    beta = torch.sigmoid(b.float()).to(torch.bfloat16).float()
    return kn, qn, g, beta


def _live(h):
    # a fill count of L ("just flushed") reads as an empty window; entries at and past h are ignored
    h = torch.where(h == L, torch.zeros_like(h), h).long()
    return h, torch.arange(L, device=h.device) < h.unsqueeze(-1)


def _delta(S, kn, qn, vx, beta):
    u_new = beta.unsqueeze(-1) * (vx.float() - (S @ kn.unsqueeze(-1)).squeeze(-1))
    o = (S @ qn.unsqueeze(-1)).squeeze(-1) + (kn * qn).sum(-1, keepdim=True) * u_new
    return u_new, o
'''

KDA_STEP_REF = _STEP_COMMON + '''

@torch.no_grad()
def run(codes, s_k, s_v, u, q, kbuf, ubuf, gbuf, w, pcum, h, qx, kx, vx, a, b, A_log, dt_bias):
    h, live = _live(h)
    kn, qn, g, beta = _token(qx, kx, a, b, A_log, dt_bias, vx.shape[-2])
    en = torch.exp(g)
    pcum_new = pcum + g
    later = torch.where(live.unsqueeze(-1), gbuf.float(), 1.0)
    from_j = torch.flip(torch.cumprod(torch.flip(later, [-2]), -2), [-2])        # prod_{i >= j}
    decay = torch.cat([from_j[..., 1:, :], torch.ones_like(later[..., :1, :])], -2) * en.unsqueeze(-2)
    keys = torch.where(live.unsqueeze(-1), w.unsqueeze(-1) * kbuf.float() * decay, 0.0)
    values = torch.where(live.unsqueeze(-1), ubuf.float(), 0.0)
    S = _decode(codes, s_k, s_v, u, q) * torch.exp(pcum_new).unsqueeze(-2) + values.transpose(-1, -2) @ keys
    u_new, o = _delta(S, kn, qn, vx, beta)
    w_new = torch.where(torch.arange(L, device=h.device) == h.unsqueeze(-1), 1.0, w)
    return o.bfloat16(), kn.bfloat16(), u_new.bfloat16(), en.half(), w_new, pcum_new
'''

GDN_STEP_REF = _STEP_COMMON + '''

@torch.no_grad()
def run(codes, s_k, s_v, u, q, kbuf, ubuf, w, p, h, qx, kx, vx, a, b, A_log, dt_bias):
    h, live = _live(h)
    kn, qn, g, beta = _token(qx, kx, a, b, A_log, dt_bias, vx.shape[-2])
    at = torch.exp(g)
    p_new = p * at
    w_live = torch.where(live, w * at.unsqueeze(-1), w)                           # the live weights decay
    keys = torch.where(live.unsqueeze(-1), w_live.unsqueeze(-1) * kbuf.float(), 0.0)
    values = torch.where(live.unsqueeze(-1), ubuf.float(), 0.0)
    S = _decode(codes, s_k, s_v, u, q) * p_new[..., None, None] + values.transpose(-1, -2) @ keys
    u_new, o = _delta(S, kn, qn, vx, beta)
    w_new = torch.where(torch.arange(L, device=h.device) == h.unsqueeze(-1), 1.0, w_live)
    return o.bfloat16(), kn.bfloat16(), u_new.bfloat16(), w_new, p_new
'''

_CKPT_IN = {
    "codes": {"shape": ["batch_size", "num_heads", "V", "K"], "dtype": "int8",
              "description": "old checkpoint: int8 codes of the residual"},
    "s_k": {"shape": ["batch_size", "num_heads", "K"], "dtype": "float32", "description": "column scales (> 0)"},
    "s_v": {"shape": ["batch_size", "num_heads", "V"], "dtype": "float32", "description": "row scales (> 0)"},
    "u": {"shape": ["batch_size", "num_heads", "R", "K"], "dtype": "float16", "description": "key-side tokens"},
    "q": {"shape": ["batch_size", "num_heads", "R", "V"], "dtype": "float16", "description": "value-side tokens"},
    "kbuf": {"shape": ["batch_size", "num_heads", "L", "K"], "dtype": "bfloat16", "description": "buffered keys"},
    "ubuf": {"shape": ["batch_size", "num_heads", "L", "V"], "dtype": "bfloat16",
             "description": "buffered value corrections"},
}
_OUT = {
    "codes": {"shape": ["batch_size", "num_heads", "V", "K"], "dtype": "int8"},
    "s_k": {"shape": ["batch_size", "num_heads", "K"], "dtype": "float32"},
    "s_v": {"shape": ["batch_size", "num_heads", "V"], "dtype": "float32"},
    "u": {"shape": ["batch_size", "num_heads", "R", "K"], "dtype": "float16"},
    "q": {"shape": ["batch_size", "num_heads", "R", "V"], "dtype": "float16"},
}
_AXES = {"batch_size": {"type": "var"}, "num_heads": {"type": "const", "value": DEFAULT_HEADS},
         "V": {"type": "const", "value": V}, "K": {"type": "const", "value": K},
         "L": {"type": "const", "value": L}, "R": {"type": "const", "value": R}}
def _sci(x: float) -> str:
    """1e-4 as the criterion's text writes it (not 0.0001, not 1e-04)."""
    return f"{x:.0e}".replace("e-0", "e-")


_CRITERION = (f"judged on the decoded state per head against the exact fp64 rebuild S: err = mean|decode - S| <= "
              f"{REL_SLACK} x the fp32 reference's err where that is >= {_sci(REL_FLOOR)} mean|S|, else <= "
              f"{_sci(ABS_BOUND)} "
              f"mean|S|; outputs finite, codes in [-{QMAX}, {QMAX}]")


def definitions() -> dict[str, dict]:
    kda_in = dict(_CKPT_IN)
    kda_in.update({
        "gbuf": {"shape": ["batch_size", "num_heads", "L", "K"], "dtype": "float16",
                 "description": "decay factor of the step that appended each entry, in (0, 1]"},
        "w": {"shape": ["batch_size", "num_heads", "L"], "dtype": "float32", "description": "entry weights in [0, 1]"},
        "pcum": {"shape": ["batch_size", "num_heads", "K"], "dtype": "float32",
                 "description": "log-gate summed over the window (<= 0; below -1000 occurs)"},
        "q0": {"shape": ["V", "R"], "dtype": "float32", "description": "start of the subspace iteration"},
    })
    gdn_in = dict(_CKPT_IN)
    gdn_in.update({
        "w": {"shape": ["batch_size", "num_heads", "L"], "dtype": "float32",
              "description": "entry weights, each entry's later decay folded in"},
        "p": {"shape": ["batch_size", "num_heads"], "dtype": "float32", "description": "gate product in (0, 1]"},
        "q0": {"shape": ["V", "R"], "dtype": "float32", "description": "start of the subspace iteration"},
    })
    common_constraints = [
        "s_k > 0 and s_v > 0", "|S| < 1e4 elementwise", "batch_size <= 512", _CRITERION,
        "run returns the tuple (codes, s_k, s_v, u, q) in the order of outputs",
    ]
    return {
        "leapquant_kda_flush_h32": {
            "name": "leapquant_kda_flush_h32", "op_type": "leapquant_flush",
            "description": ("LeapQuant flush, Kimi Delta Attention (per-key-channel gate): fold a window of L = 16 "
                            "rank-1 updates into an int8 + rank-4 fp16 compressed 128 x 128 state and re-compress it "
                            "(one round of subspace iteration from q0, fp16 tokens, two-sided smoothing scales, "
                            "round-half-even int8 codes). A head whose window is empty (every w = 0 and pcum = 0) "
                            "keeps its checkpoint unchanged."),
            "tags": ["model:kimi-linear-48b", "layer:kda"],
            "axes": _AXES, "inputs": kda_in, "outputs": _OUT,
            "constraints": common_constraints + ["0 < gbuf <= 1", "0 <= w <= 1", "pcum <= 0"],
            "reference": KDA_REF,
        },
        "leapquant_gdn_flush_h32": {
            "name": "leapquant_gdn_flush_h32", "op_type": "leapquant_flush",
            "description": ("LeapQuant flush, Gated DeltaNet (scalar gate): S = p S_old + sum_j w_j ubuf_j kbuf_j^T, "
                            "re-compressed as in the KDA flush; a head whose window is empty (every w = 0 and p = 1) "
                            "keeps its checkpoint unchanged."),
            "tags": ["model:qwen3-next", "layer:gated_deltanet"],
            "axes": _AXES, "inputs": gdn_in, "outputs": _OUT,
            "constraints": common_constraints + ["0 < p <= 1", "w >= 0"],
            "reference": GDN_REF,
        },
        **step_definitions(),
    }


_STEP_CRITERION = (f"judged element by element against the same formula in fp64, M the formula on the absolute values "
                   f"of every term: o, k_row, u_row within half a bf16 step + {_sci(STEP_REL)} M (zero where every "
                   f"term is zero); g_row within half an fp16 step + {_sci(STEP_REL)} |exact|; pcum_new within "
                   f"{_sci(STEP_REL)} (|exact| + 1); p_new and the live decayed weights within half an fp32 step + "
                   f"({_sci(STEP_REL)} (1 + |g|) + r) |exact|, r the fp32 rounding of exp(g) relative to it; the other "
                   f"weights exact; every output finite")


def _step_io(gate: str) -> tuple[dict, dict]:
    """The step's inputs (in ``run``'s order) and outputs."""
    bh = ["batch_size", "num_heads"]
    inputs = {name: dict(spec) for name, spec in _CKPT_IN.items()}
    inputs["codes"]["description"] = "the checkpoint's int8 codes of the residual"
    if gate == "kda":
        inputs.update({
            "gbuf": {"shape": bh + ["L", "K"], "dtype": "float16",
                     "description": "decay factor of the step that appended each entry, in (0, 1]"},
            "w": {"shape": bh + ["L"], "dtype": "float32", "description": "entry weights in [0, 1]"},
            "pcum": {"shape": bh + ["K"], "dtype": "float32", "description": "log-gate summed over the window (<= 0)"},
        })
    else:
        inputs.update({
            "w": {"shape": bh + ["L"], "dtype": "float32",
                  "description": "entry weights, each entry's later decay folded in"},
            "p": {"shape": bh, "dtype": "float32", "description": "gate product in (0, 1]"},
        })
    gate_shape, dt_shape = (bh + ["K"], ["num_heads", "K"]) if gate == "kda" else (bh, ["num_heads"])
    inputs.update({
        "h": {"shape": bh, "dtype": "int32",
              "description": f"fill count in [0, {L}]: entries before it are live; {L} (just flushed) reads as 0"},
        "qx": {"shape": ["batch_size", "num_k_heads", "K"], "dtype": "bfloat16", "description": "query (per key head)"},
        "kx": {"shape": ["batch_size", "num_k_heads", "K"], "dtype": "bfloat16", "description": "key (per key head)"},
        "vx": {"shape": bh + ["V"], "dtype": "bfloat16", "description": "value"},
        "a": {"shape": gate_shape, "dtype": "bfloat16", "description": "gate pre-activation"},
        "b": {"shape": bh, "dtype": "bfloat16", "description": "beta pre-activation (beta = sigmoid(b), in bf16)"},
        "A_log": {"shape": ["num_heads"], "dtype": "float32", "description": "per-head log decay rate"},
        "dt_bias": {"shape": dt_shape, "dtype": "float32", "description": "gate bias"},
    })
    outputs = {
        "o": {"shape": bh + ["V"], "dtype": "bfloat16", "description": "the token's output"},
        "k_row": {"shape": bh + ["K"], "dtype": "bfloat16", "description": "window entry h's key (kn)"},
        "u_row": {"shape": bh + ["V"], "dtype": "bfloat16", "description": "window entry h's value correction"},
    }
    if gate == "kda":
        outputs.update({
            "g_row": {"shape": bh + ["K"], "dtype": "float16", "description": "window entry h's decay factor"},
            "w_new": {"shape": bh + ["L"], "dtype": "float32", "description": "weights with w[h] = 1"},
            "pcum_new": {"shape": bh + ["K"], "dtype": "float32", "description": "pcum + this token's log-gate"},
        })
    else:
        outputs.update({
            "w_new": {"shape": bh + ["L"], "dtype": "float32", "description": "live weights decayed, w[h] = 1"},
            "p_new": {"shape": bh, "dtype": "float32", "description": "p times this token's gate"},
        })
    return inputs, outputs


def step_definitions() -> dict[str, dict]:
    """The decode step of each gate: KDA with one key head per head, GDN with Qwen3-Next's 16 key heads."""
    out = {}
    for gate, k_heads, ref in (("kda", DEFAULT_HEADS, KDA_STEP_REF), ("gdn", DEFAULT_HEADS // 2, GDN_STEP_REF)):
        name = STEP_NAMES[gate]
        inputs, outputs = _step_io(gate)
        kda = gate == "kda"
        out[name] = {
            "name": name, "op_type": "leapquant_step",
            "description": (
                "LeapQuant decode step, " + ("Kimi Delta Attention (per-key-channel gate)" if kda else
                                             "Gated DeltaNet (scalar gate, grouped key heads)")
                + ": one token of the gated delta rule served from the compressed state (int8 codes with two-sided "
                  "scales plus rank-4 fp16 tokens) and the window of up to L = 16 buffered updates, without forming "
                  "the state in memory; it returns the output and the window entry the token appends "
                  "(leapquant's docs/spec.md section 7)."),
            "tags": ["model:kimi-linear-48b", "layer:kda"] if kda else ["model:qwen3-next", "layer:gated_deltanet"],
            "axes": dict(_AXES, num_k_heads={"type": "const", "value": k_heads}),
            "inputs": inputs, "outputs": outputs,
            "constraints": ["s_k > 0 and s_v > 0", "0 <= w <= 1", "batch_size <= 512", _STEP_CRITERION,
                            "run returns the tuple of outputs in their order"]
                           + (["0 < gbuf <= 1", "pcum <= 0"] if kda else ["0 < p <= 1"]),
            "reference": ref,
        }
    return out



def workloads(name: str, inputs: dict) -> list[dict]:
    rows = []
    for b in BATCHES:
        wid = str(uuid.uuid5(uuid.NAMESPACE_URL, f"leapquant/{name}/{b}"))
        rows.append({"definition": name, "solution": "", "workload": {
            "uuid": wid, "axes": {"batch_size": b}, "inputs": {k: {"type": "random"} for k in inputs}},
            "evaluation": {}})
    return rows


def render() -> dict[Path, str]:
    out = {}
    for name, d in definitions().items():
        folder = HERE / name
        out[folder / "definition.json"] = json.dumps(d, indent=2) + "\n"
        out[folder / "workloads.jsonl"] = "".join(json.dumps(r) + "\n" for r in workloads(name, d["inputs"]))
    return out


if __name__ == "__main__":
    for path, text in render().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(path)
