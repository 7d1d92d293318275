"""Shared by the device index guard tests (issue 12): run an op on both CPU backends and read the error word."""
import os

import pytest

from megamoe.ops import errors

# Whether ``triton.jit`` kernels are interpreted in this process: decided when they are defined, from
# TRITON_INTERPRET at import (tests/conftest.py sets it where no GPU is). A GPU machine compiles them for the GPU,
# and setting the variable later does not turn them back into interpreted functions.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def require_interpreter() -> None:
    """Skip a test that runs CPU tensors through Triton kernels where they are compiled for a GPU instead."""
    if not INTERPRETED:
        pytest.skip("runs CPU tensors through the Triton interpreter, which is on only without a GPU (conftest)")


def set_interpret(monkeypatch, value: str) -> None:
    """``TRITON_INTERPRET=value`` for this test (the ops' choice of the Triton or the torch path); "1" skips the test
    where the kernels are compiled for a GPU (:func:`require_interpreter`)."""
    if value not in ("", "0"):
        require_interpreter()
    monkeypatch.setenv("TRITON_INTERPRET", value)


def on_both_backends(monkeypatch, fn):
    """fn() on the Triton path (interpreter) and on the torch path, each from a clean CPU error word:
    [(result, word)] in that order; the word is left clean. Skips where the interpreter is off (a GPU machine)."""
    out = []
    for flag in ("1", "0"):
        set_interpret(monkeypatch, flag)
        errors.clear_errors("cpu")
        result = fn()
        out.append((result, errors.peek_errors("cpu")))
    errors.clear_errors("cpu")
    return out
