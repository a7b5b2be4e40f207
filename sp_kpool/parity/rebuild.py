"""The module of a capture: a ``KPoolIndexer`` rebuilt from what one file stores.

Here, above the indexer and the capture code, so that the capture writer (which the
indexer imports) never imports the indexer back; the capture comes from :mod:`.load`.
"""

from __future__ import annotations

import torch

from ..indexer import KPoolIndexer
from .load import Capture

__all__ = ["rebuild_indexer"]


def rebuild_indexer(capture: Capture, device: torch.device | str = "cpu") -> KPoolIndexer:
    """A ``KPoolIndexer`` with the captured parameters (dtypes kept), config and options
    of ``capture``, on ``device``, that never captures (whatever the environment says)."""
    m, cfg, opts = capture.meta, capture.config(), capture.options()
    wq, wk = capture.params["wq_b.weight"], capture.params["wk.weight"]
    mod = KPoolIndexer(
        hidden_size=wk.shape[1], q_lora_rank=wq.shape[1], index_n_heads=m["heads"],
        index_head_dim=wk.shape[0], index_topk=cfg.topk, index_kpool=cfg.kpool,
        tail=cfg.tail, order=cfg.order, alignment=cfg.alignment, max_logits_bytes=cfg.max_logits_bytes,
        precision=cfg.precision, device="meta", capture_dir=None, **opts.record(),
    )  # fmt: skip
    mod._capture = None  # never re-capture a replay, whatever the environment says
    mod.load_state_dict({n: t.to(device) for n, t in capture.params.items()}, strict=True, assign=True)
    for name in mod.FP32_PARAMETERS:  # assign= takes the stored dtype (older captures: BF16, exact in FP32)
        p = mod.get_parameter(name)
        p.data = p.data.float()
    return mod.requires_grad_(False)
