"""A dense projection whose weight is NVFP4 (through ``nvfp4_linear``) or kept in bf16/fp32 by the checkpoint."""
from __future__ import annotations

import torch

from ..format.tensor import NVFP4Tensor
from ..ops import gemm as gemm_ops


class DenseLinear:
    """``y = x @ W.T`` for a weight of logical shape (out_features, in_features).

    weight: an :class:`NVFP4Tensor` (runs ``megamoe.nvfp4_linear``, bf16 in, bf16 out, float32 accumulation),
    a bf16 tensor (``torch.matmul`` in bf16, float32 accumulation inside cuBLAS) or a float32 tensor (float32
    matmul on ``x.float()``, the official code's choice for the compressor projections and the gate).
    """

    def __init__(self, weight, *, name: str = "weight"):
        if isinstance(weight, NVFP4Tensor):
            if len(weight.shape) != 2:
                raise ValueError(f"{name}: expected a 2-D NVFP4 weight, got shape {tuple(weight.shape)}")
        elif isinstance(weight, torch.Tensor):
            if weight.dim() != 2 or weight.dtype not in (torch.bfloat16, torch.float32):
                raise TypeError(f"{name}: expected a 2-D bf16/fp32 tensor or an NVFP4Tensor, got "
                                f"{weight.dtype} of shape {tuple(weight.shape)}")
            weight = weight.contiguous()
        else:
            raise TypeError(f"{name}: expected a torch.Tensor or NVFP4Tensor, got {type(weight).__name__}")
        self.weight, self.name = weight, name
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])

    @property
    def nvfp4(self) -> bool:
        return isinstance(self.weight, NVFP4Tensor)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x (M, in) -> (M, out): bf16 for NVFP4/bf16 weights, float32 for float32 weights."""
        if self.nvfp4:
            return gemm_ops.nvfp4_linear(x.to(torch.bfloat16), self.weight, out=out)
        if self.weight.dtype == torch.float32:
            y = x.float() @ self.weight.t()
        else:
            y = x.to(torch.bfloat16) @ self.weight.t()
        if out is not None:
            out.copy_(y)
            return out
        return y

    def nbytes(self) -> int:
        if self.nvfp4:
            return self.weight.nbytes()
        return self.weight.numel() * self.weight.element_size()
