import os, shutil, subprocess, sys
K = "sp_kpool/kernels/triton_select.py"
M = {
 "M1_i0_zero": ("i0 = (a > a0).to(tl.int32)", "i0 = (a > a0).to(tl.int32) * 0"),
 "M2_i1_plus1": ("i1 = tl.maximum((e - a0) // TILE, i0)", "i1 = tl.maximum((e - a0 + TILE - 1) // TILE, i0)"),
 "M3_skip_last": ("for i in range(0, i0 + 1):", "for i in range(0, i0):"),
 "M4_top_low": ("t, n_ge, n_gt, _t = kth_largest(key, k, low, k, WAYS, (F4B > 0) * 1, top, F4A, F4B,",
                "t, n_ge, n_gt, _t = kth_largest(key, k, low, k, WAYS, (F4B > 0) * 1, low, F4A, F4B,"),
 "M5_top_minus1": ("t, n_ge, n_gt, _t = kth_largest(key, k, low, k, WAYS, (F4B > 0) * 1, top, F4A, F4B,",
                   "t, n_ge, n_gt, _t = kth_largest(key, k, low, k, WAYS, (F4B > 0) * 1, tl.maximum(top - 1, low), F4A, F4B,"),
 "M6_nc_minus1": ("                    nc = n_low\n", "                    nc = n_low - (n_low > k).to(tl.int32)\n"),
 "M7_nan_as_inf": ("m = tl.max(tl.max(v, axis=2), axis=1)", "m = tl.max(tl.max(tl.where(v == v, v, float('inf')), axis=2), axis=1)"),
 "M8_gidx_off": ("tl.store(gbase + gidx + z1, row_keys(m, m == m))", "tl.store(gbase + gidx + z1 + 1, row_keys(m, m == m))"),
 "M9_no_end_clamp": (".clamp(max=W).contiguous()", ".contiguous()"),
 "M10_first_tile_idx": ("t0 = a0 + tl.where(i < i0, 0, i1) * TILE", "t0 = a0 + tl.where(i < i0, 0, tl.maximum(i1 - 1, i0)) * TILE"),
 "M11b_cnt_hi_plus1": ("        if top is None:\n            top = tl.max(vals)", "        if top is None:\n            top = tl.max(vals)\n        else:\n            cnt_hi = cnt_hi + 1"),
 "M11_cnt_hi_stale": ("        if top is None:\n            top = tl.max(vals)", "        if top is None:\n            top = tl.max(vals)\n        else:\n            cnt_hi = cnt_hi + (top < 0).to(tl.int32)"),
}
name = sys.argv[1]
dst = f"/tmp/mut/{name}"
shutil.rmtree(dst, ignore_errors=True)
shutil.copytree("/tmp/review_wt", dst, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", ".hypothesis", ".pytest_cache"))
old, new = M[name]
src = open(f"{dst}/{K}").read()
assert src.count(old) == 1, (name, src.count(old))
open(f"{dst}/{K}", "w").write(src.replace(old, new))
env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=dst)
tests = "tile_geometry or first_split or nan_is_never or value_split or skewed or random_rows or ties or streamed or tiny or odd_width"
r = subprocess.run(["/tmp/venv/bin/python", "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", f"{dst}/tests/unit/triton_interp_cases.py", "-k", tests],
                   env=env, capture_output=True, text=True, timeout=1200)
last = [l for l in r.stdout.splitlines() if "passed" in l or "failed" in l or "error" in l.lower()][-1:]
fl = [l for l in r.stdout.splitlines() if l.startswith("FAILED")][:1]
print(name, "TESTS:", last, fl)
r = subprocess.run(["/tmp/venv/bin/python", "/tmp/fuzz/fuzz_select.py", "7", "100", "--budget", "150"], env=env, capture_output=True, text=True, timeout=1200)
done = [l for l in r.stdout.splitlines() if l.startswith("DONE")]
nf = sum(l.startswith("FAIL") for l in r.stdout.splitlines())
print(name, "FUZZ fails:", nf, done[0][:80] if done else r.stdout[-300:] + r.stderr[-500:])
