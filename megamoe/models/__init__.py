"""DeepSeek-V4 configurations, weight specifications, decoder layer and model (``model.V4Model``)."""
from .config import (  # noqa: F401
    DEEPSEEK_V3_GUIDE, DEEPSEEK_V4_FLASH, DEEPSEEK_V4_PRO, MODEL_PRESETS, PRESETS, SMALL, V4_FLASH_MODEL,
    V4_PRO_MODEL, MoEConfig, V4Config,
)
