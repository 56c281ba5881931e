#!/usr/bin/env bash
# Builds tests/c/test_engine.c with csrc/engine.c, shm.c, kernels.c and common.c (no Python)
# under ThreadSanitizer, then under AddressSanitizer with UBSan, and runs each: one-node groups
# of 2 and 3 rank processes, both streams busy from two threads, shared buffers, abort from a
# third thread, destroy with work queued, ranks leaving a group rank 0 still uses.
# Usage: tools/tsan.sh [ops_per_stream [deadline_s]]
# Exits non-zero on any failed check or sanitizer report.  tests/test_engine_tsan.py runs
# the same under pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
unset LD_PRELOAD DPTC_SHM   # tools/sanitize.sh's preloaded ASan runtime breaks TSan programs
cc=${CC:-gcc}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
flags=(-std=c11 -O1 -g -D_GNU_SOURCE -pthread -Wall -Wextra -Werror)
sources=(tests/c/test_engine.c tests/c/no_bridge.c csrc/engine.c csrc/shm.c csrc/kernels.c csrc/common.c)

# kernels.c's target_clones become ifunc resolvers that the loader runs before the TSan
# runtime is initialised (they crash instrumented); the portable build has no clones.
"$cc" "${flags[@]}" -fsanitize=thread -DDPTC_REDUCE_PORTABLE "${sources[@]}" -lrt \
    -o "$out/tsan"
"$cc" "${flags[@]}" -fsanitize=address,undefined -fno-sanitize-recover=all \
    -fno-omit-frame-pointer "${sources[@]}" -lrt -o "$out/asan"

# Runs "$@", echoing its output into $out/log; returns its status.
run() {
    local status=0
    "$@" >"$out/log" 2>&1 || status=$?
    cat "$out/log"
    return "$status"
}

echo "== ThreadSanitizer"
export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1}
status=0
run "$out/tsan" "$@" || status=$?
if grep -q "FATAL: ThreadSanitizer" "$out/log" && command -v setarch >/dev/null; then
    # Older TSan runtimes cannot map their shadow under a randomised high address space.
    echo "== ThreadSanitizer with ASLR off (setarch -R)"
    status=0
    run setarch "$(uname -m)" -R "$out/tsan" "$@" || status=$?
fi
if [ "$status" -ne 0 ] || grep -q "ThreadSanitizer:" "$out/log"; then
    echo "tsan.sh: ThreadSanitizer run failed (exit $status)" >&2
    exit 1
fi

echo "== AddressSanitizer and UndefinedBehaviorSanitizer"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:halt_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
status=0
run "$out/asan" "$@" || status=$?
if [ "$status" -ne 0 ] || grep -Eq "ERROR: (Address|Leak)Sanitizer|runtime error:" "$out/log"; then
    echo "tsan.sh: AddressSanitizer/UBSan run failed (exit $status)" >&2
    exit 1
fi
echo "tsan.sh: clean"
