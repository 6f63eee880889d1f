# Two commands on a fresh machine (see README):
#   make demo   set up .venv, then train + evaluate a KCLA detector on synthetic data
#   make test   set up .venv, then run the whole test suite (slow end-to-end tests included)
#   make demo-seg / make demo-cls   the segmentation / classification demos on synthetic data
PY := .venv/bin/python

.PHONY: setup demo demo-seg demo-cls test test-fast lint

setup:
	bash tools/setup_env.sh

demo: setup
	bash tools/run_demo.sh

demo-seg: setup
	bash tools/run_demo_seg.sh

demo-cls: setup
	bash tools/run_demo_cls.sh

test: setup
	bash tools/run_tests.sh

test-fast: setup
	bash tools/run_tests.sh -m "not slow"

lint: setup
	$(PY) -m flake8 kcla_mm tools tests configs
	$(PY) -m isort --check-only --diff kcla_mm tools tests
