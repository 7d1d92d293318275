"""Graph-capturable NVFP4 layers: the DeepSeek-V4 MoE block and its shared expert."""
from .moe import Nvfp4MoE, Nvfp4SharedExpert, quantize_weight  # noqa: F401
