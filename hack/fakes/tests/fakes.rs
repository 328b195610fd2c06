//! The fake tools as built binaries: the MPS control protocol (daemon start, commands,
//! quit, refusal of a second daemon, failure knobs) and nvidia-smi's records and state.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const MPS: &str = env!("CARGO_BIN_EXE_nvidia-cuda-mps-control");
const SMI: &str = env!("CARGO_BIN_EXE_nvidia-smi");

fn control(pipe: &Path, input: &str) -> Output {
    let mut child = Command::new(MPS)
        .env("CUDA_MPS_PIPE_DIRECTORY", pipe)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

fn wait_for(mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let rest = &s[s.rfind(')')? + 1..];
            rest.split_whitespace().next().map(|st| st != "Z")
        })
        .unwrap_or(false)
}

/// Kills a daemon a failed assertion would otherwise leave running.
struct Reap(Option<u32>);

impl Drop for Reap {
    fn drop(&mut self) {
        if let Some(pid) = self.0.filter(|p| alive(*p)) {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        }
    }
}

#[test]
fn mps_daemon_serves_commands_until_quit() {
    let tmp = tempfile::tempdir().unwrap();
    let pipe = tmp.path().join("pipe");
    std::fs::create_dir(&pipe).unwrap();
    let record = tmp.path().join("record.log");

    // No daemon yet: the client says so, like the real tool.
    let out = control(&pipe, "get_default_active_thread_percentage\n");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("Cannot find MPS control daemon"));

    let status = Command::new(MPS)
        .arg("-d")
        .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
        .env("CUDA_VISIBLE_DEVICES", "GPU-a,MIG-b")
        .env("FAKE_MPS_RECORD", &record)
        .env("FAKE_MPS_IDLE_EXIT_SECS", "60")
        .status()
        .unwrap();
    assert!(status.success());
    let pid_file = pipe.join("nvidia-cuda-mps-control.pid");
    assert!(wait_for(|| pid_file.exists()));
    let pid: u32 = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let _reap = Reap(Some(pid));
    assert!(alive(pid));

    let out = control(
        &pipe,
        "get_default_active_thread_percentage\n\
         set_default_active_thread_percentage 30\n\
         set_default_device_pinned_mem_limit 1 512M\n\
         set_default_device_pinned_mem_limit 2 1G\n\
         set_default_device_pinned_mem_limit 0 5GB\n\
         get_default_device_pinned_mem_limit MIG-b\n\
         get_default_active_thread_percentage\n",
    );
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "100.0\nInvalid device 2\nInvalid memory limit 5GB\n512M\n30.0\n"
    );

    // A second daemon on the same pipe directory is refused.
    let second = Command::new(MPS)
        .arg("-d")
        .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
        .output()
        .unwrap();
    assert!(!second.status.success());
    assert!(String::from_utf8_lossy(&second.stderr).contains("already running"));

    let out = control(&pipe, "quit\n");
    assert!(out.status.success());
    assert!(wait_for(|| !alive(pid)), "daemon exits on quit");
    assert!(!pid_file.exists() && !pipe.join("control").exists());

    let lines = std::fs::read_to_string(&record).unwrap();
    assert!(lines.starts_with(&format!(
        "start pid={pid} pipe={} devices=GPU-a,MIG-b\n",
        pipe.display()
    )));
    assert!(lines.contains("set_default_active_thread_percentage 30\n"));
    assert!(lines.ends_with(&format!("exit pid={pid} reason=quit\n")));
}

#[test]
fn mps_knobs_fail_start_and_idle_exit() {
    let tmp = tempfile::tempdir().unwrap();
    let pipe = tmp.path().join("pipe");
    std::fs::create_dir(&pipe).unwrap();
    let out = Command::new(MPS)
        .arg("-d")
        .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
        .env("FAKE_MPS_FAIL_START", "1")
        .output()
        .unwrap();
    assert!(!out.status.success());

    // A daemon nobody talks to exits by itself.
    let record = tmp.path().join("record.log");
    let status = Command::new(MPS)
        .arg("-d")
        .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
        .env("FAKE_MPS_RECORD", &record)
        .env("FAKE_MPS_IDLE_EXIT_SECS", "1")
        .status()
        .unwrap();
    assert!(status.success());
    let pid_file = pipe.join("nvidia-cuda-mps-control.pid");
    assert!(wait_for(|| pid_file.exists()));
    let pid: u32 = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let _reap = Reap(Some(pid));
    assert!(wait_for(|| !alive(pid)), "idle daemon exits");
    assert!(
        std::fs::read_to_string(&record)
            .unwrap()
            .contains("reason=idle")
    );
}

#[test]
fn nvidia_smi_records_keeps_state_and_fails_on_request() {
    let tmp = tempfile::tempdir().unwrap();
    let record = tmp.path().join("smi.log");
    let state = tmp.path().join("smi.state");
    let smi = |args: &[&str], fail: Option<&str>| {
        let mut cmd = Command::new(SMI);
        cmd.args(args)
            .env("FAKE_NVIDIA_SMI_RECORD", &record)
            .env("FAKE_NVIDIA_SMI_STATE", &state)
            .env("FAKE_NVIDIA_SMI_GPUS", "GPU-a,GPU-b");
        if let Some(f) = fail {
            cmd.env("FAKE_NVIDIA_SMI_FAIL", f);
        }
        cmd.output().unwrap()
    };
    assert!(
        smi(&["-i", "GPU-a", "-c", "EXCLUSIVE_PROCESS"], None)
            .status
            .success()
    );
    assert!(
        smi(
            &["compute-policy", "-i", "GPU-a", "--set-timeslice=2"],
            None
        )
        .status
        .success()
    );
    assert!(
        !smi(
            &["compute-policy", "-i", "MIG-x", "--set-timeslice=2"],
            None
        )
        .status
        .success()
    );
    assert!(
        !smi(
            &["compute-policy", "-i", "GPU-a", "--set-timeslice=7"],
            None
        )
        .status
        .success()
    );
    let failed = smi(&["-i", "GPU-b", "-c", "DEFAULT"], Some("GPU-b"));
    assert!(!failed.status.success());
    assert!(String::from_utf8_lossy(&failed.stderr).contains("Unknown Error"));
    let list = smi(&["-L"], None);
    assert_eq!(
        String::from_utf8_lossy(&list.stdout),
        "GPU 0: Fake GPU (UUID: GPU-a)\nGPU 1: Fake GPU (UUID: GPU-b)\n"
    );

    let settings = cleave_fakes::nvidia_smi::read_state(&state);
    let get = |id: &str, key: &str| settings.get(&(id.to_owned(), key.to_owned())).cloned();
    assert_eq!(
        get("GPU-a", "computeMode").as_deref(),
        Some("EXCLUSIVE_PROCESS")
    );
    assert_eq!(get("GPU-a", "timeslice").as_deref(), Some("2"));
    assert_eq!(get("GPU-b", "computeMode"), None);
    let lines = std::fs::read_to_string(&record).unwrap();
    assert_eq!(lines.lines().count(), 6);
    assert!(lines.starts_with("-i GPU-a -c EXCLUSIVE_PROCESS\n"));
}
