"""Hyper-connections of DeepSeek-V4 as few launches: ``hc_pre`` (+ RMSNorm), ``hc_post``, ``hc_head`` (+ norm).

The PyTorch formulas (``megamoe.reference.v4_numerics``: ``hc_mixes``, ``hc_split_sinkhorn``, ``hc_pre``,
``hc_post``, ``hc_head``, ``rms_norm``) are ~40 tiny kernels per decoder layer and token batch. Here:

* :func:`launch_hc_split_sinkhorn`: the sigmoid pre/post weights and the Sinkhorn comb from given mixes (one
  program per ``ROWS`` tokens; the (hc, hc) matrices stay in registers).
* :func:`launch_hc_pre`: two launches. ``_hc_mix_partial_kernel`` (grid ``(cdiv(T, BT), S)``, :func:`mix_plan`)
  splits the ``hc * dim`` reduction by hidden position: program ``s`` takes positions ``[s * CH, (s + 1) * CH)`` of
  all ``hc`` copies, so the float32 ``hc_fn`` (1.5 MB at V4-Flash) is streamed by ~128-264 CTAs even at T = 1;
  it writes its tokens' partial dots with the ``M`` rows of ``hc_fn`` and the partial sum of squares into a
  float32 workspace ``(S, T, MP)`` (column ``M`` = sum of squares). Up to 4 tokens it multiplies and sums
  directly (no ``tl.dot``, whose 16-row minimum wasted 15/16 of the T = 1 work), above that ``tl.dot``.
  ``_hc_pre_finish_kernel`` (one program per token) loads the token's ``x`` first, sums the S partials (one
  fixed-order reduction), applies ``rsqrt(mean + eps)``, forms ``y = sum_k pre_k x_k`` in float32, rounds it to
  bf16 and, with a norm weight, applies the RMSNorm of that bf16 ``y`` (float32, rounded to bf16) - the official
  rounding points of ``Block.hc_pre`` + ``attn_norm`` / ``ffn_norm`` and of ``ParallelHead.hc_head`` + ``norm`` -
  then the Sinkhorn (``HEAD``: the head's ``sigmoid(mix * scale + base) + eps`` instead) on scalars: every
  thread holds the (hc, hc) matrix, the 20 iterations need no shuffle or barrier.
* :func:`launch_hc_post_pre`: ``hc_post`` fused with the next ``hc_pre`` / ``hc_head``: the partial kernel
  (``POST``) computes the new residual stream of its slice (``hc_post``'s arithmetic, stored), then the partial
  dots of those bf16 values; then the finish kernel. Two launches instead of three, and the same partial kernel
  with the same split as :func:`launch_hc_pre`: bit for bit ``launch_hc_post`` then ``launch_hc_pre`` (on the GPU
  when ``dim % 16 == 0``, as V4's 4096 / 7168: otherwise the two partial kernels' x loads are aligned differently,
  Triton picks other layouts and the partial sums differ in float32 order; measured at dim 72).
* :func:`launch_hc_post`: ``out[k] = bf16(post_k * y + sum_j comb[j, k] * residual[j])``, grid
  ``(T, cdiv(dim, BLOCK_D))``.

Numerics (launches pass ``enable_fp_fusion=False``: no FMA contraction in the partial / finish / post kernels,
each product is rounded as in the reference; ``tl.dot`` above 4 tokens uses FMAs, and from ``MIX_TC_MIN_T`` tokens on
the GPU the tensor cores with exact products, :data:`MIX_TC_MIN_T`). What is not bit-for-bit the reference's:

* the mixes GEMV and the sums of squares are float32 sums in another order than cuBLAS / PyTorch's reductions
  (``hc_fn`` dot products of 16384 terms; ``tl.dot`` with ``input_precision="ieee"``, plain float32 FMAs, or the
  tensor-core steps: exact products, each step's sum added once): the
  mixes differ by a few float32 ulps of ``sum |x_i w_i|``, so pre / post / comb differ by ~1e-7..1e-6
  (absolute; they are O(1)), and a bf16 output that depends on them moves by one bf16 ulp only where its float32
  value sits within that distance of a rounding boundary (measured: a few 1e-4 of the elements);
* the RMSNorm's sum of squares has another order than PyTorch's mean (a few float32 ulps of the factor);
* the Sinkhorn's 4-term row / column sums are sequential (index order); the standalone kernel divides (the
  platform's float32 division, ``div.full.f32`` on the GPU, ~2 ulps), the finish kernel multiplies by one
  reciprocal per sum (``FINISH_RCP``: ``rcp.approx.ftz.f32`` on the GPU, <= 1 ulp, then a rounded product;
  ``1.0 / x`` in the interpreter): within the same ~1e-6 of pre / post / comb;
* the partials' order (version 2, this file): per hidden slice of ``CH`` positions, inner steps of ``BDI`` positions
  x ``hc`` copies summed in step order (``tl.dot`` / a product-and-sum tree inside a step), then the S slices in
  the finish's reduction tree; version 1 split ``hc * dim`` into contiguous column chunks. A function of
  (T, dim) only: deterministic, and the fused / unfused paths use the same order;
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

import os

import torch
import triton
import triton.language as tl

from .pdl import grid_dependency_prologue, pdl_enabled
from .v4_elementwise import _bf16_bits, _bf16_round, _load_bf16

#: Tokens per program of the standalone Sinkhorn kernel.
ROWS = 16
#: Mixes-partial kernel (:func:`mix_plan`): target number of programs (about 2 per H100 SM); up to MIX_SMALL_T
#: tokens a broadcast product of MIX_SMALL_COLS hidden positions x tokens per step (no ``tl.dot``, whose 16-row
#: minimum wastes 15/16 of the work at T = 1), above it ``tl.dot`` steps of MIX_DOT_BDI hidden positions
#: (hc * MIX_DOT_BDI = 64 columns); MIX_WARPS for the broadcast product, MIX_DOT_WARPS for 16 tokens per program,
#: twice that for 32 (the FMA ``tl.dot`` with the fused hc_post tiles: 128 registers, 255 with 4 warps).
MIX_TARGET_PROGRAMS = 264
MIX_SMALL_T = 4
MIX_SMALL_COLS = 32
MIX_DOT_BDI = 16
MIX_WARPS = 4
MIX_DOT_WARPS = 8
#: From MIX_TC_MIN_T tokens on the GPU the ``tl.dot`` steps run on the tensor cores (:func:`mix_plan`'s TC): x is bf16
#: (exact), each float32 ``hc_fn`` value is split into three bf16 terms (hi + mid + lo, exact for normal values), so
#: every product is exact; each step's three dots are added to the float32 accumulator by one rounded add (the
#: router-logits promotion). The FMA ``tl.dot`` (``input_precision="ieee"``) it replaces took 1.1 ms per call at
#: 4096 tokens (22% of a V4-Flash prefill, ``results/gpu_check_v30/d_prefill.md``; now 268 us, and more accurate:
#: ``f_sweep_hc_mix.md``). 16 tokens per program up to 64 tokens, MIX_TC_BT above; MIX_TC_BDI hidden positions per
#: step (32 spilled: 320-368 B of stack at 64-token tiles).
MIX_TC_MIN_T = 16
MIX_TC_BT = 64
MIX_TC_BDI = 16
MIX_TC_WARPS = 8
#: Finish kernel (one token per program): hidden positions per thread and copy (the warps follow: 4 at D = 4096, 8
#: at 7168). Every thread runs the whole scalar Sinkhorn chain, so each extra warp per scheduler adds the chain's
#: ~1500 instructions to the issue slots of the kernel's critical path (v2: 16 per thread, 8 / 16 warps). x is
#: loaded before the partial sums (HOIST) when a thread holds at most FINISH_HOIST_MAX positions per copy.
FINISH_POSITIONS_PER_THREAD = 32
FINISH_HOIST_MAX = 16
#: Finish kernel's Sinkhorn: one reciprocal per row / column sum and products (4 + 4 reciprocals per iteration at
#: hc = 4) instead of 32 divisions (:func:`finish_rcp`).
FINISH_RCP = True
POST_BLOCK_D = 512
POST_WARPS = 4

#: Compile options of the partial / finish / post launches: no FMA contraction (the reference rounds each product).
_EXACT = dict(enable_fp_fusion=False)


def finish_warps(D: int) -> int:
    """Warps of the finish kernel: FINISH_POSITIONS_PER_THREAD positions of each copy per thread, 1 to 16 warps."""
    return max(1, min(16, triton.next_power_of_2(D) // (32 * FINISH_POSITIONS_PER_THREAD)))


def finish_rcp(x: torch.Tensor) -> int:
    """The finish kernel's Sinkhorn reciprocal mode (:func:`_divisor`): 0 without FINISH_RCP, else the GPU's
    ``rcp.approx`` on CUDA and ``1.0 / x`` in the interpreter."""
    return 0 if not FINISH_RCP else (2 if x.is_cuda else 1)


def finish_hoist(D: int) -> bool:
    """Load x before the partial sums when a thread holds <= FINISH_HOIST_MAX positions per copy (registers)."""
    return triton.next_power_of_2(D) // (32 * finish_warps(D)) <= FINISH_HOIST_MAX


def mix_mp(M: int) -> int:
    """Workspace row length: the M mixes and the sum of squares, padded to a power of two >= 16."""
    return max(16, triton.next_power_of_2(M + 1))


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
                              eps, HC: tl.constexpr, ITERS: tl.constexpr, ROWS: tl.constexpr,
                              PDL: tl.constexpr = False):
    grid_dependency_prologue(PDL)  # first: before any global access (kernels/pdl.py)
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
        pdl = pdl_enabled(mixes)
        _hc_split_sinkhorn_kernel[(triton.cdiv(T, ROWS),)](
            mixes, hc_scale, hc_base, pre, post, comb, T, eps, HC=hc, ITERS=iters, ROWS=ROWS, PDL=pdl,
            launch_pdl=pdl)
    return pre, post, comb


# ------------------------------------------------------------------------------------------------ hc_pre / hc_head
def mix_plan(T: int, D: int, tc: bool = False) -> tuple[int, bool, int, int, int, int]:
    """(BT, DOT, BDI, CH, S, warps) of the mixes-partial kernel for T tokens of hidden size D (host shapes only).

    BT tokens per program (``tl.dot`` needs >= 16 rows; up to 4 tokens a broadcast product instead), BDI hidden
    positions per inner step (times ``hc`` copies: ``hc * BDI`` columns of the ``hc * D`` reduction), CH hidden
    positions per program (a multiple of BDI giving about ``MIX_TARGET_PROGRAMS`` programs), S = cdiv(D, CH)
    partials per token. ``tc``: the tensor-core steps (:func:`mix_tensor_cores`; from MIX_TC_MIN_T tokens)."""
    if T <= MIX_SMALL_T:
        bt = triton.next_power_of_2(max(T, 1))
        dot, bdi, warps = False, MIX_SMALL_COLS // bt, MIX_WARPS
    elif tc:
        bt = 16 if T <= 64 else MIX_TC_BT
        dot, bdi, warps = True, MIX_TC_BDI, MIX_TC_WARPS
    else:
        bt = 16 if T <= 64 else 32
        dot, bdi, warps = True, MIX_DOT_BDI, MIX_DOT_WARPS if bt <= 16 else 2 * MIX_DOT_WARPS
    blocks = triton.cdiv(T, bt)
    splits = max(1, MIX_TARGET_PROGRAMS // blocks)
    ch = max(bdi, triton.next_power_of_2(triton.cdiv(D, splits)))
    return bt, dot, bdi, ch, triton.cdiv(D, ch), warps


def mix_tensor_cores(T: int, on_gpu: bool) -> bool:
    """Whether the mixes-partial kernel takes the tensor-core steps for T tokens (host shapes and the device only):
    from :data:`MIX_TC_MIN_T` tokens, on the GPU (the interpreter runs them when ``MEGAMOE_HC_MIX_TC=1``, for the
    CPU tests)."""
    if T < MIX_TC_MIN_T:
        return False
    return on_gpu or os.environ.get("MEGAMOE_HC_MIX_TC", "0") == "1"


@triton.jit
def _hc_mix_partial_kernel(y_ptr, res_ptr, post_ptr, comb_ptr, out_ptr, x_ptr, fn_ptr, ws_ptr, T, D, one,
                           HC: tl.constexpr, M: tl.constexpr, MP: tl.constexpr, BT: tl.constexpr, CH: tl.constexpr,
                           BDI: tl.constexpr, POST: tl.constexpr, DOT: tl.constexpr, TC: tl.constexpr = False,
                           INTERPRET: tl.constexpr = False, PDL: tl.constexpr = False):
    """Program (pid_t, s): tokens [pid_t * BT, + BT), hidden positions d in [s * CH, (s + 1) * CH) of all HC copies.

    POST: h[t, k, d] = bf16(post[t, k] * y[t, d] + sum_j comb[t, j, k] * res[t, j, d]) (``_hc_post_kernel``'s
    order) is stored to ``out`` (T, HC, D) and is the ``x`` of the partials; else x is read from ``x_ptr``.
    ws[s, t, :M] = sum over the slice of x[t, k, d] * fn[:, k * D + d], ws[s, t, M] = sum of x[t, k, d]^2 (float32,
    inner steps of BDI positions in order). x / y / res / out: bf16 bits (int16); fn (M, HC * D) float32.
    TC: each step's dot on the tensor cores, fn split into three bf16 terms (exact products), the step's sum added to
    acc by one rounded add (``one`` is 1.0 at run time: the compiler cannot fold the add into the MMA accumulator).
    """
    grid_dependency_prologue(PDL)  # first: before any global access (kernels/pdl.py)
    pid_t = tl.program_id(0)
    s = tl.program_id(1)
    KC: tl.constexpr = HC * BDI
    K = HC * D
    rows = pid_t * BT + tl.arange(0, BT)
    rmask = rows < T
    rows64 = rows.to(tl.int64)
    c = tl.arange(0, KC)
    ck = c // BDI  # copy k of column c; its hidden position is d0 + c % BDI
    cd = c % BDI
    m = tl.arange(0, MP)
    mmask = m < M
    if POST:
        pc = tl.load(post_ptr + rows64[:, None] * HC + ck[None, :], mask=rmask[:, None], other=0.0)
        combs = ()  # combs[j][t, c] = comb[t, j, k(c)]
        for j in tl.static_range(HC):
            combs = combs + (tl.load(comb_ptr + rows64[:, None] * (HC * HC) + j * HC + ck[None, :],
                                     mask=rmask[:, None], other=0.0),)
    acc = tl.zeros((BT, MP), dtype=tl.float32)
    sq = tl.zeros((BT,), dtype=tl.float32)
    for dd in range(0, CH, BDI):
        d = s * CH + dd + cd
        dmask = d < D
        mask = rmask[:, None] & dmask[None, :]
        col = ck * D + d
        w = tl.load(fn_ptr + m[:, None] * K + col[None, :], mask=mmask[:, None] & dmask[None, :], other=0.0)
        if POST:
            res_row = res_ptr + rows64[:, None] * K + d[None, :]
            mixed = combs[0] * _load_bf16(res_row, mask)
            for j in tl.static_range(1, HC):
                mixed = mixed + combs[j] * _load_bf16(res_row + j * D, mask)
            hv = pc * _load_bf16(y_ptr + rows64[:, None] * D + d[None, :], mask) + mixed
            hb = _bf16_bits(hv)
            tl.store(out_ptr + rows64[:, None] * K + col[None, :], hb.to(tl.int16), mask=mask)
            xv = tl.where(mask, (hb << 16).to(tl.float32, bitcast=True), 0.0)
        else:
            xv = _load_bf16(x_ptr + rows64[:, None] * K + col[None, :], mask)
        if TC:
            w_hi = w.to(tl.bfloat16)
            rest = w - w_hi.to(tl.float32)
            w_mid = rest.to(tl.bfloat16)
            w_lo = (rest - w_mid.to(tl.float32)).to(tl.bfloat16)
            xb = xv.to(tl.bfloat16)  # exact: x holds bf16 values
            if INTERPRET:  # the interpreter's bf16 dot is wrong; bf16 values and their products are exact in fp32
                part = tl.dot(xb.to(tl.float32), tl.trans(w_hi.to(tl.float32)), input_precision="ieee")
                small = tl.dot(xb.to(tl.float32), tl.trans(w_lo.to(tl.float32)), input_precision="ieee")
                small = tl.dot(xb.to(tl.float32), tl.trans(w_mid.to(tl.float32)), small, input_precision="ieee")
            else:
                part = tl.dot(xb, tl.trans(w_hi))
                small = tl.dot(xb, tl.trans(w_lo))
                small = tl.dot(xb, tl.trans(w_mid), small)
            acc = acc + (part + small) * one
        elif DOT:
            acc = tl.dot(xv, tl.trans(w), acc, input_precision="ieee")
        else:
            acc += tl.sum(xv[:, None, :] * w[None, :, :], axis=2)
        sq += tl.sum(xv * xv, axis=1)
    out = tl.where(m[None, :] == M, sq[:, None], acc)
    tl.store(ws_ptr + (s * T + rows64[:, None]) * MP + m[None, :], out, mask=rmask[:, None] & (m[None, :] <= M))


@triton.jit
def _divisor(x, RCP: tl.constexpr):
    """What the Sinkhorn's ``_divide`` takes for a sum ``x`` (> eps > 0): RCP 0 = x itself (divisions), 1 = ``1.0 /
    x`` (the platform's division, once per sum), 2 = one ``rcp.approx.ftz.f32`` (GPU only; max 1 ulp, the sums are
    normal numbers)."""
    if RCP == 2:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    elif RCP == 1:
        return 1.0 / x
    else:
        return x


@triton.jit
def _divide(a, d, RCP: tl.constexpr):
    """a / sum, given ``d = _divisor(sum, RCP)``: a product with the reciprocal (RCP 1 / 2) or a division (0)."""
    if RCP:
        return a * d
    else:
        return a / d


@triton.jit
def _sinkhorn_scalars(comb, eps, HC: tl.constexpr, ITERS: tl.constexpr, RCP: tl.constexpr = 0):
    """The Sinkhorn of ``hc_split_sinkhorn`` on HC * HC float32 scalars (a row-major tuple, already ``mix * scale +
    base``): softmax over k, + eps, then column / row normalisations. Scalars: every thread holds the whole
    matrix, no shuffles or shared memory. Row / column sums are sequential in index order. RCP (:func:`_divisor`):
    one reciprocal per sum and HC products instead of HC divisions."""
    c = ()
    for j in tl.static_range(HC):
        mx = comb[j * HC]
        for k in tl.static_range(1, HC):
            mx = tl.maximum(mx, comb[j * HC + k])
        e = ()
        for k in tl.static_range(HC):
            e = e + (tl.exp(comb[j * HC + k] - mx),)
        tot = e[0]
        for k in tl.static_range(1, HC):
            tot = tot + e[k]
        d = _divisor(tot, RCP)
        for k in tl.static_range(HC):
            c = c + (_divide(e[k], d, RCP) + eps,)
    c = _normalize_columns(c, eps, HC, RCP)
    for _ in tl.static_range(ITERS - 1):
        c = _normalize_rows(c, eps, HC, RCP)
        c = _normalize_columns(c, eps, HC, RCP)
    return c


@triton.jit
def _normalize_rows(c, eps, HC: tl.constexpr, RCP: tl.constexpr = 0):
    """Rows divided by (their sum + eps) (RCP: :func:`_divisor`)."""
    out = ()
    for j in tl.static_range(HC):
        tot = c[j * HC]
        for k in tl.static_range(1, HC):
            tot = tot + c[j * HC + k]
        d = _divisor(tot + eps, RCP)
        for k in tl.static_range(HC):
            out = out + (_divide(c[j * HC + k], d, RCP),)
    return out


@triton.jit
def _normalize_columns(c, eps, HC: tl.constexpr, RCP: tl.constexpr = 0):
    """Columns divided by (their sum + eps) (RCP: :func:`_divisor`)."""
    ds = ()
    for k in tl.static_range(HC):
        tot = c[k]
        for j in tl.static_range(1, HC):
            tot = tot + c[j * HC + k]
        ds = ds + (_divisor(tot + eps, RCP),)
    out = ()
    for j in tl.static_range(HC):
        for k in tl.static_range(HC):
            out = out + (_divide(c[j * HC + k], ds[k], RCP),)
    return out


@triton.jit
def _hc_pre_finish_kernel(ws_ptr, x_ptr, scale_ptr, base_ptr, w_ptr, out_ptr, pre_ptr, post_ptr, comb_ptr,
                          T, S, D, hc_eps, norm_eps, rms_eps, HC: tl.constexpr, ITERS: tl.constexpr,
                          M: tl.constexpr, S_P2: tl.constexpr, BLOCK_D: tl.constexpr, HEAD: tl.constexpr,
                          HAS_NORM: tl.constexpr, MP: tl.constexpr, HOIST: tl.constexpr, PDL: tl.constexpr = False,
                          RCP: tl.constexpr = 0):
    """One token: (HOIST) its x rows and norm weight loaded first; the (S, MP) partials summed over s, the M + 1
    columns as scalars; pre (then y and the optional RMSNorm), then the Sinkhorn (or the head's sigmoid) on
    scalars: every thread holds them all, no shuffles or shared memory in the 20 iterations."""
    grid_dependency_prologue(PDL)  # first: before any global access (kernels/pdl.py)
    t = tl.program_id(0).to(tl.int64)
    K = HC * D
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    x_row = x_ptr + t * K
    xs = ()
    if HOIST:  # the token's loads first, their latency overlaps the partial sums (registers permitting)
        for k in tl.static_range(HC):
            xs = xs + (_load_bf16(x_row + k * D + d, dmask),)
    if HAS_NORM:
        wv = tl.load(w_ptr + d, mask=dmask, other=0.0)
    sp = tl.arange(0, S_P2)
    m = tl.arange(0, MP)
    ws_row = ws_ptr + (sp.to(tl.int64) * T + t) * MP  # (S_P2,) pointers to this token's partials
    # one (S_P2, MP) reduction over s (a fixed tree order), then the M + 1 columns as scalars (column M: the sum
    # of squares); the extraction reduces along MP only (within warps: no barrier per column)
    tot = tl.sum(tl.load(ws_row[:, None] + m[None, :], mask=(sp < S)[:, None] & (m <= M)[None, :], other=0.0), axis=0)
    mix = ()
    for i in tl.static_range(M + 1):
        mix = mix + (tl.sum(tl.where(m == i, tot, 0.0), axis=0),)
    rs = tl.math.rsqrt(tl.div_rn(mix[M], K * 1.0) + norm_eps)
    s0 = tl.load(scale_ptr)
    pre = ()
    for k in tl.static_range(HC):
        pre = pre + (tl.sigmoid(mix[k] * rs * s0 + tl.load(base_ptr + k)) + hc_eps,)
    if not HOIST:
        for k in tl.static_range(HC):
            xs = xs + (_load_bf16(x_row + k * D + d, dmask),)
    # y = sum_k pre_k * x_k: products rounded, summed in k order (no FMA: enable_fp_fusion=False)
    y = pre[0] * xs[0]
    for k in tl.static_range(1, HC):
        y = y + pre[k] * xs[k]
    if HAS_NORM:
        yb = _bf16_round(y)
        r = tl.math.rsqrt(tl.div_rn(tl.sum(yb * yb, axis=0), D * 1.0) + rms_eps)
        y = wv * (yb * r)
    tl.store(out_ptr + t * D + d, _bf16_bits(y).to(tl.int16), mask=dmask)
    for k in tl.static_range(HC):
        tl.store(pre_ptr + t * HC + k, pre[k])
    if not HEAD:
        s1 = tl.load(scale_ptr + 1)
        s2 = tl.load(scale_ptr + 2)
        for k in tl.static_range(HC):
            tl.store(post_ptr + t * HC + k, 2.0 * tl.sigmoid(mix[HC + k] * rs * s1 + tl.load(base_ptr + HC + k)))
        cm = ()
        for i in tl.static_range(HC * HC):
            cm = cm + (mix[2 * HC + i] * rs * s2 + tl.load(base_ptr + 2 * HC + i),)
        comb = _sinkhorn_scalars(cm, hc_eps, HC, ITERS, RCP)
        for i in tl.static_range(HC * HC):
            tl.store(comb_ptr + t * (HC * HC) + i, comb[i])


def _launch_mix_and_finish(x, hc_fn, hc_scale, hc_base, norm_weight, post_args, *, iters, hc_eps, norm_eps,
                           rms_eps, head):
    """The partial launch (``post_args`` = (y, residual, post, comb) fuses the preceding hc_post: x is its output,
    allocated here) and the finish launch. -> (x, out, pre, post, comb)."""
    T, hc, D = x.shape if post_args is None else post_args[1].shape
    M = hc_fn.shape[0]
    dev = hc_fn.device
    if post_args is not None:
        x = torch.empty((T, hc, D), dtype=torch.bfloat16, device=dev)
    out = torch.empty((T, D), dtype=torch.bfloat16, device=dev)
    pre = torch.empty((T, hc), dtype=torch.float32, device=dev)
    post = None if head else torch.empty((T, hc), dtype=torch.float32, device=dev)
    comb = None if head else torch.empty((T, hc, hc), dtype=torch.float32, device=dev)
    if T == 0:
        return x, out, pre, post, comb
    MP = mix_mp(M)
    tc = mix_tensor_cores(T, hc_fn.is_cuda)
    bt, dot, bdi, ch, S, warps = mix_plan(T, D, tc)
    ws = torch.empty((S, T, MP), dtype=torch.float32, device=dev)
    x16 = x.view(torch.int16)
    pdl = pdl_enabled(hc_fn)
    if post_args is None:
        y16, res16, p_in, c_in = x16, x16, hc_fn, hc_fn  # unused (POST=False)
    else:
        y16, res16, p_in, c_in = post_args[0].view(torch.int16), post_args[1].view(torch.int16), post_args[2], \
            post_args[3]
    _hc_mix_partial_kernel[(triton.cdiv(T, bt), S)](
        y16, res16, p_in, c_in, x16, x16, hc_fn, ws, T, D, 1.0, HC=hc, M=M, MP=MP, BT=bt, CH=ch, BDI=bdi,
        POST=post_args is not None, DOT=dot, TC=tc, INTERPRET=not hc_fn.is_cuda, num_warps=warps, PDL=pdl,
        launch_pdl=pdl, **_EXACT)
    has_norm = norm_weight is not None
    _hc_pre_finish_kernel[(T,)](
        ws, x16, hc_scale, hc_base, norm_weight if has_norm else hc_base, out.view(torch.int16), pre,
        pre if head else post, pre if head else comb, T, S, D, hc_eps, norm_eps, rms_eps, HC=hc, ITERS=iters, M=M,
        S_P2=triton.next_power_of_2(S), BLOCK_D=triton.next_power_of_2(D), HEAD=head, HAS_NORM=has_norm, MP=MP,
        HOIST=finish_hoist(D), RCP=finish_rcp(x), num_warps=finish_warps(D), PDL=pdl, launch_pdl=pdl, **_EXACT)
    return x, out, pre, post, comb


def launch_hc_pre(x: torch.Tensor, hc_fn: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor,
                  norm_weight: torch.Tensor | None, *, iters: int, hc_eps: float, norm_eps: float, rms_eps: float,
                  head: bool = False):
    """x (T, hc, D) bf16 contiguous, hc_fn (M, hc * D) float32 contiguous with M = (2 + hc) * hc (``head``: M = hc),
    hc_scale (3,) / (1,) float32, hc_base (M,) float32, norm_weight (D,) float32 or None.

    -> (out (T, D) bf16, pre (T, hc), post (T, hc) or None, comb (T, hc, hc) or None) float32; ``out`` is
    ``bf16(sum_k pre_k x_k)``, then ``rms_norm(out, norm_weight, rms_eps)`` when a weight is given.
    Two launches; the (S, T, MP) float32 workspace is allocated per call.
    """
    return _launch_mix_and_finish(x, hc_fn, hc_scale, hc_base, norm_weight, None, iters=iters, hc_eps=hc_eps,
                                  norm_eps=norm_eps, rms_eps=rms_eps, head=head)[1:]


def launch_hc_post_pre(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                       hc_fn: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor,
                       norm_weight: torch.Tensor | None, *, iters: int, hc_eps: float, norm_eps: float, rms_eps: float,
                       head: bool = False):
    """``hc_post`` followed by the next ``hc_pre`` (or ``hc_head``) in two launches instead of three.

    y (T, D) bf16, residual (T, hc, D) bf16, post (T, hc), comb (T, hc, hc) float32 (all contiguous); the rest as
    :func:`launch_hc_pre`. -> (h (T, hc, D) bf16 = ``launch_hc_post(y, residual, post, comb)`` bit for bit, then
    ``launch_hc_pre(h, ...)``'s (out, pre, post, comb), bit for bit; on the GPU for ``D % 16 == 0`` only, see the
    module docstring)."""
    return _launch_mix_and_finish(None, hc_fn, hc_scale, hc_base, norm_weight, (y, residual, post, comb),
                                  iters=iters, hc_eps=hc_eps, norm_eps=norm_eps, rms_eps=rms_eps, head=head)


# ------------------------------------------------------------------------------------------------ hc_post
@triton.jit
def _hc_post_kernel(y_ptr, res_ptr, post_ptr, comb_ptr, out_ptr, D, HC: tl.constexpr, BLOCK_D: tl.constexpr,
                    PDL: tl.constexpr = False):
    """out[t, k, d] = bf16(post[t, k] * y[t, d] + sum_j comb[t, j, k] * res[t, j, d]) (reference order)."""
    grid_dependency_prologue(PDL)  # first: before any global access (kernels/pdl.py)
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
        pdl = pdl_enabled(y)
        _hc_post_kernel[(T, triton.cdiv(D, block_d))](
            y.view(torch.int16), residual.view(torch.int16), post, comb, out.view(torch.int16), D, HC=hc,
            BLOCK_D=block_d, num_warps=POST_WARPS, PDL=pdl, launch_pdl=pdl, **_EXACT)
    return out


#: Offline sm_90 compile (tests / SASS inspection): kernel name -> runtime-argument signature.
_SIGNATURES = {
    "_hc_mix_partial_kernel": dict(y_ptr="*i16", res_ptr="*i16", post_ptr="*fp32", comb_ptr="*fp32", out_ptr="*i16",
                                   x_ptr="*i16", fn_ptr="*fp32", ws_ptr="*fp32", T="i32", D="i32", one="fp32"),
    "_hc_pre_finish_kernel": dict(ws_ptr="*fp32", x_ptr="*i16", scale_ptr="*fp32", base_ptr="*fp32", w_ptr="*fp32",
                                  out_ptr="*i16", pre_ptr="*fp32", post_ptr="*fp32", comb_ptr="*fp32", T="i32",
                                  S="i32", D="i32", hc_eps="fp32", norm_eps="fp32", rms_eps="fp32"),
    "_hc_post_kernel": dict(y_ptr="*i16", res_ptr="*i16", post_ptr="*fp32", comb_ptr="*fp32", out_ptr="*i16",
                            D="i32"),
}


def compile_sm90(T: int = 1, dim: int = 4096, hc: int = 4, *, head: bool = False, iters: int = 20,
                 post: bool = True, pdl: bool = False):
    """Compile the hc kernels for sm_90 without a GPU, as launched for (T, hc, dim) (default: V4-Flash decode at
    T = 1; ``post``: the mixes-partial kernel fused with hc_post, else standalone). Returns {kernel name:
    ``CompiledKernel``} (``asm["ptx"]``, ``asm["cubin"]``). ``pdl``: the programmatic-dependent-launch build."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    M = hc if head else (2 + hc) * hc
    tc = mix_tensor_cores(T, on_gpu=True)  # as launched on the GPU
    bt, dot, bdi, ch, S, warps = mix_plan(T, dim, tc)
    MP = mix_mp(M)
    consts = {
        "_hc_mix_partial_kernel": (dict(HC=hc, M=M, MP=MP, BT=bt, CH=ch, BDI=bdi, POST=post, DOT=dot, TC=tc,
                                        INTERPRET=False), warps),
        "_hc_pre_finish_kernel": (dict(HC=hc, ITERS=iters, M=M, S_P2=triton.next_power_of_2(S),
                                       BLOCK_D=triton.next_power_of_2(dim), HEAD=head, HAS_NORM=True, MP=MP,
                                       HOIST=finish_hoist(dim), RCP=2 if FINISH_RCP else 0),
                                  finish_warps(dim)),
        "_hc_post_kernel": (dict(HC=hc, BLOCK_D=min(POST_BLOCK_D, triton.next_power_of_2(dim))), POST_WARPS),
    }
    out = {}
    for name, (constexprs, nw) in consts.items():
        constexprs = dict(constexprs, PDL=pdl)
        sig = dict(_SIGNATURES[name], **{k: "constexpr" for k in constexprs})
        out[name] = triton.compile(ASTSource(globals()[name], signature=sig, constexprs=constexprs),
                                   target=GPUTarget("cuda", 90, 32),
                                   options=dict(num_warps=nw, launch_pdl=pdl, **_EXACT))
    return out
