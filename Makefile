# deviceplane — `make demo` to see it run, `make test` to install everything and run the whole suite.
PYTHON ?= python3
CACHE ?= $(HOME)/.cache/deviceplane
export PATH := $(CACHE)/bin:$(PATH)

.PHONY: deps k8s-bins promtool proto crds image lint test unit demo bench compare clean

deps:  ## the package with every extra (cluster, operator, demo) and the test tools
	$(PYTHON) -m pip install -q -e '.[cluster,operator,demo,test,bench]'
	@# An editable install leaves the checkout without bytecode, and with PYTHONDONTWRITEBYTECODE set (as on CI) every
	@# agent, plugin and operator process the tests start would compile the package again (0.3-0.55 s each, here).
	$(PYTHON) -m compileall -q deviceplane

k8s-bins:  ## real kube-apiserver, controller-manager, scheduler, kubectl, etcd, kwok and Go device plugins (cached)
	bash tests/k8s/build.sh

promtool:  ## `promtool check metrics` for the metrics tests
	bash scripts/install-promtool.sh

proto:  ## regenerate deviceplane/api from proto/
	$(PYTHON) scripts/gen_proto.py

crds:  ## regenerate crds/ from the pydantic models in deviceplane/api
	$(PYTHON) scripts/gen_crds.py

image:  ## localhost/deviceplane:<version> with buildah, base made by debootstrap (root; Debian buildah, debootstrap)
	bash scripts/build-image.sh

lint:
	$(PYTHON) -m ruff check deviceplane tests benchmarks scripts
	$(PYTHON) -m ruff format --check deviceplane tests benchmarks scripts
	$(PYTHON) -m mypy deviceplane

test: deps k8s-bins promtool lint
	$(PYTHON) -m pytest -q -ra

unit: deps
	$(PYTHON) -m pytest -q -ra tests/unit

demo: deps
	$(PYTHON) -m deviceplane demo

bench: deps
	for b in benchmarks/*.py; do [ $$b = benchmarks/compare.py ] || $(PYTHON) $$b || exit 1; done

COMPARE_ARGS ?=
compare: deps k8s-bins  ## deviceplane beside the kubelet's device manager -> benchmarks/results/compare.{md,png,json}
	$(PYTHON) benchmarks/compare.py $(COMPARE_ARGS)
