#!/usr/bin/env bash
# Offline checks of the install parts (deployments/ and hack/*.sh): renders and lints the
# Helm chart, validates every rendered object and example against the Kubernetes 1.34
# schemas (strict), checks the values schema, CEL selectors, opaque configs, that the
# Dockerfile agrees with the chart and Cargo, and shellcheck. No Docker, no cluster.
#
# Installs its Python packages (hack/tests/requirements.txt, from PyPI) into a venv at
# target/ci-venv (CLEAVE_CI_VENV overrides), once: later runs reuse it while the
# requirements are unchanged. Closes with "deployments: N passed, M failed".
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${CLEAVE_CI_VENV:-target/ci-venv}"
REQS="hack/tests/requirements.txt"
PYTHON="${PYTHON:-python3}"

die() { printf 'deployments: error: %s\n' "$*" >&2; exit 1; }
command -v "$PYTHON" >/dev/null 2>&1 || die "'$PYTHON' is not installed or not on PATH"

# The stamp records what the venv was built from; a change of requirements or of the
# interpreter rebuilds it.
want="$(cat "$REQS"; "$PYTHON" -c 'import sys; print(sys.version)')"
stamp="$VENV/.cleave-requirements"
if [[ ! -x "$VENV/bin/python" || ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
  printf '==> installing Python packages into %s\n' "$VENV"
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV" || die "cannot create a venv with $PYTHON (is the venv module installed?)"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-input -r "$REQS" \
    || die "pip install -r $REQS failed"
  printf '%s' "$want" >"$stamp"
fi

PATH="$PWD/$VENV/bin:$PATH" "$VENV/bin/python" hack/tests/test_deployments.py
