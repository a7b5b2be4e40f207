"""Exact-arithmetic inputs: the tilelang backend's output equals the torch backend's bit for
bit (packed odd documents, shard offsets of 4- and 3-rank splits, 1 .. 131072 tokens, heavy
exact ties), both BF16 modes (gpu_check section ``tilelang-exact``)."""

import pytest
import torch

from sp_kpool.testing.gpu_checks import ids_of
from sp_kpool.testing.problems import rank_slice_problem

pytestmark = [pytest.mark.requires("tilelang"), pytest.mark.xdist_group("gpu")]

CASES = [
    # total, world, rank, H, D, lengths, topk
    (1, 1, 0, 16, 64, None, 2048),
    (4099, 4, 1, 16, 64, [1000, 1, 3, 2047, 1048], 64),
    (4099, 4, 3, 64, 64, [1000, 1, 3, 2047, 1048], 64),
    (20000, 4, 2, 64, 64, [19999, 1], 2048),
    (8193, 3, 2, 16, 64, None, 512),
    pytest.param(131072, 4, 3, 64, 64, None, 2048, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("precision", ("bf16", "bf16-serving"))
@pytest.mark.parametrize("total,ws,rank,H,D,lengths,topk", CASES)
def test_tilelang_equals_torch_exact_inputs(total, ws, rank, H, D, lengths, topk, precision):
    p = rank_slice_problem(total, ws, rank, heads=H, head_dim=D, topk=topk, exact=True, lengths=lengths,
                           precision=precision, max_logits_bytes=1 << 30)  # fmt: skip
    a = ids_of("tilelang", p)
    b = ids_of("torch", p)
    assert torch.equal(a, b), f"rows={a.shape[0]} differing_rows={int((a != b).any(1).sum())}"
