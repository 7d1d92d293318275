"""Public quantize / dequantize / compute_global_scale ops: validation, dispatch, out= buffers, empty inputs,
the CLI check, and (marked ``cuda``) large shapes, sync-freedom and CUDA-graph capture on a GPU."""
import sys

import pytest
import torch

import megamoe
import megamoe.ops.quantize  # noqa: F401
import megamoe.reference.quantize  # noqa: F401
from megamoe.format.layouts import swizzled_128x4_shape, to_swizzled_128x4
from sync_helpers import no_host_syncs

ops = sys.modules["megamoe.ops.quantize"]
ref = sys.modules["megamoe.reference.quantize"]


def assert_same(got, want):
    assert got.shape == want.shape
    assert torch.equal(got.data.cpu(), want.data.cpu())
    assert torch.equal(got.block_scale.view(torch.uint8).cpu(), want.block_scale.view(torch.uint8).cpu())
    assert tuple(got.global_scale.shape) == tuple(want.global_scale.shape)
    assert torch.equal(got.global_scale.cpu().reshape(-1).view(torch.int32),
                       want.global_scale.cpu().reshape(-1).view(torch.int32))


def test_exports():
    assert megamoe.quantize is ops.quantize
    assert megamoe.dequantize is ops.dequantize
    assert megamoe.compute_global_scale is ops.compute_global_scale
    from megamoe.ops import compute_global_scale, dequantize, quantize  # noqa: F401


def test_bad_inputs(device):
    x = torch.randn(4, 32, device=device)
    with pytest.raises(TypeError, match="x"):
        ops.quantize(x.numpy() if device.type == "cpu" else [1.0])
    with pytest.raises(TypeError, match="x: expected float32"):
        ops.quantize(x.to(torch.int32))
    with pytest.raises(ValueError, match="multiple of 16"):
        ops.quantize(torch.randn(4, 24, device=device))
    with pytest.raises(ValueError, match="0-d"):
        ops.quantize(torch.tensor(1.0, device=device))
    with pytest.raises(TypeError, match="global_scale: expected float32"):
        ops.quantize(x, torch.tensor(1.0, dtype=torch.float64, device=device))
    with pytest.raises(TypeError, match="global_scale"):
        ops.quantize(x, 0.5)
    with pytest.raises(ValueError, match="global_scale: expected a 0-d tensor or a shape broadcastable"):
        ops.quantize(x, torch.ones(4, device=device))
    with pytest.raises(ValueError, match="global_scale"):
        ops.quantize(x, torch.ones(3, 1, device=device))
    with pytest.raises(ValueError, match="swizzled_scale_out: expected shape"):
        ops.quantize(x, swizzled_scale_out=torch.zeros(4, 2, dtype=torch.uint8, device=device))
    with pytest.raises(TypeError, match="swizzled_scale_out"):
        ops.quantize(x, swizzled_scale_out=torch.zeros(128, 4, device=device))
    with pytest.raises(TypeError, match="out: expected an NVFP4Tensor"):
        ops.quantize(x, out=torch.empty(4, 16, device=device))
    for flag in ("no", 0, None):  # a string would be truthy: per-row scales silently
        with pytest.raises(TypeError, match="per_row"):
            ops.quantize(x, per_row=flag)
    with pytest.raises(TypeError, match="t: expected an NVFP4Tensor"):
        ops.dequantize(x)
    q = ops.quantize(x)
    with pytest.raises(TypeError, match="dtype"):
        ops.dequantize(q, torch.int8)
    with pytest.raises(ValueError, match="out: expected a contiguous tensor of shape"):
        ops.dequantize(q, out=torch.empty(4, 16, dtype=torch.bfloat16, device=device))
    with pytest.raises(TypeError, match="out: expected dtype"):
        ops.dequantize(q, out=torch.empty(4, 32, dtype=torch.float32, device=device))
    with pytest.raises(ValueError, match="multiple of 16"):
        ops.compute_global_scale(torch.randn(2, 8, device=device))


def test_reference_dispatch_without_interpreter(monkeypatch):
    """CPU tensors without TRITON_INTERPRET=1 take the reference (no Triton launch)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    calls = []
    monkeypatch.setattr(ops, "_kernels", lambda: calls.append(1))
    x = torch.randn(3, 5, 64)
    rows_p, cols_p = swizzled_128x4_shape(15, 4)
    buf = torch.full((rows_p, cols_p), 7, dtype=torch.uint8)
    got = ops.quantize(x, per_row=True, swizzled_scale_out=buf)
    assert_same(got, ref.quantize(x, per_row=True))
    assert torch.equal(buf, to_swizzled_128x4(got.block_scale.reshape(15, 4).view(torch.uint8)))
    assert torch.equal(ops.dequantize(got), ref.dequantize(got))
    assert torch.equal(ops.compute_global_scale(x), ref.compute_global_scale(x))
    assert not calls


@pytest.mark.parametrize("kwargs", [{}, {"per_row": True}, {"global_scale": "scalar"}])
def test_empty_inputs(device, kwargs):
    kwargs = dict(kwargs)
    if kwargs.get("global_scale") == "scalar":
        kwargs["global_scale"] = torch.tensor(0.5, device=device)
    for shape in ((0, 64), (2, 0, 32), (3, 0)):
        x = torch.randn(shape, device=device).to(torch.bfloat16)
        got = ops.quantize(x, **kwargs)
        cpu_kwargs = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
        assert_same(got, ref.quantize(x.cpu(), **cpu_kwargs))
        back = ops.dequantize(got)
        assert back.shape == x.shape and back.dtype == torch.bfloat16
    assert ops.compute_global_scale(torch.empty(0, 16, device=device), per_row=True).shape == (0, 1)
    gs = ops.compute_global_scale(torch.empty(0, 16, device=device))
    assert torch.equal(gs.cpu(), ref.compute_global_scale(torch.empty(0, 16)))


@pytest.mark.parametrize("per_row", [False, True])
def test_out_buffers_are_used(device, per_row):
    x = torch.randn(2, 6, 96, device=device)
    want = ops.quantize(x, per_row=per_row)
    out = megamoe.NVFP4Tensor(
        torch.empty(2, 6, 48, dtype=torch.uint8, device=device),
        torch.empty(2, 6, 6, dtype=torch.float8_e4m3fn, device=device),
        torch.empty((2, 6, 1) if per_row else (), device=device),
        x.shape,
    )
    got = ops.quantize(x, per_row=per_row, out=out)
    assert got.data.data_ptr() == out.data.data_ptr()
    assert got.block_scale.data_ptr() == out.block_scale.data_ptr()
    assert got.global_scale.data_ptr() == out.global_scale.data_ptr()
    assert_same(got, want)
    buf = torch.empty(2, 6, 96, dtype=torch.float16, device=device)
    assert ops.dequantize(got, torch.float16, out=buf) is buf
    assert torch.equal(buf.cpu(), ref.dequantize(want.to("cpu"), torch.float16))
    bad = megamoe.NVFP4Tensor(out.data, out.block_scale, torch.empty((), device=device), x.shape)
    if per_row:
        with pytest.raises(ValueError, match="out: expected a contiguous global_scale"):
            ops.quantize(x, per_row=True, out=bad)


def test_given_global_scale_is_returned(device):
    x = torch.randn(3, 32, device=device)
    gs = torch.full((3, 1), 0.01, device=device)
    got = ops.quantize(x, gs)
    assert got.global_scale is gs or torch.equal(got.global_scale, gs)
    assert ops.quantize(x, torch.full((1, 1), 0.01, device=device)).global_scale.dim() == 0


def test_cli_quantize_check(capsys):
    from megamoe.commands import quantize_check

    import argparse

    parser = argparse.ArgumentParser()
    quantize_check.register(parser.add_subparsers())
    # auto: CUDA on a GPU machine; on CPU the interpreter (conftest already set TRITON_INTERPRET=1)
    args = parser.parse_args(["quantize-check", "--rows", "9", "--cols", "96", "--per-row", "--device", "auto"])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "OK: bit-exact" in text and "relative RMS error" in text
    args = parser.parse_args(["quantize-check", "--cols", "40"])
    assert args.func(args) == 2


# ----------------------------------------------------------------------------- GPU only


def _cuda_inputs():
    torch.manual_seed(1234)
    x = torch.randn(1000, 7168, device="cuda", dtype=torch.bfloat16) * 3
    x[5, 100] = float("nan")
    x[7, :16] = 0
    x[9] *= 1e-6
    return x


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["given", "given_per_row", "per_row", "per_tensor"])
def test_cuda_large_bit_exact(mode):
    x = _cuda_inputs()
    kwargs = {"given": {"global_scale": torch.tensor(0.003, device="cuda")},
              "given_per_row": {"global_scale": torch.rand(1000, 1, device="cuda") * 0.01 + 1e-4},
              "per_row": {"per_row": True}, "per_tensor": {}}[mode]
    rows_p, cols_p = swizzled_128x4_shape(1000, 448)
    buf = torch.full((rows_p, cols_p), 0xAB, dtype=torch.uint8, device="cuda")
    got = ops.quantize(x, swizzled_scale_out=buf, **kwargs)
    cpu_kwargs = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    want = ref.quantize(x.cpu(), **cpu_kwargs)
    assert_same(got, want)
    assert torch.equal(buf.cpu(), to_swizzled_128x4(want.block_scale.view(torch.uint8)))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        back, expect = ops.dequantize(got, dtype).cpu(), ref.dequantize(want, dtype)
        nan = torch.isnan(expect)
        assert torch.equal(torch.isnan(back), nan)
        assert torch.equal(back[~nan], expect[~nan])
    for dtype in (torch.float32, torch.float16):
        xd = x[:64].to(dtype)
        assert_same(ops.quantize(xd, **{k: (v[:64] if k == "global_scale" and v.dim() else v)
                                          for k, v in kwargs.items()}),
                    ref.quantize(xd.cpu(), **{k: (v[:64] if k == "global_scale" and v.dim() else v)
                                             for k, v in cpu_kwargs.items()}))


@pytest.mark.cuda
def test_cuda_sync_free_and_graph_capture():
    x = _cuda_inputs()
    gs_given = torch.tensor(0.003, device="cuda")
    rows_p, cols_p = swizzled_128x4_shape(1000, 448)
    swz = torch.empty((rows_p, cols_p), dtype=torch.uint8, device="cuda")

    def step():
        a = ops.quantize(x, per_row=True, swizzled_scale_out=swz)
        b = ops.quantize(x)
        c = ops.quantize(x, gs_given)
        d = ops.dequantize(b)
        e = ops.compute_global_scale(x)
        f = ops.compute_global_scale(x, per_row=True)
        return a, b, c, d, e, f

    step()  # warm-up: compiles the kernels outside the checked region
    torch.cuda.synchronize()
    with no_host_syncs():
        eager = step()
    eager_swz = swz.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    swz.zero_()
    x_orig = x.clone()
    x.copy_(torch.randn_like(x))  # the replay must read the new values
    graph.replay()
    torch.cuda.synchronize()
    fresh = ops.quantize(x, per_row=True)
    assert torch.equal(captured[0].data, fresh.data)
    x.copy_(x_orig)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured[:3], eager[:3]):
        assert_same(got, want)
    assert torch.equal(captured[3].view(torch.int16), eager[3].view(torch.int16))
    assert torch.equal(captured[4], eager[4]) and torch.equal(captured[5], eager[5])
    assert torch.equal(swz, eager_swz)
