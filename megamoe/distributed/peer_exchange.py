"""Capacity-mode EP exchanges over NVLink peer-to-peer stores (``torch.distributed._symmetric_memory``).

On one host whose GPUs can address each other, a 2-rank all-to-all through NCCL costs ~10-12 us per call at
decode sizes even when it moves a few KB (H100 x2, ``benchmarks/results/gpu_check_v31``), and an EP step makes
three (counts, rows, return). Here each rank stores its rows (and counts) straight into the peers' receive
buffers with one kernel (``megamoe/kernels/ep_exchange.py``, ``ep_put_rows``), then all ranks meet at the
symmetric-memory handle's barrier: two kernels per exchange, and the counts ride with the rows.

:class:`PeerExchange` is one layer's workspace: a symmetric allocation holding the receive rows (W * cap, H)
bf16, the return rows (W * cap + max tokens, H) bf16 and the received counts (E,) int32, plus the device table
of every rank's base address. No multicast is used (``TORCH_SYMM_MEM_DISABLE_MULTICAST`` may stay set).

Ordering of one step (each rank, one stream): pack -> put rows + counts -> barrier -> local GEMMs (read the
receive rows) -> put the results -> barrier -> combine (reads the return rows). A rank writes a peer's receive
rows for step n + 1 only after the second barrier of step n, which the peer reaches after its GEMMs of step n;
it writes the peer's return rows only after the first barrier of step n + 1, which the peer reaches after its
combine of step n. So one workspace serves every step without extra synchronisation.
"""
from __future__ import annotations

import importlib

import torch
import torch.distributed as dist


def _align(n: int, a: int = 256) -> int:
    return (n + a - 1) // a * a


def peer_exchange_available(device: torch.device) -> tuple[bool, str]:
    """Whether this process can build a :class:`PeerExchange` (local check; the layer agrees across ranks)."""
    if device.type != "cuda":
        return False, "not a CUDA device"
    try:
        importlib.import_module("torch.distributed._symmetric_memory")
    except Exception as exc:  # noqa: BLE001 (any import failure means unavailable)
        return False, f"torch.distributed._symmetric_memory: {exc}"
    return True, ""


class PeerExchange:
    """One EP layer's symmetric workspace (module docstring). A collective over ``group`` (rendezvous).

    rows: receive rows (W * cap); ret_rows: return rows (W * cap + max tokens); hidden: H; num_experts: E.
    Attributes: ``recv_x`` (rows, H) bf16, ``ret`` (ret_rows, H) bf16, ``recv_counts`` (E,) int32 (views of
    this rank's part), ``peer_base`` (W,) int64 on the device (each rank's workspace address),
    ``recv_x_offset`` / ``ret_offset`` / ``counts_offset`` (bytes from a workspace's base).
    """

    def __init__(self, group, device: torch.device, *, rows: int, ret_rows: int, hidden: int, num_experts: int):
        import torch.distributed._symmetric_memory as symm_mem

        self.recv_x_offset = 0
        self.ret_offset = _align(rows * hidden * 2)
        self.counts_offset = self.ret_offset + _align(ret_rows * hidden * 2)
        nbytes = self.counts_offset + _align(num_experts * 4)
        buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(buf, group.group_name)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        views = [self.handle.get_buffer(r, (nbytes,), torch.uint8) for r in range(world)]
        self.peer_base = torch.tensor([v.data_ptr() for v in views], dtype=torch.int64, device=device)
        local = views[rank]
        local.zero_()  # padding rows stay finite; the barrier orders the zeroing before any peer's first store
        self._buf, self._local = buf, local  # keep the allocation alive
        self.recv_x = local[:rows * hidden * 2].view(torch.bfloat16).view(rows, hidden)
        self.ret = local[self.ret_offset:self.ret_offset + ret_rows * hidden * 2].view(torch.bfloat16).view(
            ret_rows, hidden)
        self.recv_counts = local[self.counts_offset:self.counts_offset + num_experts * 4].view(torch.int32)
        self.barrier()

    def barrier(self) -> None:
        """Every rank of the group has passed this point, with its earlier peer stores visible (graph-capturable)."""
        self.handle.barrier(channel=0)
