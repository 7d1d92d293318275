"""Pure-PyTorch references: the exact semantics the kernels are tested against."""
from .quantize import compute_global_scale, dequantize, quantize  # noqa: F401
from .gemm import interleave_gate_up, nvfp4_grouped_mm, nvfp4_linear  # noqa: F401
from .moe import dispatch, moe_forward, route  # noqa: F401
