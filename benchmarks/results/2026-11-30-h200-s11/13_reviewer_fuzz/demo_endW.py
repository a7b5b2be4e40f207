import sys, torch
sys.argv = ["x", "0", "0"]
src = open("/tmp/fuzz/fuzz_select.py").read().replace('if __name__ == "__main__":\n    main()', '')
# record read violations without raising; raise only on writes
src = src.replace('''    _check(self, ptrs, mask, False)
    if VIOL and CHECK:''', '''    _check(self, ptrs, mask, False)
    if False:''')
exec(compile(src, "fz", "exec"))
W = 256
big = torch.randn(2, 4096)
s = big[:, :W]
starts, ends = torch.tensor([0, 0]), torch.tensor([3000, W])
base = torch.zeros(2, dtype=torch.int64)
VIOL.clear()
try:
    got = ts.topk_ascending(s, starts, ends, base, 4, tile=256, programs=2)
    print("got", got.tolist())
except Exception as ex:
    print("exception", repr(ex)[:300])
print("violations:", VIOL[:4])
print("want", exact_ascending(s, starts, ends, base, 4).tolist())
