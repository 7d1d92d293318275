"""Fused per-token elementwise steps of the DeepSeek-V4 attention block (norms, RoPE, Hadamard, FP8/FP4 simulation).

The PyTorch formulas (``megamoe/reference/v4_numerics.py``, ``megamoe.reference.v4_attention.head_rms_norm``) run
as dozens of tiny kernels per layer and token; each family below is one launch:

* :func:`launch_rms_norm`: ``RMSNorm(weight)`` (the q_lora norm);
* :func:`launch_q_kv`: the q heads (official bf16 op-by-op per-head norm, RoPE) and the window kv row
  (RMSNorm(weight), RoPE, FP8 64-block simulation of the non-RoPE dims) in one grid (T, H + 1);
* :func:`launch_index_q`: the indexer query (RoPE, Hadamard, FP4 32-block simulation) and its head weights;
* :func:`launch_output`: inverse RoPE of the attention output, stored in the grouped (G, T, H * D / G) layout
  of the grouped ``wo_a`` GEMM;
* :func:`launch_post_pool`: the compressed cache's post-pool steps of a decode step's pooled rows (bf16, RMSNorm,
  RoPE at the window start, Hadamard for the indexer keys).

Numerics. Every elementwise step is the reference's float32 operation with its rounding, in its order: bf16
inputs are widened from their bits, bf16 outputs are rounded to nearest even from the float32 bits, RoPE's
complex product is ``a*c - b*d`` / ``a*d + b*c`` with each product rounded (PyTorch's CPU complex multiply;
launches pass ``enable_fp_fusion=False`` so that no FMA contracts them on the GPU), divisions by the power-of-two
block scales are ``div_rn`` (exact), the E4M3 / E2M1 encodes are the integer helpers of ``nvfp4_jit`` (the
interpreter's float8 cast truncates). What is not bit-for-bit the reference's:

* the sums of squares of the norms are float32 sums in another order than PyTorch's reductions (the result is
  the same whenever the sum is exact in float32, e.g. few-bit inputs; otherwise the mean differs by a few float32
  ulps, which moves a bf16 output by one ulp only at a rounding boundary);
* the Hadamard product is computed as log2(d) float32 butterfly stages (a + b, a - b) instead of the reference's
  float32 matmul: both are float32 sums of the same d exact terms +-x_k in another order, so before the
  ``* d**-0.5`` scaling ``|ours - ref| <= (log2(d) + d - 1) * 2**-24 * sum_k |x_k|`` (measured on 2e5 random
  rows against PyTorch's CPU matmul: at most 5 * 2**-24 * sum|x|, 63 % of the float32 values differ in the last
  bits, 7e-5 of the bf16 roundings and 2e-7 of the final FP4-simulated elements differ). An element differs only
  where the float32 value sits within that distance of a bf16 rounding boundary (then one bf16 ulp, which can move
  it to the neighbouring E2M1 code or, through the block amax, change the block scale by a factor of 2);
* ``rsqrt`` is the platform's: ``1 / sqrt`` in the interpreter (as PyTorch's CPU rsqrt), the approximate
  ``rsqrt.approx.ftz.f32`` on the GPU (PyTorch's CUDA ``rsqrtf`` is the same instruction; its argument here is
  >= eps, never subnormal);
* on the GPU, PyTorch's own CUDA complex multiply may be FMA-contracted by nvcc, so against the formulas run on
  CUDA (not on the CPU) a rotated element can differ by one bf16 ulp at a rounding boundary;
* a Hadamard output that is an exact zero is +0.0 here; the reference's matmul could give -0.0 for a row of
  negative zeros (then the FP4 code's sign bit differs).

Non-finite values follow the reference: NaN/Inf propagate through the norms and RoPE; an FP8/FP4 block holding a
NaN or an Inf decodes to NaN throughout (the reference's scale is NaN or Inf there). NaN is stored as 0x7FC0.
Positions outside ``[0, n_positions)`` read no table row: the rotation is the complex 0, so the RoPE dims are the
products ``x * 0`` (signed zeros; NaN for a NaN / Inf input), as the torch path's ``rope_rows`` (the drop rule of
``megamoe/ops/v4_elementwise.py``); the post-pool kernel clamps its row into the table instead. Each such token
ORs its op's ``positions`` bit into the error word (``megamoe/ops/errors.py``; one predicated atomic by the first
program of the token; post-pool: only for ``pos + shift >= n_positions``). ``FLAG == 0`` (the device guard compiled
out) drops the flag code, not the masking.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .nvfp4_jit import e2m1_decode, e2m1_magnitude_code, e4m3_decode, e4m3_encode, sign_bit
from .pdl import grid_dependency_prologue, pdl_enabled

#: FP8 block of the window kv (official ``act_quant(kv[..., :-rd], 64)``) and FP4 block of the indexer query.
FP8_BLOCK = 64
FP4_BLOCK = 32
#: Official amax floors and format maxima.
_FP8_MAX = tl.constexpr(448.0)
_FP8_AMAX_FLOOR = tl.constexpr(1e-4)
_FP4_MAX = tl.constexpr(6.0)
_FP4_AMAX_FLOOR = tl.constexpr(6.0 * 2.0 ** -126)

#: Tile configs (tiny row kernels: one token row / head per program).
RMS_NORM_WARPS = 4
Q_KV_WARPS = 4
#: Heads per program of the q / kv and the output kernels from Q_KV_MULTI_MIN_ROWS (tokens x heads) on: one head per
#: program left ~266k programs at 4096 tokens, latency-bound at 525 us (q / kv) and 234 us (output) per call (a
#: 4096-token V4-Flash prefill, ``results/gpu_check_v30/d_prefill.md``). Decode sizes keep one head per program (the
#: same builds and bits as before).
Q_KV_HEADS_PER_PROGRAM = 8
Q_KV_MULTI_MIN_ROWS = 8192
#: Indexer heads per program.
INDEX_BLOCK_H = 8
INDEX_WARPS = 4
OUTPUT_WARPS = 4
POST_POOL_WARPS = 4

#: Compile options of every launch: no FMA contraction (the reference rounds each product).
_EXACT = dict(enable_fp_fusion=False)


def _error_word(device, word):
    from ..ops import errors

    return word if word is not None else errors.error_word(device)


def _kernel_flag(op: str) -> int:
    from ..ops import errors

    return errors.kernel_flag(op, "positions")


# ------------------------------------------------------------------------------------------------ helpers
@triton.jit
def _load_bf16(ptr, mask):
    """bf16 elements (through an int16 pointer) -> float32, exact (from the bits; masked lanes 0)."""
    bits = tl.load(ptr, mask=mask, other=0)
    return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _bf16_bits(v):
    """float32 -> bf16 bit pattern (int32, low 16 bits), round to nearest even; NaN -> 0x7FC0."""
    bits = v.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(v != v, 0x7FC0, rounded)


@triton.jit
def _bf16_round(v):
    """float32 -> the float32 value of its bf16 rounding (``.to(bf16).float()``)."""
    return (_bf16_bits(v) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _is_finite(x):
    return (x == x) & (tl.abs(x) != float("inf"))


@triton.jit
def _pow2_ceil(t):
    """``2 ** ceil(log2(t))`` for positive finite float32 ``t``, exact from the bits (``nx.pow2_ceil``)."""
    bits = t.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (exponent << 23).to(tl.float32, bitcast=True)


@triton.jit
def _rope_cos_sin(freqs_ptr, pos, pos_ok, r, mask, RD: tl.constexpr):
    """cos / sin of pair ``r // 2`` at ``pos`` from the (n_positions, RD // 2, 2) float32 table (masked: 0)."""
    m = mask & pos_ok
    off = (tl.where(pos_ok, pos, 0) * (RD // 2) + tl.where(m, r, 0) // 2) * 2
    return tl.load(freqs_ptr + off, mask=m, other=0.0), tl.load(freqs_ptr + off + 1, mask=m, other=0.0)


@triton.jit
def _flag(err_ptr, bad, first, FLAG: tl.constexpr):
    """OR ``FLAG`` into the error word where ``bad`` and ``first`` (one program per token); FLAG 0: nothing."""
    if FLAG != 0:
        hit = bad & first
        tl.atomic_or(err_ptr, hit.to(tl.int32) * FLAG, mask=hit)


@triton.jit
def _rotate(y, yp, c, s, even, INVERSE: tl.constexpr):
    """One RoPE output element: ``y`` its own value, ``yp`` its pair partner (index ^ 1).

    Forward (z * f): even (real) ``y*c - yp*s``, odd (imag) ``yp*s + y*c``; inverse (z * conj f): even
    ``y*c + yp*s``, odd ``y*c - yp*s``. Each product rounded, then one add or subtract (PyTorch's CPU complex
    multiply; a true subtraction, not ``+ (-p)``: Triton's float negation is ``0 - p``, which loses -0.0).
    """
    yc = y * c
    ps = yp * s
    if INVERSE:
        sub = ~even
    else:
        sub = even
    return tl.where(sub, yc - ps, yc + ps)


# ------------------------------------------------------------------------------------------------ RMSNorm
@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, eps, stride_x, N: tl.constexpr, N_P2: tl.constexpr,
                     HAS_WEIGHT: tl.constexpr, PDL: tl.constexpr = False):
    grid_dependency_prologue(PDL)  # first: before any global access (kernels/pdl.py)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, N_P2)
    m = offs < N
    x = _load_bf16(x_ptr + row * stride_x + offs, m)
    r = tl.math.rsqrt(tl.div_rn(tl.sum(x * x, axis=0), N * 1.0) + eps)
    y = x * r
    if HAS_WEIGHT:
        y = tl.load(w_ptr + offs, mask=m, other=0.0) * y
    tl.store(out_ptr + row * N + offs, _bf16_bits(y).to(tl.int16), mask=m)


def launch_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x (R, N) bf16 with unit stride along N (rows may be strided: a column view of a wider projection output),
    weight (N,) float32 or None -> (R, N) bf16 contiguous: ``nx.rms_norm``."""
    R, N = x.shape
    out = torch.empty((R, N), dtype=x.dtype, device=x.device)
    if R:
        pdl = pdl_enabled(x)
        _rms_norm_kernel[(R,)](x.view(torch.int16), weight if weight is not None else x, out.view(torch.int16),
                               float(eps), x.stride(0), N=N, N_P2=triton.next_power_of_2(N),
                               HAS_WEIGHT=weight is not None, num_warps=RMS_NORM_WARPS, PDL=pdl, launch_pdl=pdl,
                               **_EXACT)
    return out


# ------------------------------------------------------------------------------------------------ q heads + kv
@triton.jit
def _q_heads(q_ptr, out_ptr, freqs_ptr, pos, pos_ok, t, h0, eps, stride_q, H: tl.constexpr, D: tl.constexpr,
             RD: tl.constexpr, D_P2: tl.constexpr, HB: tl.constexpr):
    """Heads [h0, h0 + HB): official bf16 per-head norm (every op rounded to bf16), then RoPE on the last RD dims.
    HB 1: one head as a (D_P2,) vector (the decode build); else (HB, D_P2) tiles, the per-head sum of squares a row
    reduction (another float32 summation order, within the op's stated order effects)."""
    if HB == 1:
        offs = tl.arange(0, D_P2)
        hh = h0
        m = offs < D
    else:
        offs = tl.arange(0, D_P2)[None, :]
        hh = h0 + tl.arange(0, HB)[:, None]
        m = (offs < D) & (hh < H)
    src = t * stride_q + hh * D
    base = t * (H * D) + hh * D
    x = _load_bf16(q_ptr + src + offs, m)
    sq = _bf16_round(x * x)
    if HB == 1:
        mean = _bf16_round(tl.div_rn(tl.sum(sq, axis=0), D * 1.0))
    else:
        mean = _bf16_round(tl.div_rn(tl.sum(sq, axis=1), D * 1.0))[:, None]
    r = _bf16_round(tl.math.rsqrt(_bf16_round(mean + eps)))
    y = _bf16_round(x * r)
    NOPE: tl.constexpr = D - RD
    rope = m & (offs >= NOPE)
    yp = _bf16_round(_load_bf16(q_ptr + src + (offs ^ 1), rope) * r)
    c, s = _rope_cos_sin(freqs_ptr, pos, pos_ok, offs - NOPE, rope, RD)
    rot = _rotate(y, yp, c, s, (offs & 1) == 0, False)
    bits = tl.where(rope, _bf16_bits(rot), _bf16_bits(y))
    tl.store(out_ptr + base + offs, bits.to(tl.int16), mask=m)


@triton.jit
def _kv_row(kv_ptr, w_ptr, out_ptr, freqs_ptr, pos, pos_ok, t, eps, stride_kv, D: tl.constexpr, RD: tl.constexpr,
            D_P2: tl.constexpr, FB: tl.constexpr):
    """The window kv row: RMSNorm(weight) -> RoPE -> FP8 simulation of the D - RD non-RoPE dims (FB-blocks)."""
    b = tl.arange(0, D_P2 // FB)[:, None]
    j = tl.arange(0, FB)[None, :]
    offs = b * FB + j                                   # (blocks, FB): one FP8 block per row
    m = offs < D
    src = t * stride_kv
    base = t * D
    x = _load_bf16(kv_ptr + src + offs, m)
    r = tl.math.rsqrt(tl.div_rn(tl.sum(tl.sum(x * x, axis=1), axis=0), D * 1.0) + eps)
    y = _bf16_round(tl.load(w_ptr + offs, mask=m, other=0.0) * (x * r))
    NOPE: tl.constexpr = D - RD
    rope = m & (offs >= NOPE)
    partner = offs ^ 1
    yp = _bf16_round(tl.load(w_ptr + partner, mask=rope, other=0.0) * (_load_bf16(kv_ptr + src + partner, rope) * r))
    c, s = _rope_cos_sin(freqs_ptr, pos, pos_ok, offs - NOPE, rope, RD)
    rot = _rotate(y, yp, c, s, (offs & 1) == 0, False)
    # FP8 (E4M3) block simulation of the non-RoPE dims: NOPE % FB == 0, so a block is all-nope or all-rope.
    nope = offs < NOPE
    finite = _is_finite(y)
    block_ok = tl.sum((nope & ~finite).to(tl.int32), axis=1) == 0
    amax = tl.max(tl.where(nope & finite, tl.abs(y), 0.0), axis=1)
    scale = _pow2_ceil(tl.maximum(amax, _FP8_AMAX_FLOOR) * (1.0 / _FP8_MAX))[:, None]
    v = tl.div_rn(y, scale)
    code = e4m3_encode(tl.minimum(tl.abs(v), _FP8_MAX)) | (sign_bit(v) << 7)
    fp8 = tl.where(block_ok[:, None], e4m3_decode(code) * scale, float("nan"))
    bits = tl.where(nope, _bf16_bits(fp8), _bf16_bits(rot))
    tl.store(out_ptr + base + offs, bits.to(tl.int16), mask=m)


@triton.jit
def _q_kv_kernel(q_ptr, kv_ptr, kv_w_ptr, freqs_ptr, pos_ptr, q_out_ptr, kv_out_ptr, err_ptr, n_pos, eps,
                 stride_q, stride_kv, H: tl.constexpr, D: tl.constexpr, RD: tl.constexpr, D_P2: tl.constexpr,
                 FB: tl.constexpr, HAS_Q: tl.constexpr, HAS_KV: tl.constexpr, FLAG: tl.constexpr = 0,
                 HB: tl.constexpr = 1, PDL: tl.constexpr = False):
    """Program (t, h): token t's q heads [h * HB, (h + 1) * HB) for h < cdiv(H, HB), then (HAS_KV) its kv row."""
    grid_dependency_prologue(PDL)  # first: before any global access (kernels/pdl.py)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    pos_ok = (pos >= 0) & (pos < n_pos)
    _flag(err_ptr, ~pos_ok, h == 0, FLAG)
    NQ: tl.constexpr = (H + HB - 1) // HB
    if HAS_Q and HAS_KV:
        if h < NQ:
            _q_heads(q_ptr, q_out_ptr, freqs_ptr, pos, pos_ok, t, h * HB, eps, stride_q, H, D, RD, D_P2, HB)
        else:
            _kv_row(kv_ptr, kv_w_ptr, kv_out_ptr, freqs_ptr, pos, pos_ok, t, eps, stride_kv, D, RD, D_P2, FB)
    elif HAS_Q:
        _q_heads(q_ptr, q_out_ptr, freqs_ptr, pos, pos_ok, t, h * HB, eps, stride_q, H, D, RD, D_P2, HB)
    else:
        _kv_row(kv_ptr, kv_w_ptr, kv_out_ptr, freqs_ptr, pos, pos_ok, t, eps, stride_kv, D, RD, D_P2, FB)


def launch_q_kv(q: torch.Tensor | None, kv: torch.Tensor | None, kv_weight: torch.Tensor | None,
                freqs: torch.Tensor, positions: torch.Tensor, *, num_heads: int, head_dim: int, eps: float,
                error_word: torch.Tensor | None = None):
    """One launch for the q heads and the window kv row of T tokens (either may be None).

    q: (T, H * D) bf16 (``wq_b`` output) -> (T, H, D) bf16; kv: (T, D) bf16 (``wkv`` output); q and kv with unit
    stride along the last dim, rows may be strided (column views of a fused projection's output); kv_weight (D,)
    float32 -> (T, D) bf16; freqs: (n_positions, RD // 2, 2) float32 contiguous (the complex64 table as real);
    positions: (T,) int32/int64. D - RD must be a multiple of 64. error_word: the (1,) int32 word an out-of-range
    position flags (default: the device's, ``megamoe.ops.errors``).
    """
    src = q if q is not None else kv
    T, D = src.shape[0], head_dim
    rd = 2 * freqs.shape[1]
    q_out = torch.empty((T, num_heads, D), dtype=torch.bfloat16, device=src.device) if q is not None else None
    kv_out = torch.empty((T, D), dtype=torch.bfloat16, device=src.device) if kv is not None else None
    if T:
        hb = q_kv_heads_per_program(T, num_heads) if q is not None else 1
        n_prog = (triton.cdiv(num_heads, hb) if q is not None else 0) + (1 if kv is not None else 0)
        d_p2 = max(triton.next_power_of_2(D), FP8_BLOCK)
        pdl = pdl_enabled(src)
        _q_kv_kernel[(T, n_prog)](
            (q if q is not None else kv).view(torch.int16), (kv if kv is not None else q).view(torch.int16),
            kv_weight if kv_weight is not None else freqs, freqs, positions,
            (q_out if q is not None else kv_out).view(torch.int16),
            (kv_out if kv is not None else q_out).view(torch.int16), _error_word(src.device, error_word),
            freqs.shape[0], float(eps), q.stride(0) if q is not None else 0, kv.stride(0) if kv is not None else 0,
            H=num_heads, D=D, RD=rd, D_P2=d_p2, FB=FP8_BLOCK, HAS_Q=q is not None,
            HAS_KV=kv is not None, FLAG=_kernel_flag("q_kv_path"), HB=hb, num_warps=Q_KV_WARPS, PDL=pdl,
            launch_pdl=pdl, **_EXACT)
    return q_out, kv_out


def q_kv_heads_per_program(T: int, num_heads: int) -> int:
    """q heads per program of :func:`launch_q_kv` (host shapes only): :data:`Q_KV_HEADS_PER_PROGRAM` from
    :data:`Q_KV_MULTI_MIN_ROWS` token-heads on, else 1."""
    return Q_KV_HEADS_PER_PROGRAM if T * num_heads >= Q_KV_MULTI_MIN_ROWS else 1


# ------------------------------------------------------------------------------------------------ indexer query
@triton.jit
def _butterfly(x, R: tl.constexpr, N: tl.constexpr, STRIDE: tl.constexpr):
    """One Walsh-Hadamard stage on the rows of x (R, N): elements i and i + STRIDE (bit STRIDE of i clear) ->
    (x_i + x_{i+STRIDE}, x_i - x_{i+STRIDE})."""
    x4 = tl.permute(tl.reshape(x, (R, N // (2 * STRIDE), 2, STRIDE)), (0, 1, 3, 2))
    a, b = tl.split(x4)
    return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (R, N))


@triton.jit
def _index_q_kernel(q_ptr, w_ptr, freqs_ptr, pos_ptr, q_out_ptr, w_out_ptr, err_ptr, n_pos, w_scale, stride_q,
                    stride_w, NH: tl.constexpr, DI: tl.constexpr, LOG2_DI: tl.constexpr, RD: tl.constexpr,
                    H_SCALE: tl.constexpr, FB: tl.constexpr, BLOCK_H: tl.constexpr, FLAG: tl.constexpr = 0,
                    PDL: tl.constexpr = False):
    grid_dependency_prologue(PDL)  # first: before any global access (kernels/pdl.py)
    t = tl.program_id(0).to(tl.int64)
    hh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = hh < NH
    pos = tl.load(pos_ptr + t).to(tl.int64)
    pos_ok = (pos >= 0) & (pos < n_pos)
    _flag(err_ptr, ~pos_ok, tl.program_id(1) == 0, FLAG)
    # head weights: float(bf16(w * scale))
    wv = _load_bf16(w_ptr + t * stride_w + hh, hm)
    tl.store(w_out_ptr + t * NH + hh, _bf16_round(wv * w_scale), mask=hm)
    # RoPE (bf16 out), in the natural layout with a partner load per rotated element
    k = tl.arange(0, DI)[None, :]
    src = t * stride_q + hh[:, None] * DI
    base = t * (NH * DI) + hh[:, None] * DI
    m = hm[:, None] & (k < DI)
    x = _load_bf16(q_ptr + src + k, m)
    NOPE: tl.constexpr = DI - RD
    rope = m & (k >= NOPE)
    xp = _load_bf16(q_ptr + src + (k ^ 1), rope)
    c, s = _rope_cos_sin(freqs_ptr, pos, pos_ok, k - NOPE, rope, RD)
    x = tl.where(rope, _bf16_round(_rotate(x, xp, c, s, (k & 1) == 0, False)), x)
    # Hadamard: x @ H_DI (Sylvester) * DI**-0.5 as log2(DI) butterfly stages (a, b) -> (a + b, a - b), float32
    for stage in tl.static_range(LOG2_DI):
        x = _butterfly(x, BLOCK_H, DI, 1 << stage)
    y = _bf16_round(x * H_SCALE)
    # FP4 (E2M1) simulation per FB-block
    y3 = tl.reshape(y, (BLOCK_H, DI // FB, FB))
    finite = _is_finite(y3)
    block_ok = tl.sum((~finite).to(tl.int32), axis=2) == 0
    amax = tl.max(tl.where(finite, tl.abs(y3), 0.0), axis=2)
    scale = _pow2_ceil(tl.maximum(amax, _FP4_AMAX_FLOOR) * (1.0 / _FP4_MAX))[:, :, None]
    v = tl.div_rn(y3, scale)
    code = e2m1_magnitude_code(tl.minimum(tl.abs(v), _FP4_MAX)) | (sign_bit(v) << 3)
    val = tl.where(block_ok[:, :, None], e2m1_decode(code) * scale, float("nan"))
    bits = tl.reshape(_bf16_bits(val), (BLOCK_H, DI))
    tl.store(q_out_ptr + base + k, bits.to(tl.int16), mask=m)


def launch_index_q(q: torch.Tensor, weights: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor, *,
                   n_heads: int, weight_scale: float, error_word: torch.Tensor | None = None):
    """q: (T, NH * DI) bf16 (``indexer.wq_b`` output), weights: (T, NH) bf16 (``weights_proj`` output), both with
    unit stride along the last dim (rows may be strided: column views of a fused projection's output), freqs
    (n_positions, RD // 2, 2) float32, positions (T,) int -> (q (T, NH, DI) bf16: FP4-simulated Hadamard of the
    rotated query, w (T, NH) float32: ``bf16(w * scale)``). error_word: as :func:`launch_q_kv`."""
    T = q.shape[0]
    DI = q.shape[1] // n_heads
    q_out = torch.empty((T, n_heads, DI), dtype=torch.bfloat16, device=q.device)
    w_out = torch.empty((T, n_heads), dtype=torch.float32, device=q.device)
    if T:
        pdl = pdl_enabled(q)
        _index_q_kernel[(T, triton.cdiv(n_heads, INDEX_BLOCK_H))](
            q.view(torch.int16), weights.view(torch.int16), freqs, positions, q_out.view(torch.int16), w_out,
            _error_word(q.device, error_word), freqs.shape[0], float(weight_scale), q.stride(0), weights.stride(0),
            NH=n_heads, DI=DI,
            LOG2_DI=DI.bit_length() - 1, RD=2 * freqs.shape[1], H_SCALE=DI ** -0.5, FB=FP4_BLOCK,
            BLOCK_H=INDEX_BLOCK_H, FLAG=_kernel_flag("index_q_path"), num_warps=INDEX_WARPS, PDL=pdl,
            launch_pdl=pdl, **_EXACT)
    return q_out, w_out


# ------------------------------------------------------------------------------------------------ output
@triton.jit
def _output_kernel(o_ptr, freqs_ptr, pos_ptr, out_ptr, err_ptr, T, n_pos, H: tl.constexpr, D: tl.constexpr,
                   RD: tl.constexpr, G: tl.constexpr, D_P2: tl.constexpr, FLAG: tl.constexpr = 0,
                   HB: tl.constexpr = 1, PDL: tl.constexpr = False):
    """Program (t, j): token t's heads [j * HB, (j + 1) * HB) (HB 1: one head, the decode build)."""
    grid_dependency_prologue(PDL)  # first: before any global access (kernels/pdl.py)
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    pos_ok = (pos >= 0) & (pos < n_pos)
    _flag(err_ptr, ~pos_ok, j == 0, FLAG)
    if HB == 1:
        h = j
        offs = tl.arange(0, D_P2)
        m = offs < D
    else:  # (HB, D_P2) tiles: row i is head j * HB + i, with the same per-element operations
        h = j * HB + tl.arange(0, HB)[:, None]
        offs = tl.arange(0, D_P2)[None, :]
        m = (offs < D) & (h < H)
    src = o_ptr + (t * H + h) * D
    bits = tl.load(src + offs, mask=m, other=0)
    x = (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    NOPE: tl.constexpr = D - RD
    rope = m & (offs >= NOPE)
    xp = _load_bf16(src + (offs ^ 1), rope)
    c, s = _rope_cos_sin(freqs_ptr, pos, pos_ok, offs - NOPE, rope, RD)
    rot = _rotate(x, xp, c, s, (offs & 1) == 0, True)
    bits = tl.where(rope, _bf16_bits(rot).to(tl.int16), bits)
    HG: tl.constexpr = H // G
    g = h // HG
    dst = out_ptr + (g * T + t) * (HG * D) + (h % HG) * D
    tl.store(dst + offs, bits, mask=m)


def launch_output(o: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor, *, groups: int,
                  error_word: torch.Tensor | None = None) -> torch.Tensor:
    """o: (T, H, D) bf16 contiguous -> (G, T, H * D // G) bf16: inverse RoPE of each head's last RD dims, head h
    at group ``h // (H // G)``, columns ``(h % (H // G)) * D ...``. error_word: as :func:`launch_q_kv`."""
    T, H, D = o.shape
    out = torch.empty((groups, T, H * D // groups), dtype=torch.bfloat16, device=o.device)
    if T:
        pdl = pdl_enabled(o)
        hb = q_kv_heads_per_program(T, H)
        _output_kernel[(T, triton.cdiv(H, hb))](o.view(torch.int16), freqs, positions, out.view(torch.int16),
                                                _error_word(o.device, error_word), T, freqs.shape[0], H=H, D=D,
                                                RD=2 * freqs.shape[1], G=groups, D_P2=triton.next_power_of_2(D),
                                                FLAG=_kernel_flag("output_path"), HB=hb, num_warps=OUTPUT_WARPS,
                                                PDL=pdl, launch_pdl=pdl, **_EXACT)
    return out


# ------------------------------------------------------------------------------------------------ post-pool
@triton.jit
def _post_pool_kernel(x_ptr, w_ptr, freqs_ptr, pos_ptr, out_ptr, err_ptr, n_pos, eps, shift,
                      D: tl.constexpr, D_P2: tl.constexpr, RD: tl.constexpr, LOG2_D: tl.constexpr,
                      H_SCALE: tl.constexpr, ROTATE: tl.constexpr, FLAG: tl.constexpr = 0, PDL: tl.constexpr = False):
    """One pooled row: bf16 -> RMSNorm(weight) -> RoPE (row ``clamp(pos + shift, 0, n_pos - 1)``) -> Hadamard;
    ``pos + shift >= n_pos`` flags."""
    grid_dependency_prologue(PDL)  # first: before any global access (kernels/pdl.py)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64) + shift
    _flag(err_ptr, pos >= n_pos, True, FLAG)
    pos = tl.minimum(tl.maximum(pos, 0), n_pos - 1)
    offs = tl.arange(0, D_P2)[None, :]
    m = offs < D
    src = x_ptr + t * D
    x = _bf16_round(tl.load(src + offs, mask=m, other=0.0))
    r = tl.math.rsqrt(tl.div_rn(tl.sum(tl.sum(x * x, axis=1), axis=0), D * 1.0) + eps)
    y = _bf16_round(tl.load(w_ptr + offs, mask=m, other=0.0) * (x * r))
    NOPE: tl.constexpr = D - RD
    rope = m & (offs >= NOPE)
    partner = offs ^ 1
    xp = _bf16_round(tl.load(src + partner, mask=rope, other=0.0))
    yp = _bf16_round(tl.load(w_ptr + partner, mask=rope, other=0.0) * (xp * r))
    c, s = _rope_cos_sin(freqs_ptr, pos, pos >= 0, offs - NOPE, rope, RD)
    y = tl.where(rope, _bf16_round(_rotate(y, yp, c, s, (offs & 1) == 0, False)), y)
    if ROTATE:
        for stage in tl.static_range(LOG2_D):
            y = _butterfly(y, 1, D, 1 << stage)
        y = y * H_SCALE
    tl.store(out_ptr + t * D + offs, _bf16_bits(y).to(tl.int16), mask=m)


def launch_post_pool(pooled: torch.Tensor, weight: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor,
                     out: torch.Tensor, *, shift: int, eps: float, rotate: bool,
                     error_word: torch.Tensor | None = None) -> torch.Tensor:
    """pooled (N, D) float32 contiguous, weight (D,) float32, freqs (n_positions, RD // 2, 2) float32, positions
    (N,) int32/int64, out (N, D) bf16 contiguous (written): the compressed cache's post-pool steps with the RoPE
    row ``clamp(positions + shift, 0, n_positions - 1)``; ``rotate``: Hadamard (D a power of two). error_word:
    the word ``positions + shift >= n_positions`` flags (default: the device's)."""
    N, D = pooled.shape
    if N:
        pdl = pdl_enabled(pooled)
        _post_pool_kernel[(N,)](pooled, weight, freqs, positions, out.view(torch.int16),
                                _error_word(pooled.device, error_word), freqs.shape[0], float(eps),
                                int(shift), FLAG=_kernel_flag("post_pool"), D=D, D_P2=triton.next_power_of_2(D),
                                RD=2 * freqs.shape[1],
                                LOG2_D=D.bit_length() - 1, H_SCALE=D ** -0.5, ROTATE=bool(rotate),
                                num_warps=POST_POOL_WARPS, PDL=pdl, launch_pdl=pdl, **_EXACT)
    return out


# ------------------------------------------------------------------------------------------------ offline build
#: Kernel signatures for :func:`compile_sm90` (pointer and scalar types; the constexprs come from the family).
_SIGNATURES = {
    "rms_norm": ("_rms_norm_kernel", dict(x_ptr="*i16", w_ptr="*fp32", out_ptr="*i16", eps="fp32", stride_x="i32")),
    "q_kv": ("_q_kv_kernel", dict(q_ptr="*i16", kv_ptr="*i16", kv_w_ptr="*fp32", freqs_ptr="*fp32", pos_ptr="*i32",
                                  q_out_ptr="*i16", kv_out_ptr="*i16", err_ptr="*i32", n_pos="i32", eps="fp32",
                                  stride_q="i32", stride_kv="i32")),
    "index_q": ("_index_q_kernel", dict(q_ptr="*i16", w_ptr="*i16", freqs_ptr="*fp32", pos_ptr="*i32",
                                        q_out_ptr="*i16", w_out_ptr="*fp32", err_ptr="*i32", n_pos="i32",
                                        w_scale="fp32", stride_q="i32", stride_w="i32")),
    "output": ("_output_kernel", dict(o_ptr="*i16", freqs_ptr="*fp32", pos_ptr="*i32", out_ptr="*i16",
                                      err_ptr="*i32", T="i32", n_pos="i32")),
    "post_pool": ("_post_pool_kernel", dict(x_ptr="*fp32", w_ptr="*fp32", freqs_ptr="*fp32", pos_ptr="*i32",
                                            out_ptr="*i16", err_ptr="*i32", n_pos="i32", eps="fp32", shift="i32")),
    "post_pool_index": ("_post_pool_kernel", dict(x_ptr="*fp32", w_ptr="*fp32", freqs_ptr="*fp32", pos_ptr="*i32",
                                                  out_ptr="*i16", err_ptr="*i32", n_pos="i32", eps="fp32",
                                                  shift="i32")),
}


def compile_sm90(family: str, *, num_heads: int = 64, head_dim: int = 512, rope_dim: int = 64, q_lora: int = 1024,
                 index_heads: int = 64, index_dim: int = 128, groups: int = 8, pdl: bool = False,
                 q_heads_per_program: int = 1):
    """Compile one family's kernel for sm_90 without a GPU (default: V4-Flash shapes), as launched
    (``enable_fp_fusion=False``). Returns the ``CompiledKernel`` (``asm["ptx"]``, ``asm["cubin"]``). ``pdl``: the
    programmatic-dependent-launch build; ``q_heads_per_program``: the q / kv and output kernels' HB (prefill sizes:
    :data:`Q_KV_HEADS_PER_PROGRAM`)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    name, signature = _SIGNATURES[family]
    constexprs, warps = {
        "rms_norm": (dict(N=q_lora, N_P2=triton.next_power_of_2(q_lora), HAS_WEIGHT=True), RMS_NORM_WARPS),
        "q_kv": (dict(H=num_heads, D=head_dim, RD=rope_dim, D_P2=max(triton.next_power_of_2(head_dim), FP8_BLOCK),
                      FB=FP8_BLOCK, HAS_Q=True, HAS_KV=True, HB=q_heads_per_program), Q_KV_WARPS),
        "index_q": (dict(NH=index_heads, DI=index_dim, LOG2_DI=index_dim.bit_length() - 1, RD=rope_dim,
                         H_SCALE=index_dim ** -0.5, FB=FP4_BLOCK,
                         BLOCK_H=INDEX_BLOCK_H), INDEX_WARPS),
        "output": (dict(H=num_heads, D=head_dim, RD=rope_dim, G=groups, D_P2=triton.next_power_of_2(head_dim),
                        HB=q_heads_per_program), OUTPUT_WARPS),
        "post_pool": (dict(D=head_dim, D_P2=triton.next_power_of_2(head_dim), RD=rope_dim,
                           LOG2_D=head_dim.bit_length() - 1, H_SCALE=head_dim ** -0.5, ROTATE=False), POST_POOL_WARPS),
        "post_pool_index": (dict(D=index_dim, D_P2=triton.next_power_of_2(index_dim), RD=rope_dim,
                                 LOG2_D=index_dim.bit_length() - 1, H_SCALE=index_dim ** -0.5, ROTATE=True),
                            POST_POOL_WARPS),
    }[family]
    kernel = globals()[name]
    if family != "rms_norm":  # as launched: with the flag code of its op (device guard on)
        op = {"q_kv": "q_kv_path", "index_q": "index_q_path", "output": "output_path"}.get(family, "post_pool")
        constexprs = dict(constexprs, FLAG=_kernel_flag(op))
    constexprs = dict(constexprs, PDL=pdl)
    sig = dict(signature, **{k: "constexpr" for k in constexprs})
    return triton.compile(ASTSource(kernel, signature=sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, launch_pdl=pdl, **_EXACT))
