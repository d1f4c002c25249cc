#!/bin/bash
# After arm 7's training (docs/real-model.md): results/after.sh on runs/real9, its cost curve at batch 1,
# then the three evaluations in the plan's order, then the base's curve, which curve_base.sh measures on its
# own. runs/real9/base.json: results/real.json's base entry; base.samples.jsonl: results/real_samples/base.jsonl.
exec "$(dirname "$0")/../after.sh" arm7 runs/real9
