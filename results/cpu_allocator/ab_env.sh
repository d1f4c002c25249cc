#!/bin/bash
# Before cli.keep_freed_memory existed: train.py under glibc's default, then with the same setting by environment.
cd /work/main
STEPS=60 results/cpu_allocator/ab.sh base60
STEPS=60 results/cpu_allocator/ab.sh nommap60 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000
