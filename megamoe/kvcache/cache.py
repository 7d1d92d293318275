"""One layer kind's compressed cache: paged pool, compressor state(s), block table, SWA window.

Host side (outside any captured graph): :meth:`CompressedKVCache.set_post_pool` (once, the norm weights and
RoPE table of the official post-pool steps), :meth:`join` / :meth:`leave` (slot life cycle),
:meth:`prepare_forward` (allocate the pages a step will write, from positions before/after the step) and
:meth:`prefill` (a fresh request's prompt: every complete window pooled and written, the compressor tails
left as the official prefill leaves them, the SWA ring filled). Device side (capturable, sync-free):
:meth:`decode_step`, which runs the compressor step, the post-pool steps, flush-write and SWA append for a
fixed-size batch whose inactive rows are masked inside the kernels, and, for CSA, the indexer scoring +
top-k.

Life cycle of a request in slot ``s`` with a prompt of T tokens::

    cache.join(s); cache.prepare_forward([s], [0], [T]); cache.prefill(s, kv, score, swa_kv, ...)
    # each decode step (all rows of the batch at once):
    cache.prepare_forward(slots, positions, positions + 1); batch.set(...); cache.decode_step(batch, ...)
    cache.leave(s)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..reference.kvcache import prefill_pool
from ..reference.v4_numerics import apply_rope, hadamard_matrix, rms_norm
from ..ops import v4_elementwise as ew
from ..ops._dispatch import resolve_device, use_triton
from . import ops
from .config import CompressedCacheConfig
from .state import CompressorState, PagedPool


#: Prompt tokens pooled per chunk in :meth:`CompressedKVCache.prefill` (bounds the (windows, 2m, D) float32
#: temporaries to ~64 MB at D = 512; prompts up to this length pool in one shot, like the official code).
_PREFILL_CHUNK_TOKENS = 16384


def check_slot(slot, max_slots: int) -> None:
    """A request slot: a Python int (not a bool) in ``[0, max_slots)``, else ValueError naming slot."""
    if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < max_slots:
        raise ValueError(f"slot: expected an int in [0, {max_slots}), got {slot!r}")


class BlockAllocator:
    """Host-side free list of pool pages (never touched inside a graph)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._free_set = set(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("BlockAllocator: the compressed-cache pool is out of pages")
        page = self._free.pop()
        self._free_set.discard(page)
        return page

    def release(self, pages) -> None:
        """Return pages to the free list; a page outside the pool, already free or listed twice raises
        ValueError and nothing is released."""
        pages = list(pages)
        seen = set()
        for p in pages:
            if not isinstance(p, int) or not 0 <= p < self.num_blocks:
                raise ValueError(f"release: page {p!r} is not a page of this pool [0, {self.num_blocks})")
            if p in self._free_set or p in seen:
                raise ValueError(f"release: page {p} is already free (released twice)")
            seen.add(p)
        self._free.extend(reversed(pages))
        self._free_set.update(pages)


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
        """Copy host lists (B ints, B ints, B bools) into the device buffers (outside the graph)."""
        B = self.slots.shape[0]
        for name, values in (("slots", slots), ("positions", positions), ("active", active)):
            if len(values) != B:
                raise ValueError(f"{name}: expected {B} values (the batch size), got {len(values)}")
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
        self.device = resolve_device(device)
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
        self.workspace = None  # the most recently allocated workspace (see ``workspaces``)
        self.workspaces: dict[int, dict] = {}  # batch size -> preallocated per-step intermediates
        self.post_pool = None
        if batch is not None:
            self.allocate_workspace(batch)

    # ---------------------------------------------------------------- host side
    def allocate_workspace(self, batch: int) -> None:
        """Preallocate the per-step intermediates for a fixed batch size (graph-stable pointers). One workspace
        is kept per batch size, so graphs captured for several batch sizes each keep their own."""
        c, dev = self.config, self.device
        ws = {
            "pooled": torch.zeros((batch, c.head_dim), dtype=torch.float32, device=dev),
            "entry": torch.zeros((batch, c.head_dim), dtype=torch.bfloat16, device=dev),
            "flush": torch.zeros((batch,), dtype=torch.bool, device=dev),
            # window_step outputs: the attention's window ring rows and entry counts (HCA: the entry list)
            "window_rows": torch.full((batch, c.window_size), -1, dtype=torch.int32, device=dev),
            "n_entries": torch.zeros((batch,), dtype=torch.int32, device=dev),
        }
        if not c.has_indexer:
            ws["entry_idx"] = torch.full((batch, max(c.max_entries, 1)), -1, dtype=torch.int32, device=dev)
        if c.has_indexer:
            ws["pooled_key"] = torch.zeros((batch, c.index_head_dim), dtype=torch.float32, device=dev)
            ws["key"] = torch.zeros((batch, c.index_head_dim), dtype=torch.bfloat16, device=dev)
            ws["key_flush"] = torch.zeros((batch,), dtype=torch.bool, device=dev)
            ws["scores"] = torch.full((batch, max(c.max_entries, 1)), float("-inf"), dtype=torch.float32, device=dev)
            if dev.type == "cuda":  # the fused indexer top-k's output and scratch (zeroed once, reset by the kernels)
                from ..kernels.topk import workspace_entries

                T = max(c.max_entries, 1)
                ws["topk"] = torch.empty((batch, min(c.index_topk, T)), dtype=torch.int32, device=dev)
                ws["topk_workspace"] = torch.zeros((batch, max(1, workspace_entries(T, c.index_topk, batch=batch))),
                                                   dtype=torch.int32, device=dev)
        self.workspaces[batch] = self.workspace = ws

    def set_post_pool(self, norm_weight: torch.Tensor, rope_freqs: torch.Tensor,
                      index_norm_weight: torch.Tensor | None = None) -> None:
        """Parameters of the official post-pool steps (outside the graph; call once before any step).

        norm_weight: (head_dim,) float tensor, the main compressor's ``norm.weight``;
        rope_freqs: (max_pos, rope_dim // 2) complex64, the compressed layers' ``freqs_cis`` (YaRN, base
        ``compress_rope_theta``); window entry ``e`` is rotated with row ``e * ratio`` (``pos + 1 - ratio``);
        index_norm_weight: (index_head_dim,) float tensor, the indexer compressor's ``norm.weight`` (CSA;
        None for HCA). The values are copied into buffers owned by the cache, so a later call (same shapes)
        updates them under captured graphs too.
        """
        c, dev = self.config, self.device

        def check_vec(t, name, n):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() or tuple(t.shape) != (n,):
                raise ValueError(f"{name}: expected a ({n},) floating-point tensor, got "
                                 f"{getattr(t, 'shape', type(t).__name__)}")

        check_vec(norm_weight, "norm_weight", c.head_dim)
        if not isinstance(rope_freqs, torch.Tensor) or rope_freqs.dtype != torch.complex64 \
                or rope_freqs.dim() != 2 or rope_freqs.shape[1] != c.rope_dim // 2 \
                or rope_freqs.shape[0] < c.max_context:
            raise ValueError(f"rope_freqs: expected a (max_pos >= max_context={c.max_context}, {c.rope_dim // 2}) "
                             "complex64 tensor, got "
                             f"{getattr(rope_freqs, 'shape', None)} {getattr(rope_freqs, 'dtype', None)}")
        if c.has_indexer:
            if index_norm_weight is None:
                raise ValueError("index_norm_weight: required for a CSA cache (the indexer compressor's norm)")
            check_vec(index_norm_weight, "index_norm_weight", c.index_head_dim)
            if c.index_head_dim & (c.index_head_dim - 1):
                raise ValueError(f"index_head_dim: the Hadamard rotation needs a power of two, got {c.index_head_dim}")
        elif index_norm_weight is not None:
            raise ValueError("index_norm_weight: expected None for an HCA cache (no indexer)")
        new = {"norm": norm_weight.detach().float(), "freqs": rope_freqs.detach(),
               "index_norm": None if index_norm_weight is None else index_norm_weight.detach().float()}
        if self.post_pool is not None and self.post_pool["freqs"].shape == rope_freqs.shape:
            for k, v in new.items():
                if v is not None:
                    self.post_pool[k].copy_(v)
            return
        self.post_pool = {k: None if v is None else v.to(dev).clone().contiguous() for k, v in new.items()}
        if c.has_indexer:
            self.post_pool["hadamard"] = hadamard_matrix(c.index_head_dim, dev)

    def _post_pool_rows(self, pooled: torch.Tensor, freqs: torch.Tensor, index: bool) -> torch.Tensor:
        """Official post-pool steps on pooled rows (N, D) float32 with RoPE rows ``freqs`` (N, rope // 2)
        -> (N, D) bf16: ``bf16`` -> RMSNorm -> RoPE of the last rope_dim dims -> (index) Hadamard.
        Same ops as ``megamoe.reference.kvcache.post_pool`` (the Hadamard matrix is built once)."""
        pp = self.post_pool
        x = rms_norm(pooled.to(torch.bfloat16), pp["index_norm" if index else "norm"], self.config.norm_eps)
        x = apply_rope(x, freqs)
        if index:
            d = x.shape[-1]
            x = ((x.float() @ pp["hadamard"]) * d ** -0.5).to(x.dtype)
        return x

    def _post_pool_decode(self, pooled: torch.Tensor, positions: torch.Tensor, out: torch.Tensor, index: bool) -> None:
        """Post-pool steps of a decode step's pooled rows (B, D) float32 -> ``out`` (B, D) bf16, RoPE row of the
        window start ``pos + 1 - ratio`` (clamped into the table, so non-flushing rows at any position index in
        range; a window start past the table flags ``(post_pool, "positions")``). Triton path: one launch
        (``megamoe.ops.v4_elementwise.post_pool``); CPU: the PyTorch formulas."""
        c, pp = self.config, self.post_pool
        freqs = pp["freqs"]
        if use_triton(pooled):
            ew.post_pool(pooled, pp["index_norm" if index else "norm"], freqs, positions, out, shift=1 - c.ratio,
                         eps=c.norm_eps, rotate=index)
            return
        ew.flag_positions("post_pool", positions, freqs.shape[0], shift=1 - c.ratio)  # the kernel's flag rule
        start = (positions.to(torch.int64) + (1 - c.ratio)).clamp_(0, freqs.shape[0] - 1)
        out.copy_(self._post_pool_rows(pooled, freqs.index_select(0, start), index=index))

    def _require_post_pool(self, where: str) -> None:
        if self.post_pool is None:
            raise ValueError(f"{where}: call set_post_pool(norm_weight, rope_freqs, index_norm_weight) first "
                             "(outside the graph): entries must go through the official RMSNorm/RoPE steps")

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
        so it needs ``ceil(entries / entries_per_block)`` pages. Deterministic; one host->device copy (CUDA: from a
        pinned snapshot, without a host sync).
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
            if self.block_table.is_cuda:
                # a pinned snapshot copied without blocking the host (a pageable source made this copy wait for the
                # device's queue: two host syncs per prefill, one per page-allocating decode step); the snapshot's
                # pinned block is not reused before the copy has run (torch's caching host allocator)
                self.block_table.copy_(self._host_table.pin_memory(), non_blocking=True)
            else:
                self.block_table.copy_(self._host_table)

    def prefill(self, slot: int, kv: torch.Tensor, score: torch.Tensor, swa_kv: torch.Tensor,
                index_kv: torch.Tensor | None = None, index_score: torch.Tensor | None = None) -> None:
        """A fresh request's prompt of T tokens (positions 0..T-1), eager (outside graphs).

        Call after ``join(slot)`` and ``prepare_forward([slot], [0], [T])``. kv, score: (T, C * head_dim)
        float32 compressor projections (score including ape); swa_kv: (T, head_dim) bf16 the tokens'
        sliding-window kv; CSA: index_kv, index_score (T, C * index_head_dim) float32 (the four float32 inputs
        may have strided rows, unit stride along the last dim: column views of a fused projection). Pools every
        complete window (official prefill: ``overlap_transform`` for CSA), applies the post-pool steps, writes the
        ``T // ratio`` entries (and indexer keys) to the pool, leaves the compressor tails as the official
        state after prefill (a-stream: the unfinished window's tokens in rows ``pos % ratio``; CSA
        b-stream: the last complete window's overlap half) and fills the SWA ring with the last
        ``window_size`` tokens. A following ``decode_step`` at position T continues like the official decode.
        Everything is validated before any state changes.
        """
        c, dev = self.config, self.device
        self._check_slot(slot)
        self._require_post_pool("prefill")
        if not isinstance(kv, torch.Tensor) or kv.dim() != 2:
            raise ValueError("kv: expected a (T, C * head_dim) float32 tensor")
        T = kv.shape[0]
        C = 2 if c.overlap else 1
        ops._check(kv, "kv", torch.float32, (T, C * c.head_dim), dev, rows=True)
        ops._check(score, "score", torch.float32, (T, C * c.head_dim), dev, rows=True)
        ops._check(swa_kv, "swa_kv", torch.bfloat16, (T, c.head_dim), dev)
        if c.has_indexer:
            if index_kv is None or index_score is None:
                raise ValueError("index_kv, index_score: required for a CSA cache")
            ops._check(index_kv, "index_kv", torch.float32, (T, C * c.index_head_dim), dev, rows=True)
            ops._check(index_score, "index_score", torch.float32, (T, C * c.index_head_dim), dev, rows=True)
        elif index_kv is not None or index_score is not None:
            raise ValueError("index_kv, index_score: expected None for an HCA cache (no indexer)")
        if T > c.max_context:
            raise ValueError(f"kv: {T} tokens exceed max_context={c.max_context}")
        n = T // c.ratio
        if len(self._pages[slot]) * c.entries_per_block < n:
            raise ValueError(f"prefill: slot {slot} has pages for {len(self._pages[slot]) * c.entries_per_block} "
                             f"entries, the prompt writes {n}; call prepare_forward([slot], [0], [T]) first")

        starts = torch.arange(n, device=dev) * c.ratio        # window-start positions (< max_context)
        row_freqs = self.post_pool["freqs"].index_select(0, starts)
        entry = key = None
        for st, k, z in ((self.state, kv, score), (self.index_state, index_kv, index_score)):
            if st is None:
                continue
            pooled, tk, tz, tkb, tzb, rem = prefill_pool(k, z, c.ratio, st.width, st.overlap,
                                                         chunk_windows=max(1, _PREFILL_CHUNK_TOKENS // c.ratio))
            st.tail_k[slot].copy_(tk)
            st.tail_z[slot].copy_(tz)
            if st.overlap:
                st.tail_kb[slot].copy_(tkb)
                st.tail_zb[slot].copy_(tzb)
            st.tail_len[slot].fill_(rem)
            rows = self._post_pool_rows(pooled, row_freqs, index=st is self.index_state)
            if st is self.index_state:
                key = rows
            else:
                entry = rows
        if n:
            ops.flush_write(self.pool, self.block_table, entry.contiguous(),
                            None if key is None else key.contiguous(),
                            torch.ones(n, dtype=torch.bool, device=dev),
                            torch.full((n,), slot, dtype=torch.int32, device=dev),
                            starts.to(torch.int32) + (c.ratio - 1), ratio=c.ratio)
        w = c.window_size
        first = max(0, T - w)
        if T > first:
            pos = torch.arange(first, T, device=dev)
            self.swa_rows.index_copy_(0, slot * w + pos % w, swa_kv[first:])

    def _check_slot(self, slot: int) -> None:
        check_slot(slot, self.config.max_slots)

    # ---------------------------------------------------------------- device side (capturable)
    def decode_step(self, batch: DecodeBatch, kv: torch.Tensor, score: torch.Tensor, swa_kv: torch.Tensor,
                    index_kv: torch.Tensor | None = None, index_score: torch.Tensor | None = None,
                    q: torch.Tensor | None = None, weights: torch.Tensor | None = None, *,
                    ape: torch.Tensor | None = None, index_ape: torch.Tensor | None = None):
        """One decode step of the cache for ``batch`` (B rows, inactive rows are no-ops).

        kv, score: (B, C * head_dim) float32 compressor projections of the new token (score includes ape; these and
        index_kv / index_score may have strided rows with unit stride along the last dim);
        swa_kv: (B, head_dim) bf16 the token's sliding-window kv;
        CSA only: index_kv, index_score (B, C * index_head_dim) float32 indexer-compressor projections,
        q (B, index_n_heads, index_head_dim) bf16 the indexer query as the official einsum sees it (RoPE'd,
        Hadamard-rotated, FP4-simulated) and weights (B, index_n_heads) float32 (``weights_proj(x) *
        softmax_scale * n_heads**-0.5``) for the top-k.
        A flushing row's pooled entry goes through the official post-pool steps (bf16 -> RMSNorm -> RoPE at
        the window start ``pos + 1 - ratio`` -> indexer: Hadamard) and is quantized by the flush-write.
        Rows whose slot is outside ``[0, max_slots)`` or whose position is negative are no-ops.
        ape / index_ape: (ratio, C * head_dim) / (ratio, C * index_head_dim) float32 or None: when given, ``score``
        / ``index_score`` exclude the official ``ape`` term and the step adds ``ape[pos mod ratio]`` (inside the
        compressor kernel on the Triton path).
        Also fills, in ``self.workspace``: ``window_rows`` (B, window_size) int32, the sliding-window ring rows
        of positions ``pos - j`` (-1 where negative), ``n_entries`` (B,) int32 ``floor((pos + 1) / ratio) *
        active`` and, HCA, ``entry_idx`` (B, max(max_entries, 1)) int32 (``e`` for ``e < n_entries``, else -1):
        the attention's indices, one launch together with the SWA append (``ops.window_step``).
        Every input is validated before any state changes.
        Returns the top-k entry indices (B, min(index_topk, max_entries)) int32 for CSA, else None.
        """
        c, dev = self.config, self.device
        if not isinstance(batch, DecodeBatch):
            raise TypeError(f"batch: expected a DecodeBatch, got {type(batch).__name__}")
        ops._rows_of(kv, "kv", 2, "(B, C * head_dim) float32")
        if kv.shape[0] not in self.workspaces:
            raise ValueError("decode_step: call allocate_workspace(batch) with this batch size first "
                             "(outside the graph)")
        self._require_post_pool("decode_step")
        ws = self.workspace = self.workspaces[kv.shape[0]]
        B, C = kv.shape[0], (2 if c.overlap else 1)
        ops._check_batch(batch.slots, batch.positions, batch.active, B, dev)
        ops._check(kv, "kv", torch.float32, (B, C * c.head_dim), dev, rows=True)
        ops._check(score, "score", torch.float32, (B, C * c.head_dim), dev, rows=True)
        ops._check(swa_kv, "swa_kv", torch.bfloat16, (B, c.head_dim), dev)
        if c.has_indexer:
            if index_kv is None or index_score is None or q is None or weights is None:
                raise ValueError("index_kv, index_score, q, weights: required for a CSA cache")
            ops._check(index_kv, "index_kv", torch.float32, (B, C * c.index_head_dim), dev, rows=True)
            ops._check(index_score, "index_score", torch.float32, (B, C * c.index_head_dim), dev, rows=True)
            ops._check(q, "q", torch.bfloat16, (B, c.index_n_heads, c.index_head_dim), dev)
            ops._check(weights, "weights", torch.float32, (B, c.index_n_heads), dev)
        elif any(t is not None for t in (index_kv, index_score, q, weights)):
            raise ValueError("index_kv, index_score, q, weights: expected None for an HCA cache (no indexer)")
        if index_ape is not None and not c.has_indexer:
            raise ValueError("index_ape: expected None for an HCA cache (no indexer)")

        ops.window_step(self.swa_rows, c.window_size, swa_kv, batch.slots, batch.positions, batch.active,
                        ws["window_rows"], ratio=c.ratio, n_entries=ws["n_entries"], entry_idx=ws.get("entry_idx"))
        ops.compressor_step(self.state, kv, score, batch.slots, batch.positions, batch.active, ws["pooled"],
                            ws["flush"], ape=ape)
        self._post_pool_decode(ws["pooled"], batch.positions, ws["entry"], index=False)
        key = None
        if c.has_indexer:
            ops.compressor_step(self.index_state, index_kv, index_score, batch.slots, batch.positions,
                                batch.active, ws["pooled_key"], ws["key_flush"], ape=index_ape)
            self._post_pool_decode(ws["pooled_key"], batch.positions, ws["key"], index=True)
            key = ws["key"]
        ops.flush_write(self.pool, self.block_table, ws["entry"], key, ws["flush"], batch.slots, batch.positions,
                        ratio=c.ratio)
        if not c.has_indexer:
            return None
        if q.is_cuda:  # scores + top-k with the top-k's preallocated workspace (one launch fewer on the split path)
            return ops.indexer_topk(self.pool, self.block_table, q, weights, batch.slots, ws["n_entries"],
                                    ws["scores"], c.index_topk, out=ws["topk"], workspace=ws["topk_workspace"])
        ops.indexer_scores(self.pool, self.block_table, q, weights, batch.slots, ws["n_entries"], ws["scores"])
        return ops.select_topk(ws["scores"], c.index_topk)
