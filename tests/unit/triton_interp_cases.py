"""The Triton selector, expansion, chunk row-range and model-pooling kernels, run by
Triton's CPU interpreter, against the exact int64-key Top-K, the torch ``assemble``, the
torch row ranges and the torch pooling (bit for bit).

Not collected directly (the name does not start with ``test_``):
``test_triton_interpreter.py`` runs this file in a child pytest with ``TRITON_INTERPRET=1``,
so that the variable (read when Triton is imported) never reaches other tests or the
processes they launch.
"""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run this file with TRITON_INTERPRET=1 (tests/unit/test_triton_interpreter.py does)")

from sp_kpool.pooling import compress_pools_bf16, pool_table  # noqa: E402
from sp_kpool.selection import _ascending, assemble, row_meta, topk_pools  # noqa: E402
from sp_kpool.testing.triton_interp import interpreted_module  # noqa: E402

tk = interpreted_module("sp_kpool.kernels.triton_topk")
te = interpreted_module("sp_kpool.kernels.triton_expand")
tr = interpreted_module("sp_kpool.kernels.triton_ranges")
ts = interpreted_module("sp_kpool.kernels.triton_serving")


def in_range(scores, starts, ends):
    cols = torch.arange(scores.shape[1])
    return (cols[None] >= starts[:, None]) & (cols[None] < ends[:, None])


def exact_ascending(scores, starts, ends, base, k):
    # -inf cells are invisible; NaN cells stay "visible" here: topk_pools must drop them
    vis = in_range(scores, starts, ends) & (scores != -float("inf"))
    p, ok = topk_pools(scores, vis, k, 0)
    p = _ascending(torch.where(ok, p + base[:, None], -1))
    out = torch.full((scores.shape[0], k), -1, dtype=torch.int64)
    out[:, : p.shape[1]] = p
    return out.int()


def run(scores, starts, ends, k, **kw):
    base = torch.arange(scores.shape[0], dtype=torch.int64) * 1000 + 7
    got = tk.topk_ascending(scores, starts, ends, base, k, **kw)
    assert got.dtype == torch.int32 and got.shape == (scores.shape[0], k)
    assert torch.equal(got, exact_ascending(scores, starts, ends, base, k))


def test_random_rows_and_ranges():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(6, 3000, generator=g)
    starts = torch.tensor([0, 5, 100, 0, 2990, 3])
    ends = torch.tensor([3000, 2000, 100, 40, 3000, 2999])
    run(s, starts, ends, 64, tile=512)  # includes an empty row and rows with < k cells


def test_many_tiles_and_wider_groups():
    g = torch.Generator().manual_seed(1)
    s = torch.randn(3, 20000, generator=g)
    run(s, torch.tensor([0, 17, 0]), torch.tensor([20000, 15000, 513]), 512, tile=1024)


def test_exact_ties_negative_zero_and_inf():
    g = torch.Generator().manual_seed(2)
    s = torch.randint(-3, 4, (5, 3000), generator=g).float()
    s[1] = 0.0
    s[2, ::2] = -0.0  # ties with +0.0
    s[3, ::3] = -float("inf")  # invisible
    s[4, 100:2500] = 3.0
    starts, ends = torch.tensor([0, 5, 0, 0, 1]), torch.tensor([3000, 2000, 3000, 2999, 3000])
    run(s, starts, ends, 64, tile=512)  # equal group maxima beyond capg: the slow exact path
    run(s, starts, ends, 300, tile=1024, capg=512)


def test_tiny_rows_and_k_one():
    g = torch.Generator().manual_seed(3)
    s = torch.randn(2, 40, generator=g)
    run(s, torch.tensor([0, 3]), torch.tensor([40, 39]), 16, tile=16)
    run(s, torch.tensor([0, 3]), torch.tensor([40, 39]), 1, tile=16)


def test_bad_arguments():
    s = torch.zeros(2, 8)
    base = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="k: expected"):
        tk.topk_ascending(s, base, base + 8, base, 0)
    with pytest.raises(ValueError, match="scores: expected"):
        tk.topk_ascending(s.double(), base, base + 8, base, 2)
    with pytest.raises(ValueError, match="ways: expected"):
        tk.topk_ascending(s, base, base + 8, base, 2, ways=4)
    with pytest.raises(ValueError, match="vsteps: expected an int >= 0, got -1"):
        tk.topk_ascending(s, base, base + 8, base, 2, vsteps=-1)
    for bad in ((0.5, 0.5), (0.0, 0.5), (0.2, 1.0), (0.1,), "ab"):
        with pytest.raises(ValueError, match=r"split4: expected two fractions \(a, b\) with 0 < a < b < 1"):
            tk.topk_ascending(s, base, base + 8, base, 2, split4=bad)
    with pytest.raises(ValueError, match="split2: expected two fractions"):
        tk.topk_ascending(s, base, base + 8, base, 2, split2=(0.7, 0.6))
    wide = torch.zeros(1, 140000)
    one = torch.zeros(1, dtype=torch.int64)
    assert tk.supports(70000, 2048) and not tk.supports(140000, 2048)
    with pytest.raises(ValueError, match="candidate cells"):
        tk.topk_ascending(wide, one, one + 140000, one, 2048)


def test_nan_is_never_selected():
    g = torch.Generator().manual_seed(7)
    s = torch.randn(3, 500, generator=g)
    s[0, ::7] = float("nan")
    s[1, :] = float("nan")
    s[2, 3] = -float("nan")
    run(s, torch.tensor([0, 0, 0]), torch.tensor([500, 500, 500]), 64, tile=128)
    # many groups, small k: a group whose maximum counted a NaN as large would change L
    s = torch.randn(3, 3000, generator=g)
    s[:, ::7] = float("nan")
    s[1, 8:3000:16] = -float("nan")
    run(s, torch.tensor([0, 3, 100]), torch.tensor([3000, 2999, 2000]), 16, tile=256)


def test_rows_with_at_most_k_cells_select_every_visible_one():
    # step 0 of the kernel (no ranking) for rows of k - 1, k cells, with NaN, -inf and ties;
    # rows of k + 1 cells next to them take the ranking path
    g = torch.Generator().manual_seed(11)
    k = 48
    s = torch.randn(8, 400, generator=g)
    s[1, 60:70] = float("nan")
    s[2, 100:110] = -float("inf")
    s[3, 200:260] = 0.0
    s[4, 5] = -0.0
    starts = torch.tensor([0, 40, 90, 200, 0, 7, 300, 352])
    ends = starts + torch.tensor([k - 1, k, k, k, k + 1, 1, 0, k])
    run(s, starts, ends, k, tile=128)
    run(s, starts, ends, 1, tile=128)


def visible_pools(cu, rows, kpool, k, seed):
    """(pools [R, k] int64, meta, pool_tok_start): for each row, up to k distinct pools of
    its visible range in random order (some rows with fewer valid ones or none), -1 after."""
    g = torch.Generator().manual_seed(seed)
    pts, offs = pool_table(torch.tensor(cu), kpool)
    meta = row_meta(rows, torch.tensor(cu), offs, kpool)
    pools = torch.full((rows.numel(), k), -1, dtype=torch.int64)
    for r in range(rows.numel()):
        n = int(meta.n_visible[r])
        m = min(n, k, int(torch.randint(0, k + 1, (1,), generator=g)) if r % 3 == 1 else k)
        pools[r, :m] = meta.pool_lo[r] + torch.randperm(n, generator=g)[:m]
    return pools, meta, pts


@pytest.mark.parametrize("kpool,tail,alignment", [(4, "fixed", 1), (4, "compact", 64), (3, "compact", 1), (1, "fixed", 8)])
def test_expand_equals_torch_assemble(kpool, tail, alignment):
    # several documents: a row's pools lie in its own document, whose first token is not a
    # multiple of kpool; the kernel computes the token ids from the row's metadata, the
    # torch path reads the pool table
    cu = [0, 13, 14, 57, 130]
    rows = torch.tensor([0, 3, 12, 13, 20, 40, 56, 57, 60, 99, 129])
    k = 6
    pools, meta, pts = visible_pools(cu, rows, kpool, k, seed=kpool)
    assert bool((pools >= 0).sum(1).max() == k) and bool(((pools >= 0).sum(1) < k).any())
    topk = k * kpool + 1  # a token budget that is not a multiple of kpool
    want = assemble(pools, meta, pts, topk=topk, kpool=kpool, tail=tail, order="score", alignment=alignment)
    out = torch.full_like(want, 12345)  # every column is written: no -1 fill needed
    got = te.expand_pools(pools.int(), meta.rows, meta.tail_len, meta.pool_hi, out, topk=topk, kpool=kpool, tail=tail)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got, want)
    with pytest.raises(ValueError, match="out: expected a"):
        te.expand_pools(pools.int(), meta.rows, meta.tail_len, meta.pool_hi, out.t(), topk=topk, kpool=kpool, tail=tail)


@pytest.mark.parametrize("tail", ["fixed", "compact"])
def test_expand_rows_wider_than_one_block(tail):
    # 5001 columns: 2500 pools of 2 tokens (a [4096, 2] block) and a one-column remainder,
    # rows with all, some and no pools valid
    k, kpool = 2500, 2
    cu = [0, 7, 7 + 18001]
    rows = torch.tensor([7 + 18000, 7 + 5001, 6])
    pools, meta, pts = visible_pools(cu, rows, kpool, k, seed=5)
    pools[1, 2100:] = -1
    assert int((pools[2] >= 0).sum()) == 3  # row 6 of a 7-token document
    want = assemble(pools, meta, pts, topk=k * kpool, kpool=kpool, tail=tail, order="score", alignment=1)
    out = torch.full_like(want, 777)
    got = te.expand_pools(pools.int(), meta.rows, meta.tail_len, meta.pool_hi, out, topk=k * kpool, kpool=kpool, tail=tail)
    assert torch.equal(got, want)


def test_wide_rows_use_wider_groups():
    # more than 8192 groups of 8 columns: groups of 16 (and the slow path with few values)
    g = torch.Generator().manual_seed(4)
    s = torch.randn(2, 70000, generator=g)
    s[1] = torch.randint(0, 3, (70000,), generator=g).float()
    run(s, torch.tensor([0, 5]), torch.tensor([70000, 69001]), 16, tile=4096)


def test_unaligned_start_and_full_width():
    # groups start at multiples of 8 before the first column: the last group still fits
    g = torch.Generator().manual_seed(5)
    s = torch.randn(3, 4096, generator=g)
    run(s, torch.tensor([5, 7, 4095]), torch.tensor([4096, 4096, 4096]), 256, tile=1024)


def test_rank_by_score_gives_score_order():
    # order="score" on CUDA ranks the selector's ascending set with _rank_by_score
    from sp_kpool.selection import _rank_by_score

    g = torch.Generator().manual_seed(6)
    s = torch.randint(-4, 5, (5, 300), generator=g).float()  # many exact ties
    starts, ends = torch.tensor([0, 3, 0, 10, 299]), torch.tensor([300, 200, 40, 300, 300])
    base = torch.tensor([7, 1000, 0, 5, 9], dtype=torch.int64)
    k = 50
    asc = tk.topk_ascending(s, starts, ends, base, k)
    want, ok = topk_pools(s, in_range(s, starts, ends), k, 0)
    want = torch.where(ok, want + base[:, None], -1)
    assert torch.equal(_rank_by_score(s, asc, base[:, None]), want)


@pytest.mark.parametrize("ways,warps", [(3, 4), (5, 8), (2, 4)])
def test_multiway_searches(ways, warps):
    # 2-, 3- and 5-way searches (one / two / four thresholds per reduction), also on exact ties
    g = torch.Generator().manual_seed(8)
    s = torch.randn(4, 2000, generator=g)
    s[1] = torch.randint(-2, 3, (2000,), generator=g).float()
    s[2, 1000:] = 5.0
    starts, ends = torch.tensor([0, 3, 0, 11]), torch.tensor([2000, 1999, 2000, 700])
    run(s, starts, ends, 100, ways=ways, num_warps=warps)
    run(s, starts, ends, 1, ways=ways, num_warps=warps)


@pytest.mark.parametrize("mode", [dict(ways=2), dict(capg=512)])
def test_search_modes(mode):
    # the bisection search and a candidate capacity above pow2(k) on random rows, exact
    # ties, skewed keys, few visible groups and short rows
    g = torch.Generator().manual_seed(12)
    n = 2000
    s = torch.randn(6, n, generator=g)
    s[1] = torch.randint(-3, 4, (n,), generator=g).float()
    s[2] = torch.exp(torch.randn(n, generator=g) * 8)
    s[3] = torch.where(torch.rand(n, generator=g) < 0.99, torch.randn(n, generator=g) * 1e-6, 1e30)
    s[4] = -float("inf")
    s[4, 0:600:8] = torch.randn(75, generator=g)
    s[4, 3:600:8] = torch.randn(75, generator=g)
    s[5, 1000:] = 2.0
    starts, ends = torch.tensor([0, 3, 17, 0, 0, 999]), torch.tensor([n, n - 5, 1500, n, n, n])
    for k in (1, 130, 300):
        run(s, starts, ends, k, **mode)


def test_group_sizes():
    # groups of 8 columns, wider ones for rows of more than 8192 groups of 8
    assert tk._sizes(32768, 512, 4096, None) == (4096, 8, 4096, 512)
    assert tk._sizes(131072, 512, 4096, None) == (4096, 16, 8192, 512)  # 8192 groups at most
    # k > 512: groups of 4 up to 32768 columns (8192 groups), then as for k 512
    assert tk._sizes(32768, 2048, 4096, None) == (4096, 4, 8192, 2048)
    assert tk._sizes(32768, 1024, 4096, None) == (4096, 4, 8192, 1024)
    assert tk._sizes(32769, 2048, 4096, None) == (4096, 8, 8192, 2048)
    # warps: 16 candidate cells per thread up to 4096 cells, 8 warps for 8192, 16 above
    assert [tk._default_warps(32768, k) for k in (100, 512, 1024, 2048)] == [4, 8, 8, 8]
    assert [tk._default_warps(65536, k) for k in (512, 1024, 2048)] == [8, 8, 16]


@pytest.mark.parametrize("ways", [2, 3, 5])
def test_groups_of_four_columns(ways):
    # group=4: twice the group maxima, half the candidate cells; the same exact answer on
    # random rows, exact ties, NaN and infinities, short and unaligned ranges, streamed groups
    assert tk._sizes(32768, 2048, 8192, None, 4) == (8192, 4, 8192, 2048)
    g = torch.Generator().manual_seed(11)
    n = 3000
    s = torch.randn(7, n, generator=g)
    s[1] = torch.randint(0, 3, (n,), generator=g).float()  # three levels: long runs of equal keys
    s[2, ::7] = float("nan")
    s[3, 100:200] = float("inf")
    s[3, 300:] = float("-inf")
    starts = torch.tensor([0, 1, 3, 0, 2990, 5, 1001])
    ends = torch.tensor([n, n, n - 2, n, n, 1003, 2999])
    for k in (1, 37, 300, 700):
        run(s, starts, ends, k, group=4, ways=ways, tile=256)
        assert tk.last_launch["G"] == 4
    run(s, starts, ends, 300, group=4, capg=512, tile=256)  # few register groups: the streamed path
    with pytest.raises(ValueError, match="group: expected a power of two >= 4"):
        run(s, starts, ends, 4, group=6)
    with pytest.raises(ValueError, match="group: expected at most the tile"):
        run(s, starts, ends, 4, group=512, tile=256)


@pytest.mark.parametrize("kind", ["lognormal", "two_clusters", "denormal_and_huge", "few_groups"])
def test_searches_on_skewed_rows(kind):
    # keys spread over the whole int32 range, clusters far apart, fewer visible groups
    # than k with more visible cells than k
    g = torch.Generator().manual_seed(9)
    n = 3000
    if kind == "lognormal":
        s = torch.exp(torch.randn(3, n, generator=g) * 8)
    elif kind == "two_clusters":
        s = torch.where(torch.rand(3, n, generator=g) < 0.99, torch.randn(3, n, generator=g) * 1e-6, 1e30 + torch.rand(3, n, generator=g) * 1e24)
    elif kind == "denormal_and_huge":
        s = torch.randn(3, n, generator=g) * 1e-40
        s[:, ::97] = -3e38
        s[:, 5::101] = 3e38
    else:  # fewer visible groups than k, more visible cells than k
        s = torch.full((3, n), -float("inf"))
        s[:, 0:600:8] = torch.randn(3, 75, generator=g)
        s[:, 1:600:8] = torch.randn(3, 75, generator=g)
    starts, ends = torch.tensor([0, 1, 17]), torch.tensor([n, n - 3, 2000])
    for k in (1, 100, 130):
        run(s.float(), starts, ends, k)


@pytest.mark.parametrize("vsteps,ways", [(0, 3), (1, 2), (64, 3), (64, 2)])
def test_value_split_steps_of_phase_two(vsteps, ways):
    # phase 2's first steps split the bracket in FP32 value (vsteps; 64: every step): the
    # same exact answer on rows whose values span binades, infinities, denormals and ties
    g = torch.Generator().manual_seed(21)
    n = 3000
    s = torch.randn(6, n, generator=g)
    s[1] = torch.exp(torch.randn(n, generator=g) * 8)
    s[2, ::89] = float("inf")  # visible, the largest key
    s[2, 1::7] = -3e38
    s[3] = torch.randn(n, generator=g) * 1e-40  # denormals
    s[3, 5::101] = 3e38
    s[4] = torch.randint(-2, 3, (n,), generator=g).float()  # exact ties, -0.0 and +0.0 among them
    s[4, ::5] = -0.0
    s[5] = -float("inf")
    s[5, 0:600:8] = torch.randn(75, generator=g)  # fewer visible groups than k
    starts, ends = torch.tensor([0, 1, 17, 0, 3, 0]), torch.tensor([n, n - 3, 2000, n, n, n])
    for k in (1, 100, 130):
        run(s, starts, ends, k, vsteps=vsteps, ways=ways)


@pytest.mark.parametrize("split2,split4,ways", [((), (), 3), ((0.45, 0.6), (0.006, 0.022), 3),
                                               ((0.01, 0.99), (0.49, 0.5), 3), ((0.3, 0.9), (0.001, 0.002), 2)])
def test_first_split_fractions(split2, split4, ways):
    # the first step of phase 2's / phase 4's search splits the values at fixed fractions
    # of the bracket: the same exact answer on rows whose values span binades, with
    # infinities, denormals, exact ties and fewer visible groups than k
    g = torch.Generator().manual_seed(23)
    n = 3000
    s = torch.randn(6, n, generator=g).relu() * 3
    s[1] = torch.exp(torch.randn(n, generator=g) * 8)
    s[2, ::89] = float("inf")
    s[2, 1::7] = -3e38
    s[3] = torch.randn(n, generator=g) * 1e-40
    s[4] = torch.randint(-2, 3, (n,), generator=g).float()
    s[4, ::5] = -0.0
    s[5] = -float("inf")
    s[5, 0:600:8] = torch.randn(75, generator=g)
    starts, ends = torch.tensor([0, 1, 17, 0, 3, 0]), torch.tensor([n, n - 3, 2000, n, n, n])
    for k in (1, 100, 130):
        run(s, starts, ends, k, split2=split2, split4=split4, ways=ways)


@pytest.mark.parametrize("warps", [4, 8])
def test_phase_one_tile_geometry(warps):
    # phase 1 takes the tiles inside [start, end) in a loop without masks or branches, the
    # first tile (starting before start) and the last (ending past end) with masks: rows
    # starting on and off a group boundary, ending on, before and after a tile boundary,
    # inside the first tile, empty, and with the row maximum in the first and last tiles
    g = torch.Generator().manual_seed(5)
    n = 2100  # tiles of 256 columns: 8 whole tiles and a part
    s = torch.randn(12, n, generator=g)
    s[0, 3] = 50.0
    s[1, n - 1] = 50.0
    s[1, :3] = s[7, 8] = s[4, 2047:2056] = s[8, 690:700] = 100.0  # just outside: must not count
    starts = torch.tensor([0, 3, 8, 255, 256, 250, 0, 9, 700, 700, 1, 2047])
    ends = torch.tensor([n, n, 2048, 2049, 2047, 260, 256, 9, 690, 1000, 255, 2048])
    for k in (1, 40, 300):
        run(s, starts, ends, k, tile=256, num_warps=warps)
    # ends past the width: the columns that exist (a view of a wider tensor, whose storage
    # holds more columns that must not be read)
    wide = torch.randn(3, n + 700, generator=g)
    wide[:, n:] = 1000.0
    base = torch.zeros(3, dtype=torch.int64)
    got = tk.topk_ascending(wide[:, :n], torch.tensor([0, 5, 2000]), torch.tensor([n + 600, n + 1, n + 300]), base, 40,
                            tile=256, num_warps=warps)  # fmt: skip
    assert torch.equal(got, exact_ascending(wide[:, :n], torch.tensor([0, 5, 2000]), torch.full((3,), n), base, 40))
    # a start near INT32_MAX (past the width: an empty row; its tile arithmetic must not wrap)
    got = tk.topk_ascending(s[:2], torch.tensor([2**31 - 1, 0]), torch.tensor([300, 300]), base[:2], 4, tile=256,
                            num_warps=warps)  # fmt: skip
    assert torch.equal(got, exact_ascending(s[:2], torch.tensor([n, 0]), torch.tensor([300, 300]), base[:2], 4))


def test_odd_width_last_row_and_strided_rows():
    # whole groups are read: the last row of a contiguous odd-width tensor runs from a
    # padded copy; rows of a wider tensor (a view) read into their own padding columns
    g = torch.Generator().manual_seed(9)
    s = torch.randn(3, 1001, generator=g)
    starts, ends = torch.tensor([0, 2, 995]), torch.tensor([1001, 1001, 1001])
    run(s, starts, ends, 40)
    wide = torch.randn(3, 1030, generator=g)
    run(wide[:, :1001], starts, ends, 40)


def test_streamed_candidate_groups():
    # more candidate groups than capg (equal group maxima): the search streams them in
    # blocks of capg, and the tied answer spans several blocks
    g = torch.Generator().manual_seed(10)
    s = torch.randint(-3, 4, (3, 3000), generator=g).float()
    s[2, 1500:] = 2.5  # distinct values above the ties in a later block
    starts, ends = torch.tensor([0, 9, 0]), torch.tensor([3000, 2900, 3000])
    run(s, starts, ends, 200, capg=256)
    run(s, starts, ends, 200, capg=256, ways=3, num_warps=4)


def test_tiny_widths_and_broadcast_rows_stay_in_storage():
    # whole groups of 8 are read: rows of a contiguous tensor narrower than a group, and
    # rows that share memory (stride 0), run from a padded copy where they would read past
    # the storage (the results are checked here, the row rule on the host)
    g = torch.Generator().manual_seed(11)
    for W, in_storage in ((1, 0), (3, 3)):  # 5 x 3: rows 0-2 reach at most 6 + 8 <= 15 cells
        s = torch.randn(5, W, generator=g)
        assert tk._rows_in_storage(s, 8) == in_storage
        run(s, torch.zeros(5, dtype=torch.int64), torch.full((5,), W), 1)
    row = torch.randn(1, 20, generator=g)
    assert tk._rows_in_storage(row.expand(3, 20), 24) == 0
    assert tk._rows_in_storage(row[:, :16].expand(3, 16), 16) == 3
    run(row.expand(3, 20), torch.zeros(3, dtype=torch.int64), torch.full((3,), 20), 4)


def test_group_count_limit():
    # at most 8192 groups per row: the searches count in 16-bit fields
    assert not tk.supports(16777216, 2) and tk.supports(2 * 10**6, 2)
    s = torch.zeros(1, 524288)
    one = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="groups of 8 columns"):
        tk.topk_ascending(s, one, one + 524288, one, 2, tile=64)


def test_streamed_blocks_with_small_k():
    # a long tied row with k = 1 streams its candidate groups in blocks of >= 256 groups
    s = torch.full((2, 6000), 2.0)
    s[1, 4321] = 3.0
    run(s, torch.tensor([0, 5]), torch.tensor([6000, 6000]), 1)
    run(s, torch.tensor([0, 5]), torch.tensor([6000, 6000]), 3)


@pytest.mark.parametrize("lengths, kpool, C, lo, hi", [
    ([3, 0, 11, 1, 17, 4, 9], 4, 7, 5, 40),
    ([3, 0, 11, 1, 17, 4, 9], 1, 16, 0, 45),
    ([45], 5, 64, 33, 45),
    ([1] * 30 + [200], 4, 50, 17, 230),
])
def test_chunk_row_ranges_equal_the_torch_arithmetic(lengths, kpool, C, lo, hi):
    from sp_kpool.plan import row_ranges_torch

    cu = torch.tensor([0] + lengths).cumsum(0)
    starts, offs = pool_table(cu, kpool)
    first = (lo // C) * C
    grid = list(range(first, hi, C))
    m = row_meta(torch.tensor([r for g0 in grid for r in (g0, min(g0 + C, int(cu[-1])) - 1)]), cu, offs, kpool)
    bounds = torch.stack([m.pool_lo[0::2], m.pool_hi[1::2]], dim=1)
    got = tr.chunk_row_ranges(cu, offs, bounds, lo, hi, first, C, kpool)
    want = row_ranges_torch(cu, offs, bounds, lo, hi, first, C, kpool)
    assert got.dtype == torch.int32 and torch.equal(got, want)


def test_chunk_row_ranges_random_layouts():
    import random

    from sp_kpool.plan import row_ranges_torch

    rng = random.Random(3)
    for _ in range(40):
        lengths = [rng.choice([0, 1, 2, 3, 5, 9, 40, 130]) for _ in range(rng.randint(1, 12))]
        if sum(lengths) == 0:
            lengths[0] = 7
        kpool, C = rng.choice([1, 2, 4, 7]), rng.randint(1, 70)
        cu = torch.tensor([0] + lengths).cumsum(0)
        n = int(cu[-1])
        lo = rng.randint(0, n - 1)
        hi = rng.randint(lo + 1, n)
        _, offs = pool_table(cu, kpool)
        first = (lo // C) * C
        grid = list(range(first, hi, C))
        m = row_meta(torch.tensor([r for g0 in grid for r in (g0, min(g0 + C, n) - 1)]), cu, offs, kpool)
        bounds = torch.stack([m.pool_lo[0::2], m.pool_hi[1::2]], dim=1)
        got = tr.chunk_row_ranges(cu, offs, bounds, lo, hi, first, C, kpool)
        assert torch.equal(got, row_ranges_torch(cu, offs, bounds, lo, hi, first, C, kpool)), (lengths, kpool, C, lo, hi)


def test_out_rows_of_a_larger_tensor():
    # the driver's path: the selector writes straight into rows of its output (row stride
    # wider than k, garbage beforehand); every element of those rows is written, nothing
    # around them
    g = torch.Generator().manual_seed(11)
    s = torch.randn(5, 700, generator=g)
    starts, ends = torch.tensor([0, 3, 650, 0, 10]), torch.tensor([700, 600, 700, 0, 90])
    base = torch.arange(5, dtype=torch.int64) * 1000 + 7
    k = 64  # rows 2 and 4 have fewer visible cells, row 3 none
    big = torch.full((9, k + 5), 12345, dtype=torch.int32)
    out = big[2:7, 3 : 3 + k]
    got = tk.topk_ascending(s, starts, ends, base, k, tile=256, out=out)
    assert got is out
    assert torch.equal(out, exact_ascending(s, starts, ends, base, k))
    keep = torch.ones_like(big, dtype=torch.bool)
    keep[2:7, 3 : 3 + k] = False
    assert bool((big[keep] == 12345).all())
    with pytest.raises(ValueError, match="out: expected an int32 tensor of shape"):
        tk.topk_ascending(s, starts, ends, base, k, out=torch.empty((5, k), dtype=torch.int64))
    with pytest.raises(ValueError, match="out: expected an int32 tensor of shape"):
        tk.topk_ascending(s, starts, ends, base, k, out=torch.empty((5, k + 1), dtype=torch.int32))
    with pytest.raises(ValueError, match="unit column stride"):
        tk.topk_ascending(s, starts, ends, base, k, out=torch.empty((k, 5), dtype=torch.int32).t())


# --- the fused FP8 scorer + selector (sp_kpool.kernels.triton_fp8_fused) ------------------

ff = interpreted_module("sp_kpool.kernels.triton_fp8_fused")
ffk = interpreted_module("sp_kpool.kernels.triton_fp8_fused_kernels")  # its kernels and their helpers


def fp8_case(C, H, P, seed, *, levels=0, zero_rows=(), bias=0.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(C, H, 128, generator=g)
    kv = torch.randn(P, 128, generator=g)
    if levels:  # few distinct values: heavy score ties
        q, kv = torch.round(q * levels) / levels, torch.round(kv * levels) / levels
    w = torch.randn(C, H, generator=g).abs() * 0.1
    for r in zero_rows:
        w[r] = 0.0  # every score 0: a ReLU plateau
    scale = 2.0 ** torch.randint(-3, 3, (P,), generator=g).float()
    if bias:  # later pools score higher: a gate that sees early pools first tightens late
        scale = scale * (1 + bias * torch.arange(P) / P)
    return q.to(torch.float8_e4m3fn), w, kv.to(torch.float8_e4m3fn), scale


def check_fused(q8, w, k8, scale, starts, ends, k, **kw):
    kw.setdefault("check", 2)  # compaction checks every 2 blocks: small buffers that compact often
    C = q8.shape[0]
    dense = ff.score_select(q8, w, k8, scale, starts, ends, k, dense=True, **kw)
    vis = in_range(dense, starts, ends)
    want = exact_ascending(torch.where(vis, dense, -float("inf")), starts, ends, torch.full((C,), 5), k)
    got, emitted = ff.score_select(q8, w, k8, scale, starts, ends, k, pool_base=5, **kw)
    assert torch.equal(got, want)
    assert (emitted <= (ends - starts).clamp(min=0)).all()
    # the other way to take buffer slots than the default (atomics / a prefix count): the same
    # gate, so the same ids and the same cells let through
    other = "atomic" if ff.SLOTS == "scan" else "scan"
    got2, emitted2 = ff.score_select(q8, w, k8, scale, starts, ends, k, pool_base=5, slots=other, **kw)
    assert torch.equal(got2, want) and torch.equal(emitted2, emitted)
    return dense, emitted


@pytest.mark.parametrize("H,bq,one_dot", [(32, 4, True), (32, 4, False), (64, 2, True), (64, 4, False), (128, 4, False),
                                          (64, 4, True), (32, 8, False), (128, 1, True), (128, 2, True)])  # fmt: skip
def test_fused_fp8_selection_equals_dense_logits_plus_exact_topk(H, bq, one_dot):
    C, P, k = 7, 700, 16
    q8, w, k8, scale = fp8_case(C, H, P, seed=H + bq)
    starts = torch.tensor([0, 3, 100, 650, 0, 5, 699], dtype=torch.int32)
    ends = torch.tensor([700, 690, 100, 700, 10, 17, 700], dtype=torch.int32)  # empty, short, k+1 rows
    dense, emitted = check_fused(q8, w, k8, scale, starts, ends, k, block_q=bq, one_dot=one_dot)
    other = ff.score_select(q8, w, k8, scale, starts, ends, k, dense=True, one_dot=not one_dot,
                            block_q=4 if one_dot else 128 // H if H < 128 else 1)  # fmt: skip
    assert torch.equal(dense.view(torch.int32), other.view(torch.int32))  # the two dot shapes: the same DAG
    # the dense logits are the serving arithmetic (tolerance: the interpreter's dot is not
    # the GPU's FP8 tensor-core sum, and the head order differs)
    from sp_kpool.serving_scores import mqa_logits_fp8_reference

    ref = mqa_logits_fp8_reference(q8, w, k8, scale)
    vis = in_range(dense, starts, ends)
    assert torch.allclose(dense[vis], ref[vis], rtol=1e-4, atol=1e-4)
    assert int(emitted.max()) < 700  # the gate dropped cells on the long rows



@pytest.mark.parametrize("H,bq", [(32, 4), (64, 2), (128, 1)])
def test_bf16_inputs_fused_equals_dense_and_the_bf16_score(H, bq):
    # BF16 queries and pools, no pool scale (the triton backend): fused = dense + the exact
    # Top-K, and the dense logits are the BF16 score w . ReLU(q . k) up to FP32 rounding
    C, P, k = 7, 700, 16
    q8, w, k8, _ = fp8_case(C, H, P, seed=H + 3)
    q, keys = q8.float().bfloat16(), k8.float().bfloat16()
    starts = torch.tensor([0, 3, 100, 650, 0, 5, 699], dtype=torch.int32)
    ends = torch.tensor([700, 690, 100, 700, 10, 17, 700], dtype=torch.int32)
    dense, _ = check_fused(q, w, keys, None, starts, ends, k, block_q=bq)
    ref = (w[:, :, None] * torch.relu(q.float().reshape(C * H, 128) @ keys.float().t()).view(C, H, P)).sum(1)
    vis = in_range(dense, starts, ends)
    assert torch.allclose(dense[vis], ref[vis], rtol=1e-4, atol=1e-4)
    # the dtypes are checked whether or not the launch gives num_stages
    for args, kw in (((q, w, keys, torch.ones(P)), {}), ((q8, w, k8, None), dict(num_stages=3)),
                     ((q8, w, k8, torch.ones(P, dtype=torch.float64)), dict(num_stages=3)),
                     ((q, w, k8, None), dict(num_stages=2))):  # fmt: skip
        with pytest.raises(ValueError, match="bfloat16 ones and k_scale=None"):
            ff.score_select(*args, starts, ends, k, dense=True, **kw)
    # one dot per chain step (one_dot=False) gives the same BF16 logits
    other = ff.score_select(q, w, keys, None, starts, ends, k, dense=True, one_dot=False, block_q=4)
    assert torch.equal(dense.view(torch.int32), other.view(torch.int32))


@pytest.mark.parametrize("H,bq,dtype", [(32, 4, torch.float8_e4m3fn), (64, 2, torch.bfloat16),
                                        (128, 1, torch.bfloat16), (128, 2, torch.float8_e4m3fn)])  # fmt: skip
def test_dense_pairs_equal_one_block_per_program(H, bq, dtype):
    # two row blocks per program (pairs=True): the same logits bit for bit, odd row counts,
    # an empty row, a partial last pair, and a row window (rows=)
    C, P = 13, 300
    q8, w, k8, scale = fp8_case(C, H, P, seed=H + bq)
    if dtype == torch.bfloat16:
        q8, k8, scale = q8.float().bfloat16(), k8.float().bfloat16(), None
    g = torch.Generator().manual_seed(H)
    starts = torch.randint(0, 150, (C,), generator=g, dtype=torch.int32)
    ends = torch.clamp(starts + torch.randint(0, 200, (C,), generator=g, dtype=torch.int32), max=P)
    ends[3] = starts[3]
    for rows in (None, (2, 11)):
        a = ff.score_select(q8, w, k8, scale, starts, ends, 1, dense=True, block_q=bq, rows=rows)
        b = ff.score_select(q8, w, k8, scale, starts, ends, 1, dense=True, block_q=bq, rows=rows, pairs=True)
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    with pytest.raises(ValueError, match="pairs: needs dense=True and one_dot"):
        ff.score_select(q8, w, k8, scale, starts, ends, 1, pairs=True)


@pytest.mark.parametrize("first", [32, 64])
def test_h128_chains_extend_the_first_heads_chains(first):
    # heads >= first weighted 0: every later chain step is fma(r, 0, c) = c, so the H 128 logits
    # are the H `first` logits of the first heads (the GPU test compares those with DeepGEMM's)
    C, P = 6, 200
    q8, w, k8, scale = fp8_case(C, 128, P, seed=first)
    w[:, first:] = 0.0
    starts = torch.tensor([0, 0, 50, 199, 3, 0], dtype=torch.int32)
    ends = torch.tensor([200, 130, 50, 200, 70, 64], dtype=torch.int32)
    got = ff.score_select(q8, w, k8, scale, starts, ends, 8, dense=True)
    want = ff.score_select(q8[:, :first].contiguous(), w[:, :first].contiguous(), k8, scale, starts, ends, 8,
                           dense=True)  # fmt: skip
    vis = in_range(got, starts, ends)
    assert torch.equal((got[vis] + 0.0).view(torch.int32), (want[vis] + 0.0).view(torch.int32))
    assert bool((got[vis] > 0).any())
    w[:, first] = 1.0  # one more weighted head: the logits change
    assert not torch.equal(ff.score_select(q8, w, k8, scale, starts, ends, 8, dense=True)[vis], got[vis])

def test_scores_probe_is_the_row_max_of_the_dense_logits():
    C, H, P = 5, 64, 300
    q8, w, k8, scale = fp8_case(C, H, P, seed=8)
    starts = torch.tensor([0, 10, 299, 40, 7], dtype=torch.int32)
    ends = torch.tensor([300, 200, 300, 40, 8], dtype=torch.int32)  # an empty row: -inf
    dense = ff.score_select(q8, w, k8, scale, starts, ends, 1, dense=True)
    want = torch.where(in_range(dense, starts, ends), dense, -float("inf")).max(dim=1).values
    got = ff.scores_probe(q8, w, k8, scale, starts, ends)
    assert torch.equal(got, want) and got[3] == -float("inf")
    with pytest.raises(ValueError, match="slots: expected 'scan' or 'atomic', got 'ballot'"):
        ff.score_select(q8, w, k8, scale, starts, ends, 1, slots="ballot")


@pytest.mark.parametrize("case", ["ties", "plateau", "recency", "nonfinite"])
def test_fused_fp8_selection_hard_inputs(case):
    C, H, P, k = 6, 32, 900, 24
    kw = dict(levels=2) if case == "ties" else dict(zero_rows=(0, 2, 3)) if case == "plateau" else {}
    q8, w, k8, scale = fp8_case(C, H, P, seed=3, bias=4.0 if case == "recency" else 0.0, **kw)
    if case == "nonfinite":
        scale[[10, 11, 500]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
        w[1, 3] = float("nan")
        w[2, 0] = float("inf")
    starts = torch.tensor([0, 1, 64, 0, 300, 7], dtype=torch.int32)
    ends = torch.tensor([900, 899, 833, 24, 900, 31], dtype=torch.int32)
    _, emitted = check_fused(q8, w, k8, scale, starts, ends, k)
    check_fused(q8, w, k8, scale, starts, ends, 1)
    if case == "recency":  # rising scores: most cells pass the gate, more than one buffer holds
        assert int(emitted[0]) > ff.capacity(k, check=2), emitted


def test_fused_gate_keeps_a_later_pool_one_ulp_above_the_threshold():
    # pools score L0 except k pools in the middle scoring the next float above it: once the
    # gate's threshold is key(L0), they must still get in (a gate one ulp too tight drops them)
    C, H, P, k = 1, 32, 300, 4
    g = torch.Generator().manual_seed(5)
    q8 = torch.randn(C, H, 128, generator=g).to(torch.float8_e4m3fn)
    k8 = torch.randn(1, 128, generator=g).to(torch.float8_e4m3fn).expand(64, 128).contiguous()
    w = torch.rand(C, H, generator=g) + 0.5
    steps = torch.full((64,), 1.0).view(torch.int32) + torch.arange(64, dtype=torch.int32)
    probe = ff.score_select(q8, w, k8, steps.view(torch.float32), torch.zeros(1, dtype=torch.int32),
                            torch.full((1,), 64, dtype=torch.int32), k, dense=True)[0]  # fmt: skip
    keys = probe.view(torch.int32)
    pairs = torch.nonzero(keys[None, :] == keys[:, None] + 1)  # scales i, j: logits one ulp apart
    assert pairs.numel(), keys
    i, j = pairs[0].tolist()
    scale = torch.full((P,), float(steps.view(torch.float32)[i]))
    scale[200 : 200 + k] = steps.view(torch.float32)[j]
    k8 = k8[:1].expand(P, 128).contiguous()
    ends = torch.full((1,), P, dtype=torch.int32)
    got, _ = ff.score_select(q8, w, k8, scale, torch.zeros(1, dtype=torch.int32), ends, k, check=1)
    assert got.tolist() == [[200, 201, 202, 203]]


def test_compaction_breaks_ties_by_pool_id_in_any_buffer_order():
    # the buffer may be filled by atomics (no order on the GPU): compaction must keep, of the keys
    # equal to the k-th, the lowest pool ids wherever they sit in the buffer
    import triton
    import triton.language as tl

    @triton.jit
    def compact(BK, BI, Res, n, k, CAP: tl.constexpr):
        kept, t = ffk._compact(BK, BI, n, k, CAP)
        tl.store(Res, kept)
        tl.store(Res + 1, t)

    g = torch.Generator().manual_seed(2)
    for n, k in [(100, 10), (128, 64), (37, 37), (90, 1)]:
        keys = torch.randint(0, 4, (n,), generator=g, dtype=torch.int32)  # heavy ties
        ids = torch.randperm(1000, generator=g)[:n].int()
        bk, bi = torch.zeros(128, dtype=torch.int32), torch.zeros(128, dtype=torch.int32)
        bk[:n], bi[:n] = keys, ids
        res = torch.zeros(2, dtype=torch.int32)
        compact[(1,)](bk, bi, res, n, k, CAP=128)
        order = sorted(range(n), key=lambda j: (-int(keys[j]), int(ids[j])))[:k]
        assert int(res[0]) == k and int(res[1]) == int(keys[order[-1]])
        assert sorted(bi[:k].tolist()) == sorted(int(ids[j]) for j in order)


def test_short_rows_step_is_only_a_shortcut():
    g = torch.Generator().manual_seed(4)
    s = torch.randn(6, 300, generator=g)
    s[0, 3:9] = float("nan")
    starts, ends = torch.tensor([0, 10, 50, 0, 299, 100]), torch.tensor([20, 30, 51, 300, 300, 132])
    base = torch.arange(6, dtype=torch.int64)
    a = tk.topk_ascending(s, starts, ends, base, 32, tile=128)
    b = tk.topk_ascending(s, starts, ends, base, 32, tile=128, short_rows=False)
    assert torch.equal(a, b) and torch.equal(a, exact_ascending(s, starts, ends, base, 32))


def test_all_short_rows_launch():
    # short_rows="all" (every range holds at most k columns): one program per row, step 0
    # only; the same ids as the persistent kernel, NaN and -inf never selected, empty ranges
    g = torch.Generator().manual_seed(5)
    s = torch.randn(7, 300, generator=g)
    s[0, 3:9] = float("nan")
    s[1, :] = float("-inf")
    s[2, 10:40] = 0.0
    starts = torch.tensor([0, 10, 50, 268, 299, 100, 7])
    ends = torch.tensor([32, 30, 51, 300, 299, 132, 3])
    base = torch.arange(7, dtype=torch.int64) * 1000
    for k in (32, 40):
        got = tk.topk_ascending(s, starts, ends, base, k, short_rows="all")
        assert tk.last_launch["kernel"] == "short"
        assert torch.equal(got, exact_ascending(s, starts, ends, base, k))
        assert torch.equal(got, tk.topk_ascending(s, starts, ends, base, k, tile=128))
    with pytest.raises(ValueError, match="short_rows: expected True, False or 'all'"):
        tk.topk_ascending(s, starts, ends, base, 32, short_rows="some")


def test_expand_takes_the_unused_slots_first():
    # order="ascending-unused-first" (XTuner's columns): assemble hands the kernel the pools
    # sorted with -1 first, padded to topk // kpool slots; with tail="fixed" every slot is
    # expanded on its own, so the kernel's columns equal the torch path's
    cu = [0, 13, 14, 57, 130]
    rows = torch.tensor([0, 3, 12, 13, 20, 40, 56, 57, 60, 99, 129])
    k, kpool = 6, 4
    pools, meta, pts = visible_pools(cu, rows, kpool, k, seed=2)
    want = assemble(pools, meta, pts, topk=k * kpool, kpool=kpool, tail="fixed", order="ascending-unused-first",
                    alignment=8)  # fmt: skip
    first = torch.sort(pools.int(), dim=-1).values
    out = torch.full_like(want, 12345)
    got = te.expand_pools(first, meta.rows, meta.tail_len, meta.pool_hi, out, topk=k * kpool, kpool=kpool, tail="fixed")
    assert torch.equal(got, want)
    assert bool((want[:, 0] == -1).any()) and not torch.equal(
        want, assemble(pools, meta, pts, topk=k * kpool, kpool=kpool, tail="fixed", order="ascending", alignment=8))


def cuda_pooling_steps(k, gates, ape, pool_tok_start):
    """``compress_pools_bf16`` as the CUDA kernels of its torch ops compute it, step by step
    (the spatial softmax: maximum from FP32's lowest value with ``m < s ? s : m``, sum from
    0 in slot order, ``exp(s - m) / sum``; the BF16 products; their FP32 sum as the
    reduction kernel takes it, four accumulators from 0, slot ``j`` into ``j % 4``, combined
    in order, rounded once): the rule the model-pooling kernel follows, also for NaN and
    infinite gates, where CPU and CUDA softmax kernels may differ."""
    K = ape.shape[0]
    idx = pool_tok_start[:, None] + torch.arange(K)
    s = [gates[idx[:, j]].float() + ape[j].float() for j in range(K)]
    m = torch.full_like(s[0], torch.finfo(torch.float32).min)
    for x in s:
        m = torch.where(m < x, x, m)
    den = torch.zeros_like(m)
    for x in s:
        den = den + torch.exp(x - m)
    acc = [torch.zeros_like(m) for _ in range(4)]
    for j, x in enumerate(s):
        p = (torch.exp(x - m) / den).bfloat16()
        acc[j % 4] = acc[j % 4] + (p * k[idx[:, j]]).float()
    return (((acc[0] + acc[1]) + acc[2]) + acc[3]).bfloat16()


def same_bits(a, b):
    """Equal bit for bit, NaN payloads aside (torch and the GPU's conversion write
    different BF16 NaNs)."""
    a16, b16 = a.view(torch.int16), b.view(torch.int16)
    return bool(((a16 == b16) | (a.isnan() & b.isnan())).all())


def model_pool_inputs(S, D, K, seed, gates_dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(S, D, generator=g).bfloat16()
    gates = (torch.randn(S, D, generator=g) * 3).to(gates_dtype)
    ape = torch.randn(K, D, generator=g).bfloat16()
    # documents whose lengths are not multiples of K: pool starts off the multiples of K
    starts = pool_table(torch.tensor([0, S // 3 + 1, S // 2, S]), K)[0]
    return k, gates, ape, starts


@pytest.mark.parametrize("S,D,K,gdt", [(4 * 37 + 5, 128, 4, torch.bfloat16), (211, 64, 1, torch.float32),
                                       (16 * 600 + 3, 128, 16, torch.bfloat16), (4 * 16, 128, 4, torch.float32)])
def test_model_pools_follow_the_cuda_rule(S, D, K, gdt):
    # the CUDA torch ops' rule step by step; torch's CPU pooling too where it sums in the same
    # order (K <= 4); equality with the CUDA torch ops themselves: tests/gpu/test_serving_kernels.py
    k, gates, ape, starts = model_pool_inputs(S, D, K, S, gdt)
    got = ts.pools_model(k, gates, ape, starts)
    assert got.dtype == torch.bfloat16 and got.shape == (starts.numel(), D)
    assert torch.equal(got.view(torch.int16), cuda_pooling_steps(k, gates, ape, starts).view(torch.int16))
    if K <= 4:  # (torch's CPU reduction sums more slots in another order)
        assert torch.equal(got.view(torch.int16), compress_pools_bf16(k, gates, ape, starts).view(torch.int16))


def test_model_pools_nonfinite_gates_zero_keys_and_ties():
    S, D, K = 4 * 40, 64, 4
    k, gates, ape, starts = model_pool_inputs(S, D, K, 7)
    gates[0:4, 0] = float("nan")  # a pool with every slot NaN in channel 0
    gates[5, 1] = float("nan")  # one NaN slot: never the maximum, the pool's channel NaN
    gates[8:12, 2] = float("-inf")  # every slot -inf: 0 / 0
    gates[13, 3] = float("inf")  # inf - inf
    gates[16:20, 4] = -1e30  # far below: exp underflows except at the maximum
    gates[20:24, 5] = 2.5  # equal slots: equal probabilities
    gates[24:28] = 88.0  # large equal gates: exp(0) after the maximum is taken out
    k[28:32] = 0.0
    k[32:36] = -0.0  # signed zeros through the products and the sum
    got = ts.pools_model(k, gates, ape, starts)
    want = cuda_pooling_steps(k, gates, ape, starts)
    assert same_bits(got, want)
    assert bool(got[0, 0].isnan()) and bool(got[1, 1].isnan()) and bool(got[2, 2].isnan())
    assert not bool(got[:, 6:].isnan().any())


def test_model_pools_check_their_arguments():
    k, gates, ape, starts = model_pool_inputs(64, 64, 4, 3)
    with pytest.raises(ValueError, match="k: expected bfloat16"):
        ts.pools_model(k.float(), gates, ape, starts)
    with pytest.raises(ValueError, match=r"gates: expected the shape of k, \(64, 64\), got \(64, 32\)"):
        ts.pools_model(k, gates[:, :32], ape, starts)
    with pytest.raises(ValueError, match=r"ape: expected \[K, 64\], got \(4, 32\)"):
        ts.pools_model(k, gates, ape[:, :32], starts)
    with pytest.raises(ValueError, match="K = 8 slots of D = 64 channels"):
        ts.pools_model(k, gates, torch.zeros(8, 64), starts)
    with pytest.raises(ValueError, match="pool_tok_start: expected a 1-D int64 tensor"):
        ts.pools_model(k, gates, ape, starts.int())
    assert ts.pools_model(k, gates, ape, starts[:0]).shape == (0, 64)
    assert ts.pools_model_supports(4, 64) and ts.pools_model_supports(16, 128)
    assert not ts.pools_model_supports(32, 128) and not ts.pools_model_supports(8, 64)


def test_model_pools_divide_as_torch_does():
    # pools whose BF16 probabilities differ between exp(s - m) / sum and exp(s - m) * (1 /
    # sum) (about 1 in 10^5 random pools): found by search, planted as FP32 gates
    g = torch.Generator().manual_seed(0)
    s = torch.randn(1 << 21, 4, generator=g) * 3
    e = torch.exp(s - s.max(1, keepdim=True).values)
    den = ((e[:, 0] + e[:, 1]) + e[:, 2]) + e[:, 3]
    a, b = (e / den[:, None]).bfloat16(), (e * (1 / den[:, None])).bfloat16()
    picked = s[(a.view(torch.int16) != b.view(torch.int16)).any(1)][:8]
    assert picked.shape[0] == 8
    D, K = 64, 4
    k, _, _, starts = model_pool_inputs(4 * 8, D, K, 5)
    gates = picked.reshape(-1, 1).expand(-1, D).contiguous()  # slot j of pool i: picked[i, j], every channel
    starts = torch.arange(0, 4 * 8, 4)
    got = ts.pools_model(k, gates, torch.zeros(K, D), starts)
    # (torch's CPU softmax gives other bits on these pools: the CUDA rule is the reference)
    assert torch.equal(got.view(torch.int16), cuda_pooling_steps(k, gates, torch.zeros(K, D), starts).view(torch.int16))


def test_short_rows_all_never_writes_outside_a_row():
    # short_rows="all" with a row that breaks the guarantee (40 cells, k 3: a tile of 4): that
    # row's ids are wrong, but nothing outside its row of out is written (the others exact)
    s = torch.randn(3, 40, generator=torch.Generator().manual_seed(5))
    big = torch.full((5, 7), 777, dtype=torch.int32)
    starts, ends, base = torch.tensor([0, 0, 0]), torch.tensor([3, 40, 2]), torch.zeros(3, dtype=torch.int64)
    tk.topk_ascending(s, starts, ends, base, 3, short_rows="all", out=big[1:4, 2:5])
    want = exact_ascending(s, starts, ends, base, 3)
    assert torch.equal(big[1:4, 2:5][[0, 2]], want[[0, 2]])
    assert bool((big[[0, 4]] == 777).all() and (big[:, [0, 1, 5, 6]] == 777).all())
