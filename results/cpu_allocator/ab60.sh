#!/bin/bash
# train.py as it is (freed memory kept), then with MALLOC_MMAP_MAX_ set, which train.py leaves alone: any of
# glibc's mmap variables set turns off its sliding mmap threshold, so every block over 128 KiB is mapped and
# returned (the least memory). 60 steps each, side by side.
cd /work/main
STEPS=60 results/cpu_allocator/ab.sh keep60
STEPS=60 results/cpu_allocator/ab.sh static60 MALLOC_MMAP_MAX_=65536
