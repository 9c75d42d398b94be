"""The KV offload tier (docs/kv-offload.md): full KV blocks kept in host memory and on disk, across restarts."""

from executor_svc.kv.tier.block_file import BadBlock, TierNamespace
from executor_svc.kv.tier.dir_lock import TierDirBusy
from executor_svc.kv.tier.store import TierStats, TierStore

__all__ = ["BadBlock", "TierDirBusy", "TierNamespace", "TierStats", "TierStore"]
