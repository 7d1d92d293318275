"""NVFP4 DeepSeek-V4 MoE block and shared expert for Hopper (and CPU).

Pipeline of :meth:`Nvfp4MoE.forward` (all on the device, no host syncs):

1. + 2. router and dispatch (``megamoe.ops.moe.route_dispatch``): up to
   ``FUSED_ROUTE_MAX_TOKENS`` tokens (``router_backend="triton"``, flat top-k)
   ONE launch (``megamoe/kernels/moe_route_dispatch.py``: fp32 gate GEMV,
   scoring, bias, top-k, renormalisation, scaling and the grouping below; ids
   equal to the float64 routing except at float32 near-ties, see that op);
   above, the fp32 gate GEMM (from ``ROUTER_TC_MIN_TOKENS`` bf16 tokens on the
   tensor cores, ``megamoe/kernels/router_logits.py``, under the same routing
   guarantee; below, torch's, ids identical to the reference router) and scoring,
   one Triton kernel for bias, top-k (the reference's tie-break), renormalisation
   and scaling (group-limited configs use torch), then the dispatch
   (``megamoe.ops.moe.dispatch``): stable grouping of the T*k pairs by expert ->
   ``expert_offsets``, ``row_index`` (token of each sorted row), ``inv_perm``;
   one Triton launch up to ``DISPATCH_SORT_MAX_PAIRS`` pairs and two blocked
   launches above (``DISPATCH_KERNEL_MAX_PAIRS`` bounds "auto"; torch sort +
   searchsorted past it; identical outputs);
3. L1: ``nvfp4_grouped_mm(x, w13, expert_offsets, row_index=row_index,
   activation="swiglu")`` -- the row gather is fused into the GEMM's A loads and
   SwiGLU + clamp into its epilogue (w13 stored gate/up *interleaved*, done once
   at load);
   From ``PAIRED_X_MIN_TOKENS`` to ``PAIRED_X_MAX_TOKENS`` tokens (8) the route launch also writes x in the
   decode kernel's paired K order and gate_up reads it and writes ``inter`` in that order (``x_order`` /
   ``out_order="paired"``): the same bits, fewer instructions;
4. L2: ``nvfp4_grouped_mm(inter, w2, expert_offsets)``;
5. combine kernel: ``out[t] = sum_j w[t, j] * y[inv_perm[t*k + j]]`` (float32, one
   bf16 rounding). The shared expert, when as wide as a routed expert
   (DeepSeek-V4), is appended to the stacked weights as group E and every token
   gets it as an extra slot with weight 1.0, so it runs *inside* the same two
   grouped GEMMs (``fuse_shared_expert=True``, default); otherwise it runs as
   its own one-group pipeline and the combine adds its output.

Opt-in single-launch decode (``fused_decode=True`` or ``MEGAMOE_MOE_FUSED_DECODE=1`` at construction; issue 11):
for 1..16 tokens in mode w4a16 with the shared expert fused (or absent), steps 3-5 are ONE persistent launch
(``megamoe/kernels/moe_fused_decode.py``: gate_up + SwiGLU, per-expert device counters, down with the combine
folded in, slot order, one bf16 rounding; deterministic). Its down output stays float32 into the combine (the
multi-launch path rounds it to bf16), so the two paths agree within the float32 bound, not bit for bit.

Hash-routed layers (DeepSeek-V4's first ``num_hash_layers``): load the
``tid2eid`` (vocab, k) table with :meth:`Nvfp4MoE.load_weights` (``tid2eid=``)
and pass the token ids to :meth:`Nvfp4MoE.forward` (``token_ids=``); step 1
then takes the ids from the table (``megamoe.ops.moe.route`` with
``tid2eid``), everything after it is unchanged.

Activation modes: ``"w4a16"`` (bf16 activations) and ``"w4a4"``: the inputs of
both GEMMs are quantized to NVFP4 and decoded back to bf16 before the bf16
tensor-core GEMM (Hopper has no FP4 MMA; this reproduces W4A4 numerics). The
activation global scales are either computed at run time on the device
(per-row, default) or static: set by :meth:`Nvfp4MoE.calibrate` (the seeds'
``compute_activation_global_scales``) or loaded from a checkpoint's
``input_scale``; L2's static scale is per expert, gathered per sorted row on
the device. ``"w4a8"`` (prefill): both GEMMs run on FP8 tensor cores (activations
quantized to FP8 per token inside ``nvfp4_grouped_mm``, NVFP4 weights decoded to
FP8 in the kernel); GEMMs with fewer than 48 rows per expert on average keep the
w4a16 kernels (``megamoe.ops.gemm.w4a8_kernel_mode``; e.g. V4-Flash's routed
experts below ~2060 tokens, the separate shared expert below 48), and
:meth:`reference_forward` follows the same rule.

Buffers are preallocated for ``max_num_tokens``; ``forward`` returns a view of
the layer's output buffer (valid until the next call; clone it to keep it).
CUDA graphs: :meth:`capture` (warm-up, capture, returns a replay callable), or
by hand: warm up ``forward`` once on a side stream, then capture it with
``torch.cuda.graph`` on a static input tensor. ``torch.compile``: call
:meth:`compiled_forward` (the ``megamoe::moe_layer_forward`` custom op, opaque to
the compiler, with a fake implementation).
"""
from __future__ import annotations

import itertools
import os
import weakref
from typing import Optional

import torch

from ..format.tensor import NVFP4Tensor
from ..models.config import MoEConfig
from ..ops import errors
from ..ops import gemm as gemm_ops
from ..ops import moe as moe_ops
from ..ops import moe_fused_decode as fused_ops
from ..ops._dispatch import resolve_device
from ..ops._validate import check_positive_finite
import importlib

# the module (ops/__init__ re-exports a function of that name)
quantize_ops = importlib.import_module("megamoe.ops.quantize")
from ..reference import moe as moe_reference
from ..reference.gemm import one_expert_weight

MODES = ("w4a16", "w4a4", "w4a8")


_resolve_device = resolve_device


def _check_count(name: str, value) -> None:
    """A positive int (bools rejected) or ValueError naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


def _check_nvfp4(t, name: str, shape: tuple, device) -> None:
    if not isinstance(t, NVFP4Tensor):
        raise TypeError(f"{name}: expected an NVFP4Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected logical shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != torch.device(device):
        raise ValueError(f"{name}: expected device {device}, got {t.device}")


def _check_hidden(hidden_states, hidden: int, max_num_tokens: int, device) -> None:
    if not isinstance(hidden_states, torch.Tensor):
        raise TypeError(f"hidden_states: expected a torch.Tensor, got {type(hidden_states).__name__}")
    if hidden_states.dtype != torch.bfloat16:
        raise TypeError(f"hidden_states: expected bfloat16, got {hidden_states.dtype}")
    if hidden_states.dim() != 2 or hidden_states.shape[1] != hidden:
        raise ValueError(f"hidden_states: expected shape (T, {hidden}), got {tuple(hidden_states.shape)}")
    if hidden_states.shape[0] > max_num_tokens:
        raise ValueError(
            f"hidden_states: {hidden_states.shape[0]} tokens exceed max_num_tokens={max_num_tokens} "
            "(the preallocated buffers); split the batch or build the layer with a larger max_num_tokens"
        )
    if hidden_states.device != torch.device(device):
        raise ValueError(f"hidden_states: expected device {device}, got {hidden_states.device}")


def _quant_roundtrip(x: torch.Tensor, global_scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """bf16 -> NVFP4 (given global scale) -> bf16 into ``out`` (sync-free on the kernel path)."""
    if x.shape[0] == 0:
        return out
    return quantize_ops.dequantize(quantize_ops.quantize(x, global_scale), torch.bfloat16, out=out)


class Nvfp4SharedExpert:
    """Dense SwiGLU FFN with NVFP4 weights (DeepSeek's shared expert), one expert group.

    Weights: ``w13`` NVFP4Tensor (2*I, H), rows ``[gate(I); up(I)]`` (checkpoint
    order; interleaved internally once), ``w2`` NVFP4Tensor (H, I). forward:
    (T, H) bf16 -> (T, H) bf16 (a view of a preallocated buffer).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, *, max_num_tokens: int, device="cpu",
                 swiglu_limit: float | None = 10.0, mode: str = "w4a16"):
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        _check_count("max_num_tokens", max_num_tokens)
        for name, value in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            _check_count(name, value)
            if value % 16:  # the reduction width of one of the two GEMMs: whole 16-element NVFP4 blocks
                raise ValueError(f"{name}: expected a multiple of 16 (NVFP4 blocks), got {value}")
        if swiglu_limit is not None:
            check_positive_finite(swiglu_limit, "swiglu_limit")
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.max_num_tokens, self.device, self.mode = max_num_tokens, _resolve_device(device), mode
        self.swiglu_limit = swiglu_limit
        self.w13 = self.w2 = None  # checkpoint-order weights (reference)
        self._w13_dense = None  # (2I, H) interleaved (nvfp4_linear's dense routes)
        self._w13_kernel = self._w2_kernel = None  # (1, 2I, H) interleaved, (1, H, I): views of the same bytes
        self.input_scales: dict | None = None  # static w4a4 scales {"l1": 0-d, "l2": 0-d} or None (dynamic)
        dev = self.device
        self._offsets = torch.empty(1, dtype=torch.int32, device=dev)
        self._x_q = torch.empty((max_num_tokens, hidden_size), dtype=torch.bfloat16, device=dev)
        self._inter = torch.empty((max_num_tokens, intermediate_size), dtype=torch.bfloat16, device=dev)
        self._inter_q = torch.empty_like(self._inter)
        self._out = torch.empty((max_num_tokens, hidden_size), dtype=torch.bfloat16, device=dev)

    def load_weights(self, w13: NVFP4Tensor, w2: NVFP4Tensor) -> None:
        _check_nvfp4(w13, "w13", (2 * self.intermediate_size, self.hidden_size), self.device)
        _check_nvfp4(w2, "w2", (self.hidden_size, self.intermediate_size), self.device)
        self.w13, self.w2 = w13, w2
        self._w13_dense = gemm_ops.interleave_gate_up(w13)
        self._w13_kernel = one_expert_weight(self._w13_dense)
        self._w2_kernel = one_expert_weight(w2)
        # host copies of the global scales (a device read, here at load time): route "dense-bf16" of nvfp4_linear
        self._w13_host = self._w2_host = None
        if self._w13_dense.data.is_cuda:
            self._w13_host = gemm_ops.host_global_scale(self._w13_dense, device_scale_ok=True)
            self._w2_host = gemm_ops.host_global_scale(w2) if w2.row_interleave == 1 else None

    def dense_routes(self, hidden_states: torch.Tensor, gemm_mode: str, splitk: bool = True) -> tuple[bool, bool]:
        """(gate_up, down): whether each GEMM of this batch runs as a dense GEMM (``nvfp4_linear``) instead of a
        grouped GEMM of one expert: CUDA, w4a16 numerics, and the shape's split-K route (:data:`SHARED_SPLITK` and
        ``splitk``; the SwiGLU in its reduction) or its route "dense-bf16" (:data:`SHARED_DENSE_BF16`, the weight's
        host scale read at load; cuBLAS, the SwiGLU after its float32 product). Host shapes only."""
        if not (hidden_states.is_cuda and gemm_mode == "w4a16"):
            return False, False
        t, h, i = hidden_states.shape[0], self.hidden_size, self.intermediate_size

        def dense(n, k, host_scale):
            return ((splitk and SHARED_SPLITK and gemm_ops.dense_splitk_preferred(t, n, k))
                    or (SHARED_DENSE_BF16 and host_scale is not None and gemm_ops.dense_bf16_preferred(t, n)))

        # up to SHARED_DOWN_LINEAR_MAX_ROWS the down GEMM also takes nvfp4_linear's other routes (the Triton
        # tensor-core kernel above split-K's rows): ahead of the one-expert grouped plan there
        down = dense(h, i, self._w2_host) or (splitk and SHARED_SPLITK and t <= SHARED_DOWN_LINEAR_MAX_ROWS)
        return dense(2 * i, h, self._w13_host), self.w2.row_interleave == 1 and down

    def forward(self, hidden_states: torch.Tensor, out: torch.Tensor | None = None, *,
                splitk: bool = True) -> torch.Tensor:
        """(T, H) bf16 -> (T, H) bf16 = W2 @ swiglu(W13 @ x).

        splitk: False keeps both GEMMs off the split-K route (:meth:`dense_routes`), e.g. on a side stream beside
        other split-K launches, whose single-launch reduction shares the device's tile counters (``nvfp4_splitk``)."""
        if self._w13_kernel is None:
            raise RuntimeError("Nvfp4SharedExpert: call load_weights() first")
        _check_hidden(hidden_states, self.hidden_size, self.max_num_tokens, self.device)
        t = hidden_states.shape[0]
        out = self._out[:t] if out is None else out
        x, gemm_mode = hidden_states, self.mode
        static = self.mode == "w4a4" and self.input_scales is not None
        if static:
            x, gemm_mode = _quant_roundtrip(hidden_states, self.input_scales["l1"], self._x_q[:t]), "w4a16"
        dense_gate_up, dense_down = self.dense_routes(hidden_states, gemm_mode, splitk)
        if not (dense_gate_up and dense_down):
            self._offsets.fill_(t)  # scalar fill: a kernel launch, no host read
        if dense_gate_up:
            inter = gemm_ops.nvfp4_linear(x, self._w13_dense, out=self._inter[:t], activation="swiglu",
                                          swiglu_limit=self.swiglu_limit, host_scale=self._w13_host)
        else:
            inter = gemm_ops.nvfp4_grouped_mm(
                x, self._w13_kernel, self._offsets, mode=gemm_mode, out=self._inter[:t],
                activation="swiglu", swiglu_limit=self.swiglu_limit,
            )
        if static:
            inter = _quant_roundtrip(inter, self.input_scales["l2"], self._inter_q[:t])
        if dense_down:
            return gemm_ops.nvfp4_linear(inter, self.w2, out=out, host_scale=self._w2_host)
        return gemm_ops.nvfp4_grouped_mm(inter, self._w2_kernel, self._offsets, mode=gemm_mode, out=out)

    __call__ = forward

    def effective_mode(self, hidden_states: torch.Tensor) -> str:
        """The numerics ``forward`` uses for this batch: ``mode``, except w4a8 at decode sizes on CUDA -> w4a16."""
        if self.mode != "w4a8":
            return self.mode
        return gemm_ops.w4a8_kernel_mode(hidden_states, hidden_states.shape[0], 1)

    def reference_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Float32 reference on decoded weights: (T, H) float32."""
        scales = self.input_scales or {}
        return moe_reference.expert_ffn(
            hidden_states, self.w13, self.w2, self.swiglu_limit, mode=self.effective_mode(hidden_states),
            input_scale=scales.get("l1"), inter_scale=scales.get("l2"),
        )


# The shared expert apart (not fused into the routed GEMMs) runs each of its GEMMs as a dense split-K GEMM where the
# split-K route takes its shape (nvfp4_linear; gate_up with the SwiGLU in the split-K reduction), instead of a grouped
# GEMM of one expert, whose band plan gives a 64-row expert 16 tiles of 256 columns on 132 SMs (V4-Flash gate_up at
# 64 tokens 42.8 us for 8.4 MB: NOTES_moe_decode.md "The shared expert at 9-256 tokens"). Env MEGAMOE_SHARED_SPLITK=0
# (read at import): off, and with it the next rule.
SHARED_SPLITK = os.environ.get("MEGAMOE_SHARED_SPLITK", "1").strip() not in ("", "0")
# Up to this many tokens the shared expert's down GEMM runs on nvfp4_linear also above split-K's rows (the Triton
# tensor-core route). H100, the shared expert alone (results/gpu_check_v34/h_shared_expert.md, against b / d with the
# down grouped): V4-Flash 256 tokens 84.4 -> 66.6 us, V4-Pro 155.4 -> 137.7; at 384 tokens 0.93-0.94x of the
# grouped plan.
SHARED_DOWN_LINEAR_MAX_ROWS = 256
# ... and from route "dense-bf16"'s row threshold (ops.gemm.dense_bf16_preferred: 512 rows, 1024 for N > 4096) as
# that route: the weight dequantized exactly to bf16 without its global scale, cuBLAS (gate_up with float32 output and
# the scaled SwiGLU after it), instead of the pipelined kernel's grouped GEMM of one expert. Host copies of the global
# scales are read at load_weights (the down's as at most ops.gemm.HOST_SCALE_MAX_SEGMENTS runs; the gate_up's scale is
# applied on the device, so any per-row scale). Env MEGAMOE_SHARED_DENSE_BF16=0: off.
SHARED_DENSE_BF16 = os.environ.get("MEGAMOE_SHARED_DENSE_BF16", "1").strip() not in ("", "0")
# With shared_overlap (the shared expert on a side stream), its GEMMs may take the split-K route (SHARED_SPLITK) for
# batches whose split-K launches reduce in a second launch (more than nvfp4_splitk.FUSED_MAX_ROWS rows): those use
# no tile counters, so they cannot collide with split-K launches of the main stream. False: never split-K there.
SHARED_OVERLAP_SPLITK = True
# Nvfp4MoE(shared_overlap=None) runs the shared expert on the side stream at these batch sizes (CUDA, w4a16). The
# lower edge is the first size whose split-K launches use no tile counters (above nvfp4_splitk.FUSED_MAX_ROWS = 8,
# which is also FUSE_SHARED_MAX_TOKENS); the upper edge is the largest size measured. H200, graph replay, read flush
# (results/gpu_check_v38/ b, d; NOTES_moe_decode.md, "The shared expert on a side stream"), against the overlap off:
# 9-128 tokens 1.00-1.04x under the router and Zipf, 1.05-1.17x all-on-k (one V4-Pro all-on-k 32 capture 0.92x);
# 192-512 tokens V4-Flash 1.004-1.21x, V4-Pro 1.03-1.25x except its router at 192 / 256 tokens (0.986 / 0.970x).
SHARED_OVERLAP_MIN_TOKENS = 9
SHARED_OVERLAP_MAX_TOKENS = 512
# Fused shared expert only up to this many tokens. H100, graph replay, with the Gluon decode kernel
# (benchmarks/results/moe_v5_fuse0*.md = separate, moe_v5_fuse64*.md = always fused), guide / V4-Flash dims:
# 1 token 181.8 -> 141.9 / 123.5 -> 90.0 us and 8 tokens 651.3 -> 608.2 / 354.6 -> 309.6 us (fused better);
# 16 tokens equal (1046 vs 1042 / 554.5 vs 556.6); 32 tokens 1579 -> 1679 / 831 -> 934 and 64 tokens
# 2087 -> 2317 / 1145 -> 1351 us (fused worse: the shared group's T rows loop over 8-row MMA tiles, each
# streaming its weights again). 16 until 2026-11-27; then, with today's decode kernels (results/gpu_check_v29/
# ab_layer_settings_{f,g,n}_*.md, graph replay, read flush), the shared expert apart was 1.03-1.05x faster at 9-16
# tokens on V4-Flash and V4-Pro and 0.91 / 0.98x at 8 tokens, so the fused path now stops at 8.
FUSE_SHARED_MAX_TOKENS = 8
# Decode batches of PAIRED_X_MIN_TOKENS..PAIRED_X_MAX_TOKENS tokens run both expert GEMMs on x in the paired order
# (issue 11; NOTES_moe_decode.md "x in the paired order"): the route + dispatch launch also writes the hidden states
# in that order, gate_up reads it and writes its SwiGLU output in it, down reads that, so the decode kernel skips the
# byte permutes that build its MMA operand (same MMAs, same bits). Only where every launch of both GEMMs is the
# mma.sync decode kernel's register path (megamoe.ops.gemm.paired_order_supported), mode w4a16, on CUDA; MAX 0 turns
# it off. The window is where it measured faster on the H100 (results/gpu_check_v32/ d, e, g: 1.005-1.017x at 8
# tokens; 0.986-1.006x at 1-4 tokens, where the route launch's copy costs about what the GEMMs save).
PAIRED_X_MIN_TOKENS = 8
PAIRED_X_MAX_TOKENS = 8
# "auto" dispatch uses the single-program Triton sort kernel (megamoe/kernels/moe_dispatch.py) up to this many
# (token, slot) pairs and the torch sort path above (the op's constant, measured there).
DISPATCH_KERNEL_MAX_PAIRS = moe_ops.DISPATCH_KERNEL_MAX_PAIRS

_LAYERS: "weakref.WeakValueDictionary[int, Nvfp4MoE]" = weakref.WeakValueDictionary()
_LAYER_IDS = itertools.count()


def default_row_interleave(config: MoEConfig, mode: str, device, fused_decode: bool = False) -> int:
    """The routed experts' layout of ``Nvfp4MoE(row_interleave=None)``: 4 (NVFP4Tensor.row_interleave) where every
    grouped GEMM of the layer runs on a Gluon kernel that reads it (a CUDA sm_90 device with the Gluon kernels and
    the pipelined route, mode "w4a16", hidden and intermediate sizes multiples of 256, no fused decode), else 1
    (row-major: CPU, the interpreter, other GPUs, the other modes)."""
    device = torch.device(device)
    if fused_decode or device.type != "cuda" or _row_interleave_refusal(config, mode):
        return 1
    from ..kernels.gemm.nvfp4_gluon_jit import GLUON_AVAILABLE, _capability

    if not (GLUON_AVAILABLE and gemm_ops.PIPE_ROUTE and _capability(device.index or 0)[0] == 9):
        return 1
    return 4


def _row_interleave_refusal(config: MoEConfig, mode: str) -> str | None:
    """Why a layer of this config and mode cannot hold row-interleaved experts (the rest of a ValueError naming
    ``row_interleave``), or None."""
    if mode != "w4a16":
        return f"runs mode 'w4a16' only, got mode {mode!r}"
    if config.hidden_size % 256 or config.intermediate_size % 256:
        return (f"needs hidden and intermediate sizes that are multiples of 256 (the pipelined kernel's K), got "
                f"{config.hidden_size} / {config.intermediate_size}")
    return None


class Nvfp4MoE:
    """DeepSeek-V4-style MoE block with NVFP4 expert weights (routed experts + shared expert).

    config: :class:`megamoe.models.MoEConfig`. max_num_tokens: the most tokens a
    forward may take (buffers are sized by it; more -> ValueError). mode:
    "w4a16", "w4a4" or "w4a8".

    Weights (:meth:`load_weights`): ``gate_weight`` (E, H) bf16,
    ``correction_bias`` (E,) fp32 or None, ``w13`` NVFP4Tensor (E, 2*I, H) rows
    ``[gate(I); up(I)]`` per expert, global scale 0-d, (E,1,1) or (E,2I,1);
    ``w2`` NVFP4Tensor (E, H, I); shared expert ``(2*Is, H)`` / ``(H, Is)``.

    fused_decode: the single-launch decode MoE for 1..16 tokens (see the module docstring); None reads
    ``MEGAMOE_MOE_FUSED_DECODE`` (``"1"``: on) once, here. Default off.

    row_interleave: None (default: 4 where it runs, else 1; :func:`default_row_interleave`), 1 or 4: the routed
    experts' kernel copies (not ``w13`` / ``w2``) with 4 rows interleaved per 128-K step
    (:attr:`megamoe.format.NVFP4Tensor.row_interleave`), read by the Gluon grouped kernels only (sm_90): mode
    "w4a16", no fused decode, hidden and intermediate sizes multiples of 256. HBM streams them faster: the routed
    experts run 1.02-1.44x faster at 512-8192 tokens, and each decode-band GEMM 1.005-1.04x faster at 1-64 tokens
    (H100; NOTES_gemm.md v21, v22). An explicit 4 where it cannot run is a ValueError; the default falls back to 1,
    and :meth:`set_mode` to another mode turns a defaulted layer's copies back to row-major.
    """

    def __init__(self, config: MoEConfig, *, max_num_tokens: int, device="cpu", mode: str = "w4a16",
                 fuse_shared_expert: bool = True, fuse_shared_max_tokens: int | None = None,
                 dispatch_backend: str = "auto", router_backend: str = "triton", shared_overlap: bool | None = None,
                 fused_decode: bool | None = None, row_interleave: int | None = None):
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config: expected a MoEConfig, got {type(config).__name__}")
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        _check_count("max_num_tokens", max_num_tokens)
        if not isinstance(fuse_shared_expert, bool):
            raise TypeError(f"fuse_shared_expert: expected a bool, got {type(fuse_shared_expert).__name__}")
        if fuse_shared_max_tokens is not None and (not isinstance(fuse_shared_max_tokens, int)
                                                   or isinstance(fuse_shared_max_tokens, bool)
                                                   or fuse_shared_max_tokens < 0):
            raise ValueError(f"fuse_shared_max_tokens: expected None or an int >= 0, got {fuse_shared_max_tokens!r}")
        if dispatch_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"dispatch_backend: expected 'auto', 'torch' or 'triton', got {dispatch_backend!r}")
        self.config, self.max_num_tokens, self.mode = config, max_num_tokens, mode
        self.dispatch_backend = dispatch_backend
        if router_backend not in ("torch", "triton"):
            raise ValueError(f"router_backend: expected 'torch' or 'triton', got {router_backend!r}")
        # "triton": torch scores + one selection kernel (identical ids; on CPU without the interpreter, torch)
        self.router_backend = router_backend
        self.device = dev = _resolve_device(device)
        c = config
        # The shared expert runs as routed expert number E (weight 1.0, every token) inside the same two grouped
        # GEMMs when its width equals the routed experts' (DeepSeek-V4: both 2048): one launch per GEMM, and
        # its tiles share the machine with the routed experts' instead of running after them.
        # It pays only at the smallest batches (see FUSE_SHARED_MAX_TOKENS); the choice is made on the host from the
        # token count (a shape), so each captured graph has one fixed path.
        self.fused_shared = bool(fuse_shared_expert and c.shared_intermediate_size == c.intermediate_size)
        self.fuse_shared_max_tokens = (FUSE_SHARED_MAX_TOKENS if fuse_shared_max_tokens is None
                                       else fuse_shared_max_tokens)
        # shared_overlap (CUDA): the shared expert runs apart (never fused), on a side stream forked before the
        # routing and joined before the combine, so its two GEMMs fill the SMs the router and the routed GEMMs
        # leave idle. The same kernels and order as the unfused path: the same bits. True: at every batch size;
        # False: never; None (default): where it measured faster, SHARED_OVERLAP_MIN_TOKENS..MAX_TOKENS tokens in
        # mode w4a16 (:meth:`overlaps_shared`; benchmarks/NOTES_moe_decode.md, "The shared expert on a side stream").
        if shared_overlap is not None and not isinstance(shared_overlap, bool):
            raise TypeError(f"shared_overlap: expected None or a bool, got {type(shared_overlap).__name__}")
        self.shared_overlap = shared_overlap
        # fused_decode (issue 11, opt-in): at 1..FUSED_DECODE_MAX_TOKENS tokens, mode "w4a16", the routed experts +
        # shared expert + combine run as ONE persistent launch after the route + dispatch launch
        # (megamoe/kernels/moe_fused_decode.py) on CUDA (and under the Triton interpreter, for tests). None: the
        # environment variable MEGAMOE_MOE_FUSED_DECODE=1 (read here, once). Used only where the shared expert is
        # fused as group E (or absent); otherwise the existing path.
        if fused_decode is None:
            fused_decode = os.environ.get("MEGAMOE_MOE_FUSED_DECODE", "0") == "1"
        if not isinstance(fused_decode, bool):
            raise TypeError(f"fused_decode: expected a bool, got {type(fused_decode).__name__}")
        self.fused_decode = fused_decode
        # None: the layout that runs fastest here, chosen once (re-laid row-major by set_mode to another mode)
        self._row_interleave_default = row_interleave is None
        if row_interleave is None:
            row_interleave = default_row_interleave(config, mode, dev, fused_decode)
        if type(row_interleave) is not int or row_interleave not in (1, 4):
            raise ValueError(f"row_interleave: expected None, 1 or 4, got {row_interleave!r}")
        refusal = _row_interleave_refusal(config, mode) if row_interleave != 1 else None
        if refusal:
            raise ValueError(f"row_interleave: {row_interleave} {refusal}")
        self.row_interleave = row_interleave
        # the shared expert's side stream (shared_overlap), made here rather than during a graph capture
        # (or on the first overlapped forward, if the attribute was set to True later)
        side = dev.type == "cuda" and shared_overlap is not False and bool(c.shared_intermediate_size)
        self._side_stream = torch.cuda.Stream(dev) if side else None
        self._captured = False  # capture() was called (set_mode then keeps the weight layout)
        self._slots = c.top_k + (1 if self.fused_shared else 0)  # rows per token in the grouped GEMMs
        self._groups = c.num_experts + (1 if self.fused_shared else 0)
        pairs = max_num_tokens * self._slots
        self.gate_weight = self.correction_bias = self.w13 = self.w2 = None
        self.tid2eid = None  # (vocab, k) int32 on the device for a hash-routed layer, else None
        self._w13_kernel = None
        self.input_scales: dict | None = None  # static w4a4: {"l1": 0-d, "l2": (E,)} or None (dynamic)
        self.shared = (
            Nvfp4SharedExpert(c.hidden_size, c.shared_intermediate_size, max_num_tokens=max_num_tokens, device=dev,
                              swiglu_limit=c.swiglu_limit, mode=mode)
            if c.shared_intermediate_size else None
        )
        self._dispatch_buffers = dispatch_buffers(pairs, self._groups, dev)
        self._route_weights = torch.empty((max_num_tokens, c.top_k), dtype=torch.float32, device=dev)
        self._route_ids = torch.empty((max_num_tokens, c.top_k), dtype=torch.int32, device=dev)
        if self.fused_shared:  # routing with the shared expert appended as slot k: id E, weight 1.0 (set once)
            self._ids_ext = torch.full((max_num_tokens, self._slots), c.num_experts, dtype=torch.int32, device=dev)
            self._weights_ext = torch.ones((max_num_tokens, self._slots), dtype=torch.float32, device=dev)
        self._x_q = torch.empty((max_num_tokens, c.hidden_size), dtype=torch.bfloat16, device=dev)
        # the hidden states in the paired order (PAIRED_X_MAX_TOKENS), and a cache of its host rule (_paired_x)
        # keyed by the shapes and settings it reads: {(tokens, shared fused, mode, dynamic scales, weight
        # interleave, fused decode, the PAIRED_X window): bool}
        self._x_paired = torch.empty((min(max_num_tokens, PAIRED_X_MAX_TOKENS), c.hidden_size), dtype=torch.bfloat16,
                                     device=dev)
        self._paired_rule: dict = {}
        self._inter = torch.empty((pairs, c.intermediate_size), dtype=torch.bfloat16, device=dev)
        self._inter_q = torch.empty_like(self._inter)
        self._expert_out = torch.empty((pairs, c.hidden_size), dtype=torch.bfloat16, device=dev)
        self._out = torch.empty((max_num_tokens, c.hidden_size), dtype=torch.bfloat16, device=dev)
        self._fused_ws = None
        if self.fused_decode:  # h / y / counters of the fused decode launch (h shares the GEMMs' intermediate)
            self._fused_ws = fused_ops.fused_decode_workspace(max_num_tokens, self._slots, self._groups,
                                                             c.hidden_size, c.intermediate_size, dev, h=self._inter)
        errors.error_word(dev)  # the device's error word exists before any graph capture
        if dev.type == "cuda":  # likewise the fused route + dispatch launch's counters (CUDA only: importing the
            from ..kernels.moe_route_dispatch import route_dispatch_counters  # kernel fixes its interpreter mode)

            route_dispatch_counters(dev)
        self._layer_id = next(_LAYER_IDS)
        _LAYERS[self._layer_id] = self
        self.last_routing = None  # (topk_weights, topk_ids) of the last forward: views of layer buffers

    # ------------------------------------------------------------------ weights
    def load_weights(self, gate_weight, correction_bias, w13: NVFP4Tensor, w2: NVFP4Tensor,
                     shared_w13: NVFP4Tensor | None = None, shared_w2: NVFP4Tensor | None = None, *,
                     tid2eid: torch.Tensor | None = None) -> None:
        """Install weights (checkpoint order) and build the kernel layouts once (not for hot paths).

        tid2eid: None (score-routed layer) or the hash-routing table (vocab, k) int32/int64 with entries in
        [0, E) (checked here, on the host; stored as int32 on the layer's device). A hash-routed layer has no
        correction bias (pass None) and its forward needs ``token_ids``.
        """
        c, dev = self.config, self.device
        gate_weight, correction_bias, tid2eid = check_router_weights(c, dev, gate_weight, correction_bias, tid2eid)
        _check_nvfp4(w13, "w13", (c.num_experts, 2 * c.intermediate_size, c.hidden_size), dev)
        _check_nvfp4(w2, "w2", (c.num_experts, c.hidden_size, c.intermediate_size), dev)
        # fp32 once at load: the router computes its logits in fp32 (bf16 -> fp32 is exact, routing unchanged)
        self.gate_weight, self.correction_bias = gate_weight, correction_bias
        self.tid2eid = tid2eid
        self.w13, self.w2 = w13, w2
        if self.shared is not None:
            if shared_w13 is None or shared_w2 is None:
                raise ValueError("shared_w13/shared_w2: the config has a shared expert; got None")
            self.shared.load_weights(shared_w13, shared_w2)
        if self.fused_shared:
            self._w13_kernel = gemm_ops.interleave_gate_up(_append_expert(w13, shared_w13))
            self._w2_kernel = _append_expert(w2, shared_w2)  # group E stays empty when the shared runs apart
        else:
            self._w13_kernel = gemm_ops.interleave_gate_up(w13)
            self._w2_kernel = w2
        if self.row_interleave != 1:  # the kernel copies only: w13 / w2 stay in checkpoint order
            self._w13_kernel = self._w13_kernel.interleave_rows(self.row_interleave)
            self._w2_kernel = self._w2_kernel.interleave_rows(self.row_interleave)

    @classmethod
    def from_bf16(cls, config: MoEConfig, gate_weight, correction_bias, w13_bf16, w2_bf16,
                  shared_w13_bf16=None, shared_w2_bf16=None, *, tid2eid=None, **kwargs) -> "Nvfp4MoE":
        """Quantize bf16 weights (per-expert global scales) and build the layer.

        w13_bf16: (E, 2I, H) rows [gate; up]; w2_bf16: (E, H, I); shared: (2Is, H), (H, Is).
        tid2eid: optional hash-routing table (see :meth:`load_weights`).
        """
        layer = cls(config, **kwargs)
        q = quantize_weight
        layer.load_weights(
            gate_weight, correction_bias, q(w13_bf16), q(w2_bf16),
            q(shared_w13_bf16) if shared_w13_bf16 is not None else None,
            q(shared_w2_bf16) if shared_w2_bf16 is not None else None, tid2eid=tid2eid,
        )
        return layer

    @classmethod
    def random(cls, config: MoEConfig, *, seed: int = 0, return_bf16: bool = False, hash_vocab: int | None = None,
               **kwargs):
        """A layer with random weights (std 1/sqrt(fan_in)) quantized to NVFP4; optionally also the bf16 ones.

        Memory: the experts are drawn and quantized in chunks of about ``RANDOM_CHUNK_ELEMENTS`` float32
        elements, so the peak is the NVFP4 result plus one chunk (V4-Pro: ~1 GiB of float32 per chunk instead
        of 68 GB for the whole w13); ``return_bf16=True`` keeps every bf16 weight too (small configs only).
        Determinism: every expert matrix (and the gate, the bias, each shared matrix, the table) is drawn from
        its own generator seeded from ``(seed, tensor, expert)``, so the same seed gives the same weights on
        one device type whatever the chunking (CPU and CUDA generators differ). Weights drawn by versions
        before this scheme (one generator for everything) are not reproduced.
        hash_vocab: build a hash-routed layer with a random ``tid2eid`` (hash_vocab, k) table (k distinct
        experts per token id).
        """
        device = _resolve_device(kwargs.get("device", "cpu"))
        c = config
        h, i, e, si = c.hidden_size, c.intermediate_size, c.num_experts, c.shared_intermediate_size

        def gen(tag: int, index: int = 0) -> torch.Generator:
            return torch.Generator(device=device).manual_seed(_sub_seed(seed, tag, index))

        def randn(shape, scale, tag, index=0):
            return (torch.randn(*shape, generator=gen(tag, index), device=device) * scale).to(torch.bfloat16)

        gate, bias, tid2eid = _random_router(c, gen, device, hash_vocab)
        kept = {} if return_bf16 else None
        w13 = _random_experts(e, (2 * i, h), h ** -0.5, lambda j: gen(4, j), device, kept, "w13")
        w2 = _random_experts(e, (h, i), i ** -0.5, lambda j: gen(5, j), device, kept, "w2")
        s13 = randn((2 * si, h), h ** -0.5, 6) if si else None
        s2 = randn((h, si), si ** -0.5, 7) if si else None
        layer = cls(c, **kwargs)
        layer.load_weights(gate, bias, w13, w2, quantize_weight(s13) if si else None,
                           quantize_weight(s2) if si else None, tid2eid=tid2eid)
        if return_bf16:
            return layer, {"gate_weight": gate, "correction_bias": bias, "w13": kept["w13"], "w2": kept["w2"],
                           "shared_w13": s13, "shared_w2": s2, "tid2eid": tid2eid}
        return layer

    # ------------------------------------------------------------------ forward
    @property
    def hash_routed(self) -> bool:
        """True for a hash-routed layer (a ``tid2eid`` table is loaded): forward needs ``token_ids``."""
        return self.tid2eid is not None

    def _token_ids(self, token_ids, num_tokens: int):
        """Validated token ids for a hash layer (None for a score-routed one; host metadata only)."""
        if token_ids is not None:
            if not isinstance(token_ids, torch.Tensor):
                raise TypeError(f"token_ids: expected a torch.Tensor, got {type(token_ids).__name__}")
            if token_ids.dtype not in (torch.int32, torch.int64):
                raise TypeError(f"token_ids: expected int32 or int64, got {token_ids.dtype}")
            if tuple(token_ids.shape) != (num_tokens,) or token_ids.device != self.device:
                raise ValueError(f"token_ids: expected shape ({num_tokens},) on {self.device}, got "
                                 f"{tuple(token_ids.shape)} on {token_ids.device}")
        if not self.hash_routed:
            return None  # score-routed: token ids are accepted (uniform model loops) and unused
        if token_ids is None:
            raise ValueError("token_ids: this layer is hash-routed (tid2eid loaded); pass the (T,) token ids")
        return token_ids

    def route(self, hidden_states: torch.Tensor, out=None, token_ids: torch.Tensor | None = None):
        """(topk_weights (T, k) fp32, topk_ids (T, k) int32) with the layer's router backend, as forward routes
        (``moe_ops.route_dispatch``; its grouping is computed and dropped: not for hot paths).

        token_ids: (T,) int32/int64, required by a hash-routed layer (ignored otherwise).
        """
        c = self.config
        if self.hash_routed and token_ids is None:
            raise ValueError("token_ids: this layer is hash-routed (tid2eid loaded); pass the (T,) token ids")
        token_ids = token_ids if self.hash_routed else None  # shapes, dtypes, devices: checked by moe_ops.route
        # the same op as forward (its fused decode launch for small batches), so forward's routing is reproduced
        return moe_ops.route_dispatch(
            hidden_states, self.gate_weight, self.correction_bias, top_k=c.top_k, scoring_func=c.scoring_func,
            n_group=c.n_group, topk_group=c.topk_group, norm_topk_prob=c.norm_topk_prob,
            routed_scaling_factor=c.routed_scaling_factor, backend=self.router_backend, out=out,
            token_ids=token_ids, tid2eid=self.tid2eid,
        )[:2]

    def forward(self, hidden_states: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """(T, H) bf16 -> (T, H) bf16 (a view of the layer's output buffer). Sync-free, graph-capturable.

        token_ids: (T,) int32/int64 token ids on the layer's device; required by a hash-routed layer, accepted
        and unused by a score-routed one.
        """
        if self._w13_kernel is None:
            raise RuntimeError("Nvfp4MoE: call load_weights() first")
        c = self.config
        _check_hidden(hidden_states, c.hidden_size, self.max_num_tokens, self.device)
        t = hidden_states.shape[0]
        token_ids = self._token_ids(token_ids, t)
        overlap, fuse = self.overlaps_shared(t), self.fuses_shared(t)
        pairs = t * (self._slots if fuse else c.top_k)
        out = self._out[:t]
        if t == 0:
            return out
        side = self._fork_shared(hidden_states) if overlap else None
        paired = self._paired_x(hidden_states, fuse)
        # routing + dispatch: one launch for decode-sized batches (megamoe.ops.moe.route_dispatch picks it from
        # the token count), the router kernel + dispatch otherwise
        c_out = (self._weights_ext, self._ids_ext) if fuse else (self._route_weights, self._route_ids)
        topk_weights, topk_ids, d = moe_ops.route_dispatch(
            hidden_states, self.gate_weight, self.correction_bias, top_k=c.top_k, scoring_func=c.scoring_func,
            n_group=c.n_group, topk_group=c.topk_group, norm_topk_prob=c.norm_topk_prob,
            routed_scaling_factor=c.routed_scaling_factor, num_groups=self._groups,
            slots=self._slots if fuse else c.top_k, out=c_out, buffers=self._dispatch_buffers,
            token_ids=token_ids, tid2eid=self.tid2eid, backend=self.router_backend,
            dispatch_backend=self.dispatch_backend if self.dispatch_backend != "auto" else
            ("triton" if pairs <= DISPATCH_KERNEL_MAX_PAIRS else "torch"),
            x_paired_out=self._x_paired[:t] if paired else None)
        self.last_routing = (topk_weights, topk_ids)
        if fuse:  # column k is the shared expert (id E, weight 1.0, preset once)
            topk_weights = self._weights_ext[:t]
        offsets = d["expert_offsets"]
        if self._use_fused_decode(hidden_states, fuse):
            fused_ops.moe_fused_decode(hidden_states, self._w13_kernel, self._w2_kernel, offsets, d["row_index"],
                                       d["inv_perm"], topk_weights, swiglu_limit=c.swiglu_limit,
                                       workspace=self._fused_ws, out=out)
            errors.check_errors_eager(self.device)
            return out
        x, gemm_mode = hidden_states, self.mode
        static = self.mode == "w4a4" and self.input_scales is not None
        if static:
            x, gemm_mode = _quant_roundtrip(hidden_states, self.input_scales["l1"], self._x_q[:t]), "w4a16"
        order = "paired" if paired else "plain"
        if paired:
            x = self._x_paired[:t]
        inter = gemm_ops.nvfp4_grouped_mm(
            x, self._w13_kernel, offsets, mode=gemm_mode, out=self._inter[:pairs], row_index=d["row_index"],
            activation="swiglu", swiglu_limit=c.swiglu_limit, max_rows_per_expert=t,  # distinct top-k experts
            x_order=order, out_order=order,
        )
        if static:
            l2 = self.input_scales.get("l2_groups", self.input_scales["l2"])
            row_scale = l2.index_select(0, d["sorted_expert"]).unsqueeze(1)  # (pairs, 1)
            inter = _quant_roundtrip(inter, row_scale, self._inter_q[:pairs])
        # the routing (offsets) was written before gate_up started: the down GEMM may read it before its PDL wait
        expert_out = gemm_ops.nvfp4_grouped_mm(inter, self._w2_kernel, offsets, mode=gemm_mode,
                                               out=self._expert_out[:pairs], max_rows_per_expert=t, x_order=order,
                                               index_settled=True)
        if side is not None:
            shared = self._join_shared(side)
        else:
            shared = self.shared.forward(hidden_states) if self.shared is not None and not fuse else None
        result = moe_ops.combine(expert_out, d["inv_perm"], topk_weights, shared, out=out)
        # eager only: raises if a kernel masked an out-of-range index (no-op while capturing / sync-debugging)
        errors.check_errors_eager(self.device)
        return result

    __call__ = forward

    def _paired_x(self, hidden_states: torch.Tensor, fuse: bool) -> bool:
        """Host rule (shapes only, cached per token count): this batch's expert GEMMs run on x in the paired order
        (see PAIRED_X_MIN_TOKENS / PAIRED_X_MAX_TOKENS)."""
        t = hidden_states.shape[0]
        key = (t, fuse, self.mode, self.input_scales is None, self._w13_kernel.row_interleave, self.fused_decode,
               PAIRED_X_MIN_TOKENS, PAIRED_X_MAX_TOKENS)
        rule = self._paired_rule.get(key)
        if rule is None:
            c = self.config
            pairs = t * (self._slots if fuse else c.top_k)
            rule = (self.device.type == "cuda" and PAIRED_X_MIN_TOKENS <= t <= min(PAIRED_X_MAX_TOKENS,
                                                                                 self._x_paired.shape[0])
                    and self.mode == "w4a16" and self.input_scales is None
                    and not self._use_fused_decode(hidden_states, fuse)
                    and c.hidden_size % 8 == 0 and c.intermediate_size % 8 == 0
                    and gemm_ops.paired_order_supported(hidden_states, self._w13_kernel, pairs, max_rows_per_expert=t)
                    and gemm_ops.paired_order_supported(self._inter[:pairs], self._w2_kernel, pairs,
                                                        max_rows_per_expert=t))
            self._paired_rule[key] = rule
        return rule

    def _use_fused_decode(self, hidden_states: torch.Tensor, fuse: bool) -> bool:
        """Host rule (shapes only): the single-launch decode MoE takes this batch (see ``fused_decode``)."""
        return (self.fused_decode and self._fused_ws is not None and self.mode == "w4a16"
                and (fuse or self.shared is None)  # neither forks the shared expert (overlaps_shared)
                and hidden_states.shape[0] <= self._fused_ws["max_tokens"]
                and fused_ops.fused_decode_supported(hidden_states, self._w13_kernel, self._w2_kernel))

    def overlaps_shared(self, num_tokens: int) -> bool:
        """Whether a batch of ``num_tokens`` runs the shared expert apart on the side stream (host rule on the
        shape and the settings; on CPU the same path runs in place): ``shared_overlap`` when it is a bool, else
        SHARED_OVERLAP_MIN_TOKENS <= num_tokens <= SHARED_OVERLAP_MAX_TOKENS on CUDA in mode w4a16."""
        if self.shared is None:
            return False
        if self.shared_overlap is not None:
            return self.shared_overlap
        return (self.device.type == "cuda" and self.mode == "w4a16"
                and SHARED_OVERLAP_MIN_TOKENS <= num_tokens <= SHARED_OVERLAP_MAX_TOKENS)

    def fuses_shared(self, num_tokens: int) -> bool:
        """Whether a batch of ``num_tokens`` runs the shared expert inside the routed GEMMs (as group E): a shared
        expert as wide as the routed ones, at most ``fuse_shared_max_tokens`` tokens, and not on the side stream."""
        return self.fused_shared and num_tokens <= self.fuse_shared_max_tokens and not self.overlaps_shared(num_tokens)

    def _fork_shared(self, hidden_states: torch.Tensor):
        """Start the shared expert on the side stream (CUDA; graph-capturable fork). Returns the handle for
        :meth:`_join_shared`; on CPU runs it in place (sequential)."""
        if self.device.type != "cuda":
            return self.shared.forward(hidden_states)
        main = torch.cuda.current_stream(self.device)
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self.device)
        side = self._side_stream
        side.wait_stream(main)  # hidden_states is ready
        # split-K only where neither GEMM's reduction uses the device's tile counters (shared with split-K launches
        # on the main stream): SHARED_OVERLAP_SPLITK
        splitk = SHARED_OVERLAP_SPLITK and not gemm_ops.splitk_uses_tile_counters(hidden_states.shape[0])
        with torch.cuda.stream(side):
            shared = self.shared.forward(hidden_states, splitk=splitk)
        return shared

    def _join_shared(self, shared: torch.Tensor) -> torch.Tensor:
        """The shared expert's (T, H) output, visible to the current stream (joins the side stream)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).wait_stream(self._side_stream)
        return shared

    def compiled_forward(self, hidden_states: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``forward`` through the ``megamoe::moe_layer_forward`` custom op
        (opaque to torch.compile; returns a copy)."""
        return torch.ops.megamoe.moe_layer_forward(hidden_states, self._layer_id, token_ids)

    def reference_forward(self, hidden_states: torch.Tensor, routing=None,
                          token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 reference layer on decoded weights with the same routing: (T, H) float32.

        routing: (topk_weights, topk_ids) to reuse (default: route again, identically, with ``token_ids`` for
        a hash-routed layer).
        """
        topk_weights, topk_ids = routing if routing is not None else self.route(hidden_states, token_ids=token_ids)
        scales = self.input_scales or {}
        if self.shared is not None and self.shared.input_scales:
            scales = {**scales, "shared_l1": self.shared.input_scales["l1"],
                      "shared_l2": self.shared.input_scales["l2"]}
        mode, shared_mode = self.mode, None
        if mode == "w4a8":  # the same host rule as forward's GEMMs (w4a16 kernels at decode sizes on CUDA)
            t = hidden_states.shape[0]
            fuse = self.fuses_shared(t)
            pairs = t * (self._slots if fuse else self.config.top_k)
            mode = gemm_ops.w4a8_kernel_mode(hidden_states, pairs, self._groups)  # the stacked weights' groups
            shared_mode = mode if fuse or self.shared is None else self.shared.effective_mode(hidden_states)
        return moe_reference.moe_forward(
            hidden_states, topk_weights, topk_ids, self.w13, self.w2, swiglu_limit=self.config.swiglu_limit,
            shared_w13=self.shared.w13 if self.shared else None, shared_w2=self.shared.w2 if self.shared else None,
            mode=mode, input_scales=scales or None, shared_mode=shared_mode,
        )

    # ------------------------------------------------------------- calibration
    @torch.no_grad()
    def calibrate(self, hidden_states_sample: torch.Tensor, token_ids: torch.Tensor | None = None) -> dict:
        """Static w4a4 activation global scales from a sample batch (not for hot paths; syncs).

        l1: ``amax(sample) / 2688`` (per tensor); l2: per expert, the amax of that
        expert's SwiGLU output on the sample (w4a16 L1) / 2688; experts that got no
        rows take the largest observed scale. The shared expert gets its own
        l1/l2. Sets ``mode = "w4a4"`` with these static scales; returns them.
        token_ids: the sample's (T,) token ids (hash-routed layers).
        """
        c = self.config
        x = hidden_states_sample
        _check_hidden(x, c.hidden_size, self.max_num_tokens, self.device)
        if x.shape[0] == 0:
            raise ValueError("hidden_states_sample: expected at least one token")
        l1 = quantize_ops.compute_global_scale(x)
        _, topk_ids = self.route(x, token_ids=token_ids)
        d = moe_ops.dispatch(topk_ids, self._groups)  # routed rows only; the fused shared group stays empty
        inter = gemm_ops.nvfp4_grouped_mm(x, self._w13_kernel, d["expert_offsets"], row_index=d["row_index"],
                                          activation="swiglu", swiglu_limit=c.swiglu_limit)
        row_amax = inter.float().abs().nan_to_num(0.0).amax(dim=1)
        expert_amax = torch.zeros(c.num_experts, device=self.device).scatter_reduce_(
            0, d["sorted_expert"].long(), row_amax, reduce="amax")
        seen = torch.zeros(c.num_experts, dtype=torch.bool, device=self.device)
        seen[d["sorted_expert"].long()] = True
        expert_amax = torch.where(seen, expert_amax, expert_amax.max())
        from ..format.constants import AMAX_FLOOR, GLOBAL_SCALE_DIVISOR

        l2 = (expert_amax.clamp(min=AMAX_FLOOR) / GLOBAL_SCALE_DIVISOR).float()
        self.input_scales = {"l1": l1, "l2": l2}
        self.mode = "w4a4"
        if self.shared is not None:
            s = self.shared
            s_inter = gemm_ops.nvfp4_grouped_mm(x, s._w13_kernel, torch.full((1,), x.shape[0], dtype=torch.int32,
                                                device=self.device), activation="swiglu",
                                                swiglu_limit=s.swiglu_limit)
            s.input_scales = {"l1": l1, "l2": quantize_ops.compute_global_scale(s_inter)}
            s.mode = "w4a4"
        self._fuse_scales()
        return self.input_scales

    def _fuse_scales(self) -> None:
        """Fused shared expert: one L1 scale for all (the max), L2 scale of group E = the shared one."""
        if not self.fused_shared or self.input_scales is None or not self.shared.input_scales:
            return
        l1 = torch.maximum(self.input_scales["l1"], self.shared.input_scales["l1"])
        self.input_scales["l1"] = self.shared.input_scales["l1"] = l1
        l2 = self.input_scales["l2"][: self.config.num_experts]
        self.input_scales["l2_groups"] = torch.cat((l2, self.shared.input_scales["l2"].reshape(1)))

    def set_input_scales(self, l1: torch.Tensor, l2: torch.Tensor, shared_l1=None, shared_l2=None) -> None:
        """Static w4a4 scales (e.g. ModelOpt ``input_scale``): l1 0-d, l2 (E,) fp32 on the layer's device.

        Every scale must be finite and > 0 (checked on the host: not for hot paths).
        """
        c = self.config
        for name, t in (("l1", l1), ("l2", l2), ("shared_l1", shared_l1), ("shared_l2", shared_l2)):
            if t is None and name.startswith("shared"):
                continue
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise TypeError(f"{name}: expected a floating-point torch.Tensor, got "
                                f"{getattr(t, 'dtype', type(t).__name__)}")
            if t.numel() and not bool(torch.isfinite(t).all() and (t > 0).all()):
                raise ValueError(f"{name}: static input scales must be finite and > 0, got {t.flatten().tolist()}")
        if l1.dim() != 0 or tuple(l2.shape) != (c.num_experts,):
            raise ValueError(f"l1/l2: expected a 0-d tensor and ({c.num_experts},), got "
                             f"{tuple(l1.shape)} and {tuple(l2.shape)}")
        for name, t in (("shared_l1", shared_l1), ("shared_l2", shared_l2)):
            if t is not None and t.numel() != 1:
                raise ValueError(f"{name}: expected one value, got shape {tuple(t.shape)}")
        self.input_scales = {"l1": l1.float().to(self.device), "l2": l2.float().to(self.device)}
        if self.shared is not None and shared_l1 is not None and shared_l2 is not None:
            self.shared.input_scales = {"l1": shared_l1.float().to(self.device),
                                        "l2": shared_l2.float().to(self.device)}
        elif self.fused_shared:
            raise ValueError("shared_l1/shared_l2: the fused shared expert needs its static scales too")
        self._fuse_scales()

    def set_mode(self, mode: str) -> None:
        """Switch the activation mode. A layer whose row-interleaved kernel copies came from the default
        (``row_interleave=None``) re-lays them row-major for the other modes (one copy of the routed experts; it stays
        row-major after) unless graphs were captured from it (they would read the old copies: ValueError); an
        explicit ``row_interleave=4`` runs "w4a16" only."""
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        if self.row_interleave != 1 and mode != "w4a16":
            if not self._row_interleave_default:
                raise ValueError(f"mode: a layer with row_interleave={self.row_interleave} runs 'w4a16' only, got "
                                 f"{mode!r}")
            if self._captured:
                raise ValueError(f"mode: {mode!r} needs the routed experts row-major, and graphs captured from this "
                                 "layer read its row-interleaved copies; set the mode before capture(), or build "
                                 "the layer with row_interleave=1")
            if self._w13_kernel is not None:
                self._w13_kernel = self._w13_kernel.rows_in_order()
                self._w2_kernel = self._w2_kernel.rows_in_order()
            self.row_interleave = 1
        self.mode = mode
        if self.shared is not None:
            self.shared.mode = mode

    # ------------------------------------------------------------ CUDA graphs
    def capture(self, num_tokens: int, *, warmup: int = 2):
        """Capture ``forward`` for ``num_tokens`` tokens into a CUDA graph.

        Returns ``run(hidden_states, token_ids=None) -> out``: copies the (num_tokens, H) bf16 input (and, for
        a hash-routed layer, the (num_tokens,) token ids: required then) into the graph's static inputs,
        replays, returns the static output (the layer's output buffer; valid until the next call).
        Replays do not check the device error word: call ``megamoe.ops.errors.check_errors()`` between steps.
        """
        if self.device.type != "cuda":
            raise RuntimeError("capture: CUDA graphs need a CUDA layer")
        self._captured = True  # set_mode may no longer re-lay the kernel copies these graphs read
        if not 1 <= num_tokens <= self.max_num_tokens:
            raise ValueError(f"num_tokens: expected 1..{self.max_num_tokens}, got {num_tokens}")
        static_in = torch.zeros((num_tokens, self.config.hidden_size), dtype=torch.bfloat16, device=self.device)
        static_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device) if self.hash_routed else None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                self.forward(static_in, static_ids)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = self.forward(static_in, static_ids)

        def run(hidden_states: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
            if tuple(hidden_states.shape) != tuple(static_in.shape):
                raise ValueError(f"hidden_states: the graph was captured for shape {tuple(static_in.shape)}, "
                                 f"got {tuple(hidden_states.shape)}")
            if static_ids is not None:
                if not isinstance(token_ids, torch.Tensor) or tuple(token_ids.shape) != (num_tokens,) \
                        or token_ids.dtype not in (torch.int32, torch.int64):
                    raise ValueError(f"token_ids: the hash-routed graph needs ({num_tokens},) int32/int64 token "
                                     f"ids, got {token_ids if token_ids is None else tuple(token_ids.shape)}")
                static_ids.copy_(token_ids)
            static_in.copy_(hidden_states)
            graph.replay()
            return static_out

        run.graph, run.static_input, run.static_output = graph, static_in, static_out
        run.static_token_ids = static_ids
        return run

    def release_reference_weights(self) -> None:
        """Drop the checkpoint-order copies of the routed experts kept for :meth:`reference_forward` and
        :meth:`calibrate` (the kernels use their own interleaved copies): halves the experts' device memory of a
        serving model. Those two methods raise afterwards."""
        self._expert_bytes = (self.w13.nbytes() + self.w2.nbytes()) // self.config.num_experts
        self.w13 = self.w2 = None

    def weight_bytes(self, experts_touched: int | None = None) -> int:
        """Bytes of NVFP4 weights read for ``experts_touched`` routed experts (+ shared expert + gate)."""
        c = self.config
        e = c.num_experts if experts_touched is None else experts_touched
        per_expert = (getattr(self, "_expert_bytes", None) if self.w13 is None
                      else (self.w13.nbytes() + self.w2.nbytes()) // c.num_experts)
        total = e * per_expert + self.gate_weight.numel() * 2  # the checkpoint's bf16 gate
        if self.shared is not None:
            total += self.shared.w13.nbytes() + self.shared.w2.nbytes()
        return total


def _random_router(c: MoEConfig, gen, device, hash_vocab: int | None):
    """Random router weights of :meth:`Nvfp4MoE.random` (also the expert-parallel layer's): gate (E, H) bf16 with
    std H**-0.5 from ``gen(1)``, correction bias U(0, 0.1) from ``gen(2)`` (score routing with a bias), hash
    table of ``hash_vocab`` rows of distinct experts from ``gen(3)`` (hash routing)."""
    e, h = c.num_experts, c.hidden_size
    gate = (torch.randn(e, h, generator=gen(1), device=device) * h ** -0.5).to(torch.bfloat16)
    bias = None
    if c.use_correction_bias and hash_vocab is None:
        bias = torch.rand(e, generator=gen(2), device=device) * 0.1
    tid2eid = None
    if hash_vocab is not None:
        tid2eid = torch.rand(hash_vocab, e, generator=gen(3), device=device).topk(c.top_k, dim=1).indices.int()
    return gate, bias, tid2eid


def dispatch_buffers(pairs: int, groups: int, device) -> dict:
    """Preallocated outputs of ``megamoe.ops.moe.dispatch`` for up to ``pairs`` (token, expert) pairs over ``groups``
    expert groups (graph-stable pointers)."""
    return {
        "sorted_expert": torch.empty(pairs, dtype=torch.int32, device=device),
        "perm": torch.empty(pairs, dtype=torch.int64, device=device),
        "row_index": torch.empty(pairs, dtype=torch.int32, device=device),
        "inv_perm": torch.empty(pairs, dtype=torch.int32, device=device),
        "arange": torch.arange(pairs, dtype=torch.int32, device=device),
        "experts": torch.arange(groups, dtype=torch.int32, device=device),
        "expert_offsets": torch.empty(groups, dtype=torch.int32, device=device),
    }


def check_router_weights(c: MoEConfig, dev, gate_weight, correction_bias, tid2eid):
    """The router's weights checked (before any state changes) and returned as a layer stores them: gate (E, H)
    in its own dtype, bf16 or float32 (the router computes its logits in fp32 from either: bf16 -> fp32 is exact;
    a bf16 gate halves the decode GEMV's bytes and needs one tensor-core product per element in prefill instead of
    the fp32 gate's three), correction bias (E,) float32 or None,
    hash table (vocab, k) int32 or None. Shared by :class:`Nvfp4MoE` and the expert-parallel layer."""
    if not isinstance(gate_weight, torch.Tensor) or gate_weight.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError("gate_weight: expected a bf16/fp32 tensor (E, H)")
    if tuple(gate_weight.shape) != (c.num_experts, c.hidden_size) or gate_weight.device != dev:
        raise ValueError(f"gate_weight: expected shape {(c.num_experts, c.hidden_size)} on {dev}, got "
                         f"{tuple(gate_weight.shape)} on {gate_weight.device}")
    if tid2eid is not None:
        if not isinstance(tid2eid, torch.Tensor):
            raise TypeError(f"tid2eid: expected a torch.Tensor, got {type(tid2eid).__name__}")
        if tid2eid.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"tid2eid: expected int32 or int64, got {tid2eid.dtype}")
        if tid2eid.dim() == 2 and tid2eid.dtype == torch.int64 and tid2eid.numel():
            lo, hi = int(tid2eid.min()), int(tid2eid.max())  # before the int32 cast can wrap
            if lo < 0 or hi >= c.num_experts:
                raise ValueError(f"tid2eid: expected expert ids in [0, {c.num_experts}), got values in "
                                 f"[{lo}, {hi}]")
        tid2eid = tid2eid.to(device=dev, dtype=torch.int32).contiguous()
        moe_ops.check_tid2eid(tid2eid, c.num_experts, c.top_k)
        if correction_bias is not None:
            raise ValueError("correction_bias: hash-routed layers (tid2eid given) have no correction bias; "
                             "pass None")
    elif c.use_correction_bias:
        if correction_bias is None:
            raise ValueError("correction_bias: the config uses e_score_correction_bias; got None")
        if tuple(correction_bias.shape) != (c.num_experts,) or correction_bias.device != dev:
            raise ValueError(f"correction_bias: expected ({c.num_experts},) on {dev}, got "
                             f"{tuple(correction_bias.shape)} on {correction_bias.device}")
        correction_bias = correction_bias.float().contiguous()
    else:
        correction_bias = None
    return gate_weight.contiguous(), correction_bias, tid2eid


def _per_expert_global_scale(gs: torch.Tensor, experts: int) -> torch.Tensor:
    """0-d / (E,1,1) / (E,R,1) / (R,1) -> (experts, 1 or R, 1)."""
    if gs.dim() == 0:
        return gs.reshape(1, 1, 1).expand(experts, 1, 1)
    if gs.dim() == 2:
        gs = gs.unsqueeze(0)
    return gs.expand(experts, gs.shape[1], 1)


def _append_expert(stacked: NVFP4Tensor, extra: NVFP4Tensor) -> NVFP4Tensor:
    """(E, N, K) stacked experts + one (N, K) expert -> (E+1, N, K), global scales merged exactly (load time)."""
    if stacked.row_interleave != 1 or extra.row_interleave != 1:
        raise ValueError("weights: expected row-major experts (row_interleave 1) to append the shared expert")
    e = stacked.shape[0]
    gs_a = _per_expert_global_scale(stacked.global_scale, e)
    gs_b = _per_expert_global_scale(extra.global_scale, 1)
    rows = max(gs_a.shape[1], gs_b.shape[1])
    gs = torch.cat((gs_a.expand(e, rows, 1), gs_b.expand(1, rows, 1))).contiguous()
    return NVFP4Tensor(
        torch.cat((stacked.data, extra.data.unsqueeze(0))),
        torch.cat((stacked.block_scale, extra.block_scale.unsqueeze(0))),
        gs,
        (e + 1,) + tuple(stacked.shape[1:]),
    )


def quantize_weight(w: torch.Tensor) -> NVFP4Tensor:
    """bf16 weight (N, K) -> NVFP4 with one global scale; (E, N, K) -> one global scale per expert (E,1,1)."""
    if w.dim() == 3:
        gs = quantize_ops.compute_global_scale(w.reshape(w.shape[0], -1), per_row=True).reshape(-1, 1, 1)
        return quantize_ops.quantize(w, gs)
    return quantize_ops.quantize(w)


# Random weights (Nvfp4MoE.random): float32 elements drawn and quantized at a time (1 GiB of float32).
RANDOM_CHUNK_ELEMENTS = 1 << 28


def _sub_seed(seed: int, tag: int, index: int) -> int:
    """A 63-bit seed for tensor ``tag``, expert ``index`` (a fixed integer mix: same inputs, same seed)."""
    x = (int(seed) * 0x9E3779B97F4A7C15 + tag * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB) % (1 << 64)
    x ^= x >> 31
    return (x * 0xD6E8FEB86659FD93 % (1 << 64)) >> 1


def _random_experts(experts: int, shape: tuple, scale: float, generator, device, kept: dict | None,
                    name: str) -> NVFP4Tensor:
    """(experts, N, K) NVFP4 with per-expert global scales: each expert drawn from ``generator(e)`` as
    ``randn * scale`` -> bf16, quantized a chunk of experts at a time into preallocated tensors."""
    n, k = shape
    chunk = max(1, min(experts, RANDOM_CHUNK_ELEMENTS // (n * k)))
    data = torch.empty((experts, n, k // 2), dtype=torch.uint8, device=device)
    block_scale = torch.empty((experts, n, k // 16), dtype=torch.float8_e4m3fn, device=device)
    global_scale = torch.empty((experts, 1, 1), dtype=torch.float32, device=device)
    full = torch.empty((experts, n, k), dtype=torch.bfloat16, device=device) if kept is not None else None
    buf = torch.empty((chunk, n, k), dtype=torch.float32, device=device)
    for start in range(0, experts, chunk):
        stop = min(experts, start + chunk)
        for j in range(start, stop):
            torch.randn((n, k), generator=generator(j), device=device, out=buf[j - start])
        w = buf[: stop - start].mul_(scale).to(torch.bfloat16)
        q = quantize_weight(w)
        data[start:stop].copy_(q.data)
        block_scale[start:stop].copy_(q.block_scale)
        global_scale[start:stop].copy_(q.global_scale.reshape(-1, 1, 1))
        if full is not None:
            full[start:stop].copy_(w)
        del w, q
    if kept is not None:
        kept[name] = full
    return NVFP4Tensor(data, block_scale, global_scale, (experts, n, k))


@torch.library.custom_op("megamoe::moe_layer_forward", mutates_args=())
def _moe_layer_forward(hidden_states: torch.Tensor, layer_id: int,
                       token_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    return _LAYERS[layer_id].forward(hidden_states, token_ids).clone()


@_moe_layer_forward.register_fake
def _moe_layer_forward_fake(hidden_states: torch.Tensor, layer_id: int,
                            token_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    return torch.empty_like(hidden_states)
