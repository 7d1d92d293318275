"""Shared by the device index guard tests (issue 12): run an op on both CPU backends and read the error word."""
from megamoe.ops import errors


def on_both_backends(monkeypatch, fn):
    """fn() on the Triton path (interpreter) and on the torch path, each from a clean CPU error word:
    [(result, word)] in that order; the word is left clean."""
    out = []
    for flag in ("1", "0"):
        monkeypatch.setenv("TRITON_INTERPRET", flag)
        errors.clear_errors("cpu")
        result = fn()
        out.append((result, errors.peek_errors("cpu")))
    errors.clear_errors("cpu")
    return out
