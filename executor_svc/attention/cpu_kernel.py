"""The C++ paged attention kernels (decode, K/V store, AMX prefill) of the installed pagoda-kernels.

They are built ahead of time (``make install``; see executor_svc/native);
nothing here compiles. ``load()`` returns ``torch.ops.pagoda``, whose
``paged_decode``, ``store_kv`` and ``paged_prefill`` the C++ backend calls.
"""

from __future__ import annotations

from executor_svc.native import loader


def is_built() -> bool:
    """True when the kernels are installed and load in this process (logs once why not)."""
    return loader.kernels() is not None


def load():
    """``torch.ops.pagoda`` of the loaded kernels.

    Raises:
        RuntimeError: they are not installed or do not load here (the message says why).
    """
    return loader.ops()
