"""Paged kernel path vs the float32 reference decode simulation, step by step (see megamoe/kvcache/simulate.py):
prefills of random (mostly non-multiple-of-ratio) lengths, post-pool steps on, both numerics."""
import pytest
import torch

from megamoe.kvcache import CompressedCacheConfig
from megamoe.kvcache.simulate import run_side_by_side
from megamoe.kvcache.config import V4_CSA_RATIO, V4_HCA_RATIO

SMALL = dict(head_dim=144, rope_dim=16, index_head_dim=64, index_n_heads=16, index_topk=8, window_size=8,
             entries_per_block=4, max_context=128)


@pytest.mark.parametrize("kind,ratio,numerics", [
    ("csa", 4, ("official", "official")),
    ("csa", 4, ("per_entry", "nvfp4")),
    ("hca", 8, ("official", "official")),
])
def test_side_by_side_small(kind, ratio, numerics, device):
    cfg = CompressedCacheConfig(kind=kind, ratio=ratio, max_slots=3, entry_numerics=numerics[0],
                                index_numerics=numerics[1], **SMALL)
    steps = 32
    # the request schedule is random: a fresh seed per run, and up to 3 runs until it has covered a leave and the
    # other events (one 32-step schedule without a leave made this test flaky); every run is checked in full
    covered = dict(flushes=0, joins=0, leaves=0, prefills=0, prefill_entries=0)
    for _ in range(3):
        stats = run_side_by_side(cfg, steps=steps, batch=3, device=device, seed=int(torch.randint(0, 2**30, ())))
        assert stats["entries_exact"] >= 0.8 * stats["entries_checked"]
        if kind == "csa":
            assert stats["topk_checked"] >= steps
            assert stats["topk_near_tie_swaps"] <= 2
            assert stats["keys_exact"] >= 0.8 * stats["keys_checked"]
        covered = {k: v + stats[k] for k, v in covered.items()}
        if covered["leaves"] >= 1 and covered["flushes"] >= 5 and covered["joins"] >= 3 and \
                covered["prefills"] >= 2 and covered["prefill_entries"] >= 2:
            break
    assert covered["flushes"] >= 5 and covered["joins"] >= 3 and covered["leaves"] >= 1, covered
    assert covered["prefills"] >= 2 and covered["prefill_entries"] >= 2, covered


@pytest.mark.cuda
@pytest.mark.parametrize("kind,ratio,numerics", [
    ("csa", V4_CSA_RATIO, ("official", "official")),
    ("csa", V4_CSA_RATIO, ("per_entry", "nvfp4")),
    ("hca", V4_HCA_RATIO, ("official", "official")),
])
def test_side_by_side_full_size_cuda_graph(kind, ratio, numerics):
    """Full DeepSeek-V4 dims, several hundred steps, prefills, the step replayed from one CUDA graph == eager,
    eager step under sync-debug 'error'."""
    # index_topk 64 (V4: 512) so the selection is a real choice among the few hundred entries simulated
    cfg = CompressedCacheConfig(kind=kind, ratio=ratio, max_slots=8, entries_per_block=64, max_context=8192,
                                index_topk=64, entry_numerics=numerics[0], index_numerics=numerics[1])
    stats = run_side_by_side(cfg, steps=300, batch=8, device="cuda", seed=1234, graph=True, check_every=10,
                             max_prompt=3 * ratio if kind == "hca" else 200)
    print(stats)
    assert stats["steps"] == 300 and stats["flushes"] >= 8 and stats["prefill_entries"] >= 8
    assert stats["topk_near_tie_swaps"] <= max(2, stats["topk_checked"] // 100)


def test_side_by_side_reference_dispatch(monkeypatch):
    """CPU without the interpreter: the ops dispatch to the PyTorch references (plumbing check)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cfg = CompressedCacheConfig(kind="csa", ratio=4, max_slots=2, **SMALL)
    stats = run_side_by_side(cfg, steps=16, batch=2, device="cpu", seed=7)
    assert stats["flushes"] >= 2
