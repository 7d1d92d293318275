"""Per-token FP8 E4M3 activation quantizer for the W4A8 GEMMs (one launch, sync-free).

x (M, K) bf16 -> codes (M, K) float8_e4m3fn and one float32 power-of-two scale per row,
``s = pow2ceil(max(amax, 1e-4) / 448)``, ``q = e4m3_rne(clamp(x / s, -448, 448))``; a row holding a NaN or
an Inf gets a NaN scale and zero codes. Bit-identical to
``megamoe.reference.w4a8.quantize_activations_fp8`` (the division by a power of two is an exact multiply by
its reciprocal, built from the exponent bits; the E4M3 rounding is the hardware's ``cvt.rn.satfinite`` on the
GPU and :func:`megamoe.kernels.nvfp4_jit.e4m3_encode` in the interpreter, whose own fp8 cast truncates).

Each program owns ``BLOCK_R`` rows and walks K twice (amax, then quantize; the second pass hits L2).
``MMA_ORDER``: the codes are stored in the FP8 MMA K order of the pipelined W4A8 kernel
(:func:`megamoe.format.mma_order.fp8_mma_k_permutation`, within each 128-element K group) instead of memory order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .nvfp4_jit import e4m3_encode, sign_bit

#: (BLOCK_R rows per program, BLOCK_K columns per step, num_warps).
QUANT_CONFIG = (4, 1024, 4)
INTERPRETER_QUANT_CONFIG = (2, 128, 4)


@triton.jit(do_not_specialize=["num_rows"])
def _fp8_act_quant_kernel(
    x_ptr, q_ptr, s_ptr, num_rows, K, stride_xm, stride_qm,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr, MMA_ORDER: tl.constexpr = False,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < num_rows
    rows64 = rows.to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
    bad = tl.zeros((BLOCK_R,), dtype=tl.int32)
    k0 = 0
    while k0 < K:
        mask = row_mask[:, None] & ((k0 + offs) < K)[None, :]
        x = tl.load(x_ptr + rows64[:, None] * stride_xm + (k0 + offs)[None, :], mask=mask, other=0.0)
        a = tl.abs(x.to(tl.float32))
        bad += tl.sum(((a != a) | (a == float("inf"))).to(tl.int32), 1)
        amax = tl.maximum(amax, tl.max(tl.where(a == a, a, 0.0), 1))
        k0 += BLOCK_K
    t = tl.maximum(amax, 1e-4) * 0.002232142857142857  # float32(1/448), as the reference multiplies
    bits = t.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    exponent = tl.minimum(exponent, 254)  # only reached by non-finite rows, whose scale is NaN below
    scale = (exponent << 23).to(tl.float32, bitcast=True)
    inv = ((254 - exponent) << 23).to(tl.float32, bitcast=True)  # 1 / scale, exact
    ok = bad == 0
    tl.store(s_ptr + rows, tl.where(ok, scale, float("nan")), mask=row_mask)
    k0 = 0
    while k0 < K:
        mask = row_mask[:, None] & ((k0 + offs) < K)[None, :]
        x = tl.load(x_ptr + rows64[:, None] * stride_xm + (k0 + offs)[None, :], mask=mask, other=0.0)
        v = x.to(tl.float32) * inv[:, None]
        v = tl.minimum(tl.maximum(v, -448.0), 448.0)
        v = tl.where(ok[:, None], v, 0.0)
        if INTERPRET:
            code = e4m3_encode(tl.abs(v)) | (sign_bit(v) << 7)
            code = code.to(tl.uint8)
        else:
            code = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        cols = k0 + offs
        if MMA_ORDER:  # memory m = 32q + 8i + 4g + c of a 128-K group -> position 32i + 16g + 4q + c
            m = cols % 128
            cols = cols - m + 32 * ((m >> 3) & 3) + 16 * ((m >> 2) & 1) + 4 * (m >> 5) + (m & 3)
        tl.store(q_ptr + rows64[:, None] * stride_qm + cols[None, :], code, mask=mask)
        k0 += BLOCK_K


def launch_fp8_act_quant(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, *,
                         interpreter: bool = False, mma_order: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) bf16 (unit last stride) -> codes (M, K) float8_e4m3fn, scales (M,) float32 (both written).
    ``mma_order``: codes in the FP8 MMA K order (K % 128 == 0; module docstring).

    Inputs already validated by the caller (``megamoe.ops.gemm``); no host read of device values.
    """
    num_rows, k = x.shape
    if num_rows == 0 or k == 0:
        return codes, scales
    block_r, block_k, num_warps = INTERPRETER_QUANT_CONFIG if interpreter else QUANT_CONFIG
    block_k = min(block_k, triton.next_power_of_2(k))
    q_u8 = codes.view(torch.uint8)
    _fp8_act_quant_kernel[(triton.cdiv(num_rows, block_r),)](
        x, q_u8, scales, num_rows, k, x.stride(0), q_u8.stride(0),
        BLOCK_R=block_r, BLOCK_K=block_k, INTERPRET=interpreter, num_warps=num_warps,
        **({"MMA_ORDER": True} if mma_order else {}),
    )
    return codes, scales
