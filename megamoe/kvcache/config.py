"""Configuration of the DeepSeek-V4 compressed attention cache.

Constants and where each one comes from
---------------------------------------

=========================  =========  ===================================================================
constant                   value      source
=========================  =========  ===================================================================
``head_dim``               512        DeepSeek-V4-Flash / -Pro ``config.json`` ("head_dim": 512), quoted in
                                      public repos (find_string ``"index_topk": 512`` hits, e.g. a V4-Flash
                                      config dump and an sglang DSV4 pool-configurator test); seed file 004
                                      (head_dim loop over 512).
``rope_dim``               64         ``qk_rope_head_dim`` = 64 in the same configs; the sglang DSV4 test
                                      uses ``qk_nope_head_dim=448, qk_rope_head_dim=64``.
``index_head_dim``         128        ``index_head_dim`` = 128 (same configs); seed file 004
                                      ("indexer_head_dim=128").
``index_n_heads``          64         ``index_n_heads`` = 64 (V4-Flash and V4-Pro configs).
``index_topk``             512        ``index_topk`` = 512 (V4-Flash); 1024 for V4-Pro.
``csa_ratio`` (m, CSA)     4          ``compress_ratios`` entries 4 (CSA, with indexer) in the configs;
                                      DeepSeek-V4 ``inference/model.py`` ``Compressor``: ``overlap =
                                      compress_ratio == 4``; seed file 004 (tail_a = tail_b = 4).
``hca_ratio`` (m, HCA)     128        ``compress_ratios`` entries 128 (no indexer: ``Indexer`` only when
                                      ratio == 4 in ``Attention.__init__``); seed file 004 (tail_a=128).
``window_size``            128        ``sliding_window`` = 128 (configs); ``window_size=128`` (sglang test).
FP8 entry scale            2**k / 64  official ``Compressor.forward``: ``act_quant(kv[..., :-rd], 64, scale_fmt, ...)``
                                      with ue8m0 (power-of-two) scales, one per 64 non-RoPE dims (kernel
                                      ``act_quant``, see ``/work/plan/NUMERICS.md``). Default
                                      ``entry_numerics="official"``; ``"per_entry"`` keeps seed file 004's
                                      one ``amax / 448`` float32 scale per entry.
indexer key FP4            2**k / 32  official ``Compressor`` with ``rotate=True``: Hadamard rotation then
                                      ``fp4_act_quant(kv, 32, True)`` (power-of-two scale per 32 dims).
                                      Default ``index_numerics="official"`` (E2M1 codes + one E8M0 byte per
                                      32 dims); ``"nvfp4"`` keeps NVFP4 (E4M3 scale per 16, global 1.0).
post-pool steps            --         official ``Compressor.forward`` after pooling: ``kv.to(bf16)`` ->
                                      ``RMSNorm(head_dim)`` -> RoPE of the last ``rope_dim`` dims at the
                                      window's first position ``pos + 1 - m`` (the compressed layers' YaRN
                                      table) -> (indexer only) Hadamard rotation -> FP8/FP4 simulation.
``norm_eps``               1e-6       ``ModelArgs.norm_eps`` (the compressors' ``RMSNorm``).
b-stream first-flush mask  -inf       official ``Compressor``: ``score_state`` initialised to ``-inf``,
                                      ``kv_state`` to 0; seed file 004 uses -1e9 (same effect).
pooling                    softmax    official ``Compressor.forward`` decode branch: per-feature softmax of
                                      the gate scores over the 2m (CSA: m previous-window slots of the
                                      *overlap* projection half ``[:d]`` + m current slots of the main half
                                      ``[d:]``) or m (HCA) tail slots; the scores already include ``ape``.
indexer formula            ReLU       official ``Indexer.forward``: ``score[t] = sum_h w_h * relu(q_h . k_t)``
                                      with ``w = weights_proj(x) * softmax_scale * n_heads**-0.5``; same
                                      form as DeepSeek-V3.2's lightning indexer. Top-k over the first
                                      ``(pos + 1) // m`` entries.
=========================  =========  ===================================================================

The "official code" above is DeepSeek-V4's ``inference/model.py`` as reproduced in public ports found with
the search tool (``find_string "def overlap_transform"``). The post-pool steps run inside the cache
(:meth:`CompressedKVCache.set_post_pool` gives it the norm weights and the RoPE table).

Choices of this package (not in the sources)
--------------------------------------------
* ``index_numerics="nvfp4"``: keys are NVFP4 with a **fixed global scale of 1.0**: a block's scale is
  ``e4m3(min(block_amax / 6, 448))``, so keys with |k| up to 6 * 448 = 2688 are represented and blocks whose
  amax is below ~2**-10 * 6 quantize to zero (semantics of ``megamoe.reference.quantize.quantize(x,
  global_scale=1.0)``).
* ``index_numerics="official"``: a block with any NaN/Inf stores scale byte 0xFF (E8M0 NaN) and codes 0. The
  indexer kernel applies the scale after a per-block dot, so every finite scale is exact.
* ``entry_numerics="per_entry"``: ``scale = amax / 448`` (float32, amax over the non-RoPE dims); an all-zero
  entry stores ``scale = 0`` and FP8 zeros (signed as the input); an entry with any NaN/Inf in its non-RoPE
  dims stores ``scale = NaN`` and FP8 bytes 0, so it dequantizes to NaN.
* ``entry_numerics="official"``: per 64-dim block, the official ``act_quant`` (``scale =
  pow2ceil(max(amax, 1e-4) / 448)``); a block with any NaN/Inf stores scale NaN and bytes 0. The RoPE dims are
  copied bit for bit in both modes.
* Device-valued indices out of range (slot outside ``[0, max_slots)``, negative position, page id outside the
  pool) make a row a no-op in every kernel and reference (reads give zeros / ``-inf`` scores).
* Top-k tie-break: higher score first, **lower entry index first among equal scores** (stable sort); slots
  past a request's entry count score ``-inf`` and are returned as index ``-1``.
"""
from __future__ import annotations

from dataclasses import dataclass

#: Values of DeepSeek-V4-Flash (see the table above).
V4_HEAD_DIM = 512
V4_ROPE_DIM = 64
V4_INDEX_HEAD_DIM = 128
V4_INDEX_N_HEADS = 64
V4_INDEX_TOPK = 512
V4_CSA_RATIO = 4
V4_HCA_RATIO = 128
V4_WINDOW_SIZE = 128

#: FP8 E4M3 largest finite value, the divisor of the per-entry scale.
FP8_MAX = 448.0

#: NVFP4 global scale of the indexer keys (fixed, not stored; ``index_numerics="nvfp4"``).
INDEX_KEY_GLOBAL_SCALE = 1.0

#: Non-RoPE dims per FP8 scale of an entry (official ``act_quant(kv[..., :-rd], 64)``).
ENTRY_SCALE_BLOCK = 64

#: Key dims per E8M0 scale of an indexer key (official ``fp4_act_quant(kv, 32)``).
INDEX_SCALE_BLOCK = 32

#: Key dims per E4M3 scale of an NVFP4 indexer key (``index_numerics="nvfp4"``).
NVFP4_SCALE_BLOCK = 16

#: RMSNorm epsilon of the compressors (``ModelArgs.norm_eps``).
V4_NORM_EPS = 1e-6

ENTRY_NUMERICS = ("official", "per_entry")
INDEX_NUMERICS = ("official", "nvfp4")


def _check_positive(name: str, value) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


@dataclass(frozen=True)
class CompressedCacheConfig:
    """Geometry of one layer kind's compressed cache (CSA or HCA) and its SWA window.

    kind: ``"csa"`` (ratio 4, overlapping a/b streams, NVFP4 indexer keys) or ``"hca"`` (ratio 128,
        a-stream only, no indexer).
    ratio: tokens per compressed entry (m). Defaults: 4 for CSA, 128 for HCA.
    head_dim / rope_dim: entry width; the last ``rope_dim`` dims are stored bf16, the rest FP8.
    index_head_dim / index_n_heads / index_topk: indexer geometry (CSA only).
    window_size: tokens kept by the sliding-window cache.
    entries_per_block: compressed entries per page of the paged pool.
    max_slots: concurrent requests (rows of the compressor state, block table and SWA cache).
    max_context: longest request in tokens; sizes the block table.
    num_blocks: pages in the pool; default ``max_slots * max_logical_blocks`` (never runs out).
    entry_numerics: ``"official"`` (FP8 E4M3 + float32 power-of-two scale per 64 non-RoPE dims, the
        official ``act_quant`` bit for bit) or ``"per_entry"`` (one ``amax / 448`` scale per entry).
    index_numerics: ``"official"`` (E2M1 + E8M0 scale per 32 dims, the official ``fp4_act_quant`` bit for
        bit) or ``"nvfp4"`` (E2M1 + E4M3 scale per 16 dims, global scale 1.0).
    norm_eps: epsilon of the post-pool RMSNorm.
    """

    kind: str = "csa"
    ratio: int | None = None
    head_dim: int = V4_HEAD_DIM
    rope_dim: int = V4_ROPE_DIM
    index_head_dim: int = V4_INDEX_HEAD_DIM
    index_n_heads: int = V4_INDEX_N_HEADS
    index_topk: int = V4_INDEX_TOPK
    window_size: int = V4_WINDOW_SIZE
    entries_per_block: int = 64
    max_slots: int = 8
    max_context: int = 8192
    num_blocks: int | None = None
    entry_numerics: str = "official"
    index_numerics: str = "official"
    norm_eps: float = V4_NORM_EPS

    def __post_init__(self):
        if self.kind not in ("csa", "hca"):
            raise ValueError(f"kind: expected 'csa' or 'hca', got {self.kind!r}")
        if self.ratio is None:
            object.__setattr__(self, "ratio", V4_CSA_RATIO if self.kind == "csa" else V4_HCA_RATIO)
        for name in ("ratio", "head_dim", "rope_dim", "index_head_dim", "index_n_heads", "index_topk",
                     "window_size", "entries_per_block", "max_slots", "max_context"):
            _check_positive(name, getattr(self, name))
        if self.rope_dim >= self.head_dim:
            raise ValueError(f"rope_dim: expected < head_dim={self.head_dim}, got {self.rope_dim}")
        if self.rope_dim % 2 or self.head_dim % 2:
            raise ValueError("head_dim and rope_dim must be even")
        if self.index_head_dim % 32:
            raise ValueError(f"index_head_dim: expected a multiple of 32, got {self.index_head_dim}")
        if self.entry_numerics not in ENTRY_NUMERICS:
            raise ValueError(f"entry_numerics: expected one of {ENTRY_NUMERICS}, got {self.entry_numerics!r}")
        if self.index_numerics not in INDEX_NUMERICS:
            raise ValueError(f"index_numerics: expected one of {INDEX_NUMERICS}, got {self.index_numerics!r}")
        if self.entry_numerics == "official" and self.nope_dim % ENTRY_SCALE_BLOCK:
            raise ValueError(f"head_dim - rope_dim: expected a multiple of {ENTRY_SCALE_BLOCK} with "
                             f"entry_numerics='official', got {self.nope_dim}")
        if not (isinstance(self.norm_eps, float) and self.norm_eps > 0):
            raise ValueError(f"norm_eps: expected a positive float, got {self.norm_eps!r}")
        if self.num_blocks is not None:
            _check_positive("num_blocks", self.num_blocks)
        else:
            object.__setattr__(self, "num_blocks", self.max_slots * self.max_logical_blocks)

    @property
    def has_indexer(self) -> bool:
        return self.kind == "csa"

    @property
    def overlap(self) -> bool:
        """CSA pools the previous window's overlap half too (b-stream)."""
        return self.kind == "csa"

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim

    @property
    def entry_scale_cols(self) -> int:
        """float32 scales per entry: ``nope_dim // 64`` (official) or 1 (per_entry)."""
        return self.nope_dim // ENTRY_SCALE_BLOCK if self.entry_numerics == "official" else 1

    @property
    def index_scale_cols(self) -> int:
        """Scale bytes per indexer key: ``index_head_dim // 32`` (official E8M0) or ``// 16`` (NVFP4 E4M3)."""
        block = INDEX_SCALE_BLOCK if self.index_numerics == "official" else NVFP4_SCALE_BLOCK
        return self.index_head_dim // block

    @property
    def max_entries(self) -> int:
        """Compressed entries of a request of ``max_context`` tokens."""
        return self.max_context // self.ratio

    @property
    def max_logical_blocks(self) -> int:
        return -(-max(self.max_entries, 1) // self.entries_per_block)
