"""Checks of the chart's claim-shape admission policy (templates/sharing-shapes-policy.yaml):
rendered only with consumableCapacity mps, valid on 1.34, and evaluated with cel-python as the
API server would on claims and templates: the shapes prepare cannot serve on an MPS-sharing
node are denied with a message naming the fix; the shapes it serves pass, other drivers'
classes untouched. The composition matrix (driver/tests/composition.rs) evaluates the rendered
policies (fixture driver/tests/fixtures/chart-claim-policies.yaml) on its own claim shapes.

`register(module)` adds the checks to test_deployments' runner; the CEL evaluation is
test_tenancy's (the same Kubernetes functions, variables in order, failurePolicy Fail).
"""

from __future__ import annotations

from typing import Any

td: Any = None
tt: Any = None


def register(module: Any, tenancy: Any) -> None:
    global td, tt
    td, tt = module, tenancy
    for fn in (sharing_shapes_policy_renders_only_with_mps_sharing,
               sharing_shapes_policy_denies_what_prepare_cannot_serve):
        module.CHECKS.append(fn)


def shape_policies(values: dict) -> dict[str, dict]:
    out = {}
    for o in td.render(values):
        if o["kind"] == "ValidatingAdmissionPolicy" and "-sharing-shapes-" in o["metadata"]["name"]:
            (rule,) = o["spec"]["matchConstraints"]["resourceRules"]
            (res,) = rule["resources"]
            out[res] = o
    return out


def sharing_shapes_policy_renders_only_with_mps_sharing() -> None:
    assert not shape_policies({}), "rendered with consumableCapacity off"
    assert not shape_policies({"consumableCapacity": "time-slicing"}), "rendered with time-slicing"
    assert not shape_policies({"consumableCapacity": "mps", "sharingShapes": {"enabled": False}})
    pols = shape_policies({"consumableCapacity": "mps"})
    assert set(pols) == {"resourceclaims", "resourceclaimtemplates"}, set(pols)
    objs = [o for o in td.render({"consumableCapacity": "mps"})
            if "-sharing-shapes-" in o["metadata"]["name"]]
    assert {o["kind"] for o in objs} == {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    for o in objs:
        td.validate_k8s(o, o["metadata"]["name"])
    for p in pols.values():
        for v in p["spec"]["variables"] + p["spec"]["validations"]:
            for key in ("expression", "messageExpression"):
                if key in v:
                    tt.cel(v[key])  # compiles


def sharing_shapes_policy_denies_what_prepare_cannot_serve() -> None:
    pols = shape_policies({"consumableCapacity": "mps"})
    cap = {"capacity": {"requests": {"memory": "10Gi", "multiprocessors": "33"}}}
    uuid = {"matchAttribute": "gpu.cleave.dev/uuid"}

    def verdict(c: dict) -> tuple[bool, list[str]]:
        on_claim = tt.admit(pols["resourceclaims"], c, {})
        on_template = tt.admit(pols["resourceclaimtemplates"], tt.template_of(c), {})
        assert on_claim is not None and on_template is not None
        assert on_claim[0] == on_template[0], (on_claim, on_template)
        assert not [m for m in on_claim[1] if m.startswith("error:")], on_claim
        return on_claim

    def with_constraints(c: dict, *cs: dict) -> dict:
        c["spec"]["devices"]["constraints"] = list(cs)
        return c

    allowed = {
        "one share": tt.claim(tt.req("shared.gpu.cleave.dev", **cap)),
        "count 2, no capacity (whole devices)": tt.claim(tt.req("gpu.cleave.dev", count=2)),
        "All, no capacity": tt.claim(tt.req("gpu.cleave.dev", allocationMode="All")),
        "two shares held on one GPU": with_constraints(
            tt.claim(tt.req("shared.gpu.cleave.dev", "a", **cap), tt.req("shared.gpu.cleave.dev", "b", **cap)),
            {**uuid, "requests": ["a", "b"]}),
        "count 2 held on one GPU (constraint over all requests)": with_constraints(
            tt.claim(tt.req("shared.gpu.cleave.dev", count=2, **cap)), uuid),
        "the MPS class alone": tt.claim(tt.req("mps.gpu.cleave.dev")),
        "the MPS class asking capacity (a share with tighter limits)": tt.claim(tt.req("mps.gpu.cleave.dev", **cap)),
        "another driver's class": tt.claim(tt.req("other.example.com", "a", count=2, **cap)),
        "admin access with capacity": tt.claim(
            tt.req("shared.gpu.cleave.dev", "a", adminAccess=True, **cap),
            tt.req("shared.gpu.cleave.dev", "b", **cap)),
    }
    denied = {
        "two shares, unconstrained": (
            tt.claim(tt.req("shared.gpu.cleave.dev", "a", **cap), tt.req("gpu.cleave.dev", "b", **cap)),
            "matchAttribute: gpu.cleave.dev/uuid"),
        "count 2 asking capacity": (tt.claim(tt.req("shared.gpu.cleave.dev", count=2, **cap)), "one claim per share"),
        "All asking capacity": (tt.claim(tt.req("shared.gpu.cleave.dev", allocationMode="All", **cap)), "a", ),
        "a constraint on another attribute": (with_constraints(
            tt.claim(tt.req("shared.gpu.cleave.dev", "a", **cap), tt.req("shared.gpu.cleave.dev", "b", **cap)),
            {"matchAttribute": "gpu.cleave.dev/productName"}), "uuid"),
        "a constraint that leaves a request out": (with_constraints(
            tt.claim(tt.req("shared.gpu.cleave.dev", "a", **cap), tt.req("shared.gpu.cleave.dev", "b", **cap),
                     tt.req("shared.gpu.cleave.dev", "c", **cap)),
            {**uuid, "requests": ["a", "b"]}), "a, b, c"),
        "the MPS class beside a share": (
            tt.claim(tt.req("mps.gpu.cleave.dev", "own"), tt.req("shared.gpu.cleave.dev", "part", **cap)),
            "separate claims"),
    }
    for what, c in allowed.items():
        ok, msgs = verdict(c)
        assert ok, f"{what}: denied: {msgs}"
    for what, (c, needle) in denied.items():
        ok, msgs = verdict(c)
        assert not ok, f"{what}: allowed"
        assert any(needle in m for m in msgs), f"{what}: {msgs} lacks {needle!r}"
