"""Replay a captured indexer call in two arithmetic/backend arms and compare them.

An *arm* is ``precision[:backend]`` (``fp8``, ``bf16-serving:torch``, ``bf16:auto``); the
backend defaults to ``auto`` and is resolved by name through
:func:`sp_kpool.backends.resolve_backend`.

The package, by concern:

- :mod:`.load`: :class:`Capture`, :func:`load_capture`, :func:`load_capture_set` -- a capture
  file read back and validated, of any format version in :data:`FORMATS` (the writer is
  :mod:`sp_kpool.capture`, next to the indexer);
- :mod:`.arms`: :class:`Arm` and one arm's run on identical inputs (preparation, pools, ids);
- :mod:`.replay`: :func:`replay` -- both arms of a capture, compared (keys, pools, scores on the
  valid causal slots, Top-K pool sets, determinism); what is compared and how is described there;
- :mod:`.report`: :func:`format_table`, :func:`write_outputs` (a JSON-ready dict as
  ``parity.json``, the table as ``parity.txt``, two PNG plots: per-query Jaccard overlap vs
  position; histogram of ``log10 |A - B|`` over valid score slots);
- :mod:`.synthetic`: :func:`make_synthetic_capture`, random real-shaped capture files;
- :mod:`.rebuild`: :func:`~.rebuild.rebuild_indexer`, the ``KPoolIndexer`` of a capture.
"""

from __future__ import annotations

from .arms import Arm, gathered_inputs
from .load import FORMATS, Capture, CaptureError, load_capture, load_capture_set
from .replay import HIST_EDGES, replay, selected_pool_sets, stderr_progress
from .report import format_table, write_outputs
from .synthetic import make_synthetic_capture

__all__ = [
    "Arm",
    "replay",
    "format_table",
    "write_outputs",
    "make_synthetic_capture",
    "gathered_inputs",
    "selected_pool_sets",
    "stderr_progress",
    "HIST_EDGES",
    "Capture",
    "CaptureError",
    "FORMATS",
    "load_capture",
    "load_capture_set",
]
