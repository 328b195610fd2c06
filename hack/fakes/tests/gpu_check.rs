//! `hack/gpu-check.sh` run against the fakes on both sides (no GPU here): its logic runs end
//! to end, the same tools give no difference, and a tool that answers differently is shown.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::{Command, Output};

const SMI: &str = env!("CARGO_BIN_EXE_nvidia-smi");
const MPS: &str = env!("CARGO_BIN_EXE_nvidia-cuda-mps-control");
const GPUS: &str =
    "GPU-11111111-2222-3333-4444-555555555555,GPU-22222222-2222-3333-4444-555555555555";

/// Runs the script with the fakes as the "real" tools (with `knobs` for them only).
fn check(out: &Path, knobs: &[(&str, &str)]) -> Output {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../gpu-check.sh");
    let fakes = Path::new(SMI).parent().unwrap();
    Command::new("bash")
        .arg(script)
        .arg(out)
        .env("NVIDIA_SMI", SMI)
        .env("MPS_CONTROL", MPS)
        .env("FAKES_DIR", fakes)
        .env("FAKE_NVIDIA_SMI_GPUS", GPUS)
        .env("SKIP_NVML", "1")
        .env("CHECK_TIMEOUT", "20")
        .envs(knobs.iter().copied())
        .output()
        .unwrap()
}

/// Every daemon the check started (two per side: plain and multi-user) was quit.
fn no_daemon_left(out: &Path) {
    for record in ["real/fake-mps-record.log", "fake-mps-record.log"] {
        let text = std::fs::read_to_string(out.join(record)).unwrap();
        let pids: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("start pid=")?.split(' ').next())
            .collect();
        assert_eq!(pids.len(), 2, "{record}: {text}");
        for pid in pids {
            assert!(
                text.contains(&format!("exit pid={pid} reason=quit")),
                "{record}: daemon {pid} not quit: {text}"
            );
        }
    }
}

#[test]
fn same_tools_show_no_difference() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let run = check(&out, &[]);
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("the fakes answer like the real tools"),
        "{stdout}"
    );
    // What was recorded: the commands cleave sends, with the real tool's answers.
    let commands = std::fs::read_to_string(out.join("real/mps-commands.txt")).unwrap();
    assert!(commands.starts_with("100.0\n25.0\n"), "{commands}");
    assert!(commands.ends_with("exit status: 0\n"), "{commands}");
    let second = std::fs::read_to_string(out.join("real/mps-second-start.txt")).unwrap();
    assert!(
        second.contains("An instance of this daemon is already running"),
        "{second}"
    );
    assert!(second.ends_with("exit status: 1\n"), "{second}");
    let list = std::fs::read_to_string(out.join("real/smi-list.txt")).unwrap();
    assert!(
        list.starts_with("GPU 0: <NAME> (UUID: GPU-11111111"),
        "{list}"
    );
    assert!(out.join("real/compute-policy-list.txt").is_file());
    no_daemon_left(&out);
}

#[test]
fn a_tool_that_answers_differently_is_shown() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    // The "real" control daemon acknowledges sets and reads limits back in whole GiB.
    let run = check(
        &out,
        &[
            ("FAKE_MPS_SET_ECHO", "1"),
            ("FAKE_MPS_LIMIT_READBACK", "gib-floor"),
        ],
    );
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert_eq!(run.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("differences (fake -> real)"), "{stdout}");
    assert!(
        stdout.contains("+Set default active thread percentage to 25.0"),
        "{stdout}"
    );
    assert!(
        stdout.contains("\n-1536M\n") && stdout.contains("\n+1G\n"),
        "{stdout}"
    );
    assert!(
        std::fs::read_to_string(out.join("diff.txt"))
            .unwrap()
            .lines()
            .count()
            > 5
    );
    no_daemon_left(&out);
}
