"""Device tensors of the compressed cache: compressor tail state, paged pool, SWA window.

Everything here is allocated once (sized from a :class:`CompressedCacheConfig`) and then mutated in
place by the kernels, so a captured CUDA graph keeps valid pointers for the life of the cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import CompressedCacheConfig


@dataclass
class CompressorState:
    """Tail of not-yet-compressed tokens, one row per request slot (float32 like the official code).

    ``width`` is the pooled width D (head_dim for the main compressor, index_head_dim for the indexer's).

    tail_k, tail_z: (S, m, C * D) float32, the a-stream (current window): the projected kv and the gate
        score of token ``pos`` sit in row ``pos % m``. With ``overlap`` (CSA, C = 2) columns ``[:D]`` hold
        the overlap projection (used by the *next* entry) and ``[D:]`` the main projection; C = 1 for HCA.
    tail_kb, tail_zb: (S, m, D) float32, the b-stream (previous window's overlap half); CSA only, else None.
    tail_len: (S,) int32, tokens currently in the a-stream.
    Empty slots hold k = 0 and z = -inf, so they get zero softmax weight (this is also the first-flush
    mask of the b-stream).
    """

    tail_k: torch.Tensor
    tail_z: torch.Tensor
    tail_kb: torch.Tensor | None
    tail_zb: torch.Tensor | None
    tail_len: torch.Tensor
    ratio: int
    width: int
    overlap: bool

    @classmethod
    def allocate(cls, max_slots: int, ratio: int, width: int, overlap: bool, device) -> "CompressorState":
        cols = (2 if overlap else 1) * width
        tail_k = torch.zeros((max_slots, ratio, cols), dtype=torch.float32, device=device)
        tail_z = torch.full((max_slots, ratio, cols), float("-inf"), dtype=torch.float32, device=device)
        tail_kb = tail_zb = None
        if overlap:
            tail_kb = torch.zeros((max_slots, ratio, width), dtype=torch.float32, device=device)
            tail_zb = torch.full((max_slots, ratio, width), float("-inf"), dtype=torch.float32, device=device)
        tail_len = torch.zeros((max_slots,), dtype=torch.int32, device=device)
        return cls(tail_k, tail_z, tail_kb, tail_zb, tail_len, ratio, width, overlap)

    @property
    def cols(self) -> int:
        return self.tail_k.shape[-1]

    def reset_slot(self, slot: int) -> None:
        """Empty one request's tails (outside the graph, when a request joins)."""
        self.tail_k[slot].zero_()
        self.tail_z[slot].fill_(float("-inf"))
        if self.overlap:
            self.tail_kb[slot].zero_()
            self.tail_zb[slot].fill_(float("-inf"))
        self.tail_len[slot].zero_()

    def clone(self) -> "CompressorState":
        c = lambda t: None if t is None else t.clone()  # noqa: E731
        return CompressorState(c(self.tail_k), c(self.tail_z), c(self.tail_kb), c(self.tail_zb),
                               c(self.tail_len), self.ratio, self.width, self.overlap)


@dataclass
class PagedPool:
    """Paged storage of compressed entries: page ``p``, slot ``e`` holds one entry.

    The attention kernel reads the first four as raw tensors (names and layouts are an interface):

    entries_fp8: (num_blocks, epb, nope) float8_e4m3fn, the non-RoPE dims divided by their block scale.
    entries_scale: (num_blocks, epb, nope // SB) float32; SB = 64 with ``entry_numerics="official"``
        (power-of-two scales, the official ``act_quant``), SB = nope (one ``amax / 448`` scale, shape
        (num_blocks, epb, 1)) with ``"per_entry"``. Value of dim ``j``: ``float(fp8[j]) * scale[j // SB]``.
    entries_rope: (num_blocks, epb, rope_dim) bfloat16, the RoPE dims as written.
    index_keys: (num_blocks, epb, index_head_dim // 2) uint8 E2M1 codes, low nibble = even element (CSA).
    index_key_scale (CSA): official: (num_blocks, epb, index_head_dim // 32) uint8 E8M0 (power-of-two
        scale ``2 ** (byte - 127)``, 0xFF = NaN); nvfp4: (num_blocks, epb, index_head_dim // 16)
        float8_e4m3fn block scales, global scale 1.0.
    """

    entries_fp8: torch.Tensor
    entries_scale: torch.Tensor
    entries_rope: torch.Tensor
    index_keys: torch.Tensor | None
    index_key_scale: torch.Tensor | None
    entry_numerics: str = "official"
    index_numerics: str = "official"

    @classmethod
    def allocate(cls, config: CompressedCacheConfig, device) -> "PagedPool":
        nb, epb = config.num_blocks, config.entries_per_block
        fp8 = torch.zeros((nb, epb, config.nope_dim), dtype=torch.float8_e4m3fn, device=device)
        scale = torch.zeros((nb, epb, config.entry_scale_cols), dtype=torch.float32, device=device)
        rope = torch.zeros((nb, epb, config.rope_dim), dtype=torch.bfloat16, device=device)
        keys = key_scale = None
        if config.has_indexer:
            keys = torch.zeros((nb, epb, config.index_head_dim // 2), dtype=torch.uint8, device=device)
            scale_dtype = torch.uint8 if config.index_numerics == "official" else torch.float8_e4m3fn
            key_scale = torch.zeros((nb, epb, config.index_scale_cols), dtype=scale_dtype, device=device)
        return cls(fp8, scale, rope, keys, key_scale, config.entry_numerics, config.index_numerics)

    @property
    def entries_per_block(self) -> int:
        return self.entries_fp8.shape[1]

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.entries_fp8, self.entries_scale, self.entries_rope, self.index_keys,
                            self.index_key_scale) if t is not None]

    def map(self, fn) -> "PagedPool":
        """A pool of ``fn(tensor)`` for every tensor (e.g. ``.clone()``, ``.cpu()``), same numerics."""
        c = lambda t: None if t is None else fn(t)  # noqa: E731
        return PagedPool(c(self.entries_fp8), c(self.entries_scale), c(self.entries_rope), c(self.index_keys),
                         c(self.index_key_scale), self.entry_numerics, self.index_numerics)

    def clone(self) -> "PagedPool":
        return self.map(torch.clone)
