# Entry points for people and CI. Everything runs as root on a Debian 12 host;
# `make setup` installs what the rest needs (see scripts/setup.sh).

PY := .venv/bin/python

.PHONY: setup build test lint demo bench bench-core rootfs

setup:
	bash scripts/setup.sh

# Rebuild the cffi extension and dsec-init: setup.sh reinstalls the project
# whenever its stamp is missing (it also does when csrc/ or the metadata changed).
build:
	rm -f .venv/.dsecd-setup-stamp
	bash scripts/setup.sh

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
