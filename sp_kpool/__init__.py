"""sp_kpool: sequence-parallel GLM-5.3 KPool sparse-attention indexer.

Public API: :class:`ShardedSequence`, :func:`kpool_topk`, :class:`KPoolIndexer`.
Importing is silent and CPU-safe; optional GPU packages are probed lazily.
"""

from .api import kpool_topk
from .indexer import KPoolIndexer
from .sharding import ShardedSequence

__all__ = ["ShardedSequence", "kpool_topk", "KPoolIndexer", "__version__"]
__version__ = "0.1.0"
