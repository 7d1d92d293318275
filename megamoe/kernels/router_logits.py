"""Router logits ``x @ gate^T`` (T, E) in float32 on the tensor cores, for prefill-sized batches.

One kernel, one launcher (:func:`launch_router_logits`). The torch path of the router computes
``x.float() @ gate.float().T``: an fp32 copy of x and a CUDA-core SGEMM (V4-Flash at 4096 tokens: 53 + 179 us; V4-Pro
95 + 499 us on the H100, ~5% of the MoE layer; ``benchmarks/results/gpu_check_v23/probe_moe_prefill_4096.md``).

Numerics (the routing guarantee of ``megamoe.ops.moe.route_dispatch``): x is bf16 and a bf16 gate is used as is, so
every product ``x_h * w_eh`` is exact in fp32 (8 x 8 significant bits). An fp32 gate is split in the kernel into
three bf16 terms ``w = hi + mid + lo`` (exact for normal values: each term takes the next 8 bits), three products
per element, the two small ones summed apart. The tensor cores sum one ``BLOCK_K`` chunk of products from zero
(their internal adds may truncate: at most ``2u`` relative each); each chunk is then added to the float32 accumulator
by an FMA on the CUDA cores (round to nearest), the DeepSeek-style promotion. So the logit error is at most
``(2 BLOCK_K + H / BLOCK_K + 4) u * sum_h |x_h| |w_eh|`` (~200 u at H = 4096, BLOCK_K = 64; ~300 u at BLOCK_K 128),
well inside the guarantee's ``gamma_H = H u / (1 - H u)``: the selected experts obey
:func:`megamoe.reference.moe.routing_key_bounds`. The bits differ from the SGEMM's (another summation order); the
same bits on every run (fixed tiles and order).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# (BLOCK_T tokens, BLOCK_E experts, BLOCK_K, num_warps, num_stages)
ROUTER_LOGITS_CONFIG = (128, 64, 64, 8, 4)
# Up to SMALL_T_MAX_TOKENS tokens: one warpgroup (m64) and narrower expert tiles, so that more programs share the
# K loop (at 64 tokens the default config runs 4 programs of 64 steps each).
# H100 sweep (gpu_check_v23/h/bench_router_logits.md, 16-256 tokens): (64, 16, 128, 4, 3) 18.0-18.8 us on V4-Flash,
# 27.9-29.0 on V4-Pro; (64, 32, 128, 4, 3) +1.5-2.5 us; the default config 27.5-28.9 / 43.6-45.9.
SMALL_T_MAX_TOKENS = 128
ROUTER_LOGITS_SMALL_T_CONFIG = (64, 16, 128, 4, 3)
#: The largest BLOCK_K of the configs (the error bound's chunk).
MAX_BLOCK_K = max(ROUTER_LOGITS_CONFIG[2], ROUTER_LOGITS_SMALL_T_CONFIG[2])


def select_router_logits_config(num_tokens: int):
    return ROUTER_LOGITS_SMALL_T_CONFIG if num_tokens <= SMALL_T_MAX_TOKENS else ROUTER_LOGITS_CONFIG


@triton.jit
def _router_logits_kernel(x_ptr, w_ptr, out_ptr, one, num_tokens, num_experts, hidden, stride_x, stride_w,
                          stride_o, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                          K_STEPS: tl.constexpr, SPLIT: tl.constexpr, INTERPRET: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    kk = tl.arange(0, BLOCK_K)
    row_ok = rows < num_tokens
    col_ok = cols < num_experts
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_x + kk[None, :]
    w_ptrs = w_ptr + cols.to(tl.int64)[None, :] * stride_w + kk[:, None]  # (BLOCK_K, BLOCK_E): gate^T
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for step in range(K_STEPS):  # a constexpr trip count: software-pipelined on the GPU, a plain loop when interpreted
        k0 = step * BLOCK_K
        k_ok = (k0 + kk) < hidden
        x = tl.load(x_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if SPLIT == 1:
            hi = w
        else:
            hi = w.to(tl.bfloat16)
            rest = w - hi.to(tl.float32)
            mid = rest.to(tl.bfloat16)
            lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
        if INTERPRET:  # the interpreter's bf16 dot is wrong; bf16 values and their products are exact in fp32
            x = x.to(tl.float32)
            hi = hi.to(tl.float32)
            if SPLIT != 1:
                mid = mid.to(tl.float32)
                lo = lo.to(tl.float32)
        part = tl.dot(x, hi)
        if SPLIT != 1:
            small = tl.dot(x, lo)
            small = tl.dot(x, mid, small)
            part = part + small
        # promotion: the chunk's tensor-core sum is added on the CUDA cores (``one`` is 1.0 at run time, so the
        # compiler cannot fold the add into the MMA's accumulator)
        acc = acc + part * one
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :], acc,
             mask=row_ok[:, None] & col_ok[None, :])


def launch_router_logits(x: torch.Tensor, gate_weight: torch.Tensor, out: torch.Tensor | None = None, *,
                         interpreter: bool = False, config=None) -> torch.Tensor:
    """(T, H) bf16 x (unit column stride) and (E, H) bf16/fp32 gate (unit column stride) -> (T, E) float32
    logits (``out`` optional, (T, E) fp32 with unit column stride). Inputs are checked by the caller
    (``megamoe.ops.moe``); ``interpreter``: CPU tensors through Triton's interpreter."""
    num_tokens, hidden = x.shape
    num_experts = gate_weight.shape[0]
    if out is None:
        out = torch.empty((num_tokens, num_experts), dtype=torch.float32, device=x.device)
    if num_tokens == 0 or num_experts == 0:
        return out
    block_t, block_e, block_k, num_warps, num_stages = config or select_router_logits_config(num_tokens)
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(num_experts, block_e))
    _router_logits_kernel[grid](
        x, gate_weight, out, 1.0, num_tokens, num_experts, hidden, x.stride(0), gate_weight.stride(0), out.stride(0),
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=block_k, K_STEPS=triton.cdiv(hidden, block_k),
        SPLIT=1 if gate_weight.dtype == torch.bfloat16 else 3,
        INTERPRET=interpreter, num_warps=num_warps, num_stages=num_stages)
    return out
