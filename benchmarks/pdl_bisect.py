"""Which kernel family makes the PDL decode graph differ from eager? (diagnostic for test_pdl.py's tiny-model test)

The tiny V4 model (seed 7, two prompts), 12 greedy decode steps: eager with PDL off is the reference; then the
captured decode graph with PDL on for ALL families, for NONE, for each family ALONE and for all BUT each family.
A family is a kernel module that launches with ``pdl_enabled`` or ``pdl_flags``; it is switched off by replacing
that function in the module with one that answers "no PDL" (the launch is then an ordinary one). Prints one line per setting:
tokens equal to the reference or the first differing step.

Two more modes (results/gpu_check_v16, NOTES_moe_decode.md "The decode graph returns a wrong token"):
``--teacher`` feeds every setting eager's tokens and prints the max |logit diff| per step; ``--trace`` records the
free-running graph's inputs, logits and returned tokens (even attempts: a fresh clone per read, odd: rows of a
buffer allocated before the replays), replays its inputs eagerly, and with ``--history`` prints the allocator's
events on a corrupted clone's address (who owned that memory before).

Usage: python benchmarks/pdl_bisect.py [--steps 12] [--repeats 3] [--teacher | --trace [--history]]
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FAMILIES = ["kvcache.indexer", "topk", "sampling", "moe_route_dispatch", "v4_elementwise", "moe_combine",
            "gemm.nvfp4_mma_decode", "sparse_attention_ws", "sparse_attention", "moe_router", "hyper_connection",
            "moe_dispatch"]


def _previous_owner(addr: int) -> None:
    """Print the allocator events (torch.cuda.memory._snapshot's device traces) that touched ``addr``: the last
    free before the clone's allocation names the tensor that owned the memory before it, with its Python stack."""
    snap = torch.cuda.memory._snapshot()
    events = [e for trace in snap.get("device_traces", []) for e in trace
              if e.get("action") in ("alloc", "free_requested", "free_completed", "segment_free")
              and e.get("addr", -1) <= addr < e.get("addr", -1) + max(e.get("size", 0), 1)]
    print(f"    allocator events covering {addr:#x}: {len(events)}", flush=True)
    for e in events[-6:]:
        frames = [f"{f.get('filename', '?').split('/')[-1]}:{f.get('line', '?')} {f.get('name', '?')}"
                  for f in e.get("frames", []) if "megamoe" in f.get("filename", "") or "pdl_bisect" in
                  f.get("filename", "")][:6]
        print(f"    {e['action']} addr {e['addr']:#x} size {e.get('size')} stream {e.get('stream')}: {frames}",
              flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeats", type=int, default=3, help="graph runs per setting (a race may not show every time)")
    p.add_argument("--teacher", action="store_true",
                   help="instead: feed every setting the reference's tokens and print the max |logit diff| per step")
    p.add_argument("--trace", action="store_true",
                   help="instead: free-running graph (PDL off) recording each replay's input tokens, logits and "
                        "sampled tokens; then an eager model fed the graph's own inputs, step by step")
    p.add_argument("--history", action="store_true",
                   help="--trace: record the allocator's history and print who owned a corrupted clone's memory before")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the eager paths only")
    args = p.parse_args()
    from megamoe.kernels import pdl
    from megamoe.kvcache import DecodeBatch
    from megamoe.models.config import V4_TINY_MODEL
    from megamoe.models.model import V4Model
    from megamoe.models.v4_weights import random_state_dict
    from megamoe.ops.sampling import SamplingParams, sample

    modules = {f: importlib.import_module(f"megamoe.kernels.{f}") for f in FAMILIES}
    # a family launches with pdl_enabled (the switch) or pdl_flags (per kernel); both are replaced per setting
    names = {f: "pdl_flags" if hasattr(m, "pdl_flags") else "pdl_enabled" for f, m in modules.items()}
    original = {f: getattr(m, names[f]) for f, m in modules.items()}
    off = {"pdl_enabled": lambda t: False, "pdl_flags": lambda t, kernel, single_pass=True: (False, False)}
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    cfg = V4_TINY_MODEL
    sd = random_state_dict(cfg, seed=7, device=dev)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4]]

    def setting(on: set):
        pdl.PDL_ENABLED = bool(on)
        for f, m in modules.items():
            setattr(m, names[f], original[f] if f in on else off[names[f]])

    def prefilled():
        """A fresh tiny model with both prompts prefilled -> (model, each prompt's first token (argmax))."""
        m = V4Model(cfg, max_batch=2, max_prefill_tokens=16, max_context=64, device=dev)
        m.load_weights(sd)
        return m, [int(torch.argmax(m.prefill(s, torch.tensor(q, device=dev)))) for s, q in enumerate(prompts)]

    def run(graphed: bool):
        m, first = prefilled()
        seen = []
        if graphed:
            step = m.capture_decode(2)
            step.tokens.copy_(torch.tensor(first))
            for _ in range(args.steps):
                seen.append(step([0, 1]).clone())
        else:
            params = SamplingParams.allocate(2, dev)
            params.set(range(2), temperature=0.0)
            batch = DecodeBatch.allocate(2, dev)
            tokens = torch.tensor(first, device=dev)
            for _ in range(args.steps):
                m.prepare_decode(batch, [0, 1])
                tokens = sample(m.decode(batch, tokens), params)
                seen.append(tokens.clone())
        sync()
        return torch.stack(seen).cpu()

    def forced(graphed: bool, inputs: torch.Tensor):
        """Teacher forcing: step i decodes inputs[i] (2,) whatever the previous step sampled -> logits (steps, 2, V)."""
        m, _ = prefilled()
        out = []
        if graphed:
            step = m.capture_decode(2)
            for i in range(args.steps):
                step.tokens.copy_(inputs[i])  # device to device, stream-ordered
                step([0, 1])
                out.append(step.logits.clone())
        else:
            batch = DecodeBatch.allocate(2, dev)
            for i in range(args.steps):
                m.prepare_decode(batch, [0, 1])
                out.append(m.decode(batch, inputs[i].clone()).clone())
        sync()
        return torch.stack(out).float()

    if args.trace:
        setting(set())
        ref = run(False)
        if args.history:
            torch.cuda.memory._record_memory_history(max_entries=200000)
        for attempt in range(args.repeats):
            m, first = prefilled()
            step = m.capture_decode(2)
            step.tokens.copy_(torch.tensor(first))
            # variant "prealloc": copy into rows of buffers allocated before the replays (no eager allocation
            # between replays), else a fresh clone per read (what the failing test does)
            prealloc = attempt % 2 == 1
            out_buf = torch.empty((args.steps, 2), dtype=torch.int64, device=dev) if prealloc else None
            g_in, g_logits, g_out = [], [], []
            for i in range(args.steps):
                g_in.append(step.tokens.clone())  # before the replay (step() syncs in prepare_decode, then replays)
                tok = step([0, 1])
                if prealloc:
                    out_buf[i].copy_(tok)
                else:
                    g_out.append(tok.clone())
                g_logits.append(step.logits.clone())
            sync()
            outs = out_buf if prealloc else torch.stack(g_out)
            g_in, g_logits = torch.stack(g_in), torch.stack(g_logits).float()
            e_logits = forced(False, g_in)
            diff = (g_logits - e_logits).abs().amax(dim=2)
            wrong = (g_logits.argmax(dim=2) != outs).any(dim=1).nonzero().flatten().tolist()
            bad = (outs.cpu() != ref).any(dim=1).nonzero().flatten().tolist()
            print(f"trace {attempt} ({'preallocated rows' if prealloc else 'a clone per read'}): first tokens "
                  f"{first}; tokens vs reference: {'same' if not bad else f'differ from step {bad[0]}'}; steps whose "
                  f"tokens != argmax(logits): {wrong}; inputs == [first, outputs[:-1]]: "
                  f"{torch.equal(g_in[1:], outs[:-1])}; max |graph - eager logits| given the graph's inputs "
                  f"(rows 0/1) per step: " + " ".join(f"{a:.2g}/{b:.2g}" for a, b in diff.tolist()), flush=True)
            for i in wrong[:3]:
                print(f"  step {i}: tokens {outs[i].tolist()}, argmax {g_logits[i].argmax(dim=1).tolist()}, "
                      f"next step's input {g_in[i + 1].tolist() if i + 1 < args.steps else '-'}", flush=True)
                if args.history and not prealloc:
                    _previous_owner(g_out[i].data_ptr())
            del m, step
        return

    if args.teacher:
        setting(set())
        ref = run(False).to(dev)
        # step 0 decodes each prompt's own first token (argmax of its prefill), step i > 0 the reference's token i-1
        first = torch.tensor(prefilled()[1], device=dev)
        inputs = torch.cat([first[None], ref[:-1]])
        eager_a = forced(False, inputs)
        eager_b = forced(False, inputs)
        print(f"eager vs eager (two models): max |diff| per step {(eager_a - eager_b).abs().amax(dim=(1, 2)).tolist()}")
        scale = eager_a.abs().amax().item()
        if dev.type != "cuda":
            return
        for name, on in (("graph, PDL off", set()), ("graph, PDL off (again)", set()), ("graph, PDL on", set(FAMILIES))):
            setting(on)
            g = forced(True, inputs)
            d = (g - eager_a).abs().amax(dim=(2,))
            print(f"{name:24s} max |logit diff| per step (rows 0/1; logits up to {scale:.3g}): "
                  + " ".join(f"{a:.2g}/{b:.2g}" for a, b in d.tolist()), flush=True)
        setting(set())
        return

    setting(set())
    ref = run(False)
    print(f"reference (eager, PDL off): {ref[:, 0].tolist()}", flush=True)

    def report(name: str, on: set, graphed: bool = True):
        setting(on)
        verdicts = []
        for _ in range(args.repeats):
            got = run(graphed)
            bad = (got != ref).any(dim=1).nonzero().flatten().tolist()
            verdicts.append("same" if not bad else f"differs from step {bad[0]}")
        print(f"{name:40s} {'graph' if graphed else 'eager'}: {', '.join(verdicts)}", flush=True)

    every = set(FAMILIES)
    report("eager, PDL on (all)", every, graphed=False)
    if dev.type != "cuda":  # the smoke run stops before the graphs
        setting(set())
        return
    report("graph, PDL off", set())
    report("graph, PDL on (all)", every)
    for f in FAMILIES:
        report(f"graph, only {f}", {f})
    for f in FAMILIES:
        report(f"graph, all but {f}", every - {f})
    setting(set())


if __name__ == "__main__":
    main()
