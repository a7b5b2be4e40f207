import csv, sys
def load(path):
    rows = []; f = None
    for r in csv.reader(open(path)):
        if not r: continue
        if r[0] == "File Path": f = r[1].split("/")[-1]; continue
        if r[0] == "Line No": hdr = r; continue
        if r[0] and r[0].isdigit():
            d = dict(zip(hdr, r)); 
            rows.append((f, int(r[0]), r[1][:90], int(r[4]) if r[4].isdigit() else 0, int(r[7]) if r[7].isdigit() else 0))
    return rows
rows = load(sys.argv[1])
ts = sum(r[3] for r in rows); ti = sum(r[4] for r in rows)
print("total samples", ts, "warp instr", ti)
for r in sorted(rows, key=lambda r: -r[3])[:int(sys.argv[2]) if len(sys.argv) > 2 else 45]:
    print(f"{r[3]/ts*100:5.1f}% smp {r[4]/ti*100:5.1f}% ins  {r[0][:16]}:{r[1]:<4d} {r[2]}")
