"""Training the KPool indexer under sequence parallelism (``docs/contract.md`` section 13).

:func:`indexer_kl_loss` with a :class:`TokenMass` (sparse stage) or an
:class:`AttentionTeacher` (sparse or dense warm-up) teacher.
"""

from .loss import DETERMINISM, NORMALIZE, indexer_kl_loss
from .teachers import AttentionTeacher, TokenMass

__all__ = ["indexer_kl_loss", "TokenMass", "AttentionTeacher", "NORMALIZE", "DETERMINISM"]
