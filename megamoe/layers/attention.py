"""DeepSeek-V4 attention block on the compressed cache (window-only, CSA and HCA layers), graph-capturable decode.

Per token (official ``Attention.forward``; every formula of ``megamoe/reference/v4_numerics.py``):

1. q path: ``qr = q_norm(wq_a(x))``, ``q = wq_b(qr)`` as (H, head_dim), a weightless RMSNorm per head, RoPE on the
   last ``rope_dim`` dims at the token's position;
2. window kv: ``kv = kv_norm(wkv(x))``, RoPE, FP8 simulation of the non-RoPE dims (64-blocks, power-of-two scales),
   appended to the sliding-window ring;
3. compressed layers: the compressor projections (float32, ``x.float() @ W.T``, plus ``ape``) go to
   :class:`~megamoe.kvcache.CompressedKVCache`, which pools, normalises, rotates and stores the entries (FP8 pool);
   CSA layers also run the indexer: ``q_i = fp4(hadamard(rope(indexer.wq_b(qr))))``, ``w_i = weights_proj(x) *
   index_head_dim**-0.5 * index_n_heads**-0.5``, scores over the stored NVFP4-simulated keys, top-k;
4. sparse MQA attention (``megamoe.ops.attention.sparse_mqa_attention``) over the window rows and the selected
   (CSA) or all (HCA) compressed entries, with the per-head attention sink, ``softmax_scale = head_dim**-0.5``;
5. inverse RoPE on the output's last ``rope_dim`` dims; grouped low-rank output projection: per group g of heads
   ``u_g = wo_a[g] @ o_g`` (one grouped NVFP4 GEMM over the ``o_groups`` groups), then ``wo_b``.

Weights (``load_weights``) by their official names relative to ``layers.{i}.attn.``; NVFP4 where the checkpoint
holds NVFP4 (an :class:`NVFP4Tensor`), bf16/fp32 tensors otherwise (``megamoe/models/v4_weights.py`` lists which).
Projections that read the same input run as one GEMM over their row-concatenated weights
(:class:`~megamoe.layers.linear.FusedLinear`, outputs split as column views): ``x_proj`` = ``wq_a | wkv``,
``qr_proj`` = ``wq_b | indexer.wq_b`` (CSA), ``comp_proj`` = the float32 ``compressor.wkv | compressor.wgate``
(``| indexer.compressor.wkv | indexer.compressor.wgate`` on CSA layers; bf16 weights in the checkpoint stay bf16 and
run through ``megamoe.ops.gemm.bf16_linear_fp32``: exact products, float32 sums).

Host side (outside graphs): :meth:`join` / :meth:`leave` a request slot, :meth:`prepare` pages before a step,
:meth:`forward_prefill` for a new request. Device side (capturable, sync-free, preallocated):
:meth:`forward_decode` for a fixed-size :class:`~megamoe.kvcache.DecodeBatch`.

Device index errors (``megamoe/ops/errors.py``): the kernels mask out-of-range slots, window ids, entry ids and
page ids and flag them in the device error word. An eager :meth:`forward_decode` / :meth:`forward_prefill` ends
with ``errors.check_errors_eager`` (one host read; raises :class:`~megamoe.ops.errors.DeviceIndexError` naming
the op and argument); it is skipped while a CUDA graph is captured, under ``torch.cuda.set_sync_debug_mode``
(non-zero), and after ``errors.set_eager_checks(False)``. Graph users call ``megamoe.check_errors()`` between
replays.
"""
from __future__ import annotations

import torch

from ..format.tensor import NVFP4Tensor
from ..kvcache import CompressedCacheConfig, CompressedKVCache, DecodeBatch
from ..kvcache import ops as kv_ops
from ..kvcache.cache import check_slot
from ..models.config import V4Config
from ..ops import errors
from ..ops import gemm as gemm_ops
from ..ops._dispatch import resolve_device
from ..ops import v4_elementwise as ew
from ..ops.attention import sparse_mqa_attention
from ..reference import v4_numerics as nx
from .linear import DenseLinear, FusedLinear

#: Block of the FP8 simulation of the window kv and compressed entries (official ``act_quant(..., 64)``).
KV_FP8_BLOCK = ew.KV_FP8_BLOCK
#: Block of the FP4 simulation of the indexer query and keys (official ``fp4_block_size``).
INDEX_FP4_BLOCK = ew.INDEX_FP4_BLOCK


def rope_table(cfg: V4Config, layer: int, device) -> torch.Tensor:
    """The layer's (max_seq_len, rope_dim // 2) complex64 RoPE table: YaRN with compress_rope_theta for compressed
    layers, plain rope_theta for window-only layers (official ``Attention.__init__``)."""
    if cfg.compress_ratios[layer]:
        f = nx.rope_frequencies(cfg.rope_dim, cfg.max_seq_len, base=cfg.compress_rope_theta,
                                original_seq_len=cfg.original_seq_len, factor=cfg.rope_factor,
                                beta_fast=cfg.beta_fast, beta_slow=cfg.beta_slow)
    else:
        f = nx.rope_frequencies(cfg.rope_dim, cfg.max_seq_len, base=cfg.rope_theta)
    return f.to(device)


class Nvfp4Attention:
    """One DeepSeek-V4 attention layer with its caches for up to ``max_slots`` concurrent requests.

    cfg: :class:`V4Config`; layer: layer index (its ``compress_ratios`` entry picks the kind);
    max_batch: the largest decode batch; max_prefill_tokens: the longest prompt one prefill call takes;
    max_slots / max_context: cache geometry (requests, tokens per request); entries_per_block: compressed entries
    per pool page. All of these are Python ints (not bools). device: a ``torch.device`` or a device string.
    """

    def __init__(self, cfg: V4Config, layer: int, *, max_batch: int, max_prefill_tokens: int, max_slots: int,
                 max_context: int, device="cpu", entries_per_block: int = 64):
        if not isinstance(cfg, V4Config):
            raise TypeError(f"cfg: expected a V4Config, got {type(cfg).__name__}")
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < cfg.num_layers:
            raise ValueError(f"layer: expected an int in [0, {cfg.num_layers}), got {layer!r}")
        for name, v in (("max_batch", max_batch), ("max_prefill_tokens", max_prefill_tokens),
                        ("max_slots", max_slots), ("max_context", max_context),
                        ("entries_per_block", entries_per_block)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        if max_context > cfg.max_seq_len:
            raise ValueError(f"max_context: {max_context} exceeds cfg.max_seq_len={cfg.max_seq_len}")
        self.cfg, self.layer, self.device = cfg, layer, resolve_device(device)  # ValueError / TypeError naming it
        self.kind = cfg.layer_kind(layer)
        self.ratio = cfg.compress_ratios[layer]
        self.max_batch, self.max_prefill_tokens = max_batch, max_prefill_tokens
        self.max_slots, self.max_context = max_slots, max_context
        self.softmax_scale = cfg.head_dim ** -0.5
        self.freqs = rope_table(cfg, layer, self.device)
        dev, D, win = self.device, cfg.head_dim, cfg.window_size
        self.cache = None
        self.last_entry_idx = None  # the compressed-entry indices of the last forward (CSA: the indexer's top-k)
        if self.kind == "window":
            self.swa_rows = torch.zeros((max_slots * win + 1, D), dtype=torch.bfloat16, device=dev)
        else:
            kcfg = CompressedCacheConfig(
                kind=self.kind, ratio=self.ratio, head_dim=D, rope_dim=cfg.rope_dim,
                index_head_dim=cfg.index_head_dim, index_n_heads=cfg.index_n_heads, index_topk=cfg.index_topk,
                window_size=win, entries_per_block=entries_per_block, max_slots=max_slots, max_context=max_context)
            self.cache = CompressedKVCache(kcfg, dev)
            self.swa_rows = self.cache.swa_rows
        if self.cache is None:
            nope, rope = cfg.nope_dim, cfg.rope_dim
            self._no_entries = dict(
                entries_fp8=torch.zeros((1, 1, nope), dtype=torch.float8_e4m3fn, device=dev),
                entries_scale=torch.zeros((1, 1, max(nope // KV_FP8_BLOCK, 1)), dtype=torch.float32, device=dev),
                entries_rope=torch.zeros((1, 1, rope), dtype=torch.bfloat16, device=dev),
                block_table=torch.full((1, 1), -1, dtype=torch.int32, device=dev))
            self._no_entry_idx = torch.empty((max(max_batch, max_prefill_tokens), 0), dtype=torch.int32, device=dev)
        self._weights_loaded = False
        self._window_offsets = torch.arange(win, dtype=torch.int32, device=dev)
        if self.kind == "hca":
            self._entry_arange = torch.arange(max(kcfg.max_entries, 1), dtype=torch.int32, device=dev)
        self._group_offsets = torch.arange(1, cfg.o_groups + 1, dtype=torch.int32, device=dev)
        self._group_offsets_by_rows = {}  # T -> group offsets * T (host cache on a shape, made outside graphs)
        errors.error_word(dev)  # the device's error word exists before any graph capture
        self._window_rows_ws = {}  # window-only layers: B -> (B, window) int32 ring rows of a decode step

    # ------------------------------------------------------------------ weights
    def load_weights(self, w) -> None:
        """w: mapping of official names relative to ``layers.{i}.attn.`` -> NVFP4Tensor / tensor (see module doc)."""
        cfg, dev = self.cfg, self.device

        def get(name):
            if name not in w:
                raise ValueError(f"load_weights: missing attention weight {name!r} (layer {self.layer})")
            t = w[name]
            if isinstance(t, torch.Tensor) and t.device != dev:
                t = t.to(dev)
            return t

        def vec(name, n, dtype=torch.float32):
            t = get(name)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (n,):
                raise ValueError(f"{name}: expected a ({n},) tensor, got {getattr(t, 'shape', type(t))}")
            return t.to(dtype).contiguous()

        H, D = cfg.num_heads, cfg.head_dim
        csa = self.kind == "csa"
        # Projections that share an input run as one GEMM over their row-concatenated weights (FusedLinear; the
        # outputs are column views): x -> wq_a | wkv (NVFP4); qr -> wq_b | indexer.wq_b (NVFP4, CSA); x.float()
        # -> the compressor's wkv | wgate | the indexer compressor's wkv | wgate (float32, compressed layers).
        # indexer.weights_proj (bf16, official bf16 linear) stays a separate launch.
        self.x_proj = FusedLinear([("wq_a", get("wq_a.weight")), ("wkv", get("wkv.weight"))])
        self.q_norm = vec("q_norm.weight", cfg.q_lora_rank)
        self.qr_proj = FusedLinear([("wq_b", get("wq_b.weight"))]
                                   + ([("indexer.wq_b", get("indexer.wq_b.weight"))] if csa else []))
        self.kv_norm = vec("kv_norm.weight", D)
        self.attn_sink = vec("attn_sink", H)
        wo_a = get("wo_a.weight")
        group_in = H * D // cfg.o_groups
        if isinstance(wo_a, NVFP4Tensor):
            if tuple(wo_a.shape) != (cfg.o_groups * cfg.o_lora_rank, group_in):
                raise ValueError(f"wo_a.weight: expected shape {(cfg.o_groups * cfg.o_lora_rank, group_in)}, got "
                                 f"{tuple(wo_a.shape)}")
            gs = wo_a.global_scale
            gs = gs.reshape(1, 1, 1) if gs.dim() == 0 else gs.reshape(cfg.o_groups, cfg.o_lora_rank, 1)
            self.wo_a = NVFP4Tensor(wo_a.data.reshape(cfg.o_groups, cfg.o_lora_rank, -1),
                                    wo_a.block_scale.reshape(cfg.o_groups, cfg.o_lora_rank, -1),
                                    gs if gs.dim() == 3 and gs.shape[0] > 1 else gs.reshape(()),
                                    (cfg.o_groups, cfg.o_lora_rank, group_in))
        else:
            self.wo_a = wo_a.to(torch.bfloat16).reshape(cfg.o_groups, cfg.o_lora_rank, group_in).contiguous()
        self.wo_b = DenseLinear(get("wo_b.weight"), name="wo_b")
        self.comp_proj = None
        if self.cache is not None:
            C = 2 if csa else 1
            names = ["compressor.wkv", "compressor.wgate"]
            if csa:
                names += ["indexer.compressor.wkv", "indexer.compressor.wgate"]
            comp = [(n, get(n + ".weight")) for n in names]
            if all(w.dtype == torch.bfloat16 for _, w in comp):
                # float32 projections of bf16 weights: the weights stay bf16 (exact products, float32 sums)
                self.comp_proj = FusedLinear(comp, out_dtype=torch.float32)
            else:
                self.comp_proj = FusedLinear([(n, w.float()) for n, w in comp])
            self.c_ape = get("compressor.ape").float().reshape(self.ratio, C * D).contiguous()
            index_norm = None
            if self.kind == "csa":
                Di = cfg.index_head_dim
                self.i_weights = DenseLinear(get("indexer.weights_proj.weight").to(torch.bfloat16),
                                             name="indexer.weights_proj")
                self.i_ape = get("indexer.compressor.ape").float().reshape(self.ratio, 2 * Di).contiguous()
                index_norm = vec("indexer.compressor.norm.weight", Di)
                self.index_weight_scale = Di ** -0.5 * cfg.index_n_heads ** -0.5
            self.cache.set_post_pool(vec("compressor.norm.weight", D), self.freqs, index_norm)
        # The single projections by their former names: DenseLinears over their rows of the fused weights (views,
        # no extra memory; tests and diagnostics: the forward passes run the fused projections).
        self.wq_a, self.wkv = self.x_proj.part("wq_a"), self.x_proj.part("wkv")
        self.wq_b = self.qr_proj.part("wq_b")
        if csa:
            self.i_wq_b = self.qr_proj.part("indexer.wq_b")
        if self.comp_proj is not None:
            self.c_wkv, self.c_wgate = self.comp_proj.part("compressor.wkv"), self.comp_proj.part("compressor.wgate")
            if csa:
                self.i_wkv = self.comp_proj.part("indexer.compressor.wkv")
                self.i_wgate = self.comp_proj.part("indexer.compressor.wgate")
        self._weights_loaded = True

    # ------------------------------------------------------------------ host side
    def join(self, slot: int) -> None:
        """A new request takes ``slot`` (outside graphs; an int in ``[0, max_slots)``, every layer kind)."""
        self._check_slot(slot)
        if self.cache is not None:
            self.cache.join(slot)

    def leave(self, slot: int) -> None:
        self._check_slot(slot)
        if self.cache is not None:
            self.cache.leave(slot)

    def prepare(self, slots, positions_before, positions_after) -> None:
        """Allocate the pool pages a step will write (outside graphs)."""
        if self.cache is not None:
            self.cache.prepare_forward(slots, positions_before, positions_after)

    # ------------------------------------------------------------------ shared per-token math
    # The elementwise steps are the fused ops of ``megamoe.ops.v4_elementwise`` (one launch each on CUDA; the
    # PyTorch formulas ``*_reference`` there on the CPU).
    def _q_and_kv(self, x: torch.Tensor, pos: torch.Tensor):
        """x (T, dim) bf16, pos (T,) int -> (q (T, H, D) bf16, kv (T, D) bf16, iq (T, index_n_heads *
        index_head_dim) bf16 ``indexer.wq_b(qr)`` on CSA layers, else None).

        ``qr = q_norm(wq_a(x))``; q: official bf16 per-head norm + RoPE; kv: kv_norm + RoPE + FP8 simulation of
        the non-RoPE dims (64-blocks). Two GEMMs: ``wq_a | wkv`` on x, ``wq_b | indexer.wq_b`` on qr."""
        cfg = self.cfg
        qa, kv = self.x_proj(x)
        qr = ew.rms_norm(qa, self.q_norm, cfg.norm_eps)
        qb, *iq = self.qr_proj(qr)
        q, kv = ew.q_kv_path(qb, kv, self.kv_norm, self.freqs, pos, num_heads=cfg.num_heads, eps=cfg.norm_eps)
        return q, kv, (iq[0] if iq else None)

    def _compressor_inputs(self, x: torch.Tensor, pos: torch.Tensor, add_ape: bool = True):
        """Float32 compressor projections with ``ape`` added to the gate scores (``add_ape=False``: without it; the
        decode step adds it inside the compressor kernel). One float32 GEMM for the two (HCA) or four (CSA)
        projections; the outputs are column views of its output."""
        kv, score, *index = self.comp_proj(x)  # bf16 x: float32 results (DenseLinear: x.float() for float32 weights)
        ikv, iscore = index if index else (None, None)
        if add_ape:
            phase = torch.remainder(pos.long(), self.ratio)
            score = score + self.c_ape[phase]
            if iscore is not None:
                iscore = iscore + self.i_ape[phase]
        return kv, score, ikv, iscore

    def _index_query(self, x: torch.Tensor, iq: torch.Tensor, pos: torch.Tensor):
        """iq: ``indexer.wq_b(qr)`` (from :meth:`_q_and_kv`) -> indexer query (T, n_heads, Di) bf16 (RoPE, Hadamard,
        FP4 simulated) and weights (T, n_heads) float32."""
        return ew.index_q_path(iq, self.i_weights(x), self.freqs, pos, n_heads=self.cfg.index_n_heads,
                               weight_scale=self.index_weight_scale)

    def _output(self, o: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """o (T, H, D) bf16 -> inverse RoPE -> grouped wo_a -> wo_b -> (T, dim) bf16."""
        cfg = self.cfg
        T, G, R = o.shape[0], cfg.o_groups, cfg.o_lora_rank
        width = o.shape[1] * o.shape[2] // G  # explicit widths (no -1): T = 0 works too
        grouped = ew.output_path(o, self.freqs, pos, groups=G).view(G * T, width)  # rows sorted by group
        if isinstance(self.wo_a, NVFP4Tensor):
            u = gemm_ops.nvfp4_grouped_mm(grouped, self.wo_a, self._group_row_offsets(T))
        else:
            u = torch.bmm(grouped.view(G, T, width), self.wo_a.transpose(1, 2)).reshape(G * T, R)
        u = u.view(G, T, R).transpose(0, 1).reshape(T, G * R)
        return self.wo_b(u)

    def _group_row_offsets(self, T: int) -> torch.Tensor:
        """(G,) int32 cumulative row counts ``(g + 1) * T`` of the grouped ``wo_a`` GEMM (cached per T, outside
        graph capture; inside a capture a new tensor from the graph's pool)."""
        offs = self._group_offsets_by_rows.get(T)
        if offs is None:
            offs = self._group_offsets * T
            if not (offs.is_cuda and torch.cuda.is_current_stream_capturing()):
                self._group_offsets_by_rows[T] = offs
        return offs

    def _hca_entries(self, n_entries: torch.Tensor) -> torch.Tensor:
        idx = self._entry_arange[None, :].expand(n_entries.shape[0], -1)
        return torch.where(idx < n_entries[:, None], idx, torch.full_like(idx, -1))

    def _attend(self, q, slots, pos, window_kv, window_idx, entry_idx):
        if self.cache is None:  # window-only layer: an empty one-entry pool, no entries selected
            entries = self._no_entries
            entry_idx = self._no_entry_idx[: q.shape[0]]
        else:
            pool = self.cache.pool
            entries = dict(entries_fp8=pool.entries_fp8, entries_scale=pool.entries_scale,
                           entries_rope=pool.entries_rope, block_table=self.cache.block_table)
        o = sparse_mqa_attention(q, self.attn_sink, self.softmax_scale, window_kv=window_kv, window_idx=window_idx,
                                 slots=slots, entry_idx=entry_idx, **entries)
        return self._output(o, pos)

    # ------------------------------------------------------------------ argument checks (host metadata only)
    def _check_slot(self, slot) -> None:
        """Every layer kind checks the slot before any write (the cache's rule, ``kvcache.cache.check_slot``)."""
        check_slot(slot, self.max_slots)

    def _check_x(self, x, rows: int | None = None) -> None:
        """x: a (T, hidden_size) bf16 tensor on the layer's device (``rows``: T must equal it)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
        if x.dtype != torch.bfloat16:
            raise TypeError(f"x: expected dtype torch.bfloat16, got {x.dtype}")
        H = self.cfg.hidden_size
        if x.dim() != 2 or x.shape[1] != H or (rows is not None and x.shape[0] != rows):
            want = f"({'T' if rows is None else rows}, {H})"
            raise ValueError(f"x: expected shape {want}, got {tuple(x.shape)}")
        if x.device != self.device:
            raise ValueError(f"x: expected device {self.device}, got {x.device}")

    # ------------------------------------------------------------------ decode (device, capturable)
    def forward_decode(self, batch: DecodeBatch, x: torch.Tensor) -> torch.Tensor:
        """x (B, dim) bf16, one new token per row of ``batch`` -> (B, dim) bf16. Inactive rows are no-ops for the
        caches; their outputs are unspecified. Eager calls end with the error-word check (module docstring).
        ``batch`` must be a :class:`DecodeBatch` and x a bf16 tensor of that batch size (TypeError / ValueError
        otherwise; no cast)."""
        if not self._weights_loaded:
            raise RuntimeError("Nvfp4Attention: call load_weights() first")
        if not isinstance(batch, DecodeBatch):
            raise TypeError(f"batch: expected a DecodeBatch, got {type(batch).__name__}")
        self._check_x(x, batch.slots.shape[0] if isinstance(batch.slots, torch.Tensor) else None)
        pos, slots = batch.positions, batch.slots
        q, kv, iq_raw = self._q_and_kv(x, pos)
        entry_idx = None
        # SWA append, window ring rows (and entry counts / the HCA entry list): one window_step launch per layer
        if self.cache is None:
            window_rows = self._window_rows_ws.get(x.shape[0])
            if window_rows is None:  # host decision on a shape (first call of a batch size, outside graphs)
                window_rows = self._window_rows_ws[x.shape[0]] = torch.full(
                    (x.shape[0], self.cfg.window_size), -1, dtype=torch.int32, device=self.device)
            kv_ops.window_step(self.swa_rows, self.cfg.window_size, kv, slots, pos, batch.active, window_rows)
        else:
            ckv, cscore, ikv, iscore = self._compressor_inputs(x, pos, add_ape=False)
            iq = iw = None
            if self.kind == "csa":
                iq, iw = self._index_query(x, iq_raw, pos)
            if x.shape[0] not in self.cache.workspaces:  # host decision on a shape (first call of a batch size)
                self.cache.allocate_workspace(x.shape[0])
            topk = self.cache.decode_step(batch, ckv, cscore, kv, ikv, iscore, iq, iw, ape=self.c_ape,
                                          index_ape=self.i_ape if self.kind == "csa" else None)
            ws = self.cache.workspace
            window_rows = ws["window_rows"]
            entry_idx = topk if self.kind == "csa" else ws["entry_idx"]
        self.last_entry_idx = entry_idx  # a reference only (V4Model's decision recording reads it; no device op)
        out = self._attend(q, slots, pos, self.swa_rows, window_rows, entry_idx)
        errors.check_errors_eager(self.device)  # eager only (no-op while capturing / sync-debugging)
        return out

    # ------------------------------------------------------------------ prefill (host-driven)
    def forward_prefill(self, slot: int, x: torch.Tensor) -> torch.Tensor:
        """A new request's prompt: x (T, dim) bf16 for positions 0..T-1 of ``slot`` (already joined, pages
        prepared for T tokens) -> (T, dim) bf16. Fills the window ring, the pool and the compressor tails so
        that decoding continues at position T. ``slot``: an int (not a bool) in ``[0, max_slots)`` and x a bf16
        tensor (ValueError / TypeError otherwise, before anything is written)."""
        if not self._weights_loaded:
            raise RuntimeError("Nvfp4Attention: call load_weights() first")
        self._check_slot(slot)
        self._check_x(x)
        T, dev, win = x.shape[0], x.device, self.cfg.window_size
        if T > self.max_prefill_tokens:
            raise ValueError(f"x: {T} prompt tokens exceed max_prefill_tokens={self.max_prefill_tokens}")
        pos = torch.arange(T, dtype=torch.int32, device=dev)
        slots = torch.full((T,), slot, dtype=torch.int32, device=dev)
        q, kv, iq_raw = self._q_and_kv(x, pos)
        # the prompt's own rows are the window source (official prefill attends to the fresh kv)
        j = pos[:, None] - self._window_offsets[None, :]
        window_idx = torch.where(j >= 0, j, torch.full_like(j, -1))
        entry_idx = None
        if self.cache is None:
            keep = pos[max(0, T - win):]
            self.swa_rows[slot * win + torch.remainder(keep, win).long()] = kv[max(0, T - win):]
        else:
            ckv, cscore, ikv, iscore = self._compressor_inputs(x, pos)
            self.cache.prefill(slot, ckv, cscore, kv, ikv, iscore)
            n = torch.div(pos + 1, self.ratio, rounding_mode="floor").to(torch.int32)
            if self.kind == "csa":
                iq, iw = self._index_query(x, iq_raw, pos)
                c = self.cache.config
                scores = torch.full((T, max(c.max_entries, 1)), float("-inf"), dtype=torch.float32, device=dev)
                kv_ops.indexer_scores(self.cache.pool, self.cache.block_table, iq, iw, slots, n, scores)
                entry_idx = kv_ops.select_topk(scores, c.index_topk)
            else:
                entry_idx = self._hca_entries(n)
        self.last_entry_idx = entry_idx
        out = self._attend(q, slots, pos, kv, window_idx.to(torch.int32), entry_idx)
        errors.check_errors_eager(self.device)
        return out

    def weight_bytes(self) -> int:
        """Device bytes of the layer's projection weights: the fused projections (their global scales included),
        wo_a, wo_b and, on compressed layers, the compressor (and indexer) projections."""
        parts = [self.x_proj, self.qr_proj, self.wo_b, self.comp_proj, getattr(self, "i_weights", None)]
        total = sum(p.nbytes() for p in parts if p is not None)
        total += self.wo_a.nbytes() if isinstance(self.wo_a, NVFP4Tensor) else self.wo_a.numel() * 2
        return total
