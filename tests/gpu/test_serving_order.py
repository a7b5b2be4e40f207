"""order='serving' (LMDeploy's selector order, compact tail; gpu_check section
``serving-order``): a valid layout (invariants), and the same sets as the exact rule except
at exact ties (at least 99.9% of the rows). Needs lmdeploy: gpu_check's section crashed
(a failure) without it; here the tests are skipped, naming it."""

import dataclasses

import pytest
import torch

from sp_kpool.testing.gpu_checks import ids_of
from sp_kpool.testing.invariants import check_invariants
from sp_kpool.testing.problems import rank_slice_problem

pytestmark = pytest.mark.xdist_group("gpu")
ARMS = [pytest.param("tilelang", "bf16", marks=pytest.mark.requires("tilelang", "lmdeploy")),
        pytest.param("deepgemm", "fp8", marks=pytest.mark.requires("deep_gemm", "triton", "lmdeploy"))]  # fmt: skip


@pytest.mark.parametrize("name,precision", ARMS)
def test_serving_order_sets_equal_exact_rule(name, precision):
    p = rank_slice_problem(16384, 4, 3, heads=64, head_dim=128, topk=2048, precision=precision, seed=5,
                           tail="compact", order="serving")  # fmt: skip
    srv = ids_of(name, p)
    ref = ids_of(name, dataclasses.replace(p, config=p.config.replace(order="score")))
    check_invariants(srv.cpu(), p.seq, topk=2048, kpool=4, tail="compact")
    big = torch.iinfo(torch.int32).max
    same = (torch.sort(srv.masked_fill(srv < 0, big), 1).values == torch.sort(ref.masked_fill(ref < 0, big), 1).values).all(1)
    differ_order = int((srv != ref).any(1).sum())
    assert float(same.float().mean()) >= 0.999, (
        f"rows={srv.shape[0]} rows_same_set={int(same.sum())} rows_in_another_order={differ_order}")  # fmt: skip
