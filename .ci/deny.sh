#!/usr/bin/env bash
# Supply-chain checks (policy in deny.toml): licenses, bans (wildcard versions, the deny
# list) and sources always, and they never pass by being skipped; security advisories only
# when the RustSec advisory database can be fetched (it lives on GitHub, which CI machines
# may not reach): then the run says loudly that advisories were NOT checked, and fails with
# CLEAVE_REQUIRE_ADVISORIES=1 (set it where the network is there, e.g. before a release).
#
# With cargo-deny (on PATH, CLEAVE_CARGO_DENY, or installed from crates.io into ~/.cargo/bin
# with CLEAVE_INSTALL_CARGO_DENY=1: ~10 minutes on 2 cores) `cargo deny check` runs.
# Without it, .ci/licenses.py checks licenses, bans and sources from `cargo metadata`
# against the same deny.toml and fails on a violation or on a deny.toml key it does not
# implement; it names what it cannot check. Closes with "deny: ok" or exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."

die() { printf 'deny: error: %s\n' "$*" >&2; exit 1; }
command -v cargo >/dev/null 2>&1 || die "cargo is not installed or not on PATH"

advisories_skipped() {
  printf '\n!!! deny: advisories NOT CHECKED: %s\n' "$1"
  printf '!!! Known-vulnerable crates would pass unnoticed: run .ci/deny.sh with cargo-deny and network\n'
  printf '!!! access (CLEAVE_REQUIRE_ADVISORIES=1 makes this a failure), see SECURITY.md.\n'
  if [[ "${CLEAVE_REQUIRE_ADVISORIES:-0}" == 1 ]]; then
    die "advisories not checked and CLEAVE_REQUIRE_ADVISORIES=1"
  fi
}

DENY="${CLEAVE_CARGO_DENY:-}"
if [[ -z "$DENY" ]]; then
  if command -v cargo-deny >/dev/null 2>&1; then
    DENY="$(command -v cargo-deny)"
  elif [[ "${CLEAVE_INSTALL_CARGO_DENY:-0}" == 1 ]]; then
    printf '==> installing cargo-deny (once; cached in ~/.cargo/bin)\n'
    start=$SECONDS
    cargo install cargo-deny --locked --quiet
    printf '==> cargo-deny installed in %ss\n' "$((SECONDS - start))"
    DENY="$HOME/.cargo/bin/cargo-deny"
  else
    command -v python3 >/dev/null 2>&1 || die "neither cargo-deny nor python3 (for the fallback) is installed"
    printf '==> cargo-deny not installed (CLEAVE_INSTALL_CARGO_DENY=1 installs it): licenses, bans and sources from cargo metadata (.ci/licenses.py)\n'
    python3 .ci/licenses.py || die "licenses, bans or sources violate deny.toml (see FAIL lines above)"
    advisories_skipped "cargo-deny is not installed (the fallback cannot read the RustSec database)"
    printf 'deny: ok (licenses, bans, sources)\n'
    exit 0
  fi
fi
"$DENY" --version

printf '\n==> cargo deny check licenses bans sources\n'
"$DENY" --log-level warn --frozen check licenses bans sources

printf '\n==> cargo deny check advisories\n'
# Fetch the database with a short deadline; without it, say so.
if timeout 60 "$DENY" --log-level error fetch db >/dev/null 2>&1; then
  "$DENY" --log-level warn --frozen check advisories
  printf 'deny: ok\n'
else
  advisories_skipped "the RustSec advisory database (github.com/rustsec/advisory-db) could not be fetched (no network?)"
  printf 'deny: ok (licenses, bans, sources)\n'
fi
