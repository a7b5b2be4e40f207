"""DeepGEMM (gpu_check section ``deepgemm``): its MQA API found, legacy/compact logits vs the
dequantized torch reference (DeepGEMM's normalized error on the valid causal slots, -inf
outside in the legacy layout), the real logits storage of short unaligned chunks within
the budget in both layouts, the fp8 indexer vs the torch fp8 backend (near-ties only) and
repeated runs bitwise identical."""

import dataclasses

import pytest
import torch

from sp_kpool import serving, serving_scores
from sp_kpool.backends import BACKENDS
from sp_kpool.pooling import pool_table
from sp_kpool.selection import row_meta
from sp_kpool.testing.gpu_checks import fp8_row_scores, ids_of, near_tie_rows
from sp_kpool.testing.problems import rank_slice_problem

pytestmark = [pytest.mark.requires("deep_gemm", "triton"), pytest.mark.xdist_group("gpu")]
LAYOUTS = ("legacy", "compact")
INDEXER_CASES = [(8195, [4000, 3, 4192]), (16384, None), pytest.param(65536, None, marks=pytest.mark.slow)]


def _api(layout=None):
    from sp_kpool.backends.deepgemm_backend import legacy_alignment, mqa_api

    fn, layouts = mqa_api()
    if layout is not None and layout not in layouts:
        pytest.skip(f"this deep_gemm offers the layouts {list(layouts)}, not {layout!r}")
    return fn, layouts, legacy_alignment(0)


def test_api():
    fn, layouts, _ = _api()
    assert callable(fn) and len(layouts) > 0, (fn, layouts)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("H", (32, 64))
def test_logits_vs_dequantized_reference(H, layout):
    from sp_kpool.kernels.triton_serving import pools_serving, queries_fp8

    fn, _, _ = _api(layout)
    p = rank_slice_problem(8192, 4, 3, heads=H, head_dim=128, topk=2048, precision="fp8", seed=3)
    st, offs = pool_table(p.seq.real_cu_seq_lens, 4)
    k8, ks = pools_serving(p.k, p.gates, p.ape, st.cuda(), fp8=True)
    q8, wq = queries_fp8(p.q, p.head_weights)
    ref = serving_scores.mqa_logits_fp8_reference(q8, wq, k8, ks)
    m = row_meta(torch.arange(p.seq.shard_start, p.seq.shard_end), p.seq.real_cu_seq_lens, offs, 4)
    s, e = m.pool_lo.int().cuda(), m.pool_hi.int().cuda()
    cols = torch.arange(k8.shape[0], device="cuda")
    valid = (cols[None] >= s[:, None]) & (cols[None] < e[:, None])
    if layout == "legacy":
        lg = fn(q8, (k8, ks), wq, s, e, clean_logits=True)[:, : k8.shape[0]]
    else:
        width = int((e - s).max())
        raw = fn(q8, (k8, ks), wq, s, e, clean_logits=False, max_seqlen_k=width)[:, :width]
        lg = torch.full_like(ref, -float("inf"))
        ok_c = torch.arange(width, device="cuda")[None] < (e - s)[:, None]
        ri, ci = ok_c.nonzero(as_tuple=True)
        lg[ri, s[ri].long() + ci] = raw[ri, ci]
    x, y = lg[valid].double(), ref[valid].double()
    rel = float((x - y).norm() / y.norm())
    calc_diff = float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())  # DeepGEMM's normalized error
    info = f"normalized_error_calc_diff={calc_diff} relative_l2={rel} valid_slots={int(valid.sum())}"
    if layout == "compact" and not calc_diff <= 5e-6:
        r = int(valid.sum(1).argmax())
        n = int(e[r] - s[r])
        info += (f"; row {r} s={int(s[r])} e={int(e[r])} raw[:4]={raw[r, :4].tolist()} "
                 f"raw[n-2:n+2]={raw[r, max(0, n - 2):n + 2].tolist()} ref[s:s+4]={ref[r, int(s[r]):int(s[r]) + 4].tolist()} "
                 f"ref[:4]={ref[r, :4].tolist()} shape={tuple(raw.shape)} width={width}")  # fmt: skip
    assert calc_diff <= 5e-6, info
    if layout == "legacy":
        assert bool(torch.isneginf(lg[~valid]).all()), "legacy layout: cells outside the row ranges not -inf; " + info


@pytest.mark.parametrize("rows,budget", [(204, 2**20), (37, 2**20), (4096, 64 * 2**20)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_budget_short_unaligned_chunks(layout, rows, budget):
    from sp_kpool.backends.base import QueryInputs
    from sp_kpool.backends.deepgemm_logits import logits_bytes
    from sp_kpool.settings import Settings

    _, _, a = _api(layout)
    p = rank_slice_problem(4096, 1, 0, heads=32, head_dim=128, topk=2048, precision="fp8", max_logits_bytes=budget)
    p = dataclasses.replace(p, settings=Settings(mqa_layout=layout))
    be = BACKENDS["deepgemm"]
    st = pool_table(p.seq.real_cu_seq_lens, 4)[0].cuda()
    pooled = be.pools(p, st)
    n = st.numel()
    C = min(rows, be.chunk_rows(p, n))
    z = torch.zeros(C, dtype=torch.int32, device="cuda")
    _, queries = be.prepare(p, None, QueryInputs(p.q[:C], p.head_weights[:C], 0))
    try:
        be.score(p, pooled, queries.q, queries.w, 0, n, z, z + n)
    except RuntimeError as exc:
        pytest.fail(f"rows={C} budget={budget} predicted={logits_bytes(C, n, 32, layout, a)}: {exc}")


def _indexer(cache, H, total, lengths, prompt_fraction=0.0):
    key = (H, total, prompt_fraction)
    if key not in cache:
        p = rank_slice_problem(total, 4, 3, heads=H, head_dim=128, topk=2048, lengths=lengths, precision="fp8", seed=H,
                               prompt_fraction=prompt_fraction)  # fmt: skip
        cache[key] = p, ids_of("deepgemm", p)
    return cache[key]


@pytest.mark.parametrize("prompt_fraction", [0.0, 0.9])  # 0.9: the serving schedule, most pools in extend order
@pytest.mark.parametrize("total,lengths", INDEXER_CASES)
@pytest.mark.parametrize("H", (32, 64))
def test_fp8_indexer_vs_torch_fp8(cache, H, total, lengths, prompt_fraction):
    from sp_kpool.pooling import extend_pools

    p, x = _indexer(cache, H, total, lengths, prompt_fraction)
    y = ids_of("torch", p)
    st = pool_table(p.seq.real_cu_seq_lens, 4)[0].cuda()
    ext = extend_pools(p.seq.real_cu_seq_lens, p.seq.prompt_lens, 4).cuda() if p.seq.prompt_lens else None
    k8, ks = BACKENDS["torch"].pools(p, st, ext).parts()
    q8, wq = serving.prepare_queries_fp8(p.q, p.head_weights)
    # DeepGEMM's FP8 tensor-core accumulation differs from an FP32 one by ~1e-4 relative
    ndiff, bad = near_tie_rows(p, x, y, fp8_row_scores(q8, wq, k8, ks), rel_tol=1e-3)
    assert not bad, f"rows={x.shape[0]} differing_rows={ndiff} beyond_near_tie={bad[:5]}"


@pytest.mark.parametrize("total,lengths", INDEXER_CASES)
@pytest.mark.parametrize("H", (32, 64))
def test_repeat_bitwise(cache, H, total, lengths):
    p, x = _indexer(cache, H, total, lengths)
    assert torch.equal(x, ids_of("deepgemm", p))
