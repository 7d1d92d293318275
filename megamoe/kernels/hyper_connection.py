"""Hyper-connections of DeepSeek-V4 as few launches: ``hc_pre`` (+ RMSNorm), ``hc_post``, ``hc_head`` (+ norm).

The PyTorch formulas (``megamoe.reference.v4_numerics``: ``hc_mixes``, ``hc_split_sinkhorn``, ``hc_pre``,
``hc_post``, ``hc_head``, ``rms_norm``) are ~40 tiny kernels per decoder layer and token batch. Here:

* :func:`launch_hc_split_sinkhorn`: the sigmoid pre/post weights and the Sinkhorn comb from given mixes (one
  program per ``ROWS`` tokens; the (hc, hc) matrices stay in registers).
* :func:`launch_hc_pre`: two launches. ``_hc_mix_partial_kernel`` (grid ``(cdiv(T, BT), S)``) splits the
  ``hc * dim`` reduction into ``S`` chunks so that the float32 ``hc_fn`` (1.5 MB at V4-Flash) is streamed by
  many CTAs even at T = 1: each program writes its tokens' partial dots with the ``M`` rows of ``hc_fn`` and the
  partial sum of squares into a float32 workspace ``(S, T, MP)`` (column ``M`` = sum of squares).
  ``_hc_pre_finish_kernel`` (one program per token) adds the ``S`` partials in a fixed order (deterministic),
  applies ``rsqrt(mean + eps)``, runs the Sinkhorn (``HEAD``: the head's ``sigmoid(mix * scale + base) + eps``
  instead), forms ``y = sum_k pre_k x_k`` in float32, rounds it to bf16 and, with a norm weight, applies the
  RMSNorm of that bf16 ``y`` (float32, rounded to bf16) - the official rounding points of ``Block.hc_pre`` +
  ``attn_norm`` / ``ffn_norm`` and of ``ParallelHead.hc_head`` + ``norm``.
* :func:`launch_hc_post`: ``out[k] = bf16(post_k * y + sum_j comb[j, k] * residual[j])``, grid
  ``(T, cdiv(dim, BLOCK_D))``.

Numerics (launches pass ``enable_fp_fusion=False``: no FMA contraction in the finish / post kernels, each product
is rounded as in the reference). What is not bit-for-bit the reference's:

* the mixes GEMV and the sums of squares are float32 sums in another order than cuBLAS / PyTorch's reductions
  (``hc_fn`` dot products of 16384 terms; ``tl.dot`` with ``input_precision="ieee"``, plain float32 FMAs): the
  mixes differ by a few float32 ulps of ``sum |x_i w_i|``, so pre / post / comb differ by ~1e-7..1e-6
  (absolute; they are O(1)), and a bf16 output that depends on them moves by one bf16 ulp only where its float32
  value sits within that distance of a rounding boundary (measured: a few 1e-4 of the elements);
* the RMSNorm's sum of squares has another order than PyTorch's mean (a few float32 ulps of the factor);
* ``rsqrt`` is the platform's (``1 / sqrt`` in the interpreter, ``rsqrt.approx.ftz.f32`` on the GPU, as
  PyTorch's CUDA ``rsqrtf``).

Given the same pre / post / comb, ``y`` and ``hc_post`` are the reference's operation order (products rounded,
then summed over k / j sequentially, as PyTorch's 4-element reductions do), so they are bit-exact against it.

Non-finite values stay in their token: every token's reductions read only its own row (the GEMV's ``tl.dot``
rows are independent; masked lanes load 0).

Workspace: the ``(S, T, MP)`` float32 partials are a fresh ``torch.empty`` per call (PyTorch's caching
allocator: no host sync; under CUDA-graph capture they live in the graph's pool); no hidden persistent buffers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .v4_elementwise import _bf16_bits, _bf16_round, _load_bf16

#: Tokens per program of the standalone Sinkhorn kernel.
ROWS = 16
#: GEMV partial kernel: K elements per inner step; target number of programs (about 2 per H100 SM); smallest
#: chunk of the hc * dim reduction per program.
MIX_BLOCK_K = 64
MIX_TARGET_PROGRAMS = 264
MIX_MIN_CHUNK = 128
#: Warps of the GEMV partial kernel for 16 tokens per program; 8 for more (keeps registers < 255).
MIX_WARPS = 4
#: Finish kernel (one token per program) and hc_post kernel. The partials are loaded as (FINISH_MIN_S, ...)
#: tiles at least: with fewer rows the compiler spreads the reduced (hc, hc) comb over warps, and every Sinkhorn
#: normalisation becomes a shared-memory round trip (73 instead of 16 barriers in the PTX).
FINISH_WARPS = 8
FINISH_MIN_S = 64
POST_BLOCK_D = 512
POST_WARPS = 4

#: Compile options of the finish / post launches: no FMA contraction (the reference rounds each product).
_EXACT = dict(enable_fp_fusion=False)


def mix_tokens_per_program(T: int) -> int:
    """Tokens per program of the GEMV partial kernel (``tl.dot`` needs >= 16 rows; more rows, fewer re-reads
    of ``hc_fn`` from L2 at large T)."""
    return 16 if T <= 32 else 32 if T <= 128 else 64


def mix_warps(T: int) -> int:
    return MIX_WARPS if mix_tokens_per_program(T) <= 16 else 2 * MIX_WARPS


def finish_s_p2(S: int) -> int:
    return max(FINISH_MIN_S, triton.next_power_of_2(S))


def mix_chunk(T: int, K: int) -> int:
    """Elements of the ``K = hc * dim`` reduction per program: a power of two >= ``MIX_MIN_CHUNK`` giving about
    ``MIX_TARGET_PROGRAMS`` programs in all."""
    blocks = triton.cdiv(T, mix_tokens_per_program(T))
    splits = max(1, MIX_TARGET_PROGRAMS // blocks)
    return max(MIX_MIN_CHUNK, triton.next_power_of_2(triton.cdiv(K, splits)))


# ------------------------------------------------------------------------------------------------ Sinkhorn
@triton.jit
def _sinkhorn(m_pre, m_post, c, s0, s1, s2, base_ptr, eps, HC: tl.constexpr, ITERS: tl.constexpr):
    """(R, HC) pre / post mixes and (R, HC, HC) comb mixes -> (pre, post, comb), ``hc_split_sinkhorn``'s order."""
    h = tl.arange(0, HC)
    pre = tl.sigmoid(m_pre * s0 + tl.load(base_ptr + h)[None, :]) + eps
    post = 2.0 * tl.sigmoid(m_post * s1 + tl.load(base_ptr + HC + h)[None, :])
    jk = h[:, None] * HC + h[None, :]
    c = c * s2 + tl.load(base_ptr + 2 * HC + jk)[None, :, :]
    c = tl.exp(c - tl.max(c, axis=2)[:, :, None])
    c = c / tl.sum(c, axis=2)[:, :, None] + eps
    c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
    for _ in tl.static_range(ITERS - 1):
        c = c / (tl.sum(c, axis=2)[:, :, None] + eps)
        c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
    return pre, post, c


@triton.jit
def _hc_split_sinkhorn_kernel(mixes_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, n_rows,
                              eps, HC: tl.constexpr, ITERS: tl.constexpr, ROWS: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    rmask = rows < n_rows
    M: tl.constexpr = (2 + HC) * HC
    h = tl.arange(0, HC)
    m_pre = tl.load(mixes_ptr + rows[:, None] * M + h[None, :], mask=rmask[:, None], other=0.0)
    m_post = tl.load(mixes_ptr + rows[:, None] * M + HC + h[None, :], mask=rmask[:, None], other=0.0)
    # comb: (ROWS, HC, HC), element [r, j, k] at mixes[2*HC + j*HC + k]
    jk = h[:, None] * HC + h[None, :]
    c = tl.load(mixes_ptr + rows[:, None, None] * M + 2 * HC + jk[None, :, :], mask=rmask[:, None, None], other=0.0)
    pre, post, c = _sinkhorn(m_pre, m_post, c, tl.load(scale_ptr), tl.load(scale_ptr + 1), tl.load(scale_ptr + 2),
                             base_ptr, eps, HC, ITERS)
    tl.store(pre_ptr + rows[:, None] * HC + h[None, :], pre, mask=rmask[:, None])
    tl.store(post_ptr + rows[:, None] * HC + h[None, :], post, mask=rmask[:, None])
    tl.store(comb_ptr + rows[:, None, None] * (HC * HC) + jk[None, :, :], c, mask=rmask[:, None, None])


def launch_hc_split_sinkhorn(mixes: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor, hc: int,
                             iters: int, eps: float):
    """mixes (T, (2+hc)*hc) float32 contiguous -> (pre (T, hc), post (T, hc), comb (T, hc, hc)) float32."""
    T = mixes.shape[0]
    pre = torch.empty((T, hc), dtype=torch.float32, device=mixes.device)
    post = torch.empty((T, hc), dtype=torch.float32, device=mixes.device)
    comb = torch.empty((T, hc, hc), dtype=torch.float32, device=mixes.device)
    if T:
        _hc_split_sinkhorn_kernel[(triton.cdiv(T, ROWS),)](
            mixes, hc_scale, hc_base, pre, post, comb, T, eps, HC=hc, ITERS=iters, ROWS=ROWS)
    return pre, post, comb


# ------------------------------------------------------------------------------------------------ hc_pre / hc_head
@triton.jit
def _hc_mix_partial_kernel(x_ptr, fn_ptr, ws_ptr, T, K, M: tl.constexpr, MP: tl.constexpr, BT: tl.constexpr,
                           CHUNK: tl.constexpr, BK: tl.constexpr):
    """ws[s, t, :M] = x[t, chunk s] . fn[:, chunk s] (float32), ws[s, t, M] = sum over chunk s of x[t]^2.

    x: (T, K) bf16 bits (int16), fn: (M, K) float32, ws: (S, T, MP) float32 with S = cdiv(K, CHUNK).
    """
    pid_t = tl.program_id(0)
    s = tl.program_id(1)
    rows = pid_t * BT + tl.arange(0, BT)
    rmask = rows < T
    m = tl.arange(0, MP)
    mmask = m < M
    rows64 = rows.to(tl.int64)
    acc = tl.zeros((BT, MP), dtype=tl.float32)
    sq = tl.zeros((BT,), dtype=tl.float32)
    for kk in range(0, CHUNK, BK):
        cols = s * CHUNK + kk + tl.arange(0, BK)
        cmask = cols < K
        xv = _load_bf16(x_ptr + rows64[:, None] * K + cols[None, :], rmask[:, None] & cmask[None, :])
        w = tl.load(fn_ptr + m[:, None] * K + cols[None, :], mask=mmask[:, None] & cmask[None, :], other=0.0)
        acc = tl.dot(xv, tl.trans(w), acc, input_precision="ieee")
        sq += tl.sum(xv * xv, axis=1)
    out = tl.where(m[None, :] == M, sq[:, None], acc)
    tl.store(ws_ptr + (s * T + rows64[:, None]) * MP + m[None, :], out, mask=rmask[:, None] & (m[None, :] <= M))


@triton.jit
def _hc_pre_finish_kernel(ws_ptr, x_ptr, scale_ptr, base_ptr, w_ptr, out_ptr, pre_ptr, post_ptr, comb_ptr,
                          T, S, D, hc_eps, norm_eps, rms_eps, HC: tl.constexpr, ITERS: tl.constexpr,
                          M: tl.constexpr, MP: tl.constexpr, S_P2: tl.constexpr, BLOCK_D: tl.constexpr,
                          HEAD: tl.constexpr, HAS_NORM: tl.constexpr):
    """One token: reduce the S partials in order, weights (Sinkhorn or head sigmoid), y, optional RMSNorm."""
    t = tl.program_id(0).to(tl.int64)
    K = HC * D
    sp = tl.arange(0, S_P2)
    smask = sp < S
    ws_row = ws_ptr + (sp.to(tl.int64) * T + t) * MP  # (S_P2,) pointers to this token's partials
    h = tl.arange(0, HC)
    sumsq = tl.sum(tl.load(ws_row + M, mask=smask, other=0.0), axis=0)
    rs = tl.math.rsqrt(tl.div_rn(sumsq, K * 1.0) + norm_eps)
    m_pre = tl.sum(tl.load(ws_row[:, None] + h[None, :], mask=smask[:, None], other=0.0), axis=0)[None, :] * rs
    if HEAD:
        pre = tl.sigmoid(m_pre * tl.load(scale_ptr) + tl.load(base_ptr + h)[None, :]) + hc_eps
    else:
        m_post = tl.sum(tl.load(ws_row[:, None] + HC + h[None, :], mask=smask[:, None], other=0.0),
                        axis=0)[None, :] * rs
        jk = h[:, None] * HC + h[None, :]
        m_comb = tl.sum(tl.load(ws_row[:, None, None] + 2 * HC + jk[None, :, :], mask=smask[:, None, None],
                                other=0.0), axis=0)[None, :, :] * rs
        pre, post, comb = _sinkhorn(m_pre, m_post, m_comb, tl.load(scale_ptr), tl.load(scale_ptr + 1),
                                    tl.load(scale_ptr + 2), base_ptr, hc_eps, HC, ITERS)
        tl.store(post_ptr + t * HC + h[None, :], post)
        tl.store(comb_ptr + t * (HC * HC) + jk[None, :, :], comb)
    tl.store(pre_ptr + t * HC + h[None, :], pre)
    # y = sum_k pre_k * x_k: products rounded, summed in k order (no FMA: enable_fp_fusion=False)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    x_row = x_ptr + t * K
    y = tl.sum(tl.where(h[None, :] == 0, pre, 0.0)) * _load_bf16(x_row + d, dmask)
    for k in tl.static_range(1, HC):
        y = y + tl.sum(tl.where(h[None, :] == k, pre, 0.0)) * _load_bf16(x_row + k * D + d, dmask)
    if HAS_NORM:
        yb = _bf16_round(y)
        r = tl.math.rsqrt(tl.div_rn(tl.sum(yb * yb, axis=0), D * 1.0) + rms_eps)
        y = tl.load(w_ptr + d, mask=dmask, other=0.0) * (yb * r)
    tl.store(out_ptr + t * D + d, _bf16_bits(y).to(tl.int16), mask=dmask)


def launch_hc_pre(x: torch.Tensor, hc_fn: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor,
                  norm_weight: torch.Tensor | None, *, iters: int, hc_eps: float, norm_eps: float, rms_eps: float,
                  head: bool = False):
    """x (T, hc, D) bf16 contiguous, hc_fn (M, hc * D) float32 contiguous with M = (2 + hc) * hc (``head``: M = hc),
    hc_scale (3,) / (1,) float32, hc_base (M,) float32, norm_weight (D,) float32 or None.

    -> (out (T, D) bf16, pre (T, hc), post (T, hc) or None, comb (T, hc, hc) or None) float32; ``out`` is
    ``bf16(sum_k pre_k x_k)``, then ``rms_norm(out, norm_weight, rms_eps)`` when a weight is given.
    Two launches; the (S, T, MP) float32 workspace is allocated per call.
    """
    T, hc, D = x.shape
    M, K = hc_fn.shape
    dev = x.device
    out = torch.empty((T, D), dtype=torch.bfloat16, device=dev)
    pre = torch.empty((T, hc), dtype=torch.float32, device=dev)
    post = None if head else torch.empty((T, hc), dtype=torch.float32, device=dev)
    comb = None if head else torch.empty((T, hc, hc), dtype=torch.float32, device=dev)
    if T == 0:
        return out, pre, post, comb
    MP = max(16, triton.next_power_of_2(M + 1))
    BT = mix_tokens_per_program(T)
    chunk = mix_chunk(T, K)
    S = triton.cdiv(K, chunk)
    ws = torch.empty((S, T, MP), dtype=torch.float32, device=dev)
    x16 = x.view(torch.int16)
    _hc_mix_partial_kernel[(triton.cdiv(T, BT), S)](x16, hc_fn, ws, T, K, M=M, MP=MP, BT=BT, CHUNK=chunk,
                                                   BK=min(MIX_BLOCK_K, chunk), num_warps=mix_warps(T))
    has_norm = norm_weight is not None
    _hc_pre_finish_kernel[(T,)](
        ws, x16, hc_scale, hc_base, norm_weight if has_norm else hc_base, out.view(torch.int16), pre,
        pre if head else post, pre if head else comb, T, S, D, hc_eps, norm_eps, rms_eps, HC=hc, ITERS=iters, M=M,
        MP=MP, S_P2=finish_s_p2(S), BLOCK_D=triton.next_power_of_2(D), HEAD=head, HAS_NORM=has_norm,
        num_warps=FINISH_WARPS, **_EXACT)
    return out, pre, post, comb


# ------------------------------------------------------------------------------------------------ hc_post
@triton.jit
def _hc_post_kernel(y_ptr, res_ptr, post_ptr, comb_ptr, out_ptr, D, HC: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[t, k, d] = bf16(post[t, k] * y[t, d] + sum_j comb[t, j, k] * res[t, j, d]) (reference order)."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < D
    h = tl.arange(0, HC)
    res_row = res_ptr + t * HC * D
    mixed = tl.load(comb_ptr + t * HC * HC + h)[:, None] * _load_bf16(res_row + d, dmask)[None, :]
    for j in tl.static_range(1, HC):
        c_j = tl.load(comb_ptr + t * HC * HC + j * HC + h)
        mixed = mixed + c_j[:, None] * _load_bf16(res_row + j * D + d, dmask)[None, :]
    yv = _load_bf16(y_ptr + t * D + d, dmask)
    out = tl.load(post_ptr + t * HC + h)[:, None] * yv[None, :] + mixed
    tl.store(out_ptr + t * HC * D + h[:, None] * D + d[None, :], _bf16_bits(out).to(tl.int16), mask=dmask[None, :])


def launch_hc_post(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """y (T, D) bf16, residual (T, hc, D) bf16, post (T, hc), comb (T, hc, hc) float32, all contiguous ->
    (T, hc, D) bf16. One launch, grid (T, cdiv(D, POST_BLOCK_D))."""
    T, hc, D = residual.shape
    out = torch.empty((T, hc, D), dtype=torch.bfloat16, device=y.device)
    if T:
        block_d = min(POST_BLOCK_D, triton.next_power_of_2(D))
        _hc_post_kernel[(T, triton.cdiv(D, block_d))](
            y.view(torch.int16), residual.view(torch.int16), post, comb, out.view(torch.int16), D, HC=hc,
            BLOCK_D=block_d, num_warps=POST_WARPS, **_EXACT)
    return out


#: Offline sm_90 compile (tests / SASS inspection): kernel name -> runtime-argument signature.
_SIGNATURES = {
    "_hc_mix_partial_kernel": dict(x_ptr="*i16", fn_ptr="*fp32", ws_ptr="*fp32", T="i32", K="i32"),
    "_hc_pre_finish_kernel": dict(ws_ptr="*fp32", x_ptr="*i16", scale_ptr="*fp32", base_ptr="*fp32", w_ptr="*fp32",
                                  out_ptr="*i16", pre_ptr="*fp32", post_ptr="*fp32", comb_ptr="*fp32", T="i32",
                                  S="i32", D="i32", hc_eps="fp32", norm_eps="fp32", rms_eps="fp32"),
    "_hc_post_kernel": dict(y_ptr="*i16", res_ptr="*i16", post_ptr="*fp32", comb_ptr="*fp32", out_ptr="*i16",
                            D="i32"),
}


def compile_sm90(T: int = 1, dim: int = 4096, hc: int = 4, *, head: bool = False, iters: int = 20):
    """Compile the three hc kernels for sm_90 without a GPU, as launched for (T, hc, dim) (default: V4-Flash
    decode at T = 1). Returns {kernel name: ``CompiledKernel``} (``n_regs``, ``n_spills``, ``asm["ptx"]``)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    M = hc if head else (2 + hc) * hc
    K = hc * dim
    chunk = mix_chunk(T, K)
    S = triton.cdiv(K, chunk)
    MP = max(16, triton.next_power_of_2(M + 1))
    consts = {
        "_hc_mix_partial_kernel": (dict(M=M, MP=MP, BT=mix_tokens_per_program(T), CHUNK=chunk,
                                        BK=min(MIX_BLOCK_K, chunk)), mix_warps(T), {}),
        "_hc_pre_finish_kernel": (dict(HC=hc, ITERS=iters, M=M, MP=MP, S_P2=finish_s_p2(S),
                                       BLOCK_D=triton.next_power_of_2(dim), HEAD=head, HAS_NORM=True),
                                  FINISH_WARPS, _EXACT),
        "_hc_post_kernel": (dict(HC=hc, BLOCK_D=min(POST_BLOCK_D, triton.next_power_of_2(dim))), POST_WARPS,
                            _EXACT),
    }
    out = {}
    for name, (constexprs, warps, opts) in consts.items():
        sig = dict(_SIGNATURES[name], **{k: "constexpr" for k in constexprs})
        out[name] = triton.compile(ASTSource(globals()[name], signature=sig, constexprs=constexprs),
                                   target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, **opts))
    return out
