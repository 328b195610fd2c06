"""Offline checks of cleave's tenancy parts (docs/tenancy.md), run by test_deployments.py:

- the tenancy ValidatingAdmissionPolicies (values tenancy.*) validate strictly against the
  Kubernetes 1.34 schemas, every CEL expression compiles, and evaluated the way the API
  server evaluates them they allow each mode only where the namespace's labels allow it,
  cap the memory of shares, and leave other drivers' claims alone, for claims and
  templates alike;
- the two node-pool releases of deployments/examples/tenancy/ render side by side with no
  object name in common and no node that both plugin DaemonSets select;
- the manifests of deployments/examples/tenancy/ validate: Kubernetes objects strictly
  against the 1.34 schemas, Kueue objects against the fields of Kueue v0.19's API types
  (apis/kueue/v1beta2, apis/config/v1beta2 at tag v0.19.2; no package ships Kueue's CRD
  schemas), and they agree with each other (queues, flavors, device class mappings,
  quotas, the tenancy policy).

`register(module)` adds the checks to test_deployments' runner and takes its helpers.
"""

from __future__ import annotations

import copy
import itertools
import re
from decimal import Decimal
from pathlib import Path
from typing import Any

import celpy
import yaml
from celpy import celtypes

td: Any = None  # test_deployments, set by register()

ROOT = Path(__file__).resolve().parents[2]
TENANCY = ROOT / "deployments" / "examples" / "tenancy"
TENANCY_DOC = ROOT / "docs" / "tenancy.md"
PREFIX = "tenancy.gpu.cleave.dev/"
MODES = ["whole", "mig", "mps", "time-slicing", "shares"]
KUEUE_VERSION = "v0.19"
POOLS = {"cleave-training": "values-training-pool.yaml", "cleave-inference": "values-inference-pool.yaml"}


def register(module: Any) -> None:
    global td
    td = module
    for fn in (tenancy_policy_is_off_by_default_and_validates, tenancy_policy_allows_modes_by_namespace_label,
               tenancy_policy_caps_share_memory, tenancy_policy_catches_a_broken_rule,
               tenancy_values_schema, pool_releases_do_not_clash,
               tenancy_examples_validate, tenancy_examples_agree_with_each_other_and_the_policy,
               tenancy_doc_walks_every_example, pools_publish_what_their_tenants_classes_select):
        module.CHECKS.append(fn)


# ----------------------------------------------------------------------------- CEL


def _quantity(text: Any) -> celtypes.IntType:
    return celtypes.IntType(int(td.quantity(str(text))))


def _is_quantity(text: Any) -> celtypes.BoolType:
    try:
        td.quantity(str(text))
    except ValueError:
        return celtypes.BoolType(False)
    return celtypes.BoolType(True)


def _compare_to(a: Any, b: Any) -> celtypes.IntType:
    return celtypes.IntType((a > b) - (a < b))


def _join(items: Any, sep: Any = celtypes.StringType("")) -> celtypes.StringType:
    return celtypes.StringType(str(sep).join(str(i) for i in items))


def _as_approximate_float(q: Any) -> celtypes.DoubleType:
    return celtypes.DoubleType(float(q))


def _sum(items: Any) -> Any:
    items = list(items)
    if not items:
        return celtypes.IntType(0)
    total = items[0]
    for i in items[1:]:
        total = total + i
    return total


def _max(items: Any) -> Any:
    items = list(items)
    if not items:
        raise ValueError("max() of an empty list")  # as the lists library: an error
    return max(items)


# The Kubernetes CEL libraries the policies use: quantity() / isQuantity() / compareTo() /
# asApproximateFloat() (quantity library), list.join() (strings library) and list.sum() /
# list.max() (lists library), as the API server has them.
K8S_FUNCTIONS = {"quantity": _quantity, "isQuantity": _is_quantity, "compareTo": _compare_to, "join": _join,
                 "asApproximateFloat": _as_approximate_float, "sum": _sum, "max": _max}


def cel(expr: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(expr), functions=K8S_FUNCTIONS)


def _eval(expr: str, act: dict) -> Any:
    try:
        return cel(expr).evaluate(act)
    except celpy.CELEvalError as e:
        return e


def policies(objs: list[dict]) -> dict[str, dict]:
    """The tenancy policies by resource they match."""
    out = {}
    for o in objs:
        if o["kind"] == "ValidatingAdmissionPolicy" and "-tenancy-" in o["metadata"]["name"]:
            (rule,) = o["spec"]["matchConstraints"]["resourceRules"]
            (res,) = rule["resources"]
            out[res] = o
    return out


def admit(policy: dict, obj: dict, ns_labels: dict[str, str] | None, op: str = "CREATE",
          namespace: str = "team-a") -> tuple[bool, list[str]] | None:
    """Evaluates a policy as the API server does: None when it does not match the request,
    else (allowed, messages of the failed validations). Variables are computed in order;
    one that fails is kept as an error and fails only the expressions that read it."""
    spec = policy["spec"]
    res = {"ResourceClaim": "resourceclaims", "ResourceClaimTemplate": "resourceclaimtemplates"}[obj["kind"]]
    group, _, version = obj["apiVersion"].partition("/")
    if not any(group in r["apiGroups"] and version in r["apiVersions"] and op in r["operations"]
               and res in r["resources"] for r in spec["matchConstraints"]["resourceRules"]):
        return None
    ns = {"metadata": {"name": namespace}}
    if ns_labels is not None:
        ns["metadata"]["labels"] = ns_labels
    act = {"object": celpy.json_to_cel(obj), "oldObject": None, "namespaceObject": celpy.json_to_cel(ns),
           "request": celpy.json_to_cel({"operation": op, "namespace": namespace,
                                         "resource": {"group": group, "version": version, "resource": res}})}
    for c in spec.get("matchConditions", []):
        if not _eval(c["expression"], act):
            return None
    variables: dict[str, Any] = {}
    for v in spec["variables"]:
        act["variables"] = celtypes.MapType({celtypes.StringType(k): x for k, x in variables.items()})
        variables[v["name"]] = _eval(v["expression"], act)
    act["variables"] = celtypes.MapType({celtypes.StringType(k): x for k, x in variables.items()})
    messages = []
    for v in spec["validations"]:
        ok = _eval(v["expression"], act)
        if isinstance(ok, Exception):  # failurePolicy Fail: an error denies
            assert spec["failurePolicy"] == "Fail"
            messages.append(f"error: {ok}")
        elif not ok:
            msg = _eval(v["messageExpression"], act) if "messageExpression" in v else v["message"]
            assert not isinstance(msg, Exception), f"messageExpression failed: {msg}"
            messages.append(str(msg))
    return (not messages, messages)


def claim(*requests: dict, configs: list[dict] | None = None) -> dict:
    devices: dict[str, Any] = {"requests": list(requests)}
    if configs:
        devices["config"] = configs
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "c", "namespace": "team-a"}, "spec": {"devices": devices}}


def template_of(c: dict) -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": c["metadata"], "spec": {"spec": c["spec"]}}


def req(cls: str, name: str = "gpu", **extra: Any) -> dict:
    return {"name": name, "exactly": {"deviceClassName": cls, **extra}}


def alternatives(*classes: str, name: str = "gpu") -> dict:
    return {"name": name, "firstAvailable": [{"name": f"a{i}", "deviceClassName": c} for i, c in enumerate(classes)]}


def strategy(s: str, driver: str = "gpu.cleave.dev") -> dict:
    sharing: dict[str, Any] = {"strategy": s}
    return {"opaque": {"driver": driver, "parameters": {"apiVersion": "gpu.cleave.dev/v1alpha1",
                                                        "kind": "GpuConfig", "sharing": sharing}}}


def allow(*modes: str) -> dict[str, str]:
    return {f"{PREFIX}allow-{m}": "true" for m in modes}


def verdict(pols: dict[str, dict], c: dict, labels: dict[str, str] | None) -> tuple[bool, list[str]]:
    """The verdict on a claim, checked to be the same on the template that holds its spec."""
    on_claim = admit(pols["resourceclaims"], c, labels)
    on_template = admit(pols["resourceclaimtemplates"], template_of(c), labels)
    assert on_claim is not None and on_template is not None
    assert admit(pols["resourceclaims"], template_of(c), labels) is None, "claim policy matched a template"
    assert admit(pols["resourceclaimtemplates"], c, labels) is None, "template policy matched a claim"
    assert on_claim[0] == on_template[0], f"claim {on_claim} vs template {on_template}"
    assert not [m for m in on_claim[1] + on_template[1] if m.startswith("error:")], (on_claim, on_template)
    for a, b in zip(on_claim[1], on_template[1]):
        assert a.replace("ResourceClaim", "X") == b.replace("ResourceClaimTemplate", "X"), (a, b)
    return on_claim


def tenancy_objs(values: dict | None = None) -> list[dict]:
    return td.render({"tenancy": {"enabled": True, **(values or {})}})


# ----------------------------------------------------------------------------- policy checks


def tenancy_policy_is_off_by_default_and_validates() -> None:
    assert not policies(td.render()), "tenancy policies rendered without tenancy.enabled"
    objs = tenancy_objs()
    pols = policies(objs)
    assert set(pols) == {"resourceclaims", "resourceclaimtemplates"}, sorted(pols)
    bindings = {o["spec"]["policyName"]: o for o in objs
                if o["kind"] == "ValidatingAdmissionPolicyBinding" and "-tenancy-" in o["metadata"]["name"]}
    for p in pols.values():
        td.validate_k8s(p, "tenancy policy")
        b = bindings[p["metadata"]["name"]]
        td.validate_k8s(b, "tenancy binding")
        assert b["spec"]["validationActions"] == ["Deny"], b["spec"]
        spec = p["spec"]
        assert spec["failurePolicy"] == "Fail"
        (rule,) = spec["matchConstraints"]["resourceRules"]
        assert rule["operations"] == ["CREATE"] and rule["apiVersions"] == ["v1"], rule
        exprs = [v["expression"] for v in spec["variables"]] + \
            [e for v in spec["validations"] for e in (v["expression"], v.get("messageExpression")) if e]
        for e in exprs:
            cel(e)  # compiles
    warn = tenancy_objs({"validationActions": ["Warn", "Audit"]})
    assert {o["spec"]["validationActions"][0] for o in warn if o["kind"] == "ValidatingAdmissionPolicyBinding"
            and "-tenancy-" in o["metadata"]["name"]} == {"Warn"}


def tenancy_policy_allows_modes_by_namespace_label() -> None:
    pols = policies(tenancy_objs())
    ts = claim(req("gpu.cleave.dev"), configs=[strategy("TimeSlicing")])

    # Time-slicing: denied unlabelled, with a message naming namespace, mode, rule and label.
    ok, msgs = verdict(pols, ts, None)
    assert not ok and len(msgs) == 1, msgs
    for needle in ("namespace team-a", "time-slicing (sharing.strategy TimeSlicing)",
                   f"{PREFIX}allow-time-slicing=true", f"{PREFIX}allow-whole=true"):
        assert needle in msgs[0], f"{needle!r} not in {msgs[0]!r}"
    assert verdict(pols, ts, allow("whole", "time-slicing")) == (True, [])
    ok, msgs = verdict(pols, ts, allow("whole"))
    assert not ok and "allow-time-slicing" in msgs[0] and "allow-whole" not in msgs[0], msgs
    # Only "true", as Kubernetes' admin-access label.
    assert not verdict(pols, ts, {f"{PREFIX}allow-whole": "true", f"{PREFIX}allow-time-slicing": "True"})[0]
    assert not verdict(pols, ts, {f"{PREFIX}allow-whole": "true", f"{PREFIX}allow-time-slicing": "false"})[0]

    # Each class stands for its mode.
    for cls, mode in (("gpu.cleave.dev", "whole"), ("mig.cleave.dev", "mig"), ("mps.gpu.cleave.dev", "mps")):
        c = claim(req(cls))
        assert verdict(pols, c, allow(mode)) == (True, []), cls
        others = [m for m in MODES if m != mode]
        ok, msgs = verdict(pols, c, allow(*others))
        assert not ok and f"allow-{mode}=true" in msgs[0] and cls in msgs[0], msgs
        assert not verdict(pols, c, None)[0]
    share = claim(req("shared.gpu.cleave.dev", capacity={"requests": {"memory": "10Gi", "multiprocessors": "33"}}))
    assert verdict(pols, share, allow("shares")) == (True, [])
    assert not verdict(pols, share, allow("whole"))[0]
    # A MIG device asked by capacity is a share of it: mig and shares.
    mig_share = claim(req("mig.cleave.dev", capacity={"requests": {"memory": "5Gi"}}))
    assert verdict(pols, mig_share, allow("mig", "shares")) == (True, [])
    ok, msgs = verdict(pols, mig_share, allow("mig"))
    assert not ok and "allow-shares=true" in msgs[0], msgs
    # MPS by config on the whole-GPU class: whole and mps.
    mps_cfg = claim(req("gpu.cleave.dev"), configs=[strategy("MPS")])
    assert verdict(pols, mps_cfg, allow("whole", "mps")) == (True, [])
    assert not verdict(pols, mps_cfg, allow("whole"))[0]
    # Every alternative of a prioritized list must be allowed.
    alt = claim(alternatives("mig.cleave.dev", "gpu.cleave.dev"))
    assert verdict(pols, alt, allow("mig", "whole")) == (True, [])
    ok, msgs = verdict(pols, alt, allow("mig"))
    assert not ok and "allow-whole=true" in msgs[0], msgs
    # Several modes denied at once: all named.
    mixed = claim(req("mig.cleave.dev", name="a"), req("mps.gpu.cleave.dev", name="b"))
    ok, msgs = verdict(pols, mixed, None)
    assert "allow-mig=true, " + PREFIX + "allow-mps=true" in msgs[0], msgs

    # Other drivers pass untouched, whatever their configs say; so do claims without devices.
    other = claim(req("gpu.example.com"), alternatives("fpga.example.com", name="f"),
                  configs=[strategy("TimeSlicing", driver="gpu.example.com")])
    assert verdict(pols, other, None) == (True, [])
    assert verdict(pols, claim(), None) == (True, [])
    # ... but not a cleave request beside them.
    assert not verdict(pols, claim(req("gpu.example.com", name="x"), req("mig.cleave.dev")), None)[0]

    # Admin access: in a namespace Kubernetes lets use it, the request is not charged its
    # class's mode; a config of the driver still is. Elsewhere it is charged as usual.
    admin_label = {"resource.kubernetes.io/admin-access": "true"}
    admin = claim(req("gpu.cleave.dev", adminAccess=True))
    assert verdict(pols, admin, admin_label) == (True, [])
    assert not verdict(pols, admin, {"resource.kubernetes.io/admin-access": "True"})[0]
    assert not verdict(pols, admin, None)[0]
    admin_ts = claim(req("gpu.cleave.dev", adminAccess=True), configs=[strategy("TimeSlicing")])
    ok, msgs = verdict(pols, admin_ts, admin_label)
    assert not ok and "allow-time-slicing" in msgs[0] and "allow-whole" not in msgs[0], msgs

    # allowEverywhere, and classes of one's own.
    pols2 = policies(tenancy_objs({"allowEverywhere": ["whole", "mig"],
                                   "classModes": {"h100.example.com": "whole"}}))
    assert verdict(pols2, claim(req("mig.cleave.dev")), None) == (True, [])
    assert verdict(pols2, claim(req("h100.example.com")), None) == (True, [])
    assert not verdict(pols2, ts, None)[0]
    pols3 = policies(tenancy_objs({"classModes": {"h100.example.com": "whole"}}))
    ok, msgs = verdict(pols3, claim(req("h100.example.com")), None)
    assert not ok and "DeviceClass gpu.cleave.dev, h100.example.com" in msgs[0], msgs

    # Not on UPDATE (specs are immutable; finalizer updates must pass) nor other versions
    # as such (matchPolicy Equivalent converts them to v1 first).
    assert admit(pols["resourceclaims"], ts, None, op="UPDATE") is None
    assert pols["resourceclaims"]["spec"]["matchConstraints"]["matchPolicy"] == "Equivalent"


def tenancy_policy_caps_share_memory() -> None:
    pols = policies(tenancy_objs())

    def share(cls: str = "shared.gpu.cleave.dev", **caps: str) -> dict:
        extra = {"capacity": {"requests": caps}} if caps else {}
        return claim(req(cls, **extra))

    capped = dict(allow("shares", "mig", "whole"), **{PREFIX + "max-share-memory": "20Gi"})
    assert verdict(pols, share(memory="20Gi", multiprocessors="33"), capped) == (True, [])
    assert verdict(pols, share(memory="10240Mi"), capped) == (True, [])
    ok, msgs = verdict(pols, share(memory="21Gi"), capped)
    assert not ok and "caps the GPU memory of the shares of one claim at 20Gi" in msgs[0] \
        and "request(s) gpu" in msgs[0], msgs
    assert not verdict(pols, share(**{"gpu.cleave.dev/memory": "30Gi"}), capped)[0]
    # No memory asked: the share takes the whole device's memory.
    ok, msgs = verdict(pols, share(), capped)
    assert not ok and "ask no capacity.requests memory" in msgs[0], msgs
    assert not verdict(pols, share(multiprocessors="10"), capped)[0]
    assert not verdict(pols, share("mig.cleave.dev", memory="40Gi"), capped)[0]
    assert verdict(pols, share("mig.cleave.dev", memory="10Gi"), capped) == (True, [])
    # Whole GPUs and MIG devices asked without capacity are not shares.
    assert verdict(pols, claim(req("gpu.cleave.dev"), req("mig.cleave.dev", name="m")), capped) == (True, [])
    # A prioritized list: every alternative that is a share must fit.
    alt = claim({"name": "gpu", "firstAvailable": [
        {"name": "small", "deviceClassName": "shared.gpu.cleave.dev", "capacity": {"requests": {"memory": "8Gi"}}},
        {"name": "big", "deviceClassName": "shared.gpu.cleave.dev", "capacity": {"requests": {"memory": "40Gi"}}}]})
    assert not verdict(pols, alt, capped)[0]
    # The whole claim counts, since prepare gives it every share: memory x count, summed
    # over its requests, a prioritized list by its largest alternative.
    def shares(*reqs: tuple[str, str, int | None]) -> dict:
        return claim(*(req("shared.gpu.cleave.dev", name=n, capacity={"requests": {"memory": m}},
                           **({"count": c} if c is not None else {})) for n, m, c in reqs))
    ok, msgs = verdict(pols, shares(("a", "10Gi", 8)), capped)
    assert not ok and "ask more in total" in msgs[0] and "request(s) a" in msgs[0], msgs
    assert verdict(pols, shares(("a", "10Gi", 2)), capped) == (True, [])
    assert verdict(pols, shares(("a", "5Gi", 4)), capped) == (True, [])
    assert not verdict(pols, shares(("a", "5Gi", 4), ("b", "1Mi", None)), capped)[0]
    ok, msgs = verdict(pols, shares(("a", "12Gi", None), ("b", "12Gi", None)), capped)
    assert not ok and "request(s) a, b" in msgs[0], msgs
    assert verdict(pols, shares(("a", "10Gi", None), ("b", "10Gi", None)), capped) == (True, [])
    # Whole GPUs beside shares do not count against the share cap.
    assert verdict(pols, claim(req("gpu.cleave.dev", name="w", count=4),
                               req("shared.gpu.cleave.dev", capacity={"requests": {"memory": "20Gi"}})), capped) == (True, [])
    # The qualified capacity name counts the same.
    assert not verdict(pols, claim(req("shared.gpu.cleave.dev", count=3,
                                       capacity={"requests": {"gpu.cleave.dev/memory": "8Gi"}})), capped)[0]
    # firstAvailable: the largest alternative counts (memory x count), beside the other requests.
    def fa(*alts: tuple[str, int]) -> dict:
        return {"name": "f", "firstAvailable": [
            {"name": f"a{i}", "deviceClassName": "shared.gpu.cleave.dev", "count": c,
             "capacity": {"requests": {"memory": m}}} for i, (m, c) in enumerate(alts)]}
    assert verdict(pols, claim(fa(("4Gi", 2), ("8Gi", 1))), capped) == (True, [])
    assert not verdict(pols, claim(fa(("4Gi", 2), ("8Gi", 3))), capped)[0]
    assert verdict(pols, claim(fa(("4Gi", 2), ("8Gi", 1)), *shares(("s", "12Gi", None))["spec"]["devices"]["requests"]),
                   capped) == (True, [])
    assert not verdict(pols, claim(fa(("4Gi", 2), ("8Gi", 1)), *shares(("s", "13Gi", None))["spec"]["devices"]["requests"]),
                       capped)[0]
    # A firstAvailable of a whole GPU or a share: the share alternative is what counts.
    mixed = {"name": "f", "firstAvailable": [{"name": "whole", "deviceClassName": "gpu.cleave.dev", "count": 8},
                                             {"name": "part", "deviceClassName": "shared.gpu.cleave.dev",
                                              "capacity": {"requests": {"memory": "16Gi"}}}]}
    assert verdict(pols, claim(mixed), capped) == (True, [])
    # allocationMode All: no bound on the number of shares.
    ok, msgs = verdict(pols, claim(req("shared.gpu.cleave.dev", allocationMode="All",
                                       capacity={"requests": {"memory": "1Gi"}})), capped)
    assert not ok and "allocationMode All" in msgs[0], msgs
    # A count large enough to overflow int64 bytes is still refused with the cap's message.
    ok, msgs = verdict(pols, shares(("a", "1Ti", 2**40)), capped)
    assert not ok and "ask more in total" in msgs[0], msgs
    # A label that is not a quantity refuses every share and says so; no label, no cap.
    bad = dict(capped, **{PREFIX + "max-share-memory": "lots"})
    ok, msgs = verdict(pols, share(memory="1Gi"), bad)
    assert not ok and "is not a quantity" in msgs[0], msgs
    assert verdict(pols, claim(req("gpu.cleave.dev")), bad) == (True, [])
    assert verdict(pols, share(memory="70Gi"), allow("shares")) == (True, [])


def tenancy_policy_catches_a_broken_rule() -> None:
    """The evaluation above can fail: a policy that forgets the strategy of opaque configs
    lets a time-slicing claim through, and the check sees it."""
    pols = policies(tenancy_objs())
    broken = copy.deepcopy(pols)
    for p in broken.values():
        for v in p["spec"]["variables"]:
            if v["name"] == "strategyModes":
                v["expression"] = "{'MPS': 'mps'}"
    ts = claim(req("gpu.cleave.dev"), configs=[strategy("TimeSlicing")])
    assert not verdict(pols, ts, allow("whole"))[0]
    assert verdict(broken, ts, allow("whole"))[0], "the doctored policy should have let time-slicing through"


def tenancy_values_schema() -> None:
    bad = [
        {"tenancy": {"enabled": "yes"}},
        {"tenancy": {"allowEverywhere": ["timeslicing"]}},
        {"tenancy": {"classModes": {"gpu.cleave.dev": "exclusive"}}},
        {"tenancy": {"classModes": {"Not A Class": "whole"}}},
        {"tenancy": {"validationActions": ["Deny", "Warn"]}},
        {"tenancy": {"validationActions": []}},
        {"tenancy": {"validationActions": ["Block"]}},
        {"tenancy": {"labelPrefix": "x/"}},
    ]
    with td.helm.Chart.load(td.CHART) as chart:
        accepted = td.schema_accepted(chart, bad)
    assert not accepted, f"schema accepted wrong tenancy values: {accepted}"
    tenancy_objs({"allowEverywhere": MODES, "validationActions": ["Audit"]})


# ----------------------------------------------------------------------------- pools


def render_release(name: str, values: dict, namespace: str = "cleave-system") -> list[dict]:
    with td.helm.Chart.load(td.CHART) as chart:
        out = td.chart_render(chart, values, name=name, namespace=namespace, is_install=True)
    return [d for path, text in sorted(out.items()) if not path.endswith("NOTES.txt")
            for d in yaml.safe_load_all(text) if d is not None]


def node_terms(ds: dict) -> list[list[tuple[str, str, set[str]]]]:
    """The DaemonSet's node requirements as OR-ed terms of AND-ed (key, operator, values):
    nodeSelector entries added to each required nodeAffinity term."""
    pod = ds["spec"]["template"]["spec"]
    base = [(k, "In", {v}) for k, v in (pod.get("nodeSelector") or {}).items()]
    terms = (((pod.get("affinity") or {}).get("nodeAffinity") or {})
             .get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms") or [{}]
    return [base + [(e["key"], e["operator"], set(e.get("values", []))) for e in t.get("matchExpressions", [])]
            for t in terms]


def selects(term: list[tuple[str, str, set[str]]], labels: dict[str, str]) -> bool:
    for key, op, values in term:
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
        if op not in {"In", "NotIn", "Exists", "DoesNotExist"}:
            raise AssertionError(f"operator {op} not modelled")
    return True


def contradict(a: list, b: list) -> bool:
    """True when no node can meet both terms: some key both pin to disjoint values."""
    pins: dict[str, set[str]] = {}
    for key, op, values in a + b:
        if op == "In":
            pins[key] = pins.get(key, values) & values
    return any(not v for v in pins.values())


def pool_releases_do_not_clash() -> None:
    releases = {name: render_release(name, yaml.safe_load((TENANCY / f).read_text())) for name, f in POOLS.items()}
    names: dict[tuple[str, str], str] = {}
    for rel, objs in releases.items():
        for o in objs:
            td.validate_k8s(o, f"release {rel}")
            key = (o["kind"], o["metadata"]["name"])
            assert key not in names, f"{key} rendered by both {names[key]} and {rel}"
            names[key] = rel
    classes = {n for (k, n) in names if k == "DeviceClass"}
    assert classes == td.DEVICE_CLASSES, f"the pools install the classes {sorted(classes)}"
    assert [r for r, objs in releases.items() if policies(objs)] == ["cleave-training"]
    train = td.plugin_container(releases["cleave-training"])
    infer = td.plugin_container(releases["cleave-inference"])
    tf, inf = td.flags(train), td.flags(infer)
    assert "--dynamic-mig" not in tf and tf.get("--consumable-capacity", "off") == "off", tf
    assert "--dynamic-mig" in inf and inf.get("--consumable-capacity") == "mps", inf

    sets = {rel: node_terms(td.one(objs, "DaemonSet")) for rel, objs in releases.items()}
    # Symbolically: every pair of terms pins one key to different values.
    for ta, tb in itertools.product(*sets.values()):
        assert contradict(ta, tb), f"a node could match both DaemonSets: {ta} and {tb}"
    # And on sample nodes: every combination of pool and GPU labels.
    pool_values = [None, "training", "inference", "other"]
    gpu_labels = [{}, *td.GPU_NODE_LABELS.values()]
    hits = {rel: 0 for rel in sets}
    for pool, gpu in itertools.product(pool_values, gpu_labels):
        labels = dict(gpu, **({"example.com/gpu-pool": pool} if pool else {}))
        matched = [rel for rel, terms in sets.items() if any(selects(t, labels) for t in terms)]
        assert len(matched) <= 1, f"node {labels} runs two plugins: {matched}"
        for rel in matched:
            hits[rel] += 1
    assert all(hits.values()), f"a pool's plugin selects no sample node: {hits}"
    # The check can fail: the same release twice overlaps.
    same = node_terms(td.one(releases["cleave-training"], "DaemonSet"))
    assert not contradict(same[0], same[0])


# The classes each pool's tenants are meant to use (docs/tenancy.md): the training pool runs
# whole GPUs (training-job.yaml); the inference pool runs the model server's shares
# (inference.yaml) and the evaluation Job's MIG instances (eval-job.yaml).
POOL_CLASSES = {"cleave-training": ["gpu.cleave.dev"],
                "cleave-inference": ["shared.gpu.cleave.dev", "mig.cleave.dev"]}
# Each pool's nodes as the mock plays them: MIG mode off in training (docs/tenancy.md
# section 1), on in inference (MIG instances on demand); eight H100s each.
POOL_MIG = {"cleave-training": "off", "cleave-inference": "on"}
POOL_PROFILE = "h100-80gb-x8"
# The `run` flags that change what a node publishes; `inspect` takes the same.
PUBLISH_FLAGS = ("--dynamic-mig", "--consumable-capacity", "--share-on-demand-mig")


def published_devices(flags: dict[str, str | None], mig: str) -> list[dict]:
    """The devices a mock node publishes with the DaemonSet's publishing flags, as `inspect
    --yaml` of the built plugin prints them, in the shape CEL selectors see (`device.driver`,
    `.attributes[domain][name]`, `.capacity[domain][name]` as a number, `.allowMultipleAllocations`)."""
    import subprocess  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    args = [str(td.built_plugin()), "inspect", "--mock", POOL_PROFILE, "--yaml"]
    for f in PUBLISH_FLAGS:
        if f in flags:
            args += [f] if flags[f] is None else [f"{f}={flags[f]}"]
    with tempfile.TemporaryDirectory() as tmp:
        env = {"PATH": "/usr/bin:/bin", "MOCK_NVML_STATE": str(Path(tmp) / "state"), "MOCK_NVML_MIG": mig}
        proc = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, f"{' '.join(args[1:])}: {proc.stderr[-2000:]}"
    devices = []
    for slice_ in (d for d in yaml.safe_load_all(proc.stdout) if d):
        driver = slice_["spec"]["driver"]
        for dev in slice_["spec"].get("devices") or []:
            attrs: dict[str, dict] = {}
            for name, value in (dev.get("attributes") or {}).items():
                domain, _, short = name.rpartition("/")
                (v,) = value.values()
                attrs.setdefault(domain or driver, {})[short] = v
            caps: dict[str, dict] = {}
            for name, value in (dev.get("capacity") or {}).items():
                domain, _, short = name.rpartition("/")
                caps.setdefault(domain or driver, {})[short] = int(td.quantity(str(value["value"])))
            devices.append({"name": dev["name"], "driver": driver, "attributes": attrs, "capacity": caps,
                            "allowMultipleAllocations": bool(dev.get("allowMultipleAllocations"))})
    return devices


def class_selects(cls: dict, device: dict) -> bool:
    return all(td.cel_select(s["cel"]["expression"], device) for s in cls["spec"].get("selectors") or [])


def pools_publish_what_their_tenants_classes_select() -> None:
    """Each class a pool's tenants use selects some device that pool's plugin publishes
    (its release's flags, on a mock node of the pool's MIG mode); otherwise their pods
    stay Pending. Fails naming the class and the pool."""
    releases = {name: render_release(name, yaml.safe_load((TENANCY / f).read_text())) for name, f in POOLS.items()}
    classes = {o["metadata"]["name"]: o for objs in releases.values() for o in objs if o["kind"] == "DeviceClass"}
    used = {d["deviceClassName"] for docs in tenancy_docs().values() for d in _walk(docs)
             if isinstance(d, dict) and isinstance(d.get("deviceClassName"), str)}
    meant = {c for cs in POOL_CLASSES.values() for c in cs}
    assert used <= meant, f"the tenancy examples use classes no pool is meant for: {sorted(used - meant)}"

    def missing(rel: str, objs: list[dict]) -> list[str]:
        devices = published_devices(td.flags(td.plugin_container(objs)), POOL_MIG[rel])
        assert devices, f"pool {rel} ({POOLS[rel]}) publishes no device"
        return [f"class {c} selects none of the {len(devices)} devices pool {rel} ({POOLS[rel]}) publishes"
                for c in POOL_CLASSES[rel] if not any(class_selects(classes[c], d) for d in devices)]

    bad = [m for rel, objs in releases.items() for m in missing(rel, objs)]
    assert not bad, "; ".join(bad)
    # The check can fail: without shareOnDemandMig the inference pool's MIG-mode GPUs
    # publish nothing shareable, and the shared class selects nothing.
    values = yaml.safe_load((TENANCY / POOLS["cleave-inference"]).read_text())
    values["shareOnDemandMig"] = False
    got = missing("cleave-inference", render_release("cleave-inference", values))
    assert got and "shared.gpu.cleave.dev" in got[0], got


def _walk(node: Any) -> Any:
    """Every dict and list inside `node` (itself included)."""
    yield node
    if isinstance(node, dict):
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


# ----------------------------------------------------------------------------- examples

# Fields of the Kueue objects the examples use, from Kueue v0.19.2: apis/kueue/v1beta2
# (resourceflavor_types.go, clusterqueue_types.go, localqueue_types.go) and
# apis/config/v1beta2/configuration_types.go. A dict lists the fields of an object (None:
# not looked into); a one-element list, the fields of each item.
_META = {"name": None, "namespace": None, "labels": None, "annotations": None}
_QUOTA = [{"name": None, "nominalQuota": None, "borrowingLimit": None, "lendingLimit": None}]
KUEUE_FIELDS: dict[tuple[str, str], dict] = {
    ("kueue.x-k8s.io/v1beta2", "ResourceFlavor"): {
        "apiVersion": None, "kind": None, "metadata": _META,
        "spec": {"nodeLabels": None, "nodeTaints": None, "tolerations": None, "topologyName": None}},
    ("kueue.x-k8s.io/v1beta2", "ClusterQueue"): {
        "apiVersion": None, "kind": None, "metadata": _META,
        "spec": {"resourceGroups": [{"coveredResources": None, "flavors": [{"name": None, "resources": _QUOTA}]}],
                 "cohortName": None, "queueingStrategy": None, "namespaceSelector": None,
                 "flavorFungibility": None, "preemption": None, "admissionChecksStrategy": None,
                 "stopPolicy": None, "fairSharing": None, "admissionScope": None,
                 "concurrentAdmissionPolicy": None}},
    ("kueue.x-k8s.io/v1beta2", "LocalQueue"): {
        "apiVersion": None, "kind": None, "metadata": _META,
        "spec": {"clusterQueue": None, "stopPolicy": None, "fairSharing": None}},
    ("config.kueue.x-k8s.io/v1beta2", "Configuration"): {
        "apiVersion": None, "kind": None, "namespace": None, "manageJobsWithoutQueueName": None,
        "managedJobsNamespaceSelector": None, "internalCertManagement": None,
        "waitForPodsReady": {"timeout": None, "blockAdmission": None, "requeuingStrategy": None,
                             "recoveryTimeout": None},
        "clientConnection": None, "integrations": None, "multiKueue": None, "fairSharing": None,
        "admissionFairSharing": None,
        "resources": {"quotaCheckStrategy": None, "excludeResourcePrefixes": None, "transformations": None,
                      "deviceClassMappings": [{"name": None, "deviceClassNames": None, "sources": None}]},
        "featureGates": None, "objectRetentionPolicies": None, "visibilityServer": None,
        "webhook": None, "leaderElection": None, "metrics": None, "health": None, "pprofBindAddress": None,
        "controller": None},
}


def check_fields(obj: Any, shape: Any, at: str) -> None:
    if shape is None:
        return
    if isinstance(shape, list):
        assert isinstance(obj, list), f"{at}: expected a list"
        for i, item in enumerate(obj):
            check_fields(item, shape[0], f"{at}[{i}]")
        return
    assert isinstance(obj, dict), f"{at}: expected an object"
    unknown = set(obj) - set(shape)
    assert not unknown, f"{at}: field(s) {sorted(unknown)} not in Kueue {KUEUE_VERSION}'s API"
    for k, v in obj.items():
        check_fields(v, shape[k], f"{at}.{k}")


def tenancy_docs() -> dict[str, list[dict]]:
    files = sorted(p for p in TENANCY.glob("*.yaml") if not p.name.startswith("values-"))
    assert files, f"no manifests in {TENANCY}"
    return {p.name: [d for d in yaml.safe_load_all(p.read_text()) if d is not None] for p in files}


def is_kueue(d: dict) -> bool:
    return d["apiVersion"].split("/")[0].endswith("kueue.x-k8s.io")


def tenancy_examples_validate() -> None:
    for name, docs in tenancy_docs().items():
        assert (TENANCY / name).read_text().startswith("# "), f"{name} must begin with a comment saying what it shows"
        assert docs, f"{name} is empty"
        for d in docs:
            if is_kueue(d):
                shape = KUEUE_FIELDS.get((d["apiVersion"], d["kind"]))
                assert shape, f"{name}: {d['apiVersion']} {d['kind']} is not a Kueue {KUEUE_VERSION} kind checked here"
                check_fields(d, shape, f"{name}: {d['kind']}")
            else:
                td.validate_k8s(d, name)
            if d["kind"] in {"ResourceClaim", "ResourceClaimTemplate"}:
                assert d["apiVersion"] == "resource.k8s.io/v1", f"{name}: {d['apiVersion']}"
    for name in POOLS.values():
        with td.helm.Chart.load(td.CHART) as chart:
            assert td.schema_accepted(chart, [yaml.safe_load((TENANCY / name).read_text())]), f"{name} rejected"


def tenancy_examples_agree_with_each_other_and_the_policy() -> None:
    docs = tenancy_docs()
    every = [(f, d) for f, ds in docs.items() for d in ds]

    def kind(k: str) -> list[dict]:
        return [d for _, d in every if d["kind"] == k]

    namespaces = {d["metadata"]["name"]: d["metadata"].get("labels", {}) for d in kind("Namespace")}
    for f, d in every:
        if d["kind"] not in {"Namespace", "ResourceFlavor", "ClusterQueue", "Configuration"}:
            assert d["metadata"].get("namespace") in namespaces, f"{f}: {d['kind']} outside the tenants' namespaces"
    # Claims and templates: the shipped classes, valid configs and selectors, and the
    # tenancy policy's verdict in their namespace (the one denied example is denied).
    pols = policies(render_release("cleave-training", yaml.safe_load((TENANCY / POOLS["cleave-training"]).read_text())))
    for f, d in every:
        if d["kind"] not in {"ResourceClaim", "ResourceClaimTemplate"}:
            continue
        spec = d["spec"]["spec"] if d["kind"] == "ResourceClaimTemplate" else d["spec"]
        for r in spec["devices"]["requests"]:
            assert r["exactly"]["deviceClassName"] in td.DEVICE_CLASSES, f"{f}: {r}"
            for s in r["exactly"].get("selectors", []):
                td.check_cel_names(s["cel"]["expression"], f)
                td.cel_program(s["cel"]["expression"])
        for cfg in spec["devices"].get("config", []):
            td.check_opaque_config(cfg["opaque"]["parameters"], f)
        res = "resourceclaims" if d["kind"] == "ResourceClaim" else "resourceclaimtemplates"
        ns = d["metadata"]["namespace"]
        ok, msgs = admit(pols[res], d, namespaces[ns], namespace=ns)
        if f.startswith("denied-"):
            assert not ok, f"{f}: the tenancy policy allows what the file says it refuses"
            quoted = " ".join(line[1:].strip() for line in (TENANCY / f).read_text().splitlines()
                              if line.startswith("#   "))
            assert quoted == msgs[0], f"{f}: the comment quotes\n  {quoted}\nthe policy says\n  {msgs[0]}"
        else:
            assert ok, f"{f}: {d['kind']} {d['metadata']['name']} denied: {msgs}"

    # Kueue: configuration, flavors, queues and Jobs refer to each other.
    (config,) = kind("Configuration")
    mapping = {c: m["name"] for m in config["resources"]["deviceClassMappings"] for c in m["deviceClassNames"]}
    assert all(c in td.DEVICE_CLASSES for c in mapping), mapping
    flavors = {d["metadata"]["name"]: d for d in kind("ResourceFlavor")}
    pools = {yaml.safe_load((TENANCY / v).read_text())["nodeSelector"]["example.com/gpu-pool"] for v in POOLS.values()}
    for fl in flavors.values():
        assert fl["spec"]["nodeLabels"].get("example.com/gpu-pool") in pools, f"flavor {fl['metadata']['name']}"
    cqs = {d["metadata"]["name"]: d for d in kind("ClusterQueue")}
    assert len(cqs) >= 2 and len({cq["spec"].get("cohortName") for cq in cqs.values()}) == 1, "one cohort"
    limit: dict[tuple[str, str], Decimal] = {}  # (clusterqueue, resource) -> nominal + borrowing, all flavors
    for name, cq in cqs.items():
        groups = cq["spec"]["resourceGroups"]
        covered = [r for g in groups for r in g["coveredResources"]]
        assert len(covered) == len(set(covered)), f"{name}: a resource in two groups"
        assert set(mapping.values()) <= set(covered), f"{name}: covers {covered}, not all of {set(mapping.values())}"
        for g in groups:
            for fq in g["flavors"]:
                assert fq["name"] in flavors, f"{name}: no ResourceFlavor {fq['name']}"
                assert [r["name"] for r in fq["resources"]] == g["coveredResources"], \
                    f"{name}: flavor {fq['name']} must list {g['coveredResources']} in that order"
                for r in fq["resources"]:
                    total = td.quantity(r["nominalQuota"]) + td.quantity(r.get("borrowingLimit", 0))
                    assert "borrowingLimit" in r or r["name"] not in mapping.values(), \
                        f"{name}: {r['name']} in {fq['name']} may borrow without limit"
                    limit[(name, r["name"])] = limit.get((name, r["name"]), Decimal(0)) + total
        sel = cq["spec"]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
        assert sel in namespaces, f"{name}: selects namespace {sel}, not in the examples"
    local = {(d["metadata"]["namespace"], d["metadata"]["name"]): d["spec"]["clusterQueue"] for d in kind("LocalQueue")}
    assert all(cq in cqs for cq in local.values()), local
    templates = {(d["metadata"]["namespace"], d["metadata"]["name"]): d for d in kind("ResourceClaimTemplate")}
    quotas = {d["metadata"]["namespace"]: d["spec"]["hard"] for d in kind("ResourceQuota")}
    assert set(quotas) == set(namespaces), "a ResourceQuota per tenant namespace"
    for ns, hard in quotas.items():
        for key in hard:
            m = re.fullmatch(r"(.+)\.deviceclass\.resource\.k8s\.io/devices", key)
            assert m and m.group(1) in td.DEVICE_CLASSES, f"quota key {key}"
        # Quota leaves room for all that Kueue may admit in the namespace's queue.
        (cq,) = [cq for (lns, _), cq in local.items() if lns == ns]
        for cls, res in mapping.items():
            have = td.quantity(hard.get(f"{cls}.deviceclass.resource.k8s.io/devices", "0"))
            assert have >= limit[(cq, res)], f"{ns}: quota for {cls} {have} < Kueue's {limit[(cq, res)]}"
    jobs = kind("Job")
    assert jobs, "no Kueue Job"
    for job in jobs:
        ns = job["metadata"]["namespace"]
        q = job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"]
        assert (ns, q) in local, f"Job {job['metadata']['name']}: no LocalQueue {q} in {ns}"
        pod = job["spec"]["template"]["spec"]
        for rc in pod["resourceClaims"]:
            assert "resourceClaimName" not in rc, "Kueue refuses pods that name a ResourceClaim"
            t = templates[(ns, rc["resourceClaimTemplateName"])]
            for r in t["spec"]["spec"]["devices"]["requests"]:
                ex = r["exactly"]
                assert ex.get("allocationMode", "ExactCount") == "ExactCount" and not ex.get("adminAccess")
                assert ex["deviceClassName"] in mapping, f"Job {job['metadata']['name']}: class not mapped for Kueue"
        for c in pod["containers"]:
            assert {x["name"] for x in c["resources"].get("claims", [])} <= {rc["name"] for rc in pod["resourceClaims"]}
    for dep in kind("Deployment"):
        pod = dep["spec"]["template"]["spec"]
        for rc in pod["resourceClaims"]:
            assert (dep["metadata"]["namespace"], rc["resourceClaimTemplateName"]) in templates


def tenancy_doc_walks_every_example() -> None:
    doc = TENANCY_DOC.read_text()
    named = set(re.findall(r"deployments/examples/tenancy/([\w.-]+\.yaml)", doc))
    files = {p.name for p in TENANCY.glob("*.yaml")}
    assert named == files, f"docs/tenancy.md names {sorted(named - files)} that do not exist, " \
                           f"leaves out {sorted(files - named)}"
    for needle in (f"{PREFIX}allow-", f"{PREFIX}max-share-memory", "deviceclass.resource.k8s.io/devices",
                   "resource.kubernetes.io/admin-access", KUEUE_VERSION):
        assert needle in doc, f"docs/tenancy.md lacks {needle!r}"
