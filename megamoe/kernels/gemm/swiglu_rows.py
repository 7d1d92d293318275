"""The scaled SwiGLU of float32 GEMM rows: ``out = bf16(swiglu(y * global_scale))`` for a dense gate/up GEMM whose
float32 product came from elsewhere (route "dense-bf16" of ``megamoe.ops.gemm.nvfp4_linear``: cuBLAS on the weight
dequantized without its global scale).

One kernel, one launcher (:func:`launch_scaled_swiglu`). Program ``(m, j)`` takes columns ``[j * BLOCK, (j + 1) *
BLOCK)`` of row m of y (M, N) float32 (N even, the :func:`megamoe.ops.gemm.interleave_gate_up` layout: column 2i
gate i, 2i + 1 up i), multiplies each column by its global scale (0-d or per row of the weight, (N, 1)), and
stores the SwiGLU of each pair at out[m, j * BLOCK / 2 + i]: the epilogue of the split-K reduction
(``nvfp4_splitk._swiglu_epilogue_store`` with a weight scale of 1), so the same operations as the NVFP4 kernels'
SwiGLU epilogues after their float32 sums. Rows are the grid's first axis, which may hold 2**31 - 1 programs; the
second and third hold at most 65535, which a prefill of 65536+ rows would pass.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .nvfp4_gemm import global_scale_strides
from .nvfp4_splitk import _swiglu_epilogue_store

#: Columns of y per program (a power of two, even: a gate/up pair never straddles two programs).
BLOCK = 1024


@triton.jit(do_not_specialize=["num_rows"])
def _scaled_swiglu_kernel(y_ptr, global_scale_ptr, out_ptr, num_rows, N, stride_ym, stride_gn, stride_om,
                          swiglu_limit, BLOCK: tl.constexpr, HAS_LIMIT: tl.constexpr, INTERPRET: tl.constexpr):
    rows = tl.program_id(0) + tl.arange(0, 1)
    col_start = tl.program_id(1) * BLOCK
    cols = col_start + tl.arange(0, BLOCK)
    acc = tl.load(y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :], mask=(cols < N)[None, :],
                  other=0.0)
    _swiglu_epilogue_store(acc, rows, rows < num_rows, col_start, N, global_scale_ptr, stride_gn, out_ptr, out_ptr,
                           stride_om, swiglu_limit, BLOCK, False, HAS_LIMIT, INTERPRET, 1.0)


def launch_scaled_swiglu(y: torch.Tensor, global_scale: torch.Tensor, out: torch.Tensor, swiglu_limit=None, *,
                         interpreter: bool = False) -> torch.Tensor:
    """y (M, N) float32 (unit column stride, N even), global_scale float32 0-d or (N, 1), out (M, N // 2) bf16
    (unit column stride) -> out (validated by ``megamoe.ops.gemm``); ``swiglu_limit`` None (no clamp) or a
    positive float."""
    m, n = y.shape
    if m == 0 or n == 0:
        return out
    block = max(2, min(BLOCK, triton.next_power_of_2(n)))
    _, stride_gn = global_scale_strides(global_scale, False)
    _scaled_swiglu_kernel[(m, triton.cdiv(n, block))](  # rows on the first axis: 65535 is the limit of the others
        y, global_scale, out, m, n, y.stride(0), stride_gn, out.stride(0),
        float(swiglu_limit) if swiglu_limit is not None else 0.0,
        BLOCK=block, HAS_LIMIT=swiglu_limit is not None, INTERPRET=interpreter, num_warps=4,
    )
    return out
