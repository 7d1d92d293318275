"""ExpertParallelMoE on CPU (gloo, 2 and 4 spawned ranks) vs the single-process Nvfp4MoE, bit for bit.

Each launch runs several scenarios in the same ranks (process start-up dominates the time). See
``ep_workers.py`` for the harness and the one-thread / >= 4 tokens per rank rule of the oracle.
"""
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ep_workers as workers
from megamoe.checkpoint import bf16_moe_state_dict, quantize_model_weights
from megamoe.distributed import expert_range, slice_experts
from megamoe.layers import Nvfp4MoE


@pytest.mark.parametrize("world", [2, 4])
def test_matches_single_process_bit_for_bit(world, tmp_path):
    seed = int(torch.randint(0, 1000, ()).item())
    results = workers.launch(world, workers.all_scenarios, tmp_path, seed=seed)
    for name in workers.SCENARIOS:
        per_rank = [r[name] for r in results]
        for rank, r in enumerate(per_rank):
            where = f"{name}, rank {rank}/{world} ({r['tokens']} tokens)"
            assert r["routing_equal"], where
            assert r["exact_equal"], f"{where}: exact mode differs from Nvfp4MoE by {r['max_diff']}"
            assert r["capacity_equal"] and r["capacity_vs_exact"], f"{where}: capacity mode differs"
            assert r["finite"] and r["ref_nonzero"], where
    assert [r["score_fused_order"]["tokens"] for r in results].count(0) == (1 if world == 4 else 0)
    # all pairs on the last rank's experts: the other ranks received no rows
    el = workers.TINY.num_experts // world
    assert set(results[0]["all_to_last_rank"]["experts_used"]) <= set(range((world - 1) * el, world * el))


@pytest.mark.parametrize("world", [2, 4])
def test_exchange_kernels_match_their_oracles_in_the_layer(world, tmp_path):
    """The pack / receive-order kernels (interpreter) inside the layer give the oracles' outputs bit for bit."""
    seed = int(torch.randint(0, 1000, ()).item())
    results = workers.launch(world, workers.exchange_kernels_vs_oracles, tmp_path, timeout_s=600, interpret=True,
                             seed=seed)
    for rank, r in enumerate(results):
        for name in ("fused", "shared_first", "last_rank"):
            assert r[name]["exact_equal"] and r[name]["capacity_equal"] and r[name]["nonzero"], (rank, name, r)


def _write_checkpoint(directory) -> str:
    """A sharded ModelOpt checkpoint of a TINY MoE block with static input scales (distinct per module)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "checkpoint"))
    from ckpt_helpers import write_sharded_checkpoint

    c, prefix = workers.TINY, "model.layers.0.mlp."
    _, weights = Nvfp4MoE.random(c, seed=11, max_num_tokens=4, return_bf16=True)
    sd = bf16_moe_state_dict(weights, c, prefix=prefix)
    modules = sorted({n.rsplit(".", 1)[0] for n in sd if n.endswith("_proj.weight")})
    scales = {m: 0.01 + 0.001 * i for i, m in enumerate(modules)}  # the largest L1 is on the last experts
    tensors = quantize_model_weights(sd, input_scales=scales)
    write_sharded_checkpoint(directory, tensors, max_shard_bytes=20_000)
    return str(directory)


def test_checkpoint_loading_and_mismatched_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # build the checkpoint on the reference path (fast)
    path = _write_checkpoint(tmp_path / "ckpt")
    world = 2
    seed = int(torch.randint(0, 1000, ()).item())
    results = workers.launch(world, workers.loading_and_validation, tmp_path / "out", path=path, seed=seed)
    for rank, r in enumerate(results):
        ck = r["checkpoint"]
        start, stop = ck["range"]
        experts_read = {int(m.group(1)) for m in (re.search(r"experts\.(\d+)\.", n) for n in ck["read"]) if m}
        assert experts_read == set(range(start, stop)), f"rank {rank} read experts {sorted(experts_read)}"
        assert any("shared_experts" in n for n in ck["read"]) and any(n.endswith("gate.weight") for n in ck["read"])
        assert ck["static_scales"] and ck["l1_equal"], rank
        assert ck["exact_equal"] and ck["capacity_equal"], f"rank {rank}: checkpoint EP layer differs"
        # every rank raises the same clear error (and returns: no hang)
        assert "top_k" in r["top_k"]["error"] and "mismatched" in r["top_k"]["error"]
        assert "mode" in r["mode"]["error"]
        assert "divisible" in r["divisible"]["error"]
        assert "rank 1" in r["local_error"]["error"] and "max_num_tokens" in r["local_error"]["error"]
        assert "gate_weight" in r["weights"]["error"]
        assert "exchange='p2p'" in r["p2p_on_cpu"]["error"] and "CUDA" in r["p2p_on_cpu"]["error"]
        assert "rank 0" in r["bad_exchange"]["error"] and "exchange" in r["bad_exchange"]["error"]
    assert results[0]["top_k"]["error"] == results[1]["top_k"]["error"]


def test_expert_range_and_slicing(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert expert_range(8, 4, 2) == (4, 6)
    with pytest.raises(ValueError, match="divisible"):
        expert_range(6, 4, 0)
    layer = Nvfp4MoE.random(workers.TINY, seed=1, max_num_tokens=4)
    part = slice_experts(layer.w13, 2, 4)
    assert part.shape == (2,) + tuple(layer.w13.shape[1:])
    assert torch.equal(part.data, layer.w13.data[2:4]) and torch.equal(part.global_scale, layer.w13.global_scale[2:4])


@pytest.mark.slow
def test_torchrun_run_ep_cli(tmp_path):
    """`torchrun --nproc-per-node 2 -m megamoe run --ep` on CPU (gloo, 127.0.0.1): exits 0, bit-exact check."""
    import os

    env = dict(os.environ, TRITON_INTERPRET="0", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--nnodes", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(workers.free_port()),
           "-m", "megamoe", "run", "--ep", "--tokens", "4", "--iters", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env,
                          cwd=str(Path(__file__).resolve().parents[2]))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "== single-process (bit for bit): True" in proc.stdout and "ok" in proc.stdout
