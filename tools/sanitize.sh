#!/usr/bin/env bash
# Builds dptc._C with AddressSanitizer and UndefinedBehaviorSanitizer and runs
# the tests against it (every rank process loads the sanitizer runtime), then
# rebuilds the normal extension.  Usage: tools/sanitize.sh [pytest args...]
# Leak detection is off: CPython and torch keep allocations until exit.
set -euo pipefail
cd "$(dirname "$0")/.."
rebuild() { python3 setup.py -q build_ext --inplace --force >/dev/null; }
trap 'rebuild' EXIT
DPTC_SANITIZE=1 python3 setup.py -q build_ext --inplace --force >/dev/null
asan=$(gcc -print-file-name=libasan.so)
ubsan=$(gcc -print-file-name=libubsan.so)
export LD_PRELOAD="$asan $ubsan"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
python3 -m pytest -q "${@:-tests}"
