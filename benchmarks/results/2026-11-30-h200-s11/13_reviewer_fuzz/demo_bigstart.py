import sys, torch
sys.argv = ["x", "0", "0"]
src = open("/tmp/fuzz/fuzz_select.py").read().replace('if __name__ == "__main__":\n    main()', '')
src = src.replace('''    _check(self, ptrs, mask, False)
    if VIOL and CHECK:''', '''    _check(self, ptrs, mask, False)
    if VIOL and CHECK:''')
exec(compile(src, "fz", "exec"))
big = torch.randn(2, 8192)
s = big[:, :300]
for a in (2**31 - 1, 2**31 - 200, 2**31 - 3000):
    starts, ends = torch.tensor([a, 0]), torch.tensor([300, 300])
    base = torch.zeros(2, dtype=torch.int64)
    VIOL.clear()
    try:
        got = ts.topk_ascending(s, starts, ends, base, 4, tile=256)
        print(a, "ok" if torch.equal(got, exact_ascending(s, starts, ends, base, 4)) else "WRONG", VIOL[:2])
    except Exception as ex:
        print(a, "exception", repr(ex)[:300], VIOL[:2])
