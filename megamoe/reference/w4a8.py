"""Pure-PyTorch reference of the W4A8 numerics (NVFP4 weights x FP8 E4M3 activations on FP8 tensor cores).

The oracle of ``megamoe/kernels/fp8_act_quant.py`` (bit-exact) and ``megamoe/kernels/gemm/nvfp4_w4a8.py``
(float32 summation noise), and the CPU path of ``mode="w4a8"``.

Activations (:func:`quantize_activations_fp8`): one scale per token (the official ``act_quant`` rule with
the block = the whole row): ``s = pow2ceil(max(amax, 1e-4) / 448)`` (float32, a power of two),
``q = e4m3_rne(clamp(x / s, -448, 448))``; the division by a power of two is exact, so each element is
rounded once. Per token rather than per (token, 128-K block): the measured error is the same (E4M3's range,
2**-9..448, holds 3000x "massive activations" in normal precision; benchmarks/NOTES_gemm.md "w4a8 v1") and
the token scale is applied once in the epilogue instead of once per K step. A row holding a NaN or an Inf
gets a NaN scale and zero codes (its outputs are NaN, as a non-finite input makes them in w4a16).

Weights (:func:`weight_operands`): the NVFP4 codes are turned into FP8 operands per (weight row, 128-K
block), never stored (the kernel decodes them in registers). With ``s_j`` the eight E4M3 block scales of the
block and ``S = pow2ceil(max_j |s_j|)`` (a power of two >= every |s_j|; S = 1 when all are 0), the operand of an
element of group j is ``e4m3_rne(e2m1(code) * s_j / S)``. ``e2m1 * s_j / S`` is exact in float32 (and in
float16: at most 6 significant bits, >= 2**-19), so this is one round-to-nearest-even to E4M3: exact when the
product has <= 4 significant bits (codes 0, 0.5, 1, 2, 4 always; 1.5, 3, 6 when s_j's mantissa is even),
otherwise a tie rounded to even, |error| = half an E4M3 ulp <= 2**-4 relative; operands below 2**-6 (groups
more than ~2**5 below their block's largest scale) fall into E4M3 subnormals (absolute error <= 2**-10 * S).
A NaN block scale (0x7F / 0xFF) makes S NaN (operands 0): the row's outputs are NaN, as in the float32
reference.

GEMM (:func:`w4a8_grouped_mm`): per 128-K block b, the FP8 products are summed in float32 (``partial_b``)
and promoted: ``y[m, n] = global_scale[n] * s_x[m] * sum_b partial_b[m, n] * S[n, b]``; SwiGLU + clamp in
float32, one bf16 rounding. Since S and s_x are powers of two, this equals ``x_q @ w_eff.T`` with the exact
effective weight ``w_eff = operand * S * global_scale`` (:func:`effective_weight`), used by the layer
reference. Requires K % 128 == 0.
"""
from __future__ import annotations

import torch

from ..format.e2m1 import e2m1_decode
from ..format.tensor import NVFP4Tensor
from .gemm import ACTIVATIONS, _expert_global_scale, _finish, swiglu_reference
from .v4_numerics import FP8_AMAX_FLOOR, FP8_E4M3_MAX, pow2_ceil

#: K elements per weight-scale promotion step (and the K granularity w4a8 requires).
W4A8_BLOCK_K = 128
#: NVFP4 block scales per 128-K block.
GROUPS_PER_BLOCK = W4A8_BLOCK_K // 16


def quantize_activations_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) bf16/fp32 -> (codes (M, K) float8_e4m3fn, scales (M,) float32 powers of two)."""
    g = x.float()
    finite = torch.isfinite(g).all(-1)
    amax = torch.where(finite, g.abs().amax(-1), 0.0).clamp_min(FP8_AMAX_FLOOR)
    scale = pow2_ceil(amax * torch.tensor(1.0 / FP8_E4M3_MAX, dtype=torch.float32))
    q = (g / scale[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    q = torch.where(finite[..., None], q, 0.0).to(torch.float8_e4m3fn)
    scale = torch.where(finite, scale, float("nan"))
    return q, scale


def dequantize_activations_fp8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_activations_fp8`: (M, K) float32 ``code * scale``."""
    return codes.float() * scales[..., None]


def weight_operands(data: torch.Tensor, block_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 bytes -> FP8 operands and per-(row, 128-K block) power-of-two scales.

    data (..., N, K//2) uint8 (low nibble = even element), block_scale (..., N, K//16) float8_e4m3fn,
    K % 128 == 0. Returns (operands (..., N, K) float8_e4m3fn, S (..., N, K // 128) float32) with
    ``operand * S == e2m1 * block_scale`` up to one E4M3 rounding (module docstring).
    """
    codes = torch.stack((data & 0xF, data >> 4), dim=-1).flatten(-2)
    values = e2m1_decode(codes).float()  # (..., N, K)
    s = block_scale.float().unflatten(-1, (-1, GROUPS_PER_BLOCK))  # (..., N, K//128, 8)
    nan = torch.isnan(s).any(-1)
    smax = torch.where(nan, 0.0, s.nan_to_num(0.0).abs().amax(-1))  # |s|: negative scales flip signs
    big_s = torch.where(smax > 0, pow2_ceil(torch.where(smax > 0, smax, 1.0)), 1.0)
    ratio = torch.where(nan[..., None], 0.0, s.nan_to_num(0.0) / big_s[..., None])  # exact (power of two)
    ops = values.unflatten(-1, (-1, GROUPS_PER_BLOCK, 16)) * ratio[..., None]
    ops = ops.flatten(-3).to(torch.float8_e4m3fn)
    return ops, torch.where(nan, float("nan"), big_s)


def effective_weight(weight: NVFP4Tensor) -> torch.Tensor:
    """The float32 weight the W4A8 kernels multiply: ``operand * S * global_scale`` (exact), (..., N, K)."""
    ops, big_s = weight_operands(weight.data, weight.block_scale)
    w = ops.float().unflatten(-1, (-1, W4A8_BLOCK_K)) * big_s[..., None]
    return w.flatten(-2) * weight.global_scale.float()


def fake_quant_activations(x: torch.Tensor) -> torch.Tensor:
    """x -> bf16 (as on the fast path) -> FP8 per (row, 128 block) -> float32 values."""
    return dequantize_activations_fp8(*quantize_activations_fp8(x.to(torch.bfloat16)))


def _promoted_mm(xq: torch.Tensor, xs: torch.Tensor, ops: torch.Tensor, big_s: torch.Tensor) -> torch.Tensor:
    """s_x[:, None] * sum_b (xq_b @ ops_b.T) * S[:, b] in float32: (M, N)."""
    m, n = xq.shape[0], ops.shape[0]
    y = torch.zeros((m, n), dtype=torch.float32, device=xq.device)
    for b in range(xq.shape[1] // W4A8_BLOCK_K):
        cols = slice(b * W4A8_BLOCK_K, (b + 1) * W4A8_BLOCK_K)
        partial = xq[:, cols].float() @ ops[:, cols].float().t()
        y += partial * big_s[None, :, b]
    return y * xs[:, None]


def w4a8_linear(x, weight: NVFP4Tensor, bias=None, *, out=None) -> torch.Tensor:
    """Reference W4A8 ``x @ W.T (+ bias)``: x (M, K) bf16, weight NVFP4Tensor (N, K) -> (M, N) bf16."""
    xq, xs = quantize_activations_fp8(x)
    ops, big_s = weight_operands(weight.data, weight.block_scale)
    gs = weight.global_scale.float()
    y = _promoted_mm(xq, xs, ops, big_s) * (gs.reshape(1, -1) if gs.dim() else gs)
    if bias is not None:
        y = y + bias.float()
    return _finish(y, out)


def w4a8_grouped_mm(x, weight: NVFP4Tensor, expert_offsets, *, out=None, row_index=None, activation=None,
                    swiglu_limit=None) -> torch.Tensor:
    """Reference W4A8 grouped GEMM (same contract as ``megamoe.reference.gemm.nvfp4_grouped_mm``).

    x (S, K) bf16 is quantized per source row, then gathered by ``row_index`` (an out-of-range index reads
    zero codes with scale 0: the row is dropped), rows sorted by expert, padding rows are zero.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    xq, xs = quantize_activations_fp8(x)
    xq = xq.float()
    if row_index is not None:
        idx = row_index.long()
        ok = (idx >= 0) & (idx < x.shape[0])
        safe = torch.where(ok, idx, 0)
        if x.shape[0]:
            xq = torch.where(ok[:, None], xq[safe], 0.0)
            xs = torch.where(ok, xs[safe], 0.0)
        else:
            xq = xq.new_zeros((idx.shape[0], x.shape[1]))
            xs = xs.new_zeros((idx.shape[0],))
    num_rows, (num_experts, n) = xq.shape[0], weight.shape[:2]
    y = torch.zeros((num_rows, n), dtype=torch.float32, device=x.device)
    ends = [min(max(int(v), 0), num_rows) for v in expert_offsets.tolist()]
    start = 0
    for e in range(num_experts):
        end = max(ends[e], start)
        if end > start:
            ops, big_s = weight_operands(weight.data[e], weight.block_scale[e])
            gs = _expert_global_scale(weight.global_scale, e).float()
            part = _promoted_mm(xq[start:end], xs[start:end], ops, big_s)
            y[start:end] = part * (gs.reshape(1, -1) if gs.dim() else gs)
        start = end
    if activation == "swiglu":
        y = swiglu_reference(y, swiglu_limit)
    return _finish(y, out)
