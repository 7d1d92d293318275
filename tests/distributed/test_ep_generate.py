"""``generate --ep``: the DeepSeek-V4 model with expert-parallel MoE blocks (megamoe/distributed/ep_block.py).

CPU, gloo, 2 and 4 spawned ranks: every rank's greedy tokens and logits equal the single-process model's on the
same seed bit for bit (each rank holds E/W routed experts per layer, the batch's tokens are split over the ranks
for the MoE block and gathered back). The CLI runs under a torchrun-like environment. The ``cuda`` test runs the
CLI on one GPU over NCCL (world size 1), which captures the decode step in a CUDA graph with the all-to-alls.
"""
import os
import subprocess
import sys

import pytest
import torch

import ep_workers as workers
from megamoe.models.config import MODEL_PRESETS


@pytest.mark.parametrize("world", [2, 4])
def test_generate_matches_single_process_bit_for_bit(world, tmp_path):
    seed = int(torch.randint(0, 1000, ()).item())
    # >= MIN_ROWS_PER_RANK rows per rank in every split matmul (the oracle rule of ep_workers.py); the prompts split
    # unevenly (world 2: 9 + 8 rows, world 4: 9 + 8 + 8 + 8), the decode batch evenly (8 rows per rank)
    rows = workers.MIN_ROWS_PER_RANK
    results = workers.launch(world, workers.generate_tokens, tmp_path, timeout_s=300, seed=seed, batch=rows * world,
                             prompt_len=rows * world + 1, steps=3, single=True)
    single = results[0]["single"]
    e = MODEL_PRESETS["tiny"].moe.num_experts
    for rank, r in enumerate(results):
        ep = r["ep"]
        assert set(ep["experts"]) == {(rank * e // world, (rank + 1) * e // world)}, ep["experts"]
        assert torch.equal(ep["prefill_logits"], single["prefill_logits"]), f"rank {rank}: prefill logits differ"
        assert torch.equal(ep["logits"], single["logits"]), f"rank {rank}: decode logits differ"
        assert torch.equal(ep["tokens"], single["tokens"]), f"rank {rank}: tokens differ"
    assert any(results[0]["ep"]["hashed"]) and not all(results[0]["ep"]["hashed"])  # both routings ran


def _torchrun_like(world: int, args: list, extra_env: dict | None = None, timeout: float = 240) -> list:
    """Run ``python -m megamoe <args>`` as ``world`` ranks with torchrun's environment; [(rc, stdout, stderr)]."""
    port = workers.free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", **(extra_env or {})}
        procs.append(subprocess.Popen([sys.executable, "-m", "megamoe", *args], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            out.append((p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return out


def test_generate_cli_ep_two_ranks():
    args = ["generate", "--ep", "--device", "cpu", "--batch", "3", "--prompt-len", "5", "--steps", "3"]
    (rc0, out0, err0), (rc1, out1, err1) = _torchrun_like(2, args)
    assert rc0 == 0 and rc1 == 0, err0[-2000:] + err1[-2000:]
    assert "x 2 ranks (expert parallel)" in out0 and "all 2 ranks generated the same tokens" in out0, out0
    assert out1.strip() == "", out1  # only rank 0 prints
    single = subprocess.run([sys.executable, "-m", "megamoe", *[a for a in args if a != "--ep"]], capture_output=True,
                            text=True, timeout=240, env={**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1"})
    assert single.returncode == 0, single.stderr[-2000:]
    line = [ln for ln in out0.splitlines() if "tokens of request 0" in ln]
    assert line and line == [ln for ln in single.stdout.splitlines()
                             if "tokens of request 0" in ln], (out0, single.stdout)


def test_generate_cli_ep_errors(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    from megamoe.cli import main

    with pytest.raises(SystemExit, match="RANK"):  # --ep without torchrun
        main(["generate", "--ep", "--device", "cpu", "--steps", "1"])
    results = _torchrun_like(3, ["generate", "--ep", "--device", "cpu", "--steps", "1"], timeout=120)
    for rc, _, err in results:  # 8 experts over 3 ranks: every rank stops with the same clear message
        assert rc != 0 and "do not split over 3 ranks" in err, err[-2000:]


@pytest.mark.cuda
def test_cuda_generate_ep_world_one_nccl():
    """The --ep CLI on one GPU over NCCL: prefill, graph-captured decode steps with the all-to-alls inside."""
    (rc, out, err), = _torchrun_like(1, ["generate", "--ep", "--device", "cuda", "--config", "tiny", "--batch", "1,4",
                                          "--prompt-len", "8", "--steps", "4"], extra_env={"TRITON_INTERPRET": "0"})
    assert rc == 0, err[-3000:]
    assert "all 1 ranks generated the same tokens" in out, out


def test_checkpoint_each_rank_reads_only_its_experts(tmp_path, monkeypatch):
    import re
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "checkpoint"))
    from ckpt_helpers import write_sharded_checkpoint
    from megamoe.models.v4_weights import random_state_dict

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cfg = MODEL_PRESETS["tiny"]
    write_sharded_checkpoint(tmp_path / "ckpt", random_state_dict(cfg, seed=5), max_shard_bytes=256 * 1024)
    results = workers.launch(2, workers.load_model_from_checkpoint, tmp_path / "out", timeout_s=240,
                             path=str(tmp_path / "ckpt"), prompt_len=2 * workers.MIN_ROWS_PER_RANK + 1)
    for rank, r in enumerate(results):
        assert r["equal"], f"rank {rank}: the EP model from the checkpoint differs from the single-process one"
        start, stop = r["ranges"][0]
        experts = {int(m.group(1)) for m in (re.search(r"\.experts\.(\d+)\.", n) for n in r["read"]) if m}
        assert experts == set(range(start, stop)), f"rank {rank} read experts {sorted(experts)}"
        assert any(".shared_experts." in n for n in r["read"]) and "embed.weight" in r["read"]
