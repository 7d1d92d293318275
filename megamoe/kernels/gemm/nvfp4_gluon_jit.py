"""Gluon (Triton's explicit-layout dialect) building blocks of the sm_90 NVFP4 GEMMs.

Shared by ``nvfp4_mma_decode.py`` (decode shapes, ``mma.sync``) and
``nvfp4_wgmma.py`` (prefill shapes, ``wgmma``): the register layouts, the
exact FP4 -> bf16 decode straight into the MMA A operand, the matching
permutation of the activations, and the epilogue.

Why Gluon: a kernel streaming FP4 weights is only fast if decoding them costs
little per weight. In plain Triton the decoded values come out in a blocked
layout and the compiler re-packs them into the MMA operand layout (~6.8 SASS
instructions per weight in ``nvfp4_gemm.py``); here the layouts are chosen so
that the packed words are *loaded* in the A-operand layout and decoding is the
only per-weight work (~2.4 instructions).

Register mapping (per 16 weight rows and BLOCK_K K elements per step; the same
for ``mma.sync.m16n8k16`` and for each warp of a ``wgmma`` warpgroup): lane
``q = lane % 4`` of a quad owns the contiguous K range ``[q*BLOCK_K/4,
(q+1)*BLOCK_K/4)`` of rows ``lane // 4`` and ``lane // 4 + 8`` (16-byte loads).
The MMA's K order is a permutation of memory K (the dot product does not care
which, as long as both operands use the same one): ``kappa = c0 + 2q + 8c1 +
16nib + 32i`` for memory ``k = q*BLOCK_K/4 + 8i + 2(2c1 + c0) + nib`` (word
``i`` of the lane's range, byte ``c`` of the word, nibble ``nib``). With it the
decode of one 32-bit word (``prmt`` + and/multiply/and per bf16 pair +
``mul.bf16x2`` by the block scale, exact as in ``nvfp4_jit``) produces exactly
four A-operand registers, and the activations need one ``prmt`` per register
to pair (k, k+2), amortised over all weight rows of a warp. A word's 8 K
elements lie in one 16-element block, so one scale serves the whole word. The
decoded weights carry a factor ``2**-8`` that :func:`store_epilogue` undoes.

Gluon kernels do not run in the Triton interpreter. :func:`compile_sm90`
compiles them for sm_90 on any machine (the CPU tests inspect their K loops).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

try:  # Gluon ships with Triton >= 3.5; this code uses its 3.6 API
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

    GLUON_AVAILABLE = True
except ImportError:  # pragma: no cover - older Triton
    GLUON_AVAILABLE = False


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def gluon_supports(x: torch.Tensor, data: torch.Tensor, block_k: int = 128) -> bool:
    """Whether the Gluon kernels can run: sm_90 CUDA tensors, K % block_k == 0, 16-byte aligned rows."""
    if not (GLUON_AVAILABLE and x.is_cuda and _capability(x.device.index or 0)[0] == 9):
        return False
    k = 2 * data.shape[-1]
    return (k % block_k == 0 and x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and x.stride(0) % 8 == 0
            and data.is_contiguous() and data.data_ptr() % 16 == 0)


POINTER_ARGS = dict(x_ptr="*i32", row_index_ptr="*i32", w_ptr="*i32", scale_ptr="*u8", global_scale_ptr="*fp32",
                    offsets_ptr="*i32", bias_ptr="*bf16", out_ptr="*bf16", err_ptr="*i32")
ALIGNED_ARGS = [name for name in POINTER_ARGS if name != "err_ptr"] + ["N", "K", "stride_xm", "stride_we", "stride_wn",
                                                                       "stride_se", "stride_sn", "stride_om"]


def _device_guard() -> bool:
    from ...ops import errors

    return errors.DEVICE_GUARD


def compile_sm90(kernel, scalars: list, block_sizes: tuple, num_warps: int, *, grouped=True, row_index=True,
                 bias=False, swiglu=False, swiglu_limit=True, extra_signature=None, extra_constants=None,
                 maxnreg=None):
    """Compile a Gluon GEMM kernel of this family for sm_90 without a GPU (for tests and offline SASS).

    ``scalars``: the kernel's i32 arguments (``swiglu_limit`` is fp32);
    ``block_sizes``: (BLOCK_M, BLOCK_N, BLOCK_K). The pointers, N, K and the
    row strides are specialised as 16-byte aligned, as a launch on aligned
    tensors specialises them. ``extra_signature`` / ``extra_constants``: a
    kernel's further arguments (types / constexpr values); ``maxnreg``: the ptxas register cap, as a launch's
    ``maxnreg`` keyword passes it.
    """
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    block_m, block_n, block_k = block_sizes
    constants = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_E=512, GROUPED=grouped,
                     HAS_ROW_INDEX=row_index, HAS_BIAS=bias, SWIGLU=swiglu, HAS_LIMIT=swiglu_limit,
                     ERR_FLAG=1 if _device_guard() else 0, num_warps=num_warps, **(extra_constants or {}))
    if "BLOCK_E" not in kernel.arg_names:  # a kernel that reads its schedule from a list builds no expert table
        del constants["BLOCK_E"]
    # constexpr parameters with defaults that the caller left out get their defaults: a missing one shifts the
    # specialisation silently (a PDL=True build without the later X_SMEM came out without griddepcontrol)
    for param in kernel.params:
        if param.is_constexpr and param.has_default and param.name not in constants:
            constants[param.name] = param.default
    signature = dict(POINTER_ARGS, **{name: "i32" for name in scalars + ["num_src_rows"]}, swiglu_limit="fp32",
                     **(extra_signature or {}), **{name: "constexpr" for name in constants})
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in ALIGNED_ARGS}
    source = GluonASTSource(kernel, signature=signature, constexprs=constants, attrs=attrs)
    options = {"num_warps": num_warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def check_weight_interleave(weight_interleave, data: torch.Tensor) -> None:
    """The launchers' ``weight_interleave``: 1 (row-major) or 4 (``NVFP4Tensor.row_interleave``), dividing N."""
    if weight_interleave not in (1, 4) or (weight_interleave > 1 and data.shape[-2] % weight_interleave):
        raise ValueError(f"weight_interleave: expected 1, or 4 with N % 4 == 0, got {weight_interleave!r}")


def kernel_arguments(x, data, block_scale, global_scale, out, *, expert_offsets, row_index, bias, swiglu,
                     swiglu_limit, error_word=None):
    """The shared launch arguments of the Gluon GEMM kernels: (head, strides, flags).

    ``kernel[grid](*head, [num_programs,] *strides, BLOCK_..., **flags)``: x and
    the packed weights as int32 words (bf16 pairs, 4 packed bytes), scale bytes
    as uint8; unused pointers alias x (never read). ``error_word``: the int32 word that a
    ``row_index`` value outside ``[0, S)`` flags (default: the device's, ``megamoe.ops.errors``).
    """
    from .nvfp4_gemm import gemm_error_word, global_scale_strides

    grouped = expert_offsets is not None
    x32, data32 = x.view(torch.int32), data.view(torch.int32)
    scale_u8 = block_scale.view(torch.uint8)
    stride_ge, stride_gn = global_scale_strides(global_scale, grouped)
    err, err_flag = gemm_error_word(out.device, error_word)
    head = (x32, row_index if row_index is not None else x32, data32, scale_u8, global_scale,
            expert_offsets if grouped else x32, bias if bias is not None else x, out, err,
            out.shape[0], data.shape[-2], 2 * data.shape[-1], data.shape[0] if grouped else 1, x.shape[0],
            float(swiglu_limit) if swiglu_limit is not None else 0.0)
    strides = (x32.stride(0), data32.stride(0) if grouped else 0, data32.stride(-2),
               scale_u8.stride(0) if grouped else 0, scale_u8.stride(-2), stride_ge, stride_gn, out.stride(0))
    flags = dict(GROUPED=grouped, HAS_ROW_INDEX=row_index is not None, HAS_BIAS=bias is not None,
                 SWIGLU=swiglu, HAS_LIMIT=swiglu_limit is not None, ERR_FLAG=err_flag)
    return head, strides, flags


if GLUON_AVAILABLE:

    @gluon.constexpr_function
    def row_bases(BLOCK_N, num_warps):
        """(register bases, warp bases) of the weight rows: row+8 in a register, 16 rows per warp, repeats."""
        regs = [8]
        warps = [16 << w for w in range(num_warps.bit_length() - 1)]
        r = 16 * num_warps
        while r < BLOCK_N:
            regs.append(r)
            r *= 2
        return regs, warps

    @gluon.constexpr_function
    def weight_layout(BLOCK_N, BLOCK_K, num_warps):
        """(BLOCK_N, BLOCK_K//8) int32 words of packed bytes: lane q of a quad holds BLOCK_K/32 contiguous words."""
        row_regs, row_warps = row_bases(BLOCK_N, num_warps)
        regs = [[0, 1 << b] for b in range((BLOCK_K // 32).bit_length() - 1)] + [[r, 0] for r in row_regs]
        return gl.DistributedLinearLayout(
            reg_bases=regs, lane_bases=[[0, BLOCK_K // 32], [0, BLOCK_K // 16], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[w, 0] for w in row_warps], block_bases=[], shape=[BLOCK_N, BLOCK_K // 8])

    @gluon.constexpr_function
    def scale_layout(BLOCK_N, BLOCK_K, num_warps):
        """(BLOCK_N, BLOCK_K//16) scale bytes, the blocks of the same lane's bytes."""
        row_regs, row_warps = row_bases(BLOCK_N, num_warps)
        regs = [[0, 1 << b] for b in range((BLOCK_K // 64).bit_length() - 1)] + [[r, 0] for r in row_regs]
        return gl.DistributedLinearLayout(
            reg_bases=regs, lane_bases=[[0, BLOCK_K // 64], [0, BLOCK_K // 32], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[w, 0] for w in row_warps], block_bases=[], shape=[BLOCK_N, BLOCK_K // 16])

    @gluon.constexpr_function
    def x_operand_layout(BLOCK_M, BLOCK_K, num_warps):
        """(BLOCK_M, BLOCK_K//2) activation bf16 pairs: token = lane // 4 (+8 per register), lane q's K range."""
        regs = [[0, 1 << b] for b in range((BLOCK_K // 8).bit_length() - 1)]
        t = 8
        while t < BLOCK_M:
            regs.append([t, 0])
            t *= 2
        return gl.DistributedLinearLayout(
            reg_bases=regs, lane_bases=[[0, BLOCK_K // 8], [0, BLOCK_K // 4], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[0, 0]] * (num_warps.bit_length() - 1), block_bases=[], shape=[BLOCK_M, BLOCK_K // 2])

    @gluon.constexpr_function
    def x_split_layout(BLOCK_M, BLOCK_K, num_warps):
        """(BLOCK_M, BLOCK_K//2) activation pairs spread over the warps (for a shared-memory B operand):
        lane q's K range, token = lane // 4 + 8 * warp (+ 8 * num_warps per register)."""
        regs = [[0, 1 << b] for b in range((BLOCK_K // 8).bit_length() - 1)]
        t = 8 * num_warps
        while t < BLOCK_M:
            regs.append([t, 0])
            t *= 2
        return gl.DistributedLinearLayout(
            reg_bases=regs, lane_bases=[[0, BLOCK_K // 8], [0, BLOCK_K // 4], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[8 << w, 0] for w in range(num_warps.bit_length() - 1)], block_bases=[],
            shape=[BLOCK_M, BLOCK_K // 2])

    @gluon.jit
    def decode_words(packed, factor):
        """Packed bytes (uint8) x fp32 ``scale * 2**118`` -> (low-nibble, high-nibble) bf16 ``e2m1 * scale * 2**-8``.

        Four bytes (one word, one block scale) per call: ``prmt`` puts bytes
        (b0, b1) and (b2, b3) in the two 16-bit halves; per half-pair of nibbles
        an ``and`` isolates them, one integer multiply by ``2**6 + 2**12``
        (high nibbles: ``2**2 + 2**8``) writes non-overlapping copies so that
        a second ``and`` leaves the E2M1 magnitude at bf16 bits 6-8 and the sign
        at bit 15 (``e2m1 * 2**-126``; 0.5 is a bf16 subnormal), and one
        ``mul.rn.bf16x2`` by the factor gives ``e2m1 * scale * 2**-8`` exactly.
        Outputs: (lo(b0), lo(b1)), (lo(b2), lo(b3)) and the same for the high nibbles.
        """
        return gl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 t0, t1, a, s;
            cvt.rn.bf16x2.f32 s, $5, $5;
            prmt.b32 t0, $4, 0, 0x7170;
            prmt.b32 t1, $4, 0, 0x7372;
            and.b32 a, t0, 0x000F000F;
            mul.lo.u32 a, a, 4160;
            and.b32 a, a, 0x81C081C0;
            mul.rn.bf16x2 $0, a, s;
            and.b32 a, t1, 0x000F000F;
            mul.lo.u32 a, a, 4160;
            and.b32 a, a, 0x81C081C0;
            mul.rn.bf16x2 $1, a, s;
            and.b32 a, t0, 0x00F000F0;
            mul.lo.u32 a, a, 260;
            and.b32 a, a, 0x81C081C0;
            mul.rn.bf16x2 $2, a, s;
            and.b32 a, t1, 0x00F000F0;
            mul.lo.u32 a, a, 260;
            and.b32 a, a, 0x81C081C0;
            mul.rn.bf16x2 $3, a, s;
            }
            """,
            constraints="=r,=r,=r,=r,r,r,r,r,r",
            args=[packed, factor],
            dtype=(gl.bfloat16, gl.bfloat16),
            is_pure=True,
            pack=4,
        )

    @gluon.jit
    def load_weights(w_ptrs, s_ptrs, k0, W_IL: gl.constexpr = 1):
        """Weight words and scale bytes of the step starting at K element ``k0`` (int32 words: the
        loop carries whole registers, not bytes). ``W_IL`` > 1: rows interleaved in groups of W_IL per 128-K
        step (``megamoe.format.layouts.interleave_weight_rows``; ``k0`` a multiple of 128)."""
        if W_IL > 1:
            return gl.load(w_ptrs + k0 * W_IL // 8), gl.load(s_ptrs + k0 * W_IL // 16)
        return gl.load(w_ptrs + k0 // 8), gl.load(s_ptrs + k0 // 16)

    @gluon.jit
    def interleaved_row_offsets(rows, stride, CHUNK: gl.constexpr, W_IL: gl.constexpr):
        """Offset of each row's first K chunk in a matrix of row stride ``stride`` stored with rows interleaved in
        groups of ``W_IL`` per chunk of ``CHUNK`` elements (``megamoe.format.layouts.interleave_weight_rows``: 16
        words or 8 scale bytes per 128-K step), int64."""
        return ((rows // W_IL) * W_IL).to(gl.int64) * stride + (rows % W_IL) * CHUNK

    @gluon.jit
    def interleaved_offsets(rows, cols, stride, CHUNK: gl.constexpr, W_IL: gl.constexpr):
        """(rows, cols) offsets of that layout: column c sits in chunk c // CHUNK, W_IL chunks after the one before."""
        return interleaved_row_offsets(rows, stride, CHUNK, W_IL)[:, None] + (
            (cols // CHUNK) * (W_IL * CHUNK) + cols % CHUNK)[None, :]

    @gluon.jit
    def word_bytes(words):
        """(R, C) int32 -> (R, 4C) uint8, little-endian byte order (register moves only)."""
        b0 = (words & 0xFF).to(gl.uint8)
        b1 = ((words >> 8) & 0xFF).to(gl.uint8)
        b2 = ((words >> 16) & 0xFF).to(gl.uint8)
        b3 = ((words >> 24) & 0xFF).to(gl.uint8)
        return gl.join(gl.join(b0, b2), gl.join(b1, b3)).reshape([words.shape[0], 4 * words.shape[1]])

    @gluon.jit
    def pair_halves(pairs):
        """(R, C) int32 of bf16 pairs -> (R, 2C) bf16 (low half first)."""
        lo = pairs.to(gl.int16).to(gl.bfloat16, bitcast=True)
        hi = (pairs >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
        return gl.join(lo, hi).reshape([pairs.shape[0], 2 * pairs.shape[1]])

    @gluon.jit
    def decode_a_operand(words, scale_bytes, a_layout: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
        """Weight words (BLOCK_N, BLOCK_K//8) + scale bytes -> the MMA A operand (BLOCK_N, BLOCK_K) bf16
        ``e2m1 * block_scale * 2**-8`` in MMA K order ``kappa = c0 + 2q + 8c1 + 16nib + 32i``."""
        # block-scale factor (hardware e4m3 -> f32, exact; 0x7F -> NaN) * 2**118, one per word
        factor = scale_bytes.to(gl.float8e4nv, bitcast=True).to(gl.float32) * 3.3230699894622794e35
        factor = gl.join(factor, factor).reshape([BLOCK_N, BLOCK_K // 8])
        factor = gl.join(factor, factor)
        factor = gl.join(factor, factor).reshape([BLOCK_N, BLOCK_K // 2])
        packed = word_bytes(words)
        lo, hi = decode_words(packed, gl.convert_layout(factor, packed.type.layout))
        w = gl.join(lo, hi).reshape([BLOCK_N, 4, BLOCK_K // 32, 2, 2, 2])  # n, q, i, c1, c0, nib
        w = w.permute([0, 2, 5, 3, 1, 4]).reshape([BLOCK_N, BLOCK_K])  # n, i, nib, c1, q, c0
        return gl.convert_layout(w, a_layout)

    @gluon.jit
    def x_kappa_order(x_pairs, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr):
        """Activation pairs (BLOCK_M, BLOCK_K//2) int32, memory K order (each quad lane q holding its
        K range) -> (BLOCK_M, BLOCK_K) bf16 in the MMA K order of :func:`decode_a_operand`."""
        x = pair_halves(x_pairs).reshape([BLOCK_M, 4, BLOCK_K // 32, 2, 2, 2])  # m, q, i, c1, c0, nib
        return x.permute([0, 2, 5, 3, 1, 4]).reshape([BLOCK_M, BLOCK_K])

    @gluon.jit
    def wgmma_k_loop(acc, w_ptrs, s_ptrs, x_ptrs, x_mask, x_smem, k_steps, a_layout: gl.constexpr,
                     BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr):
        """The synchronous wgmma K loop of the Gluon prefill kernels: per step the weight words decoded into the
        A registers, the x^T tile (registers, permuted to the MMA K order) through ``x_smem``, one wgmma chain
        waited for; step i+1's words and x are loaded while step i runs (past the end: the last step again,
        discarded). Returns ``acc`` (BLOCK_N, BLOCK_M) fp32."""
        last = gl.maximum(k_steps - 1, 0) * BLOCK_K
        words, scale_bytes = load_weights(w_ptrs, s_ptrs, 0)
        x_pairs = gl.load(x_ptrs, mask=x_mask, other=0)
        for step in range(0, k_steps):
            nxt = gl.minimum((step + 1) * BLOCK_K, last)
            words_n, scale_n = load_weights(w_ptrs, s_ptrs, nxt)
            x_next = gl.load(x_ptrs + nxt // 2, mask=x_mask, other=0)
            a = decode_a_operand(words, scale_bytes, a_layout, BLOCK_N, BLOCK_K)
            gl.thread_barrier()  # every warpgroup's (synchronous) wgmma of the previous step has read x_smem
            x_smem.store(x_kappa_order(x_pairs, BLOCK_M, BLOCK_K))
            fence_async_shared()
            gl.thread_barrier()
            acc = warpgroup_mma(a, x_smem.permute([1, 0]), acc)
            words, scale_bytes, x_pairs = words_n, scale_n, x_next
        return acc

    @gluon.jit
    def gathered_source_rows(row_index_ptr, rows, real, num_src_rows):
        """x rows of a tile for cp.async copies through ``row_index``: ``rows`` (a 1-D tile of output rows), ``real``
        = rows below the tile end. Returns (source row int64, source row in range, copy mask (rows, 1)): rows past
        the end and out-of-range values address row 0; the mask is False for out-of-range values of real rows
        (those rows are stored, so their copies zero-fill: the reference's drop rule) and everywhere when x has no
        rows (row 0 does not exist). The one rule of every x ring (pipelined, wgmma x ring, mma x-smem)."""
        src = gl.load(row_index_ptr + rows, mask=real, other=0).to(gl.int64)
        src_ok = (src >= 0) & (src < num_src_rows)
        return gl.where(src_ok & real, src, 0), src_ok, (src_ok | ~real)[:, None] & (num_src_rows > 0)

    @gluon.jit
    def tile_row_pointers(x_base, row_index_ptr, first_row, row_end, is_real, num_src_rows, row_stride, cols,
                          ROWS: gl.constexpr, layout: gl.constexpr, ERR_FLAG: gl.constexpr):
        """cp.async source pointers of a tile's x rows ``[first_row, first_row + ROWS)`` gathered through
        ``row_index`` (``layout``'s row slice; ``cols`` its column offsets, ``row_stride`` in ``x_base``'s elements;
        :func:`gathered_source_rows`' rule). Returns (pointers, copy mask, how many of the rows below ``row_end`` of a
        real tile hold a value outside ``[0, num_src_rows)``; 0 when ERR_FLAG is 0: guard compiled out,
        MEGAMOE_DEVICE_GUARD=0, benchmarking only). Without ``row_index`` a kernel reads rows
        ``where(row < row_end, row, 0)`` unmasked."""
        rows = first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        ok = rows < row_end
        src, src_ok, mask = gathered_source_rows(row_index_ptr, rows, ok, num_src_rows)
        bad = 0
        if ERR_FLAG != 0:
            bad = gl.sum((ok & ~src_ok & is_real).to(gl.int32), axis=0)
        return x_base + src[:, None] * row_stride + cols[None, :], mask, bad

    @gluon.jit
    def add_i32(a, b):
        return a + b


    @gluon.jit
    def grouped_tile_table(offsets_ptr, num_rows, num_experts, row_lo, row_hi, own_pad, BLOCK_M: gl.constexpr,
                           BLOCK_E: gl.constexpr, LANES_PER_THREAD: gl.constexpr, num_warps: gl.constexpr):
        """The grouped kernels' schedule, built in registers from ``expert_offsets`` (no host sync): per-"expert"
        row ranges, counts of BLOCK_M-row tiles (the mma.sync decode kernel's chunks) and their prefix sum over
        BLOCK_E lanes (lane E = the padding pseudo-expert ``[offsets[E-1], T)``). Row band: only experts with
        ``row_lo < rows`` (and ``<= row_hi`` unless it is None); the padding lane only with ``own_pad``. Returns
        (lane, starts, ends, tiles, tile_ends, total tiles)."""
        lane_layout: gl.constexpr = gl.BlockedLayout([LANES_PER_THREAD], [32], [num_warps], [0])
        lane = gl.arange(0, BLOCK_E, layout=lane_layout)
        ends = gl.load(offsets_ptr + lane, mask=lane < num_experts, other=num_rows)
        prev = gl.load(offsets_ptr + lane - 1, mask=(lane >= 1) & (lane <= num_experts), other=0)
        starts = gl.where(lane > num_experts, num_rows, prev)
        ends = gl.minimum(gl.maximum(ends, 0), num_rows)
        starts = gl.minimum(gl.maximum(starts, 0), num_rows)
        counts = gl.maximum(ends - starts, 0)
        if row_hi is None:
            in_band = counts > row_lo
        else:
            in_band = (counts > row_lo) & (counts <= row_hi)
        take = gl.where(lane < num_experts, in_band, (lane == num_experts) & (own_pad != 0))
        tiles = gl.where(take, (counts + BLOCK_M - 1) // BLOCK_M, 0)
        tile_ends = gl.associative_scan(tiles, 0, add_i32)
        return lane, starts, ends, tiles, tile_ends, gl.sum(tiles, axis=0)

    @gluon.jit
    def locate_tile(tile, lane, starts, ends, tiles, tile_ends, BLOCK_M: gl.constexpr):
        """m-tile ``tile`` of :func:`grouped_tile_table` -> (first row, row end, expert; E = padding)."""
        expert = gl.sum((tile_ends <= tile).to(gl.int32), axis=0)
        here = lane == expert
        first_tile = gl.sum(gl.where(here, tile_ends - tiles, 0), axis=0)
        row_start = gl.sum(gl.where(here, starts, 0), axis=0) + (tile - first_tile) * BLOCK_M
        row_end = gl.sum(gl.where(here, ends, 0), axis=0)
        return row_start, row_end, expert

    @gluon.constexpr_function
    def row_pairs_in_registers(layout):
        """``layout`` (a linear MMA accumulator layout over (weight rows, tokens)) with weight-row bit 0,
        held by lane bit 2, exchanged for row bit 3 (a register bit) and made the first register bit:
        gate/up rows 2j, 2j+1 land in one thread, and the conversion is one warp shuffle exchange."""
        regs = [list(b) for b in layout.reg_bases]
        lanes = [list(b) for b in layout.lane_bases]
        i, j = regs.index([8, 0]), lanes.index([1, 0])
        regs[i], lanes[j] = lanes[j], regs[i]
        regs.insert(0, regs.pop(i))
        return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes, warp_bases=layout.warp_bases,
                                          block_bases=layout.block_bases, shape=layout.shape)

    @gluon.jit
    def store_epilogue(acc, pid_rows, row_end, is_real, n_start, N, global_scale_ptr, expert, stride_ge, stride_gn,
                       bias_ptr, out_ptr, stride_om, swiglu_limit, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       HAS_BIAS: gl.constexpr, SWIGLU: gl.constexpr, HAS_LIMIT: gl.constexpr,
                       num_warps: gl.constexpr, OUT_PAIRED: gl.constexpr = False):
        """acc (BLOCK_N, BLOCK_M) fp32 (weight rows x token rows) -> out rows pid_rows..: global scale
        (times 2**8: the decoded weights carry 2**-8), bias, SwiGLU; zeros where ``is_real`` is false.
        ``OUT_PAIRED`` (SwiGLU only; N // 2 a multiple of 8): the output columns go in the paired order of
        :func:`megamoe.format.mma_order.to_paired_order` (column c at ``8 (c // 8) + 4 (c % 2) + (c % 8) // 2``)."""
        if SWIGLU:
            # stay in the MMA layout (a full layout conversion of the tile through shared memory
            # spilled registers): one shuffle exchange puts rows 2j, 2j+1 in the same thread
            pair_layout: gl.constexpr = row_pairs_in_registers(gl.to_linear_layout(acc.type.layout,
                                                                                   [BLOCK_N, BLOCK_M]))
            result = gl.convert_layout(acc, pair_layout)
            wrows = n_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, pair_layout))
            gscale = gl.load(global_scale_ptr + expert * stride_ge + gl.minimum(wrows, N - 1).to(gl.int64) * stride_gn)
            result = result * (gscale * 256.0)[:, None]
            if HAS_BIAS:
                result = result + gl.load(bias_ptr + wrows, mask=wrows < N, other=0.0).to(gl.float32)[:, None]
            result = gl.where(is_real, result, 0.0)
            gate, up = gl.split(result.reshape([BLOCK_N // 2, 2, BLOCK_M]).permute([0, 2, 1]))
            if HAS_LIMIT:
                # NaN-propagating (min.NaN): a plain minimum is min.f32 on the GPU, which returns the limit for a
                # NaN gate / up, so a NaN token came out finite; the reference's clamp keeps NaN
                gate = gl.minimum(gate, swiglu_limit, propagate_nan=tl.PropagateNan.ALL)
                up = gl.maximum(gl.minimum(up, swiglu_limit, propagate_nan=tl.PropagateNan.ALL), -swiglu_limit,
                                propagate_nan=tl.PropagateNan.ALL)
            y = gate / (1.0 + gl.exp(-gate)) * up  # (BLOCK_N // 2, BLOCK_M)
            half_layout: gl.constexpr = y.type.layout
            half_cols = n_start // 2 + gl.arange(0, BLOCK_N // 2, layout=gl.SliceLayout(1, half_layout))
            rows = pid_rows + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, half_layout))
            if OUT_PAIRED:
                store_cols = (half_cols // 8) * 8 + (half_cols % 2) * 4 + (half_cols % 8) // 2
            else:
                store_cols = half_cols
            gl.store(out_ptr + rows.to(gl.int64)[None, :] * stride_om + store_cols[:, None], y.to(gl.bfloat16),
                     mask=(rows < row_end)[None, :] & (half_cols < N // 2)[:, None])
        else:
            epi_layout: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [1, num_warps], [1, 0])
            cols = n_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, epi_layout))
            col_mask = cols < N
            gscale = gl.load(global_scale_ptr + expert * stride_ge + gl.minimum(cols, N - 1).to(gl.int64) * stride_gn)
            result = gl.convert_layout(acc.permute([1, 0]), epi_layout) * (gscale * 256.0)[None, :]
            if HAS_BIAS:
                result = result + gl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(gl.float32)[None, :]
            result = gl.where(is_real, result, 0.0)
            rows = pid_rows + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, epi_layout))
            gl.store(out_ptr + rows.to(gl.int64)[:, None] * stride_om + cols[None, :], result.to(gl.bfloat16),
                     mask=(rows < row_end)[:, None] & col_mask[None, :])

    @gluon.jit
    def store_plain_epilogue(acc, row_start, row_end, is_real, n_start, N, global_scale_ptr, expert_c, stride_ge,
                             stride_gn, bias_ptr, out_ptr, stride_om, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                             HAS_BIAS: gl.constexpr):
        """The plain (no SwiGLU) epilogue of :func:`store_epilogue`, stored from the MMA layout with weight rows
        2j, 2j+1 paired in a thread (one shuffle exchange, 4-byte stores), for the kernels whose accumulator tile
        is too large for that epilogue's full-tile layout conversion (it spilled ~3800 instructions at BLOCK_M
        256 in ``nvfp4_wgmma_ws.py``, and needs 128 KB of shared memory at 256 x 128 in ``nvfp4_wgmma_pipe.py``)."""
        pair_layout: gl.constexpr = row_pairs_in_registers(gl.to_linear_layout(acc.type.layout,
                                                                               [BLOCK_N, BLOCK_M]))
        result = gl.convert_layout(acc, pair_layout)
        cols = n_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, pair_layout))
        col_mask = cols < N
        gscale = gl.load(global_scale_ptr + expert_c * stride_ge + gl.minimum(cols, N - 1).to(gl.int64) * stride_gn)
        result = result * (gscale * 256.0)[:, None]
        if HAS_BIAS:
            result = result + gl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(gl.float32)[:, None]
        result = gl.where(is_real, result, 0.0)
        rows = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, pair_layout))
        gl.store(out_ptr + rows.to(gl.int64)[None, :] * stride_om + cols[:, None], result.to(gl.bfloat16),
                 mask=(rows < row_end)[None, :] & col_mask[:, None])
