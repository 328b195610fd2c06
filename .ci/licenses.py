#!/usr/bin/env python3
"""Fallback license and source check when cargo-deny is not installed (installing it from
crates.io takes ~10 minutes on a 2-core machine). Reads `cargo metadata --locked` and checks
every third-party package's SPDX license expression against deny.toml's allow list, and that
every package comes from crates.io or the workspace. Prints `licenses: N passed, M failed`."""
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

root = Path(__file__).resolve().parent.parent
policy = tomllib.loads((root / "deny.toml").read_text())
allowed = set(policy["licenses"]["allow"])
meta = json.loads(subprocess.run(
    ["cargo", "metadata", "--format-version", "1", "--locked", "--all-features"],
    cwd=root, check=True, capture_output=True, text=True).stdout)

def satisfied(expr: str) -> bool:
    """An SPDX expression with OR/AND and parentheses is satisfied by the allow list."""
    expr = expr.replace("/", " OR ")
    tokens = re.findall(r"\(|\)|[A-Za-z0-9.+-]+(?: WITH [A-Za-z0-9.+-]+)?", expr)
    pos = 0
    def parse_or():
        nonlocal pos
        v = parse_and()
        while pos < len(tokens) and tokens[pos] == "OR":
            pos += 1
            v = parse_and() or v
        return v
    def parse_and():
        nonlocal pos
        v = parse_atom()
        while pos < len(tokens) and tokens[pos] == "AND":
            pos += 1
            v = parse_atom() and v
        return v
    def parse_atom():
        nonlocal pos
        tok = tokens[pos]; pos += 1
        if tok == "(":
            v = parse_or(); pos += 1
            return v
        return tok in allowed
    return bool(tokens) and parse_or()

passed, failed = 0, []
for pkg in meta["packages"]:
    src = pkg.get("source")
    if src is None:  # workspace crate
        continue
    if not src.startswith("registry+https://github.com/rust-lang/crates.io-index"):
        failed.append(f"{pkg['name']} {pkg['version']}: source {src} is not crates.io")
        continue
    lic = pkg.get("license")
    if not lic or not satisfied(lic):
        failed.append(f"{pkg['name']} {pkg['version']}: license {lic!r} not in deny.toml's allow list")
    else:
        passed += 1
for f in failed:
    print(f"FAIL  {f}")
print(f"licenses: {passed} passed, {len(failed)} failed")
sys.exit(1 if failed else 0)
