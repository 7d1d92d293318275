"""Token sampler (megamoe/ops/sampling.py): greedy, determinism, the sampled distribution vs the definition,
special values, the Triton kernel vs the reference, validation, and the sm_90 build / CUDA graph checks."""
import math

import pytest
import torch

from megamoe.ops.sampling import SamplingParams, sample
from megamoe.reference import sampling as ref
from sync_helpers import no_host_syncs


@pytest.fixture
def torch_path(monkeypatch):
    """The CPU reference path of the op (fast: used for the large-sample statistics)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _params(batch, device="cpu", **kw):
    p = SamplingParams.allocate(batch, device)
    if kw:
        p.set(range(batch), **kw)
    return p


@pytest.mark.parametrize("filtering", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax_lowest_id_on_ties(filtering, dtype, device):
    logits = torch.randn(6, 70).to(dtype)
    logits[1, 5] = logits[1, 40] = logits[1].max() + 1  # tie -> 5
    logits[2] = 0.25  # all equal -> 0
    logits[3, 7] = float("nan")
    logits = logits.to(device)
    p = _params(6, device, temperature=0.0, top_k=3 if filtering else 0, seed=list(range(6)))
    got = sample(logits, p, filtering=filtering)
    expect = torch.nan_to_num(logits.float(), nan=-float("inf")).argmax(dim=1)
    assert torch.equal(got, expect) and got[1] == 5 and got[2] == 0
    assert p.step.tolist() == [1] * 6


def test_seed_step_determinism_and_row_independence(device):
    v = 500
    logits = torch.zeros(16, v, device=device)  # uniform distribution: the draw is all noise
    p = _params(16, device, seed=[7] * 8 + list(range(100, 108)))
    first = sample(logits, p)
    assert len(set(first[:8].tolist())) == 1  # same seed, same step, same logits -> same token on every row
    assert len(set(first[8:].tolist())) >= 6  # different seeds -> different tokens (collisions ~ 1/500)
    second = sample(logits, p)
    assert p.step.tolist() == [2] * 16 and not torch.equal(first, second)  # the counter advanced
    p.set(range(16), seed=[7] * 8 + list(range(100, 108)))  # resets the steps: the same draws again
    assert torch.equal(sample(logits, p), first)
    # the batch composition does not matter: seed 7 at step 0 in row 5 of a 6-row batch
    q = _params(6, device, seed=[1, 2, 3, 4, 5, 7])
    assert sample(logits[:6], q)[5] == first[0]
    # partial batches use (and advance) the first rows only
    r = _params(4, device, seed=7)
    sample(logits[:2], r)
    assert r.step.tolist() == [1, 1, 0, 0]


def _expected_probs(logits_row, t, k, p):
    """The definition, independently in Python floats: softmax(x / T) over top-k, then the top-p prefix."""
    x = [v / t for v in logits_row.tolist()]
    order = sorted(range(len(x)), key=lambda i: (-x[i], i))
    if k:
        order = order[:k]
    m = max(x[i] for i in order)
    w = [math.exp(x[i] - m) for i in order]
    z = sum(w)
    q = [wi / z for wi in w]
    keep, acc = [], 0.0
    for i, qi in zip(order, q):
        if p < 1.0 and keep and acc >= p:
            break
        keep.append(i)
        acc += qi
    w = {i: math.exp(x[i] - m) for i in keep}
    z = sum(w.values())
    return [w.get(i, 0.0) / z for i in range(len(x))]


def _chi2(counts, probs, n):
    stat, df = 0.0, -1
    for c, pr in zip(counts, probs):
        if pr > 0:
            stat += (c - n * pr) ** 2 / (n * pr)
            df += 1
        elif c:
            return float("inf"), df  # a token outside the kept set was drawn
    return stat, df


CASES = [  # (temperature, top_k, top_p)
    (1.0, 0, 1.0), (0.5, 0, 1.0), (2.0, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.7), (0.7, 4, 0.8), (1.0, 1, 1.0),
]


@pytest.mark.parametrize("t,k,p", CASES)
def test_distribution_matches_the_definition(t, k, p, torch_path):
    n, v = 40000, 8
    logits_row = torch.tensor([1.2, -0.3, 0.8, 0.8, -1.5, 0.1, 2.0, -0.7])
    logits = logits_row.expand(n, v).contiguous()
    params = _params(n, temperature=t, top_k=k, top_p=p, seed=list(range(n)))
    counts = torch.bincount(sample(logits, params), minlength=v).tolist()
    probs = _expected_probs(logits_row, t, k, p)
    stat, df = _chi2(counts, probs, n)
    bound = df + 6 * math.sqrt(2 * max(df, 1)) + 10  # ~ 6 sigma of a chi-square with df degrees of freedom
    assert stat < bound, (stat, df, counts, probs)
    # the test has power: the same counts against the unfiltered, unscaled softmax fail (except the trivial case)
    if (t, k, p) != (1.0, 0, 1.0):
        wrong, _ = _chi2(counts, _expected_probs(logits_row, 1.0, 0, 1.0), n)
        assert wrong > 4 * bound, wrong


def test_top_p_prefix_and_renormalisation_after_top_k():
    logits = torch.tensor([[math.log(2.0), 0.0, 0.0]])  # probabilities 0.5, 0.25, 0.25

    def keep(k, p):
        return ref.keep_counts(logits, torch.tensor([k]), torch.tensor([p])).item()

    # the smallest prefix whose mass reaches p (exclusive prefix sums 0, 0.5, 0.75 compared with p)
    assert (keep(0, 0.4), keep(0, 0.6), keep(0, 0.8), keep(0, 1.0)) == (1, 2, 3, 3)
    # top-p on the top-k distribution renormalised: top-2 -> (2/3, 1/3), so p = 0.6 keeps one token only
    assert (keep(2, 0.6), keep(2, 0.8), keep(2, 1.0), keep(1, 1.0), keep(7, 1.0)) == (1, 2, 2, 1, 3)


@pytest.mark.parametrize("filtering", [False, True])
def test_special_values(filtering, device):
    v = 40
    logits = torch.randn(4, v)
    logits[0, :] = float("nan")  # all NaN -> token 0
    logits[1, ::2] = float("nan")  # NaN never sampled
    logits[2, :] = float("-inf")
    logits[3, 9] = logits[3, 30] = float("inf")  # +inf: the lowest-id +inf token
    p = _params(4, device, temperature=1.0, top_k=5 if filtering else 0, top_p=0.9 if filtering else 1.0,
                seed=[1, 2, 3, 4])
    for _ in range(5):
        got = sample(logits.to(device), p, filtering=filtering).tolist()
        assert got[0] == 0 and got[1] % 2 == 1 and got[2] == 0 and got[3] == 9


@pytest.mark.parametrize("filtering", [False, True])
def test_kernel_matches_reference(filtering, device):
    b, v = 48, 300  # several interpreter chunks of 64 columns
    logits = torch.randn(b, v) * 2
    logits[3, 17] = float("nan")
    temps = [0.0, 0.3, 1.0, 1.7] * (b // 4)
    ks = [0, 1, 5, 50, 0, 400] * (b // 6)
    ps = [1.0, 0.5, 0.9, 1.0] * (b // 4)
    seeds = [(i * 7919) - 2 ** 62 + (i << 40) for i in range(b)]
    steps = [i * 3 + 2 ** 32 * (i % 2) for i in range(b)]
    p = _params(b, device, temperature=temps, top_k=ks, top_p=ps, seed=seeds, step=steps)
    t, k, pp, s, st = (torch.tensor(x) for x in (temps, ks, ps, seeds, steps))
    if filtering:
        expect = ref.sample(logits, t.float(), k.int(), pp.float(), s, st)
    else:
        expect = ref.gumbel_pick(ref.scaled_logits(logits, t.float()), None, None, t.float(), s, st)
    got = sample(logits.to(device), p, filtering=filtering).cpu()
    assert torch.equal(got, expect)
    assert p.step.cpu().tolist() == [x + 1 for x in steps]


@pytest.mark.parametrize("filtering", [False, True])
def test_strided_logits_equal_contiguous(filtering, device):
    """Column-major or row-strided logits draw the same tokens as their contiguous copy (the sort path once gave
    another token for a transposed view)."""
    logits = torch.randn(3, 50, device=device)
    layouts = {"column-major": logits.t().contiguous().t(), "strided": torch.randn(3, 100, device=device)[:, ::2]}
    layouts["strided"].copy_(logits)
    for name, view in layouts.items():
        assert not view.is_contiguous()
        kw = dict(temperature=0.7, seed=[1, 2, 3, 4], top_k=5, top_p=0.9)
        expect = sample(logits, _params(4, device, **kw), filtering=filtering)
        assert torch.equal(sample(view, _params(4, device, **kw), filtering=filtering), expect), name


def test_parameter_tensors_and_flags_are_validated():
    """The constructor checks the values of the tensors it is given as ``set`` checks host values; ``filtering``
    is a bool or None."""
    ones, zeros_i, zeros_l = torch.ones(2), torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(ones, torch.tensor([-1, 0], dtype=torch.int32), ones, zeros_l, zeros_l)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(ones, zeros_i, torch.tensor([2.0, 1.0]), zeros_l, zeros_l)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(torch.tensor([-1.0, 1.0]), zeros_i, ones, zeros_l, zeros_l)
    with pytest.raises(ValueError, match="step"):
        SamplingParams(ones, zeros_i, ones, zeros_l, torch.tensor([0, -3]))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(torch.ones(0), torch.zeros(0, dtype=torch.int32), torch.ones(0),
                       torch.zeros(0, dtype=torch.long),
                       torch.zeros(0, dtype=torch.long))
    p = SamplingParams.allocate(2)
    for bad in ("no", 1, 0.0):
        with pytest.raises(TypeError, match="filtering"):
            sample(torch.randn(2, 10), p, filtering=bad)


def test_uniforms_are_uniform_and_keyed():
    seed = torch.tensor([0, 1, 2 ** 40])
    step = torch.tensor([0, 0, 5])
    u = ref.counter_uniform(seed, step, torch.arange(20000))
    assert (u > 0).all() and (u < 1).all()
    hist = torch.histc(u[0], bins=10, min=0, max=1)
    assert ((hist - 2000).abs() < 200).all(), hist  # ~ 4.7 sigma per bin
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[1], u[2])
    assert torch.equal(ref.counter_uniform(seed, step, torch.arange(5)), u[:, :5])  # a pure function
    assert abs(torch.corrcoef(torch.stack((u[0, :-1], u[0, 1:])))[0, 1].item()) < 0.05  # neighbours uncorrelated


def test_validation():
    p = SamplingParams.allocate(4)
    logits = torch.randn(4, 10)
    with pytest.raises(ValueError, match="temperature"):
        p.set(0, temperature=-1.0)
    with pytest.raises(ValueError, match="temperature"):
        p.set(0, temperature=float("nan"))
    with pytest.raises(ValueError, match="top_p"):
        p.set(0, top_p=0.0)
    with pytest.raises(ValueError, match="top_p"):
        p.set(0, top_p=float("nan"))
    with pytest.raises(ValueError, match="top_k"):
        p.set(0, top_k=-1)
    with pytest.raises(ValueError, match="seed"):
        p.set(0, seed=2 ** 64)
    with pytest.raises(ValueError, match="rows"):
        p.set(4, seed=1)
    with pytest.raises(ValueError, match="one value per row"):
        p.set([0, 1], seed=[1, 2, 3])
    with pytest.raises(TypeError, match="rows"):
        p.set("all", seed=1)
    p.set(slice(0, 2), top_k=5)
    assert p.any_filter and p.top_k.tolist() == [5, 5, 0, 0]
    p.set([0, 1], top_k=0)
    assert not p.any_filter
    with pytest.raises(ValueError, match="rows exceed"):
        sample(torch.randn(5, 10), p)
    with pytest.raises(TypeError, match="logits"):
        sample(torch.randint(0, 3, (4, 10)), p)
    with pytest.raises(ValueError, match="logits"):
        sample(torch.randn(40), p)
    with pytest.raises(ValueError, match="out"):
        sample(logits, p, out=torch.empty(4, dtype=torch.int32))
    with pytest.raises(TypeError, match="params"):
        sample(logits, {"temperature": 1.0})
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(torch.ones(2), torch.zeros(2), torch.ones(2), torch.zeros(2, dtype=torch.long),
                       torch.zeros(2, dtype=torch.long))
    assert sample(torch.randn(0, 10), p).shape == (0,)


def test_sampler_kernel_builds_for_sm90():
    from sm90_compile import compile_sm90

    sig = dict(values_ptr="*fp32", ids_ptr="*i64", n_keep_ptr="*i32", temperature_ptr="*fp32", seed_ptr="*i64",
               step_ptr="*i64", part_best_ptr="*fp32", part_at_ptr="*i32", N="i32", stride_v="i32", stride_i="i32",
               P="i32")
    for sorted_, vtype in ((False, "*bf16"), (True, "*fp32")):
        ptx, res = compile_sm90("megamoe.kernels.sampling", "_sample_partial_kernel", {**sig, "values_ptr": vtype},
                                dict(SORTED=sorted_, BLOCK_V=2048, CHUNKS_PER_PART=2), 8)
        assert res["LOCAL"] == 0 and res["STACK"] == 0 and res["REG"] <= 64, res
        assert "mul.lo.s32" in ptx and "shr.u32" in ptx  # the mixer stays in 32-bit (wrapping) arithmetic
    msig = dict(part_best_ptr="*fp32", part_at_ptr="*i32", ids_ptr="*i64", stride_i="i32", step_ptr="*i64",
                out_ptr="*i64", P="i32")
    _, res = compile_sm90("megamoe.kernels.sampling", "_sample_merge_kernel", msig, dict(SORTED=True, P_P2=64), 1)
    assert res["LOCAL"] == 0 and res["STACK"] == 0, res


def test_parts_cover_the_row_and_do_not_change_the_token():
    """The row split (shapes only) covers every chunk once; any split gives the one-pass argmax (ties: lowest)."""
    from guard_helpers import require_interpreter
    from megamoe.kernels import sampling as ks

    for rows, n in ((1, 129280), (8, 129280), (64, 129280), (1, 1), (3, 5000), (300, 4096)):
        parts, per = ks.sample_parts(rows, n, 2048)
        chunks = -(-n // 2048)
        assert parts * per >= chunks > (parts - 1) * per, (rows, n, parts, per)
    # ties across part boundaries and NaN/-inf parts: the interpreter kernel with 4 parts against argmax
    require_interpreter()
    logits = torch.full((3, 300), float("-inf"))
    logits[0, 70] = logits[0, 250] = 5.0  # tie in parts 1 and 3 -> 70
    logits[1, :] = float("nan")  # nothing finite -> 0, like the one-pass kernel
    logits[2, 299] = 1.0
    b = logits.shape[0]
    p = _params(b, "cpu", temperature=0.0)
    out = torch.empty(b, dtype=torch.int64)
    step = p.step.clone()
    ks.launch_sample(logits, None, None, p.temperature, p.seed, p.step, out, interpreter=True)
    assert out.tolist() == [70, 0, 299]
    assert (p.step == step + 1).all()


@pytest.mark.cuda
@pytest.mark.parametrize("filtering", [False, True])
def test_cuda_graph_replay_equals_eager_and_sync_free(filtering):
    b, v = 64, 129280  # decode batch, DeepSeek-V4 vocabulary
    logits = torch.randn(b, v, device="cuda") * 3
    p = _params(b, "cuda", temperature=[0.0, 0.6, 1.0, 1.3] * 16, top_k=[0, 50, 0, 1000] * 16 if filtering else 0,
                top_p=[1.0, 0.9, 0.95, 1.0] * 16 if filtering else 1.0, seed=list(range(b)))
    out = torch.empty(b, dtype=torch.int64, device="cuda")
    sample(logits, p, out, filtering=filtering)  # warm-up (compiles)
    p.set(range(b), seed=list(range(b)))
    torch.cuda.synchronize()
    with no_host_syncs():
        eager = sample(logits, p, out, filtering=filtering).clone()
    # the reference on the same inputs: the same tokens, except where the chosen keys tie within a few ulps
    t, k, pp = p.temperature, p.top_k, p.top_p
    steps0 = torch.zeros(b, dtype=torch.int64, device="cuda")
    if filtering:
        expect = ref.sample(logits, t, k, pp, p.seed, steps0)
    else:
        expect = ref.gumbel_pick(ref.scaled_logits(logits, t), None, None, t, p.seed, steps0)
    assert (eager != expect).sum().item() <= 2
    p.set(range(b), seed=list(range(b)))
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        sample(logits, p, out, filtering=filtering)
    torch.cuda.current_stream().wait_stream(s)
    p.set(range(b), seed=list(range(b)))
    with torch.cuda.graph(graph):
        sample(logits, p, out, filtering=filtering)
    p.set(range(b), seed=list(range(b)))  # capture does not run: steps are back at 0
    graph.replay()
    assert torch.equal(out, eager) and p.step.tolist() == [1] * b
    graph.replay()  # the counter advanced inside the graph: new draws for the sampled rows
    assert p.step.tolist() == [2] * b
    greedy = torch.tensor([0.0, 0.6, 1.0, 1.3] * 16, device="cuda") == 0
    assert torch.equal(out[greedy], eager[greedy]) and not torch.equal(out[~greedy], eager[~greedy])
