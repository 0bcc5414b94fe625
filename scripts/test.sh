#!/bin/bash
# The whole check, as CI runs it (.ci/run): set the host up, lint, then the
# test suite (unit and, as root, integration). Exits non-zero if any part
# fails; pytest's "no tests collected" (exit 5) counts as a failure.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
VENV=$REPO/.venv

# The optional Ray extra too: tests/integration/test_ray.py needs it.
DSECD_SETUP_RAY=1 bash scripts/setup.sh || exit 1

status=0

lint_dirs=()
for d in dsecd tests bench; do
    [[ -d $d ]] && lint_dirs+=("$d")
done
echo "test: ruff check ${lint_dirs[*]}"
if ! "$VENV/bin/ruff" check "${lint_dirs[@]}"; then
    echo "test: FAILED: ruff check" >&2
    status=1
fi

# pytest last, so that its summary line closes the output. Two workers,
# each taking whole test files (a module's daemon is started once, in the
# worker that runs it): most of a test's time is waiting on daemons,
# sandboxes and guests, so two share the two cores of a CI machine and
# take about half the wall time of one (25 -> 13 minutes). Each test
# daemon has its own socket, state dir, cgroups, bridge and id range
# (tests/integration/conftest.py), as it must anyway beside the host's.
echo "test: pytest -n 2 tests"
"$VENV/bin/pytest" -q -n 2 --dist loadfile tests
rc=$?
case $rc in
    0) ;;
    5) echo "test: FAILED: pytest collected no tests" >&2; status=1 ;;
    *) echo "test: FAILED: pytest exited $rc" >&2; status=1 ;;
esac
exit $status
