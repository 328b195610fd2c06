//! Fake `nvidia-cuda-mps-control`.
//!
//! - `-d`: starts a control daemon for `CUDA_MPS_PIPE_DIRECTORY` (default `/tmp/nvidia-mps`)
//!   and returns at once, like the real tool. Without `fork`: it re-runs its own executable
//!   with the hidden argument `--daemon-loop` in a new process group with null stdio, so the
//!   daemon outlives its caller. The daemon writes `nvidia-cuda-mps-control.pid` into the pipe
//!   directory (as the real daemon does) and serves a unix socket `control` there.
//! - no argument: reads commands from stdin, one per line, sends each to the daemon of the
//!   pipe directory and prints its answer; prints `Cannot find MPS control daemon process`
//!   and exits 1 when there is none.
//!
//! Commands: `get_default_active_thread_percentage` (prints e.g. `100.0`),
//! `set_default_active_thread_percentage <pct>`, `set_default_device_pinned_mem_limit <dev>
//! <n>M|<n>G` (`<dev>` an ordinal below the number of `CUDA_VISIBLE_DEVICES` entries or one
//! of their UUIDs), `get_default_device_pinned_mem_limit <dev>`, `get_server_list`, `quit`
//! (the daemon removes its pid file and socket and exits). Set commands print nothing on
//! success and an error line otherwise.
//!
//! Every daemon start and every command is recorded, one line each, into the file named by
//! `FAKE_MPS_RECORD`, else `<pipe dir>/../fake-mps-record.log`:
//! `start pid=<pid> pipe=<dir> devices=<CUDA_VISIBLE_DEVICES>`, `cmd pipe=<dir> <command>`,
//! `exit pid=<pid> reason=<quit|idle|signal>`.
//!
//! Knobs (environment of the `-d` call): `FAKE_MPS_FAIL_START=1` (exit 1 without starting),
//! `FAKE_MPS_NO_ANSWER=1` (daemon starts but never answers), `FAKE_MPS_IGNORE_QUIT=1` (`quit`
//! is acknowledged but the daemon keeps running), `FAKE_MPS_START_DELAY_MS=<ms>` (delay before
//! the socket exists), `FAKE_MPS_IDLE_EXIT_SECS=<s>` (the daemon exits by itself after this
//! long without a command; default 600, so a test that forgets one never leaks it for long).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::append_line;

/// Tool name (`argv[0]` file name).
pub const TOOL: &str = "nvidia-cuda-mps-control";
/// Pid file the daemon writes into the pipe directory (same name as the real daemon's).
pub const PID_FILE: &str = "nvidia-cuda-mps-control.pid";
/// Unix socket the fake daemon serves in the pipe directory.
pub const SOCKET: &str = "control";
/// Hidden argument that runs the daemon loop.
pub const DAEMON_LOOP_ARG: &str = "--daemon-loop";
/// File receiving the record lines (else `<pipe dir>/../fake-mps-record.log`).
pub const ENV_RECORD: &str = "FAKE_MPS_RECORD";
/// `1`: `-d` fails without starting a daemon.
pub const ENV_FAIL_START: &str = "FAKE_MPS_FAIL_START";
/// `1`: the daemon starts but never answers a command.
pub const ENV_NO_ANSWER: &str = "FAKE_MPS_NO_ANSWER";
/// `1`: the daemon acknowledges `quit` but keeps running (to test the kill fallback).
pub const ENV_IGNORE_QUIT: &str = "FAKE_MPS_IGNORE_QUIT";
/// Milliseconds the daemon waits before it serves its socket.
pub const ENV_START_DELAY_MS: &str = "FAKE_MPS_START_DELAY_MS";
/// Seconds without a command after which the daemon exits by itself (default 600).
pub const ENV_IDLE_EXIT_SECS: &str = "FAKE_MPS_IDLE_EXIT_SECS";
/// Message of the client when no daemon serves the pipe directory (as the real tool says).
pub const NO_DAEMON: &str = "Cannot find MPS control daemon process";

const DEFAULT_IDLE_EXIT_SECS: u64 = 600;

fn env_flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"))
}

fn pipe_dir() -> PathBuf {
    std::env::var_os("CUDA_MPS_PIPE_DIRECTORY")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/tmp/nvidia-mps"))
}

fn log_dir() -> Option<PathBuf> {
    std::env::var_os("CUDA_MPS_LOG_DIRECTORY").map(PathBuf::from)
}

fn record_path(pipe: &Path) -> PathBuf {
    match std::env::var_os(ENV_RECORD) {
        Some(p) => PathBuf::from(p),
        None => pipe
            .parent()
            .unwrap_or(Path::new("/tmp"))
            .join("fake-mps-record.log"),
    }
}

/// Runs the fake with `args` (`args[0]` is the program name) and returns the exit code.
pub fn run(args: &[String]) -> i32 {
    let rest: Vec<&str> = args.iter().skip(1).map(String::as_str).collect();
    match rest.as_slice() {
        ["-d"] => start_daemon(args.first().map(String::as_str).unwrap_or(TOOL)),
        [DAEMON_LOOP_ARG] => daemon_loop(),
        [] => client(),
        ["-h" | "--help"] => {
            println!("usage: {TOOL} [-d]");
            0
        }
        _ => {
            eprintln!("{TOOL} (fake): unsupported arguments {rest:?}");
            2
        }
    }
}

fn start_daemon(argv0: &str) -> i32 {
    let pipe = pipe_dir();
    if env_flag(ENV_FAIL_START) {
        eprintln!("{TOOL} (fake): start failure requested by {ENV_FAIL_START}");
        return 1;
    }
    if !pipe.is_dir() {
        eprintln!(
            "{TOOL} (fake): pipe directory {} does not exist",
            pipe.display()
        );
        return 1;
    }
    if UnixStream::connect(pipe.join(SOCKET)).is_ok() {
        eprintln!("An instance of this daemon is already running");
        return 1;
    }
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("{TOOL} (fake): cannot find own executable: {e}");
            return 1;
        }
    };
    let spawned = Command::new(exe)
        .arg0(argv0)
        .arg(DAEMON_LOOP_ARG)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn();
    match spawned {
        Ok(_) => 0,
        Err(e) => {
            eprintln!("{TOOL} (fake): starting the daemon: {e}");
            1
        }
    }
}

struct Daemon {
    pipe: PathBuf,
    record: PathBuf,
    devices: Vec<String>,
    thread_percentage: f64,
    limits: BTreeMap<String, String>,
}

impl Daemon {
    fn log(&self, line: &str) {
        if let Some(dir) = log_dir() {
            let secs = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or_default();
            append_line(&dir.join("control.log"), &format!("[{secs}] {line}"));
        }
    }

    fn cleanup(&self) {
        let _ = std::fs::remove_file(self.pipe.join(SOCKET));
        let _ = std::fs::remove_file(self.pipe.join(PID_FILE));
    }

    /// Resolves `<dev>` (an ordinal or a UUID among the visible devices) to its ordinal.
    fn device(&self, dev: &str) -> Option<usize> {
        if let Ok(i) = dev.parse::<usize>() {
            return (i < self.devices.len()).then_some(i);
        }
        self.devices
            .iter()
            .position(|d| d.eq_ignore_ascii_case(dev))
    }

    /// Answers one command; `None` for `quit`.
    fn handle(&mut self, command: &str) -> Option<String> {
        let words: Vec<&str> = command.split_whitespace().collect();
        let answer = match words.as_slice() {
            ["quit"] => return None,
            ["get_default_active_thread_percentage"] => format!("{:.1}", self.thread_percentage),
            ["set_default_active_thread_percentage", pct] => match pct.parse::<f64>() {
                Ok(p) if p > 0.0 && p <= 100.0 => {
                    self.thread_percentage = p;
                    String::new()
                }
                _ => format!("Invalid active thread percentage {pct}"),
            },
            ["set_default_device_pinned_mem_limit", dev, value] => {
                match (self.device(dev), valid_limit(value)) {
                    (Some(i), true) => {
                        self.limits.insert(i.to_string(), (*value).to_owned());
                        String::new()
                    }
                    (None, _) => format!("Invalid device {dev}"),
                    (_, false) => format!("Invalid memory limit {value}"),
                }
            }
            ["get_default_device_pinned_mem_limit", dev] => match self.device(dev) {
                Some(i) => self
                    .limits
                    .get(&i.to_string())
                    .cloned()
                    .unwrap_or_else(|| "0".into()),
                None => format!("Invalid device {dev}"),
            },
            ["get_server_list"] => String::new(),
            _ => format!("Unrecognized command {command:?}"),
        };
        Some(answer)
    }
}

/// `<digits>M` or `<digits>G`, as the real control daemon requires.
fn valid_limit(value: &str) -> bool {
    let Some(number) = value.strip_suffix('M').or_else(|| value.strip_suffix('G')) else {
        return false;
    };
    !number.is_empty() && number.bytes().all(|b| b.is_ascii_digit())
}

fn daemon_loop() -> i32 {
    let pipe = pipe_dir();
    let record = record_path(&pipe);
    let devices: Vec<String> = std::env::var("CUDA_VISIBLE_DEVICES")
        .unwrap_or_default()
        .split(',')
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect();
    let mut daemon = Daemon {
        pipe: pipe.clone(),
        record,
        devices,
        thread_percentage: 100.0,
        limits: BTreeMap::new(),
    };
    let pid = std::process::id();

    if let Some(ms) = std::env::var(ENV_START_DELAY_MS)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        std::thread::sleep(Duration::from_millis(ms));
    }
    let socket = pipe.join(SOCKET);
    let _ = std::fs::remove_file(&socket);
    let listener = match UnixListener::bind(&socket) {
        Ok(l) => l,
        Err(e) => {
            daemon.log(&format!("binding {}: {e}", socket.display()));
            return 1;
        }
    };
    // Pid file last and atomically: once it exists, the socket accepts connections.
    let tmp = pipe.join(format!(".{PID_FILE}.tmp"));
    if std::fs::write(&tmp, format!("{pid}\n")).is_err()
        || std::fs::rename(&tmp, pipe.join(PID_FILE)).is_err()
    {
        daemon.log("writing the pid file failed");
        daemon.cleanup();
        return 1;
    }
    append_line(
        &daemon.record,
        &format!(
            "start pid={pid} pipe={} devices={}",
            pipe.display(),
            daemon.devices.join(",")
        ),
    );
    daemon.log(&format!("started pid={pid}"));

    // Exit by itself after a bounded idle time, so a test that forgets to quit a daemon
    // never leaks it for long.
    let idle_limit = std::env::var(ENV_IDLE_EXIT_SECS)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(DEFAULT_IDLE_EXIT_SECS);
    let last = Arc::new(AtomicU64::new(now_secs()));
    {
        let last = Arc::clone(&last);
        let pipe = pipe.clone();
        let record = daemon.record.clone();
        std::thread::spawn(move || {
            loop {
                std::thread::sleep(Duration::from_millis(200));
                if now_secs().saturating_sub(last.load(Ordering::Relaxed)) >= idle_limit {
                    // Only remove files that are still ours (a new daemon may own the dir).
                    if std::fs::read_to_string(pipe.join(PID_FILE))
                        .is_ok_and(|p| p.trim() == pid.to_string())
                    {
                        let _ = std::fs::remove_file(pipe.join(SOCKET));
                        let _ = std::fs::remove_file(pipe.join(PID_FILE));
                    }
                    append_line(&record, &format!("exit pid={pid} reason=idle"));
                    std::process::exit(0);
                }
            }
        });
    }

    let no_answer = env_flag(ENV_NO_ANSWER);
    let ignore_quit = env_flag(ENV_IGNORE_QUIT);
    let mut silent: Vec<UnixStream> = Vec::new();
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else { continue };
        last.store(now_secs(), Ordering::Relaxed);
        if no_answer {
            // Keep the connection open and never answer.
            silent.push(stream);
            continue;
        }
        let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
        let mut line = String::new();
        let Ok(read) = stream.try_clone() else {
            continue;
        };
        if BufReader::new(read).read_line(&mut line).is_err() {
            continue;
        }
        let command = line.trim();
        append_line(
            &daemon.record,
            &format!("cmd pipe={} {command}", pipe.display()),
        );
        daemon.log(&format!("Cmd:{command}"));
        match daemon.handle(command) {
            Some(answer) => {
                let _ = stream.write_all(answer.as_bytes());
            }
            None if ignore_quit => {}
            None => {
                daemon.cleanup();
                append_line(&daemon.record, &format!("exit pid={pid} reason=quit"));
                daemon.log("exiting on quit");
                drop(stream);
                return 0;
            }
        }
    }
    0
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
}

fn client() -> i32 {
    let socket = pipe_dir().join(SOCKET);
    let stdin = std::io::stdin();
    let mut out = std::io::stdout().lock();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        let command = line.trim();
        if command.is_empty() {
            continue;
        }
        let Ok(mut stream) = UnixStream::connect(&socket) else {
            let _ = writeln!(out, "{NO_DAEMON}");
            return 1;
        };
        if stream.write_all(format!("{command}\n").as_bytes()).is_err() {
            let _ = writeln!(out, "{NO_DAEMON}");
            return 1;
        }
        let _ = stream.shutdown(std::net::Shutdown::Write);
        let mut answer = String::new();
        let _ = stream.read_to_string(&mut answer);
        if !answer.is_empty() {
            let _ = writeln!(out, "{}", answer.trim_end());
        }
    }
    0
}
