#!/usr/bin/env bash
# Deletes the kind cluster made by hack/kind-up.sh (CLUSTER_NAME, default cleave).
set -euo pipefail

CLUSTER_NAME="${CLUSTER_NAME:-cleave}"

die() { printf 'kind-down: error: %s\n' "$*" >&2; exit 1; }
command -v kind >/dev/null 2>&1 || die "'kind' is not installed or not on PATH"
command -v docker >/dev/null 2>&1 || die "'docker' is not installed or not on PATH"

if kind get clusters 2>/dev/null | grep -qx "$CLUSTER_NAME"; then
  kind delete cluster --name "$CLUSTER_NAME"
else
  printf 'kind-down: no cluster named %s\n' "$CLUSTER_NAME"
fi
