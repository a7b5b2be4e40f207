import numpy as np, torch
torch.manual_seed(0)
H, D, P, k, G = 32, 128, 32768, 512, 8
kp = torch.randn(P, D)
def keys_of(x):
    i = x.view(torch.int32).numpy().astype(np.int64)
    key = np.where(i >= 0, i, i ^ 0x7FFFFFFF)
    key = np.where(i == -2147483648, 0, key)
    return key
def kth(vals, k, lo, stop, mode="split", vals_f=None):
    """returns steps. vals int64 keys"""
    cnt_lo = (vals >= lo).sum(); hi = vals.max() + 1; cnt_hi = 0; steps = 0
    while hi - lo > 1 and cnt_lo > stop:
        d = (hi - lo) // 3
        m1 = lo + max(d, 1); m2 = lo + max(2 * d, 1)
        for m in (m1, m2):
            c = (vals >= m).sum()
            if c >= k and m > lo: lo, cnt_lo = m, c
        for m in (m1, m2):
            c = (vals >= m).sum()
            if c < k and m < hi: hi, cnt_hi = m, c
        steps += 1
    return lo, steps
def key_to_float(key):
    i = np.where(key >= 0, key, key ^ 0x7FFFFFFF).astype(np.int32)
    return i.view(np.float32)
def kth_val(vals, k, lo, stop):
    """split in value space: thresholds = keys of floats at thirds of [f(lo), f(hi-1)]"""
    cnt_lo = (vals >= lo).sum(); hi = vals.max() + 1; cnt_hi = 0; steps = 0
    while hi - lo > 1 and cnt_lo > stop:
        flo, fhi = key_to_float(np.array([lo]))[0], key_to_float(np.array([hi - 1]))[0]
        if steps % 2 == 1 or not np.isfinite(flo):  # alternate with key-space thirds (safeguard)
            d = (hi - lo) // 3; ms = (lo + max(d, 1), lo + max(2 * d, 1))
        else:
            fs = [flo + (fhi - flo) * t for t in (1/3, 2/3)]
            ms = [int(np.clip(keys_of(torch.tensor([f], dtype=torch.float32))[0], lo + 1, hi - 1)) for f in fs]
            ms = sorted(ms)
        for m in ms:
            c = (vals >= m).sum()
            if c >= k and m > lo: lo, cnt_lo = m, c
        for m in ms:
            c = (vals >= m).sum()
            if c < k and m < hi: hi, cnt_hi = m, c
        steps += 1
    return lo, steps
res = {"p2": [], "p4": [], "p2min": [], "p2v": [], "p4v": []}
for r in range(20):
    q = torch.randn(H, D); w = torch.randn(H)
    W = 24576 + r * 400
    s = (torch.relu(q @ kp[:W].T) * w[:, None]).sum(0) * (H ** -0.5 * D ** -0.5)
    key = keys_of(s.float())
    ng = -(-W // G)
    kk = np.full(ng * G, -2**31, dtype=np.int64); kk[:W] = key
    gm = kk.reshape(ng, G).max(1)
    MINK = -2**31
    low, st2 = kth(gm, k, MINK, 512)
    res["p2"].append(st2)
    _, st2m = kth(gm, k, gm.min(), 512); res["p2min"].append(st2m)
    lowv, st2v = kth_val(gm, k, gm.min(), 512); res["p2v"].append(st2v)
    cand = kk.reshape(ng, G)[gm >= low].ravel()
    _, st4 = kth(cand, k, low, k); res["p4"].append(st4)
    _, st4v = kth_val(cand, k, low, k); res["p4v"].append(st4v)
    if r == 0: print("logit range", s.min().item(), s.max().item(), "low", key_to_float(np.array([low])), "ncand", cand.size)
for n, v in res.items(): print(n, np.mean(v), min(v), max(v))

def kth_mode(vals, k, lo, stop, policy):
    cnt_lo = (vals >= lo).sum(); hi = vals.max() + 1; steps = 0
    while hi - lo > 1 and cnt_lo > stop:
        use_val = policy(steps)
        flo, fhi = key_to_float(np.array([lo]))[0], key_to_float(np.array([hi - 1]))[0]
        d = (hi - lo) // 3; ms = (lo + max(d, 1), lo + max(2 * d, 1))
        if use_val and np.isfinite(flo) and np.isfinite(fhi):
            fs = np.array([flo + (fhi - flo) / 3, flo + (fhi - flo) * 2 / 3], dtype=np.float32)
            mv = keys_of(torch.from_numpy(fs))
            mv = np.clip(mv, lo + 1, hi - 1)
            ms = (min(mv), max(mv))
        for m in ms:
            c = (vals >= m).sum()
            if c >= k and m > lo: lo, cnt_lo = m, c
        for m in ms:
            c = (vals >= m).sum()
            if c < k and m < hi: hi = m
        steps += 1
    return lo, steps
pols = {"key": lambda s: False, "alt": lambda s: s % 2 == 0, "val": lambda s: True, "first2": lambda s: s < 2 or s % 2 == 0, "val_then_key4": lambda s: s < 4}
torch.manual_seed(1)
for dist in ("dg", "relu8", "normal"):
    out = {n: [[], []] for n in pols}
    for r in range(30):
        W = 24576 + r * 270
        if dist == "dg":
            q = torch.randn(H, D); w = torch.randn(H)
            s = (torch.relu(q @ kp[:W].T) * w[:, None]).sum(0) * (H ** -0.5 * D ** -0.5)
        elif dist == "relu8":
            s = (torch.randn(8, 1) * torch.randn(8, W).relu()).sum(0)
        else:
            s = torch.randn(W) * 0.01 + 5
        key = keys_of(s.float()); ng = -(-W // G)
        kk = np.full(ng * G, -2**31, dtype=np.int64); kk[:W] = key
        gm = kk.reshape(ng, G).max(1)
        for n, pol in pols.items():
            low, s2 = kth_mode(gm, k, -2**31 if True else 0, 512, pol)
            low = max(low, -2**31 + 1)
            cand = kk.reshape(ng, G)[gm >= low].ravel()
            _, s4 = kth_mode(cand, k, low, k, pol)
            out[n][0].append(s2); out[n][1].append(s4)
    print(dist, {n: (np.mean(a), max(a), np.mean(b), max(b)) for n, (a, b) in out.items()})
print("---- from min visible")
for dist in ("dg", "relu8", "normal"):
    out = {n: [[], []] for n in pols}
    for r in range(30):
        W = 24576 + r * 270
        if dist == "dg":
            q = torch.randn(H, D); w = torch.randn(H)
            s = (torch.relu(q @ kp[:W].T) * w[:, None]).sum(0) * (H ** -0.5 * D ** -0.5)
        elif dist == "relu8":
            s = (torch.randn(8, 1) * torch.randn(8, W).relu()).sum(0)
        else:
            s = torch.randn(W) * 0.01 + 5
        key = keys_of(s.float()); ng = -(-W // G)
        kk = np.full(ng * G, -2**31, dtype=np.int64); kk[:W] = key
        gm = kk.reshape(ng, G).max(1)
        for n, pol in pols.items():
            low, s2 = kth_mode(gm, k, gm[gm > -2**31].min(), 512, pol)
            cand = kk.reshape(ng, G)[gm >= low].ravel()
            _, s4 = kth_mode(cand, k, low, k, pol)
            out[n][0].append(s2); out[n][1].append(s4)
    print(dist, {n: (round(np.mean(a),2), max(a), round(np.mean(b),2), max(b)) for n, (a, b) in out.items()})
