#!/usr/bin/env bash
# Builds dptc._C with AddressSanitizer and UndefinedBehaviorSanitizer and runs the tests
# against it, every rank process loading the sanitizer runtimes.  Usage:
#     tools/sanitize.sh [pytest args...]        (default: tests)
#
# The build and the run happen in a temporary copy of the working tree (tracked files and
# untracked ones git does not ignore, as they are now), so the checkout's own extension is
# never replaced: it stays usable meanwhile, nothing needs rebuilding afterwards, and a run
# killed midway leaves no instrumented build behind.
#
# Every sanitizer report is written to a file and the run fails on any, whatever the test
# thought of the process: a rank that a test expects to die (expect_failure=True), or a
# torch reference rank whose SIGABRT the harness forgives (reference=True), cannot hide one.
# A /dev/shm/dptc* entry the run left behind (new, mapped by no process) is removed and fails
# the run too.  Leak detection is off: CPython and torch keep allocations until exit
# (tests/test_engine_tsan.py runs engine.c and shm.c alone with LeakSanitizer on).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/dptc-sanitize.XXXXXX")
trap 'rm -rf "$work"' EXIT
tree=$work/tree
reports=$work/reports
mkdir -p "$tree" "$reports"

# The copy.  Its own git index holds what the checkout tracks (tests/test_packaging.py lists
# it with git ls-files).
cd "$root"
git ls-files -z --cached --others --exclude-standard >"$work/files"
while IFS= read -r -d '' name; do
    if [ -e "$name" ]; then printf '%s\0' "$name"; fi
done <"$work/files" | xargs -0 -r cp -P --parents -t "$tree"
git ls-files -z --cached >"$work/tracked"
(cd "$tree" && git init -q && while IFS= read -r -d '' name; do
    if [ -e "$name" ]; then printf '%s\0' "$name"; fi
done <"$work/tracked" | xargs -0 -r git add -f --)

cd "$tree"
if ! DPTC_SANITIZE=1 python3 setup.py -q build_ext --inplace >"$work/build.log" 2>&1; then
    cat "$work/build.log" >&2
    echo "sanitize.sh: the instrumented build failed" >&2
    exit 1
fi
asan=$(gcc -print-file-name=libasan.so)
ubsan=$(gcc -print-file-name=libubsan.so)
export LD_PRELOAD="$asan $ubsan"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1:log_path=$reports/asan"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$reports/ubsan"

# The tests must load the instrumented extension, not the checkout's or an installed one.
loaded=$(python3 -c 'import dptc._C; print(dptc._C.__file__)')
case $loaded in
    "$tree"/dptc/*) ;;
    *) echo "sanitize.sh: python imports dptc._C from $loaded, not the instrumented build in" \
            "$tree" >&2; exit 1 ;;
esac
symbols=$(nm -D --undefined-only "$loaded")   # not piped to grep -q: pipefail and SIGPIPE
if [[ $symbols != *__asan_report* ]]; then
    echo "sanitize.sh: $loaded is not instrumented" >&2
    exit 1
fi

# Arguments naming files of the checkout name the copy's.
args=()
for arg in "${@:-tests}"; do
    case $arg in
        "$root"/*) args+=("$tree/${arg#"$root"/}") ;;
        *) args+=("$arg") ;;
    esac
done
ls -1 /dev/shm 2>/dev/null | grep '^dptc' >"$work/shm_before" || true
status=0
python3 -m pytest -q -p no:cacheprovider "${args[@]}" || status=$?

unset LD_PRELOAD
left=$(python3 - "$work/shm_before" <<'EOF'
import sys
from tests._launch import _remove_new_shm
print(" ".join(_remove_new_shm(set(open(sys.argv[1]).read().split()))))
EOF
)
if [ -n "$left" ]; then
    echo "sanitize.sh: the run left /dev/shm entries behind (now removed): $left" >&2
    status=1
fi
count=0
while IFS= read -r -d '' report; do
    echo "== $(basename "$report")" >&2
    cat "$report" >&2
    count=$((count + 1))
done < <(find "$reports" -type f -print0 | sort -z)
if [ "$count" -gt 0 ]; then
    echo "sanitize.sh: $count sanitizer report(s) above" >&2
    status=1
fi
[ "$status" -eq 0 ] && echo "sanitize.sh: clean"
exit "$status"
