#!/usr/bin/env bash
# Brings up a kind cluster with cleave installed on mock GPUs:
#   1. creates the cluster from hack/kind-config.yaml (Kubernetes >= 1.34, CDI on,
#      DRAPartitionableDevices on), or reuses it if it exists;
#   2. builds the image from deployments/container/Dockerfile (target `kind`: with the mock
#      NVML library and the fake NVIDIA tools) and loads it into kind;
#   3. installs the Helm chart with deployments/helm/cleave/values-kind.yaml;
#   4. waits for the plugin pods and for the first ResourceSlices.
# Then run hack/kind-demo.sh. Tear down with hack/kind-down.sh.
#
# Environment: CLUSTER_NAME (cleave), KIND_NODE_IMAGE (kindest/node:v1.34.0),
# IMAGE (cleave:dev), NAMESPACE (cleave-system), RELEASE (cleave), SKIP_BUILD (unset),
# TIMEOUT_S (300).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CLUSTER_NAME="${CLUSTER_NAME:-cleave}"
KIND_NODE_IMAGE="${KIND_NODE_IMAGE:-kindest/node:v1.34.0}"
IMAGE="${IMAGE:-cleave:dev}"
NAMESPACE="${NAMESPACE:-cleave-system}"
RELEASE="${RELEASE:-cleave}"
TIMEOUT_S="${TIMEOUT_S:-300}"
DRIVER="gpu.cleave.dev"

log() { printf '==> %s\n' "$*"; }
die() { printf 'kind-up: error: %s\n' "$*" >&2; exit 1; }

require() {
  local tool
  for tool in "$@"; do
    command -v "$tool" >/dev/null 2>&1 \
      || die "'$tool' is not installed or not on PATH (needed: docker, kind, kubectl, helm)"
  done
}

require docker kind kubectl helm
docker info >/dev/null 2>&1 || die "docker is installed but its daemon is not reachable (is it running? may you use it?)"

case "$IMAGE" in
  *:*) IMAGE_REPO="${IMAGE%:*}"; IMAGE_TAG="${IMAGE##*:}" ;;
  *) die "IMAGE must be repository:tag, got '$IMAGE'" ;;
esac

if kind get clusters 2>/dev/null | grep -qx "$CLUSTER_NAME"; then
  log "reusing kind cluster '$CLUSTER_NAME'"
else
  log "creating kind cluster '$CLUSTER_NAME' ($KIND_NODE_IMAGE)"
  kind create cluster --name "$CLUSTER_NAME" --image "$KIND_NODE_IMAGE" \
    --config "$ROOT/hack/kind-config.yaml" --wait "${TIMEOUT_S}s"
fi
KUBECTL=(kubectl --context "kind-$CLUSTER_NAME")

minor="$("${KUBECTL[@]}" version -o json | sed -n 's/.*"minor": *"\([0-9]*\).*/\1/p' | tail -n 1)"
major="$("${KUBECTL[@]}" version -o json | sed -n 's/.*"major": *"\([0-9]*\).*/\1/p' | tail -n 1)"
[[ -n "$minor" && -n "$major" ]] || die "could not read the server version"
if (( major < 1 || (major == 1 && minor < 34) )); then
  die "cluster runs Kubernetes $major.$minor; cleave needs 1.34 or newer (set KIND_NODE_IMAGE)"
fi
"${KUBECTL[@]}" api-resources --api-group=resource.k8s.io -o name | grep -qx 'deviceclasses.resource.k8s.io' \
  || die "the API server does not serve resource.k8s.io DeviceClasses"

if [[ -z "${SKIP_BUILD:-}" ]]; then
  log "building $IMAGE"
  DOCKER_BUILDKIT=1 docker build -f "$ROOT/deployments/container/Dockerfile" --target kind -t "$IMAGE" "$ROOT"
fi
log "loading $IMAGE into kind"
kind load docker-image "$IMAGE" --name "$CLUSTER_NAME"

log "installing the chart (release '$RELEASE', namespace '$NAMESPACE')"
helm upgrade --install "$RELEASE" "$ROOT/deployments/helm/cleave" \
  --kube-context "kind-$CLUSTER_NAME" \
  --namespace "$NAMESPACE" --create-namespace \
  -f "$ROOT/deployments/helm/cleave/values-kind.yaml" \
  --set "image.repository=$IMAGE_REPO" --set "image.tag=$IMAGE_TAG" \
  --wait --timeout "${TIMEOUT_S}s"

# A new image under the same tag does not change the pod template: restart so the
# freshly loaded image runs.
daemonsets="$("${KUBECTL[@]}" -n "$NAMESPACE" get daemonset -l "app.kubernetes.io/instance=$RELEASE" -o name)"
[[ -n "$daemonsets" ]] || die "the release made no DaemonSet in namespace $NAMESPACE"
for ds in $daemonsets; do
  "${KUBECTL[@]}" -n "$NAMESPACE" rollout restart "$ds"
  "${KUBECTL[@]}" -n "$NAMESPACE" rollout status "$ds" --timeout "${TIMEOUT_S}s"
done

log "waiting for ResourceSlices of $DRIVER"
deadline=$((SECONDS + TIMEOUT_S))
until [[ -n "$("${KUBECTL[@]}" get resourceslices --field-selector "spec.driver=$DRIVER" -o name 2>/dev/null)" ]]; do
  if (( SECONDS >= deadline )); then
    "${KUBECTL[@]}" -n "$NAMESPACE" logs -l "app.kubernetes.io/instance=$RELEASE" --tail=50 >&2 || true
    die "no ResourceSlice of $DRIVER after ${TIMEOUT_S}s (plugin logs above)"
  fi
  sleep 2
done
"${KUBECTL[@]}" get resourceslices --field-selector "spec.driver=$DRIVER"
"${KUBECTL[@]}" get deviceclasses
log "cluster '$CLUSTER_NAME' is ready: run hack/kind-demo.sh"
