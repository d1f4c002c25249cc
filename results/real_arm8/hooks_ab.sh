#!/bin/bash
# results/hooks_ab.sh on arm 8's adapter (runs/real10/arm8), writing runs/real10/NAME/:
#   results/real_arm8/hooks_ab.sh OLD NEW NAME
# With no arguments, the folded gate (566a9f9: one addmm_ into the output) against the low-rank update and
# a select per linear before it (108fc2e); f32_ab.sh runs the float32 products against e465560.
exec "$(dirname "$0")/../hooks_ab.sh" "${1:-108fc2e}" "${2:-566a9f9}" "${3:-hooks_ab}" runs/real10/arm8 runs/real10
