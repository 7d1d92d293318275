"""benchmarks/graph_timing.py's flush_mode: ``do_bench`` clears the L2 through the active driver's ``clear_cache``;
"read" swaps it for a reading flush inside the block and puts the driver's own back after it (also on an error),
"write" leaves it alone, anything else is refused. CPU: a stand-in driver (no GPU needed)."""
import importlib
import os
import sys

import pytest
import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
graph_timing = importlib.import_module("graph_timing")


class _Driver:
    def __init__(self):
        self.zeroed = 0

    def clear_cache(self, cache):
        self.zeroed += 1
        cache.zero_()


@pytest.fixture
def driver(monkeypatch):
    stand_in = _Driver()
    monkeypatch.setattr(triton.runtime.driver, "_active", stand_in)
    return stand_in


def test_read_flush_reads_and_restores(driver):
    cache = torch.arange(8, dtype=torch.int32)
    own = driver.clear_cache
    with graph_timing.flush_mode("read"):
        assert triton.runtime.driver.active.clear_cache is not own
        triton.runtime.driver.active.clear_cache(cache)
        assert torch.equal(cache, torch.arange(8, dtype=torch.int32)) and driver.zeroed == 0  # read, not zeroed
    assert triton.runtime.driver.active.clear_cache == own
    with pytest.raises(RuntimeError):
        with graph_timing.flush_mode("read"):
            raise RuntimeError("inside")
    assert triton.runtime.driver.active.clear_cache == own


def test_write_flush_is_do_bench_own(driver):
    cache = torch.ones(4, dtype=torch.int32)
    with graph_timing.flush_mode("write"):
        triton.runtime.driver.active.clear_cache(cache)
    assert driver.zeroed == 1 and not cache.any()


def test_unknown_flush_mode_is_refused(driver):
    with pytest.raises(ValueError, match="mode"):
        with graph_timing.flush_mode("none"):
            pass


def test_use_flush_mode_and_the_flush_option(driver):
    import argparse

    graph_timing.use_flush_mode("read")  # for the rest of a script (the stand-in driver is undone by monkeypatch)
    assert triton.runtime.driver.active.clear_cache is graph_timing.read_cache
    parser = argparse.ArgumentParser()
    graph_timing.add_flush_argument(parser, default="read")
    assert parser.parse_args([]).flush == "read" and parser.parse_args(["--flush", "write"]).flush == "write"
    with pytest.raises(SystemExit):
        parser.parse_args(["--flush", "none"])
