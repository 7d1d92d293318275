"""The DeepSeek-V4 model (megamoe.models.model) against the float reference model on the same decoded weights.

Two references (``megamoe.reference.v4_model``):

* ``numerics="blocks"``: the megamoe block references (``megamoe/reference/``: moe, gemm, attention, kvcache,
  v4_numerics), each the oracle of one fast op, composed at the fast path's rounding points. The fast model must
  emit EXACTLY the same greedy tokens, free-running for 64 steps on several prompts decoded together as one batch,
  with logits within a tight stated bound (CPU: the fast model runs its ops' PyTorch references; CUDA: the
  kernels).
* the official bf16 numerics (``numerics="official_fp32_index"``): the fast path rounds at other points than the
  official model (routing weight after the down projection, float32 P, ...), so that comparison has stated
  loose bounds (``test_fast_model_vs_official_numerics_bounded``): fidelity to the official math.

CPU bit-exactness needs one more thing: float32 BLAS products sum in an order that depends on the row count (a
decode step has 1-3 rows, the stateless reference the whole sequence), and an ulp there can flip a bf16 rounding.
The CPU token test runs both models under ``exact_cpu_products`` (every CPU float32/bf16 product computed in
float64, rounded once), which removes that; what remains is every rounding point, and there the two agree bit
for bit. Plus one captured decode graph == eager and sync-free on CUDA.
"""
import pytest
import torch

from megamoe.models.config import V4_TINY_MODEL
from megamoe.models.model import V4Model
from megamoe.models.v4_weights import decoded_weight, random_state_dict, weight_specs
from megamoe.reference import v4_model as ref_model

STEPS = 64
#: Prompts of the token tests: 17 tokens (not a multiple of the compress ratios 4 and 16), 18, 3 (no entry before
#: decode) and 32 (a multiple of both: the prefill writes an HCA entry and ends on a flush).
PROMPTS = [[5, 17, 300, 2, 9, 44, 101, 7, 7, 250, 3, 18, 64, 99, 12, 1, 4],
           [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18],
           [400, 401, 402],
           [(37 * i + 11) % 512 for i in range(32)]]
#: Relative L2 error bound of every step's logits, fast vs the "blocks" reference, on the CPU with
#: ``exact_cpu_products``. Measured: 0 (bit for bit) on every step of every prompt, both selection regimes, seeds
#: 1234 and 7 (benchmarks/diag_v4_exact.py). The bound leaves room for a libm / vector-width difference between the
#: two paths' elementwise ops on another CPU, nothing more. Without ``exact_cpu_products`` (plain MKL float32
#: products) the same comparison measures a median of ~5e-3 per step and lets tokens differ at near-ties.
CPU_EXACT_BOUND = 1e-6


@pytest.fixture
def no_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _decoded(cfg, sd):
    return {name: decoded_weight(sd, name) for name in weight_specs(cfg)}


#: ``peaked_state_dict``: weight of the bigram direction added to each head row (the random rows have norm ~1).
PEAKED_ALPHA = 4.0


def peaked_state_dict(cfg, sd, alpha=PEAKED_ALPHA, seed=99):
    """A test-weight option: the random tiny model with a peaked next-token distribution, as a trained model has.

    The random model's logits (std ~1) have the top-2 margin distribution of 512 Gaussians: over the token test's
    4 prompts x 64 steps, 9 margins below 1e-2 (1% quantile 3e-3), i.e. below the logits error the GPU's GEMM
    summation order alone gives (~5e-3 relative), so exact tokens there would be luck, not a property of the fast
    model. Here head row ``v`` gets ``alpha * embed[sigma(v)] / |embed[sigma(v)]|`` added (``sigma`` a fixed random
    permutation): the final hidden state keeps the current token's embedding direction (x . e_t ~ 5), so the
    model mostly predicts the "bigram" successor ``sigma^-1(t)`` with a clear margin; context (attention, MoE) still
    decides ~2% of the steps and shifts every logit. Everything else is unchanged; the logits bound still covers
    all 512 logits of every step."""
    g = torch.Generator().manual_seed(seed)
    sigma = torch.randperm(cfg.vocab_size, generator=g)
    e = sd["embed.weight"].float()[sigma]
    out = dict(sd)
    out["head.weight"] = (sd["head.weight"].float() + alpha * e / e.norm(dim=1, keepdim=True)).to(
        sd["head.weight"].dtype)
    return out


def _config(selection):
    """"dense": index_topk >= the entries the prompts reach (the indexer selects every entry); "sparse": the tiny
    config's index_topk = 8 of up to 24 entries."""
    return V4_TINY_MODEL.replace(index_topk=64) if selection == "dense" else V4_TINY_MODEL


def _new_model(cfg, sd, device, prompts, steps, **kwargs):
    m = V4Model(cfg, max_batch=len(prompts), max_prefill_tokens=max(map(len, prompts)),
                max_context=max(map(len, prompts)) + steps + 1, device=device, **kwargs)
    m.load_weights(sd)
    return m


def _free_running(model, prompts, steps):
    """All prompts decoded together as one batch, greedy, each feeding its own tokens back. Returns the tokens
    (len(prompts) lists of ``steps``) and the logits (len(prompts), steps, vocab) float32 on the CPU that chose
    them (row 0 from the prefill, then one per decode step)."""
    from megamoe.kvcache import DecodeBatch

    dev = model.device
    logits = [[model.prefill(s, torch.tensor(p, dtype=torch.int64, device=dev)).float().cpu()]
              for s, p in enumerate(prompts)]
    outs = [[int(torch.argmax(l[0]))] for l in logits]
    batch = DecodeBatch.allocate(len(prompts), dev)
    for _ in range(steps - 1):
        model.prepare_decode(batch, list(range(len(prompts))))
        step = model.decode(batch, torch.tensor([o[-1] for o in outs], dtype=torch.int64, device=dev)).float().cpu()
        for r, o in enumerate(outs):
            logits[r].append(step[r])
            o.append(int(torch.argmax(step[r])))
    return outs, torch.stack([torch.stack(l) for l in logits])


def _reference_logits(cfg, w, prompt, tokens, device, **kwargs):
    """The "blocks" reference's logits (steps, vocab) float32 predicting each of ``tokens`` after ``prompt``
    (one stateless forward over prompt + tokens[:-1], the prompt as one prefill call). kwargs: ``model_forward``'s
    ``attention_p_rounding`` / ``max_context`` / ``decode_batch``."""
    seq = torch.tensor(prompt + tokens[:-1], device=device)
    out = ref_model.model_forward(cfg, w, seq, numerics="blocks", prefill_tokens=len(prompt), **kwargs)
    return out[len(prompt) - 1:].float().cpu()


def compare_with_reference(cfg, device, prompts, steps, *, attention_p_rounding=None, peaked=False):
    """Free-run the fast model (all prompts as one decode batch) and teacher-force the "blocks" reference on its
    tokens. ``attention_p_rounding="kernel"``: the reference's attention with the attention kernel's bf16 P, the
    tile size and split counts of the fast model's calls on ``device``. ``peaked``: :func:`peaked_state_dict`.
    Returns per prompt a dict: ``tokens`` (fast), ``ref_tokens`` (reference argmax per step), ``diverged`` (steps
    where they differ), ``rel`` / ``abs`` (steps,) the logits' relative L2 / max abs error, ``margins`` (steps,) the
    reference's top-2 logit margin, ``std`` (steps,) the reference logits' std, ``got`` / ``ref`` the logits."""
    sd = random_state_dict(cfg, seed=1234)  # on the CPU: the same model on CPU and GPU
    if peaked:
        sd = peaked_state_dict(cfg, sd)
    w = {k: v.to(device) for k, v in _decoded(cfg, sd).items()}
    sd = {k: v.to(device) for k, v in sd.items()}
    # float32 head on either device (CUDA defaults to a bf16 head; the reference head is float32)
    model = _new_model(cfg, sd, device, prompts, steps, head_dtype=torch.float32)
    fast_tokens, fast_logits = _free_running(model, prompts, steps)
    kwargs = {}
    if attention_p_rounding is not None:
        kwargs = dict(attention_p_rounding=attention_p_rounding, max_context=model.max_context,
                      decode_batch=len(prompts))
    out = []
    for r, (prompt, toks) in enumerate(zip(prompts, fast_tokens)):
        ref = _reference_logits(cfg, w, prompt, toks, device, **kwargs)
        got = fast_logits[r]
        ref_tokens = ref.argmax(dim=1)
        top2 = ref.topk(2, dim=1).values
        out.append(dict(tokens=toks, ref_tokens=ref_tokens.tolist(), got=got, ref=ref,
                        diverged=(ref_tokens != torch.tensor(toks)).nonzero().reshape(-1).tolist(),
                        rel=(got - ref).norm(dim=1) / ref.norm(dim=1), abs=(got - ref).abs().amax(dim=1),
                        margins=top2[:, 0] - top2[:, 1], std=ref.std(dim=1)))
    return out


def _exact_tokens(cfg, device, prompts, steps, bound, **kwargs):
    """Fast free-running batched greedy tokens == the reference's greedy tokens, logits within ``bound``.

    The reference is causal (row t of its stateless forward reads tokens <= t only), so its greedy generation
    equals the fast tokens exactly when, teacher-forced on the fast tokens, its argmax at every step is the fast
    token: one reference forward per prompt checks all 64 steps (``greedy_generate`` would recompute the sequence
    64 times). On a failure the message names the first diverging step and the reference's top-2 margin there.
    kwargs: :func:`compare_with_reference`'s.
    """
    problems = []
    for r, (prompt, d) in enumerate(zip(prompts, compare_with_reference(cfg, device, prompts, steps, **kwargs))):
        toks, got, ref, rel = d["tokens"], d["got"], d["ref"], d["rel"]
        if d["diverged"]:
            i = d["diverged"][0]
            j = d["ref_tokens"][i]
            problems.append(
                f"prompt {r} (len {len(prompt)}): diverging steps {d['diverged']} of {steps}; first: fast token "
                f"{toks[i]}, reference {j}; reference top-2 margin {float(d['margins'][i]):.3e}, fast - reference "
                f"logit of the two: {float(got[i, toks[i]] - got[i, j]):.3e} vs {float(ref[i, toks[i]] - ref[i, j]):.3e}"
                f"; logits rel err at that step {float(rel[i]):.3e}, before it max "
                f"{float(rel[:i].max()) if i else 0.0:.3e}")
        elif float(rel.max()) > bound:
            problems.append(f"prompt {r}: logits relative error max {float(rel.max()):.3e} (step "
                            f"{int(rel.argmax())}) above {bound:.1e}; median {float(rel.median()):.3e}")
    assert not problems, "\n".join(problems)


@pytest.mark.slow
@pytest.mark.parametrize("selection", ["dense", "sparse"])
def test_tiny_model_greedy_tokens_equal_blocks_reference_cpu(no_interpreter, selection):
    with ref_model.exact_cpu_products():
        _exact_tokens(_config(selection), torch.device("cpu"), PROMPTS, STEPS, CPU_EXACT_BOUND)


#: CUDA: the reference is the "blocks" one with the attention kernel's bf16 P (``attention_p_rounding="kernel"``:
#: BLOCK_N = 32 and the split counts of the fast model's calls), which the kernel follows to within the score dot's
#: summation order. What remains is the GEMMs' float32 summation order (tensor cores, split-K): under the
#: interpreter, every kernel on, 3.4e-3 / 5.2e-3 on the prefill logits (benchmarks/NOTES_model.md, issue 9); the
#: float32-P reference was 1.2-3.4e-2 away on the H100. Bound: 3x the interpreter's, for the H100's other order.
CUDA_BOUND = 1.5e-2
#: Logits-only check on the plain random weights (no token equality: their top-2 margins go down to 3e-3, below
#: the GEMM-order error), teacher-forced on the fast tokens: median and max of the per-step relative error.
#: An expert choice or indexer top-k flip at a near-tie is a discrete jump of one step's logits: the max allows one.
CUDA_LOGITS_BOUND = dict(median=1e-2, max=1e-1)


@pytest.mark.cuda
@pytest.mark.xfail(reason="not yet run on a GPU since the reference mirrors the attention kernel's bf16 P and the "
                          "test uses the peaked weights (issue 9); expected to pass: kernel vs bf16-P mirror <= 1e-4 per "
                          "attention call (interpreter: bit-exact or <= 9.5e-5), GEMM order ~5e-3 on the logits, "
                          "peaked reference margins >> that. Remove the marker once the H100 run passes",
                   strict=False)
@pytest.mark.parametrize("selection", ["dense", "sparse"])
def test_tiny_model_greedy_tokens_equal_blocks_reference_cuda(selection):
    """Exact greedy tokens on the GPU against the bf16-P "blocks" reference, on the peaked test weights
    (:func:`peaked_state_dict`: the plain random model's near-tie margins are below the GEMM summation-order error,
    see there), logits within ``CUDA_BOUND`` on every step."""
    _exact_tokens(_config(selection), torch.device("cuda"), PROMPTS, STEPS, CUDA_BOUND,
                  attention_p_rounding="kernel", peaked=True)


@pytest.mark.cuda
@pytest.mark.parametrize("selection", ["dense", "sparse"])
def test_tiny_model_logits_bound_blocks_reference_cuda(selection):
    """Teacher-forced logits bound on the plain random weights: the bf16-P "blocks" reference run on the fast
    model's own free-running tokens, per step relative L2 error median / max within ``CUDA_LOGITS_BOUND``."""
    res = compare_with_reference(_config(selection), torch.device("cuda"), PROMPTS, STEPS,
                                 attention_p_rounding="kernel")
    rel = torch.cat([d["rel"] for d in res])
    assert float(rel.median()) <= CUDA_LOGITS_BOUND["median"] and float(rel.max()) <= CUDA_LOGITS_BOUND["max"], (
        f"logits relative error median {float(rel.median()):.3e}, max {float(rel.max()):.3e}; per prompt max "
        f"{[round(float(d['rel'].max()), 4) for d in res]}, token flips at steps {[d['diverged'] for d in res]}")


#: Stated bounds of the fast model against the OFFICIAL numerics (``numerics="official_fp32_index"``, same decoded
#: weights), teacher-forced on the official reference's greedy tokens. The fast path rounds to bf16 at other points
#: than the official bf16 model (routing weight after the down projection, float32 P in the attention reference;
#: fused kernels on the GPU): ~3.5e-3 relative per attention block and ~4.7e-3 per MoE block, ~1e-2 on the logits
#: through 4 layers. The cache's FP4 indexer keys and FP8 entries turn such differences into a different code now
#: and then, so the indexer's top-k or an expert choice at a near-tie can differ: a discrete jump of one step's
#: logits. Measured on the tiny model (seeds 1-5, dense selection, CPU and H200): median 1.1-1.6e-2, 0-8% of steps
#: above 5e-2 (max 0.6), greedy tokens agreeing on 94-100% of the steps. Exact token equality holds against the
#: "blocks" reference (the tests above), not against the official rounding points; these bounds are what the
#: official math gives.
OFFICIAL_BOUNDS = {
    "dense": dict(median=2.5e-2, jump=5e-2, jump_fraction=0.15, max=1.0, agree=0.9),
    "sparse": dict(median=3.5e-2, jump=5e-2, jump_fraction=0.35, max=1.0, agree=0.8),
}
#: The reference with float32 indexer scores (the official bf16 scores tie often; see reference.v4_attention).
OFFICIAL_NUMERICS = "official_fp32_index"


def _teacher_forced(model, slot, prompt, tokens):
    """Prefill ``prompt`` in ``slot``, then decode feeding ``tokens``; returns the fast logits (len(tokens),
    vocab) float32 predicting each of ``tokens``."""
    from megamoe.kvcache import DecodeBatch

    dev = model.device
    rows = [model.prefill(slot, torch.tensor(prompt, dtype=torch.int64, device=dev)).float().cpu()]
    batch = DecodeBatch.allocate(1, dev)
    for t in tokens[:-1]:
        model.prepare_decode(batch, [slot])
        rows.append(model.decode(batch, torch.tensor([t], dtype=torch.int64, device=dev))[0].float().cpu())
    return torch.stack(rows)


def _official_agreement(cfg, device, prompts, steps, bounds):
    sd = random_state_dict(cfg, seed=1234)
    w = _decoded(cfg, sd)
    sd = {k: v.to(device) for k, v in sd.items()}
    model = _new_model(cfg, sd, device, prompts, steps)
    for slot, prompt in enumerate(prompts):
        want = ref_model.greedy_generate(cfg, w, prompt, steps, numerics=OFFICIAL_NUMERICS)
        ref_logits = ref_model.model_forward(cfg, w, torch.tensor(prompt + want[:-1]),
                                             numerics=OFFICIAL_NUMERICS)[len(prompt) - 1:]
        got = _teacher_forced(model, slot, prompt, want)
        rel = (got - ref_logits).norm(dim=1) / ref_logits.norm(dim=1)
        b = bounds
        jumps = float((rel > b["jump"]).float().mean())
        assert float(rel.median()) < b["median"] and jumps <= b["jump_fraction"] and float(rel.max()) < b["max"], (
            f"prompt {slot}: logits relative error median {float(rel.median()):.3e}, {jumps:.0%} of steps above "
            f"{b['jump']}, max {float(rel.max()):.3e}")
        assert float(rel[0]) < 2 * b["median"], f"prompt {slot}: prefill logits relative error {float(rel[0]):.3e}"
        agree = float((got.argmax(dim=1) == torch.tensor(want)).float().mean())
        assert agree >= b["agree"], f"prompt {slot}: greedy tokens agree on only {agree:.0%} of the steps"


@pytest.mark.slow
@pytest.mark.parametrize("selection", ["dense", "sparse"])
def test_fast_model_vs_official_numerics_bounded_cpu(no_interpreter, selection):
    _official_agreement(_config(selection), torch.device("cpu"), PROMPTS[:3], STEPS, OFFICIAL_BOUNDS[selection])


@pytest.mark.cuda
@pytest.mark.parametrize("selection", ["dense", "sparse"])
def test_fast_model_vs_official_numerics_bounded_cuda(selection):
    _official_agreement(_config(selection), torch.device("cuda"), PROMPTS[:2], STEPS, OFFICIAL_BOUNDS[selection])


@pytest.mark.cuda
def test_decode_graph_replay_equals_eager_and_is_sync_free():
    cfg = V4_TINY_MODEL
    dev = torch.device("cuda")
    sd = random_state_dict(cfg, seed=7, device=dev)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4]]
    models = []
    for _ in range(2):
        m = V4Model(cfg, max_batch=2, max_prefill_tokens=16, max_context=64, device=dev)
        m.load_weights(sd)
        first = [int(torch.argmax(m.prefill(s, torch.tensor(p, device=dev)))) for s, p in enumerate(prompts)]
        models.append((m, first))
    (eager, first), (graphed, _) = models
    step = graphed.capture_decode(2)
    step.tokens.copy_(torch.tensor(first))
    from megamoe.kvcache import DecodeBatch
    from megamoe.ops.sampling import sample

    batch = DecodeBatch.allocate(2, dev)
    tokens = torch.tensor(first, device=dev)
    for _ in range(20):
        eager.prepare_decode(batch, [0, 1])
        torch.cuda.set_sync_debug_mode("error")
        try:
            tokens = sample(eager.decode(batch, tokens), step.params)  # greedy (capture_decode's default)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        got = step([0, 1])
        assert torch.equal(got, tokens)
