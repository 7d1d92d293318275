"""Public functional API: validation and dispatch to kernels or references."""
from .gemm import interleave_gate_up, nvfp4_grouped_mm, nvfp4_linear  # noqa: F401
from .quantize import compute_global_scale, dequantize, quantize  # noqa: F401
from .moe import combine, dispatch, route  # noqa: F401
