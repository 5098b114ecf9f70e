# Two commands, from nothing: `make demo` and `make test` (CI runs `make test` via .ci/run).
VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
# Re-install when packaging changes.
STAMP   := $(VENV)/.prfaas-installed-$(shell cat pyproject.toml setup.py prfaas_sgl_boot.pth | sha1sum | cut -c1-12)
PYTEST  := $(PY) -m pytest -p no:cacheprovider
# Debian's prometheus: promtool for the monitoring tests, a server for the demo's monitored run (deploy/monitoring/)
APT_PROMETHEUS = command -v promtool >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && \
	(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus) || \
	echo "warning: prometheus missing (apt-get install prometheus): the promtool tests cannot pass, make demo reads /metrics directly"; }

.PHONY: setup models test test-fast test-sglang demo clean

setup: $(STAMP)

$(STAMP):
	@echo "== setup: venv + prfaas-sgl[sglang,test] (first run: ~5 min, ~11 GB)"
	@dpkg -s libibverbs1 >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && \
		(apt-get update -qq && apt-get install -y -qq libibverbs1) || \
		echo "warning: libibverbs1 missing (apt-get install libibverbs1): mooncake_tcp tests will fail"; }
	@$(APT_PROMETHEUS)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned: the local wheel satisfies sglang's pin, so no second multi-GB torch is pulled.
	$(PIP) install -q torch==2.14.1 torchvision==0.29.1
	$(PIP) install -q -e ".[sglang,test]"
	rm -f $(VENV)/.prfaas-installed-*
	touch $(STAMP)

models: setup
	$(PY) -m prfaas_sgl.tools.models.tiny

# One pytest run over both tiers (fast first, then real SGLang servers on CPU): one closing line for CI.
test: models
	$(PYTEST) tests -q -rs --timeout=1800

test-fast: setup
	$(PYTEST) tests/fast -q -rs

test-sglang: models
	$(PYTEST) tests/sglang -q -rs --timeout=1800

demo: models
	@$(APT_PROMETHEUS)
	$(PY) -m prfaas_sgl.tools.demo

clean:
	rm -rf $(VENV) out .pytest_cache
