"""Are the tensor-core router logits batch-invariant across tile configs? (2026-11-26 part 12, one-off probe)

For V4-Flash and V4-Pro gates: logits of the same tokens from the default config (batches over 128 tokens) and from
candidate small-T configs with BLOCK_K 64 (the default's promotion chunk), compared bit for bit, and the graph-replay
time of each candidate at 64 tokens against the small-T config in use (BLOCK_K 128).
Run (H100): ``PYTHONPATH=$PWD python benchmarks/probe_router_block_k.py``.
"""
import torch, triton
from megamoe.kernels import router_logits as rl
dev = torch.device("cuda")
for h, e in ((4096, 256), (7168, 384)):
    g = torch.Generator(device=dev).manual_seed(h)
    gate = (torch.randn(e, h, device=dev, generator=g) * h ** -0.5).bfloat16()
    x = torch.randn(300, h, device=dev, generator=g).bfloat16()
    for small in ((64, 16, 64, 4, 4), (64, 16, 64, 4, 3), (64, 32, 64, 4, 4)):
        big = rl.launch_router_logits(x, gate, config=rl.ROUTER_LOGITS_CONFIG)
        s20 = rl.launch_router_logits(x[:20].contiguous(), gate, config=small)
        s128 = rl.launch_router_logits(x[:128].contiguous(), gate, config=small)
        same = torch.equal(big[:20], s20) and torch.equal(big[:128], s128)
        out = torch.empty(64, e, device=dev)
        xs = x[:64].contiguous()
        fn = lambda: rl.launch_router_logits(xs, gate, out, config=small)
        fn(); torch.cuda.synchronize()
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            fn()
        us = triton.testing.do_bench(gr.replay, warmup=10, rep=100, return_mode="median") * 1e3
        cur = lambda: rl.launch_router_logits(xs, gate, out)
        cur(); torch.cuda.synchronize()
        gr2 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr2):
            cur()
        us2 = triton.testing.do_bench(gr2.replay, warmup=10, rep=100, return_mode="median") * 1e3
        print(h, e, small, "same bits as the default config:", same, f"{us:.1f} us vs current small config {us2:.1f} us")
