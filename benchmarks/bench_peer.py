"""Side-by-side MoE expert benchmark against the peer, OpenAI's ``triton_kernels`` (issues 10 and 11).

What is timed, per (config, routing, tokens), every row in CUDA-graph replay on the SAME inputs (x, top-k ids and
weights from ``bench_moe_skew.routing``: uniform / zipf / all-on-k):

* ``ours``: the routed part of ``Nvfp4MoE`` built from the ops, dispatch precomputed (as the peer's metadata is):
  ``nvfp4_grouped_mm(x, w13, row_index=..., activation="swiglu")`` (gather + gate_up + SwiGLU) ->
  ``nvfp4_grouped_mm(inter, w2)`` (down) -> ``combine`` (weighted top-k sum). This is the issues' "our
  gate_up+SwiGLU plus down+combine"; ``ours+disp`` adds ``megamoe.ops.moe.dispatch`` from the ids (the layer's
  backend rule: the Triton kernel up to 512 pairs, torch above).
* ``peer``: ``triton_kernels`` v3.6.0 the way vLLM 0.19 calls it on Hopper (../shared/peers/README.md): MXFP4
  weights (``downcast_to_mxfp`` + ``HopperMXValueLayout`` / ``HopperMXScaleLayout(num_warps=8)``), split_k 1,
  ``matmul_ogs`` gate_up with gather + fused swiglu, then down with scatter + gammas (its scatter and top-k sum).
  The routing metadata (k = 6 is not a power of two for its ``topk``) is built once per point in torch
  (:func:`peer_routing`) + ``make_ragged_tensor_metadata``, outside the timed graph.
  The peer's weights are the same matrices as ours (our NVFP4 experts decoded, re-quantized to MXFP4).
  Its swiglu is gpt-oss's (``x*sigmoid(alpha*x)*(up+1)``, alpha 1.0, limit = the config's): same cost.
* ``bf16``: the same precomputed dispatch, dequantized bf16 weights, ``torch._grouped_mm`` + torch SwiGLU +
  ``combine`` (bench_moe_skew's bf16 layer without router / shared expert); skipped when it does not fit in
  free GPU memory (V4-Pro on an 80 GB H100).
* ``floor``: max(touched experts' NVFP4 bytes + activations / 3.0 TB/s, FLOPs / 749 TFLOP/s), as bench_moe_skew
  computes it without the shared expert and gate.

Timing: ``triton.testing.do_bench(graph.replay, return_mode="median")``, which clears L2 (a 256 MB memset)
before every timed replay, as the README's peer numbers were taken (L2 flushed before each call).
speed-up = peer us / ours us; target 1.2x at <= 64 tokens (issue 11), 1.25x at >= 512 tokens (issue 10).
Check (T <= 8): each side against a float32 reference on its own decoded weights and its own SwiGLU (ours
~1e-2, peer ~0.1 from the MXFP4 re-quantization; a wrong gather / scatter index gives ~1.4).

The peer is imported from $MEGAMOE_PEERS, ./shared/peers or ../shared/peers (or a shared/peers further up);
without it the peer columns are empty and the run goes on. A peer failure prints its traceback and the run goes on
with our rows (a CUDA fault stops the run after writing what was measured).

Usage:
  python benchmarks/bench_peer.py [--configs v4-flash,v4-pro] [--tokens 1,8,64,512,4096,16384]
      [--routings uniform,zipf,all-on-k] [--ws | --both-ws | --pipe | --both-pipe] [--no-peer] [--no-bf16] [--quick]
      [--rep-ms 20] [--budget-s 540] [--out-dir DIR (default $OUT or benchmarks/results)] [--tag peer_v1]
Default tokens: V4-Flash 1..16384, V4-Pro 1..8192. ``--ws``: megamoe.ops.gemm.WS_ROUTE = True (the
warp-specialized grouped GEMM); ``--both-ws``: ours with WS off and on in the same run; ``--pipe`` /
``--both-pipe``: the same for megamoe.ops.gemm.PIPE_ROUTE (the pipelined wgmma kernel, NOTES_gemm.md v17). ``--budget-s``: no new
point starts after that many seconds (results so far are written after every point).
Device time (guessed, not yet measured; the script prints this estimate per config and then the real times):
V4-Flash default grid ~3 min (weights + bf16 copy ~30 s, first compiles ~100 s, 18 points ~45 s), V4-Pro ~3.5 min
(weights ~75 s); ``--both-ws`` adds ~1 min per config (WS compiles); ``--quick`` ~2 min. On a fresh machine
(empty Triton cache) run one config per 600 s device call.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
from types import SimpleNamespace

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)
sys.path.insert(0, _REPO)  # run from a checkout
sys.path.insert(0, _HERE)

from bench_moe import BF16_FLOPS, HBM_BYTES_PER_S  # noqa: E402
from bench_moe_skew import ROUTINGS, routing  # noqa: E402

CONFIGS = {"v4-flash": "v4-flash", "v4-pro": "v4-pro"}
DEFAULT_TOKENS = {"v4-flash": (1, 8, 64, 512, 4096, 16384), "v4-pro": (1, 8, 64, 512, 4096, 8192)}
QUICK = dict(configs="v4-flash", tokens="8,512", routings="uniform", rep_ms=10)
PEER_SWIGLU_ALPHA = 1.0
PEER_SCALE_NUM_WARPS = 8  # HopperMXScaleLayout(num_warps=8), as vLLM (the kernel then runs 8 warps)
CHUNK_EXPERTS = 16  # experts decoded / re-quantized at a time (bounds the conversion's temporaries)


def target_speedup(tokens: int) -> float:
    """Issue 11 (decode, <= 64 tokens): 1.2x; issue 10 (prefill, >= 512 tokens): 1.25x."""
    return 1.2 if tokens <= 64 else 1.25


# ----------------------------------------------------------------------------------------------- peer routing
def peer_routing(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> dict:
    """The peer's ragged routing for any k, in torch (its ``topk`` needs a power-of-2 k; V4 has k = 6).

    topk_ids (T, k) int, topk_weights (T, k) float. Pairs are numbered ``p = t*k + j``; sorted rows group them by
    expert, stably (token order within an expert, as our dispatch). Returns:
    ``hist`` (E,) int32 rows per expert; ``slice_offs`` (E+1,) int32 = [0, cumsum(hist)];
    ``gather_src`` (T*k,) int32 pair of each sorted row (the peer's GatherIndx.src_indx and ScatterIndx.dst_indx;
    ``gather_src // k`` is the token); ``gather_dst`` (T*k,) int32 sorted row of each pair (GatherIndx.dst_indx and
    ScatterIndx.src_indx); ``gate_scal`` (T*k,) float32 weight of each sorted row (the down GEMM's gammas).
    """
    if topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids / topk_weights: expected equal (T, k) shapes, got {tuple(topk_ids.shape)} and "
                         f"{tuple(topk_weights.shape)}")
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    hist = torch.bincount(flat, minlength=num_experts).to(torch.int32)
    offs = torch.zeros(num_experts + 1, dtype=torch.int32, device=flat.device)
    offs[1:] = torch.cumsum(hist, 0)
    return {"hist": hist, "slice_offs": offs, "gather_src": order.to(torch.int32),
            "gather_dst": inverse.to(torch.int32), "gate_scal": topk_weights.reshape(-1)[order].float().contiguous()}


# ------------------------------------------------------------------------------------------------ peer import
def peer_dirs() -> list:
    """Folders that may hold the peer's ``triton_kernels`` package, most specific first."""
    found, d = [os.environ.get("MEGAMOE_PEERS"), os.path.join(_REPO, "shared", "peers")], _REPO
    while os.path.dirname(d) != d:  # ../shared/peers, then further up (a worktree nested deeper)
        d = os.path.dirname(d)
        found.append(os.path.join(d, "shared", "peers"))
    return [x for x in found if x]


def load_peer():
    """(namespace of the peer's API, where it came from) or (None, why not). Never raises."""
    for d in peer_dirs():
        if os.path.isfile(os.path.join(d, "triton_kernels", "matmul_ogs.py")):
            if d not in sys.path:
                sys.path.insert(0, d)
            break
    try:
        import triton_kernels
        from triton_kernels.matmul_ogs import (FlexCtx, FusedActivation, GatherIndx, PrecisionConfig, RoutingData,
                                               ScatterIndx, matmul_ogs)
        from triton_kernels.matmul_ogs_details import opt_flags
        from triton_kernels.numerics import InFlexData
        from triton_kernels.numerics_details.mxfp import downcast_to_mxfp
        from triton_kernels.specialize import FnSpecs
        from triton_kernels.swiglu import swiglu_fn
        from triton_kernels.tensor import (FP4, Storage, Tensor, convert_layout, make_ragged_tensor_metadata,
                                           make_ragged_tensor_metadata_torch, wrap_torch_tensor)
        from triton_kernels.tensor_details.layout import HopperMXScaleLayout, HopperMXValueLayout
    except Exception as e:  # noqa: BLE001  (absent, or an API other than v3.6.0's)
        return None, f"{type(e).__name__}: {e}"
    ns = SimpleNamespace(
        FlexCtx=FlexCtx, FusedActivation=FusedActivation, GatherIndx=GatherIndx, PrecisionConfig=PrecisionConfig,
        RoutingData=RoutingData, ScatterIndx=ScatterIndx, matmul_ogs=matmul_ogs, opt_flags=opt_flags,
        InFlexData=InFlexData, downcast_to_mxfp=downcast_to_mxfp, FnSpecs=FnSpecs, swiglu_fn=swiglu_fn, FP4=FP4,
        Storage=Storage, Tensor=Tensor, convert_layout=convert_layout,
        make_ragged_tensor_metadata=make_ragged_tensor_metadata,
        make_ragged_tensor_metadata_torch=make_ragged_tensor_metadata_torch, wrap_torch_tensor=wrap_torch_tensor,
        HopperMXScaleLayout=HopperMXScaleLayout, HopperMXValueLayout=HopperMXValueLayout)
    return ns, os.path.dirname(os.path.abspath(triton_kernels.__file__))


# ------------------------------------------------------------------------------------------- peer weights
class _ChunkStack:
    """Stack per-expert-chunk swizzled tensors along dim 0 into one buffer with the chunks' strides.

    The Hopper layouts return a transposed view (``.mT`` of a contiguous tensor, stride(-2) == 1, which matmul_ogs
    requires): the chunks' contiguous storages are copied into one (E, ...) buffer and the result is its ``.mT``.
    """

    def __init__(self, total: int):
        self.total, self.buf, self.transposed, self.filled = total, None, False, 0

    def add(self, start: int, data: torch.Tensor) -> None:
        if not data.is_contiguous() and data.mT.is_contiguous():
            phys, transposed = data.mT, True
        elif data.is_contiguous():
            phys, transposed = data, False
        else:
            phys, transposed = data.mT.contiguous(), True
        if self.buf is None:
            self.buf = torch.empty((self.total,) + tuple(phys.shape[1:]), dtype=phys.dtype, device=phys.device)
            self.transposed = transposed
        if transposed != self.transposed or tuple(phys.shape[1:]) != tuple(self.buf.shape[1:]):
            raise RuntimeError(f"chunk at {start}: layout {tuple(phys.shape)} / transposed={transposed} differs "
                               f"from the first chunk's {tuple(self.buf.shape)} / {self.transposed}")
        self.buf[start:start + phys.shape[0]].copy_(phys)
        self.filled += phys.shape[0]

    def result(self) -> torch.Tensor:
        if self.filled != self.total:
            raise RuntimeError(f"stacked {self.filled} of {self.total} experts")
        return self.buf.mT if self.transposed else self.buf


def peer_swizzle(tk, quant: torch.Tensor, scale: torch.Tensor):
    """One chunk: ``downcast_to_mxfp(..., axis=1)`` outputs (c, K//2, N) uint8 / (c, K//32, N) uint8 -> the peer's
    (value, scale) Tensors in the Hopper layouts (vLLM's ``_swizzle_mxfp4`` on sm_90)."""
    w = tk.convert_layout(tk.wrap_torch_tensor(quant, dtype=tk.FP4), tk.HopperMXValueLayout, mx_axis=1)
    s = tk.convert_layout(tk.wrap_torch_tensor(scale), tk.HopperMXScaleLayout, mx_axis=1,
                          num_warps=PEER_SCALE_NUM_WARPS)
    return w, s


def peer_weights_from_chunks(tk, chunks, total: int):
    """chunks: iterable of (start expert, quant (c, K//2, N), scale (c, K//32, N)) covering [0, total) in order.
    Returns the stacked (value Tensor (E, K, N) fp4, scale Tensor) in the Hopper layouts."""
    vs, ss, first = _ChunkStack(total), _ChunkStack(total), None
    for start, quant, scale in chunks:
        w, s = peer_swizzle(tk, quant, scale)
        if start == 0 and quant.shape[0] == total:  # one chunk: the converted tensors as they are
            return w, s
        first = first or (w, s)
        vs.add(start, w.storage.data)
        ss.add(start, s.storage.data)
        del w, s
    w0, s0 = first
    wl = tk.HopperMXValueLayout([total] + list(w0.storage.layout.initial_shape[1:]), mx_axis=1)
    sl = tk.HopperMXScaleLayout([total] + list(s0.storage.layout.initial_shape[1:]), mx_axis=1,
                                num_warps=PEER_SCALE_NUM_WARPS)
    w = tk.Tensor(tk.Storage(vs.result(), wl), dtype=w0.dtype, shape=[total] + list(w0.shape[1:]),
                  shape_max=[total] + list(w0.shape_max[1:]))
    s = tk.Tensor(tk.Storage(ss.result(), sl), dtype=s0.dtype, shape=[total] + list(s0.shape[1:]),
                  shape_max=[total] + list(s0.shape_max[1:]))
    return w, s


def _expert_range(t, a: int, b: int):
    """Experts [a, b) of an (E, N, K) NVFP4Tensor (per-expert or shared global scale)."""
    from megamoe.format.tensor import NVFP4Tensor

    gs = t.global_scale
    if gs.dim() == 3 and gs.shape[0] == t.shape[0]:
        gs = gs[a:b]
    return NVFP4Tensor(t.data[a:b], t.block_scale[a:b], gs, (b - a,) + tuple(t.shape[1:]))


def build_peer_weights(tk, t, chunk: int = CHUNK_EXPERTS):
    """Our (E, N, K) NVFP4 experts (w13 already gate/up-interleaved: the peer's swiglu pairs columns 2j, 2j+1)
    -> the peer's MXFP4 weight (E, K, N) and PrecisionConfig, a chunk of experts at a time."""
    from megamoe.ops.quantize import dequantize

    e = t.shape[0]

    def chunks():
        for a in range(0, e, chunk):
            b = min(e, a + chunk)
            w = dequantize(_expert_range(t, a, b), torch.bfloat16)  # (c, N, K)
            quant, scale = tk.downcast_to_mxfp(w.transpose(1, 2), torch.uint8, axis=1)  # (c, K//2, N), (c, K//32, N)
            del w
            yield a, quant, scale

    w, s = peer_weights_from_chunks(tk, chunks(), e)
    pc = tk.PrecisionConfig(weight_scale=s, flex_ctx=tk.FlexCtx(rhs_data=tk.InFlexData()))
    return w, pc


def peer_routing_objects(tk, topk_ids, topk_weights, num_experts: int):
    """(RoutingData, GatherIndx, ScatterIndx) of the peer for fixed ids / weights (device tensors)."""
    r = peer_routing(topk_ids, topk_weights, num_experts)
    try:
        meta = tk.make_ragged_tensor_metadata(r["hist"], topk_ids.numel())  # its Triton kernels (no host sync)
    except Exception:  # noqa: BLE001  (same metadata, its torch reference)
        traceback.print_exc()
        meta = tk.make_ragged_tensor_metadata_torch(r["hist"], topk_ids.numel())
    rd = tk.RoutingData(r["gate_scal"], r["hist"], num_experts, topk_ids.shape[1], expt_data=meta)
    gi = tk.GatherIndx(src_indx=r["gather_src"], dst_indx=r["gather_dst"])
    si = tk.ScatterIndx(src_indx=r["gather_dst"], dst_indx=r["gather_src"])
    return rd, gi, si


def peer_forward_fn(tk, w1, pc1, w2, pc2, rd, gi, si, swiglu_limit):
    act = tk.FusedActivation(tk.FnSpecs("swiglu", tk.swiglu_fn, ("alpha", "limit"), reduction_n=2),
                             (PEER_SWIGLU_ALPHA, swiglu_limit))

    def forward(x):
        inter = tk.matmul_ogs(x, w1, None, rd, gather_indx=gi, precision_config=pc1, fused_activation=act)
        return tk.matmul_ogs(inter, w2, None, rd, scatter_indx=si, precision_config=pc2, gammas=rd.gate_scal)

    return forward


# ------------------------------------------------------------------------------------------------------ ours
def build_ours(c, seed: int, device):
    """Random NVFP4 experts as ``Nvfp4MoE.random`` draws them: (w13 interleaved (E, 2I, H), w2 (E, H, I))."""
    from megamoe.layers.moe import _random_experts, _sub_seed
    from megamoe.ops import gemm as gemm_ops

    def gen(tag, j):
        return torch.Generator(device=device).manual_seed(_sub_seed(seed, tag, j))

    h, i, e = c.hidden_size, c.intermediate_size, c.num_experts
    w13 = _random_experts(e, (2 * i, h), h ** -0.5, lambda j: gen(4, j), device, None, "w13")
    w13k = gemm_ops.interleave_gate_up(w13)
    del w13
    w2 = _random_experts(e, (h, i), i ** -0.5, lambda j: gen(5, j), device, None, "w2")
    return w13k, w2


def ours_forward_fns(c, w13k, w2, topk_ids, topk_weights, dispatch_bufs):
    """(gemms(x): precomputed dispatch -> gate_up+SwiGLU, down, combine; full(x): dispatch + the same; d)."""
    from megamoe.layers.moe import DISPATCH_KERNEL_MAX_PAIRS
    from megamoe.ops import gemm as gemm_ops
    from megamoe.ops import moe as moe_ops

    t, k = topk_ids.shape
    e, dev = c.num_experts, topk_ids.device
    pairs = t * k
    inter = torch.empty((pairs, c.intermediate_size), dtype=torch.bfloat16, device=dev)
    expert_out = torch.empty((pairs, c.hidden_size), dtype=torch.bfloat16, device=dev)
    out = torch.empty((t, c.hidden_size), dtype=torch.bfloat16, device=dev)
    d0 = moe_ops.dispatch(topk_ids, e)
    backend = "triton" if pairs <= DISPATCH_KERNEL_MAX_PAIRS else "torch"

    def experts(x, d):
        offs = d["expert_offsets"]
        h = gemm_ops.nvfp4_grouped_mm(x, w13k, offs, out=inter, row_index=d["row_index"], activation="swiglu",
                                      swiglu_limit=c.swiglu_limit, max_rows_per_expert=t)
        y = gemm_ops.nvfp4_grouped_mm(h, w2, offs, out=expert_out, max_rows_per_expert=t)
        return moe_ops.combine(y, d["inv_perm"], topk_weights, out=out)

    def gemms(x):
        return experts(x, d0)

    def full(x):
        return experts(x, moe_ops.dispatch(topk_ids, e, buffers=dispatch_bufs, backend=backend))

    return gemms, full, d0


def bf16_weights(c, w13k, w2, chunk: int = CHUNK_EXPERTS):
    """(E, H, 2I) [gate | up] and (E, I, H) bf16 K-major views of the dequantized experts (bench_moe's layout)."""
    from megamoe.ops.quantize import dequantize

    e, i, h = c.num_experts, c.intermediate_size, c.hidden_size
    w13 = torch.empty((e, 2 * i, h), dtype=torch.bfloat16, device=w2.data.device)
    w2b = torch.empty((e, h, i), dtype=torch.bfloat16, device=w2.data.device)
    for a in range(0, e, chunk):
        b = min(e, a + chunk)
        w = dequantize(_expert_range(w13k, a, b), torch.bfloat16)
        w13[a:b, :i], w13[a:b, i:] = w[:, 0::2], w[:, 1::2]  # de-interleave to [gate; up]
        dequantize(_expert_range(w2, a, b), torch.bfloat16, out=w2b[a:b])
    return w13.transpose(1, 2), w2b.transpose(1, 2)


def bf16_forward_fn(c, w13b, w2b, d, topk_weights):
    from megamoe.ops import moe as moe_ops
    from megamoe.reference.moe import swiglu

    i = c.intermediate_size

    def forward(x):
        xs = x.index_select(0, d["row_index"])
        hh = torch._grouped_mm(xs, w13b, offs=d["expert_offsets"])
        act = swiglu(hh[:, :i], hh[:, i:], c.swiglu_limit)
        y = torch._grouped_mm(act, w2b, offs=d["expert_offsets"])
        return moe_ops.combine(y, d["inv_perm"], topk_weights)

    return forward


# ------------------------------------------------------------------------------------------------- checks
def reference_outputs(c, x, topk_ids, topk_weights, w13k, w2):
    """float32 (ours, peer-style) outputs on our decoded weights; per touched expert (small T only)."""
    from megamoe.ops.quantize import dequantize
    from megamoe.reference.moe import swiglu

    t, h = x.shape
    lim = c.swiglu_limit
    ours = torch.zeros((t, h), dtype=torch.float32, device=x.device)
    peer = torch.zeros_like(ours)
    for e in torch.unique(topk_ids).tolist():
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        w13 = dequantize(_expert_range(w13k, e, e + 1), torch.float32)[0]  # (2I, H) interleaved
        w2e = dequantize(_expert_range(w2, e, e + 1), torch.float32)[0]  # (H, I)
        hh = x[tok].float() @ w13.t()
        gate, up = hh[:, 0::2], hh[:, 1::2]
        wt = topk_weights[tok, slot].float()[:, None]
        ours.index_add_(0, tok, wt * (swiglu(gate, up, lim) @ w2e.t()))
        g = gate.clamp(max=lim) if lim is not None else gate
        u = up.clamp(-lim, lim) if lim is not None else up
        peer.index_add_(0, tok, wt * ((g * torch.sigmoid(PEER_SWIGLU_ALPHA * g) * (u + 1)) @ w2e.t()))
    return ours, peer


def rel_err(a, b) -> float:
    b = b.float()
    return float((a.float() - b).norm() / b.norm().clamp_min(1e-30))


# ----------------------------------------------------------------------------------------------------- bench
def _graph(fn, static_in):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn(static_in)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(static_in)
    torch.cuda.synchronize()
    return g, out


def _time(g, rep_ms: int) -> float:
    import triton.testing

    return triton.testing.do_bench(g.replay, warmup=5, rep=rep_ms, return_mode="median") * 1e3


def _is_cuda_fault(e: BaseException) -> bool:
    msg = str(e)
    return any(s in msg for s in ("CUDA error", "illegal memory", "device-side assert", "unspecified launch"))


def floor_terms(c, t: int, touched: int, expert_bytes: int):
    k, h, i = c.top_k, c.hidden_size, c.intermediate_size
    nbytes = touched * expert_bytes + 2 * t * h * 2 + 2 * t * k * (i + h) * 2
    flops = 2.0 * t * k * 3 * h * i
    return flops, max(nbytes / HBM_BYTES_PER_S, flops / BF16_FLOPS) * 1e6


def estimate_config_s(c, tokens, routings, peer: bool, bf16: bool, variants: int, rep_ms: int) -> dict:
    """A rough device-time guess (seconds), printed before each config; the real times are printed as it runs."""
    e, h, i, k = c.num_experts, c.hidden_size, c.intermediate_size, c.top_k
    w_gb = e * 3 * h * i * 0.5625 / 1e9
    build = 5 + 2.0 * w_gb * (1 + (1.5 if peer else 0) + (1 if bf16 else 0))
    compile_s = 60 * variants + (40 if peer else 0)
    per = 0.0
    for t in tokens:
        _, fl = floor_terms(c, t, min(e, t * k), 3 * h * i * 9 // 16)
        call_ms = 3 * fl / 1e3
        fns = 2 * variants + (1 if peer else 0) + (1 if bf16 else 0)
        per += len(routings) * (1.0 + fns * (0.3 + max(rep_ms + 5, 12 * call_ms) / 1e3))
    return {"build_s": round(build), "compile_s": round(compile_s), "points_s": round(per),
            "total_s": round(build + compile_s + per)}


def bench_config(name, c, tokens, routings, args, tk, variants, deadline, progress):
    from megamoe.ops import errors
    from megamoe.ops import gemm as gemm_ops
    from megamoe.layers.moe import dispatch_buffers

    dev = torch.device("cuda")
    errors.error_word(dev)  # the device error word exists before any capture (as the layer makes sure)
    rows, notes, fatal = [], [], False
    t0 = time.time()
    w13k, w2 = build_ours(c, args.seed, dev)
    expert_bytes = (w13k.nbytes() + w2.nbytes()) // c.num_experts
    print(f"{name}: our NVFP4 experts built in {time.time() - t0:.0f} s", flush=True)
    # --both-interleave: the second variant reads copies with 4 rows interleaved per 128-K step (the peer and the
    # references keep the row-major ones)
    w_il = (w13k.interleave_rows(4), w2.interleave_rows(4)) if (args.both_interleave or args.interleaved) else None
    peer = None
    if tk is not None:
        t1 = time.time()
        try:
            tk.opt_flags.update_opt_flags_constraints({"split_k": 1})
            pw1, pc1 = build_peer_weights(tk, w13k)
            pw2, pc2 = build_peer_weights(tk, w2)
            peer = (pw1, pc1, pw2, pc2)
            torch.cuda.synchronize()
            print(f"{name}: peer MXFP4 weights built in {time.time() - t1:.0f} s", flush=True)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            notes.append(f"peer weights failed: {type(e).__name__}: {e}")
            fatal = _is_cuda_fault(e)
        torch.cuda.empty_cache()
    bf16 = None
    if args.bf16 and not fatal:
        need = c.num_experts * 3 * c.hidden_size * c.intermediate_size * 2
        free, _ = torch.cuda.mem_get_info()
        peak_act = max(tokens) * c.top_k * (2 * c.intermediate_size + 2 * c.hidden_size) * 2 * 2
        if need + peak_act + (6 << 30) > free:
            notes.append(f"bf16 rows skipped: {need / 1e9:.0f} GB of bf16 weights + activations do not fit in "
                         f"{free / 1e9:.0f} GB free")
            print(f"{name}: {notes[-1]}", flush=True)
        else:
            t2 = time.time()
            bf16 = bf16_weights(c, w13k, w2)
            print(f"{name}: bf16 weights built in {time.time() - t2:.0f} s", flush=True)
    switch, alt, _ = route_switch(switch_kind(args))
    switch_saved = getattr(gemm_ops, switch, None)  # None: not a megamoe.ops.gemm flag (--both-interleave)
    for ri, kind in enumerate(routings):
        for t in tokens:
            if fatal:
                break
            if time.time() > deadline:
                notes.append(f"budget: {kind} {t} tokens and later points not run")
                print(notes[-1], flush=True)
                return rows, notes, fatal
            tp = time.time()
            gen = torch.Generator().manual_seed(args.seed * 1000003 + ri * 100003 + t)
            weights, ids = (v.to(dev) for v in routing(kind, t, c.num_experts, c.top_k, gen))
            x = torch.randn(t, c.hidden_size, generator=gen).to(torch.bfloat16).to(dev)
            touched = int(torch.unique(ids).numel())
            flops, floor_us = floor_terms(c, t, touched, expert_bytes)
            row = {"config": c.name, "routing": kind, "tokens": t, "experts_touched": touched,
                   "max_rows_per_expert": int(torch.bincount(ids.flatten().long()).max()), "floor_us": floor_us,
                   "flops": flops, "target": target_speedup(t), "errors": []}
            check = t <= 8
            ref = reference_outputs(c, x, ids, weights, w13k, w2) if check else None
            bufs = dispatch_buffers(t * c.top_k, c.num_experts, dev)
            d0 = None
            for v in variants:
                suffix = alt if (v and len(variants) > 1) else ""
                try:
                    if switch_saved is not None:
                        setattr(gemm_ops, switch, v)
                    wa, wb = w_il if (w_il is not None and (v or args.interleaved)) else (w13k, w2)
                    gemms, full, d0 = ours_forward_fns(c, wa, wb, ids, weights, bufs)
                    g, out = _graph(gemms, x)
                    g.replay()
                    torch.cuda.synchronize()
                    if check:
                        row[f"ours{suffix}_rel_err"] = rel_err(out, ref[0])
                    if not suffix:
                        row["routes"] = _routes(gemm_ops, x, w13k, w2, t, c)
                    row[f"ours{suffix}_us"] = _time(g, args.rep_ms)
                    del g
                    g, _ = _graph(full, x)
                    row[f"ours{suffix}_disp_us"] = _time(g, args.rep_ms)
                    del g
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    row["errors"].append(f"ours{suffix}: {type(e).__name__}: {e}")
                    fatal = fatal or _is_cuda_fault(e)
                finally:
                    if switch_saved is not None:
                        setattr(gemm_ops, switch, switch_saved)
            if peer is not None and not fatal:
                try:
                    rd, gi, si = peer_routing_objects(tk, ids, weights, c.num_experts)
                    fn = peer_forward_fn(tk, peer[0], peer[1], peer[2], peer[3], rd, gi, si, c.swiglu_limit)
                    g, out = _graph(fn, x)
                    g.replay()
                    torch.cuda.synchronize()
                    if tuple(out.shape) != (t, c.hidden_size):
                        raise RuntimeError(f"peer output shape {tuple(out.shape)}, expected {(t, c.hidden_size)}")
                    row["peer_finite"] = bool(torch.isfinite(out).all())
                    if check:
                        row["peer_rel_err"] = rel_err(out, ref[1])
                    row["peer_us"] = _time(g, args.rep_ms)
                    del g, out
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    row["errors"].append(f"peer: {type(e).__name__}: {e}")
                    fatal = fatal or _is_cuda_fault(e)
            if bf16 is not None and d0 is not None and not fatal:
                try:
                    g, out = _graph(bf16_forward_fn(c, bf16[0], bf16[1], d0, weights), x)
                    row["bf16_us"] = _time(g, args.rep_ms)
                    del g, out
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    row["errors"].append(f"bf16: {type(e).__name__}: {e}")
                    fatal = fatal or _is_cuda_fault(e)
            _derive(row, variants)
            row["point_s"] = round(time.time() - tp, 1)
            rows.append(row)
            progress(row)
            torch.cuda.empty_cache()
    if fatal:
        notes.append("stopped after a CUDA fault (the context is unusable); rows above are complete")
    return rows, notes, fatal


SWITCHES = {"ws": ("WS_ROUTE", "_ws", "WS"), "pipe": ("PIPE_ROUTE", "_pipe", "pipe"),
            "tail": ("PIPE_TAIL", "_tail", "tail"), "interleave": ("ROW_INTERLEAVE", "_il", "rows x4"),
            "after-decode": ("PIPE_AFTER_DECODE", "_pad", "pipe after decode"),
            "concurrent": ("BANDS_CONCURRENT", "_conc", "bands concurrent"),
            "list": ("PIPE_LIST", "_list", "tile lists")}


def route_switch(kind: str):
    """The second variant of ours (``kind`` "ws", "pipe" or "tail"): (the megamoe.ops.gemm flag it sets, its
    row-key suffix, its column label)."""
    return SWITCHES[kind]


def switch_kind(args) -> str:
    if args.both_interleave:
        return "interleave"
    if args.both_after_decode:
        return "after-decode"
    if args.both_concurrent:
        return "concurrent"
    if args.both_list:
        return "list"
    return "tail" if args.both_tail else "pipe" if (args.pipe or args.both_pipe) else "ws"


def _routes(gemm_ops, x, w13k, w2, t, c):
    """Which of our kernels each GEMM takes (host decision; informational)."""
    try:
        pairs = t * c.top_k
        return [gemm_ops.decode_route(x, w13k.data, pairs, c.num_experts, 2 * c.intermediate_size, c.hidden_size),
                gemm_ops.decode_route(x.new_empty((1, c.intermediate_size)), w2.data, pairs, c.num_experts,
                                      c.hidden_size, c.intermediate_size)]
    except Exception as e:  # noqa: BLE001
        return [f"? ({type(e).__name__})"]


def _derive(row, variants):
    for key in ["ours"] + [f"ours{alt}" for _, alt, _ in SWITCHES.values()]:
        us = row.get(f"{key}_us")
        if us:
            row[f"{key}_tflops"] = row["flops"] / us / 1e6
            if row.get("peer_us"):
                row[f"speedup{key[4:]}"] = row["peer_us"] / us
                disp = row.get(f"{key}_disp_us")
                if disp:
                    row[f"speedup{key[4:]}_disp"] = row["peer_us"] / disp
    if row.get("peer_us"):
        row["peer_tflops"] = row["flops"] / row["peer_us"] / 1e6
    best = max((row.get(k) or 0.0) for k in ["speedup"] + [f"speedup{alt}" for _, alt, _ in SWITCHES.values()])
    row["meets"] = bool(best >= row["target"]) if row.get("peer_us") else None
    if row.get("ours_us"):
        row["ours_over_floor"] = row["ours_us"] / row["floor_us"]


def _fmt(v, spec="{:.1f}"):
    return "-" if v is None else spec.format(v)


def write_results(rows, meta, out_dir, tag):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{tag}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    both = meta["ws_variants"] == [False, True]
    _, alt, label = next(v for v in SWITCHES.values() if v[0] == meta.get("switch", "WS_ROUTE"))
    head = ["config", "routing", "tokens", "touched", "max rows/expert", "ours us", "ours+disp us"]
    if both:
        head += [f"ours {label} us", f"ours {label}+disp us"]
    head += ["peer us", "bf16 us", "floor us", "ours TFLOP/s", "peer TFLOP/s", "ours/peer", "ours+disp/peer"]
    if both:
        head += [f"{label}/peer"]
    head += ["target", "meets", "ours rel err", "peer rel err", "routes (L1, L2)", "errors"]
    lines = [
        "# MoE experts: megamoe NVFP4 vs triton_kernels MXFP4 (CUDA-graph replay, L2 flushed)", "",
        f"- date: {meta['date']}; device: {meta['device']}; torch {meta['torch']}; triton {meta['triton']}",
        f"- command: `{meta['command']}`",
        f"- peer: {meta['peer']}",
        f"- ours {meta.get('switch', 'WS_ROUTE')}: {meta['ws_variants']}",
        "- times: `triton.testing.do_bench(graph.replay, return_mode='median')` in us; do_bench clears L2 before "
        f"every timed replay ({meta.get('flush', 'write')} flush). ours ="
        " gate_up+SwiGLU (gather fused) + down + combine, dispatch precomputed as the "
        "peer's metadata is; ours+disp adds our dispatch from the ids; peer = matmul_ogs gate_up + swiglu (gather) "
        "+ down (scatter, gammas, top-k sum); bf16 = torch._grouped_mm on dequantized weights, same dispatch; "
        "floor = max(touched NVFP4 experts + activations / 3.0 TB/s, FLOPs / 749 TFLOP/s)",
        "- speed-up = peer us / ours us; target 1.2x at <= 64 tokens (issue 11), 1.25x at >= 512 (issue 10); "
        "meets uses the better WS variant when both ran. rel err (T <= 8): each side vs a float32 reference on "
        "its own decoded weights and SwiGLU (peer: MXFP4 re-quantized, ~0.1 expected)", "",
        "| " + " | ".join(head) + " |", "|" + "---|" * len(head),
    ]
    for r in rows:
        cells = [r["config"], r["routing"], str(r["tokens"]), str(r["experts_touched"]),
                 str(r["max_rows_per_expert"]), _fmt(r.get("ours_us")), _fmt(r.get("ours_disp_us"))]
        if both:
            cells += [_fmt(r.get(f"ours{alt}_us")), _fmt(r.get(f"ours{alt}_disp_us"))]
        cells += [_fmt(r.get("peer_us")), _fmt(r.get("bf16_us")), _fmt(r.get("floor_us")),
                  _fmt(r.get("ours_tflops")), _fmt(r.get("peer_tflops")), _fmt(r.get("speedup"), "{:.2f}x"),
                  _fmt(r.get("speedup_disp"), "{:.2f}x")]
        if both:
            cells += [_fmt(r.get(f"speedup{alt}"), "{:.2f}x")]
        meets = {True: "yes", False: "no", None: "-"}[r.get("meets")]
        cells += [f"{r['target']:.2f}x", meets, _fmt(r.get("ours_rel_err"), "{:.1e}"),
                  _fmt(r.get("peer_rel_err"), "{:.1e}"), ", ".join(r.get("routes", [])),
                  "; ".join(e.replace("|", "/")[:160] for e in r["errors"])]
        lines.append("| " + " | ".join(cells) + " |")
    if meta.get("notes"):
        lines += ["", "Notes:"] + [f"- {n}" for n in meta["notes"]]
    path = os.path.join(out_dir, f"{tag}.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def build_parser():
    from graph_timing import add_flush_argument  # benchmarks/ (on sys.path above)

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="v4-flash,v4-pro", help="comma list of: " + ", ".join(CONFIGS))
    p.add_argument("--tokens", default=None, help="comma list (default: per config, see above)")
    p.add_argument("--routings", default=",".join(ROUTINGS))
    ws = p.add_mutually_exclusive_group()
    ws.add_argument("--ws", action="store_true", help="time ours with megamoe.ops.gemm.WS_ROUTE = True")
    ws.add_argument("--both-ws", action="store_true", help="time ours with WS_ROUTE off and on")
    ws.add_argument("--pipe", action="store_true", help="time ours with megamoe.ops.gemm.PIPE_ROUTE = True")
    ws.add_argument("--both-pipe", action="store_true", help="time ours with PIPE_ROUTE off and on")
    ws.add_argument("--both-tail", action="store_true", help="time ours with PIPE_TAIL (tail-tile bands) off and on")
    ws.add_argument("--both-interleave", action="store_true",
                    help="time ours on row-major experts and on a copy with NVFP4Tensor.row_interleave 4")
    ws.add_argument("--both-after-decode", action="store_true",
                    help="time ours with megamoe.ops.gemm.PIPE_AFTER_DECODE off and on (use with --interleaved)")
    ws.add_argument("--both-concurrent", action="store_true",
                    help="time ours with megamoe.ops.gemm.BANDS_CONCURRENT off and on")
    ws.add_argument("--both-list", action="store_true",
                    help="time ours with megamoe.ops.gemm.PIPE_LIST (bands above 32 rows as two tile-list launches) "
                         "off and on")
    p.add_argument("--interleaved", action="store_true",
                   help="ours reads copies with NVFP4Tensor.row_interleave 4 in every variant (the layer's default)")
    p.add_argument("--no-peer", action="store_true")
    p.add_argument("--no-bf16", dest="bf16", action="store_false")
    p.add_argument("--quick", action="store_true", help="smoke run: v4-flash, 8 and 512 tokens, uniform")
    p.add_argument("--rep-ms", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=540.0, help="start no new point after this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=os.environ.get("OUT") or os.path.join(_HERE, "results"))
    p.add_argument("--tag", default="peer_v1")
    add_flush_argument(p)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.configs, args.tokens = QUICK["configs"], args.tokens or QUICK["tokens"]
        args.routings, args.rep_ms = QUICK["routings"], min(args.rep_ms, QUICK["rep_ms"])
    configs = [s for s in args.configs.split(",") if s]
    for name in configs:
        if name not in CONFIGS:
            print(f"--configs: unknown {name!r}; expected some of {sorted(CONFIGS)}")
            return 2
    routings = [s for s in args.routings.split(",") if s]
    for kind in routings:
        if kind not in ROUTINGS:
            print(f"--routings: unknown {kind!r}; expected some of {list(ROUTINGS)}")
            return 2
    if not torch.cuda.is_available():
        print("bench_peer: needs a CUDA GPU (none found); nothing run")
        return 2
    import triton

    from graph_timing import use_flush_mode

    use_flush_mode(args.flush)

    from megamoe.models.config import PRESETS

    start = time.time()
    deadline = start + args.budget_s
    both = (args.both_ws or args.both_pipe or args.both_tail or args.both_interleave or args.both_after_decode
            or args.both_concurrent or args.both_list)
    variants = [False, True] if both else [bool(args.ws or args.pipe)]
    switch, alt, _ = route_switch(switch_kind(args))
    tk, where = (None, "disabled (--no-peer)") if args.no_peer else load_peer()
    peer_desc = f"triton_kernels from {where}" if tk is not None else f"not run: {where}"
    print(f"peer: {peer_desc}", flush=True)
    command = "python " + " ".join([os.path.relpath(os.path.abspath(__file__), _REPO)] + list(
        sys.argv[1:] if argv is None else argv))
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "command": command, "peer": peer_desc, "ws_variants": variants, "switch": switch, "rep_ms": args.rep_ms,
            "flush": args.flush,
            "timing": "do_bench median of CUDA-graph replays, L2 cleared before each", "notes": [],
            "rooflines": {"hbm_bytes_per_s": HBM_BYTES_PER_S, "bf16_flops": BF16_FLOPS}, "config_s": {}}
    rows, path = [], None

    def progress(r):
        nonlocal path
        print(f"  {r['routing']:9s} {r['tokens']:6d} tok: ours {_fmt(r.get('ours_us'))} us "
              f"(+disp {_fmt(r.get('ours_disp_us'))}"
              + (f", {switch} {_fmt(r.get(f'ours{alt}_us'))}" if len(variants) > 1 else "")
              + f"), peer {_fmt(r.get('peer_us'))}, bf16 {_fmt(r.get('bf16_us'))}, floor {r['floor_us']:.1f}; "
              f"ours/peer {_fmt(r.get('speedup'), '{:.2f}x')} (target {r['target']:.2f}x); "
              f"rel ours {_fmt(r.get('ours_rel_err'), '{:.1e}')} peer {_fmt(r.get('peer_rel_err'), '{:.1e}')}; "
              f"{r['point_s']} s" + (f"; ERRORS {r['errors']}" if r["errors"] else ""), flush=True)
        rows.append(r)
        path = write_results(rows, meta, args.out_dir, args.tag)  # partial results survive a timeout

    for name in configs:
        c = PRESETS[CONFIGS[name]]
        tokens = ([int(s) for s in args.tokens.split(",") if s] if args.tokens else list(DEFAULT_TOKENS[name]))
        est = estimate_config_s(c, tokens, routings, tk is not None, args.bf16, len(variants), args.rep_ms)
        print(f"{name}: tokens {tokens}, routings {routings}; rough estimate {est} "
              f"({time.time() - start:.0f} s elapsed of a {args.budget_s:.0f} s budget)", flush=True)
        tc = time.time()
        try:
            _, notes, fatal = bench_config(name, c, tokens, routings, args, tk, variants, deadline, progress)
        except Exception as e:  # noqa: BLE001  (e.g. out of memory building the weights)
            traceback.print_exc()
            notes, fatal = [f"{type(e).__name__}: {e}"], _is_cuda_fault(e)
        meta["notes"] += [f"{name}: {n}" for n in notes]
        meta["config_s"][name] = {"estimate": est, "measured_s": round(time.time() - tc)}
        print(f"{name}: done in {time.time() - tc:.0f} s (estimate {est['total_s']} s)", flush=True)
        path = write_results(rows, meta, args.out_dir, args.tag)
        torch.cuda.empty_cache()
        if fatal:
            break
    if path:
        print(open(path).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
