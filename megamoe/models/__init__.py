"""Model configurations (DeepSeek-V4-class MoE blocks)."""
from .config import DEEPSEEK_V3_GUIDE, DEEPSEEK_V4_FLASH, PRESETS, SMALL, MoEConfig  # noqa: F401
