#!/usr/bin/env bash
# Runs the examples of deployments/examples/ on the kind cluster made by hack/kind-up.sh
# and checks them end to end:
#   - every pod reaches Ready within POD_TIMEOUT_S;
#   - each claim is allocated by gpu.cleave.dev, and the claim's CDI spec exists on the
#     node: its env entries are in the container's environment, its device nodes and
#     mount targets exist inside the container (kubectl exec);
#   - per example: two pods sharing one claim see the same devices (time-slicing, MPS),
#     the MPS pods get CUDA_MPS_PIPE_DIRECTORY, the MIG pod got a 1g.10gb device, the
#     CEL pod got an H100;
#   - after the examples are deleted, the claims' CDI specs are gone (unprepare ran).
# Prints a summary and exits non-zero if any check failed.
#
# Environment: CLUSTER_NAME (cleave), POD_TIMEOUT_S (180), KEEP=1 keeps the examples.
# Needs docker, kubectl and python3 (for reading JSON; YAML CDI specs also need PyYAML).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CLUSTER_NAME="${CLUSTER_NAME:-cleave}"
POD_TIMEOUT_S="${POD_TIMEOUT_S:-180}"
DRIVER="gpu.cleave.dev"
CDI_ROOT="/var/run/cdi"
EXAMPLES="$ROOT/deployments/examples"

die() { printf 'kind-demo: error: %s\n' "$*" >&2; exit 1; }
log() { printf '==> %s\n' "$*"; }

for tool in docker kubectl python3; do
  command -v "$tool" >/dev/null 2>&1 \
    || die "'$tool' is not installed or not on PATH (needed: docker, kubectl, python3)"
done
KUBECTL=(kubectl --context "kind-$CLUSTER_NAME")
"${KUBECTL[@]}" get --raw /readyz >/dev/null 2>&1 \
  || die "cluster kind-$CLUSTER_NAME is not reachable: run hack/kind-up.sh first"

RESULTS=()
FAILED=0
pass() { RESULTS+=("PASS  $1"); printf '  ok: %s\n' "$1"; }
fail() { RESULTS+=("FAIL  $1"); FAILED=$((FAILED + 1)); printf '  FAILED: %s\n' "$1" >&2; }

# Prints the edits a claim's CDI spec asks for, one per line: "ENV k=v", "DEV path",
# "MOUNT path". Reads the spec on stdin; $1 is the claim UID (device names start with it).
cdi_edits() {
  python3 -c '
import json, sys
text = sys.stdin.read()
try:
    spec = json.loads(text)
except ValueError:
    try:
        import yaml
    except ImportError:
        sys.exit("the CDI spec is YAML and PyYAML is not installed (pip install pyyaml)")
    spec = yaml.safe_load(text)
uid = sys.argv[1]
edits = [spec.get("containerEdits") or {}]
edits += [d.get("containerEdits") or {} for d in spec.get("devices", []) if d.get("name", "").startswith(uid)]
for e in edits:
    for env in e.get("env") or []:
        print("ENV", env)
    for node in e.get("deviceNodes") or []:
        print("DEV", node.get("path"))
    for mount in e.get("mounts") or []:
        print("MOUNT", mount.get("containerPath"))
' "$1"
}

# The claims a pod uses: generated from templates, or named directly.
pod_claims() {
  local ns="$1" pod="$2"
  {
    "${KUBECTL[@]}" -n "$ns" get pod "$pod" -o jsonpath='{range .status.resourceClaimStatuses[*]}{.resourceClaimName}{"\n"}{end}'
    "${KUBECTL[@]}" -n "$ns" get pod "$pod" -o jsonpath='{range .spec.resourceClaims[*]}{.resourceClaimName}{"\n"}{end}'
  } | sed '/^$/d' | sort -u
}

# The devices allocated to a claim, "driver/pool/device" per line.
claim_devices() {
  "${KUBECTL[@]}" -n "$1" get resourceclaim "$2" \
    -o jsonpath='{range .status.allocation.devices.results[*]}{.driver}/{.pool}/{.device}{"\n"}{end}'
}

# An attribute of a published device: $1 pool, $2 device, $3 attribute name.
device_attribute() {
  "${KUBECTL[@]}" get resourceslices --field-selector "spec.driver=$DRIVER" -o json | python3 -c '
import json, sys
pool, device, attr = sys.argv[1:4]
for s in json.load(sys.stdin)["items"]:
    if s["spec"]["pool"]["name"] != pool:
        continue
    for d in s["spec"].get("devices", []):
        if d["name"] == device:
            attrs = d.get("attributes", {})
            a = attrs.get(attr) or attrs.get(sys.argv[4] + "/" + attr) or {}
            print(next(iter(a.values()), ""))
            sys.exit(0)
' "$1" "$2" "$3" "$DRIVER"
}

CLAIM_UIDS=()   # "node uid" of every claim checked, for the unprepare check

# Checks one running pod: allocation, CDI spec on the node, env and paths in the container.
# Prints the pod's CDI env (sorted) to the file $3 for cross-pod comparisons.
check_pod() {
  local ns="$1" pod="$2" envfile="$3" node claims claim uid devices spec edits kind value
  node="$("${KUBECTL[@]}" -n "$ns" get pod "$pod" -o jsonpath='{.spec.nodeName}')"
  claims="$(pod_claims "$ns" "$pod")"
  [[ -n "$claims" ]] || { fail "$ns/$pod: pod references no ResourceClaim"; return; }
  local pod_env
  pod_env="$("${KUBECTL[@]}" -n "$ns" exec "$pod" -- env 2>&1)" \
    || { fail "$ns/$pod: kubectl exec env failed: $pod_env"; return; }
  : >"$envfile"
  for claim in $claims; do
    uid="$("${KUBECTL[@]}" -n "$ns" get resourceclaim "$claim" -o jsonpath='{.metadata.uid}')"
    devices="$(claim_devices "$ns" "$claim")"
    if [[ -z "$devices" ]] || grep -qv "^$DRIVER/" <<<"$devices"; then
      fail "$ns/$pod: claim $claim is not allocated by $DRIVER (devices: ${devices:-none})"
      continue
    fi
    pass "$ns/$pod: claim $claim allocated: ${devices//$'\n'/ }"
    if [[ " ${CLAIM_UIDS[*]} " != *" $node $uid "* ]]; then
      CLAIM_UIDS+=("$node $uid")
    fi
    spec="$(docker exec "$node" sh -c "grep -l -- '$uid' $CDI_ROOT/* 2>/dev/null | head -n 1 | xargs -r cat")"
    if [[ -z "$spec" ]]; then
      fail "$ns/$pod: no CDI spec for claim $claim ($uid) in $CDI_ROOT on node $node"
      continue
    fi
    if ! edits="$(cdi_edits "$uid" <<<"$spec")"; then
      fail "$ns/$pod: cannot read the CDI spec of claim $claim"
      continue
    fi
    local n_env=0 n_path=0 bad=0
    while read -r kind value; do
      [[ -n "$kind" ]] || continue
      case "$kind" in
        ENV)
          n_env=$((n_env + 1))
          printf '%s\n' "$value" >>"$envfile"
          grep -qxF -- "$value" <<<"$pod_env" || { fail "$ns/$pod: CDI env $value missing in the container"; bad=1; }
          ;;
        DEV|MOUNT)
          n_path=$((n_path + 1))
          "${KUBECTL[@]}" -n "$ns" exec "$pod" -- test -e "$value" \
            || { fail "$ns/$pod: CDI $kind $value missing in the container"; bad=1; }
          ;;
      esac
    done <<<"$edits"
    if (( bad == 0 )); then
      pass "$ns/$pod: CDI edits of claim $claim applied ($n_env env, $n_path device nodes/mounts)"
    fi
  done
  sort -o "$envfile" "$envfile"
}

wait_ready() {
  local ns="$1" pod="$2"
  if "${KUBECTL[@]}" -n "$ns" wait --for=condition=Ready "pod/$pod" --timeout "${POD_TIMEOUT_S}s" >/dev/null; then
    pass "$ns/$pod: Ready"
    return 0
  fi
  fail "$ns/$pod: not Ready after ${POD_TIMEOUT_S}s"
  "${KUBECTL[@]}" -n "$ns" describe pod "$pod" | tail -n 25 >&2 || true
  return 1
}

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

# file:namespace:pods (space separated)
EXAMPLE_LIST=(
  "gpu-whole.yaml:cleave-gpu-whole:gpu-whole"
  "mig-slice.yaml:cleave-mig:mig-slice"
  "timeslicing-shared.yaml:cleave-timeslicing:timeslicing-a timeslicing-b"
  "mps-shared.yaml:cleave-mps:mps-a mps-b"
  "cel-selector.yaml:cleave-cel:cel-h100"
)

for entry in "${EXAMPLE_LIST[@]}"; do
  IFS=: read -r file ns pods <<<"$entry"
  log "example $file"
  if ! "${KUBECTL[@]}" apply -f "$EXAMPLES/$file" >/dev/null; then
    fail "$file: kubectl apply failed"
    continue
  fi
  for pod in $pods; do
    wait_ready "$ns" "$pod" && check_pod "$ns" "$pod" "$TMP/$ns-$pod.env"
  done
done

log "example-specific checks"
# Shared claims: both pods must see the same CDI environment (same devices, same MPS daemon).
for pair in "cleave-timeslicing timeslicing-a timeslicing-b" "cleave-mps mps-a mps-b"; do
  read -r ns a b <<<"$pair"
  if [[ -f "$TMP/$ns-$a.env" && -f "$TMP/$ns-$b.env" ]]; then
    if cmp -s "$TMP/$ns-$a.env" "$TMP/$ns-$b.env"; then
      pass "$ns: $a and $b share one claim and see the same devices"
    else
      fail "$ns: $a and $b got different CDI environments"
    fi
  fi
done
for pod in mps-a mps-b; do
  if [[ -f "$TMP/cleave-mps-$pod.env" ]]; then
    if grep -q '^CUDA_MPS_PIPE_DIRECTORY=' "$TMP/cleave-mps-$pod.env"; then
      pass "cleave-mps/$pod: MPS client environment set (CUDA_MPS_PIPE_DIRECTORY)"
    else
      fail "cleave-mps/$pod: no CUDA_MPS_PIPE_DIRECTORY in the claim's CDI env"
    fi
  fi
done
if [[ -f "$TMP/cleave-mig-mig-slice.env" ]]; then
  mig_claim="$(pod_claims cleave-mig mig-slice | head -n 1)"
  mig_dev="$(claim_devices cleave-mig "$mig_claim" | head -n 1)"
  if [[ "$mig_dev" == */gpu-*-mig-1g10gb-* ]]; then
    pass "cleave-mig/mig-slice: got a 1g.10gb MIG device ($mig_dev)"
  else
    fail "cleave-mig/mig-slice: allocated device '$mig_dev' is not a 1g.10gb MIG device"
  fi
fi
if [[ -f "$TMP/cleave-cel-cel-h100.env" ]]; then
  cel_claim="$(pod_claims cleave-cel cel-h100 | head -n 1)"
  cel_dev="$(claim_devices cleave-cel "$cel_claim" | head -n 1)"
  IFS=/ read -r _ cel_pool cel_name <<<"$cel_dev"
  product="$(device_attribute "$cel_pool" "$cel_name" productName || true)"
  if [[ "$product" == *H100* ]]; then
    pass "cleave-cel/cel-h100: CEL selected $cel_dev ($product)"
  else
    fail "cleave-cel/cel-h100: allocated '$cel_dev' has productName '$product', not an H100"
  fi
fi

if [[ -z "${KEEP:-}" ]]; then
  log "deleting the examples"
  for entry in "${EXAMPLE_LIST[@]}"; do
    IFS=: read -r file _ _ <<<"$entry"
    "${KUBECTL[@]}" delete -f "$EXAMPLES/$file" --ignore-not-found --wait=true \
      --timeout "${POD_TIMEOUT_S}s" >/dev/null || fail "$file: kubectl delete failed"
  done
  # One deadline for all claims: the kubelet unprepares them in parallel.
  deadline=$((SECONDS + POD_TIMEOUT_S))
  for entry in "${CLAIM_UIDS[@]}"; do
    read -r node uid <<<"$entry"
    while docker exec "$node" sh -c "grep -q -- '$uid' $CDI_ROOT/* 2>/dev/null"; do
      if (( SECONDS >= deadline )); then
        fail "claim $uid: CDI spec still in $CDI_ROOT on $node after ${POD_TIMEOUT_S}s (unprepare?)"
        continue 2
      fi
      sleep 1
    done
    pass "claim $uid: unprepared (CDI spec removed from $node)"
  done
else
  log "KEEP set: examples left running"
fi

printf '\n==> summary\n'
printf '%s\n' "${RESULTS[@]}"
total=${#RESULTS[@]}
printf '%d passed, %d failed\n' "$((total - FAILED))" "$FAILED"
(( FAILED == 0 && total > 0 ))
