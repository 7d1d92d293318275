"""The DeepSeek-V4 model (megamoe.models.model) against the float reference model on the same decoded weights.

CPU: the fast model runs its ops' PyTorch references (the interpreter is switched off for these tests, the
kernels have their own tests); it must emit the same greedy tokens as ``reference.v4_model.greedy_generate``
for 64 steps on several prompts, with logits within a stated bound. CUDA: the same with the kernels, plus one
captured decode graph == eager and sync-free.
"""
import pytest
import torch

from megamoe.models.config import V4_TINY_MODEL
from megamoe.models.model import V4Model
from megamoe.models.v4_weights import decoded_weight, random_state_dict, weight_specs
from megamoe.reference import v4_model as ref_model

STEPS = 64


@pytest.fixture
def no_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _decoded(cfg, sd):
    return {name: decoded_weight(sd, name) for name in weight_specs(cfg)}


#: Stated bounds of the fast model against the float reference model (same decoded weights), teacher-forced on
#: the reference's greedy tokens. The fast path rounds to bf16 at other points than the official bf16 model
#: (routing weight after the down projection, float32 P in the attention reference; fused kernels on the GPU):
#: ~3.5e-3 relative per attention block and ~4.7e-3 per MoE block, ~1e-2 on the logits through 4 layers. The
#: cache's FP4 indexer keys and FP8 entries turn such differences into a different code now and then (~7% of the
#: keys of layer 3), so the indexer's top-k at a near-tie, or an expert choice at a near-tie, can differ: a
#: discrete jump of one step's logits. Measured on the tiny model (seeds 1-5, dense selection, CPU and H200):
#: median 1.1-1.6e-2, 0-8% of steps above 5e-2 (max 0.6), greedy tokens agreeing on 94-100% of the steps. Exact 64-step token equality with random tiny weights is therefore not a property either path has (the
#: official code's own decode and prefill differ the same way); these bounds are.
#: Bounds per selection regime. "dense": index_topk >= the entries the prompts reach (the indexer selects every
#: entry, so only expert choices can jump); "sparse": the tiny config's index_topk = 8 of up to 20 entries.
BOUNDS = {
    "dense": dict(median=2.5e-2, jump=5e-2, jump_fraction=0.15, max=1.0, agree=0.9),
    "sparse": dict(median=3.5e-2, jump=5e-2, jump_fraction=0.35, max=1.0, agree=0.8),
}
#: The reference with float32 indexer scores (the official bf16 scores tie often; see reference.v4_attention).
NUMERICS = "official_fp32_index"


def _teacher_forced(model, slot, prompt, tokens):
    """Prefill ``prompt`` in ``slot``, then decode feeding ``tokens`` (the reference's greedy output); returns the
    fast logits (len(tokens), vocab) float32 predicting each of ``tokens``."""
    from megamoe.kvcache import DecodeBatch

    dev = model.device
    rows = [model.prefill(slot, torch.tensor(prompt, dtype=torch.int64, device=dev)).float().cpu()]
    batch = DecodeBatch.allocate(1, dev)
    for t in tokens[:-1]:
        model.prepare_decode(batch, [slot])
        rows.append(model.decode(batch, torch.tensor([t], dtype=torch.int64, device=dev))[0].float().cpu())
    return torch.stack(rows)


def _free_running(model, prompts, steps):
    """All prompts decoded together as one batch, greedy, each feeding its own tokens back."""
    from megamoe.kvcache import DecodeBatch

    dev = model.device
    outs = [[int(torch.argmax(model.prefill(s, torch.tensor(p, dtype=torch.int64, device=dev))))]
            for s, p in enumerate(prompts)]
    batch = DecodeBatch.allocate(len(prompts), dev)
    for _ in range(steps - 1):
        model.prepare_decode(batch, list(range(len(prompts))))
        logits = model.decode(batch, torch.tensor([o[-1] for o in outs], dtype=torch.int64, device=dev))
        for r, o in enumerate(outs):
            o.append(int(torch.argmax(logits[r])))
    return outs


def _agreement(cfg, device, prompts, steps, bounds):
    # generated on the CPU for every device: the same model on CPU and GPU (CUDA generators draw other values)
    sd = random_state_dict(cfg, seed=1234)
    w = _decoded(cfg, sd)
    sd = {k: v.to(device) for k, v in sd.items()}

    def new_model():
        m = V4Model(cfg, max_batch=len(prompts), max_prefill_tokens=max(map(len, prompts)),
                    max_context=max(map(len, prompts)) + steps + 1, device=device)
        m.load_weights(sd)
        return m

    model = new_model()
    refs, firsts = [], []
    for slot, prompt in enumerate(prompts):
        want = ref_model.greedy_generate(cfg, w, prompt, steps, numerics=NUMERICS)
        refs.append(want)
        ref_logits = ref_model.model_forward(cfg, w, torch.tensor(prompt + want[:-1]), numerics=NUMERICS)[len(prompt) - 1:]
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
        firsts.append(int(got[0].argmax()))
    # all prompts decoded together in one batch (slots side by side): each request's prefill is unaffected by
    # the others, and the batched decode runs
    fast = _free_running(new_model(), prompts, steps)
    assert [f[0] for f in fast] == firsts
    assert all(len(f) == steps for f in fast)



@pytest.mark.slow
@pytest.mark.parametrize("selection", ["dense", "sparse"])
def test_tiny_model_greedy_tokens_match_reference_cpu(no_interpreter, selection):
    cfg = V4_TINY_MODEL.replace(index_topk=64) if selection == "dense" else V4_TINY_MODEL
    prompts = [[5, 17, 300, 2, 9, 44, 101, 7, 7, 250, 3, 18, 64, 99, 12, 1, 4],  # 17: not a multiple of 4 or 16
               [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18],
               [400, 401, 402]]
    _agreement(cfg, torch.device("cpu"), prompts, STEPS, BOUNDS[selection])


@pytest.mark.cuda
@pytest.mark.parametrize("selection", ["dense", "sparse"])
def test_tiny_model_greedy_tokens_match_reference_cuda(selection):
    cfg = V4_TINY_MODEL.replace(index_topk=64) if selection == "dense" else V4_TINY_MODEL
    prompts = [[5, 17, 300, 2, 9, 44, 101, 7, 7, 250, 3, 18, 64, 99, 12, 1, 4], [400, 401, 402]]
    _agreement(cfg, torch.device("cuda"), prompts, STEPS, BOUNDS[selection])


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
