"""Programmatic dependent launch switch (megamoe/kernels/pdl.py)."""
import os

import pytest
import torch

from megamoe.kernels import pdl


def test_pdl_is_off_on_cpu_and_in_the_interpreter(monkeypatch):
    monkeypatch.setattr(pdl, "PDL_ENABLED", True)
    assert not pdl.pdl_enabled(torch.zeros(1))
    monkeypatch.setattr(pdl, "PDL_ENABLED", False)
    assert not pdl.pdl_enabled(torch.zeros(1))


@pytest.mark.slow
def test_sm90_build_waits_first_only_when_on():
    """Offline sm_90 build of the decode GEMM: griddepcontrol.wait + launch_dependents with PDL, none without."""
    from megamoe.kernels.gemm import nvfp4_gluon_jit

    if not nvfp4_gluon_jit.GLUON_AVAILABLE:
        pytest.skip("needs Gluon")
    from megamoe.kernels.gemm import nvfp4_mma_decode as mma

    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        scalars = ["num_rows", "N", "K", "num_experts", "num_programs", "row_lo", "row_hi", "own_pad", "stride_xm",
                   "stride_we", "stride_wn", "stride_se", "stride_sn", "stride_ge", "stride_gn", "stride_om",
                   "splits", "chunk_steps", "slot_chunks"]
        for on in (False, True):
            c = nvfp4_gluon_jit.compile_sm90(mma._nvfp4_mma_decode_kernel, scalars, (8, 128, 256), 4, swiglu=True,
                                             extra_signature=dict(ws_ptr="*fp32", cnt_ptr="*i32"),
                                             extra_constants=dict(SPLIT=0, STAGES=0, PDL=on))
            ptx = c.asm["ptx"]
            assert ptx.count("griddepcontrol.wait") == int(on)
            assert ptx.count("griddepcontrol.launch_dependents") == int(on)
            if on:  # the wait comes before the kernel's first global load
                assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_cuda_moe_layer_pdl_equals_plain_graph_and_sync_free(monkeypatch, tokens):
    """With PDL on, the V4-Flash MoE layer (route + dispatch, decode GEMMs, combine launched with PDL): eager
    without host syncs, graph replay == eager, and the same bits as with PDL off."""
    from megamoe.layers.moe import Nvfp4MoE
    from megamoe.models.config import PRESETS
    from megamoe.ops import errors

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90+")
    config = PRESETS["v4-flash"]
    layer = Nvfp4MoE.random(config, seed=0, max_num_tokens=tokens, device="cuda")
    x = torch.randn(tokens, config.hidden_size, device="cuda").to(torch.bfloat16)
    monkeypatch.setattr(pdl, "PDL_ENABLED", False)
    plain = layer.forward(x).clone()
    monkeypatch.setattr(pdl, "PDL_ENABLED", True)
    layer.forward(x)  # compile outside the sync check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = layer.forward(x).clone()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    run = layer.capture(tokens)
    replayed = run(x).clone()
    torch.cuda.synchronize()
    errors.check_errors("cuda")
    assert torch.equal(eager, plain)
    assert torch.equal(replayed, plain)
