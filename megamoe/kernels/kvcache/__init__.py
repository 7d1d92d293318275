"""Compressed KV-cache kernels: compressor step, flush (quantize + write), entry gather and indexer
scores. Public entry points live in ``megamoe.kvcache.ops``."""
