#!/bin/bash
# The adapter's decode hooks before (e465560: the low-rank products in bf16, then a select per linear) and
# after (aaa187f: the low-rank products in float32, the gate folded into the low-rank input, the update
# added in place) on arm 8's adapter, side by side, as hooks_ab.sh runs them (runs/real10/f32_ab/).
exec "$(dirname "$0")/hooks_ab.sh" e465560 aaa187f f32_ab
