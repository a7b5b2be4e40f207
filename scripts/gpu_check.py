"""GPU correctness checks of the GPU backends (run on a Hopper GPU; records JSON).

    python scripts/gpu_check.py [--quick] [--out DIR]

Sections (each reports PASS/FAIL with numbers; exit status 1 if any FAILs):
  serving-kernels  Triton pools (fp8 values+scales, bf16-serving) and queries bitwise equal
                   to the torch serving implementation on the same GPU
  tilelang-exact   exact-arithmetic inputs: tilelang backend output == torch backend output
                   bit for bit (packed odd documents, shard offsets of a 4-rank split,
                   1 .. 131072 tokens, heavy exact ties), both BF16 modes
  tilelang-random  random inputs, H 32/64, D 128, topk 2048, kpool 4: differing rows are
                   near-ties only (float64 scores); repeated runs bitwise identical
  deepgemm         legacy/compact logits vs the dequantized torch reference (normalized error
                   on valid causal slots), real logits storage within the budget (also a
                   short unaligned chunk), fp8 indexer vs the torch fp8 backend (near-ties
                   only), repeat bitwise identical
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from sp_kpool import serving  # noqa: E402
from sp_kpool.backends import BACKENDS  # noqa: E402
from sp_kpool.pooling import pool_table  # noqa: E402
from sp_kpool.selection import row_meta  # noqa: E402
from sp_kpool.testing.problems import rank_slice_problem  # noqa: E402

RESULTS: dict = {"sections": {}}
FAILS: list[str] = []


def log(msg):
    print(msg, flush=True)


def record(section, name, ok, **info):
    RESULTS["sections"].setdefault(section, []).append({"check": name, "ok": bool(ok), **info})
    log(f"[{section}] {'PASS' if ok else 'FAIL'} {name} {json.dumps(info, default=str)}")
    if not ok:
        FAILS.append(f"{section}:{name}")


def versions():
    v = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "python": platform.python_version(), "torch": torch.__version__,
         "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0)}  # fmt: skip
    for mod in ("triton", "tilelang", "deep_gemm", "lmdeploy", "transformers"):
        try:
            m = __import__(mod)
            v[mod] = getattr(m, "__version__", "?")
        except Exception as exc:  # noqa: BLE001
            v[mod] = f"unavailable ({type(exc).__name__})"
    return v


def near_tie_rows(problem, out_a, out_b, row_scores, rel_tol=1e-5):
    """Rows whose selected token sets differ beyond a near-tie: every swapped pool's float64
    score (``row_scores(r, lo, hi)`` -> ``[hi - lo]``) must lie within ``rel_tol * max|s|``
    of the selection boundary."""
    seq, K = problem.seq, problem.kpool
    diff = torch.nonzero((torch.sort(out_a, dim=1).values != torch.sort(out_b, dim=1).values).any(1)).flatten()
    starts, offs = pool_table(seq.real_cu_seq_lens, K)
    starts = starts.to(out_a.device)
    bad = []
    for r in diff.tolist():
        t = seq.shard_start + r
        m = row_meta(torch.tensor([t]), seq.real_cu_seq_lens, offs, K)
        lo, hi = int(m.pool_lo[0]), int(m.pool_hi[0])
        sc = row_scores(r, lo, hi)
        ranked = torch.sort(sc, descending=True).values
        kk = min(problem.topk // K, hi - lo)
        boundary = float(ranked[kk - 1])
        tol = rel_tol * float(sc.abs().max()) + 1e-9
        to_pool = {int(s): i for i, s in enumerate(starts[lo:hi].tolist())}
        sa = {to_pool[v] for v in out_a[r].tolist() if v in to_pool}
        sb = {to_pool[v] for v in out_b[r].tolist() if v in to_pool}
        if any(abs(float(sc[p]) - boundary) > tol for p in sa ^ sb):
            bad.append(t)
    return diff.numel(), bad


def bf16_row_scores(problem, pooled):
    H, D = problem.heads, problem.head_dim
    pk = pooled.double()

    def f(r, lo, hi):
        sc = torch.relu(problem.q[r].double() @ pk[lo:hi].t() * D**-0.5)
        return (problem.head_weights[r].double() * H**-0.5) @ sc

    return f


def fp8_row_scores(q8, wq, k8, ks):
    kd, qd = k8.double(), q8.double()

    def f(r, lo, hi):
        return ks[lo:hi].double() * (wq[r].double() @ torch.relu(qd[r] @ kd[lo:hi].t()))

    return f


def section_serving_kernels(quick):
    from sp_kpool.kernels.triton_serving import pools_serving, queries_fp8

    for S, D, K in [(4099, 128, 4), (1000, 64, 1), (777, 128, 16), (4096 if quick else 131072, 128, 4)]:
        g = torch.Generator(device="cuda").manual_seed(S)
        k = torch.randn(S, D, generator=g, device="cuda").bfloat16()
        gates = (torch.randn(S, D, generator=g, device="cuda") * 3).bfloat16()
        ape = torch.randn(K, D, generator=g, device="cuda").bfloat16()
        starts, _ = pool_table(torch.tensor([0, S // 3, S]), K)
        starts = starts.cuda()
        k8, ks = pools_serving(k, gates, ape, starts, fp8=True)
        r8, rs = serving.prepare_pools_fp8(k, gates, ape, starts)
        ok = torch.equal(k8.view(torch.uint8), r8.view(torch.uint8)) and torch.equal(ks, rs)
        nbad = int((k8.view(torch.uint8) != r8.view(torch.uint8)).sum())
        record("serving-kernels", f"fp8 pools S={S} D={D} K={K}", ok, pools=starts.numel(), differing_values=nbad,
               differing_scales=int((ks != rs).sum()))  # fmt: skip
        pb = pools_serving(k, gates, ape, starts, fp8=False)
        rb = serving.prepare_pools_bf16_serving(k, gates, ape, starts)
        record("serving-kernels", f"bf16-serving pools S={S} D={D} K={K}", torch.equal(pb.view(torch.int16), rb.view(torch.int16)),
               differing=int((pb.view(torch.int16) != rb.view(torch.int16)).sum()))  # fmt: skip
    # D 128 runs the register kernel, other D (and generic=True) the generic one
    for S, H, D, generic in [(37, 16, 64, False), (37, 16, 128, False), (4096, 64, 128, False), (1000, 32, 128, False),
                             (4096, 64, 128, True)]:  # fmt: skip
        g = torch.Generator(device="cuda").manual_seed(H)
        q = torch.randn(S, H, D, generator=g, device="cuda").bfloat16()
        w = torch.randn(S, H, generator=g, device="cuda").bfloat16()
        if S == 37:  # wide dynamic range: rounding in the butterflies, tiny and huge scales
            q = (q.float() * torch.exp2(torch.randint(-30, 30, (S, H, 1), generator=g, device="cuda").float())).bfloat16()
        q8, wq = queries_fp8(q, w, generic=generic)
        r8, rw = serving.prepare_queries_fp8(q, w)
        ok = torch.equal(q8.view(torch.uint8), r8.view(torch.uint8)) and torch.equal(wq, rw)
        record("serving-kernels", f"fp8 queries S={S} H={H} D={D} generic={generic}", ok,
               differing_values=int((q8.view(torch.uint8) != r8.view(torch.uint8)).sum()), differing_weights=int((wq != rw).sum()))  # fmt: skip
        # zero rows written around the prepared ones (the driver's chunk grid): before /
        # after rows that are whole programs of zeros, and ones that share a program
        for before, after in [(3, 5), (1000, 0), (0, 777)]:
            p8, pw = queries_fp8(q, w, generic=generic, before=before, after=after)
            z8, zw = serving.prepare_queries_fp8(torch.zeros_like(q[:1]), torch.zeros_like(w[:1]))
            ok = (p8.shape[0] == pw.shape[0] == before + S + after
                  and torch.equal(p8[before : before + S].view(torch.uint8), r8.view(torch.uint8))
                  and torch.equal(pw[before : before + S], rw)
                  and bool((p8[:before].view(torch.uint8) == z8.view(torch.uint8)).all())
                  and bool((p8[before + S :].view(torch.uint8) == z8.view(torch.uint8)).all())
                  and bool((pw[:before] == zw).all()) and bool((pw[before + S :] == zw).all())
                  and int(z8.view(torch.uint8).max()) == 0 and int(zw.abs().max()) == 0)  # fmt: skip
            record("serving-kernels", f"fp8 queries S={S} H={H} D={D} generic={generic} zero rows {before}+{after}", ok)
    # pools and queries in one launch (the deepgemm backend's driver path; D 64 takes the
    # two kernels): the same bits as the torch implementation, zero rows around the queries
    from sp_kpool.kernels.triton_serving import prepare_fp8

    for S, H, D, K, before, after in [(4099, 32, 128, 4, 3, 5), (1000, 64, 128, 16, 0, 0), (4096, 64, 128, 4, 1000, 777),
                                      (777, 16, 64, 4, 2, 2)]:  # fmt: skip
        g = torch.Generator(device="cuda").manual_seed(S + H)
        k = torch.randn(S, D, generator=g, device="cuda").bfloat16()
        gates = (torch.randn(S, D, generator=g, device="cuda") * 3).bfloat16()
        ape = torch.randn(K, D, generator=g, device="cuda").bfloat16()
        q = torch.randn(S, H, D, generator=g, device="cuda").bfloat16()
        w = torch.randn(S, H, generator=g, device="cuda").bfloat16()
        starts = pool_table(torch.tensor([0, S // 3, S]), K)[0].cuda()
        (k8, ks), (q8, wq) = prepare_fp8(q, w, k, gates, ape, starts, before=before, after=after)
        r8, rs = serving.prepare_pools_fp8(k, gates, ape, starts)
        z = torch.zeros(before + S + after, H, D, dtype=q.dtype, device="cuda")
        zw = torch.zeros(before + S + after, H, dtype=w.dtype, device="cuda")
        z[before : before + S], zw[before : before + S] = q, w
        p8, pw = serving.prepare_queries_fp8(z, zw)
        ok = (torch.equal(k8.view(torch.uint8), r8.view(torch.uint8)) and torch.equal(ks, rs)
              and torch.equal(q8.view(torch.uint8), p8.view(torch.uint8)) and torch.equal(wq, pw))  # fmt: skip
        record("serving-kernels", f"prepare_fp8 S={S} H={H} D={D} K={K} zero rows {before}+{after}", ok,
               one_launch=D == 128, pools=starts.numel(),
               differing_pool_values=int((k8.view(torch.uint8) != r8.view(torch.uint8)).sum()),
               differing_query_values=int((q8.view(torch.uint8) != p8.view(torch.uint8)).sum()))  # fmt: skip


def _run(name, problem):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = BACKENDS[name].run(problem)
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def section_tilelang_exact(quick):
    cases = [
        # total, world, rank, H, D, lengths, topk
        (1, 1, 0, 16, 64, None, 2048),
        (4099, 4, 1, 16, 64, [1000, 1, 3, 2047, 1048], 64),
        (4099, 4, 3, 64, 64, [1000, 1, 3, 2047, 1048], 64),
        (20000, 4, 2, 64, 64, [19999, 1], 2048),
        (8193, 3, 2, 16, 64, None, 512),
    ]
    if not quick:
        cases.append((131072, 4, 3, 64, 64, None, 2048))
    for total, ws, rank, H, D, lengths, topk in cases:
        for precision in ("bf16", "bf16-serving"):
            p = rank_slice_problem(total, ws, rank, heads=H, head_dim=D, topk=topk, exact=True, lengths=lengths,
                                   precision=precision, max_logits_bytes=1 << 30)  # fmt: skip
            a, ta = _run("tilelang", p)
            b, tb = _run("torch", p)
            record("tilelang-exact", f"S={total} ws={ws} rank={rank} H={H} D={D} topk={topk} {precision}",
                   torch.equal(a, b), rows=a.shape[0], tilelang_s=round(ta, 3), torch_s=round(tb, 3),
                   differing_rows=int((a != b).any(1).sum()))  # fmt: skip


def section_tilelang_random(quick):
    for H in (32, 64):
        for total, ws, rank, lengths in [(8192 + 3, 4, 3, [5000, 7, 3188]), (16384 if quick else 65536, 4, 3, None)]:
            p = rank_slice_problem(total, ws, rank, heads=H, head_dim=128, topk=2048, lengths=lengths, seed=H)
            a, ta = _run("tilelang", p)
            b, tb = _run("torch", p)
            pooled = BACKENDS["torch"].pool(p, pool_table(p.seq.real_cu_seq_lens, 4)[0].cuda())
            ndiff, bad = near_tie_rows(p, a, b, bf16_row_scores(p, pooled))
            record("tilelang-random", f"S={total} rank={rank}/{ws} H={H}", not bad, rows=a.shape[0], differing_rows=ndiff,
                   beyond_near_tie=bad[:5], tilelang_s=round(ta, 3), torch_s=round(tb, 3))  # fmt: skip
            a2, _ = _run("tilelang", p)
            a3, _ = _run("tilelang", dataclasses.replace(p, max_logits_bytes=3 * 2**20 + 12345))
            record("tilelang-random", f"repeat bitwise S={total} H={H}", torch.equal(a, a2))
            record("tilelang-random", f"small budget bitwise S={total} H={H}", torch.equal(a, a3))
    # the budget bounds the real logits storage
    p = rank_slice_problem(20000, 4, 3, heads=64, head_dim=128, topk=2048, max_logits_bytes=5_000_000)
    be = BACKENDS["tilelang"]
    n = pool_table(p.seq.real_cu_seq_lens, 4)[0].numel()
    C = be.chunk_rows(p, n)
    pooled = be.pool(p, pool_table(p.seq.real_cu_seq_lens, 4)[0].cuda())
    z = torch.zeros(C, dtype=torch.int32, device="cuda")
    sc = be.score(p, pooled, p.q[:C], p.head_weights[:C], 0, n, z, z + n)
    record("tilelang-random", "logits storage within budget", sc.untyped_storage().nbytes() <= p.max_logits_bytes,
           rows=C, bytes=sc.untyped_storage().nbytes(), budget=p.max_logits_bytes)  # fmt: skip


def section_deepgemm(quick):
    from sp_kpool.backends.deepgemm_backend import legacy_alignment, mqa_api
    from sp_kpool.kernels.triton_serving import pools_serving, queries_fp8
    from sp_kpool.logits_budget import logits_bytes

    fn, layouts = mqa_api()
    a = legacy_alignment(0)
    record("deepgemm", "api", True, function=fn.__name__, layouts=list(layouts), legacy_alignment=a)
    for H in (32, 64):
        p = rank_slice_problem(8192, 4, 3, heads=H, head_dim=128, topk=2048, precision="fp8", seed=3)
        st = pool_table(p.seq.real_cu_seq_lens, 4)[0].cuda()
        k8, ks = pools_serving(p.k, p.gates, p.ape, st, fp8=True)
        q8, wq = queries_fp8(p.q, p.head_weights)
        ref = serving.mqa_logits_fp8_reference(q8, wq, k8, ks)
        m = row_meta(torch.arange(p.seq.shard_start, p.seq.shard_end), p.seq.real_cu_seq_lens, pool_table(p.seq.real_cu_seq_lens, 4)[1], 4)
        s, e = m.pool_lo.int().cuda(), m.pool_hi.int().cuda()
        cols = torch.arange(k8.shape[0], device="cuda")
        valid = (cols[None] >= s[:, None]) & (cols[None] < e[:, None])
        for layout in layouts:
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
            outside = bool(torch.isneginf(lg[~valid]).all()) if layout == "legacy" else True
            record("deepgemm", f"logits vs dequantized reference H={H} {layout}", calc_diff <= 5e-6 and outside,
                   normalized_error_calc_diff=calc_diff, relative_l2=rel, valid_slots=int(valid.sum()), masked_outside=outside)  # fmt: skip
            if layout == "compact" and not calc_diff <= 5e-6:
                r = int(valid.sum(1).argmax())
                n = int(e[r] - s[r])
                log(f"compact diag row {r} s={int(s[r])} e={int(e[r])} raw[:4]={raw[r, :4].tolist()} raw[n-2:n+2]={raw[r, max(0, n - 2):n + 2].tolist()} "
                    f"ref[s:s+4]={ref[r, int(s[r]):int(s[r]) + 4].tolist()} ref[:4]={ref[r, :4].tolist()} shape={tuple(raw.shape)} width={width}")
    # budget: real storage of short unaligned chunks in both layouts
    for layout in layouts:
        os.environ["SP_KPOOL_MQA_LAYOUT"] = layout
        for rows, budget in [(204, 2**20), (37, 2**20), (4096, 64 * 2**20)]:
            p = rank_slice_problem(4096, 1, 0, heads=32, head_dim=128, topk=2048, precision="fp8", max_logits_bytes=budget)
            be = BACKENDS["deepgemm"]
            st = pool_table(p.seq.real_cu_seq_lens, 4)[0].cuda()
            pooled = be.pool(p, st)
            n = st.numel()
            C = min(rows, be.chunk_rows(p, n))
            z = torch.zeros(C, dtype=torch.int32, device="cuda")
            try:
                be.score(p, pooled, p.q[:C], p.head_weights[:C], 0, n, z, z + n)
                ok, info = True, {}
            except RuntimeError as exc:
                ok, info = False, {"error": str(exc)}
            record("deepgemm", f"budget {layout} rows={C} budget={budget}", ok, predicted=logits_bytes(C, n, 32, layout, a), **info)
        os.environ.pop("SP_KPOOL_MQA_LAYOUT")
    for H in (32, 64):
        for total, lengths in [(8195, [4000, 3, 4192]), (16384 if quick else 65536, None)]:
            p = rank_slice_problem(total, 4, 3, heads=H, head_dim=128, topk=2048, lengths=lengths, precision="fp8", seed=H)
            x, tx = _run("deepgemm", p)
            y, ty = _run("torch", p)
            st = pool_table(p.seq.real_cu_seq_lens, 4)[0].cuda()
            k8, ks = BACKENDS["torch"].pool(p, st)
            q8, wq = serving.prepare_queries_fp8(p.q, p.head_weights)
            # DeepGEMM's FP8 tensor-core accumulation differs from an FP32 one by ~1e-4 relative
            ndiff, bad = near_tie_rows(p, x, y, fp8_row_scores(q8, wq, k8, ks), rel_tol=1e-3)
            x2, _ = _run("deepgemm", p)
            record("deepgemm", f"fp8 indexer vs torch fp8 S={total} H={H}", not bad, differing_rows=ndiff, rows=x.shape[0],
                   beyond_near_tie=bad[:5], deepgemm_s=round(tx, 3), torch_s=round(ty, 3))  # fmt: skip
            record("deepgemm", f"repeat bitwise S={total} H={H}", torch.equal(x, x2))


def section_selectors(quick):
    from sp_kpool.selection import _radix_selector, topk_pools, topk_pools_fast, topk_pools_radix

    sel = _radix_selector(512)
    record("selectors", "lmdeploy sparse_index_topk importable", sel is not None)
    for levels in (3, 1000, 10**7):
        g = torch.Generator(device="cuda").manual_seed(levels)
        R, N = 2048, 8192
        scores = torch.randint(-levels, levels, (R, N), generator=g, device="cuda").float()
        st = torch.randint(0, 1000, (R,), generator=g, device="cuda")
        en = torch.minimum(st + torch.randint(0, N, (R,), generator=g, device="cuda"), torch.tensor(N, device="cuda"))
        cols = torch.arange(N, device="cuda")
        vis = (cols >= st[:, None]) & (cols < en[:, None])
        exact, _ = topk_pools(scores, vis, 512, 5)
        masked = scores.masked_fill(~vis, -float("inf"))
        fast, _ = topk_pools_fast(masked, 512, 5)
        record("selectors", f"fp32 candidates == exact levels={levels}", torch.equal(fast, exact))
        if sel is not None:
            rad, _ = topk_pools_radix(masked, en, 512, 5, sel)
            record("selectors", f"radix + check == exact levels={levels}", torch.equal(rad, exact))
        from sp_kpool.kernels.triton_select import topk_ascending
        from sp_kpool.selection import _ascending

        for k in (1, 512, 2048):
            ref = _ascending(topk_pools(scores, vis, k, 5)[0]).int()
            base = torch.full((R,), 5, dtype=torch.int64, device="cuda")
            got = topk_ascending(scores, st, en, base, k)[:, : ref.shape[1]]
            got2 = topk_ascending(masked, st, en, base, k, tile=1024, num_warps=4)[:, : ref.shape[1]]
            got3 = topk_ascending(masked, st, en, base, k, ways=5, maxnreg=64)[:, : ref.shape[1]]
            got4 = topk_ascending(scores, st, en, base, k, ways=3, num_warps=8)[:, : ref.shape[1]]
            record("selectors", f"triton topk_ascending == exact levels={levels} k={k} (4 launch configurations)",
                   all(torch.equal(x, ref) for x in (got, got2, got3, got4)))  # fmt: skip
        # odd width: the last row runs from a padded copy (whole groups are read)
        odd = scores[:, :8191].contiguous()
        ref = _ascending(topk_pools(odd, vis[:, :8191], 512, 5)[0]).int()
        en_odd = en.clamp(max=8191)
        got = topk_ascending(odd, st, en_odd, torch.full((R,), 5, dtype=torch.int64, device="cuda"), 512)
        record("selectors", f"triton topk_ascending == exact, 8191 columns, levels={levels}", torch.equal(got, ref))
    # NaN cells are never selected: scattered, whole groups of 8 and rows of NaN only (the
    # tiles inside a row take the group maxima of floats, which skip NaN)
    from sp_kpool.kernels.triton_select import topk_ascending

    g = torch.Generator(device="cuda").manual_seed(11)
    R, N = 512, 8192
    scores = torch.randn(R, N, generator=g, device="cuda")
    scores[0::4, ::7] = float("nan")
    scores[1::4, 64:4096] = float("nan")
    scores[2::4] = float("nan")
    scores[2::4, ::997] = 1.0
    scores[3::4, 8:16] = -float("nan")
    st = torch.randint(0, 100, (R,), generator=g, device="cuda")
    en = torch.full((R,), N, device="cuda")
    vis = (torch.arange(N, device="cuda") >= st[:, None]) & (torch.arange(N, device="cuda") < en[:, None])
    for k in (1, 512):
        ref = _ascending(topk_pools(scores, vis, k, 0)[0]).int()
        got = topk_ascending(scores, st, en, torch.zeros(R, dtype=torch.int64, device="cuda"), k)[:, : ref.shape[1]]
        record("selectors", f"triton topk_ascending == exact with NaN cells, k={k}", torch.equal(got, ref))
    # rows wider than 65536 columns: groups of 16 columns

    for levels in (3, 10**7):
        g = torch.Generator(device="cuda").manual_seed(levels)
        R, N = 256, 70000
        scores = torch.randint(-levels, levels, (R, N), generator=g, device="cuda").float()
        st = torch.randint(0, 1000, (R,), generator=g, device="cuda")
        en = torch.full((R,), N, device="cuda") - torch.randint(0, 1000, (R,), generator=g, device="cuda")
        cols = torch.arange(N, device="cuda")
        vis = (cols >= st[:, None]) & (cols < en[:, None])
        for k in (512, 2048):
            ref = _ascending(topk_pools(scores, vis, k, 0)[0]).int()
            got = topk_ascending(scores, st, en, torch.zeros(R, dtype=torch.int64, device="cuda"), k)
            record("selectors", f"triton topk_ascending == exact, {N} columns, k={k}, levels={levels}", torch.equal(got, ref))
    # the expansion kernel (token ids from the row metadata) against the CPU path of assemble
    # (pool table): packed documents with unaligned starts, random visible pools per row
    from sp_kpool.pooling import pool_table
    from sp_kpool.selection import assemble, row_meta

    for kpool, k, tail, alignment in ((4, 512, "fixed", 1), (4, 512, "compact", 1), (3, 64, "compact", 64), (1, 300, "fixed", 8)):
        g = torch.Generator().manual_seed(kpool * 1000 + k)
        cu = torch.tensor([0, 1, 4099, 4100, 20000, 32771])
        rows = torch.randint(0, 32771, (4096,), generator=g)
        pts, offs = pool_table(cu, kpool)
        meta = row_meta(rows, cu, offs, kpool)
        keys = torch.rand(rows.numel(), int(meta.n_visible.max()), generator=g)
        keys = keys.masked_fill(torch.arange(keys.shape[1])[None] >= meta.n_visible[:, None], -1.0)
        top = torch.topk(keys, k, dim=1)
        pools = torch.where(top.values >= 0, meta.pool_lo[:, None] + top.indices, -1)
        pools[::7, k // 2 :] = -1
        want = assemble(pools, meta, pts, topk=k * kpool, kpool=kpool, tail=tail, order="score", alignment=alignment)
        mc = type(meta)(**{f: getattr(meta, f).cuda() for f in ("rows", "pool_lo", "n_visible", "tail_len", "padding")})
        got = assemble(pools.cuda(), mc, pts.cuda(), topk=k * kpool, kpool=kpool, tail=tail, order="score", alignment=alignment)
        record("selectors", f"triton expansion == torch assemble kpool={kpool} k={k} tail={tail} alignment={alignment}",
               torch.equal(got.cpu(), want), rows=rows.numel())  # fmt: skip


RANK_BACKENDS: list = []
RANK_ARMS = (("tilelang", "bf16", 64, 128), ("tilelang", "bf16-serving", 32, 128), ("deepgemm", "fp8", 64, 128),
             ("deepgemm", "fp8", 32, 128))  # fmt: skip


def section_ranks(quick):
    """Every rank of a 2/3/4/8-rank split (computed in this process, the gather replaced by
    the padded global keys) equals world size 1 bit for bit, per GPU backend (``--ranks-backends``
    names the backends to run; the default runs all)."""
    from sp_kpool.sharding import ShardedSequence

    lengths = [3001, 1, 2, 5000, 4095]
    for name, precision, H, D in RANK_ARMS:
        if RANK_BACKENDS and name not in RANK_BACKENDS:
            continue
        base = rank_slice_problem(sum(lengths), 1, 0, heads=H, head_dim=D, topk=2048, lengths=lengths,
                                  precision=precision, max_logits_bytes=64 << 20, seed=11)  # fmt: skip
        ref = BACKENDS[name].run(base)
        for ws in (2, 3, 4, 8):
            ok = True
            for r in range(ws):
                seq = ShardedSequence.split(base.seq.cu_seq_lens, world_size=ws, rank=r)
                pad = seq.total_length - base.k.shape[0]

                def padrows(t, n):
                    return torch.cat([t, t.new_zeros((n, *t.shape[1:]))]) if n > 0 else t

                a, b = seq.shard_start, min(seq.shard_end, seq.num_real_tokens)
                q = padrows(base.q[a:b], seq.shard_size - max(0, b - a))
                w = padrows(base.head_weights[a:b], seq.shard_size - max(0, b - a))
                p = dataclasses.replace(base, seq=seq, q=q, head_weights=w, k=padrows(base.k, pad), gates=padrows(base.gates, pad))
                out = BACKENDS[name].run(p)
                n = max(0, b - a)
                ok &= torch.equal(out[:n], ref[a:b]) and bool((out[n:] == -1).all())
            record("ranks", f"{name} {precision} H={H} world size {ws} == 1", ok)


def section_serving_order(quick):
    """order='serving' (LMDeploy's selector order, compact tail): same sets as the exact rule
    except at exact ties, valid layout (invariants), and the order is the selector's."""
    from sp_kpool.testing.invariants import check_invariants

    for name, precision in (("tilelang", "bf16"), ("deepgemm", "fp8")):
        p = rank_slice_problem(16384, 4, 3, heads=64, head_dim=128, topk=2048, precision=precision, seed=5,
                               tail="compact", order="serving")  # fmt: skip
        srv = BACKENDS[name].run(p)
        ref = BACKENDS[name].run(dataclasses.replace(p, order="score"))
        check_invariants(srv.cpu(), p.seq, topk=2048, kpool=4, tail="compact")
        big = torch.iinfo(torch.int32).max
        same = (torch.sort(srv.masked_fill(srv < 0, big), 1).values == torch.sort(ref.masked_fill(ref < 0, big), 1).values).all(1)
        differ_order = int((srv != ref).any(1).sum())
        record("serving-order", f"{name} {precision} sets == exact rule", float(same.float().mean()) >= 0.999,
               rows=srv.shape[0], rows_same_set=int(same.sum()), rows_in_another_order=differ_order)  # fmt: skip


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sections", default="serving-kernels,selectors,tilelang-exact,tilelang-random,deepgemm,ranks,serving-order")
    ap.add_argument("--ranks-backends", default="", help="backends of the ranks section (default: all)")
    args = ap.parse_args()
    RANK_BACKENDS.extend(b for b in args.ranks_backends.split(",") if b)
    RESULTS["versions"] = versions()
    log(json.dumps(RESULTS["versions"]))
    table = {"serving-kernels": section_serving_kernels, "tilelang-exact": section_tilelang_exact,
             "tilelang-random": section_tilelang_random, "deepgemm": section_deepgemm,
             "selectors": section_selectors, "ranks": section_ranks, "serving-order": section_serving_order}  # fmt: skip
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        try:
            table[name](args.quick)
        except Exception:  # noqa: BLE001 - report and go on to the next section
            record(name, "section crashed", False, traceback=traceback.format_exc()[-3000:])
        log(f"[{name}] done in {time.perf_counter() - t0:.1f} s")
    RESULTS["fails"] = FAILS
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)
    log(f"{'PASS' if not FAILS else 'FAIL'}: {len(FAILS)} failing checks {FAILS}")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
