#!/bin/bash
# arm 7's summaries in one: verify (arm7.json), the knob runs (knob.json).
cd /work/main/runs/real9 && rm -rf m && mkdir m && cd m
for f in arm7-b1.json arm7-b1.samples.jsonl arm7-fp32.json arm7-fp32.samples.jsonl arm7 arm7.train.log; do ln -s ../$f $f; done
python3 - <<'PY'
import json, os
merged, rows = {}, []
for name in ["arm7", "knob"]:
    p = f"../{name}.json"
    if not os.path.exists(p):
        continue
    d = json.load(open(p)); s = d.pop("settings", None); merged |= d
    merged.setdefault("settings", s)
    rows += open(f"../{name}.samples.jsonl").read().splitlines()
json.dump(merged, open("arm7.json", "w"), indent=1)
open("arm7.samples.jsonl", "w").write("\n".join(rows) + "\n")
print(list(merged))
PY
