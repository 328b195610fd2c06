#!/usr/bin/env python3
"""Fallback for `cargo deny check licenses bans sources` when cargo-deny is not installed
(installing it from crates.io takes ~10 minutes on a 2-core machine). It enforces the same
policy, deny.toml, from `cargo metadata` (all features, as deny.toml's [graph] says):

- licenses: every third-party package's SPDX expression is satisfied by [licenses] allow
  (a package without a `license` field fails: cargo-deny would read its license file, this
  check cannot); workspace crates are skipped ([licenses.private] ignore = true);
- bans: no dependency of any package is declared with a wildcard version (`*`), except
  path dependencies of unpublished workspace crates ([bans] allow-wildcard-paths); no
  package matches [bans] deny (entries `{ crate = "name" }`, `{ crate = "name@version" }`,
  `{ name = "...", version = "..." }`, where a version is an exact one);
- sources: every package comes from the workspace, a registry in [sources] allow-registry,
  or a git repository in [sources] allow-git.

What it does not check, and says so: security advisories and yanked crates (the RustSec
database and the registry index are on the network, which CI cannot reach), and license
text detection (confidence-threshold). A deny.toml key it does not implement fails the run,
so a policy added there cannot be skipped silently.

Usage: licenses.py [--metadata FILE] [--deny-toml FILE]; FILE holds `cargo metadata
--format-version 1` output (default: runs cargo metadata in the repository). Prints one FAIL
line per violation and `deny-fallback: N packages, M failed`; exits 1 on any failure.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CRATES_IO = "https://github.com/rust-lang/crates.io-index"
# deny.toml keys this check implements (or that change nothing it checks); any other key fails.
KNOWN = {
    "graph": {"all-features"},
    "advisories": {"version", "yanked", "ignore"},
    "licenses": {"version", "allow", "confidence-threshold", "private"},
    "licenses.private": {"ignore"},
    "bans": {"multiple-versions", "wildcards", "allow-wildcard-paths", "deny"},
    "sources": {"unknown-registry", "unknown-git", "allow-registry", "allow-git"},
}


def unsupported_keys(policy: dict) -> list[str]:
    """deny.toml keys outside KNOWN, and settings whose meaning this check does not share."""
    bad = []
    for table, value in policy.items():
        if table not in KNOWN:
            bad.append(f"[{table}]")
            continue
        for key, sub in value.items():
            if key not in KNOWN[table]:
                bad.append(f"[{table}] {key}")
            elif isinstance(sub, dict):
                bad.extend(f"[{table}.{key}] {k}" for k in sub if k not in KNOWN.get(f"{table}.{key}", set()))
    if policy.get("graph", {}).get("all-features") is not True:
        bad.append("[graph] all-features must be true (the fallback reads metadata with --all-features)")
    if policy.get("licenses", {}).get("private", {}).get("ignore") is not True:
        bad.append("[licenses.private] ignore must be true (the fallback skips workspace crates)")
    for key in ("unknown-registry", "unknown-git"):
        if policy.get("sources", {}).get(key, "deny") != "deny":
            bad.append(f"[sources] {key} must be deny")
    if policy.get("bans", {}).get("wildcards", "deny") != "deny":
        bad.append("[bans] wildcards must be deny")
    if policy.get("advisories", {}).get("ignore"):
        bad.append("[advisories] ignore: advisories are not checked here, so ignores cannot be honoured")
    return bad


def satisfied(expr: str, allowed: set[str]) -> bool:
    """An SPDX expression with OR/AND and parentheses is satisfied by the allow list."""
    expr = expr.replace("/", " OR ")
    tokens = re.findall(r"\(|\)|[A-Za-z0-9.+-]+(?: WITH [A-Za-z0-9.+-]+)?", expr)
    pos = 0

    def parse_or() -> bool:
        nonlocal pos
        v = parse_and()
        while pos < len(tokens) and tokens[pos] == "OR":
            pos += 1
            v = parse_and() or v
        return v

    def parse_and() -> bool:
        nonlocal pos
        v = parse_atom()
        while pos < len(tokens) and tokens[pos] == "AND":
            pos += 1
            v = parse_atom() and v
        return v

    def parse_atom() -> bool:
        nonlocal pos
        if pos >= len(tokens):
            return False
        tok = tokens[pos]
        pos += 1
        if tok == "(":
            v = parse_or()
            pos += 1
            return v
        return tok in allowed

    try:
        return bool(tokens) and parse_or() and pos == len(tokens)
    except IndexError:
        return False


def registry_url(source: str) -> str | None:
    """The index URL of a registry source ('registry+URL' or 'sparse+URL'), crates.io's sparse
    index counted as crates.io."""
    for prefix in ("registry+", "sparse+"):
        if source.startswith(prefix):
            url = source[len(prefix):].rstrip("/")
            return CRATES_IO if url == "https://index.crates.io" else url
    return None


def banned(pkg: dict, entries: list) -> bool:
    for e in entries:
        if isinstance(e, str):
            spec = e
        else:
            spec = e.get("crate") or e.get("name") or ""
            if "version" in e:
                spec = f"{spec}@{e['version'].lstrip('=')}"
        name, _, version = spec.partition("@")
        if pkg["name"] == name and (not version or pkg["version"] == version.lstrip("=")):
            return True
    return False


def check(meta: dict, policy: dict) -> tuple[int, list[str]]:
    """(packages checked, violations)."""
    failed = [f"deny.toml: {k}: not implemented by the fallback" for k in unsupported_keys(policy)]
    allowed = set(policy.get("licenses", {}).get("allow", []))
    bans = policy.get("bans", {})
    wildcard_paths = bans.get("allow-wildcard-paths", False)
    sources = policy.get("sources", {})
    registries = {u.rstrip("/") for u in sources.get("allow-registry", [CRATES_IO])}
    gits = {u.rstrip("/") for u in sources.get("allow-git", [])}
    members = set(meta.get("workspace_members", []))
    for pkg in meta["packages"]:
        label = f"{pkg['name']} {pkg['version']}"
        src = pkg.get("source")
        private = src is None and (pkg["id"] in members or pkg.get("publish") == [])
        # sources
        if src is not None:
            reg = registry_url(src)
            if src.startswith("git+"):
                url = src[len("git+"):].split("?")[0].split("#")[0].rstrip("/")
                if url not in gits:
                    failed.append(f"sources: {label}: git source {src} is not in deny.toml's allow-git")
            elif reg is None or reg not in registries:
                failed.append(f"sources: {label}: source {src} is not an allowed registry")
        # licenses
        if not private:
            lic = pkg.get("license")
            if not lic:
                failed.append(f"licenses: {label}: no SPDX license field (cargo-deny would read the "
                              "license file; this fallback cannot)")
            elif not satisfied(lic, allowed):
                failed.append(f"licenses: {label}: license {lic!r} not in deny.toml's allow list")
        # bans
        if banned(pkg, bans.get("deny", [])):
            failed.append(f"bans: {label}: banned by deny.toml [bans] deny")
        for dep in pkg.get("dependencies", []):
            if dep.get("req", "").strip() != "*":
                continue
            if dep.get("path") is not None and wildcard_paths and (private or pkg.get("publish") == []):
                continue
            failed.append(f"bans: {label}: dependency {dep['name']} has a wildcard version (*)")
    return len(meta["packages"]), failed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--metadata", type=Path, help="cargo metadata JSON (default: run cargo metadata)")
    ap.add_argument("--deny-toml", type=Path, default=ROOT / "deny.toml")
    args = ap.parse_args()
    policy = tomllib.loads(args.deny_toml.read_text())
    if args.metadata:
        meta = json.loads(args.metadata.read_text())
    else:
        proc = subprocess.run(["cargo", "metadata", "--format-version", "1", "--locked", "--all-features"],
                              cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"FAIL  cargo metadata failed: {proc.stderr.strip()}")
            return 1
        meta = json.loads(proc.stdout)
    count, failed = check(meta, policy)
    for f in failed:
        print(f"FAIL  {f}")
    print("deny-fallback: checked licenses, bans (wildcards, deny list) and sources; NOT checked: "
          "advisories and yanked crates (need the RustSec database and the registry index from the "
          "network), license text detection (confidence-threshold)")
    print(f"deny-fallback: {count} packages, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
