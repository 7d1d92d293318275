"""Checkpoint loading: ModelOpt NVFP4 safetensors -> megamoe layers."""
from .modelopt import CheckpointError, bf16_moe_state_dict, load_moe_layer, quantize_model_weights  # noqa: F401
