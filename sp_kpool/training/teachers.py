"""The teachers of the indexer's KL loss: the attention's mass on each candidate pool.

Two forms (``docs/contract.md`` section 13):

* :class:`TokenMass` (sparse stage only): the caller's head-summed attention probability of
  every selected id, column-aligned with the ids; a candidate pool's mass is the sum over
  the columns of its ``K`` ids.
* :class:`AttentionTeacher` (sparse or dense): the attention's own queries and keys (MQA or
  absorbed-MLA form) and the log-sum-exp of the attention that ran; a pool's mass is
  ``sum_h sum_{x in pool} exp(q_h(t) . k(x) * scale - lse_h(t))``, computed in chunks of
  rows and blocks of pools (never ``[S_local, P]`` at once), in ``max(FP32, q.dtype)``.

Neither receives gradients (teachers are detached, as in every public implementation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .._device import to_device
from ..checks import FLOAT_DTYPES, check_float_dtype, check_float_tensor
from ..comm import take_rows

__all__ = ["TokenMass", "AttentionTeacher"]


def _first_bad(mask: torch.Tensor) -> tuple[int, int]:
    r, c = (int(v) for v in torch.nonzero(mask)[0])
    return r, c


@dataclass(frozen=True)
class TokenMass:
    """Teacher mass per selected id (sparse stage).

    mass: ``[S_local, width]`` float, column-aligned with the selection's ids (this rank's
        rows, storage order): the head-summed attention probability of each id, finite and
        ``>= 0``, ``0`` where the id is ``-1``. Tail ids' mass is attended but scored by no
        pool: it is ignored (the candidates' mass is renormalised over the candidates).
    """

    mass: torch.Tensor

    def rows(self, selection: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor, storage: torch.Tensor) -> torch.Tensor:
        """This rank's real rows of ``mass`` (``[n, width]``, CPU), checked: ``ValueError`` /
        ``TypeError`` naming ``teacher.mass`` (shape and dtype against ``selection``; values
        finite, ``>= 0`` and ``0`` where ``ids``, the selection's rows ``storage``, are ``-1``)."""
        m = self.mass
        check_float_tensor("teacher.mass", m, tuple(selection.shape), selection.device)
        check_float_dtype("teacher.mass", m, FLOAT_DTYPES)
        mine = take_rows(m, storage).cpu()
        if not (bool(torch.isfinite(mine).all()) and (mine.numel() == 0 or float(mine.min()) >= 0)):
            bad = ~torch.isfinite(mine) | (mine < 0)
            r, c = _first_bad(bad)
            raise ValueError(f"teacher.mass: expected finite values >= 0, got {float(mine[r, c])} at local row "
                             f"{int(storage[r])} (real row {int(rows[r])}) column {c}")  # fmt: skip
        unused = torch.where(ids < 0, mine, 0)
        if unused.numel() and float(unused.max()) > 0:
            r, c = _first_bad(unused > 0)
            raise ValueError(f"teacher.mass: expected 0 where the selection's id is -1 (column-aligned with the "
                             f"ids), got {float(mine[r, c])} at local row {int(storage[r])} column {c}")  # fmt: skip
        return mine

    @staticmethod
    def candidate_mass(mine: torch.Tensor, col_slot: torch.Tensor, slots: int, dtype) -> torch.Tensor:
        """``[n, slots]``: each candidate's mass (the sum of its columns, in column order) from
        the rows ``mine`` of :meth:`rows` (``col_slot``: their columns' candidate slots)."""
        mine = mine.to(dtype)
        out = torch.zeros((mine.shape[0], slots + 1), dtype=dtype)
        out.scatter_add_(1, torch.where(col_slot >= 0, col_slot, slots), mine)
        return out[:, :slots]


@dataclass(frozen=True)
class AttentionTeacher:
    """The attention that ran, as the teacher (sparse or dense stage).

    q: ``[S_local, Hq, Dqk]`` float: this rank's attention queries (storage order).
    k: ``[N_real, Dqk]`` float: the whole sequence's attention keys in real-token order (MQA,
        or absorbed MLA: one key per token shared by the heads).
    lse: ``[S_local, Hq]`` float32 (or float64): each head's log-sum-exp of the attention
        that ran (sparse: over the selected tokens and the tail; dense: over all visible).
    scale: the softmax scale (``Dqk^-0.5`` or the model's).
    head_group: a process group (tensor parallelism) over which the heads are split: the
        head sum is all-reduced over it (its ranks hold the same rows).
    """

    q: torch.Tensor
    k: torch.Tensor
    lse: torch.Tensor
    scale: float
    head_group: Any = None

    def check(self, seq) -> None:
        S, N = seq.shard_size, seq.num_real_tokens
        check_float_tensor("teacher.q", self.q, (S, None, None), why="rows: seq.shard_size")
        Hq, Dqk = self.q.shape[1:]
        check_float_tensor("teacher.k", self.k, (N, Dqk), self.q.device,
                           why="rows: seq.num_real_tokens, the whole sequence in real-token order; Dqk: teacher.q")  # fmt: skip
        check_float_tensor("teacher.lse", self.lse, (S, Hq), self.q.device, why="rows: seq.shard_size; Hq: teacher.q")
        check_float_dtype("teacher.lse", self.lse, (torch.float32, torch.float64))
        for name in ("q", "k"):
            check_float_dtype(f"teacher.{name}", getattr(self, name), FLOAT_DTYPES)
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) or not (
                math.isfinite(self.scale) and self.scale > 0):  # fmt: skip
            raise ValueError(f"teacher.scale: expected a finite float > 0, got {self.scale!r}")
        rows = self.lse.index_select(0, to_device(seq.storage_index(), self.lse.device))
        bad = ~torch.isfinite(rows)
        if bool(bad.any()):
            r, c = _first_bad(bad.cpu())
            raise ValueError(f"teacher.lse: expected finite values in real rows, got {float(rows[r, c])} at local "
                             f"row {int(seq.storage_index()[r])} head {c}")  # fmt: skip

    def compute_dtype(self) -> torch.dtype:
        return torch.float64 if torch.float64 in (self.q.dtype, self.k.dtype, self.lse.dtype) else torch.float32

    def local_rows(self, storage: torch.Tensor, ct: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries and log-sum-exps of this rank's rows at ``storage`` in ``ct`` (at least
        the teacher's own compute type)."""
        ct = torch.float64 if torch.float64 in (ct, self.compute_dtype()) else torch.float32
        return take_rows(self.q, storage).to(ct), take_rows(self.lse, storage).to(ct)

    def _reduce_heads(self, m: torch.Tensor) -> torch.Tensor:
        if self.head_group is not None:
            import torch.distributed as dist

            dist.all_reduce(m, group=self.head_group)
        return m

    def sparse_mass(self, q: torch.Tensor, lse: torch.Tensor, tokens: torch.Tensor, kpool: int) -> torch.Tensor:
        """``[C, slots]``: the mass of each candidate pool (``tokens [C, slots * K]``: their
        token ids, any valid id where the slot is empty; the caller masks those)."""
        ct = q.dtype
        keys = self.k.index_select(0, to_device(tokens.reshape(-1), self.k.device)).to(ct)
        keys = keys.view(tokens.shape[0], tokens.shape[1], -1)
        logits = torch.bmm(q, keys.transpose(1, 2)).mul_(self.scale).sub_(lse[:, :, None])  # [C, Hq, slots * K]
        m = logits.exp_().sum(dim=1).view(tokens.shape[0], -1, kpool).sum(dim=2)
        return self._reduce_heads(m)

    def dense_mass(self, q: torch.Tensor, lse: torch.Tensor, pool_tok_start: torch.Tensor, kpool: int,
                   block: int, ws=None) -> torch.Tensor:  # fmt: skip
        """``[C, N]``: the mass of pools ``pool_tok_start [N]`` for the chunk's rows, streamed
        over blocks of ``block`` pools (``C * Hq * block * K`` scratch values). Pools a row
        cannot see hold anything (even ``inf``): the caller masks them. ``ws``: a
        :class:`~sp_kpool.training.student.Workspace` for the logits."""
        ct, (C, Hq, Dqk) = q.dtype, q.shape
        n = pool_tok_start.numel()
        out = q.new_empty((C, n))
        flat = q.reshape(C * Hq, Dqk)
        slots = torch.arange(kpool)
        for a in range(0, n, block):
            b = min(n, a + block)
            tok = (pool_tok_start[a:b, None] + slots).reshape(-1)
            keys = self.k.index_select(0, to_device(tok, self.k.device)).to(ct)
            buf = None if ws is None else ws.get("teacher", (C * Hq, keys.shape[0]), ct, q.device)
            logits = torch.mm(flat, keys.t(), out=buf).view(C, Hq, -1).mul_(self.scale).sub_(lse[:, :, None])
            out[:, a:b] = logits.exp_().sum(dim=1).view(C, b - a, kpool).sum(dim=2)
        return self._reduce_heads(out)
