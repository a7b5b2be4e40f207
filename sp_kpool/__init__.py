"""sp_kpool: sequence-parallel GLM-5.3 KPool sparse-attention indexer.

Public API: :class:`ShardedSequence`, :func:`kpool_topk`, :class:`KPoolIndexer`, and the
records :class:`KPoolConfig`, :class:`RunOptions` and :class:`Settings`.
Importing is silent and CPU-safe; optional GPU packages are probed lazily.
"""

from .api import kpool_topk
from .config import KPoolConfig, RunOptions
from .indexer import KPoolIndexer
from .settings import Settings
from .sharding import ShardedSequence

__all__ = ["ShardedSequence", "kpool_topk", "KPoolIndexer", "KPoolConfig", "RunOptions", "Settings", "__version__"]
__version__ = "0.1.0"
