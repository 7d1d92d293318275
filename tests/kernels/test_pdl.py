"""Programmatic dependent launch (megamoe/kernels/pdl.py) on the decode-path kernels.

CPU: the switch is off on CPU / in the interpreter; every decode-path kernel starts with the prologue and every
launch passes ``PDL`` and ``launch_pdl`` from ``pdl_enabled`` (source check, and a recorded interpreter run
with the switch forced on, whose outputs equal the run with it off: the prologue is a no-op there); the offline
sm_90 builds have ``griddepcontrol.wait`` before any global memory instruction with PDL and none without.
CUDA (the lead runs them): PDL on == PDL off bit for bit, graph replay == eager, sync-free, for the MoE layer,
the top-k, sparse attention and a tiny-model decode step.
"""
import ast
import importlib
import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

from megamoe.kernels import pdl
from sync_helpers import no_host_syncs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: The decode-path kernel modules that launch with PDL (the decode GEMMs, nvfp4_mma_decode / nvfp4_splitk, are
#: owned elsewhere; nvfp4_mma_decode already has it).
DECODE_MODULES = ["megamoe.kernels.moe_route_dispatch", "megamoe.kernels.moe_router", "megamoe.kernels.moe_dispatch",
                  "megamoe.kernels.moe_combine", "megamoe.kernels.topk", "megamoe.kernels.kvcache.indexer",
                  "megamoe.kernels.sparse_attention", "megamoe.kernels.sparse_attention_ws",
                  "megamoe.kernels.hyper_connection", "megamoe.kernels.v4_elementwise", "megamoe.kernels.sampling",
                  "megamoe.kernels.gemm.nvfp4_mma_decode", "megamoe.kernels.gemm.nvfp4_splitk"]


def test_pdl_is_off_on_cpu_and_in_the_interpreter(monkeypatch):
    monkeypatch.setattr(pdl, "PDL_ENABLED", True)
    assert not pdl.pdl_enabled(torch.zeros(1))
    monkeypatch.setattr(pdl, "PDL_ENABLED", False)
    assert not pdl.pdl_enabled(torch.zeros(1))


def test_pdl_flags_per_kernel(monkeypatch):
    """The per-kernel knobs: a kernel in PDL_PROLOGUE is built with the prologue and launched plainly, one in
    PDL_LAUNCH both; the global switch turns both on everywhere; unsupported devices get neither."""
    t = torch.zeros(1)
    monkeypatch.setattr(pdl, "PDL_PROLOGUE", frozenset({"mma_decode"}))
    monkeypatch.setattr(pdl, "PDL_LAUNCH", frozenset({"combine"}))
    assert pdl.pdl_flags(t, "mma_decode") == (False, False)  # CPU tensor: no PDL at all
    monkeypatch.setattr(pdl, "pdl_supported", lambda t: True)
    assert pdl.pdl_flags(t, "mma_decode") == (True, False)
    assert pdl.pdl_flags(t, "combine") == (True, True)
    assert pdl.pdl_flags(t, "route_dispatch") == (False, False)
    assert pdl.pdl_flags(t, "combine", single_pass=False) == (False, False)  # a looping grid launches plainly
    monkeypatch.setattr(pdl, "PDL_LAUNCH", frozenset({"combine", "mma_decode"}))
    assert pdl.pdl_flags(t, "mma_decode", single_pass=False) == (True, False)  # still triggers its dependents
    monkeypatch.setattr(pdl, "PDL_ENABLED", True)
    assert pdl.pdl_flags(t, "route_dispatch") == (True, True)
    monkeypatch.setattr(pdl, "PDL_ENABLED", False)
    monkeypatch.setattr(pdl, "PDL_PROLOGUE", frozenset())
    monkeypatch.setattr(pdl, "PDL_LAUNCH", frozenset())
    assert pdl.pdl_flags(t, "combine") == (False, False)


def _is_jit(decorator) -> bool:
    node = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(node, ast.Attribute) and node.attr == "jit"


@pytest.mark.parametrize("module", DECODE_MODULES)
def test_every_kernel_waits_first_and_every_launch_passes_the_flag(module):
    """Source check: each ``*_kernel`` jit function has a ``PDL`` constexpr and the prologue as its first statement
    (after the docstring; or, for an ``EARLY_READS`` / ``AFTER_BAND`` kernel, under ``if not EARLY_READS and not
    AFTER_BAND:`` or ``if not EARLY_READS:`` with a later wait); each launch ``name_kernel[grid](...)`` (or the WS
    launcher) passes ``PDL=pdl, launch_pdl=pdl`` (or ``launch_pdl=launch_pdl``); each launching function takes them
    from ``pdl_enabled`` / ``pdl_flags`` (or ``pdl`` as its caller's argument)."""
    tree = ast.parse(inspect.getsource(importlib.import_module(module)))
    kernels, launches = [], 0
    for fn in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]:
        if fn.name.endswith("_kernel") and any(_is_jit(d) for d in fn.decorator_list):
            kernels.append(fn.name)
            names = [a.arg for a in fn.args.args]
            assert "PDL" in names, f"{module}.{fn.name}: no PDL constexpr"
            body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) \
                else fn.body
            first = body[0]
            if isinstance(first, ast.If) and ast.unparse(first.test) in ("not EARLY_READS and (not AFTER_BAND)",
                                                                          "not EARLY_READS") and not first.orelse:
                first = first.body[0]  # the documented exceptions (kernels/pdl.py): the wait comes later
                assert "EARLY_READS" in names and ast.unparse(fn).count("grid_dependency_prologue(PDL)") >= 2, \
                    f"{module}.{fn.name}: EARLY_READS without a later wait"
            assert isinstance(first, ast.Expr) and isinstance(first.value, ast.Call), f"{module}.{fn.name}"
            call = first.value
            assert getattr(call.func, "id", None) in ("grid_dependency_prologue", "gl_grid_dependency_prologue") \
                and [getattr(a, "id", None) for a in call.args] == ["PDL"], \
                f"{module}.{fn.name}: the first statement is not the PDL prologue"
            continue
        source = ast.unparse(fn)
        for call in [n for n in ast.walk(fn) if isinstance(n, ast.Call)]:
            target = call.func
            kernel_launch = isinstance(target, ast.Subscript) and getattr(target.value, "id", "").endswith("_kernel")
            if not (kernel_launch or getattr(target, "id", None) == "launcher"):
                continue
            launches += 1
            kw = {k.arg: ast.unparse(k.value) for k in call.keywords if k.arg}
            where = f"{module}.{fn.name}: {ast.unparse(target)}"
            passes_pdl = kw.get("PDL") == "pdl" or "['PDL'] = pdl" in source  # or through a constants dict (unparsed)
            passes_pdl = passes_pdl or "['PDL'], launch_pdl = pdl_flags(" in source
            assert kw.get("launch_pdl") in ("pdl", "launch_pdl") and passes_pdl, f"{where}: PDL / launch_pdl not passed"
            assert ("pdl_enabled(" in source or "pdl_flags(" in source
                    or "pdl" in [a.arg for a in fn.args.args + fn.args.kwonlyargs]), where
    assert kernels and launches, module


_CASES = {}


def _case(fn):
    _CASES[fn.__name__] = fn
    return fn


@_case
def topk():
    from megamoe.kernels.topk import launch_topk

    split = torch.randn(1, 700)
    split[0, ::7] = float("-inf")
    out = [launch_topk(split, torch.empty(1, 40, dtype=torch.int32), interpreter=True)]
    out.append(launch_topk(torch.randn(2, 100), torch.empty(2, 10, dtype=torch.int32), interpreter=True))
    return out


@_case
def indexer_then_topk():
    from megamoe.kernels.kvcache.indexer import launch_indexer_scores
    from megamoe.kernels.topk import launch_topk, tile_maxima_offset, workspace_entries

    B, H, D, epb, pages, T, k = 2, 16, 128, 16, 6, 64, 8
    q = (torch.randn(B, H, D) * 0.5).to(torch.bfloat16)
    keys = torch.randint(0, 256, (pages * epb, D // 2), dtype=torch.uint8)
    sb = torch.randint(118, 130, (pages * epb, D // 32), dtype=torch.uint8)
    table = torch.tensor([[2, 0, 4, -1], [1, 3, 5, 0]], dtype=torch.int32)
    scores = torch.empty(B, T)
    scratch = torch.zeros(B, workspace_entries(T, k, interpreter=True), dtype=torch.int32)
    launch_indexer_scores(q, torch.randn(B, H), torch.tensor([1, 0], dtype=torch.int32),
                          torch.tensor([60, 45], dtype=torch.int32), table, keys, sb, scores, entries_per_block=epb,
                          official=True, interpreter=True, tile_max=scratch[:, tile_maxima_offset():])
    out = launch_topk(scores, torch.empty(B, k, dtype=torch.int32), scratch, interpreter=True, path="split",
                      tile_maxima=True)
    return [scores, out, scratch]


@_case
def moe_route_dispatch_combine():
    from megamoe.kernels.moe_combine import launch_moe_combine
    from megamoe.kernels.moe_dispatch import launch_moe_dispatch
    from megamoe.kernels.moe_router import launch_moe_topk

    T, E, k, H = 3, 16, 4, 64
    w, ids = torch.empty(T, k), torch.empty(T, k, dtype=torch.int32)
    launch_moe_topk(torch.rand(T, E), torch.randn(E) * 0.1, k, True, 1.5, w, ids)
    P = T * k
    offsets, sorted_expert, row_index, inv_perm = [torch.empty(n, dtype=torch.int32) for n in (E, P, P, P)]
    launch_moe_dispatch(ids.flatten(), k, E, offsets, sorted_expert, row_index, inv_perm)
    expert_out = torch.randn(P, H).to(torch.bfloat16)
    out = launch_moe_combine(expert_out, inv_perm, w, torch.randn(T, H).to(torch.bfloat16),
                             torch.empty(T, H, dtype=torch.bfloat16), interpreter=True)
    return [w, ids, offsets, sorted_expert, row_index, inv_perm, out]


@_case
def hyper_connection():
    from megamoe.kernels import hyper_connection as hc

    T, HC, D = 2, 4, 64
    M = (2 + HC) * HC
    x = torch.randn(T, HC, D).to(torch.bfloat16)
    fn = torch.randn(M, HC * D) * 0.05
    scale, base, w = torch.rand(3) + 0.5, torch.randn(M), torch.rand(D) + 0.5
    kw = dict(iters=3, hc_eps=1e-6, norm_eps=1e-6, rms_eps=1e-6)
    out = list(hc.launch_hc_pre(x, fn, scale, base, w, **kw))
    y = torch.randn(T, D).to(torch.bfloat16)
    out += list(hc.launch_hc_post_pre(y, x, out[2], out[3], fn, scale, base, w, **kw))
    out.append(hc.launch_hc_post(y, x, out[2], out[3]))
    out += list(hc.launch_hc_split_sinkhorn(torch.randn(T, M), scale, base, HC, 3, 1e-6))
    return out


@_case
def v4_elementwise():
    from megamoe.kernels import v4_elementwise as ew

    T, H, D, rd = 2, 2, 128, 64
    freqs = torch.randn(16, rd // 2, 2)
    pos = torch.tensor([3, 9], dtype=torch.int32)
    out = [ew.launch_rms_norm(torch.randn(T, 256).to(torch.bfloat16), torch.rand(256) + 0.5, 1e-6)]
    out += list(ew.launch_q_kv(torch.randn(T, H * D).to(torch.bfloat16), torch.randn(T, D).to(torch.bfloat16),
                               torch.rand(D) + 0.5, freqs, pos, num_heads=H, head_dim=D, eps=1e-6))
    out.append(ew.launch_output(torch.randn(T, H, D).to(torch.bfloat16), freqs, pos, groups=1))
    out += list(ew.launch_index_q(torch.randn(T, 4 * 64).to(torch.bfloat16), torch.randn(T, 4).to(torch.bfloat16),
                                  freqs, pos, n_heads=4, weight_scale=0.25))
    out.append(ew.launch_post_pool(torch.randn(T, D), torch.rand(D) + 0.5, freqs, pos,
                                   torch.empty(T, D, dtype=torch.bfloat16), shift=0, eps=1e-6, rotate=True))
    return out


@_case
def sampling():
    from megamoe.kernels.sampling import launch_sample

    B, V = 2, 300
    step = torch.zeros(B, dtype=torch.int64)
    out = launch_sample(torch.randn(B, V), None, None, torch.tensor([0.0, 0.8]), torch.tensor([1, 2]), step,
                        torch.empty(B, dtype=torch.int64), interpreter=True)
    return [out, step]


@_case
def sparse_attention():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_sparse_attention import make_inputs

    from megamoe.kernels.sparse_attention import launch_sparse_mqa_attention

    i = make_inputs(N=2, H=16, D=128, W=8, K=8)
    out = torch.empty_like(i["q"])
    launch_sparse_mqa_attention(i["q"], i["attn_sink"], i["softmax_scale"], i["window_kv"], i["window_idx"],
                                i["entries_fp8"], i["entries_scale"], i["entries_rope"], i["block_table"], i["slots"],
                                i["entry_idx"], out, num_splits=2, interpreter=True)
    return [out]


@pytest.mark.parametrize("case", sorted(_CASES))
def test_interpreter_forced_on_launches_with_pdl_and_same_bits(monkeypatch, case):
    """Every launch of the case gets PDL / launch_pdl equal to ``pdl_enabled``'s answer (forced both ways); the
    forced-on run (the prologue is a no-op in the interpreter) gives the same bits as the off run."""
    from triton.runtime.interpreter import InterpretedFunction

    from guard_helpers import require_interpreter

    require_interpreter()  # the cases run CPU tensors through the interpreter's kernels

    launches = []
    original = InterpretedFunction.run

    def recording_run(self, *args, **kwargs):
        launches.append((self.fn.__name__, kwargs.get("PDL"), kwargs.get("launch_pdl")))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording_run)
    results = {}
    for setting in (False, True):
        for module in DECODE_MODULES:
            mod = importlib.import_module(module)
            if hasattr(mod, "pdl_enabled"):
                monkeypatch.setattr(mod, "pdl_enabled", lambda t, s=setting: s)
            if hasattr(mod, "pdl_flags"):
                monkeypatch.setattr(mod, "pdl_flags", lambda t, kernel, single_pass=True, s=setting: (s, s))
        launches.clear()
        torch.manual_seed(1234)
        results[setting] = _CASES[case]()
        assert launches, case
        assert all(p is setting and lp is setting for _, p, lp in launches), launches
    for off, on in zip(results[False], results[True]):
        assert torch.equal(off, on)


#: Kernels built offline with / without PDL (tests/kernels/pdl_sm90_compile.py names).
SM90_BUILDS = ["moe_dispatch", "moe_router", "moe_combine", "topk_split_max", "topk_split_rank", "topk_sort",
               "indexer_scores", "attention_combine", "attention_v1", "attention_ws", "hc_partial", "hc_finish",
               "hc_post", "v4_rms_norm", "v4_q_kv", "v4_index_q", "v4_output", "v4_post_pool", "sample_partial",
               "sample_merge", "mma_decode", "splitk_fma", "splitk_mma", "splitk_wgmma"]


@pytest.mark.slow
def test_sm90_builds_wait_first_only_when_on():
    """Offline sm_90 builds (a fresh process without the interpreter): with PDL one ``griddepcontrol.wait`` before
    the first global load / store / atomic and one ``launch_dependents``; without, none of either."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "kernels", "pdl_sm90_compile.py"),
                          *SM90_BUILDS], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    for name in SM90_BUILDS:
        off, on = report[name]["off"], report[name]["on"]
        assert off["wait"] == 0 and off["launch"] == 0 and not off["metadata_pdl"], (name, off)
        assert on["wait"] == 1 and on["launch"] == 1 and on["wait_first"], (name, on)
        if name != "mma_decode":  # built through the GEMM family's helper, which does not set the launch option
            assert on["metadata_pdl"], (name, on)


@pytest.mark.slow
def test_sm90_early_reads_wait_before_writes():
    """The mma.sync decode GEMM built with EARLY_READS (the down GEMM of a MoE layer): with PDL it loads before its
    ``griddepcontrol.wait`` (the tile table's offsets, the first weights) but no path of its control-flow graph
    stores or does an atomic before one (a program without chunks waits before its error-word atomic); without PDL
    there is no wait at all."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "kernels", "pdl_sm90_compile.py"),
                          "mma_decode_early"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])["mma_decode_early"]
    off, on = report["off"], report["on"]
    assert off["wait"] == 0 and off["launch"] == 0, off
    assert on["wait"] >= 1 and on["launch"] == on["wait"], on
    assert not on["wait_first"] and on["wait_before_writes"], on


@pytest.mark.slow
def test_sm90_after_band_triggers_first_and_waits():
    """A later band of a banded GEMM (the mma.sync decode kernel and the pipelined kernel built with AFTER_BAND):
    ``launch_dependents`` before any global access, and one ``griddepcontrol.wait`` (at the exit); the plain builds
    have neither."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    names = ["mma_decode_after_band", "pipe_after_band"]
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "kernels", "pdl_sm90_compile.py"), *names],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    for name in names:
        off, on = report[name]["off"], report[name]["on"]
        assert off["wait"] == 0 and off["launch"] == 0, (name, off)
        assert on["wait"] == 1 and on["launch"] == 1 and on["launch_first"] and not on["wait_first"], (name, on)


def test_early_reads_setting(monkeypatch):
    """pdl_early_reads follows PDL_EARLY_READS (kernel names)."""
    monkeypatch.setattr(pdl, "PDL_EARLY_READS", frozenset({"mma_decode"}))
    assert pdl.pdl_early_reads("mma_decode") and not pdl.pdl_early_reads("combine")
    monkeypatch.setattr(pdl, "PDL_EARLY_READS", frozenset())
    assert not pdl.pdl_early_reads("mma_decode")


# ------------------------------------------------------------------------------------------------ CUDA
def _cuda_sm90():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90+")


DEFAULT_PROLOGUE, DEFAULT_LAUNCH, DEFAULT_EARLY_READS = pdl.PDL_PROLOGUE, pdl.PDL_LAUNCH, pdl.PDL_EARLY_READS


def _pdl_setting(monkeypatch, setting):
    """True: PDL for every kernel (the switch); False: for none (the per-kernel sets emptied too); "default": the
    per-kernel defaults of megamoe.kernels.pdl (switch off; the down GEMM's early reads included); "no-early": those
    without the early reads (PDL_EARLY_READS empty); "all-early": the switch on, and the early reads of the defaults
    plus the dense split-K GEMMs' first weights ("splitk": ``DenseLinear``'s settled weights); "attention": the
    defaults plus the sparse attention's main kernel and split combine launched with PDL."""
    if setting == "attention":
        monkeypatch.setattr(pdl, "PDL_ENABLED", False)
        monkeypatch.setattr(pdl, "PDL_EARLY_READS", DEFAULT_EARLY_READS)
        monkeypatch.setattr(pdl, "PDL_PROLOGUE", DEFAULT_PROLOGUE)
        monkeypatch.setattr(pdl, "PDL_LAUNCH", DEFAULT_LAUNCH | {"attention", "attention_combine"})
        return
    if setting == "all-early":
        monkeypatch.setattr(pdl, "PDL_EARLY_READS", DEFAULT_EARLY_READS | {"splitk"})
        setting = True
    else:
        monkeypatch.setattr(pdl, "PDL_EARLY_READS", DEFAULT_EARLY_READS if setting == "default" else frozenset())
    if setting in ("default", "no-early"):
        monkeypatch.setattr(pdl, "PDL_ENABLED", False)
        monkeypatch.setattr(pdl, "PDL_PROLOGUE", DEFAULT_PROLOGUE)
        monkeypatch.setattr(pdl, "PDL_LAUNCH", DEFAULT_LAUNCH)
        return
    monkeypatch.setattr(pdl, "PDL_ENABLED", setting)
    monkeypatch.setattr(pdl, "PDL_PROLOGUE", frozenset())
    monkeypatch.setattr(pdl, "PDL_LAUNCH", frozenset())


def _on_off_graph(monkeypatch, fn, *, capture=True, on=True):
    """fn() -> list of tensors (launches only; no host syncs). Returns (off, eager_on, graph_on) clones; ``on``: the
    :func:`_pdl_setting` of the last two."""
    from megamoe.ops import errors

    _pdl_setting(monkeypatch, False)
    off = [t.clone() for t in fn()]
    _pdl_setting(monkeypatch, on)
    fn()  # compile outside the sync check
    torch.cuda.synchronize()
    with no_host_syncs():
        eager = [t.clone() for t in fn()]
    graphed = None
    if capture:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                outs = fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        graphed = [t.clone() for t in outs]
    torch.cuda.synchronize()
    errors.check_errors("cuda")
    return off, eager, graphed


@pytest.mark.cuda
@pytest.mark.parametrize("setting,tokens", [(True, 1), (True, 8), (True, 64), ("default", 1), ("default", 2),
                                            ("default", 8), ("no-early", 1)])
def test_cuda_moe_layer_pdl_equals_plain_graph_and_sync_free(monkeypatch, setting, tokens):
    """With PDL on (every kernel, or the per-kernel defaults: single-pass decode GEMMs and the combine launched early,
    the down GEMM reading its routing and first weights before its wait; "no-early": without that), the V4-Flash MoE
    layer (route + dispatch, decode GEMMs, combine): eager without host syncs, graph replay == eager, and the same bits
    as with PDL off everywhere."""
    from megamoe.layers.moe import Nvfp4MoE
    from megamoe.models.config import PRESETS
    from megamoe.ops import errors

    _cuda_sm90()
    config = PRESETS["v4-flash"]
    layer = Nvfp4MoE.random(config, seed=0, max_num_tokens=tokens, device="cuda")
    x = torch.randn(tokens, config.hidden_size, device="cuda").to(torch.bfloat16)
    _pdl_setting(monkeypatch, False)
    plain = layer.forward(x).clone()
    _pdl_setting(monkeypatch, setting)
    layer.forward(x)  # compile outside the sync check
    torch.cuda.synchronize()
    with no_host_syncs():
        eager = layer.forward(x).clone()
    run = layer.capture(tokens)
    replayed = run(x).clone()
    torch.cuda.synchronize()
    errors.check_errors("cuda")
    assert torch.equal(eager, plain)
    assert torch.equal(replayed, plain)


@pytest.mark.cuda
@pytest.mark.parametrize("B,T,k", [(1, 131072, 1024), (1, 131072, 512), (8, 32768, 1024)])
def test_cuda_topk_pdl_equals_plain_graph_and_sync_free(monkeypatch, B, T, k):
    """The split top-k (three or four launches in a row) with PDL: same indices as without, graph == eager."""
    from megamoe.kernels.topk import launch_topk, workspace_entries

    _cuda_sm90()
    scores = torch.randn(B, T, device="cuda")
    out = torch.empty(B, k, dtype=torch.int32, device="cuda")
    scratch = torch.zeros(B, workspace_entries(T, k), dtype=torch.int32, device="cuda")
    off, eager, graphed = _on_off_graph(monkeypatch, lambda: [launch_topk(scores, out, scratch)])
    assert torch.equal(off[0], eager[0]) and torch.equal(off[0], graphed[0])
    ref = torch.topk(scores, k, dim=1).values
    assert torch.equal(torch.gather(scores, 1, off[0].long()), ref)


@pytest.mark.cuda
@pytest.mark.parametrize("N,impl,setting", [(n, impl, s) for n in (1, 32) for impl in ("v1", "ws", "ws3")
                                            for s in (True, "attention")] + [(256, "ws3", "attention")])
def test_cuda_sparse_attention_pdl_equals_plain_graph_and_sync_free(monkeypatch, N, impl, setting):
    """V4-Flash sparse attention (main kernel + split combine) with PDL, by the switch or by the per-kernel names
    ("attention"; at 256 queries there is no split and the main grid is two waves, so it launches plainly): same bits
    as without, graph == eager."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_sparse_attention import _v4_inputs

    from megamoe.kernels.sparse_attention import launch_sparse_mqa_attention

    _cuda_sm90()
    i = _v4_inputs(N, 64, 512)
    out = torch.empty_like(i["q"])

    def fn():
        launch_sparse_mqa_attention(i["q"], i["attn_sink"], i["softmax_scale"], i["window_kv"], i["window_idx"],
                                    i["entries_fp8"], i["entries_scale"], i["entries_rope"], i["block_table"],
                                    i["slots"], i["entry_idx"], out, impl=impl)
        return [out]

    off, eager, graphed = _on_off_graph(monkeypatch, fn, on=setting)
    assert torch.equal(off[0], eager[0]) and torch.equal(off[0], graphed[0])


@pytest.mark.cuda
def test_cuda_tiny_model_decode_step_pdl_equals_plain(monkeypatch):
    """A whole tiny-model decode (every decode-path kernel family) with PDL on: the same logits as with it off,
    eager sync-free, and the captured decode graph gives the same tokens."""
    from megamoe.kvcache import DecodeBatch
    from megamoe.models.config import V4_TINY_MODEL
    from megamoe.models.model import V4Model
    from megamoe.models.v4_weights import random_state_dict
    from megamoe.ops.sampling import SamplingParams, sample

    _cuda_sm90()
    cfg = V4_TINY_MODEL
    dev = torch.device("cuda")
    sd = random_state_dict(cfg, seed=7, device=dev)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4]]

    def run(setting, graphed):
        _pdl_setting(monkeypatch, setting)
        m = V4Model(cfg, max_batch=2, max_prefill_tokens=16, max_context=64, device=dev)
        m.load_weights(sd)
        first = [int(torch.argmax(m.prefill(s, torch.tensor(p, device=dev)))) for s, p in enumerate(prompts)]
        logits, seen = [], []
        if graphed:
            step = m.capture_decode(2)
            step.tokens.copy_(torch.tensor(first))
            for _ in range(12):
                seen.append(step([0, 1]).clone())
            return logits, seen
        params = SamplingParams.allocate(2, dev)
        params.set(range(2), temperature=0.0)  # greedy, as capture_decode's default
        batch = DecodeBatch.allocate(2, dev)
        tokens = torch.tensor(first, device=dev)
        for i in range(12):
            m.prepare_decode(batch, [0, 1])
            if i > 0:  # the first step compiles
                torch.cuda.set_sync_debug_mode("error")
            try:
                out = m.decode(batch, tokens)
                logits.append(out.clone())
                tokens = sample(out, params)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            seen.append(tokens.clone())
        return logits, seen

    plain_logits, plain_tokens = run(False, False)
    on_logits, on_tokens = run(True, False)
    _, graph_tokens = run(True, True)
    default_logits, _ = run("default", False)
    _, default_graph_tokens = run("default", True)
    early_logits, _ = run("all-early", False)
    _, early_graph_tokens = run("all-early", True)
    for a, b, c, d in zip(plain_logits, on_logits, default_logits, early_logits):
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)
    for a, b, c, d, e in zip(plain_tokens, on_tokens, graph_tokens, default_graph_tokens, early_graph_tokens):
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d) and torch.equal(a, e)
