"""Programmatic dependent launch (PDL, Hopper+) for the decode-path kernels: the one switch and the prologue.

A kernel launched with ``launch_pdl=True`` may be scheduled while the previous kernel on the stream is still
running; its CTAs start and then block in ``griddepcontrol.wait`` until that kernel has completed and its
writes are visible. It hides the launch latency and the previous kernel's tail, which dominate 1-token
decode (~10-30 small kernels per layer, issue 11).

Contract of a PDL kernel: :func:`grid_dependency_prologue` (Triton) or :func:`gl_grid_dependency_prologue`
(Gluon) is its FIRST statement, before any global load, store or atomic (error words and counters included),
so nothing it touches can race with earlier kernels. Two exceptions, opt-in per launch: :data:`PDL_EARLY_READS`
(loads of inputs that were final before the previous kernel started, then the wait) and a later band of a banded
GEMM (``after_band`` of the decode / pipelined GEMMs: computes beside the previous band and waits at its exit). An
early-reading program without work exits without waiting, so such a grid could complete before the one it follows:
``megamoe.ops.gemm`` gives early reads only to a GEMM planned as one launch (no band is launched on it; its programs
with rows wait). The prologue then lets the next kernel launch at once
(``griddepcontrol.launch_dependents``): the decode grids this is used on fit in one wave, so all of their CTAs
are resident when the trigger fires, and early dependents only take free SM slots while they wait. The trigger
counts once EVERY CTA of the grid has executed it (or exited), so a grid of more than one wave triggers when its
last wave starts; its dependents' waiting CTAs then hold SM slots (registers, shared memory) while that wave
runs. For large multi-wave grids (prefill) trigger late or not at all: there is nothing to hide there. Chains
stay one deep: a kernel triggers only after its own wait returned, so at most the next kernel is early. With
the flag off the constexpr branch emits nothing and the launch is an ordinary one (bit-for-bit today's kernel).

In the Triton interpreter the prologue is a no-op (the PTX has no CPU meaning; the interpreter runs kernels one
after another anyway), so interpreter tests can force the flag on.

Switch: env ``MEGAMOE_PDL`` read at import, "1" on for every kernel that has the prologue, anything else off (the
default: measured slower at 2-4 tokens). With it off, :data:`PDL_PROLOGUE` / :data:`PDL_LAUNCH` turn it on per
kernel (:func:`pdl_flags`).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language import core

PDL_ENABLED = os.environ.get("MEGAMOE_PDL", "0").strip() == "1"


def pdl_supported(t: torch.Tensor) -> bool:
    """Whether a launch on ``t``'s device can use PDL: a CUDA device of compute capability >= 9, not the Triton
    interpreter (host decision from metadata only)."""
    if not t.is_cuda or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    return torch.cuda.get_device_capability(t.device)[0] >= 9


def pdl_enabled(t: torch.Tensor) -> bool:
    """Whether a launch on ``t``'s device uses PDL: the switch and :func:`pdl_supported`."""
    return PDL_ENABLED and pdl_supported(t)


def _env_names(variable: str, default: str) -> frozenset:
    """The comma list of kernel names in env ``variable`` (``default`` when unset; "" is the empty set)."""
    return frozenset(v.strip() for v in os.environ.get(variable, default).split(",") if v.strip())


#: Per-kernel PDL with the switch off (NOTES_moe_decode.md "PDL per kernel boundary"): names of the kernels
#: (:func:`pdl_flags`' ``kernel``) built with the prologue, so that they let the next launch start early (launched
#: plainly, their wait is a no-op) ... (env MEGAMOE_PDL_PROLOGUE, a comma list, read at import)
PDL_PROLOGUE = _env_names("MEGAMOE_PDL_PROLOGUE", "route_dispatch,mma_decode")
#: ... and of the kernels launched with PDL (and built with the prologue: they wait for the previous grid) where the
#: launcher says its grid is a single pass (every program has at most one work item, so no program of it is still to
#: come when its waiting dependents take free SM slots). Measured in the MoE layer (H100, read flush): with the route,
#: both decode GEMMs and the combine early, 1 token 1.030x (V4-Flash) / 1.016x (V4-Pro); early GEMMs whose programs
#: loop over several chunks (2-4 tokens) were 0.945-0.954x, hence the single-pass condition. (env MEGAMOE_PDL_LAUNCH)
#: The sparse attention's main kernel and split combine ("attention", "attention_combine") are not in it: launched
#: early by name (H200, results/gpu_check_v41 c) they were 0.95-1.02x per call at batch 32 / 64 (eight calls per graph)
#: and 0.996x / 1.000x on the V4-Flash decode step at batch 1 / 32.
PDL_LAUNCH = _env_names("MEGAMOE_PDL_LAUNCH", "mma_decode,combine")


#: Kernels that, launched with PDL and told by their caller that their routing inputs were final before the previous
#: kernel started, read them (and their weights) before waiting for the previous kernel (:func:`pdl_early_reads`;
#: the mma.sync decode GEMM's ``early_reads``: the MoE layer's down GEMM builds its tile table and loads its first
#: weight step while gate_up finishes). Measured (H100, the layer, read flush, same bits): V4-Flash 1 token 60.6 ->
#: 58.2 us, V4-Pro 124.7 -> 124.2; 2 tokens (no PDL launch of down) unchanged. (env MEGAMOE_PDL_EARLY_READS, a comma
#: list, read at import; "" off)
#: "splitk" (the dense split-K GEMM, ``nvfp4_linear(weight_settled=True)``: its first weight step) is not in the
#: default: per call in a chain of 32 (H200, results/gpu_check_v40/bench_dense_pdl_b.md) it saved 0.6-1.4 us on the
#: small shapes (1024x4096 M = 1 6.2 -> 4.8 us) but cost 0.6-1.9 us on 4096x8192 at M = 1 / 8, and it did not move the
#: V4-Flash decode step (1.002x / 0.997x / 0.994x at batch 1 / 8 / 64, one process: NOTES_gemm.md v35, NOTES_model.md).
PDL_EARLY_READS = _env_names("MEGAMOE_PDL_EARLY_READS", "mma_decode")


def pdl_early_reads(kernel: str) -> bool:
    """Whether ``kernel`` may read inputs that its caller vouches were final before the previous kernel started
    ahead of its PDL wait (:data:`PDL_EARLY_READS`); it only matters where the launch uses PDL (:func:`pdl_flags`)."""
    return kernel in PDL_EARLY_READS


def pdl_flags(t: torch.Tensor, kernel: str, single_pass: bool = True) -> tuple[bool, bool]:
    """(the ``PDL`` constexpr, ``launch_pdl``) of one launch of ``kernel`` ("route_dispatch", "mma_decode",
    "combine", "splitk", "attention" (the sparse attention's main kernel), "attention_combine" (its split combine))
    on ``t``'s device: both True with the switch :data:`PDL_ENABLED` on; with it off, the prologue for the kernels
    of :data:`PDL_PROLOGUE` and both for those of :data:`PDL_LAUNCH` whose launch is ``single_pass`` (the launcher's
    host answer). Neither where :func:`pdl_supported` is False (CPU, the interpreter, pre-sm_90)."""
    if not (PDL_ENABLED or PDL_PROLOGUE or PDL_LAUNCH) or not pdl_supported(t):
        return False, False
    if PDL_ENABLED:
        return True, True
    launch = kernel in PDL_LAUNCH and single_pass
    return launch or kernel in PDL_PROLOGUE, launch


def _compiled_only(fn):
    """A Triton builtin that the interpreter (which calls non-``tl`` builtins without a semantic) runs as a
    no-op instead of raising."""
    @functools.wraps(fn)
    def wrapper(*args, _semantic=None, **kwargs):
        if _semantic is None:
            return None
        return fn(*args, _semantic=_semantic, **kwargs)

    setattr(wrapper, core.TRITON_BUILTIN, True)
    return wrapper


@_compiled_only
def _gdc_wait(_semantic=None):  # the PTX of triton.language.extra.cuda.gdc_wait
    core.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=core.int32, is_pure=False,
                                pack=1, _semantic=_semantic)


@_compiled_only
def _gdc_launch_dependents(_semantic=None):  # ... and of gdc_launch_dependents
    core.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=core.int32,
                                is_pure=False, pack=1, _semantic=_semantic)


@triton.jit
def grid_dependency_prologue(ENABLED: tl.constexpr):
    """Wait for the previous kernel (its writes visible), then allow the next one to launch. Call it as the
    kernel's first statement with the kernel's ``PDL`` constexpr; ``ENABLED`` False emits nothing."""
    if ENABLED:
        _gdc_wait()
        _gdc_launch_dependents()


try:  # the Gluon twin (the same PTX through Gluon's inline asm)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    @gluon.jit
    def gl_wait_for_previous_grid():
        """``griddepcontrol.wait``: block until the previous kernel on the stream has completed and its writes are
        visible (a no-op for a kernel launched without PDL)."""
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def gl_launch_dependents():
        """``griddepcontrol.launch_dependents``: let the next kernel on the stream (launched with PDL) start once
        every CTA of this grid has executed it or exited."""
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def gl_grid_dependency_prologue(ENABLED: gl.constexpr):
        if ENABLED:
            gl_wait_for_previous_grid()
            gl_launch_dependents()
except ImportError:  # no Gluon in this Triton: only the Triton kernels use PDL
    gl_grid_dependency_prologue = gl_wait_for_previous_grid = gl_launch_dependents = None
