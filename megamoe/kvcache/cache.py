"""One layer kind's compressed cache: paged pool, compressor state(s), block table, SWA window.

Host side (outside any captured graph): :meth:`CompressedKVCache.join` / :meth:`leave` (slot life cycle)
and :meth:`prepare_forward` (allocate the pages a step will write, from positions before/after the
step). Device side (capturable, sync-free): :meth:`decode_step`, which runs the compressor step,
flush-write and SWA append for a fixed-size batch whose inactive rows are masked inside the kernels,
and, for CSA, the indexer scoring + top-k.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import ops
from .config import CompressedCacheConfig
from .state import CompressorState, PagedPool


class BlockAllocator:
    """Host-side free list of pool pages (never touched inside a graph)."""

    def __init__(self, num_blocks: int):
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("BlockAllocator: the compressed-cache pool is out of pages")
        return self._free.pop()

    def release(self, pages) -> None:
        self._free.extend(reversed(list(pages)))


@dataclass
class DecodeBatch:
    """Fixed-size device inputs of one decode step (B rows; filled before each replay).

    slots: (B,) int32 request slot of each row; positions: (B,) int32 position of the token appended this
    step; active: (B,) bool, False for padding rows (their whole step is a no-op).
    """

    slots: torch.Tensor
    positions: torch.Tensor
    active: torch.Tensor

    @classmethod
    def allocate(cls, batch: int, device) -> "DecodeBatch":
        return cls(torch.zeros(batch, dtype=torch.int32, device=device),
                   torch.zeros(batch, dtype=torch.int32, device=device),
                   torch.zeros(batch, dtype=torch.bool, device=device))

    def set(self, slots, positions, active) -> None:
        """Copy host lists into the device buffers (outside the graph)."""
        self.slots.copy_(torch.tensor(slots, dtype=torch.int32))
        self.positions.copy_(torch.tensor(positions, dtype=torch.int32))
        self.active.copy_(torch.tensor(active, dtype=torch.bool))


class CompressedKVCache:
    """Compressed cache of one layer kind (``config.kind`` "csa" or "hca") for up to ``max_slots`` requests.

    Tensors: ``pool`` (:class:`PagedPool`), ``state`` (main compressor, width head_dim),
    ``index_state`` (CSA: indexer compressor, width index_head_dim), ``block_table`` (S, L) int32 (-1 =
    no page), ``swa`` (S, window, head_dim) bf16 (a view of ``swa_rows``, which has one scratch row).
    """

    def __init__(self, config: CompressedCacheConfig, device, batch: int | None = None):
        self.config = config
        self.device = torch.device(device)
        c = config
        self.pool = PagedPool.allocate(c, self.device)
        self.state = CompressorState.allocate(c.max_slots, c.ratio, c.head_dim, c.overlap, self.device)
        self.index_state = (CompressorState.allocate(c.max_slots, c.ratio, c.index_head_dim, c.overlap, self.device)
                            if c.has_indexer else None)
        self.block_table = torch.full((c.max_slots, c.max_logical_blocks), -1, dtype=torch.int32, device=self.device)
        self._host_table = torch.full((c.max_slots, c.max_logical_blocks), -1, dtype=torch.int32)
        self._pages: list[list[int]] = [[] for _ in range(c.max_slots)]
        self.allocator = BlockAllocator(c.num_blocks)
        self.swa_rows = torch.zeros((c.max_slots * c.window_size + 1, c.head_dim), dtype=torch.bfloat16,
                                    device=self.device)
        self.swa = self.swa_rows[:-1].view(c.max_slots, c.window_size, c.head_dim)
        self.workspace = None
        if batch is not None:
            self.allocate_workspace(batch)

    # ---------------------------------------------------------------- host side
    def allocate_workspace(self, batch: int) -> None:
        """Preallocate the per-step intermediates for a fixed batch size (graph-stable pointers)."""
        c, dev = self.config, self.device
        ws = {
            "pooled": torch.zeros((batch, c.head_dim), dtype=torch.float32, device=dev),
            "entry": torch.zeros((batch, c.head_dim), dtype=torch.bfloat16, device=dev),
            "flush": torch.zeros((batch,), dtype=torch.bool, device=dev),
        }
        if c.has_indexer:
            ws["pooled_key"] = torch.zeros((batch, c.index_head_dim), dtype=torch.float32, device=dev)
            ws["key"] = torch.zeros((batch, c.index_head_dim), dtype=torch.bfloat16, device=dev)
            ws["key_flush"] = torch.zeros((batch,), dtype=torch.bool, device=dev)
            ws["n_entries"] = torch.zeros((batch,), dtype=torch.int32, device=dev)
            ws["scores"] = torch.full((batch, max(c.max_entries, 1)), float("-inf"), dtype=torch.float32, device=dev)
        self.workspace = ws

    def join(self, slot: int) -> None:
        """A request takes ``slot``: empty its tails and pages (outside the graph)."""
        self._check_slot(slot)
        self.leave(slot)
        self.state.reset_slot(slot)
        if self.index_state is not None:
            self.index_state.reset_slot(slot)

    def leave(self, slot: int) -> None:
        """Free ``slot``'s pages (outside the graph)."""
        self._check_slot(slot)
        self.allocator.release(self._pages[slot])
        self._pages[slot] = []
        self._host_table[slot] = -1
        self.block_table[slot].fill_(-1)

    def prepare_forward(self, slots, positions_before, positions_after) -> None:
        """Allocate every page a step can write, before the (captured) step runs.

        slots, positions_before, positions_after: host ints (lists); a request at ``positions_before``
        tokens that ends the step with ``positions_after`` tokens holds ``positions_after // m`` entries,
        so it needs ``ceil(entries / entries_per_block)`` pages. Deterministic; one host->device copy.
        """
        c = self.config
        if not (len(slots) == len(positions_before) == len(positions_after)):
            raise ValueError("slots, positions_before, positions_after: expected equal lengths")
        changed = False
        for slot, before, after in zip(slots, positions_before, positions_after):
            self._check_slot(slot)
            if after < before or before < 0:
                raise ValueError(f"positions: expected 0 <= before <= after, got {before}, {after}")
            if after > c.max_context:
                raise ValueError(f"positions_after: {after} exceeds max_context={c.max_context}")
            need = -(-(after // c.ratio) // c.entries_per_block)
            pages = self._pages[slot]
            while len(pages) < need:
                page = self.allocator.allocate()
                self._host_table[slot, len(pages)] = page
                pages.append(page)
                changed = True
        if changed:
            self.block_table.copy_(self._host_table)

    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 <= slot < self.config.max_slots:
            raise ValueError(f"slot: expected an int in [0, {self.config.max_slots}), got {slot!r}")

    # ---------------------------------------------------------------- device side (capturable)
    def decode_step(self, batch: DecodeBatch, kv: torch.Tensor, score: torch.Tensor, swa_kv: torch.Tensor,
                    index_kv: torch.Tensor | None = None, index_score: torch.Tensor | None = None,
                    q: torch.Tensor | None = None, weights: torch.Tensor | None = None):
        """One decode step of the cache for ``batch`` (B rows, inactive rows are no-ops).

        kv, score: (B, C * head_dim) float32 compressor projections of the new token (score includes ape);
        swa_kv: (B, head_dim) bf16 the token's sliding-window kv;
        CSA only: index_kv, index_score (B, C * index_head_dim) float32 indexer-compressor projections,
        q (B, index_n_heads, index_head_dim) bf16 and weights (B, index_n_heads) float32 for the top-k.
        The pooled entry is cast to bf16 and stored as is (the model's RMSNorm/RoPE/rotation of the pooled
        entry would go between the compressor step and the flush write).
        Returns the top-k entry indices (B, min(index_topk, max_entries)) int32 for CSA, else None.
        """
        if self.workspace is None or self.workspace["pooled"].shape[0] != kv.shape[0]:
            raise ValueError("decode_step: call allocate_workspace(batch) with this batch size first "
                             "(outside the graph)")
        ws, c = self.workspace, self.config
        ops.swa_append(self.swa_rows, c.window_size, swa_kv, batch.slots, batch.positions, batch.active)
        ops.compressor_step(self.state, kv, score, batch.slots, batch.positions, batch.active, ws["pooled"],
                            ws["flush"])
        ws["entry"].copy_(ws["pooled"])
        key = None
        if c.has_indexer:
            if index_kv is None or index_score is None or q is None or weights is None:
                raise ValueError("index_kv, index_score, q, weights: required for a CSA cache")
            ops.compressor_step(self.index_state, index_kv, index_score, batch.slots, batch.positions,
                                batch.active, ws["pooled_key"], ws["key_flush"])
            ws["key"].copy_(ws["pooled_key"])
            key = ws["key"]
        ops.flush_write(self.pool, self.block_table, ws["entry"], key, ws["flush"], batch.slots, batch.positions,
                        ratio=c.ratio)
        if not c.has_indexer:
            return None
        torch.floor_divide(batch.positions + 1, c.ratio, out=ws["n_entries"])
        ws["n_entries"].mul_(batch.active)
        ops.indexer_scores(self.pool, self.block_table, q, weights, batch.slots, ws["n_entries"], ws["scores"])
        return ops.select_topk(ws["scores"], c.index_topk)
