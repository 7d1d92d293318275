"""Host-sync checks shared by the CUDA tests."""
import contextlib

import torch


@contextlib.contextmanager
def no_host_syncs():
    """Run the block with ``torch.cuda.set_sync_debug_mode("error")``: any host-device synchronisation in it
    (``.item()``, ``.cpu()``, a host branch on a device value, a blocking copy) raises. Restored on exit."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)
