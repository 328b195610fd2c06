//! Asks NVML, once per GPU, every query the usage sampler uses to attribute memory and
//! activity to claims (device memory, utilization, compute processes, MPS clients,
//! per-process utilization) and prints one line per query: `ok` with what it answered,
//! `unsupported`, or `error`. `hack/gpu-check.sh` runs it on real hardware; it changes
//! nothing. Usage: `usage_probe [LIBNVML]` (default: the system's library).

use std::process::ExitCode;

use cleave_driver::backend::GpuBackend as _;
use cleave_driver::nvml::NvmlBackend;

fn main() -> ExitCode {
    let lib = std::env::args_os().nth(1).map(std::path::PathBuf::from);
    let backend = match NvmlBackend::open(lib.as_deref()) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("usage_probe: cannot open NVML: {e}");
            return ExitCode::from(2);
        }
    };
    let gpus = match backend.inventory() {
        Ok(inv) => inv.gpus,
        Err(e) => {
            eprintln!("usage_probe: inventory: {e}");
            return ExitCode::from(2);
        }
    };
    let Some(source) = backend.usage_source() else {
        eprintln!("usage_probe: this backend has no usage source");
        return ExitCode::from(2);
    };
    let mut failed = false;
    let mut report = |call: &str, uuid: &str, answer: Result<String, String>| match answer {
        Ok(text) => println!("ok          {call} {uuid}: {text}"),
        Err(e) => {
            failed = true;
            println!("error       {call} {uuid}: {e}");
        }
    };
    for gpu in &gpus {
        let uuid = gpu.uuid.as_str();
        report(
            "nvmlDeviceGetMemoryInfo_v2",
            uuid,
            source
                .memory(uuid)
                .map(|m| format!("used {} total {}", m.used, m.total))
                .map_err(|e| e.to_string()),
        );
        report(
            "nvmlDeviceGetUtilizationRates",
            uuid,
            source
                .gpu_utilization(uuid)
                .map(|u| u.map_or("unsupported".into(), |u| format!("gpu {u}%")))
                .map_err(|e| e.to_string()),
        );
        for (call, list) in [
            (
                "nvmlDeviceGetComputeRunningProcesses_v3",
                source.processes(uuid),
            ),
            (
                "nvmlDeviceGetMPSComputeRunningProcesses_v3",
                source.mps_processes(uuid),
            ),
        ] {
            report(
                call,
                uuid,
                list.map(|l| {
                    let pids: Vec<String> = l
                        .iter()
                        .map(|p| format!("{}:{}", p.pid, p.used.unwrap_or(0)))
                        .collect();
                    format!("{} process(es) [{}]", l.len(), pids.join(" "))
                })
                .map_err(|e| e.to_string()),
            );
        }
        report(
            "nvmlDeviceGetProcessUtilization",
            uuid,
            source
                .process_utilization(uuid, 0)
                .map(|l| {
                    l.map_or("unsupported".into(), |l| {
                        let pids: Vec<String> = l
                            .iter()
                            .map(|p| format!("{}:{}%", p.pid, p.sm_percent))
                            .collect();
                        format!("{} sample(s) [{}]", l.len(), pids.join(" "))
                    })
                })
                .map_err(|e| e.to_string()),
        );
    }
    if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}
