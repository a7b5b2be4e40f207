"""Adversarial fuzz of sp_kpool.kernels.triton_select.topk_ascending in the Triton interpreter.

usage: TRITON_INTERPRET=1 PYTHONPATH=<tree> python fuzz_select.py SEED NCASES [--budget SECONDS] [--log FILE]

Checks per case: output == exact rule (topk_pools), every memory access of the kernel lies
within the allowed part of its arguments (scores: row r, columns < roundup(W, G); Gmax / Cand:
the program's own row; Out: row r columns < k), out= padding untouched, no hang (alarm).
"""
import os
import random
import signal
import sys
import time
import traceback
import json

os.environ["TRITON_INTERPRET"] = "1"
import numpy as np  # noqa: E402
import torch  # noqa: E402

from sp_kpool.selection import _ascending, topk_pools  # noqa: E402
from sp_kpool.testing.triton_interp import interpreted_module  # noqa: E402

ts = interpreted_module("sp_kpool.kernels.triton_select")
import triton.runtime.interpreter as I  # noqa: E402
import warnings  # noqa: E402

warnings.filterwarnings("ignore")
np.seterr(all="ignore")

# ---------------------------------------------------------------- memory-access checker
CHECK = {}
VIOL = []


def _addrs(ptrs, mask):
    p = ptrs.data
    if mask is None:
        return p.reshape(-1)
    m = np.broadcast_to(mask.data, p.shape)
    return p[m]


def _check(builder, ptrs, mask, write):
    if not CHECK:
        return
    a = _addrs(ptrs, mask).astype(np.uint64)
    if a.size == 0:
        return
    esz = ptrs.get_element_ty().primitive_bitwidth // 8
    ok = np.zeros(a.shape, bool)
    pid = builder.grid_idx[0]
    for name, reg in CHECK.items():
        if write and name not in ("Gmax", "Cand", "Out"):
            continue
        if not write and name == "Out":
            continue
        base = np.uint64(reg["ptr"])
        inr = (a >= base) & (a < base + np.uint64(reg["bytes"]))
        if not inr.any():
            continue
        off = (a[inr] - base).astype(np.int64)
        if (off % esz).any() or esz != reg["esz"]:
            VIOL.append(f"{name}: misaligned/size access")
        el = off // esz
        if name == "S":
            st_, sp_ = reg["stride"], reg["span"]
            good = np.zeros(el.shape, bool)
            r_hi = el // st_
            for d in range(0, -(-sp_ // st_) + 1):
                r = r_hi - d
                good |= (r >= 0) & (r < reg["R"]) & (el - r * st_ < sp_)
        elif name in ("Gmax", "Cand"):
            good = (el >= pid * reg["w"]) & (el < (pid + 1) * reg["w"])
        elif name == "Out":
            row, col = el // reg["stride"], el % reg["stride"]
            good = (row < reg["R"]) & (col < reg["k"])
        else:
            good = el < reg["n"]
        idx = np.nonzero(inr)[0]
        ok[idx[good]] = True
        if not good.all():
            bad = el[~good][:5]
            VIOL.append(f"{'write' if write else 'read'} {name} pid={pid} bad elements {bad.tolist()}")
            ok[idx] = True  # reported
    if not ok.all():
        VIOL.append(f"{'write' if write else 'read'} outside every argument: {a[~ok][:3].tolist()}")


_orig_load = I.InterpreterBuilder.create_masked_load
_orig_store = I.InterpreterBuilder.create_masked_store


def _load(self, ptrs, mask, other, *a, **kw):
    _check(self, ptrs, mask, False)
    if VIOL and CHECK:  # do not touch bad memory
        raise RuntimeError("memory violation: " + VIOL[-1])
    return _orig_load(self, ptrs, mask, other, *a, **kw)


STORE_LOG = []


def _store(self, ptrs, value, mask, *a, **kw):
    _check(self, ptrs, mask, True)
    if os.environ.get("FUZZ_LOG_OUT") and "Out" in CHECK:
        STORE_LOG.append((self.grid_idx[0], (_addrs(ptrs, mask).astype(np.int64) - CHECK["Out"]["ptr"]) // 4,
                          np.broadcast_to(value.data, ptrs.data.shape)[np.broadcast_to(mask.data, ptrs.data.shape)]))
        VIOL.clear()
    if VIOL and CHECK:
        raise RuntimeError("memory violation: " + VIOL[-1])
    return _orig_store(self, ptrs, value, mask, *a, **kw)


I.InterpreterBuilder.create_masked_load = _load
I.InterpreterBuilder.create_masked_store = _store

_orig_kernel = ts.select_kernel
LAUNCHES = []


class _Wrapped:
    def __getitem__(self, grid):
        def launch(S, stride_s, starts, ends, base, Out, stride_o, Gmax, Cand, R, k, nprog, **consts):
            G = consts["G"]
            W = S.shape[1]
            span = -(-W // G) * G
            gen = torch.Generator().manual_seed(len(LAUNCHES) + 12345)
            Gmax.copy_(torch.randint(-2**31, 2**31 - 1, Gmax.shape, generator=gen, dtype=torch.int64).to(torch.int32))
            Cand.copy_(torch.randint(-2**31, 2**31 - 1, Cand.shape, generator=gen, dtype=torch.int64).to(torch.int32))
            st = S.untyped_storage()
            assert S.stride(1) == 1
            CHECK.clear()
            CHECK["S"] = dict(ptr=S.data_ptr(), bytes=st.nbytes() - S.storage_offset() * 4, esz=4, stride=stride_s, R=R,
                              span=span)
            for nm, t in (("starts", starts), ("ends", ends), ("base", base)):
                CHECK[nm] = dict(ptr=t.data_ptr(), bytes=t.numel() * t.element_size(), esz=t.element_size(), n=t.numel())
            CHECK["Out"] = dict(ptr=Out.data_ptr(), bytes=((R - 1) * stride_o + k) * 4, esz=4,
                                stride=stride_o, R=R, k=k)
            CHECK["Gmax"] = dict(ptr=Gmax.data_ptr(), bytes=Gmax.numel() * 4, esz=4, w=Gmax.shape[1])
            CHECK["Cand"] = dict(ptr=Cand.data_ptr(), bytes=Cand.numel() * 4, esz=4, w=Cand.shape[1])
            LAUNCHES.append(dict(grid=grid, W=W, R=R, k=k, **{c: consts[c] for c in ("TILE", "G", "NG", "CAPG", "WAYS")},
                                 VSTEPS=consts.get("VSTEPS", 0)))
            try:
                _orig_kernel[grid](S, stride_s, starts, ends, base, Out, stride_o, Gmax, Cand, R, k, nprog, **consts)
            finally:
                CHECK.clear()
        return launch


ts.select_kernel = _Wrapped()

STREAMED = [0]
_orig_ck = ts.candidate_keys


def _ck(*args, **kw):
    masked = args[-1] if len(args) >= 11 else kw.get("MASKED")
    if bool(getattr(masked, "value", masked)):
        STREAMED[0] += 1
    return _orig_ck(*args, **kw)


ts.candidate_keys = _ck

# ---------------------------------------------------------------- streamed-path detector
# count rows that reach phase 4' (nc > CAPG): patch split5 use? Simpler: compute on host.


def exact_ascending(scores, starts, ends, base, k):
    cols = torch.arange(scores.shape[1])
    vis = (cols[None] >= starts[:, None]) & (cols[None] < ends[:, None]) & (scores != -float("inf"))
    p, ok = topk_pools(scores, vis, k, 0)
    p = _ascending(torch.where(ok, p + base[:, None], -1))
    out = torch.full((scores.shape[0], k), -1, dtype=torch.int64)
    out[:, : p.shape[1]] = p
    return out.int()


def bits(x):
    return torch.tensor([x], dtype=torch.int64).to(torch.int32).view(torch.float32).item()


NANS = [float("nan"), -float("nan"), bits(0x7F800001), bits(0x7FFFFFFF), bits(-1), bits(0xFF800001 - 2**32)]


def gen_row(rng, g, W, G, TILE, a, e):
    kind = rng.choice(["randn", "ints", "const", "denorm", "binades", "sparse", "nan", "extreme", "mixed", "tiny_ints",
                       "relu", "const_top"])
    if kind == "randn":
        s = torch.randn(W, generator=g) * rng.choice([1.0, 1e-3, 1e3])
    elif kind == "ints":
        L = rng.choice([1, 2, 3, 5, 50])
        s = torch.randint(-L, L + 1, (W,), generator=g).float()
    elif kind == "tiny_ints":
        s = torch.randint(0, 2, (W,), generator=g).float()
    elif kind == "const":
        s = torch.full((W,), rng.choice([0.0, -0.0, 1.0, -2.5, 1e-45, -1e-45, 3e38, float("inf")]))
    elif kind == "const_top":
        s = torch.full((W,), rng.choice([0.0, 1.0, -1.0]))
        n = rng.randint(1, 40)
        idx = torch.randint(0, W, (n,), generator=g)
        s[idx] = torch.randn(n, generator=g).abs() + 2
    elif kind == "denorm":
        s = torch.randn(W, generator=g) * 1e-40
        if rng.random() < 0.5:
            s[torch.rand(W, generator=g) < 0.3] = rng.choice([0.0, -0.0])
        if rng.random() < 0.3:
            s = s.abs() if rng.random() < 0.5 else -s.abs()
    elif kind == "binades":
        s = torch.exp(torch.randn(W, generator=g) * rng.choice([8.0, 30.0])) * torch.sign(torch.randn(W, generator=g))
    elif kind == "sparse":
        s = torch.full((W,), -float("inf"))
        n = rng.randint(0, 50)
        idx = torch.randint(0, W, (n,), generator=g)
        s[idx] = torch.randn(n, generator=g)
    elif kind == "nan":
        s = torch.randn(W, generator=g)
        p = rng.choice([0.1, 0.5, 0.9, 0.99, 1.0])
        m = torch.rand(W, generator=g) < p
        s[m] = rng.choice(NANS)
        if rng.random() < 0.5:  # whole groups of NaN / NaN + -inf
            for _ in range(rng.randint(1, 20)):
                gi = rng.randrange(0, -(-W // G))
                s[gi * G:(gi + 1) * G] = rng.choice(NANS)
                if rng.random() < 0.3:
                    s[gi * G] = -float("inf")
    elif kind == "extreme":
        vals = torch.tensor([float("inf"), -float("inf"), 3.4028235e38, -3.4028235e38, 1e-45, -1e-45, 0.0, -0.0,
                             1.1754944e-38, -1.1754944e-38, 1.0, -1.0])
        s = vals[torch.randint(0, len(vals), (W,), generator=g)]
    elif kind == "relu":
        s = torch.randn(W, generator=g).relu() * 3
    else:  # mixed
        s = torch.randn(W, generator=g)
        for v in [float("inf"), -float("inf"), float("nan"), -0.0, 1e-42, 3e38, -3e38]:
            s[torch.rand(W, generator=g) < 0.02] = v
    s = s.float()
    # leak detectors: outside [a, e) make cells very attractive
    if rng.random() < 0.5:
        v = rng.choice([float("inf"), 3e38, 1e30])
        lo, hi = max(a, 0), min(max(e, 0), W)
        if lo > 0:
            s[max(0, lo - rng.randint(1, 3 * G)):lo] = v
        if hi < W and hi >= lo:
            s[hi:min(W, hi + rng.randint(1, 3 * G))] = v
    # plant the row maximum in the first / last tile
    if rng.random() < 0.3 and e > a and a < W:
        c = rng.choice([max(a, 0), min(e, W) - 1, max(a, 0) + rng.randint(0, G), min(e, W) - 1 - rng.randint(0, G)])
        if 0 <= c < W:
            s[c] = rng.choice([1e20, float("inf")])
    return s


def pick_pos(rng, W, G, TILE):
    nt = max(1, W // TILE + 1)
    t = rng.randint(0, nt)
    d = rng.choice([-G - 1, -G, -G + 1, -1, 0, 1, G - 1, G, G + 1, 2 * G - 1])
    c = rng.random()
    if c < 0.45:
        return t * TILE + d
    if c < 0.6:
        return rng.choice([0, 1, 2, 3, G - 1, G, G + 1, W - 1, W, W - G, W - G + 1, W + 1])
    if c < 0.65:
        return rng.choice([W + TILE, W + 3 * TILE + 5, -5, -TILE])
    return rng.randint(0, W)


def make_case(rng, ci):
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    size = rng.random()
    min_group = rng.choice([4, 8])
    if size < 0.2:
        W = rng.randint(1, 64)
    elif size < 0.7:
        W = rng.randint(64, 1500)
    elif size < 0.97:
        W = rng.randint(1500, 5000)
    else:
        W = rng.randint(65537, 70000)  # groups of 16
    if W > 65536:
        tile = rng.choice([1024, 2048, 4096])
    else:
        tile = rng.choice([16, 32, 64, 128, 128, 256, 256, 512])
    # k
    kc = rng.random()
    if kc < 0.3:
        k = rng.randint(1, 8)
    elif kc < 0.6:
        k = rng.randint(1, 300)
    elif kc < 0.8:
        k = rng.choice([16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 511, 512, 513])
    else:
        k = rng.choice([1000, 1023, 1024, 1025, 2047, 2048, rng.randint(300, 2048)])
    tile_, G, ng, capg_def = ts._sizes(W, k, tile, None, min_group)
    if ng > 8192 or capg_def * G > 32768:
        return None
    capg = None
    if rng.random() < 0.3:
        capg = ts._pow2(k) * rng.choice([1, 1, 2])
        if capg * G > 32768:
            capg = None
    R = rng.randint(1, 5) if W < 5000 else rng.randint(1, 2)
    starts, ends = [], []
    for _ in range(R):
        a = pick_pos(rng, W, G, tile_)
        if rng.random() < 0.6:
            e = pick_pos(rng, W, G, tile_)
            if e < a and rng.random() < 0.8:
                a, e = e, a
        else:
            e = rng.choice([W, W, W - rng.randint(0, 3), W + rng.randint(1, 700)])
        starts.append(a)
        ends.append(e)
    starts_t, ends_t = torch.tensor(starts), torch.tensor(ends)
    rows = [gen_row(rng, g, W, G, tile_, starts[r], ends[r]) for r in range(R)]
    s = torch.stack(rows)
    layout = rng.choice(["contig", "contig", "view"])
    if layout == "view":
        extra = rng.choice([1, 7, 64, 300])
        big = torch.full((R, W + extra), 3e38)
        big[:, :W] = s
        s = big[:, :W]
    kw = dict(tile=tile, min_group=min_group)
    if capg:
        kw["capg"] = capg
    kw["ways"] = rng.choice([2, 3, 3, 5])
    kw["search"] = "interp" if rng.random() < 0.15 else "split"
    vc = rng.random()
    if vc < 0.2:
        kw["vsteps"] = 0
    elif vc < 0.5:
        kw["vsteps"] = rng.randint(1, 6)
    for nm in ("split2", "split4"):
        c = rng.random()
        if c < 0.15:
            kw[nm] = ()
        elif c < 0.4:
            a_ = rng.random()
            b_ = rng.random()
            a_, b_ = min(a_, b_), max(a_, b_)
            if a_ > 0 and a_ < b_ < 1:
                kw[nm] = (a_, b_)
        elif c < 0.55:
            kw[nm] = rng.choice([(1e-7, 2e-7), (0.9999998, 0.9999999), (0.5, 0.5000001), (1e-30, 0.999999)])
    if rng.random() < 0.5:
        kw["programs"] = rng.choice([1, 2, 3])
    use_out = rng.random() < 0.3
    return dict(s=s, starts=starts_t, ends=ends_t, k=k, kw=kw, use_out=use_out, W=W, G=G, tile=tile_)


class Timeout(Exception):
    pass


def _alarm(*_):
    raise Timeout()


def run_case(c):
    s, starts, ends, k, kw = c["s"], c["starts"], c["ends"], c["k"], c["kw"]
    R = s.shape[0]
    base = torch.arange(R, dtype=torch.int64) * 100000 + 7
    out = None
    if c["use_out"]:
        big = torch.full((R + 2, k + 9), 0x7EADBEEF, dtype=torch.int32)
        out = big[1:R + 1, 4:4 + k]
    VIOL.clear()
    LAUNCHES.clear()
    STREAMED[0] = 0
    got = ts.topk_ascending(s, starts, ends, base, k, out=out, **kw)
    c["streamed"] = STREAMED[0] > 0
    want = exact_ascending(s, starts, ends, base, k)
    errs = list(VIOL)
    if not torch.equal(got, want):
        bad = [r for r in range(R) if not torch.equal(got[r], want[r])]
        errs.append(f"mismatch rows {bad}")
    if out is not None:
        keep = torch.ones_like(big, dtype=torch.bool)
        keep[1:R + 1, 4:4 + k] = False
        if not bool((big[keep] == 0x7EADBEEF).all()):
            errs.append("out padding overwritten")
    return errs, got, want


def main():
    seed = int(sys.argv[1])
    n = int(sys.argv[2])
    budget = float(sys.argv[sys.argv.index("--budget") + 1]) if "--budget" in sys.argv else 1e9
    log = sys.argv[sys.argv.index("--log") + 1] if "--log" in sys.argv else None
    rng = random.Random(seed)
    t0 = time.time()
    stats = dict(cases=0, fails=0, G={}, ways={}, search={}, streamed=0, launches=0, rows=0, ks=[], tiles={})
    fails = []
    signal.signal(signal.SIGALRM, _alarm)
    i = 0
    while stats["cases"] < n and time.time() - t0 < budget:
        i += 1
        c = make_case(rng, i)
        if c is None:
            continue
        signal.alarm(300)
        try:
            errs, got, want = run_case(c)
        except Timeout:
            errs = ["TIMEOUT (300 s)"]
        except Exception as ex:  # noqa: BLE001
            errs = ["exception " + repr(ex)[:300]]
        finally:
            signal.alarm(0)
        stats["cases"] += 1
        stats["rows"] += c["s"].shape[0]
        stats["G"][c["G"]] = stats["G"].get(c["G"], 0) + 1
        stats["tiles"][c["tile"]] = stats["tiles"].get(c["tile"], 0) + 1
        w = c["kw"]["ways"]
        stats["ways"][w] = stats["ways"].get(w, 0) + 1
        stats["search"][c["kw"]["search"]] = stats["search"].get(c["kw"]["search"], 0) + 1
        stats["ks"].append(c["k"])
        stats["streamed"] += bool(c.get("streamed"))
        stats["ends_past_W"] = stats.get("ends_past_W", 0) + int((c["ends"] > c["W"]).any())
        if errs:
            stats["fails"] += 1
            rec = dict(case=i, seed=seed, errs=errs, W=c["W"], k=c["k"], kw={kk: v for kk, v in c["kw"].items()},
                       starts=c["starts"].tolist(), ends=c["ends"].tolist(), use_out=c["use_out"],
                       view=c["s"].stride(0) != c["s"].shape[1])
            fails.append(rec)
            print("FAIL", json.dumps(rec, default=str), flush=True)
            torch.save(dict(c=c), f"/tmp/fuzz/fail_{seed}_{i}.pt")
        if stats["cases"] % 20 == 0:
            print(f"[{seed}] {stats['cases']} cases, {stats['fails']} fails, {time.time() - t0:.0f}s", flush=True)
    ks = stats.pop("ks")
    stats["k_min"], stats["k_max"] = min(ks), max(ks)
    stats["k_ge_1024"] = sum(k >= 1024 for k in ks)
    stats["time_s"] = round(time.time() - t0)
    print("DONE", json.dumps(stats, default=str), flush=True)
    if log:
        with open(log, "w") as f:
            json.dump(dict(stats=stats, fails=fails), f, default=str)


if __name__ == "__main__":
    main()
