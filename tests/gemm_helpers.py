"""Shared helpers of the GEMM kernel tests: random NVFP4 weights and float32 references."""
import torch

from megamoe.format.tensor import NVFP4Tensor
from megamoe.reference.quantize import dequantize, quantize


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error of ``out`` against ``ref`` (both moved to the CPU)."""
    out, ref = out.float().cpu(), ref.float().cpu()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def random_weight(shape, device, *, per_row_scale=False, scale_shape=None) -> NVFP4Tensor:
    """NVFP4 weight quantized from N(0, 0.05^2); ``scale_shape`` replaces the global scale by distinct
    random values (per expert / per row) that a wrong expert or row index would expose."""
    w = quantize(torch.randn(shape) * 0.05, per_row=per_row_scale)
    gs = w.global_scale
    if scale_shape is not None:
        gs = (torch.rand(scale_shape) + 0.5) * 1e-3
    return NVFP4Tensor(w.data, w.block_scale, gs.float(), w.shape).to(device)


def offsets_of(counts, device) -> torch.Tensor:
    """Cumulative int32 row ends of per-expert row counts."""
    return torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)


def grouped_f32(x, weight: NVFP4Tensor, offsets, row_index=None) -> torch.Tensor:
    """float32 grouped GEMM on the decoded weights (no bf16 rounding of the output); rows past
    ``offsets[-1]`` stay 0."""
    w = dequantize(weight.to("cpu"), torch.float32)
    xs = x.cpu().float()
    if row_index is not None:
        xs = xs[row_index.cpu().long()]
    y = torch.zeros(xs.shape[0], w.shape[1])
    start = 0
    for e, end in enumerate(offsets.cpu().tolist()):
        y[start:end] = xs[start:end] @ w[e].t()
        start = max(start, end)
    return y
