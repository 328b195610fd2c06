#!/usr/bin/env bash
# Supply-chain checks with cargo-deny (policy in deny.toml): licenses, bans (wildcards) and
# sources always; security advisories only when the RustSec advisory database can be
# fetched (it lives on GitHub, which CI machines may not reach): a missing database is
# reported, never a failure.
#
# cargo-deny is installed from crates.io into ~/.cargo/bin on first use and reused after
# (CLEAVE_CARGO_DENY overrides the binary). Closes with "deny: ok" or exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."

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
    # Building cargo-deny takes ~10 minutes on 2 cores; without it, check the same license
    # allow list and sources from `cargo metadata` (advisories need the network anyway).
    printf '==> cargo-deny not installed (CLEAVE_INSTALL_CARGO_DENY=1 installs it): license and source check from cargo metadata\n'
    python3 .ci/licenses.py
    printf 'deny: advisories SKIPPED: cargo-deny not installed\n'
    exit 0
  fi
fi
"$DENY" --version

printf '\n==> cargo deny check licenses bans sources\n'
"$DENY" --log-level warn --frozen check licenses bans sources

printf '\n==> cargo deny check advisories\n'
# Fetch the database with a short deadline; without it, say so and go on.
if timeout 60 "$DENY" --log-level error fetch db >/dev/null 2>&1; then
  "$DENY" --log-level warn --frozen check advisories
else
  printf 'deny: advisories SKIPPED: the RustSec advisory database (github.com/rustsec/advisory-db) could not be fetched (no network?)\n'
fi
printf 'deny: ok\n'
