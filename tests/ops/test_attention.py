"""sparse_mqa_attention op: validation messages, dispatch, and the reference against a float64 per-query loop."""
import math

import pytest
import torch

from megamoe.ops import attention as ops
from megamoe.reference import attention as ref
from guard_helpers import set_interpret  # tests/guard_helpers.py (tests/ is on sys.path)


def _inputs(N=3, H=4, D=32, rope=16, scale_block=16, epb=4, P=6, S=2, L=2, R=10, W=5, K=6):
    nope = D - rope
    table = torch.randperm(P)[: S * L].to(torch.int32).view(S, L).contiguous()
    widx = torch.randint(-1, R, (N, W), dtype=torch.int32)
    eidx = torch.randint(-1, L * epb, (N, K), dtype=torch.int32)
    return dict(
        q=(2 * torch.randn(N, H, D)).to(torch.bfloat16), attn_sink=torch.randn(H), softmax_scale=D ** -0.5,
        window_kv=torch.randn(R, D).to(torch.bfloat16), window_idx=widx,
        entries_fp8=torch.clamp(100 * torch.randn(P, epb, nope), -448, 448).to(torch.float8_e4m3fn),
        entries_scale=torch.exp2(torch.randint(-8, -5, (P, epb, nope // scale_block)).float()),
        entries_rope=torch.randn(P, epb, rope).to(torch.bfloat16), block_table=table,
        slots=torch.randint(0, S, (N,), dtype=torch.int32), entry_idx=eidx)


def _call(fn, inputs, **kw):
    args = dict(inputs)
    q, sink, scale = args.pop("q"), args.pop("attn_sink"), args.pop("softmax_scale")
    return fn(q, sink, scale, **args, **kw)


def _loop_float64(inputs):
    """Independent float64 evaluation, one query and one head at a time (the NUMERICS.md formula)."""
    q, sink = inputs["q"].double(), inputs["attn_sink"].double()
    N, H, D = q.shape
    fp8, sc, rope = inputs["entries_fp8"], inputs["entries_scale"], inputs["entries_rope"]
    P, epb, nope = fp8.shape
    sb = nope // sc.shape[-1]
    S, L = inputs["block_table"].shape
    R = inputs["window_kv"].shape[0]
    out = torch.zeros(N, H, D, dtype=torch.float64)
    for n in range(N):
        rows = [inputs["window_kv"][int(w)].double() for w in inputs["window_idx"][n] if 0 <= int(w) < R]
        slot = int(inputs["slots"][n])
        for e in inputs["entry_idx"][n].tolist():
            if e < 0 or not 0 <= slot < S or e // epb >= L:
                continue
            page = int(inputs["block_table"][slot, e // epb])
            if not 0 <= page < P:
                continue
            r = e % epb
            value = torch.stack([(fp8[page, r, d].float() * sc[page, r, d // sb]).to(torch.bfloat16)
                                 for d in range(nope)]).double()
            rows.append(torch.cat([value, rope[page, r].double()]))
        if not rows:
            continue
        kv = torch.stack(rows)
        for h in range(H):
            logits = inputs["softmax_scale"] * (kv @ q[n, h])
            m = logits.max()
            p = torch.exp(logits - m)
            out[n, h] = (p @ kv) / (p.sum() + math.exp(float(sink[h]) - float(m)))
    return out


def test_reference_matches_float64_loop():
    inputs = _inputs()
    inputs["window_idx"][0] = -1
    inputs["entry_idx"][0] = -1  # query 0: no rows -> zeros
    got = _call(ref.sparse_mqa_attention, inputs).double()
    want = _loop_float64(inputs)
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    assert torch.allclose(got, want, rtol=2 ** -8, atol=1e-6)


def test_op_without_interpreter_is_the_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    inputs = _inputs()
    got = _call(ops.sparse_mqa_attention, inputs)
    assert torch.equal(got, _call(ref.sparse_mqa_attention, inputs))
    out = torch.empty_like(inputs["q"])
    assert _call(ops.sparse_mqa_attention, inputs, out=out) is out
    assert torch.equal(out, got)


def test_op_under_interpreter_runs_the_kernel():
    inputs = _inputs(H=16, D=32, rope=16)
    got = _call(ops.sparse_mqa_attention, inputs)
    want = _call(ref.sparse_mqa_attention, inputs)
    assert got.dtype == torch.bfloat16
    assert ((got.float() - want.float()).abs().max() <= 1e-2 * want.float().abs().max())


def _bad(name, value):
    inputs = _inputs()
    inputs[name] = value
    return inputs


@pytest.mark.parametrize("name,make,exc,match", [
    ("q", lambda i: i["q"].float(), TypeError, "q: expected dtype"),
    ("q", lambda i: i["q"][0], ValueError, "q: expected 3 dimensions"),
    ("q", lambda i: i["q"].transpose(0, 1), ValueError, "q: expected a contiguous"),
    ("attn_sink", lambda i: i["attn_sink"][:2], ValueError, "attn_sink: expected shape"),
    ("attn_sink", lambda i: i["attn_sink"].double(), TypeError, "attn_sink: expected dtype"),
    ("softmax_scale", lambda i: float("nan"), TypeError, "softmax_scale"),
    ("softmax_scale", lambda i: torch.tensor(0.1), TypeError, "softmax_scale"),
    ("window_kv", lambda i: i["window_kv"][:, :16].contiguous(), ValueError, "window_kv: expected 32 columns"),
    ("window_idx", lambda i: i["window_idx"].long(), TypeError, "window_idx: expected dtype"),
    ("window_idx", lambda i: i["window_idx"][:2].contiguous(), ValueError, "window_idx: expected 3 rows"),
    ("entries_fp8", lambda i: i["entries_fp8"].view(torch.uint8), TypeError, "entries_fp8: expected dtype"),
    ("entries_rope", lambda i: i["entries_rope"][..., :8].contiguous(), ValueError, "must equal D"),
    ("entries_scale", lambda i: i["entries_scale"][..., :1].expand(-1, -1, 3).contiguous(), ValueError,
     "entries_scale: expected shape"),
    ("entries_scale", lambda i: i["entries_scale"][:2].contiguous(), ValueError, "entries_scale: expected shape"),
    ("block_table", lambda i: i["block_table"].long(), TypeError, "block_table: expected dtype"),
    ("slots", lambda i: i["slots"][:2].contiguous(), ValueError, "slots: expected shape"),
    ("entry_idx", lambda i: i["entry_idx"][:1].contiguous(), ValueError, "entry_idx: expected 3 rows"),
])
def test_validation_messages(name, make, exc, match):
    inputs = _inputs()
    inputs[name] = make(inputs)
    with pytest.raises(exc, match=match):
        _call(ops.sparse_mqa_attention, inputs)


def test_rope_multiple_of_16_and_out_checked():
    inputs = _inputs(D=40, rope=8, scale_block=16)
    with pytest.raises(ValueError, match="multiple of 16"):
        _call(ops.sparse_mqa_attention, inputs)
    inputs = _inputs()
    with pytest.raises(ValueError, match="out: expected shape"):
        _call(ops.sparse_mqa_attention, inputs, out=torch.empty(1, 4, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="num_splits"):
        _call(ops.sparse_mqa_attention, inputs, num_splits=0)


def test_workspace_helper_shapes():
    assert ops.attention_workspace(128, 64, 512, 128, 512, "cpu", num_splits=1) is None
    acc, ml = ops.attention_workspace(1, 64, 512, 128, 1024, "cpu", num_splits=4)
    assert acc.shape == (1, 4, 64, 512) and ml.shape == (1, 4, 2, 64)
    assert acc.dtype == ml.dtype == torch.float32


@pytest.mark.parametrize("workspace", [[1.0, 2.0], (torch.zeros(4), None), (torch.zeros(4), "x")])
def test_workspace_must_hold_tensors(workspace):
    with pytest.raises(TypeError, match=r"^workspace(\[\d\])?: expected"):
        _call(ops.sparse_mqa_attention, _inputs(), workspace=workspace)


@pytest.mark.parametrize("interpret", ["1", "0"])
def test_empty_batch_returns_empty_on_both_paths(interpret, monkeypatch):
    """N = 0 queries (T = 0 prefill chunk): an empty (0, H, D) result on both paths (the torch path used to raise
    'cannot reshape tensor of 0 elements')."""
    set_interpret(monkeypatch, interpret)
    inputs = _inputs(N=0)
    got = _call(ops.sparse_mqa_attention, inputs)
    assert got.shape == (0, 4, 32) and got.dtype == torch.bfloat16
    out = torch.empty(0, 4, 32, dtype=torch.bfloat16)
    assert _call(ops.sparse_mqa_attention, inputs, out=out) is out


@pytest.mark.parametrize("kw,exc,match", [
    (dict(num_tokens=-1), ValueError, "num_tokens"), (dict(num_tokens=2.5), TypeError, "num_tokens"),
    (dict(num_tokens=None), TypeError, "num_tokens"), (dict(num_tokens=True), TypeError, "num_tokens"),
    (dict(num_heads=0), ValueError, "num_heads"), (dict(num_heads=-4), ValueError, "num_heads"),
    (dict(head_dim=0), ValueError, "head_dim"), (dict(window=-8), ValueError, "window"),
    (dict(topk=-1), ValueError, "topk"), (dict(topk="8"), TypeError, "topk"),
    (dict(num_splits=0), ValueError, "num_splits"), (dict(num_splits=-2), ValueError, "num_splits"),
    (dict(num_splits=True), TypeError, "num_splits"), (dict(num_splits=2.0), TypeError, "num_splits"),
    (dict(device="nonsense"), ValueError, "device"), (dict(device=None), TypeError, "device"),
])
def test_workspace_helper_validates_arguments(kw, exc, match):
    args = dict(num_tokens=1, num_heads=64, head_dim=512, window=128, topk=1024, device="cpu", num_splits=4)
    args.update(kw)
    with pytest.raises(exc, match=f"^{match}: "):
        ops.attention_workspace(**args)


def test_workspace_helper_edge_shapes():
    assert ops.attention_workspace(0, 64, 512, 128, 1024, "cpu", num_splits=4) is None      # no tokens: no split
    assert ops.attention_workspace(1, 64, 512, 0, 0, "cpu") is None                         # nothing to attend


@pytest.mark.parametrize("num_splits", [None, 2])
def test_nan_and_empty_rows_same_policy_on_both_backends(num_splits, monkeypatch):
    """The torch path (the reference) and the Triton path (the interpreter's kernel, unsplit and through the split
    combine) agree: a NaN q row gives a NaN output row, a query without valid rows gives zeros (its q NaN, a -inf
    sink), the rest matches."""
    inputs = _inputs(H=16)
    inputs["window_idx"][0] = -1
    inputs["entry_idx"][0] = -1          # query 0: no valid row ...
    inputs["q"][0] = float("nan")        # ... and a NaN q
    inputs["window_idx"][1, 0] = 0       # query 1 has a valid row
    inputs["q"][1, 2] = float("nan")     # head 2 of query 1: NaN
    inputs["attn_sink"][5] = float("-inf")
    outs = {}
    for interpret in ("0", "1"):
        set_interpret(monkeypatch, interpret)
        outs[interpret] = _call(ops.sparse_mqa_attention, inputs, num_splits=num_splits).float()
    want_nan = torch.zeros(outs["0"].shape, dtype=torch.bool)
    want_nan[1, 2] = True
    for interpret, got in outs.items():
        assert torch.equal(torch.isnan(got), want_nan), f"TRITON_INTERPRET={interpret}"
        assert torch.equal(got[0], torch.zeros_like(got[0])), f"TRITON_INTERPRET={interpret}"
    torch_out, triton_out = outs["0"][~want_nan], outs["1"][~want_nan]
    assert (triton_out - torch_out).abs().max() <= 1e-2 * torch_out.abs().max()
