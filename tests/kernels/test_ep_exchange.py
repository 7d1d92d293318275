"""Expert-parallel exchange planning (megamoe/kernels/ep_exchange.py) against its PyTorch oracles
(megamoe/reference/ep_exchange.py), and the oracles against a loop written from the layout's definition.

Every output buffer starts filled with a sentinel in both runs and is compared whole, so a write to a row that
should stay untouched, or a missing write, fails. Routings: random, every token on the same k experts (one
expert holds every row of its slot), a peer that receives nothing, dropped ids, T = 0. Counts: random, one
block holding all rows, all zero, and inconsistent counts (no write past the buffers). CPU: the interpreter;
with a GPU: the compiled kernels.
"""
import pytest
import torch

from megamoe.kernels import ep_exchange as kernels
from megamoe.ops import moe as moe_ops
from megamoe.reference import ep_exchange as reference

SENTINEL = -7


def _routing(kind: str, tokens: int, experts: int, top_k: int, gen) -> torch.Tensor:
    if tokens == 0:
        return torch.zeros((0, top_k), dtype=torch.int32)
    if kind == "random":
        return torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(torch.int32)
    if kind == "same_k":  # every token on experts 1..k: each of them holds every token
        return torch.arange(1, top_k + 1, dtype=torch.int32).repeat(tokens, 1)
    if kind == "peer0_only":  # only the first half of the experts: rank 1 of 2 receives nothing
        return torch.stack([torch.randperm(experts // 2, generator=gen)[:top_k] for _ in range(tokens)]).to(torch.int32)
    if kind == "dropped":  # some ids outside [0, E): dispatch drops their pairs
        ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(torch.int32)
        ids[::3, 0] = -1
        ids[1::4, -1] = experts
        return ids
    raise ValueError(kind)


def _pack_buffers(tokens, top_k, experts, hidden, send_rows, shared, device):
    return dict(
        send_x=torch.full((send_rows + 3, hidden), SENTINEL, dtype=torch.bfloat16, device=device),
        send_counts=torch.full((experts,), SENTINEL, dtype=torch.int32, device=device),
        ret_row=torch.full((max(tokens, 1), top_k + (1 if shared else 0)), SENTINEL, dtype=torch.int32,
                           device=device),
    )


def _run_pack(impl, x, d, bufs, *, top_k, el, cap, send_rows, shared):
    t = x.shape[0]
    impl.ep_pack(x, d["inv_perm"], d["sorted_expert"], d["expert_offsets"], bufs["send_x"][:send_rows],
                 bufs["send_counts"], bufs["ret_row"][:t], top_k=top_k, num_local_experts=el, capacity_rows=cap,
                 shared_base=send_rows if shared else None)
    return bufs


@pytest.mark.parametrize("kind", ["random", "same_k", "peer0_only", "dropped"])
@pytest.mark.parametrize("world,experts,tokens", [(2, 12, 5), (4, 16, 9), (1, 8, 3), (2, 12, 0)])
@pytest.mark.parametrize("capacity", [True, False])
@pytest.mark.parametrize("shared", [True, False])
def test_pack_matches_reference(device, kind, world, experts, tokens, capacity, shared):
    top_k, hidden = 3, 40
    gen = torch.Generator().manual_seed(experts * 100 + tokens)
    ids = _routing(kind, tokens, experts, top_k, gen).view(tokens, top_k).to(device)
    d = moe_ops.dispatch(ids, experts, backend="torch")
    el = experts // world
    cap = tokens * top_k if capacity else 0
    send_rows = world * cap if capacity else tokens * top_k
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).to(device)
    got = _run_pack(kernels, x, d, _pack_buffers(tokens, top_k, experts, hidden, send_rows, shared, device),
                    top_k=top_k, el=el, cap=cap, send_rows=send_rows, shared=shared)
    want = _run_pack(reference, x, d, _pack_buffers(tokens, top_k, experts, hidden, send_rows, shared, device),
                     top_k=top_k, el=el, cap=cap, send_rows=send_rows, shared=shared)
    for name in got:
        assert torch.equal(got[name].cpu(), want[name].cpu()), name
    # the oracle from the definition: pair (t, j) of expert e goes to its peer's block in sorted order
    ids_cpu, ret = ids.cpu().long(), want["ret_row"].cpu()
    assert want["send_counts"].cpu().tolist() == [int((ids_cpu == e).sum()) for e in range(experts)]
    next_row = {}
    for e in range(experts):  # sorted order: by expert, then token
        peer = e // el
        for tok in range(tokens):
            for j in range(top_k):
                if int(ids_cpu[tok, j]) != e:
                    continue
                if capacity:
                    slot = peer * cap + next_row.get(peer, 0)
                    next_row[peer] = next_row.get(peer, 0) + 1
                else:
                    slot = next_row.get(0, 0)
                    next_row[0] = slot + 1
                assert int(ret[tok, j]) == slot
                assert torch.equal(want["send_x"][slot].cpu(), x[tok].cpu())
    dropped = (ids_cpu < 0) | (ids_cpu >= experts)
    if tokens:
        assert (ret[:tokens, :top_k][dropped] == -1).all()
        if shared:
            assert ret[:tokens, top_k].tolist() == [send_rows + tok for tok in range(tokens)]
    written = set(ret[:tokens, :top_k][~dropped].tolist()) if tokens else set()
    for r in range(send_rows + 3):  # every other send row keeps the sentinel
        if r not in written:
            assert (want["send_x"][r].cpu() == SENTINEL).all(), r


def _order_buffers(rows, el, device, guard=3):
    return dict(
        row_index=torch.full((rows + guard,), SENTINEL, dtype=torch.int32, device=device),
        back_index=torch.full((rows + guard,), SENTINEL, dtype=torch.int32, device=device),
        local_offsets=torch.full((el,), SENTINEL, dtype=torch.int32, device=device),
        row_expert=torch.full((rows + guard,), SENTINEL, dtype=torch.int64, device=device),
    )


def _run_order(impl, counts, bufs, rows, *, world, cap):
    impl.ep_local_order(counts, bufs["row_index"][:rows], bufs["back_index"][:rows], bufs["local_offsets"],
                        bufs["row_expert"][:rows], world_size=world, capacity_rows=cap)
    return bufs


def _counts(kind, world, el, cap, gen):
    if kind == "random":  # each source's rows sum to at most cap
        c = torch.zeros(world, el, dtype=torch.int64)
        for s in range(world):
            n = int(torch.randint(0, cap + 1, (1,), generator=gen))
            c[s] = torch.bincount(torch.randint(0, el, (n,), generator=gen), minlength=el)
        return c
    if kind == "one_block":
        c = torch.zeros(world, el, dtype=torch.int64)
        c[world - 1, el // 2] = cap
        return c
    if kind == "zero":
        return torch.zeros(world, el, dtype=torch.int64)
    if kind == "full":  # every source sends cap rows
        c = torch.zeros(world, el, dtype=torch.int64)
        for s in range(world):
            c[s] = torch.bincount(torch.randint(0, el, (cap,), generator=gen), minlength=el)
        return c
    raise ValueError(kind)


def _order_oracle(c, cap, rows):
    """Loops from the definition: expert-major positions, receive rows by source blocks."""
    world, el = c.shape
    base = [s * cap for s in range(world)] if cap else [int(c[:s].sum()) for s in range(world)]
    row_index, back_index, row_expert = [0] * rows, [0] * rows, [0] * rows
    q = 0
    offsets = []
    for expert in range(el):
        for s in range(world):
            start = base[s] + int(c[s, :expert].sum())
            for i in range(int(c[s, expert])):
                row_index[q], back_index[start + i], row_expert[q] = start + i, q, expert
                q += 1
        offsets.append(q)
    return row_index, back_index, offsets, row_expert


@pytest.mark.parametrize("kind", ["random", "one_block", "zero", "full"])
@pytest.mark.parametrize("world,experts,cap", [(2, 12, 9), (4, 16, 7), (1, 6, 5), (2, 384, 12)])
@pytest.mark.parametrize("capacity", [True, False])
def test_local_order_matches_reference_and_definition(device, kind, world, experts, cap, capacity):
    gen = torch.Generator().manual_seed(experts + cap)
    el = experts // world
    c = _counts(kind, world, el, cap, gen)
    rows = world * cap if capacity else int(c.sum())
    counts = c.reshape(-1).to(torch.int32).to(device)
    got = _run_order(kernels, counts, _order_buffers(rows, el, device), rows, world=world, cap=cap if capacity else 0)
    want = _run_order(reference, counts, _order_buffers(rows, el, device), rows, world=world,
                      cap=cap if capacity else 0)
    for name in got:
        assert torch.equal(got[name].cpu(), want[name].cpu()), name
    row_index, back_index, offsets, row_expert = _order_oracle(c, cap if capacity else 0, rows)
    assert want["row_index"][:rows].tolist() == row_index
    assert want["back_index"][:rows].tolist() == back_index
    assert want["local_offsets"].tolist() == offsets
    assert want["row_expert"][:rows].tolist() == row_expert
    for name in ("row_index", "back_index", "row_expert"):  # nothing past the buffers
        assert (want[name][rows:] == SENTINEL).all() and (got[name][rows:].cpu() == SENTINEL).all(), name


def test_local_order_inconsistent_counts_write_nothing_out_of_bounds(device):
    """Counts that exceed the capacity (a corrupted exchange): the kernel's stores stay inside the buffers."""
    world, el, cap = 2, 4, 3
    c = torch.tensor([[5, 0, 2, 1], [0, 9, 0, 0]], dtype=torch.int32)
    rows = world * cap
    bufs = _run_order(kernels, c.reshape(-1).to(device), _order_buffers(rows, el, device, guard=64), rows,
                      world=world, cap=cap)
    for name in ("row_index", "back_index", "row_expert"):
        assert (bufs[name][rows:].cpu() == SENTINEL).all(), name


def test_pack_without_tokens_writes_the_counts(device):
    experts, world, top_k = 8, 2, 2
    ids = torch.zeros((0, top_k), dtype=torch.int32, device=device)
    d = moe_ops.dispatch(ids, experts, backend="torch")
    x = torch.zeros((0, 16), dtype=torch.bfloat16, device=device)
    bufs = _run_pack(kernels, x, d, _pack_buffers(0, top_k, experts, 16, 4, False, device), top_k=top_k,
                     el=experts // world, cap=2, send_rows=4, shared=False)
    assert bufs["send_counts"].cpu().tolist() == [0] * experts
    assert (bufs["send_x"].cpu() == SENTINEL).all()
