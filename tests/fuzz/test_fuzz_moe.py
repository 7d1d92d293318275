"""Hypothesis fuzzing of the MoE ops against their references on CPU: shapes, skewed / empty experts, index
values in and out of range, NaN placement. Kernels run under the Triton interpreter (tests/conftest.py), the
torch paths with TRITON_INTERPRET=0; both must agree with each other and set the same error-word bits.

Budget: derandomized, small max_examples, no deadline (the interpreter's first call compiles nothing but is
slow); the whole file stays well under a minute on 2 cores.
"""
import os

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from megamoe.ops import errors  # noqa: E402
from megamoe.ops import gemm as gemm_ops  # noqa: E402
from megamoe.ops import moe as moe_ops  # noqa: E402
from gemm_helpers import random_weight  # noqa: E402  (tests/ is on sys.path)
from guard_helpers import require_interpreter  # noqa: E402

FUZZ = settings(max_examples=int(os.environ.get("MEGAMOE_FUZZ_EXAMPLES", 12)), deadline=None, derandomize=True,
                suppress_health_check=list(HealthCheck), database=None)


def _on_backend(interpret: str, fn):
    if interpret != "0":
        require_interpreter()  # CPU tensors through the interpreter's kernels
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = interpret
    errors.clear_errors("cpu")
    try:
        result = fn()
        return result, errors.peek_errors("cpu")
    finally:
        errors.clear_errors("cpu")
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


index_value = st.one_of(st.integers(-3, 40), st.sampled_from([-(2**31), 2**31 - 1, 1000]))


@FUZZ
@given(data=st.data(), num_experts=st.integers(1, 6), tokens=st.integers(0, 9), top_k=st.integers(1, 3))
def test_fuzz_dispatch_backends_agree(data, num_experts, tokens, top_k):
    ids = data.draw(st.lists(st.one_of(st.integers(0, num_experts - 1), index_value),
                             min_size=tokens * top_k, max_size=tokens * top_k))
    topk_ids = torch.tensor(ids, dtype=torch.int32).view(tokens, top_k)
    a, wa = _on_backend("1", lambda: moe_ops.dispatch(topk_ids, num_experts, backend="triton"))
    b, wb = _on_backend("0", lambda: moe_ops.dispatch(topk_ids, num_experts, backend="torch"))
    for key in ("expert_offsets", "sorted_expert", "row_index", "inv_perm"):
        assert torch.equal(a[key], b[key]), key
    invalid = (topk_ids < 0) | (topk_ids >= num_experts)
    assert wa == wb == (errors.flag("dispatch", "topk_ids") if bool(invalid.any()) else 0)
    valid = int((~invalid).sum())
    assert (a["expert_offsets"][-1].item() if num_experts else 0) == valid
    # inv_perm is a permutation and dropped pairs sit past the real rows
    assert sorted(a["inv_perm"].tolist()) == list(range(tokens * top_k))
    assert bool((a["inv_perm"].view(tokens, top_k)[invalid] >= valid).all())


@FUZZ
@given(data=st.data(), tokens=st.integers(0, 5), top_k=st.integers(1, 3), hidden=st.sampled_from([8, 70, 130]),
       extra_rows=st.integers(0, 3), with_shared=st.booleans())
def test_fuzz_combine_backends_agree(data, tokens, top_k, hidden, extra_rows, with_shared):
    rows = tokens * top_k + extra_rows
    inv = torch.tensor(data.draw(st.lists(st.one_of(st.integers(0, max(rows - 1, 0)), index_value),
                                          min_size=tokens * top_k, max_size=tokens * top_k)), dtype=torch.int32)
    y = torch.randn(rows, hidden).to(torch.bfloat16)
    w = torch.rand(tokens, top_k)
    nan_at = data.draw(st.lists(st.integers(0, max(tokens * top_k - 1, 0)), max_size=2))
    if tokens:
        w.view(-1)[torch.tensor(nan_at, dtype=torch.long)] = float("nan")
    if rows and data.draw(st.booleans()):
        y[data.draw(st.integers(0, rows - 1)), 0] = float("nan")
    shared = torch.randn(tokens, hidden).to(torch.bfloat16) if with_shared else None
    a, wa = _on_backend("1", lambda: moe_ops.combine(y, inv, w, shared))
    b, wb = _on_backend("0", lambda: moe_ops.combine(y, inv, w, shared))
    # bit-identical except NaN payloads (the kernel's and torch's NaN encodings differ)
    assert torch.equal(torch.isnan(a), torch.isnan(b))
    assert torch.equal(torch.nan_to_num(a, nan=0.0).view(torch.int16), torch.nan_to_num(b, nan=0.0).view(torch.int16))
    bad = (inv < 0) | (inv >= rows)
    assert wa == wb == (errors.flag("combine", "inv_perm") if bool(bad.any()) else 0)
    if tokens:  # a token whose only NaN weights belong to dropped pairs stays finite
        nan_w = torch.isnan(w) & ~bad.view(tokens, top_k)
        clean = ~nan_w.any(1) & ~torch.isnan(shared.float()).any(1) if shared is not None else ~nan_w.any(1)
        yv = torch.where(bad, 0, inv).long()
        hits_nan_row = (torch.isnan(y.float()).any(1)[yv] & ~bad).view(tokens, top_k).any(1) if rows else clean
        ok = clean & ~hits_nan_row
        assert torch.isfinite(a[ok].float()).all()


@FUZZ
@given(data=st.data(), num_experts=st.integers(1, 4), src_rows=st.integers(1, 6), pad=st.integers(0, 2),
       swiglu=st.booleans())
def test_fuzz_grouped_mm_backends_agree(data, num_experts, src_rows, pad, swiglu):
    counts = data.draw(st.lists(st.integers(0, 5), min_size=num_experts, max_size=num_experts))  # skewed, empty
    rows = sum(counts) + pad
    ri = torch.tensor(data.draw(st.lists(st.one_of(st.integers(0, src_rows - 1), index_value),
                                         min_size=rows, max_size=rows)), dtype=torch.int32)
    n, k = 32, 64
    w = random_weight((num_experts, n, k), "cpu")
    x = torch.randn(src_rows, k).to(torch.bfloat16)
    if data.draw(st.booleans()):
        x[data.draw(st.integers(0, src_rows - 1)), data.draw(st.integers(0, k - 1))] = float("nan")
    offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    kw = dict(row_index=ri, activation="swiglu" if swiglu else None, swiglu_limit=7.0 if swiglu else None)
    a, wa = _on_backend("1", lambda: gemm_ops.nvfp4_grouped_mm(x, w, offsets, **kw))
    b, wb = _on_backend("0", lambda: gemm_ops.nvfp4_grouped_mm(x, w, offsets, **kw))
    assert torch.equal(torch.isnan(a), torch.isnan(b))
    torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2, equal_nan=True)
    live = torch.arange(rows) < sum(counts)
    bad = live & ((ri < 0) | (ri >= src_rows))
    assert wa == wb == (errors.flag("nvfp4_grouped_mm", "row_index") if bool(bad.any()) else 0)
    assert bool((a[~live] == 0).all())  # padding rows are zeros
    dropped = bad
    if dropped.any():  # a dropped row reads zero activations -> zero output (no bias here)
        assert bool((a[dropped] == 0).all())
