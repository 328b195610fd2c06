//! Checks on processes a test started (fake MPS daemons above all), so none outlives it.

use std::path::Path;
use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

/// Running and not a zombie.
pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let rest = &s[s.rfind(')')? + 1..];
            rest.split_whitespace()
                .next()
                .map(|st| st != "Z" && st != "X")
        })
        .unwrap_or(false)
}

/// Waits up to `timeout` for `pid` to be gone; true when it is.
pub fn wait_dead(pid: u32, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if !alive(pid) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    !alive(pid)
}

/// Sends SIGKILL to `pid` when it still runs (errors ignored: it may be gone by then).
pub fn kill(pid: u32) {
    if alive(pid) {
        let _ = std::process::Command::new("kill")
            .args(["-9", &pid.to_string()])
            .status();
    }
}

/// PIDs of every daemon the fake `nvidia-cuda-mps-control` recorded starting in `record`.
pub fn started_pids(record: &Path) -> Vec<u32> {
    std::fs::read_to_string(record)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            l.strip_prefix("start pid=")?
                .split(' ')
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

/// Waits for `child` to exit and returns its status; past `timeout` kills it and panics
/// naming `what`, so a hung child cannot hang the test.
pub fn wait_or_kill(child: &mut Child, timeout: Duration, what: &str) -> ExitStatus {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} timed out after {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}
