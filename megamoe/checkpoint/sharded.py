"""Lazy reading of sharded safetensors checkpoints (Hugging Face / ModelOpt layout) and tensor checks.

Layout: a directory with ``model.safetensors.index.json`` = ``{"metadata": {...}, "weight_map": {tensor name:
shard file name}}`` and the shard files it names (e.g. ``model-00001-of-00046.safetensors``), all in that
directory. A directory holding one ``model.safetensors`` and no index, or a single ``.safetensors`` file, is read
as a one-shard checkpoint.

:class:`ShardedCheckpoint` reads the index once, checks that every shard it names exists, and opens a shard
(``safetensors.safe_open``) only when one of its tensors is first requested; tensors are read one at a time, so
reading one layer of a 160 GB checkpoint touches only that layer's bytes. Every failure is a
:class:`CheckpointError` (a ValueError) naming the file or tensor: missing / malformed index, missing shard,
unknown tensor, a tensor the index maps to a shard that lacks it, a corrupt or truncated shard (the safetensors
``SafetensorError`` is wrapped).

:func:`check_tensor` validates one tensor (or the parts of one NVFP4 linear) against an expected shape and kind.
"""
from __future__ import annotations

import json
import math
import os

import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DTYPE_KINDS = ("nvfp4", "bf16", "fp32", "int32")
_MISSING = object()


class CheckpointError(ValueError):
    """A missing, mis-shaped, mis-typed or corrupt checkpoint file or tensor."""


def _safetensor_errors() -> tuple:
    try:
        from safetensors import SafetensorError
    except ImportError:  # older safetensors
        return (OSError,)
    return (SafetensorError, OSError)


class ShardedCheckpoint:
    """Lazy reader of a (sharded) safetensors checkpoint; see the module docstring.

    ``names()`` all tensor names (sorted); ``name in ckpt``; ``get(name)`` / ``ckpt[name]`` one tensor (CPU,
    the stored dtype); ``get_many(prefix)`` every tensor whose name starts with ``prefix``; ``info(name)``
    (shape, safetensors dtype string) without reading the data; ``shard_of(name)``. Use as a context manager
    or call :meth:`close` to drop the open shard handles.
    """

    def __init__(self, path):
        path = os.fspath(path)
        if os.path.isfile(path):
            self.directory = os.path.dirname(os.path.abspath(path))
            self.weight_map = self._single_shard(os.path.basename(path))
            self.metadata = {}
        elif os.path.isdir(path):
            self.directory = os.path.abspath(path)
            index = os.path.join(self.directory, INDEX_NAME)
            if os.path.isfile(index):
                self.weight_map, self.metadata = self._read_index(index)
            elif os.path.isfile(os.path.join(self.directory, SINGLE_NAME)):
                self.weight_map, self.metadata = self._single_shard(SINGLE_NAME), {}
            else:
                raise CheckpointError(f"checkpoint {path!r}: no {INDEX_NAME} (nor a single {SINGLE_NAME})")
        else:
            raise CheckpointError(f"checkpoint {path!r}: no such file or directory")
        missing = sorted({f for f in self.weight_map.values() if not os.path.isfile(self._shard_path(f))})
        if missing:
            raise CheckpointError(f"checkpoint {self.directory!r}: shard file(s) named by the index are missing: "
                                  f"{missing}")
        self._handles: dict = {}
        self._keys: dict = {}

    # ---------------------------------------------------------------- index
    def _read_index(self, index_path: str) -> tuple[dict, dict]:
        try:
            with open(index_path, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise CheckpointError(f"checkpoint index {index_path!r}: unreadable ({error})") from error
        if not isinstance(doc, dict) or not isinstance(doc.get("weight_map"), dict):
            raise CheckpointError(f"checkpoint index {index_path!r}: expected an object with a 'weight_map' object")
        weight_map = doc["weight_map"]
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or not shard or os.path.basename(shard) != shard or shard in (".", ".."):
                raise CheckpointError(f"checkpoint index {index_path!r}: tensor {name!r} maps to {shard!r}, "
                                      "expected a file name in the checkpoint directory")
        metadata = doc.get("metadata") if isinstance(doc.get("metadata"), dict) else {}
        return dict(weight_map), metadata

    def _single_shard(self, file_name: str) -> dict:
        handle = self._open(file_name)
        return {name: file_name for name in handle.keys()}

    def _shard_path(self, file_name: str) -> str:
        return os.path.join(self.directory, file_name)

    def _open(self, file_name: str):
        handles = getattr(self, "_handles", None)
        if handles is not None and file_name in handles:
            return handles[file_name]
        from safetensors import safe_open

        path = self._shard_path(file_name)
        if not os.path.isfile(path):
            raise CheckpointError(f"checkpoint shard {path!r}: missing")
        try:
            handle = safe_open(path, framework="pt", device="cpu")
        except _safetensor_errors() as error:
            raise CheckpointError(f"checkpoint shard {path!r}: corrupt or unreadable ({error})") from error
        if handles is not None:
            handles[file_name] = handle
        return handle

    # ---------------------------------------------------------------- access
    def names(self) -> list:
        return sorted(self.weight_map)

    keys = names  # mapping-style access (the model's loaders iterate ``keys()``)

    def __contains__(self, name) -> bool:
        return name in self.weight_map

    def __len__(self) -> int:
        return len(self.weight_map)

    def shard_of(self, name: str) -> str:
        if name not in self.weight_map:
            raise CheckpointError(f"checkpoint {self.directory!r}: missing tensor {name!r}")
        return self.weight_map[name]

    def _handle_for(self, name: str):
        file_name = self.shard_of(name)
        handle = self._open(file_name)
        if file_name not in self._keys:
            self._keys[file_name] = set(handle.keys())
        if name not in self._keys[file_name]:
            raise CheckpointError(f"checkpoint: the index maps {name!r} to {file_name!r}, which does not contain it")
        return handle, file_name

    def get(self, name: str, default=_MISSING) -> torch.Tensor:
        """The tensor ``name`` (CPU). Missing -> ``default`` when given, else CheckpointError."""
        if name not in self.weight_map and default is not _MISSING:
            return default
        handle, file_name = self._handle_for(name)
        try:
            return handle.get_tensor(name)
        except _safetensor_errors() as error:
            raise CheckpointError(f"checkpoint shard {file_name!r}: cannot read {name!r} ({error})") from error

    __getitem__ = get

    def info(self, name: str) -> tuple[tuple, str]:
        """(shape, safetensors dtype string such as "BF16", "F8_E4M3", "U8") of ``name`` without reading it."""
        handle, file_name = self._handle_for(name)
        try:
            sl = handle.get_slice(name)
            return tuple(sl.get_shape()), sl.get_dtype()
        except _safetensor_errors() as error:
            raise CheckpointError(f"checkpoint shard {file_name!r}: cannot read {name!r} ({error})") from error

    def get_many(self, prefix: str) -> dict:
        """Every tensor whose name starts with ``prefix`` -> {name: tensor} (shard by shard)."""
        names = sorted((n for n in self.weight_map if n.startswith(prefix)), key=lambda n: (self.weight_map[n], n))
        return {n: self.get(n) for n in names}

    def get_nvfp4(self, name: str, shape) -> dict:
        """The checked parts of the ModelOpt NVFP4 linear ``name`` (without ``.weight``) of logical ``shape``
        (out, in): see :func:`check_tensor` with ``dtype_kind="nvfp4"``."""
        parts = {part: self.get(f"{name}.{part}", None)
                 for part in ("weight", "weight_scale", "weight_scale_2", "input_scale")}
        return check_tensor(name, {k: v for k, v in parts.items() if v is not None}, shape, "nvfp4")

    def close(self) -> None:
        self._handles.clear()
        self._keys.clear()

    def __enter__(self) -> "ShardedCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        shards = len(set(self.weight_map.values()))
        return f"ShardedCheckpoint({self.directory!r}, {len(self.weight_map)} tensors in {shards} shard(s))"


# -------------------------------------------------------------------- checks
_KIND_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "int32": torch.int32}


def _check_plain(name: str, t, shape, dtype) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise CheckpointError(f"checkpoint: {name!r} is not a tensor (got {type(t).__name__})")
    if t.dtype != dtype:
        raise CheckpointError(f"checkpoint: {name!r} has dtype {t.dtype}, expected {dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise CheckpointError(f"checkpoint: {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    return t


def check_scale_value(name: str, t) -> torch.Tensor:
    """A scalar float32 scale (``weight_scale_2`` / ``input_scale``): one finite value > 0 -> 0-d tensor.

    Reads the value on the host (load time only).
    """
    if not isinstance(t, torch.Tensor):
        raise CheckpointError(f"checkpoint: {name!r} is not a tensor (got {type(t).__name__})")
    if t.numel() != 1 or t.dtype != torch.float32:
        raise CheckpointError(f"checkpoint: {name!r} must be one float32 value, got shape {tuple(t.shape)} {t.dtype}")
    value = float(t.reshape(()).item())
    if not math.isfinite(value) or value <= 0:
        raise CheckpointError(f"checkpoint: {name!r} = {value!r}; a scale must be finite and > 0")
    return t.reshape(())


def check_tensor(name: str, tensor, shape, dtype_kind: str):
    """Validate ``tensor`` stored as ``name`` against ``shape`` and ``dtype_kind``; returns it (normalised).

    dtype_kind "bf16" / "fp32" / "int32": a tensor of that dtype and ``shape`` (None: any shape).
    "nvfp4": ``tensor`` is a mapping of the parts of one ModelOpt NVFP4 linear of logical ``shape`` (out, in):
    ``weight`` uint8 (out, in/2), ``weight_scale`` float8_e4m3fn (or its uint8 bytes) (out, in/16),
    ``weight_scale_2`` one float32 value, optional ``input_scale`` one float32 value; both scales finite and
    > 0. Returns a dict with the same keys (``weight_scale`` as float8_e4m3fn, scales 0-d; ``input_scale``
    None when absent). Raises CheckpointError naming ``name`` (and the part).
    """
    if dtype_kind not in DTYPE_KINDS:
        raise ValueError(f"dtype_kind: expected one of {DTYPE_KINDS}, got {dtype_kind!r}")
    if dtype_kind != "nvfp4":
        return _check_plain(name, tensor, shape, _KIND_DTYPES[dtype_kind])
    if not hasattr(tensor, "__getitem__") or not hasattr(tensor, "__contains__"):
        raise CheckpointError(f"checkpoint: {name!r}: expected the NVFP4 parts (weight, weight_scale, "
                              f"weight_scale_2[, input_scale]), got {type(tensor).__name__}")
    if shape is None or len(tuple(shape)) != 2:
        raise ValueError(f"shape: an NVFP4 linear needs its logical (out, in) shape, got {shape!r}")
    out_f, in_f = (int(s) for s in shape)
    if in_f % 16:
        raise ValueError(f"shape: in_features must be a multiple of 16 (NVFP4 blocks), got {in_f}")
    for part in ("weight", "weight_scale", "weight_scale_2"):
        if part not in tensor:
            raise CheckpointError(f"checkpoint: missing tensor {name + '.' + part!r}")
    weight = _check_plain(f"{name}.weight", tensor["weight"], (out_f, in_f // 2), torch.uint8)
    scale = tensor["weight_scale"]
    if isinstance(scale, torch.Tensor) and scale.dtype == torch.uint8:
        scale = scale.view(torch.float8_e4m3fn)
    scale = _check_plain(f"{name}.weight_scale", scale, (out_f, in_f // 16), torch.float8_e4m3fn)
    scale_2 = check_scale_value(f"{name}.weight_scale_2", tensor["weight_scale_2"])
    input_scale = tensor["input_scale"] if "input_scale" in tensor else None
    if input_scale is not None:
        input_scale = check_scale_value(f"{name}.input_scale", input_scale)
    return {"weight": weight, "weight_scale": scale, "weight_scale_2": scale_2, "input_scale": input_scale}
