#!/usr/bin/env bash
# The shipped crates and binaries carry no mock, fixture or stand-in code:
#  (a) no test-rig crate is a normal (non-dev, non-build) dependency of a product crate;
#  (b) no product library compiles a mock or fixtures module unconditionally;
#  (c) the plugin and CDI hook binaries, built without extra features, hold none of the
#      test rig's marker names in their symbols or strings.
# Report-only by default (prints what it finds, exits 0); CLEAVE_PRODUCT_CLEAN_STRICT=1
# makes any finding fail. CLEAVE_PRODUCT_CLEAN_PROFILE=release checks the release build
# (default: the debug build, which .ci/run has just made).
set -euo pipefail
cd "$(dirname "$0")/.."

strict="${CLEAVE_PRODUCT_CLEAN_STRICT:-0}"
profile="${CLEAVE_PRODUCT_CLEAN_PROFILE:-debug}"

product_crates=(cleave-kubelet-plugin cleave-cdi-hook cleave-driver cleave-controller cleave-api)
rig_crates=(cleave-mock-nvml cleave-fakes cleave-apiserver-standin cleave-demo cleave-packing cleave-testkit)
# Names only the test rig uses: the mock NVML library and its environment, the plugin's
# mock-library finder, the controller's synthetic pools, the rig crates' symbol paths.
markers=(
  'MOCK_NVML_'
  'libmock_nvml'
  'kubelet_plugin::mock::'
  'controller::fixtures::'
  'cleave_mock_nvml::'
  'mock_nvml::'
  'cleave_fakes::'
  'cleave_apiserver_standin::'
  'cleave_demo::'
  'cleave_packing::'
  'cleave_testkit::'
)

findings=0
found() {
  printf 'FOUND: %s\n' "$*"
  findings=$((findings + 1))
}

echo "-- (a) normal dependencies of the product crates"
for crate in "${product_crates[@]}"; do
  deps="$(cargo tree --locked -e normal -p "$crate" --prefix none --format '{p}' | awk '{print $1}' | sort -u)"
  for rig in "${rig_crates[@]}"; do
    if grep -qx -- "$rig" <<<"$deps"; then
      found "$crate depends on $rig: $(cargo tree --locked -e normal -p "$crate" -i "$rig" --prefix none --format '{p}' | awk '{print $1}' | sort -u | tr '\n' ' ')"
    fi
  done
done

echo "-- (b) test-rig modules compiled into the product libraries (no #[cfg(...)] above them)"
while IFS= read -r f; do
  while IFS= read -r line; do
    found "$f: $line"
  done < <(awk '/^[[:space:]]*#\[cfg\(/ {cfg = 1; next}
    /^[[:space:]]*(pub(\([a-z]+\))? )?mod (mock|mocks|fixtures|fakes|testing|standin|stand_in)[[:space:]]*;/ { if (!cfg) print }
    {cfg = 0}' "$f")
done < <(git ls-files 'api/src/*.rs' 'driver/src/*.rs' 'controller/src/*.rs' 'kubelet-plugin/src/*.rs' 'cdi-hook/src/*.rs')

echo "-- (c) marker names in the shipped binaries ($profile build, default features)"
build_args=(--locked -p cleave-kubelet-plugin --bins)
[[ "$profile" == release ]] && build_args+=(--release)
cargo build "${build_args[@]}"
target_dir="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')"
have_nm=1
command -v nm >/dev/null 2>&1 || { have_nm=0; echo "no nm: checking strings only"; }
for bin in cleave-kubelet-plugin cleave-cdi-hook; do
  path="$target_dir/$profile/$bin"
  [[ -f "$path" ]] || { found "$path was not built"; continue; }
  {
    ((have_nm)) && nm -C "$path" 2>/dev/null
    # `strings` is binutils too; grep -a reads the bytes where it is missing.
    if command -v strings >/dev/null 2>&1; then strings -n 6 "$path"; else grep -ao '[[:print:]]\{6,\}' "$path"; fi
  } >"$target_dir/product-clean-$bin.txt" || true
  for m in "${markers[@]}"; do
    n="$(grep -cF -- "$m" "$target_dir/product-clean-$bin.txt" || true)"
    if ((n > 0)); then
      pattern="$(printf '%s' "$m" | sed 's/[].[*^$()+?{|\\]/\\&/g')"
      found "$bin: $n lines with '$m', e.g.: $(grep -oaE -- ".{0,30}$pattern.{0,50}" "$target_dir/product-clean-$bin.txt" | head -n 3 | tr '\n' '|')"
    fi
  done
done

if ((findings == 0)); then
  echo "product clean: no test-rig crate among the product's dependencies, no rig module, no marker in its binaries"
  exit 0
fi
echo "product clean: $findings finding(s) above"
if [[ "$strict" == 1 ]]; then
  exit 1
fi
echo "(report only; CLEAVE_PRODUCT_CLEAN_STRICT=1 makes this fail)"
