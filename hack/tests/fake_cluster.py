#!/usr/bin/env python3
"""Stand-ins for docker, kind, kubectl and helm, so hack/kind-*.sh run without a cluster.

test_deployments.py puts a wrapper for each tool (`exec python fake_cluster.py TOOL "$@"`)
into a temporary PATH directory. Every call is appended to $FAKE_STATE/calls.log; kubectl and docker answer the
queries hack/kind-demo.sh makes from a small model of a kind cluster running the examples
(one worker node, gpu.cleave.dev devices, one CDI spec per claim). $FAKE_FAIL injects one
defect, so a test can prove that the demo notices it:
  cdi-env      the containers lack one env entry of their claim's CDI spec
  not-ready    pod mig-slice never becomes Ready
  no-unprepare CDI specs stay on the node after the examples are deleted
  old-k8s      the server says it runs Kubernetes 1.33
This checks the scripts' plumbing and their failure detection, not a real cluster.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

STATE = Path(os.environ["FAKE_STATE"])
FAIL = os.environ.get("FAKE_FAIL", "")
NODE = "cleave-worker"
DRIVER = "gpu.cleave.dev"

# pod -> (namespace, claim name, how the pod refers to it, allocated device)
PODS = {
    "gpu-whole": ("cleave-gpu-whole", "gpu-whole-gpu-x1", "template", "gpu-0"),
    "mig-slice": ("cleave-mig", "mig-slice-mig-x2", "template", "gpu-1-mig-1g10gb-3"),
    "timeslicing-a": ("cleave-timeslicing", "shared-gpu", "direct", "gpu-2"),
    "timeslicing-b": ("cleave-timeslicing", "shared-gpu", "direct", "gpu-2"),
    "mps-a": ("cleave-mps", "mps-gpu", "direct", "gpu-3"),
    "mps-b": ("cleave-mps", "mps-gpu", "direct", "gpu-3"),
    "cel-h100": ("cleave-cel", "cel-h100-gpu-x3", "template", "gpu-4"),
}
CLAIMS = {claim: (ns, dev) for ns, claim, _, dev in PODS.values()}


def uid(claim: str) -> str:
    return "00000000-0000-4000-8000-" + hashlib.sha256(claim.encode()).hexdigest()[:12]


def cdi_env(claim: str) -> list[str]:
    ns, dev = CLAIMS[claim]
    env = [f"NVIDIA_VISIBLE_DEVICES=GPU-{dev}", f"CLEAVE_CLAIM_UID={uid(claim)}"]
    if ns == "cleave-mps":
        env.append(f"CUDA_MPS_PIPE_DIRECTORY=/var/lib/kubelet/plugins/{DRIVER}/mps/{uid(claim)}/pipe")
    return env


def cdi_spec(claim: str) -> str:
    _, dev = CLAIMS[claim]
    return json.dumps({
        "cdiVersion": "0.6.0",
        "kind": "k8s.gpu.cleave.dev/claim",
        "devices": [{
            "name": f"{uid(claim)}-{dev}",
            "containerEdits": {
                "env": cdi_env(claim),
                "deviceNodes": [{"path": "/dev/nvidia0"}],
                "mounts": [{"hostPath": "/x", "containerPath": "/usr/bin/nvidia-smi"}],
            },
        }],
    })


def slices() -> str:
    devices = []
    for _, dev in sorted(set(CLAIMS.values())):
        product = "NVIDIA H100 80GB HBM3"
        devices.append({"name": dev, "attributes": {"productName": {"string": product},
                                                    "type": {"string": "mig" if "mig" in dev else "gpu"}}})
    return json.dumps({"items": [{"spec": {"driver": DRIVER, "pool": {"name": NODE, "generation": 1,
                                                                     "resourceSliceCount": 1},
                                           "nodeName": NODE, "devices": devices}}]})


def arg_after(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args and args.index(flag) + 1 < len(args) else None


def kubectl(args: list[str]) -> int:
    if "--context" in args:
        i = args.index("--context")
        del args[i:i + 2]
    ns = arg_after(args, "-n")
    if ns is not None:
        i = args.index("-n")
        del args[i:i + 2]
    jsonpath = next((a.split("=", 1)[1] for a in args if a.startswith("jsonpath=")), "")
    verb = args[0]
    if verb == "version":
        minor = "33" if FAIL == "old-k8s" else "34"
        print(json.dumps({"clientVersion": {"major": "1", "minor": "34"},
                          "serverVersion": {"major": "1", "minor": minor}}, indent=2))
        return 0
    if verb == "api-resources":
        print("deviceclasses.resource.k8s.io\nresourceclaims.resource.k8s.io\nresourceslices.resource.k8s.io")
        return 0
    if verb in {"apply", "rollout"}:
        return 0
    if verb == "delete":
        (STATE / "deleted").touch()
        return 0
    if verb == "wait":
        pod = next(a.split("/", 1)[1] for a in args if a.startswith("pod/"))
        return 1 if FAIL == "not-ready" and pod == "mig-slice" else 0
    if verb == "describe":
        print("Events: (fake)")
        return 0
    if verb == "exec":
        pod = args[1]
        cmd = args[args.index("--") + 1:]
        if cmd == ["env"]:
            _, claim, _, _ = PODS[pod]
            env = cdi_env(claim)
            if FAIL == "cdi-env":
                env = env[1:]
            print("\n".join(["PATH=/bin", "HOSTNAME=" + pod, *env]))
            return 0
        if cmd[:2] == ["test", "-e"]:
            return 0
        return 1
    if verb == "get":
        what = args[1]
        if what == "--raw":
            print("ok")
            return 0
        if what == "daemonset":
            print("daemonset.apps/cleave-kubelet-plugin")
            return 0
        if what == "resourceslices":
            if "json" in args:
                print(slices())
            else:
                print(f"resourceslice.resource.k8s.io/{NODE}-{DRIVER}-abcde")
            return 0
        if what == "deviceclasses":
            print("gpu.cleave.dev mig.cleave.dev mps.gpu.cleave.dev")
            return 0
        if what == "pod":
            pod = args[2]
            _, claim, how, _ = PODS[pod]
            if jsonpath == "{.spec.nodeName}":
                sys.stdout.write(NODE)
            elif "resourceClaimStatuses" in jsonpath:
                sys.stdout.write(f"{claim}\n" if how == "template" else "")
            elif ".spec.resourceClaims" in jsonpath:
                sys.stdout.write(f"{claim}\n" if how == "direct" else "\n")
            else:
                return 1
            return 0
        if what == "resourceclaim":
            claim = args[2]
            if jsonpath == "{.metadata.uid}":
                sys.stdout.write(uid(claim))
            elif "allocation" in jsonpath:
                sys.stdout.write(f"{DRIVER}/{NODE}/{CLAIMS[claim][1]}\n")
            else:
                return 1
            return 0
    print(f"fake kubectl: unhandled {args}", file=sys.stderr)
    return 1


def docker(args: list[str]) -> int:
    if args[0] in {"info", "build"}:
        return 0
    if args[0] == "exec":
        script = args[-1]
        claim = next((c for c in CLAIMS if uid(c) in script), None)
        gone = (STATE / "deleted").exists() and FAIL != "no-unprepare"
        if claim is None or gone:
            return 1
        if "grep -q" in script:
            return 0
        print(cdi_spec(claim))
        return 0
    print(f"fake docker: unhandled {args}", file=sys.stderr)
    return 1


def kind(args: list[str]) -> int:
    if args[:2] == ["get", "clusters"]:
        if (STATE / "cluster").exists():
            print("cleave")
        return 0
    if args[:2] == ["create", "cluster"]:
        (STATE / "cluster").touch()
        return 0
    if args[:2] == ["delete", "cluster"]:
        (STATE / "cluster").unlink(missing_ok=True)
        return 0
    if args[:2] == ["load", "docker-image"]:
        return 0
    print(f"fake kind: unhandled {args}", file=sys.stderr)
    return 1


def main() -> int:
    # Called as `fake_cluster.py TOOL ARGS...` (test wrappers) or through a link named TOOL.
    if len(sys.argv) > 1 and sys.argv[1] in {"docker", "kind", "kubectl", "helm"}:
        tool, args = sys.argv[1], sys.argv[2:]
    else:
        tool, args = Path(sys.argv[0]).name, sys.argv[1:]
    with open(STATE / "calls.log", "a") as log:
        log.write(" ".join([tool, *args]) + "\n")
    if tool == "helm":
        return 0
    return {"kubectl": kubectl, "docker": docker, "kind": kind}[tool](args)


if __name__ == "__main__":
    sys.exit(main())
