"""Logits memory of DeepGEMM-style MQA scoring (contract §8), and the chunking it implies.

``fp8_mqa_logits`` pads query rows to a multiple of ``128 / H`` and allocates FP32 logits
with a row stride that depends on the column layout:

* ``"compact"`` (request-local columns, ``max_seqlen_k = N``): stride ``align(N, 256)``;
* ``"legacy"`` (absolute columns): stride ``align(N + 256, a)`` with guard columns
  (``a`` probed from the installed build; 64 or less on the measured one).

Worked example (legacy, ``a`` = 64): 1024 pools, 32 heads, budget 1 MiB ->
stride 1280, a 256-row chunk would need 1,310,720 bytes; 204 rows need 1,044,480.
"""

from __future__ import annotations

__all__ = ["align", "logits_stride", "logits_bytes", "logits_chunk_rows"]


def align(x: int, a: int) -> int:
    """``x`` rounded up to a multiple of ``a``."""
    return -(-x // a) * a


def logits_stride(n_cols: int, layout: str, legacy_align: int = 64) -> int:
    """Row stride (elements) of the logits for ``n_cols`` columns."""
    if layout == "compact":
        return align(n_cols, 256)
    if layout == "legacy":
        return align(n_cols + 256, legacy_align)
    raise ValueError(f"layout: expected 'compact' or 'legacy', got {layout!r}")


def logits_bytes(rows: int, n_cols: int, heads: int, layout: str, legacy_align: int = 64) -> int:
    """Bytes of the FP32 logits storage: ``align(rows, 128 / H) * stride * 4``."""
    return align(rows, max(1, 128 // heads)) * logits_stride(n_cols, layout, legacy_align) * 4


def logits_chunk_rows(budget: int, n_cols: int, heads: int, layout: str, legacy_align: int = 64) -> int:
    """The most query rows whose logits storage fits ``budget`` bytes (at least 1 row
    must fit, else ``ValueError`` naming the budget and the one-row size)."""
    one = logits_bytes(1, n_cols, heads, layout, legacy_align)
    if one > budget:
        raise ValueError(
            f"max_logits_bytes: expected at least {one} (one padded row group of {max(1, 128 // heads)} rows x "
            f"{logits_stride(n_cols, layout, legacy_align)} FP32 columns, {layout} layout), got {budget}"
        )
    rows = budget // (logits_stride(n_cols, layout, legacy_align) * 4)
    while logits_bytes(rows, n_cols, heads, layout, legacy_align) > budget:
        rows -= 1  # ends at >= 1: one row (padded to a row group) fits, checked above
    return rows
