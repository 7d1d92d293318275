"""Test-suite set-up.

Without a GPU, kernel tests run through the Triton interpreter, so
``TRITON_INTERPRET=1`` is set here, before anything imports ``triton``.
Tests marked ``cuda`` are skipped when no CUDA device is present.
"""
import os
import random
import zlib

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    # Define every Triton kernel for the GPU now. ``triton.jit`` reads TRITON_INTERPRET when a kernel is defined, so a
    # kernel module first imported inside a CPU test that sets it (tests/guard_helpers.set_interpret) would otherwise
    # stay interpreted for the rest of the session, and the CUDA tests after it would run the interpreter.
    import importlib  # noqa: E402
    import pkgutil  # noqa: E402

    import megamoe.kernels  # noqa: E402

    for _module in pkgutil.walk_packages(megamoe.kernels.__path__, "megamoe.kernels."):
        importlib.import_module(_module.name)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    """The device kernel tests run on: CUDA when present, else CPU (interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# Fresh random inputs on every run; set MEGAMOE_TEST_SEED to replay a run.
RUN_SEED = int(os.environ.get("MEGAMOE_TEST_SEED", random.randrange(2**31)))


def pytest_report_header(config):
    return f"megamoe test seed: MEGAMOE_TEST_SEED={RUN_SEED}"


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    """Seed torch from the run seed and the test's node id."""
    torch.manual_seed(RUN_SEED ^ zlib.crc32(request.node.nodeid.encode()))
    yield


@pytest.fixture(autouse=True)
def _clear_error_words():
    """Each test starts with clean device error words (megamoe/ops/errors.py: process-wide state)."""
    from megamoe.ops import errors

    for word in errors._WORDS.values():
        word.zero_()
    yield
