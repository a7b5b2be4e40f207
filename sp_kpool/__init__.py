"""sp_kpool: sequence-parallel GLM-5.3 KPool sparse-attention indexer.

Public API: :class:`ShardedSequence`, :func:`kpool_topk`, :class:`KPoolIndexer`, the
indexer's training loss :func:`indexer_kl_loss` with its teachers :class:`TokenMass` and
:class:`AttentionTeacher`, and the records :class:`KPoolConfig`, :class:`RunOptions` and :class:`Settings`.
Importing is silent and CPU-safe; optional GPU packages are probed lazily.
"""

from .api import kpool_topk
from .config import KPoolConfig, RunOptions
from .indexer import KPoolIndexer
from .settings import Settings
from .sharding import ShardedSequence
from .training import AttentionTeacher, TokenMass, indexer_kl_loss

# the modules that give a lower one a service at their import, imported whatever the user
# imports: comm gives ShardedSequence its collectives (from_positions, global_rows), the
# parity reader (parity.load) gives sp_kpool.capture the reader's names (Capture, ...)
from . import comm, parity  # noqa: F401  # isort: skip

__all__ = ["ShardedSequence", "kpool_topk", "KPoolIndexer", "KPoolConfig", "RunOptions", "Settings", "indexer_kl_loss", "TokenMass",
           "AttentionTeacher", "__version__"]
__version__ = "0.1.0"
