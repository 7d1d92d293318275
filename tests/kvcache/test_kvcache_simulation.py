"""Paged kernel path vs the float32 reference decode simulation, step by step (see megamoe/kvcache/simulate.py)."""
import pytest
import torch

from megamoe.kvcache import CompressedCacheConfig
from megamoe.kvcache.simulate import run_side_by_side
from megamoe.kvcache.config import V4_CSA_RATIO, V4_HCA_RATIO

SMALL = dict(head_dim=64, rope_dim=16, index_head_dim=32, index_n_heads=16, index_topk=8, window_size=8,
             entries_per_block=4, max_context=512)


@pytest.mark.parametrize("kind,ratio,steps", [("csa", 4, 40), ("hca", 8, 40)])
def test_side_by_side_small(kind, ratio, steps, device):
    cfg = CompressedCacheConfig(kind=kind, ratio=ratio, max_slots=3, **SMALL)
    stats = run_side_by_side(cfg, steps=steps, batch=3, device=device, seed=int(torch.randint(0, 2**30, ())))
    assert stats["flushes"] >= 5 and stats["joins"] >= 3 and stats["leaves"] >= 1
    if kind == "csa":
        assert stats["topk_checked"] >= steps
        assert stats["topk_near_tie_swaps"] <= 2


@pytest.mark.cuda
@pytest.mark.parametrize("kind,ratio", [("csa", V4_CSA_RATIO), ("hca", V4_HCA_RATIO)])
def test_side_by_side_full_size_cuda_graph(kind, ratio):
    """Full DeepSeek-V4 dims, several hundred steps, the step replayed from one CUDA graph == eager,
    eager step under sync-debug 'error'."""
    # index_topk 64 (V4: 512) so the selection is a real choice among the few hundred entries simulated
    cfg = CompressedCacheConfig(kind=kind, ratio=ratio, max_slots=8, entries_per_block=64, max_context=8192,
                                index_topk=64)
    stats = run_side_by_side(cfg, steps=300, batch=8, device="cuda", seed=1234, graph=True, check_every=10)
    print(stats)
    assert stats["steps"] == 300 and stats["flushes"] >= 8
    assert stats["topk_near_tie_swaps"] <= max(2, stats["topk_checked"] // 100)


def test_side_by_side_reference_dispatch(monkeypatch):
    """CPU without the interpreter: the ops dispatch to the PyTorch references (plumbing check)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cfg = CompressedCacheConfig(kind="csa", ratio=4, max_slots=2, **SMALL)
    stats = run_side_by_side(cfg, steps=16, batch=2, device="cpu", seed=7)
    assert stats["flushes"] >= 2
