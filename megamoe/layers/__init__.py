"""Graph-capturable NVFP4 layers: the DeepSeek-V4 MoE block, its shared expert and the attention block."""
from .attention import Nvfp4Attention  # noqa: F401
from .linear import DenseLinear  # noqa: F401
from .moe import Nvfp4MoE, Nvfp4SharedExpert, quantize_weight  # noqa: F401
