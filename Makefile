# Entry points for people and CI. Everything runs as root on a Debian 12 host;
# `make setup` installs what the rest needs (see scripts/setup.sh).

PY := .venv/bin/python

.PHONY: setup build test lint demo fresh-host bench bench-core bench-build bench-security bench-fleet rootfs fuzz stress

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

# Set-up, the CLI and the unit tests in a fresh Debian 12 root made by
# debootstrap (scripts/fresh-host.sh): what a used machine cannot show.
fresh-host:
	bash scripts/fresh-host.sh

# Benchmarks print progress on stderr and one JSON object as the last line of
# stdout. `make bench-<area>` runs bench/<area>.py; `make bench` runs them all.
BENCHES := core cpu memory burst microvm

bench: $(addprefix bench-,$(BENCHES))

bench-core: setup
	$(PY) bench/core.py

bench-%: setup
	$(PY) bench/$*.py

# What a task policy costs (bench/policy.py): exec through the daemon with the
# agent policy vs without, Landlock-confined open() vs unconfined, and the
# host-wide cost of the denial monitor's sys_exit program. ~3 min.
bench-policy: setup
	$(PY) bench/policy.py

# Lazy vs eager images through a private daemon (bench/images.py): a >= 2 GiB
# image (debootstrap'ed Debian + a seeded synthetic tree, both cached under
# /var/cache/dsecd/; the first run builds them, ~3-5 min), a throttled store,
# cold runs with the page cache dropped once per run. ~5-10 min after that.
# Then image pulls from a registry on loopback vs skopeo (bench/imagepull.py);
# `.venv/bin/python bench/images.py --phases pull` runs those alone (~2 min).
bench-images: setup
	$(PY) bench/images.py

# Dockerfile rebuilds (bench/build.py): a 10-step Dockerfile rebuilt after one
# changed COPY near the end, by `dsec image build -f` and by Debian's buildah
# (private storage, removed after), medians of 5 rounds; ~1 min.
bench-build: setup
	$(PY) bench/build.py

# The full fuzz campaign: >= 100k hostile inputs against a private
# daemon plus 100k against the in-process decoder; minutes. Last line: JSON.
# `pytest tests/fuzz` runs a few-second slice of the same code.
fuzz: setup
	$(PY) bench/fuzz.py --inputs 100000 --seed 7

# 64 clients mixing create, exec, file ops, pause, FnCalls and destroy for two
# minutes against a private daemon, kill -9 and restart of the daemon half-way;
# fails on any undocumented error, lost or duplicated sandbox, or leak. Last
# line: JSON. tests/integration/test_stress_short.py runs a few seconds of it.
stress: setup
	$(PY) bench/stress.py --clients 64 --seconds 120

# dsecd beyond one host (bench/fleet.py): 4 simulated hosts, each a network
# namespace with its own sshd and dsecd, driven over ssh by dsecd.Fleet:
# creates/s through the fleet vs locally, exec overhead over ssh, placement
# of 1,000 creates, failover detection, lost or duplicated creates; with Ray
# installed, creates/s and exec stdout/stdin MiB/s through dsecd.ray vs
# locally. ~4 min. Last line: JSON.
bench-fleet: setup
	$(PY) bench/fleet.py

# The hardening report, a few minutes: the adversarial suite
# (`pytest -m attack`), a fuzz run (>= 100k inputs: daemon + decoder), kill -9
# of the daemon mid create burst three times, then leaked mounts, cgroups,
# netns and processes. Last line: JSON (attacks_tried, attacks_blocked,
# fuzz_inputs, fuzz_crashes, daemon_restarts_survived, leaked_objects).
bench-security: setup
	$(PY) bench/security.py
