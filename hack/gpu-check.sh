#!/usr/bin/env bash
# hack/gpu-check.sh: on a machine with a real NVIDIA GPU, record what the real tools answer to
# the commands cleave sends, run the same commands against the fakes of hack/fakes, and print
# the difference. See docs/hardware-check.md.
#
# It changes no GPU setting: no MIG mode, no compute mode, no time slice. It starts MPS control
# daemons only on private pipe directories under its output directory (in whatever compute mode
# the GPU is in, DEFAULT on an untouched machine), starts no MPS client (so no MPS server), and
# quits every daemon it started, also when interrupted.
#
# Usage: hack/gpu-check.sh [OUT_DIR]
#
# Environment:
#   NVIDIA_SMI, MPS_CONTROL  the real tools (default: nvidia-smi and nvidia-cuda-mps-control
#                            found on PATH)
#   FAKES_DIR                directory with the fake nvidia-smi and nvidia-cuda-mps-control
#                            (default: target/debug of this repository, built with
#                            `cargo build -p cleave-fakes` when missing)
#   PLUGIN                   cleave-kubelet-plugin binary for the NVML discovery check
#                            (default: target/debug/cleave-kubelet-plugin when it exists;
#                            skipped otherwise)
#   USAGE_PROBE              driver example that asks NVML every query usage attribution uses
#                            (compute processes, MPS clients, per-process utilization, memory,
#                            utilization; default: target/debug/examples/usage_probe, built
#                            with `cargo build -p cleave-driver --example usage_probe`;
#                            skipped when missing)
#   CHECK_TIMEOUT            seconds allowed per command (default 30)
#   SKIP_NVML                non-empty: skip the NVML discovery and usage-probe checks
#
# Exit status: 0 when the fakes answered exactly like the real tools (after normalising
# timestamps, PIDs, paths and product names), 1 when they differ (the diff is printed and kept
# in OUT_DIR/diff.txt), 2 when the check itself could not run.

set -euo pipefail

die() {
    echo "gpu-check: $*" >&2
    exit 2
}

for tool in dirname mktemp sed timeout diff stat cp chmod mkdir rm tr grep cat; do
    command -v "$tool" >/dev/null 2>&1 \
        || die "'$tool' is not installed or not on PATH (needed: coreutils, sed, grep, diffutils)"
done

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
timeout_s="${CHECK_TIMEOUT:-30}"

out="${1:-}"
if [[ -z "$out" ]]; then
    out="$(mktemp -d "${TMPDIR:-/tmp}/cleave-gpu-check.XXXXXX")" || die "cannot create a temp dir"
fi
mkdir -p "$out" || die "cannot create $out"
out="$(cd "$out" && pwd)"
# Servers of non-root users must be able to traverse every parent of a pipe directory.
chmod 0755 "$out" 2>/dev/null || true

real_smi="${NVIDIA_SMI:-$(command -v nvidia-smi || true)}"
real_mps="${MPS_CONTROL:-$(command -v nvidia-cuda-mps-control || true)}"
[[ -x "$real_smi" ]] || die "nvidia-smi is not installed or not on PATH (set NVIDIA_SMI)"
[[ -x "$real_mps" ]] || die "nvidia-cuda-mps-control is not installed or not on PATH (set MPS_CONTROL)"

fakes="${FAKES_DIR:-$repo/target/debug}"
if [[ ! -x "$fakes/nvidia-smi" || ! -x "$fakes/nvidia-cuda-mps-control" ]]; then
    if [[ -z "${FAKES_DIR:-}" ]] && command -v cargo >/dev/null; then
        echo "gpu-check: building the fakes (cargo build -p cleave-fakes)" >&2
        (cd "$repo" && cargo build -q -p cleave-fakes) || die "building the fakes failed"
    fi
fi
[[ -x "$fakes/nvidia-smi" && -x "$fakes/nvidia-cuda-mps-control" ]] \
    || die "no fake nvidia-smi / nvidia-cuda-mps-control in $fakes (set FAKES_DIR)"

# Daemons to quit on exit: pipe directories and the tool serving each.
started_pipes=()
started_tools=()
# shellcheck disable=SC2329 # run by the EXIT trap
cleanup() {
    local i
    for i in "${!started_pipes[@]}"; do
        if [[ -e "${started_pipes[$i]}/nvidia-cuda-mps-control.pid" ]]; then
            echo quit | CUDA_MPS_PIPE_DIRECTORY="${started_pipes[$i]}" \
                timeout "$timeout_s" "${started_tools[$i]}" >/dev/null 2>&1 || true
        fi
    done
}
trap cleanup EXIT
trap 'exit 2' INT TERM

# The GPUs, from the real tool: index, UUID (and MIG mode when the query works).
mapfile -t gpu_uuids < <(timeout "$timeout_s" "$real_smi" -L 2>/dev/null \
    | sed -n 's/^GPU [0-9]*: .*(UUID: \(GPU-[^)]*\)).*$/\1/p')
[[ ${#gpu_uuids[@]} -gt 0 ]] || die "$real_smi -L lists no GPU"
fake_gpus=""
for uuid in "${gpu_uuids[@]}"; do
    mig="$(timeout "$timeout_s" "$real_smi" -i "$uuid" --query-gpu=mig.mode.current \
        --format=csv,noheader 2>/dev/null | tr -d ' ' || true)"
    entry="$uuid"
    [[ "$mig" == "Enabled" ]] && entry="$entry:mig"
    fake_gpus="${fake_gpus:+$fake_gpus,}$entry"
done
first_gpu="${gpu_uuids[0]}"

# step SIDE NAME CMD...: runs CMD with stdin from $STDIN (if set), records output and status.
step() {
    local side="$1" name="$2"
    shift 2
    local file="$out/$side/$name.txt" status=0
    {
        # A failing command is what is being recorded, not a failure of the check.
        if [[ -n "${STDIN:-}" ]]; then
            printf '%s' "$STDIN" | timeout "$timeout_s" "$@" 2>&1 || status=$?
        else
            timeout "$timeout_s" "$@" </dev/null 2>&1 || status=$?
        fi
        echo "exit status: $status"
    } >"$file"
}

# The commands cleave sends (and a few rejected ones), on one side.
record() {
    local side="$1" smi="$2" mps="$3"
    local dir="$out/$side"
    rm -rf "$dir"
    mkdir -p "$dir/pipe" "$dir/log" "$dir/pipe-m" "$dir/log-m"
    chmod 0755 "$dir"
    chmod 0777 "$dir/pipe" "$dir/pipe-m"
    chmod 1777 "$dir/log" "$dir/log-m"

    step "$side" smi-list "$smi" -L
    step "$side" compute-policy-help "$smi" compute-policy -h
    step "$side" compute-policy-list "$smi" compute-policy -l

    export CUDA_MPS_PIPE_DIRECTORY="$dir/pipe" CUDA_MPS_LOG_DIRECTORY="$dir/log"
    step "$side" mps-help "$mps" -h
    STDIN=$'get_default_active_thread_percentage\n' step "$side" mps-no-daemon "$mps"
    started_pipes+=("$dir/pipe")
    started_tools+=("$mps")
    CUDA_VISIBLE_DEVICES="$first_gpu" step "$side" mps-start "$mps" -d
    (cd "$dir/pipe" && for f in *; do printf '%s %s\n' "$(stat -c %F "$f")" "$f"; done) \
        >"$dir/mps-pipe-dir.txt" 2>&1 || true
    CUDA_VISIBLE_DEVICES="$first_gpu" step "$side" mps-second-start "$mps" -d
    STDIN="get_default_active_thread_percentage
set_default_active_thread_percentage 25
get_default_active_thread_percentage
set_default_active_thread_percentage 0
set_default_active_thread_percentage 100.5
get_default_active_thread_percentage
set_default_device_pinned_mem_limit 0 1536M
get_default_device_pinned_mem_limit 0
set_default_device_pinned_mem_limit 0 2G
get_default_device_pinned_mem_limit 0
set_default_device_pinned_mem_limit 0 5GB
get_default_device_pinned_mem_limit 0
get_default_device_pinned_mem_limit 1
get_default_device_pinned_mem_limit $first_gpu
get_server_list
no_such_command
" step "$side" mps-commands "$mps"
    STDIN=$'quit\n' step "$side" mps-quit "$mps"
    [[ -e "$dir/pipe/nvidia-cuda-mps-control.pid" ]] && echo "pid file left after quit" \
        >>"$dir/mps-quit.txt"
    STDIN=$'get_default_active_thread_percentage\n' step "$side" mps-after-quit "$mps"
    cp "$dir/log/control.log" "$dir/mps-control-log.txt" 2>/dev/null \
        || echo "no control.log" >"$dir/mps-control-log.txt"

    # Multi-user mode: accepted or refused by this release?
    export CUDA_MPS_PIPE_DIRECTORY="$dir/pipe-m" CUDA_MPS_LOG_DIRECTORY="$dir/log-m"
    started_pipes+=("$dir/pipe-m")
    started_tools+=("$mps")
    CUDA_VISIBLE_DEVICES="$first_gpu" step "$side" mps-multiuser-start "$mps" -d -M
    STDIN=$'get_server_list\nquit\n' step "$side" mps-multiuser-quit "$mps"
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY

    # What differs by nature between the two sides: timestamps, PIDs, paths, names.
    local f
    for f in "$dir"/*.txt; do
        sed -i -E \
            -e "s#$dir#<DIR>#g" \
            -e 's#^\[[0-9]{4}-[0-9]{2}-[0-9]{2} [0-9:.]+ #[<TIME> #' \
            -e 's#^(\[<TIME> [A-Za-z]+( [A-Za-z]+)*) +[0-9]+\]#\1 <PID>]#' \
            -e 's#^(GPU [0-9]+: ).* \(UUID:#\1<NAME> (UUID:#' \
            "$f"
    done
    rm -rf "$dir/pipe" "$dir/log" "$dir/pipe-m" "$dir/log-m"
}

echo "gpu-check: recording the real tools ($real_smi, $real_mps) into $out/real" >&2
record real "$real_smi" "$real_mps"
echo "gpu-check: recording the fakes ($fakes) into $out/fake" >&2
# The fakes get a clean set of knobs: only the GPU list read from the real tool.
(
    while read -r name; do
        [[ "$name" == FAKE_* ]] && unset "$name"
    done < <(compgen -e)
    export FAKE_NVIDIA_SMI_GPUS="$fake_gpus" FAKE_MPS_RECORD="$out/fake-mps-record.log" \
        FAKE_MPS_IDLE_EXIT_SECS=120
    record fake "$fakes/nvidia-smi" "$fakes/nvidia-cuda-mps-control"
)
# A fake daemon left by a failed step is quit on exit too.
started_pipes+=("$out/fake/pipe" "$out/fake/pipe-m")
started_tools+=("$fakes/nvidia-cuda-mps-control" "$fakes/nvidia-cuda-mps-control")

# NVML discovery (what cleave publishes) against nvidia-smi, on the real machine only.
plugin="${PLUGIN:-$repo/target/debug/cleave-kubelet-plugin}"
nvml_status=0
if [[ -x "$plugin" && -z "${SKIP_NVML:-}" ]]; then
    mkdir -p "$out/nvml"
    timeout "$timeout_s" "$real_smi" -q >"$out/nvml/nvidia-smi-q.txt" 2>&1 || true
    timeout "$timeout_s" "$plugin" inspect >"$out/nvml/inspect.txt" 2>&1 || nvml_status=1
    timeout "$timeout_s" "$plugin" inspect --yaml >"$out/nvml/inspect.yaml" 2>&1 || nvml_status=1
    timeout "$timeout_s" "$real_smi" \
        --query-gpu=uuid,name,compute_cap,pci.bus_id,memory.total \
        --format=csv,noheader,nounits >"$out/nvml/query.csv" 2>&1 || nvml_status=1
    : >"$out/nvml/compare.txt"
    while IFS=',' read -r uuid name cc bus mem; do
        uuid="${uuid// /}"; cc="${cc// /}"; bus="${bus// /}"; mem="${mem// /}"
        name="$(echo "$name" | sed 's/^ *//; s/ *$//')"
        mem_q="${mem}Mi"
        # cleave prints whole GiB as Gi.
        [[ "$mem" =~ ^[0-9]+$ ]] && (( mem % 1024 == 0 )) && mem_q="$((mem / 1024))Gi"
        for want in "$uuid" "$name" "$cc" "${bus#0000}" "$mem_q"; do
            if grep -qiF -- "$want" "$out/nvml/inspect.yaml"; then
                echo "ok       $uuid: $want" >>"$out/nvml/compare.txt"
            else
                echo "MISSING  $uuid: $want (nvidia-smi says so; cleave's inspect does not)" \
                    >>"$out/nvml/compare.txt"
                nvml_status=1
            fi
        done
    done <"$out/nvml/query.csv"
    echo "gpu-check: NVML discovery against nvidia-smi:" >&2
    cat "$out/nvml/compare.txt" >&2
else
    echo "gpu-check: NVML discovery skipped (no cleave-kubelet-plugin at $plugin; set PLUGIN)" >&2
fi

# The NVML queries usage attribution makes, on the real machine only (read-only).
probe="${USAGE_PROBE:-$repo/target/debug/examples/usage_probe}"
if [[ -x "$probe" && -z "${SKIP_NVML:-}" ]]; then
    mkdir -p "$out/nvml"
    timeout "$timeout_s" "$probe" >"$out/nvml/usage-probe.txt" 2>&1 || nvml_status=1
    echo "gpu-check: NVML usage queries:" >&2
    cat "$out/nvml/usage-probe.txt" >&2
else
    echo "gpu-check: NVML usage queries skipped (no usage_probe at $probe; set USAGE_PROBE)" >&2
fi

status=0
diff -ru -x fake-mps-record.log "$out/fake" "$out/real" >"$out/diff.txt" || status=$?
if [[ $status -eq 0 && $nvml_status -eq 0 ]]; then
    echo "gpu-check: the fakes answer like the real tools (outputs in $out)"
    exit 0
fi
if [[ $status -gt 1 ]]; then
    die "diff failed"
fi
echo "gpu-check: differences (fake -> real), kept in $out/diff.txt:"
cat "$out/diff.txt"
exit 1
