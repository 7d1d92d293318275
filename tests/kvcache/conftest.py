"""kvcache tests run many tiny tensor ops; with intra-op threads on a loaded 2-core CI machine they spend
most of their time in thread hand-offs (a 200-step parity run: 0.7 s on one thread, ~20 s on two under
load). Each test here runs single-threaded; the previous setting is restored afterwards."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
