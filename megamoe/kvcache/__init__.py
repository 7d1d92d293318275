"""DeepSeek-V4 compressed attention cache (CSA / HCA compressors, paged FP8 pool, FP4 indexer keys, SWA).

See ``config.py`` for every constant, its source and the storage numerics (official by default),
``cache.py`` for the host/device split (``set_post_pool`` / ``join`` / ``prepare_forward`` / ``prefill``
outside the graph, ``decode_step`` inside), ``ops.py`` for the functional steps.
"""
from .cache import BlockAllocator, CompressedKVCache, DecodeBatch  # noqa: F401
from .config import CompressedCacheConfig  # noqa: F401
from .ops import (  # noqa: F401
    compressor_step,
    flush_write,
    gather_entries,
    indexer_scores,
    select_topk,
    swa_append,
)
from .state import CompressorState, PagedPool  # noqa: F401
