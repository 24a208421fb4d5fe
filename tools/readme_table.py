"""Print the README's Performance table from a benchmark JSON (dev tool, not shipped).

Usage: ``python3 tools/readme_table.py benchmarks/FILE.json``
"""
import json
import sys

data = json.load(open(sys.argv[1]))
print("| case | batch | dtype | mode | median µs | vs eager seq | × floor |")
print("|---|---|---|---|---|---|---|")
for r in data["results"]:
    for name, m in r["modes"].items():
        xf = f"{m['x_floor']:.2f}" if m.get("x_floor") else "–"
        print(f"| {r['case']} | {r['batch']} | {r['dtype']} | {name} | {m['median_us']:.1f} | "
              f"{m['speedup_vs_eager_seq']:.2f}× | {xf} |")
    if r.get("floor_us"):
        print(f"| {r['case']} | {r['batch']} | {r['dtype']} | *floor: longest branch graphed alone* | "
              f"{r['floor_us']:.1f} | | |")
    if "width" in r:  # the h2d model's width, calibrated so that its compute takes about as long as the copy
        print(f"| {r['case']} | {r['batch']} | {r['dtype']} | *model width (calibrated: compute ≈ copy)* | "
              f"{r['width']} | | |")
    stages = [k for k in r if k.startswith("stage") and k.endswith("_us")]
    for key, label in (("copy_us", "host-to-device copy alone"), ("compute_us", "compute alone"),
                       *((k, f"stage {k[5:-3]} alone") for k in stages)):
        if key in r:
            print(f"| {r['case']} | {r['batch']} | {r['dtype']} | *{label}* | {r[key]:.1f} | | |")
