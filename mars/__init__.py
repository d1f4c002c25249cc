# The product around the method: tokenizer, files and hub, data formats, CLI flags, checkpoints, run
# bookkeeping, self-verification, the adapter, the draft budget, the server and eval. The method itself is
# the five files at the root (model, data, train, generate, kvcache).
