#!/bin/bash
# After arm 8's training (docs/real-model.md): results/after.sh on runs/real10, which runs arm 7's steps in
# their order (the adapter's cost curve at batch 1, then the three evaluations) and then the base's curve,
# which curve_base.sh measures on its own.
exec "$(dirname "$0")/../after.sh" arm8 runs/real10
