#!/bin/bash
# arm 5's summaries in one: verify (arm5.json), the knob runs (knob.json, knob2.json if it finished).
cd /work/main/runs/real6 && rm -rf m && mkdir m && cd m
for f in arm5-b1.json arm5-b1.samples.jsonl arm5-fp32.json arm5-fp32.samples.jsonl arm5 arm5.train.log; do ln -s ../$f $f; done
python3 - <<'PY'
import json, os
merged, rows = {}, []
for name in ["arm5", "knob", "knob2"]:
    p = f"../{name}.json"
    if not os.path.exists(p):
        continue
    d = json.load(open(p)); s = d.pop("settings", None); merged |= d
    merged.setdefault("settings", s)
    rows += open(f"../{name}.samples.jsonl").read().splitlines()
json.dump(merged, open("arm5.json", "w"), indent=1)
open("arm5.samples.jsonl", "w").write("\n".join(rows) + "\n")
print(list(merged))
PY
