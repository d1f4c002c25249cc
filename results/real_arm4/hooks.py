# t(n) of arm 4's adapter (a token and n - 1 masks) with shared-input updates and with one update per
# linear, and of the base (no adapter), interleaved, bf16, batch 1, context 256: budget.measure.
import json
import sys

import torch

sys.path.insert(0, ".")
import budget  # noqa: E402

from mars.checkpoint import load_model  # noqa: E402

torch.manual_seed(0)
widths = [1, 2, 4, 8, 12, 16]
ad = load_model("runs/real5/arm4", "cpu", torch.bfloat16).eval()
base = load_model("/work/real/coder05", "cpu", torch.bfloat16).eval()
shared, alone = dict(ad.adapter.group), {n: [n] for n in ad.adapter.names}
out = {"widths": widths, "shared": [], "alone": [], "base": []}
for _ in range(3):  # three interleaved repetitions
    for name in ("shared", "alone", "base"):
        if name != "base":
            ad.adapter.group = shared if name == "shared" else alone
        t = budget.measure(ad if name != "base" else base, 1, widths, context=256, reps=5)
        out[name].append(t)
        print(name, [round(x * 1000, 1) for x in t], flush=True)
print(json.dumps(out))
