"""One launch each of the w4a8 v2 kernel and the bf16 pipelined kernel on the same expert GEMM, for ncu
(``benchmarks/gpu_check_v27.sh g``): V4-Flash gate_up (no SwiGLU), uniform top-6 routing of ``--tokens`` tokens.

Run: ncu --kernel-name regex:'w4a8_pipe|wgmma_pipe' ... python benchmarks/ncu_w4a8_vs_bf16.py [--tokens 16384]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from megamoe.format.tensor import NVFP4Tensor  # noqa: E402
from megamoe.kernels.fp8_act_quant import launch_fp8_act_quant  # noqa: E402
from megamoe.kernels.gemm.nvfp4_w4a8_pipe import launch_nvfp4_w4a8_pipe  # noqa: E402
from megamoe.kernels.gemm.nvfp4_wgmma_pipe import launch_nvfp4_wgmma_pipe  # noqa: E402
from megamoe.models.config import PRESETS  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--config", default="v4-flash")
    args = parser.parse_args()
    c = PRESETS[args.config]
    e, n, k = c.num_experts, 2 * c.intermediate_size, c.hidden_size
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device="cuda")
    sb = torch.randint(0x20, 0x48, (e, n, k // 16), dtype=torch.uint8, device="cuda")
    w = NVFP4Tensor(data, sb.view(torch.float8_e4m3fn), torch.full((e, 1, 1), 1e-3, device="cuda"), (e, n, k))
    experts = torch.rand(args.tokens, e, generator=gen).topk(c.top_k, dim=1).indices.flatten()
    offsets = torch.bincount(experts, minlength=e).cumsum(0).to(torch.int32).cuda()
    t = experts.numel()
    x = torch.randn(t, k, device="cuda").bfloat16()
    xq = torch.empty(t, k, dtype=torch.float8_e4m3fn, device="cuda")
    xs = torch.empty(t, dtype=torch.float32, device="cuda")
    launch_fp8_act_quant(x, xq, xs, mma_order=True)
    out = torch.empty(t, n, dtype=torch.bfloat16, device="cuda")
    launch_nvfp4_w4a8_pipe(xq, xs, w.data, w.block_scale, w.global_scale, out, expert_offsets=offsets)
    launch_nvfp4_wgmma_pipe(x, w.data, w.block_scale, w.global_scale, out, expert_offsets=offsets)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
