import numpy as np, torch
torch.manual_seed(0)
H, D, P, k, G = 32, 128, 32768, 512, 8
kp = torch.randn(P, D)
rs2, rs4 = [], []
for r in range(40):
    q = torch.randn(H, D); w = torch.randn(H)
    W = 24576 + r * 200
    s = (torch.relu(q @ kp[:W].T) * w[:, None]).sum(0)
    s = s.numpy()
    ng = -(-W // G)
    ss = np.full(ng * G, -np.inf, dtype=np.float32); ss[:W] = s
    gm = ss.reshape(ng, G).max(1)
    L = np.sort(gm)[-k]
    T = np.sort(s)[-k]
    mn, mx = gm.min(), gm.max()
    rs2.append((L - mn) / (mx - mn)); rs4.append((T - L) / (mx - L))
print("phase 2 rel pos of L in [min,max]:", np.round(np.percentile(rs2, [0, 10, 50, 90, 100]), 4))
print("phase 4 rel pos of T in [L,max]:", np.round(np.percentile(rs4, [0, 10, 50, 90, 100]), 4))
