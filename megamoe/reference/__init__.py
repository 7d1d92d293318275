"""Pure-PyTorch references: the exact semantics the kernels are tested against."""
from .quantize import compute_global_scale, dequantize, quantize  # noqa: F401
