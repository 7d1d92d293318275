"""Nvfp4MoE / Nvfp4SharedExpert vs the float32 reference layer (decoded weights, same routing)."""
import pytest
import torch

from megamoe.layers import Nvfp4MoE
from megamoe.models import MoEConfig
from sync_helpers import no_host_syncs

TINY = MoEConfig(hidden_size=64, intermediate_size=32, num_experts=8, top_k=2, shared_intermediate_size=32,
                 scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, swiglu_limit=10.0, name="tiny")


def _rel(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


@pytest.fixture(scope="module")
def layer():
    return Nvfp4MoE.random(TINY, seed=1234, max_num_tokens=16)


def test_w4a16_matches_float32_reference(layer):
    x = torch.randn(11, TINY.hidden_size).bfloat16()
    out = layer.forward(x).clone()
    routing = layer.last_routing
    ref = layer.reference_forward(x, routing)
    assert _rel(out, ref) < 1e-2
    w, ids = layer.route(x)  # routing is reproducible on the same inputs
    assert torch.equal(ids, routing[1]) and torch.equal(w, routing[0])
    # the bound is tight enough that a wrong pipeline fails it: drop the shared expert from the reference
    wrong = ref - layer.shared.reference_forward(x)
    assert _rel(out, wrong) > 5e-2


def test_one_token_and_empty_experts(layer):
    x = torch.randn(1, TINY.hidden_size).bfloat16()  # 1 token: 6 of 8 experts get no rows
    out = layer.forward(x).clone()
    assert _rel(out, layer.reference_forward(x, layer.last_routing)) < 1e-2


def test_all_tokens_to_one_expert():
    cfg = TINY.replace(top_k=1, shared_intermediate_size=0)
    lay = Nvfp4MoE.random(cfg, seed=7, max_num_tokens=8)
    lay.correction_bias = torch.zeros(cfg.num_experts)
    lay.correction_bias[5] = 100.0
    x = torch.randn(6, cfg.hidden_size).bfloat16()
    out = lay.forward(x).clone()
    assert (lay.last_routing[1] == 5).all()
    assert _rel(out, lay.reference_forward(x, lay.last_routing)) < 1e-2


def test_too_many_tokens_and_bad_input(layer):
    with pytest.raises(ValueError, match="max_num_tokens"):
        layer.forward(torch.randn(17, TINY.hidden_size).bfloat16())
    with pytest.raises(TypeError, match="bfloat16"):
        layer.forward(torch.randn(2, TINY.hidden_size))
    with pytest.raises(ValueError, match="hidden_states"):
        layer.forward(torch.randn(2, 48).bfloat16())
    assert layer.forward(torch.empty(0, TINY.hidden_size).bfloat16()).shape == (0, TINY.hidden_size)


def test_constructor_arguments_are_validated():
    """Sizes are positive ints (not bools), NVFP4 reduction widths multiples of 16, flags bools, the SwiGLU limit a
    positive finite number or None, the device a real device string; each error names its argument."""
    from megamoe.layers import Nvfp4SharedExpert

    for kw, name in ((dict(hidden_size=True), "hidden_size"), (dict(hidden_size=0), "hidden_size"),
                     (dict(hidden_size=17), "hidden_size"), (dict(hidden_size=-64), "hidden_size"),
                     (dict(intermediate_size=0), "intermediate_size"), (dict(max_num_tokens=True), "max_num_tokens"),
                     (dict(swiglu_limit=-1.0), "swiglu_limit"), (dict(swiglu_limit="10"), "swiglu_limit"),
                     (dict(swiglu_limit=float("nan")), "swiglu_limit"), (dict(device="nonsense"), "device")):
        args = dict(dict(hidden_size=64, intermediate_size=32, max_num_tokens=4), **kw)
        with pytest.raises((TypeError, ValueError), match=name):
            Nvfp4SharedExpert(args.pop("hidden_size"), args.pop("intermediate_size"), **args)
    for kw, name in ((dict(fuse_shared_max_tokens=-1), "fuse_shared_max_tokens"),
                     (dict(fuse_shared_max_tokens="8"), "fuse_shared_max_tokens"),
                     (dict(fuse_shared_max_tokens=2.5), "fuse_shared_max_tokens"),
                     (dict(fuse_shared_max_tokens=True), "fuse_shared_max_tokens"),
                     (dict(fuse_shared_expert="no"), "fuse_shared_expert"),
                     (dict(max_num_tokens=True), "max_num_tokens"),
                     (dict(device="nonsense"), "device")):
        with pytest.raises((TypeError, ValueError), match=name):
            Nvfp4MoE(TINY, **dict(dict(max_num_tokens=4), **kw))
    assert Nvfp4MoE(TINY, max_num_tokens=4, fuse_shared_max_tokens=0).fuse_shared_max_tokens == 0


def test_nan_token_gives_nan_row_only(layer):
    x = torch.randn(4, TINY.hidden_size).bfloat16()
    clean = layer.forward(x).clone()
    x[1, 7] = float("nan")
    out = layer.forward(x).clone()
    assert torch.isnan(out[1]).all()
    assert torch.equal(out[[0, 2, 3]], clean[[0, 2, 3]])


# w4a4: the reference fake-quantizes its own float32 intermediate, the layer the bf16 GEMM output; a last-bit
# difference can move a value across an E2M1 rounding boundary (one code step is 1/6..1/3 relative), so on a
# tiny layer a few such flips give ~1e-2. 5e-2 still fails for a missing expert / shared term (> 5e-2 above).
W4A4_BOUND = 5e-2


def test_w4a4_dynamic_and_calibrated():
    lay = Nvfp4MoE.random(TINY, seed=99, max_num_tokens=8, mode="w4a4")
    x = torch.randn(5, TINY.hidden_size).bfloat16()
    out = lay.forward(x).clone()
    assert _rel(out, lay.reference_forward(x, lay.last_routing)) < W4A4_BOUND
    scales = lay.calibrate(x)
    assert scales["l2"].shape == (TINY.num_experts,) and (scales["l2"] > 0).all()
    out_static = lay.forward(x).clone()
    ref = lay.reference_forward(x, lay.last_routing)
    assert _rel(out_static, ref) < W4A4_BOUND
    assert not torch.equal(out_static, out)  # static scales really change the quantization


def test_custom_op_is_opaque_to_torch_compile(layer):
    x = torch.randn(3, TINY.hidden_size).bfloat16()
    expected = layer.forward(x).clone()
    compiled = torch.compile(lambda t: layer.compiled_forward(t) * 2, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), expected * 2, rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("tokens", [2, 37])  # fused shared expert (<= 4 tokens) and separate
def test_cuda_graph_and_no_host_syncs(mode, tokens):
    lay = Nvfp4MoE.random(TINY, seed=3, max_num_tokens=64, device="cuda", mode=mode)
    x = torch.randn(tokens, TINY.hidden_size, device="cuda").bfloat16()
    eager = lay.forward(x).clone()
    assert _rel(eager, lay.reference_forward(x, lay.last_routing)) < (1e-2 if mode == "w4a16" else W4A4_BOUND)
    torch.cuda.synchronize()
    with no_host_syncs():
        lay.forward(x)
    replay = lay.capture(tokens)
    assert torch.equal(replay(x), eager)
    x2 = torch.randn_like(x)
    eager2 = lay.forward(x2).clone()
    assert torch.equal(replay(x2), eager2)


def test_fused_and_separate_shared_expert_agree():
    fused = Nvfp4MoE.random(TINY, seed=21, max_num_tokens=8)
    separate = Nvfp4MoE.random(TINY, seed=21, max_num_tokens=8, fuse_shared_expert=False)
    assert fused.fused_shared and not separate.fused_shared
    x = torch.randn(3, TINY.hidden_size).bfloat16()  # <= fuse_shared_max_tokens: the fused path runs
    assert x.shape[0] <= fused.fuse_shared_max_tokens
    a, b = fused.forward(x).clone(), separate.forward(x).clone()
    ref = fused.reference_forward(x, fused.last_routing)
    assert _rel(a, ref) < 1e-2 and _rel(b, ref) < 1e-2
    assert _rel(a, b.float()) < 4e-3  # same GEMMs, only the combine's summation order differs


def test_shared_overlap_is_the_separate_path_bit_for_bit():
    """shared_overlap runs the unfused shared expert (on CUDA beside the router, on a side stream): the same
    kernels and combine order as fuse_shared_expert=False, so the same bits; never the fused order."""
    overlap = Nvfp4MoE.random(TINY, seed=22, max_num_tokens=8, shared_overlap=True)
    separate = Nvfp4MoE.random(TINY, seed=22, max_num_tokens=8, fuse_shared_expert=False)
    fused = Nvfp4MoE.random(TINY, seed=22, max_num_tokens=8)
    x = torch.randn(3, TINY.hidden_size).bfloat16()  # a decode size: the default layer fuses here
    calls = []
    for lay in (overlap, fused):  # count the separate shared-expert runs
        inner = lay.shared.forward
        lay.shared.forward = lambda h, out=None, inner=inner, lay=lay: calls.append(lay) or inner(h, out)
    a, b = overlap.forward(x).clone(), separate.forward(x).clone()
    fused.forward(x)
    assert torch.equal(a, b)
    assert calls == [overlap]  # the option really unfuses (the default layer fuses at 3 tokens)
    assert _rel(a, overlap.reference_forward(x, overlap.last_routing)) < 1e-2
    with pytest.raises(TypeError, match="shared_overlap"):
        Nvfp4MoE(TINY, max_num_tokens=4, shared_overlap=1)


# a shape whose shared expert takes the split-K route at 9-64 tokens (the overlap tests below)
SMALL = MoEConfig(hidden_size=512, intermediate_size=256, num_experts=8, top_k=2, shared_intermediate_size=256,
                  scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, swiglu_limit=10.0, name="small")


def _graph_matches(x, eager, layer, other):
    """CUDA: ``layer.forward(x)`` runs without host syncs; its graph at x's batch size replays ``eager`` on x and
    ``other``'s eager output on new inputs."""
    torch.cuda.synchronize()
    with no_host_syncs():
        layer.forward(x)
    replay = layer.capture(x.shape[0])
    assert torch.equal(replay(x), eager)
    x2 = torch.randn_like(x)
    assert torch.equal(replay(x2), other.forward(x2))


def test_shared_overlap_rule(monkeypatch):
    """shared_overlap=None (default): the side stream only on CUDA, in mode w4a16, at SHARED_OVERLAP_MIN_TOKENS..
    MAX_TOKENS tokens; a bool forces it either way; a layer without a shared expert never forks."""
    from megamoe.layers import moe as moe_mod

    assert moe_mod.SHARED_OVERLAP_MIN_TOKENS > moe_mod.FUSE_SHARED_MAX_TOKENS  # the rule never unfuses the fused sizes
    lay = Nvfp4MoE(TINY, max_num_tokens=4)
    assert lay.shared_overlap is None and lay._side_stream is None
    assert not any(lay.overlaps_shared(t) for t in (1, 9, 128))  # CPU
    monkeypatch.setattr(lay, "device", torch.device("cuda"))  # the rule reads the device type only
    assert [lay.overlaps_shared(t) for t in (8, 9, 512, 513)] == [False, True, True, False]
    lay.mode = "w4a8"
    assert not lay.overlaps_shared(16)
    assert Nvfp4MoE(TINY, max_num_tokens=4, shared_overlap=True).overlaps_shared(1)
    assert not Nvfp4MoE(TINY, max_num_tokens=4, shared_overlap=False).overlaps_shared(16)
    no_shared = MoEConfig(hidden_size=64, intermediate_size=32, num_experts=8, top_k=2, shared_intermediate_size=0,
                          scoring_func="sqrtsoftplus", name="no-shared")
    assert not Nvfp4MoE(no_shared, max_num_tokens=4, shared_overlap=True).overlaps_shared(16)


@pytest.mark.cuda
@pytest.mark.parametrize("tokens,overlapped", [(8, False), (9, True), (512, True), (513, False)])
def test_cuda_default_shared_overlap_same_bits(monkeypatch, tokens, overlapped):
    """The default layer (shared_overlap=None) forks the shared expert onto the side stream at 9-512 tokens only:
    the same bits as the layer with the overlap off, graph replay == eager with new inputs, no host syncs."""
    auto = Nvfp4MoE.random(SMALL, seed=7, max_num_tokens=tokens, device="cuda")
    off = Nvfp4MoE.random(SMALL, seed=7, max_num_tokens=tokens, device="cuda", shared_overlap=False)
    forks = []
    inner = auto._fork_shared
    monkeypatch.setattr(auto, "_fork_shared", lambda h: forks.append(h.shape[0]) or inner(h))
    x = torch.randn(tokens, SMALL.hidden_size, device="cuda").bfloat16()
    eager = auto.forward(x).clone()
    assert forks == ([tokens] if overlapped else [])
    assert torch.equal(eager, off.forward(x))
    _graph_matches(x, eager, auto, off)


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [1, 8, 9, 16])
def test_cuda_shared_overlap_graph_sync_free_same_bits(monkeypatch, tokens):
    """On the side stream the shared expert takes the split-K route only where its split-K launches reduce without
    the device's tile counters (more than nvfp4_splitk.FUSED_MAX_ROWS rows; the main stream's split-K launches share
    those counters), else its grouped GEMMs: the bits of the separate path on the same routes, graph == eager."""
    from megamoe.layers import moe as moe_mod
    from megamoe.ops import gemm as gemm_ops

    counters = gemm_ops.splitk_uses_tile_counters(tokens)
    assert counters == (tokens <= 8)
    if counters:  # for `separate`: the routes the side stream takes there
        monkeypatch.setattr(moe_mod, "SHARED_SPLITK", False)
    overlap = Nvfp4MoE.random(SMALL, seed=5, max_num_tokens=16, device="cuda", shared_overlap=True)
    separate = Nvfp4MoE.random(SMALL, seed=5, max_num_tokens=16, device="cuda", fuse_shared_expert=False)
    x = torch.randn(tokens, SMALL.hidden_size, device="cuda").bfloat16()
    # the shape takes split-K at 9-16 rows, so the test covers the side stream's split-K launches
    assert overlap.shared.dense_routes(x, "w4a16", not counters) == ((False, False) if counters else (True, True))
    seen = []
    inner = overlap.shared.forward
    monkeypatch.setattr(overlap.shared, "forward", lambda *a, **k: seen.append(k["splitk"]) or inner(*a, **k))
    eager = overlap.forward(x).clone()
    assert seen == [not counters]
    assert torch.equal(eager, separate.forward(x))
    assert overlap._side_stream is not None  # the shared expert went to the side stream
    _graph_matches(x, eager, overlap, separate)


@pytest.mark.cuda
@pytest.mark.parametrize("tokens,parts,switch,routes", [
    (9, False, "SHARED_SPLITK", (True, True)), (16, False, "SHARED_SPLITK", (True, True)),
    (64, False, "SHARED_SPLITK", (True, True)), (200, False, "SHARED_SPLITK", (False, True)),
    (512, False, "SHARED_DENSE_BF16", (True, True)), (600, True, "SHARED_DENSE_BF16", (True, True))])
def test_cuda_shared_expert_dense_routes_graph_sync_free(monkeypatch, tokens, parts, switch, routes):
    """The shared expert apart runs its GEMMs as dense GEMMs: split-K at 9-64 tokens (SHARED_SPLITK, the SwiGLU in
    the split-K reduction), the down on the tensor-core route above split-K's rows (200 tokens; the gate_up stays
    grouped there), route "dense-bf16" from its row threshold (SHARED_DENSE_BF16: cuBLAS on the exactly dequantized
    weights, the gate_up's SwiGLU after its float32 product), the latter also with gate and up quantized apart
    (``parts``: a checkpoint's separate global scales, alternating rows once interleaved). Within the bound of the
    float32 reference and of the grouped one-expert path (``switch`` off), graph replays with new inputs == eager, no
    host syncs."""
    from megamoe.layers import Nvfp4SharedExpert
    from megamoe.layers import moe as moe_mod
    from megamoe.layers.linear import concat_rows
    from megamoe.reference.quantize import quantize

    shared = Nvfp4SharedExpert(512, 256, max_num_tokens=tokens, device="cuda")
    g = torch.Generator().manual_seed(tokens)
    w13 = torch.randn(512, 512, generator=g) * 0.05
    w13 = concat_rows([quantize(w13[:256] * 3), quantize(w13[256:])]) if parts else quantize(w13)
    shared.load_weights(w13.to("cuda"), quantize(torch.randn(512, 256, generator=g) * 0.05).to("cuda"))
    assert (shared._w13_host.segments is None) == parts
    x = torch.randn(tokens, 512, device="cuda").bfloat16()
    assert shared.dense_routes(x, "w4a16") == routes
    eager = shared.forward(x).clone()
    assert _rel(eager, shared.reference_forward(x)) < 1e-2
    monkeypatch.setattr(moe_mod, switch, False)
    assert shared.dense_routes(x, "w4a16") == (False, False)
    assert _rel(eager, shared.forward(x).float()) < 1e-2
    monkeypatch.setattr(moe_mod, switch, True)
    torch.cuda.synchronize()
    with no_host_syncs():
        shared.forward(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = shared.forward(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone()
    assert torch.equal(replayed, shared.forward(x))
    assert _rel(replayed, shared.reference_forward(x)) < 1e-2


# ---------------------------------------------------------------- x in the paired order (issue 11)
PAIRED = MoEConfig(hidden_size=512, intermediate_size=256, num_experts=16, top_k=4, shared_intermediate_size=256,
                   scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, swiglu_limit=10.0, name="paired")


@pytest.mark.cuda
@pytest.mark.parametrize("row_interleave", [1, 4])
def test_cuda_paired_x_same_bits_graph_sync_free(monkeypatch, row_interleave):
    """Decode batches in the window (widened here to 1..8 tokens) take the paired x path (the rule fires: K % 256
    shapes, mma decode bands only) and give the bits of the plain path (PAIRED_X_MAX_TOKENS 0), eager and in graph
    replays with new inputs, without host syncs; 9 tokens stay plain."""
    from megamoe.layers import moe as moe_mod

    monkeypatch.setattr(moe_mod, "PAIRED_X_MIN_TOKENS", 1)
    monkeypatch.setattr(moe_mod, "PAIRED_X_MAX_TOKENS", 8)
    paired = Nvfp4MoE.random(PAIRED, seed=7, max_num_tokens=16, device="cuda", row_interleave=row_interleave)
    plain = Nvfp4MoE.random(PAIRED, seed=7, max_num_tokens=16, device="cuda", row_interleave=row_interleave)
    for tokens in (1, 3, 8, 9):
        x = torch.randn(tokens, PAIRED.hidden_size, device="cuda").bfloat16()
        got = paired.forward(x).clone()
        fuse = paired.fused_shared and tokens <= paired.fuse_shared_max_tokens
        assert paired._paired_x(x, fuse) == (tokens <= 8), tokens
        monkeypatch.setattr(moe_mod, "PAIRED_X_MAX_TOKENS", 0)
        want = plain.forward(x).clone()
        assert not plain._paired_x(x, fuse)
        monkeypatch.setattr(moe_mod, "PAIRED_X_MAX_TOKENS", 8)
        assert torch.equal(got, want), tokens
        assert _rel(got, paired.reference_forward(x, paired.last_routing)) < 1e-2
        if tokens == 9:
            continue
        torch.cuda.synchronize()
        with no_host_syncs():
            paired.forward(x)
        replay = paired.capture(tokens)
        x2 = torch.randn_like(x)
        monkeypatch.setattr(moe_mod, "PAIRED_X_MAX_TOKENS", 0)
        want2 = plain.forward(x2).clone()
        monkeypatch.setattr(moe_mod, "PAIRED_X_MAX_TOKENS", 8)
        assert torch.equal(replay(x2), want2)
        assert torch.equal(replay(x), want)


# ---------------------------------------------------------------- fused decode (issue 11, opt-in)
def test_fused_decode_layer_within_bound_and_falls_back(monkeypatch):
    """fused_decode=True: 1..16 tokens, w4a16 -> the single-launch kernel (interpreter on CPU), within the
    element-wise float32 bound (tests/moe_fused_helpers.py); other batches / modes take the existing path."""
    from moe_fused_helpers import fused_bound, within

    from megamoe.ops import moe_fused_decode as fused_ops
    from megamoe.ops._dispatch import interpreter_enabled

    if not interpreter_enabled():  # a GPU machine: CPU tensors take the torch reference (CUDA: tests/kernels)
        pytest.skip("the CPU layer reaches the fused kernel only under the Triton interpreter (TRITON_INTERPRET=1)")
    lay = Nvfp4MoE.random(TINY, seed=31, max_num_tokens=24, fused_decode=True)
    calls = []
    inner = fused_ops.moe_fused_decode
    monkeypatch.setattr(fused_ops, "moe_fused_decode", lambda *a, **k: calls.append(a[0].shape[0]) or inner(*a, **k))
    for t in (1, 5):
        x = torch.randn(t, TINY.hidden_size).bfloat16()
        out = lay.forward(x).clone()
        ref, bound, _ = fused_bound(lay, x, *lay.last_routing)
        assert within(out, ref, bound)
    assert calls == [1, 5]
    x = torch.randn(20, TINY.hidden_size).bfloat16()  # above FUSED_DECODE_MAX_TOKENS: the existing path
    out = lay.forward(x).clone()
    assert calls == [1, 5] and _rel(out, lay.reference_forward(x, lay.last_routing)) < 1e-2
    lay.set_mode("w4a4")  # w4a16 only
    lay.forward(torch.randn(2, TINY.hidden_size).bfloat16())
    assert calls == [1, 5]


def test_fused_decode_switch(monkeypatch):
    monkeypatch.setenv("MEGAMOE_MOE_FUSED_DECODE", "1")
    assert Nvfp4MoE(TINY, max_num_tokens=4).fused_decode
    assert not Nvfp4MoE(TINY, max_num_tokens=4, fused_decode=False).fused_decode
    monkeypatch.setenv("MEGAMOE_MOE_FUSED_DECODE", "0")
    assert not Nvfp4MoE(TINY, max_num_tokens=4).fused_decode
    with pytest.raises(TypeError, match="fused_decode"):
        Nvfp4MoE(TINY, max_num_tokens=4, fused_decode=1)


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [1, 8])
def test_cuda_fused_decode_graph_sync_free(tokens):
    from moe_fused_helpers import fused_bound, within

    lay = Nvfp4MoE.random(TINY, seed=6, max_num_tokens=16, device="cuda", fused_decode=True)
    x = torch.randn(tokens, TINY.hidden_size, device="cuda").bfloat16()
    eager = lay.forward(x).clone()
    ref, bound, _ = fused_bound(lay, x, *lay.last_routing)
    assert within(eager, ref, bound)
    torch.cuda.synchronize()
    with no_host_syncs():
        lay.forward(x)
    replay = lay.capture(tokens)
    assert torch.equal(replay(x), eager)
    x2 = torch.randn_like(x)
    assert torch.equal(replay(x2), lay.forward(x2))


def test_row_interleaved_layer_gives_the_same_output(monkeypatch):
    """Nvfp4MoE(row_interleave=4): the routed experts' kernel copies interleaved, w13 / w2 kept in checkpoint order;
    the same output bits as the row-major layer at decode and prefill sizes (CPU: the torch reference reads a
    row-major copy, the interpreter path is tests/ops/test_gemm.py's; CUDA: the Gluon routes read the interleaved
    bytes); w4a16 only."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")  # the interpreter takes minutes at H = 256
    cfg = TINY.replace(hidden_size=256, intermediate_size=256, shared_intermediate_size=256)
    plain = Nvfp4MoE.random(cfg, seed=5, max_num_tokens=96, device=device, row_interleave=1)
    inter = Nvfp4MoE.random(cfg, seed=5, max_num_tokens=96, device=device, row_interleave=4)
    assert plain._w13_kernel.row_interleave == 1
    assert inter._w13_kernel.row_interleave == 4 and inter._w2_kernel.row_interleave == 4
    assert inter.w13.row_interleave == 1 and torch.equal(inter.w13.data, plain.w13.data)
    for t in (1, 5, 96):
        x = torch.randn(t, cfg.hidden_size, device=device).bfloat16()
        assert torch.equal(inter(x).clone(), plain(x).clone()), t
    with pytest.raises(ValueError, match="w4a16"):
        inter.set_mode("w4a8")
    for c, kw in ((cfg, dict(row_interleave=2)), (cfg, dict(row_interleave=4, mode="w4a4")),
                  (cfg.replace(intermediate_size=128), dict(row_interleave=4))):
        with pytest.raises(ValueError, match="row_interleave"):
            Nvfp4MoE(c, max_num_tokens=4, **kw)


def test_default_row_interleave_rule(monkeypatch):
    """row_interleave=None picks 4 exactly where every grouped GEMM of the layer has a Gluon kernel that reads it."""
    from megamoe.kernels.gemm import nvfp4_gluon_jit
    from megamoe.layers import moe as moe_layer
    from megamoe.ops import gemm as gemm_ops

    cfg = TINY.replace(hidden_size=256, intermediate_size=256, shared_intermediate_size=256)
    monkeypatch.setattr(nvfp4_gluon_jit, "GLUON_AVAILABLE", True)
    monkeypatch.setattr(nvfp4_gluon_jit, "_capability", lambda index: (9, 0))
    rule = moe_layer.default_row_interleave
    assert rule(cfg, "w4a16", "cuda") == 4 and rule(cfg, "w4a16", "cuda:0") == 4
    assert rule(cfg, "w4a16", "cpu") == 1
    for mode in ("w4a8", "w4a4"):
        assert rule(cfg, mode, "cuda") == 1
    assert rule(cfg, "w4a16", "cuda", fused_decode=True) == 1
    assert rule(cfg.replace(intermediate_size=128), "w4a16", "cuda") == 1
    assert rule(cfg.replace(hidden_size=320), "w4a16", "cuda") == 1
    monkeypatch.setattr(gemm_ops, "PIPE_ROUTE", False)
    assert rule(cfg, "w4a16", "cuda") == 1
    monkeypatch.setattr(gemm_ops, "PIPE_ROUTE", True)
    for capability in ((8, 0), (10, 0), (12, 0)):
        monkeypatch.setattr(nvfp4_gluon_jit, "_capability", lambda index, c=capability: c)
        assert rule(cfg, "w4a16", "cuda") == 1, capability


def test_defaulted_row_interleave_goes_row_major_for_other_modes(monkeypatch):
    """A layer whose interleaved layout came from the default re-lays its kernel copies row-major when set to another
    mode (then the same bits as a row-major layer in that mode), and refuses once graphs were captured from it; an
    explicit row_interleave=4 keeps refusing other modes."""
    from megamoe.layers import moe as moe_layer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")  # the torch reference paths (the interpreter takes minutes)
        monkeypatch.setattr(moe_layer, "default_row_interleave", lambda *args, **kwargs: 4)
    cfg = TINY.replace(hidden_size=256, intermediate_size=256, shared_intermediate_size=256)
    layer = Nvfp4MoE.random(cfg, seed=7, max_num_tokens=64, device=device)
    if device.type == "cuda" and moe_layer.default_row_interleave(cfg, "w4a16", device) == 1:
        pytest.skip("this GPU runs the row-major layout by default")
    plain = Nvfp4MoE.random(cfg, seed=7, max_num_tokens=64, device=device, row_interleave=1)
    assert layer.row_interleave == 4 and layer._w13_kernel.row_interleave == 4
    x = torch.randn(40, cfg.hidden_size, device=device).bfloat16()
    assert torch.equal(layer(x).clone(), plain(x).clone())
    layer.set_mode("w4a8")
    plain.set_mode("w4a8")
    assert layer.row_interleave == 1 and layer._w13_kernel.row_interleave == 1 and layer._w2_kernel.row_interleave == 1
    assert torch.equal(layer._w13_kernel.data, plain._w13_kernel.data)
    assert torch.equal(layer(x).clone(), plain(x).clone())
    layer.set_mode("w4a16")  # stays row-major
    assert layer.row_interleave == 1
    captured = Nvfp4MoE.random(cfg, seed=7, max_num_tokens=64, device=device)
    if device.type == "cuda":
        captured.capture(8)
    else:
        captured._captured = True  # capture() needs CUDA: what it records
    with pytest.raises(ValueError, match="capture"):
        captured.set_mode("w4a4")
    assert captured.row_interleave == 4 and captured.mode == "w4a16"
    explicit = Nvfp4MoE(cfg, max_num_tokens=4, device=device, row_interleave=4)
    with pytest.raises(ValueError, match="w4a16"):
        explicit.set_mode("w4a8")
