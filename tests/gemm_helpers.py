"""Shared helpers of the GEMM kernel tests: random NVFP4 weights and float32 references."""
import torch

from megamoe.format.tensor import NVFP4Tensor
from megamoe.reference.quantize import dequantize, quantize
from sync_helpers import no_host_syncs


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error of ``out`` against ``ref`` (both moved to the CPU)."""
    out, ref = out.float().cpu(), ref.float().cpu()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def random_weight(shape, device, *, per_row_scale=False, scale_shape=None) -> NVFP4Tensor:
    """NVFP4 weight quantized from N(0, 0.05^2); ``scale_shape`` replaces the global scale by distinct
    random values (per expert / per row) that a wrong expert or row index would expose."""
    w = quantize(torch.randn(shape) * 0.05, per_row=per_row_scale)
    gs = w.global_scale
    if scale_shape is not None:
        gs = (torch.rand(scale_shape) + 0.5) * 1e-3
    return NVFP4Tensor(w.data, w.block_scale, gs.float(), w.shape).to(device)


def random_codes_weight(shape, device, *, scale_shape=None) -> NVFP4Tensor:
    """NVFP4 weight of uniformly random FP4 codes (both nibbles), E4M3 block scales uniform over the normal codes
    in [0.5, 448] and a global scale (``scale_shape``, default one) of (0.5, 1.5) * 1e-3, made on ``device``
    without quantizing: real expert shapes (V4-Pro gate_up: 17e9 values) took minutes through ``quantize`` on
    the host."""
    *lead, n, k = shape
    gen = torch.Generator(device=device).manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    data = torch.randint(0, 256, (*lead, n, k // 2), dtype=torch.uint8, device=device, generator=gen)
    code = torch.randint(0x30, 0x7F, (*lead, n, k // 16), dtype=torch.uint8, device=device, generator=gen)
    block_scale = code.view(torch.float8_e4m3fn)  # 0x30 = 0.5 ... 0x7E = 448 (0x7F is NaN)
    gs = (torch.rand(scale_shape if scale_shape is not None else (), device=device, generator=gen) + 0.5) * 1e-3
    return NVFP4Tensor(data, block_scale, gs.float(), tuple(shape))


def offsets_of(counts, device) -> torch.Tensor:
    """Cumulative int32 row ends of per-expert row counts."""
    return torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)


def uniform_offsets(num_experts: int, num_rows: int, device) -> torch.Tensor:
    """Expert offsets (int32 on ``device``) of ``num_rows`` rows routed uniformly at random (torch's CPU
    generator, so seeded runs repeat)."""
    counts = torch.bincount(torch.randint(0, num_experts, (num_rows,)), minlength=num_experts)
    return counts.cumsum(0).to(torch.int32).to(device)


# A Zipf-like routing of 16 experts (one hot expert, empty ones, tails of every size) for skew tests.
SKEWED_COUNTS_16 = [700, 200, 90, 40, 0, 17, 1, 0, 300, 2, 0, 0, 64, 5, 129, 33]


def v4_flash_gate_up_case(counts, device):
    """V4-Flash gate_up shapes (H = 4096, I = 2048): gate/up-interleaved NVFP4 weights of ``len(counts)`` experts
    and ``sum(counts)`` bf16 activation rows. Returns (x, w, I)."""
    from megamoe.reference.gemm import interleave_gate_up

    e, i, k = len(counts), 2048, 4096
    w = interleave_gate_up(random_weight((e, 2 * i, k), device, scale_shape=(e, 1, 1)))
    x = torch.randn(sum(counts), k, device=device).bfloat16()
    return x, w, i


def grouped_f32(x, weight: NVFP4Tensor, offsets, row_index=None) -> torch.Tensor:
    """float32 grouped GEMM on the decoded weights (no bf16 rounding of the output); rows past
    ``offsets[-1]`` stay 0."""
    w = dequantize(weight.to("cpu"), torch.float32)
    xs = x.cpu().float()
    if row_index is not None:
        xs = xs[row_index.cpu().long()]
    y = torch.zeros(xs.shape[0], w.shape[1])
    start = 0
    for e, end in enumerate(offsets.cpu().tolist()):
        y[start:end] = xs[start:end] @ w[e].t()
        start = max(start, end)
    return y


def every_code_weight(n: int, k: int, device) -> NVFP4Tensor:
    """(1, n, k) NVFP4 weight holding every E2M1 code in shuffled order, with awkward block-scale bytes
    (zero, subnormal, negative, the largest finite) and global scale 1: for bit-exact decode tests."""
    codes = torch.arange(n * k) % 16
    codes = codes[torch.randperm(n * k)]
    data = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8).reshape(1, n, k // 2)
    sb = torch.tensor([0x00, 0x01, 0x07, 0x08, 0x38, 0x7E, 0x3F, 0xB8, 0x45, 0x11, 0x02])
    scale = sb[torch.randint(0, len(sb), (n * k // 16,))].to(torch.uint8).reshape(1, n, k // 16)
    return NVFP4Tensor(data, scale.view(torch.float8_e4m3fn), torch.ones(1, 1, 1), (1, n, k)).to(device)


def assert_exact_decode(launch, n: int, k: int, device) -> None:
    """Every E2M1 code under odd E4M3 scales, through identity activations (one expert of ``k`` rows, global
    scale 1): the output is the float32-dequantized weight bit for bit. ``launch(x, w, out, expert_offsets)``
    runs the kernel under test into ``out`` ((k, n) bf16)."""
    w = every_code_weight(n, k, device)
    out = torch.empty(k, n, dtype=torch.bfloat16, device=device)
    launch(torch.eye(k).bfloat16().to(device), w, out, torch.tensor([k], dtype=torch.int32, device=device))
    torch.testing.assert_close(out.cpu().float(), dequantize(w.to("cpu"), torch.float32)[0].t(), rtol=0, atol=0)


def sync_free_graph(launch):
    """``launch()`` once eagerly under sync debug mode "error" (a host sync raises), then captured in a CUDA
    graph; returns (graph, the captured call's return value, i.e. its output buffer)."""
    torch.cuda.synchronize()
    with no_host_syncs():
        launch()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = launch()
    return graph, out


def check_sync_free_and_graph(launch, x, offsets, num_rows: int) -> torch.Tensor:
    """CUDA checks of a grouped-GEMM launch: ``launch()`` (returning its output buffer, computed from ``x``
    and ``offsets``) runs without host syncs (sync debug mode "error"), is captured in a CUDA graph, ``x``
    and the routing (``num_rows`` rows over ``len(offsets)`` experts) are rewritten in place, and the replay
    must equal an eager launch bit for bit. Returns the new per-expert row counts."""
    graph, out = sync_free_graph(launch)
    new_counts = torch.bincount(torch.randint(0, offsets.shape[0], (num_rows,)), minlength=offsets.shape[0])
    offsets.copy_(new_counts.cumsum(0).to(torch.int32))
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone()
    assert torch.equal(replayed, launch()), "CUDA-graph replay differs from eager"
    return new_counts
