"""DeepSeek-V4 elementwise numerics in pure PyTorch: norms, RoPE, Hadamard, FP8/FP4 simulation, hyper-connections.

Each function restates one piece of the official DeepSeek-V4 ``inference/model.py`` / ``kernel.py`` math
(read from a byte-identical public copy of the V4-Flash ``inference/model.py``; the kernel semantics from public
pure-PyTorch ports of ``kernel.py``). They are device-agnostic, sync-free and CUDA-graph safe, so the fast
path calls them directly for the small per-token steps (a few (T, 512) rows per layer) as well as the
references. Where each one comes from:

=============================  ===================================================================================
function                       official source
=============================  ===================================================================================
:func:`rms_norm`               ``RMSNorm.forward``: ``(weight * (x.float() * rsqrt(mean(x^2) + eps))).to(dtype)``
:func:`rope_frequencies`       ``precompute_freqs_cis`` (YaRN blend when ``original_seq_len > 0``)
:func:`apply_rope`             ``apply_rotary_emb``: adjacent pairs (2i, 2i+1) of the last ``rope_dim`` dims as
                               complex numbers, times ``freqs_cis`` (conjugate when ``inverse``), float32
:func:`hadamard_rotate`        ``rotate_activation``: ``hadamard_transform(x, scale=d**-0.5)``
:func:`fp8_block_simulate`     kernel ``act_quant(x, block, "ue8m0", inplace=True)``: power-of-two scale
                               ``2**ceil(log2(max(amax, 1e-4) / 448))``, E4M3 round-to-nearest-even
:func:`fp4_block_simulate`     kernel ``fp4_act_quant(x, 32, inplace=True)``: power-of-two scale
                               ``2**ceil(log2(max(amax, 6 * 2**-126) / 6))``, E2M1 round-to-nearest-even
:func:`hc_split_sinkhorn`      kernel ``hc_split_sinkhorn``: sigmoid pre/post weights, Sinkhorn-normalised comb
:func:`hc_pre` / :func:`hc_post` / :func:`hc_head`  ``Block.hc_pre`` / ``Block.hc_post`` / ``ParallelHead.hc_head``
=============================  ===================================================================================

The official kernels multiply by the float32 reciprocal (``amax * (1/448)``) before taking the power of two;
:func:`pow2_ceil` reads the exponent from the float32 bits, so the scale is exact either way.
"""
from __future__ import annotations

import math

import torch

from ..format.e2m1 import e2m1_decode, e2m1_encode

FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0
#: Smallest FP8 block amax (kernel ``act_quant``: ``amax.clamp(min=1e-4)``).
FP8_AMAX_FLOOR = 1e-4
#: Smallest FP4 block amax (kernel ``fp4_act_quant``: ``6 * 2**-126``).
FP4_AMAX_FLOOR = 6.0 * 2.0 ** -126


def pow2_ceil(t: torch.Tensor) -> torch.Tensor:
    """``2 ** ceil(log2(t))`` for positive finite float32 ``t``, exact (from the float32 bits)."""
    bits = t.float().contiguous().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in float32, cast back to ``x.dtype``; ``weight`` None = no scale.

    The official q per-head norm (``q * rsqrt(q.square().mean(-1) + eps)`` on bf16 ``q``) rounds each of its ops to
    bf16 instead; :func:`megamoe.reference.v4_attention.head_rms_norm` reproduces it bit for bit (this function
    differs from it by up to one bf16 rounding of the per-head factor).
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = weight.float() * y
    return y.to(x.dtype)


def rope_frequencies(rope_dim: int, max_positions: int, *, base: float, original_seq_len: int = 0,
                     factor: float = 1.0, beta_fast: float = 32, beta_slow: float = 1) -> torch.Tensor:
    """(max_positions, rope_dim // 2) complex64 rotations, YaRN-blended when ``original_seq_len > 0``."""
    freqs = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if original_seq_len > 0:
        def correction_dim(rotations: float) -> float:
            return rope_dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), rope_dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """Rotate the last ``2 * freqs.shape[-1]`` dims of ``x`` (a new tensor; the other dims are copied).

    x: (N, ..., D) any float dtype; freqs: (N, rope_dim // 2) complex64, one row per leading index of ``x``
    (broadcast over the middle dims). Pairs (2i, 2i+1) are complex numbers; float32 math; cast back.
    """
    rd = 2 * freqs.shape[-1]
    shape = (freqs.shape[0],) + (1,) * (x.dim() - 2) + (freqs.shape[-1],)
    f = freqs.reshape(shape)
    if inverse:
        f = f.conj()
    z = torch.view_as_complex(x[..., -rd:].float().contiguous().unflatten(-1, (-1, 2)))
    rotated = torch.view_as_real(z * f).flatten(-2).to(x.dtype)
    return torch.cat([x[..., :-rd], rotated], dim=-1)


def hadamard_matrix(d: int, device=None) -> torch.Tensor:
    """(d, d) float32 Sylvester Hadamard matrix (d a power of two), entries +-1."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"d: expected a power of two, got {d}")
    h = torch.ones((1, 1), dtype=torch.float32, device=device)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """``x @ H_d * d**-0.5`` over the last dim (float32 math, cast back to ``x.dtype``)."""
    d = x.shape[-1]
    return ((x.float() @ hadamard_matrix(d, x.device)) * d ** -0.5).to(x.dtype)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"x: last dim {x.shape[-1]} is not a multiple of block={block}")
    return x.float().unflatten(-1, (-1, block))


def fp8_block_scales(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """(..., D) -> (..., D // block) float32 power-of-two scales ``pow2_ceil(max(amax, 1e-4) / 448)``.

    NaN in a block gives a NaN scale (the block then decodes to NaN).
    """
    g = _blocks(x, block)
    amax = g.abs().amax(-1).clamp_min(FP8_AMAX_FLOOR)
    scale = pow2_ceil(amax * torch.tensor(1.0 / FP8_E4M3_MAX, dtype=torch.float32))
    return torch.where(torch.isnan(amax), torch.full_like(scale, float("nan")), scale)


def fp8_block_encode(x: torch.Tensor, block: int = 64):
    """(..., D) -> (codes (..., D) float8_e4m3fn, scales (..., D // block) float32): the exact storage of
    :func:`fp8_block_simulate` (value = float(code) * scale)."""
    scale = fp8_block_scales(x, block)
    g = _blocks(x, block)
    q = (g / scale[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), scale


def fp8_block_decode(codes: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Inverse of :func:`fp8_block_encode`: ``float(code) * scale`` per block, in ``dtype``."""
    block = codes.shape[-1] // scales.shape[-1]
    return (codes.float().unflatten(-1, (-1, block)) * scales[..., None]).flatten(-2).to(dtype)


def fp8_block_simulate(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """The official in-place FP8 simulation as a new tensor of ``x``'s dtype (values exact in bf16)."""
    codes, scales = fp8_block_encode(x, block)
    return fp8_block_decode(codes, scales, x.dtype)


def fp4_block_scales(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """(..., D) -> (..., D // block) float32 power-of-two scales ``pow2_ceil(max(amax, 6*2**-126) / 6)``."""
    amax = _blocks(x, block).abs().amax(-1).clamp_min(FP4_AMAX_FLOOR)
    scale = pow2_ceil(amax * torch.tensor(1.0 / FP4_E2M1_MAX, dtype=torch.float32))
    return torch.where(torch.isnan(amax), torch.full_like(scale, float("nan")), scale)


def fp4_block_encode(x: torch.Tensor, block: int = 32):
    """(..., D) -> (codes (..., D) uint8 E2M1 codes 0..15, scales (..., D // block) float32 powers of two)."""
    scale = fp4_block_scales(x, block)
    g = _blocks(x, block) / scale[..., None]
    return e2m1_encode(g.clamp(-FP4_E2M1_MAX, FP4_E2M1_MAX)).flatten(-2), scale


def fp4_block_decode(codes: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Inverse of :func:`fp4_block_encode`."""
    block = codes.shape[-1] // scales.shape[-1]
    return (e2m1_decode(codes).unflatten(-1, (-1, block)) * scales[..., None]).flatten(-2).to(dtype)


def fp4_block_simulate(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """The official in-place FP4 simulation as a new tensor of ``x``'s dtype (values exact in bf16)."""
    codes, scales = fp4_block_encode(x, block)
    return fp4_block_decode(codes, scales, x.dtype)


# ----------------------------------------------------------------------------------------------
# hyper-connections (hc_mult copies of the residual stream)
# ----------------------------------------------------------------------------------------------
def hc_split_sinkhorn(mixes: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor, hc: int, iters: int,
                      eps: float):
    """mixes (..., (2 + hc) * hc) float32 -> (pre (..., hc), post (..., hc), comb (..., hc, hc))."""
    m = mixes.float()
    pre = torch.sigmoid(m[..., :hc] * hc_scale[0] + hc_base[:hc]) + eps
    post = 2 * torch.sigmoid(m[..., hc:2 * hc] * hc_scale[1] + hc_base[hc:2 * hc])
    comb = (m[..., 2 * hc:] * hc_scale[2] + hc_base[2 * hc:]).unflatten(-1, (hc, hc)).softmax(-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def hc_mixes(x: torch.Tensor, hc_fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """x (T, hc, D) -> (T, M) float32: ``(flat(x) @ hc_fn.T) * rsqrt(mean(flat(x)^2) + eps)``."""
    flat = x.flatten(-2).float()
    rsqrt = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return (flat @ hc_fn.float().t()) * rsqrt


def hc_pre(x: torch.Tensor, hc_fn: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor, *, hc: int,
           iters: int, hc_eps: float, norm_eps: float):
    """``Block.hc_pre``: x (T, hc, D) -> (y (T, D) in x.dtype, post (T, hc), comb (T, hc, hc)) float32."""
    pre, post, comb = hc_split_sinkhorn(hc_mixes(x, hc_fn, norm_eps), hc_scale, hc_base, hc, iters, hc_eps)
    y = (pre.unsqueeze(-1) * x.float()).sum(-2)
    return y.to(x.dtype), post, comb


def hc_post(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``Block.hc_post``: y (T, D), residual (T, hc, D) -> (T, hc, D) in y.dtype:
    ``post[k] * y + sum_j comb[j, k] * residual[j]``."""
    mixed = (comb.unsqueeze(-1) * residual.float().unsqueeze(-2)).sum(-3)
    return (post.unsqueeze(-1) * y.float().unsqueeze(-2) + mixed).to(y.dtype)


def hc_head(x: torch.Tensor, hc_fn: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor, *, hc_eps: float,
            norm_eps: float) -> torch.Tensor:
    """``ParallelHead.hc_head``: x (T, hc, D) -> (T, D) in x.dtype with ``pre = sigmoid(mix * scale + base) + eps``."""
    pre = torch.sigmoid(hc_mixes(x, hc_fn, norm_eps) * hc_scale.float() + hc_base.float()) + hc_eps
    return (pre.unsqueeze(-1) * x.float()).sum(-2).to(x.dtype)
