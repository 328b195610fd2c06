//! Process helpers for the sharing tools: run a command with a deadline, and look at or
//! signal a process by PID without mistaking a reused PID for ours.
#![allow(unsafe_code)]

use std::io::{self, Read, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// What a finished command printed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RunOutput {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

/// Why a command did not finish.
#[derive(Debug)]
pub(crate) enum RunFailure {
    /// It could not be started.
    Spawn(io::Error),
    /// It ran past the deadline and was killed.
    Timeout,
    /// Waiting for it failed.
    Wait(io::Error),
}

impl std::fmt::Display for RunFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Spawn(e) => write!(f, "could not start: {e}"),
            Self::Timeout => f.write_str("did not finish in time and was killed"),
            Self::Wait(e) => write!(f, "waiting for it failed: {e}"),
        }
    }
}

/// Polls `done` with a short, growing sleep until it returns `Some` or `timeout` passes.
pub(crate) fn poll_until<T>(timeout: Duration, mut done: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_micros(200);
    loop {
        if let Some(v) = done() {
            return Some(v);
        }
        let now = Instant::now();
        if now >= deadline {
            return None;
        }
        std::thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

fn wait_deadline(child: &mut Child, timeout: Duration) -> Result<ExitStatus, RunFailure> {
    let waited = poll_until(timeout, || match child.try_wait() {
        Ok(Some(status)) => Some(Ok(status)),
        Ok(None) => None,
        Err(e) => Some(Err(e)),
    });
    match waited {
        Some(Ok(status)) => Ok(status),
        Some(Err(e)) => Err(RunFailure::Wait(e)),
        None => {
            let _ = child.kill();
            let _ = child.wait();
            Err(RunFailure::Timeout)
        }
    }
}

/// Runs `cmd` with `input` on stdin and returns what it printed; kills it after `timeout`.
pub(crate) fn run_with_input(
    cmd: &mut Command,
    input: &str,
    timeout: Duration,
) -> Result<RunOutput, RunFailure> {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(RunFailure::Spawn)?;
    if let Some(mut stdin) = child.stdin.take() {
        // A child that exits early closes its stdin; its output tells why.
        let _ = stdin.write_all(input.as_bytes());
    }
    // Read both pipes on their own threads so a chatty child never blocks on a full pipe.
    let out = child.stdout.take().map(|mut s| {
        std::thread::spawn(move || {
            let mut buf = String::new();
            let _ = s.read_to_string(&mut buf);
            buf
        })
    });
    let err = child.stderr.take().map(|mut s| {
        std::thread::spawn(move || {
            let mut buf = String::new();
            let _ = s.read_to_string(&mut buf);
            buf
        })
    });
    let status = wait_deadline(&mut child, timeout)?;
    let join = |h: Option<std::thread::JoinHandle<String>>| {
        h.and_then(|h| h.join().ok()).unwrap_or_default()
    };
    Ok(RunOutput {
        status,
        stdout: join(out),
        stderr: join(err),
    })
}

/// Waits for an already spawned child with a deadline (killing it when it passes).
pub(crate) fn wait_child(child: &mut Child, timeout: Duration) -> Result<ExitStatus, RunFailure> {
    wait_deadline(child, timeout)
}

/// Fields of `/proc/<pid>/stat` after the command name: state and start time (clock ticks
/// since boot, field 22), which together with the PID identify a process across PID reuse.
fn stat(pid: u32) -> Option<(char, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may itself contain spaces or parentheses.
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let state = fields.first()?.chars().next()?;
    // `rest` starts at field 3 (state); field 22 is at index 19.
    let start = fields.get(19)?.parse().ok()?;
    Some((state, start))
}

/// Start time of `pid` (see [`stat`]), `None` when there is no such process.
pub(crate) fn start_time(pid: u32) -> Option<u64> {
    stat(pid).map(|(_, t)| t)
}

/// The command line of `pid`, arguments joined by spaces.
pub(crate) fn cmdline(pid: u32) -> Option<String> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    Some(
        raw.split(|b| *b == 0)
            .filter(|s| !s.is_empty())
            .map(|s| String::from_utf8_lossy(s).into_owned())
            .collect::<Vec<_>>()
            .join(" "),
    )
}

fn pid_t(pid: u32) -> Option<libc::pid_t> {
    libc::pid_t::try_from(pid).ok().filter(|p| *p > 0)
}

/// True if `pid` runs (not a zombie) and, when given, started at `start`.
pub(crate) fn is_alive(pid: u32, start: Option<u64>) -> bool {
    let Some(p) = pid_t(pid) else { return false };
    // SAFETY: kill with signal 0 only checks that the process exists and may be signalled;
    // it has no effect on any process and touches no memory of ours.
    let rc = unsafe { libc::kill(p, 0) };
    if rc != 0 && io::Error::last_os_error().raw_os_error() != Some(libc::EPERM) {
        return false;
    }
    match stat(pid) {
        Some((state, started)) => !matches!(state, 'Z' | 'X') && start.is_none_or(|s| s == started),
        None => false,
    }
}

/// Reaps every exited child without blocking (a container's PID 1 inherits the daemons
/// its children fork, and their zombies would stay otherwise).
pub(crate) fn reap_children() {
    loop {
        let mut status: libc::c_int = 0;
        // SAFETY: waitpid with WNOHANG writes only the status integer we pass and never
        // blocks; -1 selects any child of this process.
        let rc = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if rc <= 0 {
            return;
        }
    }
}

/// Sends `signal` to `pid` if it is still the process that started at `start`.
pub(crate) fn signal(pid: u32, start: Option<u64>, signal: libc::c_int) -> io::Result<()> {
    let Some(p) = pid_t(pid) else {
        return Ok(());
    };
    if !is_alive(pid, start) {
        return Ok(());
    }
    // SAFETY: plain kill(2) on a PID we checked is the process we started (same start time);
    // no memory is shared with the callee.
    let rc = unsafe { libc::kill(p, signal) };
    if rc == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::ESRCH) {
        Ok(())
    } else {
        Err(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_process_is_alive_and_identified_by_start_time() {
        let me = std::process::id();
        let start = start_time(me).unwrap();
        assert!(is_alive(me, Some(start)));
        assert!(!is_alive(me, Some(start + 1)));
        assert!(!is_alive(0, None));
        assert!(cmdline(me).unwrap().contains("cleave_driver"));
    }

    #[test]
    fn run_with_input_captures_output_and_times_out() {
        let out = run_with_input(
            Command::new("sh").args(["-c", "cat; echo err >&2"]),
            "hello\n",
            Duration::from_secs(10),
        )
        .unwrap();
        assert!(out.status.success());
        assert_eq!(out.stdout, "hello\n");
        assert_eq!(out.stderr, "err\n");
        let slow = run_with_input(
            Command::new("sleep").arg("5"),
            "",
            Duration::from_millis(100),
        );
        assert!(matches!(slow, Err(RunFailure::Timeout)), "{slow:?}");
    }

    #[test]
    fn dead_child_is_not_alive_and_signal_is_a_no_op() {
        let mut child = Command::new("sleep").arg("5").spawn().unwrap();
        let pid = child.id();
        let start = start_time(pid).unwrap();
        assert!(is_alive(pid, Some(start)));
        signal(pid, Some(start), libc::SIGKILL).unwrap();
        child.wait().unwrap();
        assert!(!is_alive(pid, Some(start)));
        // Signalling a process that is gone is a no-op, not an error.
        signal(pid, Some(start), libc::SIGTERM).unwrap();
    }
}
