"""Process-group helpers for expert parallelism (torch.distributed; NCCL on GPUs, gloo on CPU).

* :func:`backend_for` -- "nccl" for CUDA devices, "gloo" for CPU.
* :func:`init_from_env` -- ``init_process_group`` from the ``torchrun`` environment (RANK, WORLD_SIZE,
  LOCAL_RANK, MASTER_ADDR/PORT) with a finite timeout; on CUDA binds the process to ``cuda:LOCAL_RANK``.
* :func:`shutdown` -- the matching teardown: frees what is no longer referenced (captured CUDA graphs hold
  NCCL work of the communicator), waits for the device and the other ranks, destroys the group.
* :func:`check_same_across_ranks` -- every rank contributes a small dict (config, sizes, checksums, or the
  error it hit locally); every rank raises the same clear ``ValueError`` naming the fields and ranks that
  differ, instead of hanging later in a mismatched all-to-all.

Hangs: a collective that one rank never joins blocks the others until the group's timeout; groups made by
:func:`init_from_env` use ``DEFAULT_TIMEOUT_S`` (gloo honours it for every collective; NCCL needs
``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``, torch's default, to turn it into an error).
"""
from __future__ import annotations

import datetime
import gc
import os

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 120.0


def backend_for(device) -> str:
    """The torch.distributed backend for tensors on ``device``: "nccl" (CUDA) or "gloo" (CPU)."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_from_env(device_type: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> torch.device:
    """Initialise the default process group from the torchrun environment; returns this rank's device.

    device_type: "cuda" or "cpu" (default: cuda when available). CUDA: ``torch.cuda.set_device(LOCAL_RANK)``
    and the NCCL backend; CPU: gloo. Already initialised: only returns the device.
    """
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device_type: expected 'cuda' or 'cpu', got {device_type!r}")
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ and not dist.is_initialized():
            raise RuntimeError(f"init_from_env: environment variable {var} is not set; launch with "
                               "'torchrun --nproc-per-node N -m megamoe run --ep'")
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend_for(device), timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
    return device


def shutdown(device: torch.device) -> None:
    """Destroy the default process group after every rank's last collective. Drop the CUDA graphs that captured
    collectives first (``V4Model.release_graphs()``, the closures of ``capture``): with them alive,
    ``destroy_process_group`` hung on 2 H100s (torch 2.11, benchmarks/results/gpu_check_v16). Collects the
    unreferenced ones here, synchronises the device, then a barrier."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    dist.destroy_process_group()


def check_backend(group, device: torch.device) -> None:
    """A CUDA layer needs an NCCL group, a CPU layer a gloo group (clear error instead of a backend crash)."""
    backend = str(dist.get_backend(group)).lower()
    want = backend_for(device)
    if want not in backend:
        raise ValueError(f"group: the layer's device {device} needs a {want!r} process group, got backend "
                         f"{backend!r}")


def check_same_across_ranks(group, what: str, fields: dict, local_error: str | None = None) -> None:
    """Raise the same ValueError on every rank when ``fields`` differ across the ranks of ``group``.

    A collective (``all_gather_object``): every rank of the group must call it. local_error: a message when
    this rank already failed its local validation; every rank then raises naming that rank (so no rank is
    left waiting in a later collective).
    """
    world = dist.get_world_size(group)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, {"fields": fields, "error": local_error}, group=group)
    errors = [(r, g["error"]) for r, g in enumerate(gathered) if g["error"]]
    if errors:
        raise ValueError(f"{what}: rank(s) failed: " + "; ".join(f"rank {r}: {e}" for r, e in errors))
    diffs = []
    for key in fields:
        values = [g["fields"].get(key) for g in gathered]
        if any(v != values[0] for v in values[1:]):
            diffs.append(f"{key}: " + ", ".join(f"rank {r}={v!r}" for r, v in enumerate(values)))
    keys = set().union(*(g["fields"].keys() for g in gathered))
    if keys != set(fields):
        diffs.append(f"field names differ across ranks: {sorted(keys ^ set(fields))}")
    if diffs:
        raise ValueError(f"{what}: every rank must use the same settings; mismatched: " + " | ".join(diffs))


def tensor_checksum(t: torch.Tensor | None):
    """A host fingerprint of a replicated tensor (shape, dtype, float64 sum of its values); load time only."""
    if t is None:
        return None
    return (tuple(t.shape), str(t.dtype), float(t.detach().double().sum().item()) if t.numel() else 0.0)
