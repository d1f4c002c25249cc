# Tooling around the reference: the demo, its tasks, benchmarks, checks and reports. Run from the repository
# root as modules, e.g. python -m tools.bench --help.
