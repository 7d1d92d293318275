"""Public NVFP4 GEMM ops: dense ``nvfp4_linear`` and grouped ``nvfp4_grouped_mm``.

Validation happens here on host metadata only (shapes, dtypes, devices); device
values (``expert_offsets``, ``row_index``) are never read on the host, so the
ops are sync-free and CUDA-graph capturable on the Triton path.

Dispatch (``megamoe.ops._dispatch.use_triton``): CUDA tensors -> the Triton
kernels in ``megamoe/kernels/gemm/nvfp4_gemm.py``; CPU tensors -> the PyTorch
reference (``megamoe/reference/gemm.py``), or the Triton kernels through the
interpreter when ``TRITON_INTERPRET=1``.

Decode routing (CUDA only, :func:`decode_route`): shape-bucket rules on
host-known values (rows, experts, N, K; never device values), set from H100
measurements (``benchmarks/NOTES_gemm.md``). On sm_90 with K % 128 == 0,
grouped GEMMs with up to a few hundred rows per expert on average take the
"banded" route (:func:`plan_row_bands`): one launch per row band, each taking
only the experts whose row count (read on the device) lies in its band, so a
hot expert gets wide tiles and many programs whatever the routing: the Gluon
``mma.sync`` kernel (``nvfp4_mma_decode.py``, 8- and 32-row chunks) for small
experts, the Gluon wgmma kernel (``nvfp4_wgmma.py``) above 64 rows; dense GEMMs with decode-sized M to the
split-K kernel (``nvfp4_splitk.py``: K splits fill the GPU for small N; the M bound per shape class is the
table ``nvfp4_splitk.DENSE_SPLITK_MAX_ROWS``, 64 for every class, raised to 256 for K >= 4096:
``nvfp4_splitk.splitk_max_rows``), grouped shapes those kernels
cannot take to the CUDA-core kernel (``nvfp4_gemv.py``);
everything else to the Triton tensor-core GEMM (``nvfp4_gemm.py``). The interpreter (CPU) path
keeps the Triton tensor-core kernel, whose CPU tests stay meaningful; the
decode kernels have their own tests.

Modes: ``"w4a16"`` (x stays bf16; the fast default), ``"w4a4"`` (x is
quantized to NVFP4 with a dynamic per-row global scale and decoded back to bf16
before the GEMM, reproducing Blackwell W4A4 numerics to validate accuracy) and
``"w4a8"`` (prefill on Hopper's FP8 tensor cores: x quantized to FP8 E4M3 per
token by ``megamoe/kernels/fp8_act_quant.py``, the NVFP4 weights decoded to FP8
operands inside the kernel: grouped and dense GEMMs with K % 256 == 0 on sm_90 run the pipelined
``megamoe/kernels/gemm/nvfp4_w4a8_pipe.py`` (row bands of 64 / 96 / 128 / 2 x 96-row tiles by the experts' rows,
the rest 128-row tiles, ``W4A8_BAND_CONFIGS``; a dense GEMM is one expert), the others
``megamoe/kernels/gemm/nvfp4_w4a8.py``; numerics in
``megamoe/reference/w4a8.py``; needs K % 128 == 0). Host rule (:func:`w4a8_kernel_mode`): on CUDA,
a w4a8 GEMM with fewer than ``W4A8_MIN_ROWS_PER_EXPERT`` (48) rows per expert on average (M < 48 dense)
runs the w4a16 kernels (decode sizes are weight-bandwidth bound; FP8 MMA buys nothing there); the
interpreter / CPU reference always use the w4a8 numerics.
"""
from __future__ import annotations

import importlib
import math
import os
from dataclasses import dataclass

import torch

from ..format.mma_order import from_paired_order, to_paired_order
from ..format.tensor import NVFP4Tensor
from ..reference import gemm as _reference
from ..reference.gemm import deinterleave_gate_up, interleave_gate_up  # noqa: F401  (public layout helpers)
from ._dispatch import use_triton
from ._validate import check_tensor

MODES = _reference.MODES
ACTIVATIONS = _reference.ACTIVATIONS

# The warp-specialized wgmma kernel (megamoe/kernels/gemm/nvfp4_wgmma_ws.py, issue 10 item 1). Validated on
# the H100 (benchmarks/results/gpu_check_v7, 12/12 shapes; gpu_check_v8 timing at E=256, 384 rows per
# expert: gate_up 10.03 vs 10.30 ms for the Triton tensor-core kernel, down 5.12 vs 5.64 ms; at 64 rows per
# expert it is slower than the banded route: 4.00 vs 2.79 ms). So:
# * WS_ROUTE (default on): grouped GEMMs with K % 128 == 0 on sm_90 take it for more than
#   WGMMA_MAX_ROWS_PER_EXPERT (256) rows per expert on average, instead of the Triton tensor-core kernel;
# * WS_BANDED (default off): the banded route's top band (experts with > 64 rows) runs it instead of the
#   synchronous wgmma kernel (not measured per band).
# MEGAMOE_WS_ROUTE (read at import): "0" both off, "1" (default) WS_ROUTE only, "all" both. Both flags are
# read at every call (a captured CUDA graph keeps the kernels it captured).
_WS_ENV = os.environ.get("MEGAMOE_WS_ROUTE", "1")
WS_ROUTE = _WS_ENV not in ("", "0")
WS_BANDED = _WS_ENV == "all"
# The pipelined wgmma kernel (megamoe/kernels/gemm/nvfp4_wgmma_pipe.py, NOTES_gemm.md v17): when on (default),
# it takes the banded route's top band (experts with > 64 rows) and the grouped GEMMs above 256 rows per
# expert ("ws" before), for K % 256 == 0 on sm_90. Measured 1.13-1.8x faster than those wherever it runs
# (benchmarks/results/gpu_check_v19). MEGAMOE_PIPE_ROUTE (read at import; the flag at every call): "0" off.
PIPE_ROUTE = os.environ.get("MEGAMOE_PIPE_ROUTE", "1") not in ("", "0")
# With PIPE_ROUTE: when the banded route has no decode band (more than ~4 rows per expert on average: from ~170
# tokens of V4), the bands take the pipelined kernel, at the smallest BLOCK_M holding the band's experts in one
# tile (16 / 32 / 64 / 128 rows; see PIPE_SMALL), instead of the mma.sync BLOCK_M 16 / 32 bands. (A BLOCK_M 16
# pipelined band of 8 warps measured slower than the mma one at 512 tokens: 2047 vs 1893 us,
# gpu_check_v19/e_peer_pipe_bands.md.)
# MEGAMOE_PIPE_BANDS (read at import; the flag at every call): "1" (default) on, "0" off. Measured 1.04-1.88x at
# 512-4096 tokens where a band is populated, neutral elsewhere (gpu_check_v19/f_peer_pipe_{top,bands}.md).
PIPE_BANDS = os.environ.get("MEGAMOE_PIPE_BANDS", "1") not in ("", "0")
# With PIPE_BANDS and no decode band: the <= 16-row and 17-32-row bands take the one-warpgroup, two-programs-per-SM
# pipelined configs (PIPE_SMALL_CONFIGS) instead of mma.sync BLOCK_M 16 and the 8-warp BLOCK_M 32 tiles: 1.04-1.15x
# at 512-1024 tokens (gpu_check_v19/l_small*.md). MEGAMOE_PIPE_SMALL (read at import; the flag at every call):
# "1" (default) on, "0" off.
PIPE_SMALL = os.environ.get("MEGAMOE_PIPE_SMALL", "1") not in ("", "0")
# With PIPE_BANDS: tail-tile bands (nvfp4_wgmma_pipe.PIPE_TAIL_BANDS): experts of 65-96 rows take one 96-row
# (64 + 32) tile instead of a 128-row one whose last 32-63 rows would be padding, and experts of 129-192 rows two.
# MEGAMOE_PIPE_TAIL (read at import; the flag at every call): "1" (default) on, "0" off. Layer (H100, 60 ms of graph
# replays per point, gpu_check_v23/peer_tail_*_c.md): V4-Pro 4096 uniform 1.09x, V4-Flash 4096 uniform 1.025x, the
# other points (2048 / 8192 tokens, Zipf) within the run's +-3% spread.
PIPE_TAIL = os.environ.get("MEGAMOE_PIPE_TAIL", "1") not in ("", "0")
# With PIPE_TAIL: the bands above 32 rows (64-, 96- and 128-row tiles, five launches) as two persistent launches over
# device-built tile lists (nvfp4_wgmma_pipe.launch_nvfp4_wgmma_pipe(tile_list=True); issue 10's device-side schedule,
# NOTES_gemm.md v24): one for the 128- and 64-row tiles, one for the 96-row tiles. Same bits as the bands.
# MEGAMOE_PIPE_LIST (read at import; the flag at every call): "1" on, "0" (default) off. Measured (H100, two runs):
# Zipf 512-2048 tokens 1.09-1.17x faster, V4-Flash uniform 2048 0.95x and all-on-k 8192 0.97x, the rest within the
# runs' spread, so it depends on the routing.
PIPE_LIST = os.environ.get("MEGAMOE_PIPE_LIST", "0").strip() not in ("", "0")
# Split-K of the banded route's small band (experts with <= MMA_SMALL_BAND_ROWS rows: every decode step at
# 1-16 tokens; issue 11, NOTES_gemm.md "decode split-K (grouped)"): the ``splits`` argument of that launch.
# MEGAMOE_DECODE_SPLITK (read at import): "0" (default) off (the kernel as before), "1" planned from host
# shapes (nvfp4_mma_decode.plan_decode_splits: S > 1 only at 1-2 tokens), N >= 2 forces N splits (sweeps).
# Off by default: on the H100 (results/decode_splitk_v1.md) S = 3 did not speed up the V4-Flash GEMMs at 1
# token (gate_up 42.5 vs 43.6 us, down 27.5 vs 25.4), S = 2 made the V4-Pro ones 8% faster, and the MoE layer
# was slower with it on (V4-Flash 84.6 vs 80.9 us, V4-Pro 154.6 vs 142.5): more programs do not raise the
# streaming rate of this kernel at 1 token. Read at every call (a captured CUDA graph keeps its launches).
_SPLITK_ENV = os.environ.get("MEGAMOE_DECODE_SPLITK", "0").strip()
DECODE_SPLITK = None if _SPLITK_ENV == "1" else max(1, int(_SPLITK_ENV or "0"))


# The BLOCK_M 16 band of the banded route (NOTES_peer_study.md section 6): when there is no small (BLOCK_M 8) band
# and the average is <= MMA16_BAND_ROWS rows per touched expert (~256-700 tokens of V4, top-6 of 256), experts
# with <= 16 rows take BLOCK_M 16 tiles (fewer padded MMA rows: 3.86 instead of 4.66 instructions per weight) and
# the rest the BLOCK_M 32 band. MEGAMOE_MMA16_BAND (read at import): "1" (default) on, "0" off.
MMA16_BAND = os.environ.get("MEGAMOE_MMA16_BAND", "1").strip() not in ("", "0")

# Row-interleaved weights (NVFP4Tensor.row_interleave) at decode sizes: the experts above the decode band (9-64 rows:
# a skewed router's hot experts) take the pipelined small-row bands, which read that layout 1.2-1.5x faster than
# row-major (NOTES_gemm.md v21), instead of the mma.sync BLOCK_M 32 chunks (two passes over a 64-row expert's
# weights). Row-major weights keep the chunks (pipelined bands there measured 3-9% slower at 64 tokens, v17).
# Measured on the interleaved layout (NOTES_gemm.md v23): all-on-k 16-64 tokens 1.2-1.6x faster, Zipf 64-128 tokens
# 3-8% slower, so it depends on the routing. MEGAMOE_PIPE_AFTER_DECODE (read at import): "1" on, "0" (default) off.
PIPE_AFTER_DECODE = os.environ.get("MEGAMOE_PIPE_AFTER_DECODE", "0").strip() not in ("", "0")

# A middle way (issue 10, the all-on-k decode point): with a decode band on row-interleaved weights, the mma.sync
# BLOCK_M 32 chunks keep the experts of up to PIPE_ABOVE_MMA_ROWS rows (one chunk: one pass over the weights) and a
# pipelined 64-row band (then the usual pipelined band) takes the experts above, which the chunks would read twice;
# PIPE_AFTER_DECODE's extra small-row pipelined launches are not planned. The band's tiles: 256 columns where N >=
# PIPE_ABOVE_WIDE_N (nvfp4_wgmma_pipe.PIPE_BAND_CONFIGS[64]); below, 128 columns (PIPE_BAND64_NARROW_CONFIG: twice the
# programs per hot expert) and only while no expert can pass 64 rows (the row hint; V4-Flash at 128 tokens lost
# 2.6-4% with the band). H100, the MoE layer, read flush, on against off (results/gpu_check_v35/ c-h,
# NOTES_moe_decode.md "Hot experts of 33-64 rows"): all 48 / 64 tokens on the same experts 1.44 / 1.56x (V4-Flash
# 183.4 -> 117.5 us at 64, V4-Pro 435.1 -> 281.6), but Zipf 48 tokens 0.924x (V4-Flash) / 0.968x (V4-Pro), the
# layers' own routers 0.990-0.997x at 48-64 tokens; Zipf 64 / 128 even to 1.032x. With BANDS_OVERLAP (below) the
# band runs beside the chunks instead of after them (results/gpu_check_v37/ f, g; NOTES_moe_decode.md "Later bands
# beside the earlier ones"), which takes most of the Zipf loss back: the default is 32 since then.
# MEGAMOE_PIPE_ABOVE_MMA_ROWS (read at import): 0 off.
PIPE_ABOVE_MMA_ROWS = int(os.environ.get("MEGAMOE_PIPE_ABOVE_MMA_ROWS", "32").strip() or 0)
PIPE_ABOVE_WIDE_N = 6144

# The banded route's launches on side streams (:func:`_launch_banded`), for plans without a decode band (prefill
# sizes): each band is a persistent launch that ends in a partial wave; run concurrently, the next band's tiles fill
# the SMs the previous one frees. Same bits (the bands write disjoint rows). Measured (NOTES_gemm.md v23) at 512-8192
# tokens: Zipf 1.02-1.19x faster, uniform 0.95-1.02x, all-on-k 0.91-1.0x, so it depends on the routing.
# MEGAMOE_BANDS_CONCURRENT (read at import): "1" on, "0" (default) off.
BANDS_CONCURRENT = os.environ.get("MEGAMOE_BANDS_CONCURRENT", "0").strip() not in ("", "0")
# The banded route's later launches beside the earlier ones on one stream (:func:`_launch_banded`), for plans with a
# decode band (decode sizes: the measured ones): band i >= 1 is launched with PDL (``after_band``), starts on the SMs
# the previous band frees, computes without waiting for it (its inputs were final before the first band started, its
# rows are disjoint) and waits for it only before exiting, so the stream's next kernel sees every band. Same bits. Not
# with split-K bands (shared tile counters). Measured (H100, the MoE layer, read flush; results/gpu_check_v37/ f, g):
# Zipf 16 / 64 tokens 1.04-1.11x, the layers' routers 0.99-1.03x, all-on-k 0.98-1.02x alone; with PIPE_ABOVE_MMA_ROWS
# all-on-k 48 / 64 tokens 1.45-1.60x. MEGAMOE_BANDS_OVERLAP (read at import): "1" (default) on, "0" off.
BANDS_OVERLAP = os.environ.get("MEGAMOE_BANDS_OVERLAP", "1").strip() not in ("", "0")


def _check_x(x, k: int | None, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"{name}: expected bfloat16, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D (rows, K) tensor, got shape {tuple(x.shape)}")
    if k is not None and x.shape[1] != k:
        raise ValueError(f"{name}: expected K={k} columns (the weight's K), got {x.shape[1]}")


def _check_weight(weight, dims: int, x: torch.Tensor, interleave_ok: bool = False) -> None:
    if not isinstance(weight, NVFP4Tensor):
        raise TypeError(f"weight: expected an NVFP4Tensor, got {type(weight).__name__}")
    if weight.row_interleave != 1 and not interleave_ok:
        raise ValueError(f"weight: row_interleave={weight.row_interleave} is read by nvfp4_grouped_mm only; pass "
                         "weight.rows_in_order()")
    if len(weight.shape) != dims:
        layout = "(N, K)" if dims == 2 else "(E, N, K)"
        raise ValueError(f"weight: expected logical shape {layout}, got {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight: expected device {x.device} (x's), got {weight.device}")


def _check_mode(mode) -> None:
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")


def _check_out(out, shape: tuple, x: torch.Tensor) -> None:
    if out is None:
        return
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out: expected a torch.Tensor, got {type(out).__name__}")
    if out.dtype != torch.bfloat16:
        raise TypeError(f"out: expected bfloat16, got {out.dtype}")
    if tuple(out.shape) != shape:
        raise ValueError(f"out: expected shape {shape}, got {tuple(out.shape)}")
    if out.device != x.device:
        raise ValueError(f"out: expected device {x.device}, got {out.device}")
    if out.dim() == 2 and out.shape[1] > 1 and out.stride(1) != 1:
        raise ValueError("out: expected a row-major tensor with unit stride along the last dimension")


def _check_activation(activation, swiglu_limit, n: int) -> None:
    """``activation`` None or "swiglu" (N even: interleaved gate/up rows); ``swiglu_limit`` None or a finite positive
    number, with "swiglu" only."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    if activation == "swiglu" and n % 2:
        raise ValueError(f"weight: activation='swiglu' needs an even N (interleaved gate/up rows), got N={n}")
    if swiglu_limit is not None:
        if activation != "swiglu":
            raise ValueError("swiglu_limit: only valid with activation='swiglu'")
        if isinstance(swiglu_limit, bool) or not isinstance(swiglu_limit, (int, float)) \
                or not math.isfinite(swiglu_limit) or not swiglu_limit > 0:
            raise ValueError(f"swiglu_limit: expected a finite positive number or None, got {swiglu_limit!r}")


def _check_index(t, name: str, length: int | None, x: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected an int32 tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name}: expected int32, got {t.dtype}")
    if t.dim() != 1 or (length is not None and t.shape[0] != length):
        want = f"({length},)" if length is not None else "1-D"
        raise ValueError(f"{name}: expected shape {want}, got {tuple(t.shape)}")
    if t.device != x.device:
        raise ValueError(f"{name}: expected device {x.device} (x's), got {t.device}")


def _record_row_index(x: torch.Tensor, row_index: torch.Tensor, expert_offsets: torch.Tensor) -> None:
    """Torch path: flag row_index values outside [0, S) in the rows the GEMM computes (< offsets[E-1])."""
    from . import errors

    rows = torch.arange(row_index.shape[0], device=x.device)
    live = rows < expert_offsets[-1].clamp(min=0)
    bad = live & ((row_index < 0) | (row_index >= x.shape[0]))
    errors.record(errors.error_word(x.device), errors.flag("nvfp4_grouped_mm", "row_index"), bad)


def _quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """w4a4: NVFP4 round trip of x with a per-row dynamic global scale (sync-free on the kernel path)."""
    if x.numel() == 0:
        return x
    try:  # the fused quantize kernels (another family), when present
        _quantize_ops = importlib.import_module("megamoe.ops.quantize")
    except ImportError:
        _quantize_ops = None
    if _quantize_ops is not None and hasattr(_quantize_ops, "quantize") and hasattr(_quantize_ops, "dequantize"):
        q = _quantize_ops.quantize(x, per_row=True)
        return _quantize_ops.dequantize(q, torch.bfloat16)
    return _reference.activations_for_mode(x, "w4a4")


def _check_w4a8_k(mode, k: int) -> None:
    if mode == "w4a8" and k % 128:
        raise ValueError(f"weight: mode='w4a8' needs K % 128 == 0 (FP8 K steps of 128), got K={k}")


def w4a8_kernel_mode(x: torch.Tensor, num_rows: int, num_experts: int | None) -> str:
    """The numerics a ``mode="w4a8"`` GEMM runs with: "w4a8", or "w4a16" for decode sizes on CUDA.

    Host shapes only: ``num_rows`` (rows of the GEMM), ``num_experts`` (None = dense). On CUDA, fewer than
    ``nvfp4_w4a8.W4A8_MIN_ROWS_PER_EXPERT`` rows per expert on average keep the w4a16 kernels.
    """
    if not x.is_cuda:
        return "w4a8"
    from ..kernels.gemm.nvfp4_w4a8 import W4A8_MIN_ROWS_PER_EXPERT

    return "w4a8" if num_rows >= W4A8_MIN_ROWS_PER_EXPERT * (num_experts or 1) else "w4a16"


def _fp8_activations(x: torch.Tensor, mma_order: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x (S, K) bf16 -> (codes (S, K) float8_e4m3fn, per-row scales (S,) float32), one sync-free launch;
    ``mma_order``: codes in the FP8 MMA K order of the pipelined W4A8 kernel."""
    from ..kernels.fp8_act_quant import launch_fp8_act_quant

    codes = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    return launch_fp8_act_quant(_contiguous_rows(x), codes, scales, interpreter=not x.is_cuda, mma_order=mma_order)


def _contiguous_rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def decode_route(x: torch.Tensor, data: torch.Tensor, num_rows: int, num_experts, n: int, k: int) -> str:
    """Which kernel runs this GEMM: "splitk" (dense split-K decode), "banded" (grouped: Gluon mma.sync
    and wgmma launches by row bands, :func:`plan_row_bands`), "mma" (dense Gluon mma.sync decode),
    "wgmma" (Gluon wgmma), "ws" (warp-specialized Gluon wgmma, only when :data:`WS_ROUTE`), "pipe" (pipelined
    Gluon wgmma, grouped, more than 256 rows per expert, only when :data:`PIPE_ROUTE`), "dense-pipe" (a dense GEMM of
    at least :data:`DENSE_PIPE_MIN_ROWS` rows as a grouped GEMM of one expert: :func:`_dense_as_one_expert`), "gemv"
    (CUDA-core decode) or "tensor-core" (Triton).

    ``num_experts`` None means dense. Host metadata only (shapes, strides,
    pointers' alignment), never device values.
    """
    if not x.is_cuda:
        return "tensor-core"
    from ..kernels.gemm import (nvfp4_gemv, nvfp4_gluon_jit, nvfp4_mma_decode, nvfp4_splitk, nvfp4_wgmma,
                                nvfp4_wgmma_pipe, nvfp4_wgmma_ws)

    if (num_experts is None and nvfp4_splitk.splitk_preferred(num_rows, n, k)
            and nvfp4_splitk.splitk_supports(x, data)):
        return "splitk"
    gluon_ok = nvfp4_gluon_jit.gluon_supports(x, data)
    if (num_experts is None and PIPE_ROUTE and gluon_ok and num_rows >= DENSE_PIPE_MIN_ROWS
            and nvfp4_wgmma_pipe.pipe_supported(k)):
        return "dense-pipe"
    if gluon_ok and num_experts is not None and num_rows <= nvfp4_wgmma.WGMMA_MAX_ROWS_PER_EXPERT * num_experts:
        return "banded"
    if gluon_ok and nvfp4_mma_decode.mma_decode_preferred(num_rows, num_experts):
        return "mma"
    if gluon_ok and nvfp4_wgmma.wgmma_preferred(num_rows, num_experts):
        return "wgmma"
    if PIPE_ROUTE and gluon_ok and num_experts is not None and nvfp4_wgmma_pipe.pipe_supported(k):
        return "pipe"
    if WS_ROUTE and gluon_ok and nvfp4_wgmma_ws.ws_preferred(num_rows, num_experts, k):
        return "ws"
    if nvfp4_gemv.gemv_preferred(num_rows, num_experts, n, k) and nvfp4_gemv.gemv_supports(x, data):
        return "gemv"
    return "tensor-core"


def plan_row_bands(num_rows: int, num_experts: int, k: int, max_rows_per_expert: int | None = None, *,
                   weight_interleave: int = 1, n: int | None = None, num_sms: int | None = None) -> list:
    """The launches of the "banded" route: [(route, launcher keyword arguments)], host shapes only.

    Each launch computes only the experts whose row count r (read on the
    device) lies in its band, so any routing is spread over kernels that suit
    it (benchmarks/NOTES_gemm.md, v12):

    * "mma" with the decode config (BLOCK_M 8) for r <= ``MMA_SMALL_BAND_ROWS``,
      only when the average is <= 4 rows per touched expert (the previous decode bucket), split-K as
      :data:`DECODE_SPLITK` says (``splits``);
    * "mma" with BLOCK_M 32 chunks for r <= ``MMA_MAX_BAND_ROWS``;
    * "wgmma" (BLOCK_M 128 tiles, persistent) above ("pipe" when :data:`PIPE_ROUTE` is on, else "ws", the
      warp-specialized kernel, when :data:`WS_BANDED` is on).

    A launch is planned only if some routing can reach its band: no expert has
    more than ``min(T, max_rows_per_expert)`` rows (the MoE layer passes its
    token count: top-k experts are distinct per token). The last launch's band
    is unbounded above, so a wrong hint costs speed, never rows. The first
    launch writes the padding rows ``[offsets[E-1], T)``.

    ``weight_interleave`` > 1 (``NVFP4Tensor.row_interleave``): every launch must be "mma" or "pipe" (else
    ValueError); the plan is the row-major one, except that with :data:`PIPE_AFTER_DECODE` the rows above a
    decode band take the pipelined bands, and with :data:`PIPE_ABOVE_MMA_ROWS` the rows above that many (N >=
    :data:`PIPE_ABOVE_WIDE_N`, or at most 64 rows per expert).

    ``n`` (N) and ``num_sms`` (given on CUDA): the decode band takes the 8-warp one-wave config where its work items
    fit in one wave of it (``nvfp4_mma_decode.one_wave_decode_config``: V4-Flash at 1 token).
    """
    from ..kernels.gemm import nvfp4_mma_decode as mma, nvfp4_wgmma_pipe as pipe

    most = num_rows if max_rows_per_expert is None else max(1, min(num_rows, max_rows_per_expert))
    avg = -(-num_rows // max(1, min(num_experts, num_rows)))
    small = mma.select_mma_decode_config(avg, k)
    wide = mma.select_mma_decode_config(mma.MMA_SMALL_BAND_ROWS + 1, k)
    if num_experts == 1 and mma.MMA_SMALL_BAND_ROWS < most <= ONE_EXPERT_SPLITK_MAX_ROWS:
        # one expert (the shared expert, a dense GEMM as one group): 32-row chunks with planned split-K, not the
        # pipelined bands' few wide tiles (V4-Flash gate_up at 64 rows: 16 tiles of 256 columns on 132 SMs)
        return [("mma", dict(config=wide, row_band=(0, mma.ROW_HI_UNBOUNDED), splits=None, own_pad=True,
                             max_rows_per_expert=most))]
    bands, lo = [], 0
    decode_band = small[0] < wide[0]
    if decode_band:
        lo = mma.MMA_SMALL_BAND_ROWS if most > mma.MMA_SMALL_BAND_ROWS else mma.ROW_HI_UNBOUNDED
        config = small
        if n is not None and num_sms:
            config = mma.one_wave_decode_config(num_rows, num_experts, n, k, max_rows_per_expert, num_sms, lo) or small
        bands.append(("mma", dict(config=config, row_band=(0, lo), splits=DECODE_SPLITK)))
    # not with a decode band: decode sizes keep their mma.sync plan (a pipelined 64-row band after the decode band
    # measured 3% / 9% slower layers at 64 uniform / Zipf tokens on the H100, gpu_check_v19/z_moe_skew_pipe*.md,
    # though 14% faster when all 64 tokens pick the same experts)
    pipe_ok = PIPE_ROUTE and pipe.pipe_supported(k)
    pipe_bands = pipe_ok and PIPE_BANDS and (not decode_band or (PIPE_AFTER_DECODE and weight_interleave > 1))
    above_config = None  # the pipelined band above PIPE_ABOVE_MMA_ROWS, when it is planned
    if (decode_band and not pipe_bands and pipe_ok and PIPE_BANDS and weight_interleave > 1 and n is not None
            and 0 < PIPE_ABOVE_MMA_ROWS < mma.MMA_MAX_BAND_ROWS):
        if n >= PIPE_ABOVE_WIDE_N:
            above_config = pipe.PIPE_BAND_CONFIGS[64]
        elif most <= 64:
            above_config = pipe.PIPE_BAND64_NARROW_CONFIG

    def add_pipe_bands(lo, configs):
        """Pipelined launches for the row bands (lo, hi] of ``configs`` that some expert can reach; the new lo."""
        for hi, config in configs:
            if most > lo and hi > lo:
                top = hi if most > hi else mma.ROW_HI_UNBOUNDED
                bands.append(("pipe", dict(config=config, row_lo=lo, row_hi=top)))
                lo = top
        return lo

    if pipe_bands and PIPE_SMALL:
        lo = add_pipe_bands(lo, sorted(pipe.PIPE_SMALL_CONFIGS.items()))
    if MMA16_BAND and not bands and avg <= mma.MMA16_BAND_ROWS and most > lo:
        hi = mma.MMA16_BAND_ROWS if most > mma.MMA16_BAND_ROWS else mma.ROW_HI_UNBOUNDED
        bands.append(("mma", dict(config=mma.MMA16_CONFIG, row_band=(lo, hi))))
        lo = hi
    if pipe_bands and PIPE_TAIL and PIPE_LIST:  # the bands up to 32 rows, then the tile lists for the rest
        lo = add_pipe_bands(lo, [(hi, config) for hi, config in sorted(pipe.PIPE_BAND_CONFIGS.items()) if hi <= 32])
        if most > lo:
            bands.append(("pipe", dict(tile_list=True, row_lo=lo)))
            lo = mma.ROW_HI_UNBOUNDED
    elif pipe_bands:
        configs = {**pipe.PIPE_BAND_CONFIGS, **(pipe.PIPE_TAIL_BANDS if PIPE_TAIL else {})}
        lo = add_pipe_bands(lo, sorted(configs.items()) + [(mma.ROW_HI_UNBOUNDED, pipe.PIPE_CONFIG)])
    if most > lo:
        cap = PIPE_ABOVE_MMA_ROWS if above_config else mma.MMA_MAX_BAND_ROWS
        hi = cap if most > cap else mma.ROW_HI_UNBOUNDED
        bands.append(("mma", dict(config=wide, row_band=(lo, hi))))
        lo = hi
    if above_config:  # (PIPE_ABOVE_MMA_ROWS, 64] in 64-row tiles; above, the final band as without it
        lo = add_pipe_bands(lo, [(64, above_config)])
    if most > lo:
        bands.append(("pipe" if pipe_ok else "ws" if WS_BANDED else "wgmma", dict(row_lo=lo)))
    for i, (route, kwargs) in enumerate(bands):
        kwargs["own_pad"] = i == 0
        if route == "mma":
            kwargs["max_rows_per_expert"] = most
    if weight_interleave > 1:
        _check_interleaved_routes([route for route, _ in bands], weight_interleave)
    return bands


def _check_interleaved_routes(kinds: list, row_interleave: int) -> None:
    """Row-interleaved weights (NVFP4Tensor.row_interleave) are read by the mma.sync decode and pipelined wgmma
    kernels only (host shapes)."""
    if any(kind not in ("mma", "pipe") for kind in kinds):
        raise ValueError(f"weight: row_interleave={row_interleave} needs the Gluon grouped kernels (sm_90, "
                         f"K % 256 == 0, PIPE_ROUTE on); this GEMM would run {kinds}")


def _launch_banded(*args, expert_offsets, interpreter=False, max_rows_per_expert=None, early_reads=False, **kwargs):
    """The "banded" route: the launches of :func:`plan_row_bands`, in order, on the current stream (with
    :data:`BANDS_CONCURRENT` and no decode band: each on its own side stream of :func:`_band_streams`, forked from
    and joined back into the current one). ``early_reads`` goes to an mma.sync decode launch that is the plan's only
    one."""
    out = args[4]
    data = args[1]
    num_sms = None
    if out.is_cuda and not interpreter:
        from ..kernels.gemm.nvfp4_gemm import _num_sms

        num_sms = _num_sms(out.device.index or 0)
    plan = plan_row_bands(out.shape[0], data.shape[0], 2 * data.shape[-1], max_rows_per_expert,
                          weight_interleave=kwargs.get("weight_interleave", 1), n=data.shape[-2], num_sms=num_sms)
    # plans with a decode band only (its launch has "splits"), which BANDS_CONCURRENT's side streams never take
    overlap = (BANDS_OVERLAP and out.is_cuda and not interpreter and len(plan) > 1 and "splits" in plan[0][1]
               and all(band.get("splits", 1) == 1 for _, band in plan))
    pipes = [i for i, (route, band) in enumerate(plan) if route == "pipe"]
    x_mma = None
    if len(pipes) > 1 or (overlap and pipes and pipes[-1] > 0):
        # the x copy in the MMA K order, made once for all of them (and before the first band when a later pipelined
        # band overlaps: no copy kernel between the bands)
        from ..kernels.gemm.mma_k_order import launch_to_mma_k_order

        x_mma = launch_to_mma_k_order(args[0])
    launches = []
    for i, (route, band) in enumerate(plan):
        band_args = args
        if route == "pipe" and x_mma is not None:
            band_args, band = (x_mma,) + tuple(args[1:]), dict(band, x_in_mma_order=True)
        if route == "mma" and early_reads and len(plan) == 1:
            # one launch only: an early-reading program without rows exits without waiting, so a band launched on
            # this one (after_band) could start before x is complete (megamoe/kernels/pdl.py)
            band = dict(band, early_reads=True)
        if overlap and i > 0 and route in ("mma", "pipe") and not band.get("tile_list"):
            band = dict(band, after_band=True)
        launches.append(lambda route=route, band_args=band_args, band=band: _launcher(route)(
            *band_args, expert_offsets=expert_offsets, interpreter=interpreter, **kwargs, **band))
    # not with a decode band (the only launch planned with "splits"): at 16-256 tokens the concurrent launches lost
    # 1-19% wherever one band held the rows (results/gpu_check_v25/e_*, f_*); split-K launches would also share the
    # device's tile counters (nvfp4_splitk.splitk_counters)
    concurrent = (BANDS_CONCURRENT and out.is_cuda and len(plan) > 1
                  and not any("splits" in band for _, band in plan))
    if not concurrent:
        for launch in launches:
            launch()
        return out
    # the bands write disjoint rows (their experts'; the first also the padding rows), so they may overlap: a
    # band's partial last wave then runs beside the next band's tiles (the same bits, in any order). Band i runs
    # on a stream of priority rank i (the first highest): each persistent launch gets its resident programs
    # before the next one's are scheduled, which then take the SMs the earlier ones free.
    main = torch.cuda.current_stream(out.device)
    fork = torch.cuda.Event()
    fork.record(main)
    joins = []
    for stream, launch in zip(_band_streams(out.device, len(launches)), launches):
        stream.wait_event(fork)
        with torch.cuda.stream(stream):
            launch()
        joins.append(torch.cuda.Event())
        joins[-1].record(stream)
    for done in joins:  # x_mma and out are the main stream's: it waits for every band before reusing them
        main.wait_event(done)
    return out


# Band launches on side streams (the banded route with BANDS_CONCURRENT): created on first use, per device, and kept
# (the documented cache of this module; graphs captured with them keep referring to them). Stream i has priority
# BAND_STREAM_PRIORITY + i (lower = higher priority; CUDA clamps to the device's range, [-5, 0] on sm_90).
_BAND_STREAMS: dict = {}
BAND_STREAM_PRIORITY = -5


def _band_streams(device: torch.device, count: int) -> list:
    """``count`` side streams of ``device`` for :func:`_launch_banded`, in falling priority (the same every call)."""
    streams = _BAND_STREAMS.setdefault(device.index if device.index is not None else torch.cuda.current_device(), [])
    while len(streams) < count:
        streams.append(torch.cuda.Stream(device, priority=min(0, BAND_STREAM_PRIORITY + len(streams))))
    return streams[:count]


#: A grouped GEMM of ONE expert (the MoE layer's shared expert) with MMA_SMALL_BAND_ROWS < rows <= this runs the
#: mma.sync decode kernel in 32-row chunks with planned split-K (:func:`plan_row_bands`) instead of the pipelined
#: bands, whose 64-row band has N / 256 tiles: the V4-Flash shared expert at 64 tokens took 43 + 24 us for ~14 MB of
#: weights (results/gpu_check_v33/probe_moe_decode_d_*.md), 30 + 24 us this way. 0 (default): off, since the layer
#: gained only 1.005-1.028x (V4-Flash, 9-256 tokens) and 0.987-1.006x (V4-Pro): NOTES_moe_decode.md, "The shared
#: expert at 9-256 tokens". Env ``MEGAMOE_ONE_EXPERT_SPLITK_MAX_ROWS``. Its split-K shares the device's tile
#: counters (``nvfp4_splitk.splitk_counters``): not for a shared expert on a side stream beside other split-K launches.
ONE_EXPERT_SPLITK_MAX_ROWS = int(os.environ.get("MEGAMOE_ONE_EXPERT_SPLITK_MAX_ROWS", "0") or "0")

#: Dense w4a16 GEMMs (no bias) with at least this many rows run as a grouped GEMM of one expert holding every row
#: (route "dense-pipe"), i.e. on the pipelined wgmma kernel of the MoE layer instead of the Triton tensor-core kernel.
#: H100, the V4 attention projections (``results/gpu_check_v30/f_dense_prefill.md``): 1.16-1.57x from 512 rows on
#: all six shapes; at 256 rows 0.33-0.93x on five of them.
DENSE_PIPE_MIN_ROWS = 512


def _dense_as_one_expert(x: torch.Tensor, weight: NVFP4Tensor, out: torch.Tensor | None, **grouped) -> torch.Tensor:
    """``x @ dequant(weight).T`` (dense, no bias) through :func:`nvfp4_grouped_mm` with one expert holding all M rows
    (the global scale 0-d or per row (N, 1) -> (1, N, 1)); the offsets are one device fill (captured in graphs).
    ``grouped``: further keywords of :func:`nvfp4_grouped_mm` (mode, activation, swiglu_limit)."""
    m = x.shape[0]
    offsets = torch.full((1,), m, dtype=torch.int32, device=x.device)
    return nvfp4_grouped_mm(x, _reference.one_expert_weight(weight), offsets, out=out, max_rows_per_expert=m,
                            **grouped)


#: Route "dense-bf16" of a dense w4a16 GEMM without bias, when the caller passes the weight's
#: :class:`HostGlobalScale`: the weight is dequantized to bf16 WITHOUT its global scale (exact: e2m1 x E4M3 has at
#: most 6 significant bits and lies in [2**-10, 2688], which bf16 holds; ``launch_dequantize(unscaled=True)``), then
#: cuBLAS multiplies in float32 and applies the global scale as its alpha before the one bf16 rounding
#: (``torch.addmm(beta=0, alpha=...)``, one call per run of the scale, cuBLAS's reduced-precision (bf16) split-K
#: reductions disallowed). The same dot products as the other routes, in another order. It runs from
#: DENSE_BF16_MIN_ROWS rows where N <= DENSE_BF16_NARROW_N, and from DENSE_BF16_WIDE_MIN_ROWS rows for wider weights
#: (:func:`dense_bf16_preferred`): the dequantize costs ~N K, what cuBLAS saves ~M N K, and the kernels' routes do
#: best on wide N (H100, ``benchmarks/bench_dense_prefill.py``, NOTES_gemm.md v30). Env ``MEGAMOE_DENSE_BF16=0``: off.
DENSE_BF16_MIN_ROWS = 512
DENSE_BF16_NARROW_N = 4096
DENSE_BF16_WIDE_MIN_ROWS = 1024
DENSE_BF16_ROUTE = os.environ.get("MEGAMOE_DENSE_BF16", "1").strip() not in ("", "0")
#: :func:`host_global_scale` gives up (returns None) on a global scale with more runs of equal values than this: a
#: fused weight has one run per part; a true per-row scale keeps the kernels' routes.
HOST_SCALE_MAX_SEGMENTS = 16


@dataclass(frozen=True)
class HostGlobalScale:
    """A host copy of an NVFP4 weight's global scale, for route "dense-bf16" (cuBLAS's alpha is a host float).

    segments: ((row_start, row_stop, value), ...) covering rows [0, N) in order, the scale constant on each; None
    for a scale of more than :data:`HOST_SCALE_MAX_SEGMENTS` runs (``host_global_scale(..., device_scale_ok=True)``),
    which only the route's SwiGLU variant takes (it applies the scale on the device).
    source: (data_ptr, version counter, shape) of the ``global_scale`` tensor it was read from; :func:`nvfp4_linear`
    compares it with the weight's (host metadata) and raises ValueError on a mismatch, so a copy read from another
    weight, or from one changed in place since, is refused instead of used. Build it with :func:`host_global_scale`.
    """

    segments: tuple
    source: tuple


def host_global_scale(weight: NVFP4Tensor, *, device_scale_ok: bool = False) -> HostGlobalScale | None:
    """Read ``weight.global_scale`` to the host once (a device sync: call it at load / construction time, never in a
    hot path) as runs of equal values. Returns None where route "dense-bf16" cannot use it: more than
    :data:`HOST_SCALE_MAX_SEGMENTS` runs, or a value that is not finite and positive (the kernels' routes keep
    those).

    weight: a 2-D :class:`NVFP4Tensor` whose global scale is 0-d or (N, 1) (broadcastable over its N rows).
    device_scale_ok: with more runs than :data:`HOST_SCALE_MAX_SEGMENTS`, return a copy without segments instead of
    None: enough for ``nvfp4_linear(activation="swiglu")``, whose route applies the scale on the device (a gate/up
    weight interleaved from separately scaled gate and up parts alternates its scale row by row).
    """
    if not isinstance(weight, NVFP4Tensor):
        raise TypeError(f"weight: expected an NVFP4Tensor, got {type(weight).__name__}")
    if len(weight.shape) != 2:
        raise ValueError(f"weight: expected a 2-D NVFP4 weight, got shape {tuple(weight.shape)}")
    gs = weight.global_scale
    n = int(weight.shape[0])
    if gs.numel() == 1:
        runs = [(0, n, float(gs.reshape(()).item()))]
    else:
        if gs.numel() != n:
            return None
        values = gs.reshape(-1).tolist()
        runs, start = [], 0
        for i in range(1, n + 1):
            if i == n or values[i] != values[start]:
                runs.append((start, i, float(values[start])))
                start = i
    if any(not (math.isfinite(v) and v > 0) for _, _, v in runs):
        return None
    if len(runs) > HOST_SCALE_MAX_SEGMENTS:
        return HostGlobalScale(None, _scale_source(gs)) if device_scale_ok else None
    return HostGlobalScale(tuple(runs), _scale_source(gs))


def _scale_source(gs: torch.Tensor) -> tuple:
    """The host identity of a global-scale tensor that :class:`HostGlobalScale` records and checks."""
    return gs.data_ptr(), gs._version, tuple(gs.shape)


def _check_host_scale(host_scale, weight: NVFP4Tensor) -> None:
    if host_scale is None:
        return
    if not isinstance(host_scale, HostGlobalScale):
        raise TypeError(f"host_scale: expected a HostGlobalScale (megamoe.ops.gemm.host_global_scale) or None, got "
                        f"{type(host_scale).__name__}")
    if host_scale.source != _scale_source(weight.global_scale):
        raise ValueError("host_scale: it was not read from this weight's global_scale, or that tensor changed in "
                         "place since; rebuild it with host_global_scale(weight)")


def dense_bf16_preferred(num_rows: int, n: int) -> bool:
    """Whether a dense GEMM of ``num_rows`` rows and N = ``n`` takes route "dense-bf16" (given the host scale; host
    values only, see :data:`DENSE_BF16_MIN_ROWS`)."""
    return DENSE_BF16_ROUTE and num_rows >= (DENSE_BF16_MIN_ROWS if n <= DENSE_BF16_NARROW_N
                                             else DENSE_BF16_WIDE_MIN_ROWS)


def _dense_bf16(x: torch.Tensor, weight: NVFP4Tensor, host_scale: HostGlobalScale, out: torch.Tensor,
                swiglu: bool = False, swiglu_limit=None) -> torch.Tensor:
    """Route "dense-bf16" (see :data:`DENSE_BF16_MIN_ROWS`): x (M, K) bf16, weight (N, K) row-major -> out (M, N).
    ``swiglu``: cuBLAS writes the float32 product (M, N) instead, and a SwiGLU kernel applies the global scale (read
    on the device) and the SwiGLU of each gate/up column pair -> out (M, N // 2) (the kernels' epilogue)."""
    from ..kernels.quantize import launch_dequantize

    n, k = weight.shape
    w16 = torch.empty((n, k), dtype=torch.bfloat16, device=x.device)  # the caching allocator's block, per call
    unread = weight.global_scale.reshape(-1)[:1]  # one element (the per-tensor variant); the unscaled kernel ignores it
    launch_dequantize(weight.data.contiguous(), weight.block_scale.contiguous().view(torch.uint8), unread, w16,
                      unscaled=True)
    # float32 sums only: with reduced-precision reductions allowed (torch's default) cuBLAS may pick split-K algorithms
    # whose partials are bf16 (H100: a row-strided out gave errors of ~2**-9 of the partials' size; CUDA test)
    matmul = torch.backends.cuda.matmul
    allowed = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = False
    try:
        if swiglu:
            y = bf16_linear_fp32(x, w16)
        else:
            for start, stop, alpha in host_scale.segments:
                dst = out if (start, stop) == (0, n) else out[:, start:stop]
                torch.addmm(dst, x, w16[start:stop].t(), beta=0, alpha=alpha, out=dst)
    finally:
        matmul.allow_bf16_reduced_precision_reduction = allowed
    if swiglu:
        from ..kernels.gemm.swiglu_rows import launch_scaled_swiglu

        launch_scaled_swiglu(y, weight.global_scale, out, swiglu_limit)
    return out


def _launcher(route: str):
    from ..kernels.gemm import (nvfp4_gemm, nvfp4_gemv, nvfp4_mma_decode, nvfp4_splitk, nvfp4_wgmma, nvfp4_wgmma_pipe,
                                nvfp4_wgmma_ws)

    return {"splitk": nvfp4_splitk.launch_nvfp4_splitk, "banded": _launch_banded,
            "mma": nvfp4_mma_decode.launch_nvfp4_mma_decode, "wgmma": nvfp4_wgmma.launch_nvfp4_wgmma,
            "pipe": nvfp4_wgmma_pipe.launch_nvfp4_wgmma_pipe, "ws": nvfp4_wgmma_ws.launch_nvfp4_wgmma_ws,
            "gemv": nvfp4_gemv.launch_nvfp4_gemv, "tensor-core": nvfp4_gemm.launch_nvfp4_gemm}[route]


def nvfp4_linear(x, weight: NVFP4Tensor, bias=None, *, mode="w4a16", out=None,
                 host_scale=None, activation=None, swiglu_limit=None, weight_settled=False) -> torch.Tensor:
    """``x @ dequant(weight).T (+ bias)`` with NVFP4 weights.

    x: (M, K) bf16.  weight: NVFP4Tensor of logical shape (N, K): data (N, K//2)
    uint8 (low nibble = even element), block_scale (N, K//16) float8_e4m3fn,
    global_scale float32 0-d or (N, 1).  bias: None or (N,) bf16/fp32.
    mode: "w4a16", "w4a4" or "w4a8" (K % 128 == 0; M < 48 on CUDA runs w4a16, :func:`w4a8_kernel_mode`).
    out: optional (M, N) bf16 buffer.
    host_scale: None or the weight's :class:`HostGlobalScale` (:func:`host_global_scale`, read at load time). With
    it, a w4a16 GEMM without bias on CUDA with enough rows (:func:`dense_bf16_preferred`: 512, or 1024 for N > 4096)
    runs route "dense-bf16" (the weight dequantized exactly to bf16, cuBLAS with the global scale as alpha);
    otherwise it changes nothing.
    activation: None, or "swiglu" for a weight in the :func:`interleave_gate_up` layout (N even): out is then
    (M, N // 2) bf16 = silu(min(gate, limit)) * clamp(up, -limit, limit) of the float32 products (no clamp when
    ``swiglu_limit`` is None), as :func:`nvfp4_grouped_mm`'s; no bias with it. At the split-K route's sizes the
    SwiGLU runs in its reduction, on route "dense-bf16" (with ``host_scale``) after cuBLAS's float32 product;
    elsewhere the GEMM runs as a grouped GEMM of one expert.
    weight_settled: the caller's promise that ``weight`` was final before the kernel that precedes this call on the
        stream started (a model's parameters: ``DenseLinear`` passes True). A split-K launch with PDL (kernel name
        "splitk" in :mod:`megamoe.kernels.pdl`'s settings) may then read its first weights before its PDL wait
        (``nvfp4_splitk.splitk_early_reads``); the same bits either way. A wrong promise is a race: leave it False
        for a weight written by the kernel just before.
    Returns (M, N) bf16 (float32 accumulation, one final rounding).
    """
    if not isinstance(weight_settled, bool):
        raise TypeError(f"weight_settled: expected a bool, got {type(weight_settled).__name__}")
    _check_x(x, None)
    _check_weight(weight, 2, x)
    n, k = weight.shape
    _check_x(x, k)
    _check_mode(mode)
    _check_w4a8_k(mode, k)
    _check_activation(activation, swiglu_limit, n)
    m = x.shape[0]
    n_out = n // 2 if activation == "swiglu" else n
    _check_out(out, (m, n_out), x)
    if activation is not None and bias is not None:
        raise ValueError("bias: not supported with activation='swiglu' (expected None)")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias: expected a tensor or None, got {type(bias).__name__}")
        if bias.dtype not in (torch.bfloat16, torch.float32, torch.float16):
            raise TypeError(f"bias: expected a float tensor, got {bias.dtype}")
        if tuple(bias.shape) != (n,):
            raise ValueError(f"bias: expected shape ({n},), got {tuple(bias.shape)}")
        if bias.device != x.device:
            raise ValueError(f"bias: expected device {x.device}, got {bias.device}")
    _check_host_scale(host_scale, weight)
    if not use_triton(x):
        return _reference.nvfp4_linear(x, weight, bias, mode=mode, out=out, activation=activation,
                                       swiglu_limit=swiglu_limit)
    if out is None:
        out = torch.empty((m, n_out), dtype=torch.bfloat16, device=x.device)
    swiglu = activation == "swiglu"
    if (host_scale is not None and (swiglu or host_scale.segments is not None) and x.is_cuda and mode == "w4a16"
            and bias is None and dense_bf16_preferred(m, n) and weight.row_interleave == 1 and m * n * k > 0):
        return _dense_bf16(x, weight, host_scale, out, swiglu, swiglu_limit)
    if swiglu and mode == "w4a8":
        return _dense_as_one_expert(x, weight, out, mode=mode, activation=activation, swiglu_limit=swiglu_limit)
    if mode == "w4a8" and w4a8_kernel_mode(x, m, None) == "w4a8":
        from ..kernels.gemm import nvfp4_w4a8_pipe
        from ..kernels.gemm.nvfp4_w4a8 import launch_nvfp4_w4a8

        bias_c = bias.contiguous() if bias is not None else None
        if nvfp4_w4a8_pipe.W4A8_PIPE_ROUTE and nvfp4_w4a8_pipe.w4a8_pipe_supported(x, weight.data):
            # the pipelined FP8 kernel as a grouped GEMM of one expert holding the M rows (v1 runs at 0.6-0.8x of
            # the w4a16 kernels: NOTES_gemm.md "w4a8 in the layer")
            xq, xs = _fp8_activations(x, mma_order=True)
            offsets = torch.full((1,), m, dtype=torch.int32, device=x.device)  # a fill launch, captured in graphs
            return nvfp4_w4a8_pipe.launch_nvfp4_w4a8_pipe(
                xq, xs, weight.data.contiguous()[None], weight.block_scale.contiguous()[None], weight.global_scale,
                out, expert_offsets=offsets, bias=bias_c, config=nvfp4_w4a8_pipe.dense_config(m))
        xq, xs = _fp8_activations(x)
        return launch_nvfp4_w4a8(xq, xs, weight.data.contiguous(), weight.block_scale.contiguous(),
                                 weight.global_scale, out, bias=bias_c, interpreter=not x.is_cuda)
    xa = _contiguous_rows(_quantized_activations(x) if mode == "w4a4" else x)
    data = weight.data.contiguous()
    route = decode_route(xa, data, m, None, n, k)
    if swiglu and route != "splitk":  # the SwiGLU epilogue of the grouped kernels
        return _dense_as_one_expert(x, weight, out, mode=mode, activation=activation, swiglu_limit=swiglu_limit)
    if route == "dense-pipe":
        if bias is None and mode == "w4a16":
            return _dense_as_one_expert(xa, weight, out)
        route = "tensor-core"
    launch = _launcher(route)
    return launch(
        xa,
        data,
        weight.block_scale.contiguous(),
        weight.global_scale,
        out,
        bias=bias.contiguous() if bias is not None else None,
        interpreter=not x.is_cuda,
        **(dict(swiglu=True, swiglu_limit=swiglu_limit) if swiglu else {}),
        **({"weight_settled": True} if weight_settled and route == "splitk" else {}),
    )


def dense_splitk_preferred(num_rows: int, n: int, k: int) -> bool:
    """Whether a dense CUDA GEMM of ``num_rows`` rows and an (N, K) weight takes the split-K route (host shapes; the
    route also needs 4-byte aligned rows, which :func:`nvfp4_linear` checks)."""
    from ..kernels.gemm import nvfp4_splitk

    return nvfp4_splitk.splitk_preferred(num_rows, n, k)


def splitk_uses_tile_counters(num_rows: int) -> bool:
    """Whether a split-K launch of ``num_rows`` rows may reduce in one launch on the device's tile counters
    (``nvfp4_splitk.splitk_counters``), which two concurrent split-K launches would share (host shapes only)."""
    from ..kernels.gemm import nvfp4_splitk

    return nvfp4_splitk.default_single_launch(num_rows)


def bf16_linear_fp32_error_units(k: int) -> int:
    """The error bound's factor of :func:`bf16_linear_fp32` on CUDA: ``|y - exact| <= factor * 2**-24 *
    sum_k |x_k| |w_nk|``. The products are exact; the tensor cores' float32 sums may truncate (at most 2u relative per
    16-product block, K / 16 blocks in sequence: K / 8), the tile kernel's promoted chunks stay within
    ``2 BLOCK_K + K / BLOCK_K + 4`` (BLOCK_K <= 128), plus a margin for split-K reductions."""
    return k // 8 + 2 * 128 + 64


def bf16_linear_fp32(x, weight, *, out=None) -> torch.Tensor:
    """``x.float() @ weight.float().T`` in float32 for bf16 operands: the float32 linears of DeepSeek-V4 whose weights
    the checkpoint holds in bf16 (the compressor projections), without float32 weight copies.

    x: (M, K) bf16. weight: (N, K) bf16 tensor on x's device. out: optional (M, N) float32 buffer (unit stride along
    the last dimension). Returns (M, N) float32. Every product of two bf16 values is exact in float32; only the
    summation order differs from the float32 linear, within :func:`bf16_linear_fp32_error_units`.
    CUDA: cuBLAS's bf16 GEMM with float32 output (``torch.mm(..., out_dtype=torch.float32)``; the tile kernel of
    ``megamoe/kernels/router_logits.py`` where this torch lacks it). Measured against the float32 path on float32
    weight copies (H100, ``benchmarks/results/gpu_check_v30/b_bf16_linear.md``): 1.4-1.6x at M = 1, 1.9-4x at
    M = 2-16, 6-9x at M = 512-4096. CPU: the float32 reference (the same bits as the float32 linear).
    """
    _check_x(x, None)
    check_tensor(weight, "weight", torch.bfloat16, 2, x.device)
    n, k = weight.shape
    _check_x(x, k)
    m = x.shape[0]
    if out is not None:
        check_tensor(out, "out", torch.float32, 2, x.device)
        if tuple(out.shape) != (m, n):
            raise ValueError(f"out: expected shape {(m, n)}, got {tuple(out.shape)}")
        if n > 1 and out.stride(1) != 1:
            raise ValueError("out: expected unit stride along the last dimension")
    if not x.is_cuda:
        return _reference.bf16_linear_fp32(x, weight, out=out)
    if MM_OUT_DTYPE:
        if out is not None and out.is_contiguous():
            return torch.mm(x, weight.t(), out_dtype=torch.float32, out=out)
        y = torch.mm(x, weight.t(), out_dtype=torch.float32)
        return y if out is None else out.copy_(y)
    from ..kernels.router_logits import launch_router_logits

    return launch_router_logits(_contiguous_rows(x), _contiguous_rows(weight), out)


#: Whether ``torch.mm`` takes ``out_dtype=torch.float32`` for bf16 operands on CUDA (torch >= 2.8): a fixed host fact,
#: so eager calls and graph captures take the same route. Without it :func:`bf16_linear_fp32` runs the tile kernel.
MM_OUT_DTYPE = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 8)


def nvfp4_grouped_mm(
    x,
    weight: NVFP4Tensor,
    expert_offsets,
    *,
    mode="w4a16",
    out=None,
    row_index=None,
    activation=None,
    swiglu_limit=None,
    max_rows_per_expert=None,
    x_order="plain",
    out_order="plain",
    index_settled=False,
) -> torch.Tensor:
    """Grouped GEMM over experts with NVFP4 weights (rows sorted by expert).

    x: (T, K) bf16 rows sorted by expert, or, with ``row_index`` (T,) int32 on
        x's device, x: (S, K) and output row t reads ``x[row_index[t]]`` (the
        dispatch gather fused into the activation loads).
    weight: NVFP4Tensor of logical shape (E, N, K): data (E, N, K//2) uint8,
        block_scale (E, N, K//16) float8_e4m3fn, global_scale fp32 0-d,
        (E, 1, 1) or (E, N, 1); row-major, or ``row_interleave`` 4 (modes "w4a16" and "w4a8"; on CUDA the Gluon
        mma.sync / pipelined routes and the pipelined FP8 kernel read it, others raise ValueError; on CPU a row-major
        copy is used).
    expert_offsets: (E,) int32 cumulative, non-decreasing row ends on the device
        (expert e owns rows [offsets[e-1], offsets[e])); never read on the host. Any stride (expert_offsets
        and row_index are copied when not contiguous).
        Rows >= offsets[E-1] are written as zeros.
    activation: None -> out (T, N) bf16; "swiglu" -> out (T, N//2) bf16 =
        silu(min(gate, limit)) * clamp(up, -limit, limit) for weights in the
        :func:`interleave_gate_up` layout (no clamp when swiglu_limit is None; else a finite positive number).
    mode: "w4a16", "w4a4" or "w4a8" (K % 128 == 0; the FP8 quantizer runs on the (S, K) source rows,
        the gather stays fused; under 48 rows per expert on CUDA it runs w4a16, :func:`w4a8_kernel_mode`).
    out: optional preallocated bf16 buffer.
    max_rows_per_expert: None or a host int, the most rows any expert can have
        (e.g. the token count of a top-k MoE layer); only sizes launches
        (:func:`plan_row_bands`): results never depend on it, even if wrong.
    x_order / out_order: "plain" (default) or "paired": x holds its K columns, or the SwiGLU output is written, in
        the paired order of :func:`megamoe.format.mma_order.to_paired_order` (a column permutation within every 8;
        the values are those of the plain order). The decode kernel then skips the byte permutes that build its MMA
        operand; a layer chains them (``out_order="paired"`` feeding the next GEMM's ``x_order="paired"``). On CUDA
        only where :func:`paired_order_supported` says so (decode sizes, mode "w4a16"), else ValueError; on CPU the
        reference permutes.
    index_settled: the caller's promise that ``expert_offsets`` and ``row_index`` were final before the kernel that
        writes ``x`` started (a MoE layer's down GEMM: the routing ran before gate_up). The mma.sync decode launches
        may then read them, and their first weights, before their PDL wait for ``x`` (``early_reads``,
        :data:`megamoe.kernels.pdl.PDL_EARLY_READS`); the same bits either way. A wrong promise is a race: pass it
        only when the order of launches guarantees it.
    """
    _check_x(x, None)
    _check_weight(weight, 3, x, interleave_ok=True)
    if not isinstance(index_settled, bool):
        raise TypeError(f"index_settled: expected a bool, got {type(index_settled).__name__}")
    num_experts, n, k = weight.shape
    for name, order in (("x_order", x_order), ("out_order", out_order)):
        if order not in ("plain", "paired"):
            raise ValueError(f"{name}: expected 'plain' or 'paired', got {order!r}")
    if out_order == "paired" and (activation != "swiglu" or (n // 2) % 8):
        raise ValueError(f"out_order: 'paired' needs activation='swiglu' and N // 2 a multiple of 8, got "
                         f"activation={activation!r}, N={n}")
    if x_order == "paired" and k % 8:
        raise ValueError(f"x_order: 'paired' needs K a multiple of 8, got K={k}")
    _check_x(x, k)
    _check_mode(mode)
    _check_w4a8_k(mode, k)
    if weight.row_interleave != 1 and mode == "w4a4":
        raise ValueError(f"mode: weights with row_interleave={weight.row_interleave} run 'w4a16' or 'w4a8' only, got "
                         f"{mode!r}")
    _check_activation(activation, swiglu_limit, n)
    if num_experts == 0:
        raise ValueError("weight: expected at least one expert (E >= 1)")
    _check_index(expert_offsets, "expert_offsets", num_experts, x)
    if row_index is not None:
        _check_index(row_index, "row_index", None, x)
        num_rows = row_index.shape[0]
    else:
        num_rows = x.shape[0]
    n_out = n // 2 if activation == "swiglu" else n
    _check_out(out, (num_rows, n_out), x)
    if max_rows_per_expert is not None and (isinstance(max_rows_per_expert, bool)
                                            or not isinstance(max_rows_per_expert, int) or max_rows_per_expert < 1):
        raise ValueError(f"max_rows_per_expert: expected None or a positive int, got {max_rows_per_expert!r}")
    # the kernels read the index vectors as flat memory: any stride is accepted (a copy when not contiguous)
    expert_offsets = expert_offsets.contiguous()
    if row_index is not None:
        row_index = row_index.contiguous()
    paired = x_order == "paired" or out_order == "paired"
    if paired and not x.is_cuda:  # CPU (reference, interpreter): the plain order's values, permuted
        result = nvfp4_grouped_mm(from_paired_order(x) if x_order == "paired" else x, weight, expert_offsets,
                                  mode=mode, out=None if out_order == "paired" else out, row_index=row_index,
                                  activation=activation, swiglu_limit=swiglu_limit,
                                  max_rows_per_expert=max_rows_per_expert)
        return to_paired_order(result, out=out) if out_order == "paired" else result
    if not use_triton(x):
        if row_index is not None:  # same drop rule and flag as the kernels (megamoe/ops/errors.py)
            _record_row_index(x, row_index, expert_offsets)
        return _reference.nvfp4_grouped_mm(
            x, weight.rows_in_order(), expert_offsets, mode=mode, out=out, row_index=row_index,
            activation=activation, swiglu_limit=swiglu_limit,
        )
    if paired and not paired_order_supported(x, weight, num_rows, mode=mode, max_rows_per_expert=max_rows_per_expert):
        raise ValueError(f"x_order / out_order: 'paired' runs on the mma.sync decode kernel's register path only (mode "
                         f"'w4a16', decode sizes); this GEMM (rows {num_rows}, E {num_experts}, N {n}, K {k}, mode "
                         f"{mode!r}) would not (paired_order_supported)")
    if out is None:
        out = torch.empty((num_rows, n_out), dtype=torch.bfloat16, device=x.device)
    if mode == "w4a8" and w4a8_kernel_mode(x, num_rows, num_experts) == "w4a8":
        from ..kernels.gemm import nvfp4_w4a8_pipe
        from ..kernels.gemm.nvfp4_w4a8 import launch_nvfp4_w4a8

        if nvfp4_w4a8_pipe.W4A8_PIPE_ROUTE and nvfp4_w4a8_pipe.w4a8_pipe_supported(x, weight.data,
                                                                                   weight.row_interleave):
            xq, xs = _fp8_activations(x, mma_order=True)
            args = (xq, xs, weight.data.contiguous(), weight.block_scale.contiguous(), weight.global_scale, out)
            kw = dict(expert_offsets=expert_offsets, row_index=row_index, swiglu=activation == "swiglu",
                      swiglu_limit=swiglu_limit, weight_interleave=weight.row_interleave)
            for config, lo, hi, own_pad in nvfp4_w4a8_pipe.band_plan(num_rows, num_experts):  # tiles by row band
                nvfp4_w4a8_pipe.launch_nvfp4_w4a8_pipe(*args, **kw, config=config, row_lo=lo, row_hi=hi,
                                                       own_pad=own_pad)
            return out
        if weight.row_interleave != 1:
            raise ValueError(f"weight: row_interleave={weight.row_interleave} in mode 'w4a8' needs the pipelined FP8 "
                             "kernel (sm_90, K % 256 == 0, W4A8_PIPE_ROUTE on)")
        xq, xs = _fp8_activations(x)
        return launch_nvfp4_w4a8(
            xq, xs, weight.data.contiguous(), weight.block_scale.contiguous(), weight.global_scale, out,
            expert_offsets=expert_offsets, row_index=row_index, swiglu=activation == "swiglu",
            swiglu_limit=swiglu_limit, interpreter=not x.is_cuda,
        )
    xa = _contiguous_rows(_quantized_activations(x) if mode == "w4a4" else x)
    if weight.row_interleave != 1 and not x.is_cuda:  # the interpreter's kernels read row-major weights (tests)
        weight = weight.rows_in_order()
    data = weight.data.contiguous()
    route = decode_route(xa, data, num_rows, num_experts, n, k)
    interleave = {}
    if weight.row_interleave != 1:  # a banded route checks each of its launches (plan_row_bands)
        if route != "banded":
            _check_interleaved_routes([route], weight.row_interleave)
        interleave = dict(weight_interleave=weight.row_interleave)
    launch = _launcher(route)
    return launch(
        xa,
        data,
        weight.block_scale.contiguous(),
        weight.global_scale,
        out,
        expert_offsets=expert_offsets,
        row_index=row_index,
        swiglu=activation == "swiglu",
        swiglu_limit=swiglu_limit,
        interpreter=not x.is_cuda,
        **({"max_rows_per_expert": max_rows_per_expert} if route == "banded" else {}), **interleave,
        **({"x_paired": x_order == "paired", "out_paired": out_order == "paired"} if paired else {}),
        **({"early_reads": True} if index_settled and route in ("banded", "mma") else {}),
    )


def paired_order_supported(x: torch.Tensor, weight: NVFP4Tensor, num_rows: int, *, mode: str = "w4a16",
                           max_rows_per_expert: int | None = None) -> bool:
    """Whether :func:`nvfp4_grouped_mm` of ``x`` (its shape, dtype, device; the values never read) with ``weight``,
    ``num_rows`` output rows and the ``max_rows_per_expert`` hint runs every launch on the mma.sync decode kernel's
    register path, which reads ``x_order="paired"`` and writes ``out_order="paired"``: CUDA, mode "w4a16", the banded
    route with only "mma" bands, none with the cp.async weight ring or x through shared memory. Host shapes only
    (a graph keeps one answer per shape); True on CPU (the reference permutes)."""
    if not x.is_cuda:
        return True
    if mode != "w4a16" or len(weight.shape) != 3:
        return False
    from ..kernels.gemm import nvfp4_mma_decode as mma
    from ..kernels.gemm.nvfp4_gemm import _num_sms

    num_experts, n, k = weight.shape
    data = weight.data
    if decode_route(x, data, num_rows, num_experts, n, k) != "banded":
        return False
    plan = plan_row_bands(num_rows, num_experts, k, max_rows_per_expert, weight_interleave=weight.row_interleave,
                          n=n, num_sms=_num_sms(x.device.index or 0))
    for route, band in plan:
        config = band.get("config")
        if route != "mma" or config is None or (len(config) > 4 and config[4] >= 2) \
                or config[0] in mma.MMA_X_SMEM_BLOCK_M:
            return False
    return True

