"""Issue 9 diagnostics: the attention kernel's blockwise bf16-P evaluation, i.e.
``megamoe.reference.attention.sparse_mqa_attention`` with ``p_rounding=(BLOCK_N, num_splits)`` for the device's
kernel config (``main_block_n``: 64 for v3 on V4's rows, else 32 on CUDA; 16 interpreted) and the split count the
kernel picks for the call's shapes
(``choose_num_splits``), as a drop-in for the op's signature. Used by diag_v4_attn_bf16p.py and
diag_v4_kernel_bisect.py."""
from megamoe.kernels import sparse_attention as KA
from megamoe.reference import attention as RA

RA_KW = ("window_kv", "window_idx", "entries_fp8", "entries_scale", "entries_rope", "block_table", "slots",
         "entry_idx", "out")


def mirror(q, attn_sink, softmax_scale, *, block_n=None, num_splits=None, **kw):
    interp = not q.is_cuda
    if block_n is None:
        nope = kw["entries_fp8"].shape[-1]
        block_n = KA.main_block_n(interpreter=interp, head_dim=q.shape[-1], rope_dim=q.shape[-1] - nope,
                                  scale_block=nope // kw["entries_scale"].shape[-1])
    if num_splits is None:
        num_splits = KA.choose_num_splits(q.shape[0], q.shape[1], kw["window_idx"].shape[1],
                                          kw["entry_idx"].shape[1], interpreter=interp, block_n=block_n)[0]
    return RA.sparse_mqa_attention(q, attn_sink, softmax_scale, p_rounding=(block_n, num_splits),
                                   **{k: v for k, v in kw.items() if k in RA_KW})
