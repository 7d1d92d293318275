"""nvfp4-megamoe: NVFP4 inference kernels for DeepSeek-V4-class mixture-of-experts models.

On Hopper (sm_90) the kernels decode FP4 weights exactly to bf16 inside Triton
kernels and use the bf16 tensor cores; on CPU the same public functions run the
pure-PyTorch references (or the Triton interpreter with ``TRITON_INTERPRET=1``).
"""
__version__ = "0.1.0"

from .format import NVFP4Tensor  # noqa: F401
from .ops.gemm import host_global_scale, interleave_gate_up, nvfp4_grouped_mm, nvfp4_linear  # noqa: F401
from .ops.quantize import compute_global_scale, dequantize, quantize  # noqa: F401
from .kvcache import CompressedCacheConfig, CompressedKVCache  # noqa: F401
from .layers import Nvfp4Attention, Nvfp4MoE, Nvfp4SharedExpert  # noqa: F401
from .checkpoint import load_moe_layer, quantize_model_weights  # noqa: F401
from .models import V4_FLASH_MODEL, V4_PRO_MODEL, V4Config  # noqa: F401
from .models.model import V4Model  # noqa: F401
from .ops.sampling import SamplingParams, sample  # noqa: F401
