#!/usr/bin/env bash
# hack/mutants.sh: mutation testing (cargo-mutants) of the security- and correctness-critical
# code: the CDI hook's path handling, config validation and merge, prepare's plan and the
# checkpoint decode. Each module is mutated with its own scoped test command, then a table
# prints the share of mutants the tests caught per module and lists the survivors.
# See "How strong the tests are" in docs/architecture.md for the figures and how to read them.
#
# SLOW, and not in CI: every mutant is a rebuild of the mutated crate and of what depends on
# it, then a test run. Built incrementally without debug info (below), one mutant took about
# 5 s in cleave-api and 20-30 s in the driver and the hook on the 2-core development machine
# (2026-12-03): all about 400 mutants in a little over two hours, one module after another.
#
# Usage: hack/mutants.sh [MODULE...]    MODULE: hook api-config api-merge plan checkpoint
#                                        (default: all five, in that order)
#        hack/mutants.sh --table         only print the table of the last runs
#
# Environment:
#   SHARD    k/n: test only the mutants with index % n == k (round-robin), e.g. 0/4
#   JOBS     parallel build directories (default 1; each holds a copy of the tree)
#   OUT      where each module's mutants.out goes (default target/mutants-out; never commit it)
#   CARGO_TARGET_DIR  shared by all mutants when set: pointing it at a directory that
#            already holds the dependencies (hard-linked copy of target/debug) saves the
#            first full build of each module
#
# Needs: cargo install cargo-mutants --locked  (written against cargo-mutants 27.1.0)
set -euo pipefail
here=${BASH_SOURCE[0]%/*}
[[ "$here" == "${BASH_SOURCE[0]}" ]] && here=.
cd "$here/.."

OUT=${OUT:-target/mutants-out}
JOBS=${JOBS:-1}

# The files (and functions) of each module, and the tests that must catch their mutants.
module_args() {
    case "$1" in
    hook)
        # The hostile and behaviour tests of the built hook live in the plugin package.
        echo "-f cdi-hook/src/root.rs -f cdi-hook/src/symlinks.rs" \
            "--test-package cleave-cdi-hook --test-package cleave-kubelet-plugin" \
            "--cargo-arg=--lib --cargo-arg=--test=cdi_hook --cargo-arg=--test=cdi_hook_hostile"
        ;;
    api-config)
        echo "-f api/src/config.rs --test-package cleave-api"
        ;;
    api-merge)
        echo "-f api/src/merge.rs --test-package cleave-api"
        ;;
    plan)
        echo "-f driver/src/prepare/plan.rs --test-package cleave-driver --cargo-arg=--lib"
        ;;
    checkpoint)
        # The decode path only: checksum, encode/wrap, decode and the store's load.
        echo "-f driver/src/checkpoint.rs -F checksum|encode|wrap|decode|CheckpointStore::(load|remember)" \
            "--test-package cleave-driver --cargo-arg=--lib"
        ;;
    *)
        echo "unknown module $1 (hook api-config api-merge plan checkpoint)" >&2
        return 1
        ;;
    esac
}

# Lines of a result file (0 when it is missing).
count() {
    if [ -f "$1" ]; then
        grep -c . "$1" || true
    else
        echo 0
    fi
}

table() {
    printf '%-11s %7s %7s %8s %9s %8s\n' module caught missed timeout unviable "caught%"
    for m in hook api-config api-merge plan checkpoint; do
        local d="$OUT/$m/mutants.out"
        [ -d "$d" ] || continue
        local c mi t u
        c=$(count "$d/caught.txt")
        mi=$(count "$d/missed.txt")
        t=$(count "$d/timeout.txt")
        u=$(count "$d/unviable.txt")
        # A timeout counts as caught (the mutant hung the tests); unviable ones (do not
        # build) count for nothing.
        local viable=$((c + mi + t))
        local pct=-
        [ "$viable" -gt 0 ] && pct=$(((100 * (c + t)) / viable))
        printf '%-11s %7s %7s %8s %9s %8s\n' "$m" "$c" "$mi" "$t" "$u" "$pct"
    done
    for m in hook api-config api-merge plan checkpoint; do
        local f="$OUT/$m/mutants.out/missed.txt"
        if [ -s "$f" ]; then
            echo
            echo "survivors of $m:"
            sed 's/^/  /' "$f"
        fi
    done
}

if [ "${1:-}" = "--table" ]; then
    table
    exit 0
fi

command -v cargo-mutants >/dev/null || {
    echo "cargo-mutants is not installed: cargo install cargo-mutants --locked" >&2
    exit 2
}

modules=("$@")
[ ${#modules[@]} -gt 0 ] || modules=(hook api-config api-merge plan checkpoint)
# Incremental builds without debug info: a mutant changes one function, so each rebuild
# recompiles one crate incrementally and links without DWARF (measured on the driver's unit
# tests, 2 cores: 5 s instead of 40 s with CARGO_INCREMENTAL=0 and full debug info).
export CARGO_INCREMENTAL=1 CARGO_PROFILE_DEV_DEBUG=0 CARGO_PROFILE_TEST_DEBUG=0
for m in "${modules[@]}"; do
    args=$(module_args "$m")
    shard=()
    [ -n "${SHARD:-}" ] && shard=(--shard "$SHARD" --sharding round-robin)
    mkdir -p "$OUT/$m"
    started=$(date +%s)
    echo "== $m: cargo mutants $args ${shard[*]}"
    # The baseline is skipped: CI runs these tests unmutated. Exit status 2 (mutants
    # missed) and 3 (timeouts) are results, not failures of the script.
    # shellcheck disable=SC2086
    cargo mutants $args "${shard[@]}" --baseline skip --timeout 300 --build-timeout 1200 \
        -j "$JOBS" -o "$OUT/$m" || [ $? -le 3 ]
    echo "== $m took $(($(date +%s) - started)) s"
done
echo
table
