"""Checkpoint loading: ModelOpt NVFP4 safetensors -> megamoe layers."""
from .modelopt import bf16_moe_state_dict, load_moe_layer, quantize_model_weights  # noqa: F401
from .sharded import CheckpointError, ShardedCheckpoint, check_scale_value, check_tensor  # noqa: F401
