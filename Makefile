# Entry points for people and CI. Everything runs as root on a Debian 12 host;
# `make setup` installs what the rest needs (see scripts/setup.sh).

PY := .venv/bin/python

.PHONY: setup build test lint demo bench bench-core rootfs

setup:
	bash scripts/setup.sh

# Rebuild the cffi extension and dsec-init after a change in csrc/.
build: setup
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .

test:
	bash scripts/test.sh

lint: setup
	.venv/bin/ruff check dsecd tests bench

demo: setup
	bash scripts/demo.sh

rootfs:
	bash scripts/mkrootfs.sh

# Benchmarks print progress on stderr and one JSON object as the last line of
# stdout. `make bench-<area>` runs bench/<area>.py; `make bench` runs them all.
BENCHES := core

bench: $(addprefix bench-,$(BENCHES))

bench-core: setup
	$(PY) bench/core.py

bench-%: setup
	$(PY) bench/$*.py
