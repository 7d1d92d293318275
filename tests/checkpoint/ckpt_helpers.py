"""Write sharded safetensors checkpoints the way Hugging Face / ModelOpt exports do (test helper)."""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file


def write_sharded_checkpoint(directory, tensors: dict, max_shard_bytes: int) -> dict:
    """Write ``tensors`` (name -> tensor) as ``model-0000i-of-0000n.safetensors`` shards of at most
    ``max_shard_bytes`` each (a larger tensor gets a shard of its own), in the given order, plus
    ``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``).

    Returns the index dict.
    """
    os.makedirs(directory, exist_ok=True)
    shards, current, size = [], {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = t.contiguous()
        size += nbytes
    if current or not shards:
        shards.append(current)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(directory, file_name), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = file_name
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(directory, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
    return index


def nvfp4_parts(out_features: int, in_features: int, *, input_scale: float | None = 0.5) -> dict:
    """Random, well-formed parts of one ModelOpt NVFP4 linear (weight, weight_scale, weight_scale_2[, input])."""
    parts = {
        "weight": torch.randint(0, 256, (out_features, in_features // 2), dtype=torch.uint8),
        "weight_scale": (torch.rand(out_features, in_features // 16) * 4 + 0.5).to(torch.float8_e4m3fn),
        "weight_scale_2": torch.tensor(0.01, dtype=torch.float32),
    }
    if input_scale is not None:
        parts["input_scale"] = torch.tensor(input_scale, dtype=torch.float32)
    return parts
