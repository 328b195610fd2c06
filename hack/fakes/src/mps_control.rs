//! Fake `nvidia-cuda-mps-control` (Legacy MPS, "v2"), and a fake CUDA client of it.
//!
//! What it reproduces, and from where (the real tool's man page and the strings of the 550
//! binary, NVIDIA's MPS documentation, and NVIDIA's DRA driver's and device plugin's issues;
//! `docs/hardware-check.md` says how to compare it with a real GPU):
//!
//! - `-d` starts a control daemon for `CUDA_MPS_PIPE_DIRECTORY` (default `/tmp/nvidia-mps`)
//!   and returns **only once the `control` socket accepts connections**, like the real
//!   tool. Without `fork`: it re-runs its own executable with the hidden argument
//!   `--daemon-loop` in a new process group, and waits for it to say it is ready. The
//!   daemon creates `nvidia-cuda-mps-control.pid` (its PID in text), the `control` and
//!   `control_privileged` sockets, the `log` FIFO and `control_lock` in the pipe directory,
//!   and appends `Starting control daemon using socket <pipe>/control` and `To connect
//!   CUDA applications to this daemon, set env CUDA_MPS_PIPE_DIRECTORY=<pipe>` to
//!   `control.log` in the real line format (`[2026-05-31 23:24:21.919 Control  6575] msg`).
//!   `-d -M` starts it in multi-user mode (the switch NVIDIA's DRA driver passes; whether a
//!   given driver release takes it is unverified, see `FAKE_MPS_MULTIUSER`).
//! - A second `-d` on a pipe directory whose daemon answers prints `An instance of this
//!   daemon is already running` and exits 1 (the exit value is unverified; third-party
//!   scripts treat it as 1). A pipe directory that does not exist: `Cannot access
//!   CUDA_MPS_PIPE_DIRECTORY=<dir>`, exit 1. Stale files of a killed daemon are taken over.
//! - Without arguments it is the front-end UI: it reads commands from stdin, one per line,
//!   until EOF, and prints the daemon's answers on **stdout**. A rejected command prints its
//!   error there and the exit status stays **0**. No daemon reachable: `Cannot find MPS
//!   control daemon process`, exit 1 (the value is unverified). `quit` is synchronous: the
//!   UI returns once the daemon is gone.
//! - Commands: `set_default_active_thread_percentage <pct>` (a float in (0, 100], else
//!   `Invalid percentage, expected between (0.0, 100.0]`), `get_default_active_thread_percentage`
//!   (`%.1f`, e.g. `100.0`), `set_default_device_pinned_mem_limit <dev> <n>G|<n>M` (`<dev>`
//!   is kept as the **literal** key, never validated: `0` and a UUID are different keys),
//!   `get_default_device_pinned_mem_limit <dev>` (`<n>G`/`<n>M`, or `No default pinned
//!   memory limit set for the device!`), `get_server_list` (server PIDs, one per line;
//!   nothing without a server), `get_server_status <pid>`, `get_client_list <pid>`,
//!   `start_server -uid <uid>`, `shutdown_server <pid> [-f]`, `set_active_thread_percentage
//!   <pid> <pct>`, `get_active_thread_percentage <pid>`, `terminate_client <server pid>
//!   <client pid>` (`0`), `quit [-t <s>]`; anything else is `Unknown command "<line>"`. Set
//!   commands print nothing on success (what the real one prints is unverified; see
//!   `FAKE_MPS_SET_ECHO`). The `set_default_*` values are the **pending defaults of the next
//!   server**: servers that exist keep theirs, and `quit` forgets them.
//! - Servers: at most one per daemon, bound to the UID of the client that made it start. A
//!   client of the same UID attaches; a client of another UID is **queued** (`Server is not
//!   ready, push client to pending list`) until the server's clients are gone, then the
//!   server exits and one for the new UID starts. In multi-user mode every client counts as
//!   UID 0. Every client connection logs `User did not send valid credentials`. A server for
//!   a UID that cannot traverse every parent of the pipe directory fails to start, and its
//!   clients wait (as reported in bottlerocket-os/bottlerocket#4673). A server creates
//!   `mps.shm.<uid>.<server pid>` in its shared-memory directory; a client that does not
//!   see it there (it does not share the daemon's `/dev/shm`) fails.
//!
//! A server takes at most 48 clients (Volta and newer; `FAKE_MPS_MAX_CLIENTS` for another
//! limit), the next one is refused. The hidden command `fake_fault <server pid>` puts a
//! server into the FAULT state: `get_server_status` says `FAULT` and new clients are refused
//! with `CUDA_ERROR_MPS_SERVER_NOT_READY` until every client is gone (then ACTIVE again, as
//! on Volta and newer). The INITIALIZING state is not modelled (a server is ready at once).
//!
//! Server PIDs are numbers the fake makes up (`<daemon pid>00 + n`), not processes.
//!
//! The fake CUDA client (`fake-mps-client [--uid <uid>] [--hold-ms <ms>] [--wait-ms <ms>]`,
//! the same executable under that name): connects to the daemon of its
//! `CUDA_MPS_PIPE_DIRECTORY` as an MPS client would, prints `served by MPS server <pid>
//! (active thread percentage <pct>, pinned memory limits <dev>=<limit>,...)`, stays
//! connected `--hold-ms`, and exits 0; without a reachable daemon it prints `no MPS
//! daemon: running without MPS` and exits 0 (a CUDA client falls back to plain CUDA); when
//! it is not served within `--wait-ms` it prints `still waiting for an MPS server` and
//! exits 3; a refused client prints `MPS client refused: <error>` and exits 1. The limits it
//! prints are the server's lowered (never raised) by its own
//! `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` and `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`.
//!
//! Every daemon start and every UI command is recorded, one line each, into the file named
//! by `FAKE_MPS_RECORD`, else `<pipe dir>/../fake-mps-record.log`:
//! `start pid=<pid> pipe=<dir>[ multiUser=1] devices=<CUDA_VISIBLE_DEVICES>`, `cmd pipe=<dir>
//! <command>`, `exit pid=<pid> reason=<quit|idle|signal>`.
//!
//! Knobs (environment of the `-d` call unless said otherwise): `FAKE_MPS_FAIL_START=1` (exit 1
//! without starting), `FAKE_MPS_NO_ANSWER=1` (the daemon starts but never answers),
//! `FAKE_MPS_IGNORE_QUIT=1` (`quit` is acknowledged but the daemon keeps running),
//! `FAKE_MPS_START_DELAY_MS=<ms>` (delay before the socket exists; `-d` waits for it),
//! `FAKE_MPS_IDLE_EXIT_SECS=<s>` (the daemon exits by itself after this long without a
//! command and without clients; default 600), `FAKE_MPS_MULTIUSER=refuse` (`-M` is refused
//! as an unknown option, exit 1), `FAKE_MPS_SET_ECHO=1` (set commands print a line on
//! success), `FAKE_MPS_LIMIT_READBACK=gib-floor` (limits of 1 GiB or more read back as
//! `floor(MiB/1024)G`, as a third party reported for driver 595), `FAKE_MPS_DROP_SETS=1`
//! (set commands are accepted silently but change nothing), `FAKE_MPS_SHM_DIR=<dir>`
//! (shared-memory directory of the daemon, and of the fake client; default `/dev/shm`).

use std::collections::{BTreeMap, VecDeque};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::append_line;

/// Tool name (`argv[0]` file name).
pub const TOOL: &str = "nvidia-cuda-mps-control";
/// Name of the fake CUDA client (`argv[0]` file name).
pub const CLIENT_TOOL: &str = "fake-mps-client";
/// Pid file the daemon writes into the pipe directory (same name as the real daemon's).
pub const PID_FILE: &str = "nvidia-cuda-mps-control.pid";
/// Unix socket the daemon serves in the pipe directory.
pub const SOCKET: &str = "control";
/// The second socket of the real daemon (bound, never served by the fake).
pub const PRIVILEGED_SOCKET: &str = "control_privileged";
/// The log FIFO in the pipe directory.
pub const LOG_FIFO: &str = "log";
/// The lock file in the pipe directory.
pub const LOCK_FILE: &str = "control_lock";
/// Log file of the daemon in its log directory.
pub const CONTROL_LOG: &str = "control.log";
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
/// `refuse`: `-M` is an unknown option.
pub const ENV_MULTIUSER: &str = "FAKE_MPS_MULTIUSER";
/// `1`: set commands print a line on success.
pub const ENV_SET_ECHO: &str = "FAKE_MPS_SET_ECHO";
/// `gib-floor`: limits of 1 GiB or more read back as whole GiB, rounded down.
pub const ENV_LIMIT_READBACK: &str = "FAKE_MPS_LIMIT_READBACK";
/// `1`: set commands are accepted silently and change nothing.
pub const ENV_DROP_SETS: &str = "FAKE_MPS_DROP_SETS";
/// Clients per server (default 48).
pub const ENV_MAX_CLIENTS: &str = "FAKE_MPS_MAX_CLIENTS";
/// Shared-memory directory (default `/dev/shm`).
pub const ENV_SHM_DIR: &str = "FAKE_MPS_SHM_DIR";

/// The UI's message when no daemon serves the pipe directory (the real tool's words).
pub const NO_DAEMON: &str = "Cannot find MPS control daemon process";
/// A second `-d` on a served pipe directory (the real tool's words).
pub const ALREADY_RUNNING: &str = "An instance of this daemon is already running";
/// A bad thread percentage (the real tool's words).
pub const INVALID_PERCENTAGE: &str = "Invalid percentage, expected between (0.0, 100.0]";
/// No limit set under that device key (the real tool's words).
pub const NO_LIMIT: &str = "No default pinned memory limit set for the device!";
/// A limit not of the form `<n>G`/`<n>M`: the fake's own words (the real text is unknown).
pub const INVALID_LIMIT: &str = "Invalid pinned memory limit (fake: expected <n>G or <n>M)";

const DEFAULT_IDLE_EXIT_SECS: u64 = 600;
/// First line of a fake client's connection (never a UI command).
const CLIENT_HELLO: &str = "\u{1}CLIENT";
/// What the daemon tells `-d` once it serves its socket.
const READY: &str = "ready";

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

fn shm_dir() -> PathBuf {
    std::env::var_os(ENV_SHM_DIR)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/dev/shm"))
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

fn usage() -> String {
    format!("Usage: {TOOL} [-d | -f] [-M] [-h | --help] (fake)")
}

/// Runs the fake with `args` (`args[0]` is the program name) and returns the exit code.
pub fn run(args: &[String]) -> i32 {
    let rest: Vec<&str> = args.iter().skip(1).map(String::as_str).collect();
    let argv0 = args.first().map(String::as_str).unwrap_or(TOOL);
    let multi = rest.contains(&"-M");
    let others: Vec<&str> = rest.iter().copied().filter(|a| *a != "-M").collect();
    if multi && std::env::var(ENV_MULTIUSER).is_ok_and(|v| v == "refuse") {
        eprintln!("{TOOL}: unrecognized option '-M' (fake: this release has no multi-user switch)");
        eprintln!("{}", usage());
        return 1;
    }
    match others.as_slice() {
        ["-d"] => start_daemon(argv0, multi),
        [DAEMON_LOOP_ARG] => daemon_loop(multi),
        [] if !multi => ui(),
        ["-h" | "--help"] => {
            println!("{}", usage());
            println!("  -d  start the control daemon in the background");
            println!("  -M  multi-user mode");
            println!("  with no option, read commands from stdin");
            0
        }
        _ => {
            eprintln!("{TOOL}: unrecognized arguments {rest:?} (fake)");
            eprintln!("{}", usage());
            1
        }
    }
}

fn start_daemon(argv0: &str, multi: bool) -> i32 {
    let pipe = pipe_dir();
    if env_flag(ENV_FAIL_START) {
        eprintln!("{TOOL} (fake): start failure requested by {ENV_FAIL_START}");
        return 1;
    }
    if !pipe.is_dir() {
        eprintln!("Cannot access CUDA_MPS_PIPE_DIRECTORY={}", pipe.display());
        return 1;
    }
    if UnixStream::connect(pipe.join(SOCKET)).is_ok() {
        eprintln!("{ALREADY_RUNNING}");
        return 1;
    }
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("{TOOL} (fake): cannot find own executable: {e}");
            return 1;
        }
    };
    let mut cmd = Command::new(exe);
    cmd.arg0(argv0).arg(DAEMON_LOOP_ARG);
    if multi {
        cmd.arg("-M");
    }
    let spawned = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn();
    let mut child = match spawned {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{TOOL} (fake): starting the daemon: {e}");
            return 1;
        }
    };
    // Return only once the daemon serves its socket (or died trying).
    let mut line = String::new();
    if let Some(out) = child.stdout.take() {
        let _ = BufReader::new(out).read_line(&mut line);
    }
    if line.trim() == READY {
        0
    } else {
        let _ = child.wait();
        eprintln!(
            "{TOOL} (fake): the daemon did not start; see {CONTROL_LOG} in CUDA_MPS_LOG_DIRECTORY"
        );
        1
    }
}

/// `[2026-05-31 23:24:21.919 Control  6575] msg`, in UTC.
fn log_line(role: &str, pid: u32, msg: &str) -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let secs = now.as_secs();
    let (y, m, d) = civil_from_days(i64::try_from(secs / 86_400).unwrap_or_default());
    let rem = secs % 86_400;
    format!(
        "[{y}-{m:02}-{d:02} {:02}:{:02}:{:02}.{:03} {role} {pid:>5}] {msg}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        now.subsec_millis()
    )
}

/// Days since 1970-01-01 to (year, month, day) (H. Hinnant's `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = u32::try_from(doy - (153 * mp + 2) / 5 + 1).unwrap_or(1);
    let m = u32::try_from(if mp < 10 { mp + 3 } else { mp - 9 }).unwrap_or(1);
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// A memory limit as the daemon keeps it: the number and its unit (`G` or `M`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Limit {
    value: u64,
    unit: char,
}

impl Limit {
    /// `<digits>G` or `<digits>M`, as the real control daemon requires.
    fn parse(text: &str) -> Option<Self> {
        let unit = text.chars().last().filter(|c| *c == 'G' || *c == 'M')?;
        let number = &text[..text.len() - 1];
        if number.is_empty() || !number.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        Some(Self {
            value: number.parse().ok()?,
            unit,
        })
    }

    fn render(self) -> String {
        if self.unit == 'M'
            && self.value >= 1024
            && std::env::var(ENV_LIMIT_READBACK).is_ok_and(|v| v == "gib-floor")
        {
            return format!("{}G", self.value / 1024);
        }
        format!("{}{}", self.value, self.unit)
    }
}

/// One MPS server (made up: no process).
#[derive(Debug, Clone)]
struct Server {
    pid: u32,
    uid: u32,
    clients: Vec<u32>,
    thread_percentage: f64,
    limits: BTreeMap<String, Limit>,
    /// Exits once its clients are gone (`shutdown_server`).
    draining: bool,
    /// A client hit a fatal fault: new clients are refused until every client is gone
    /// (Volta and newer then return to ACTIVE).
    fault: bool,
}

struct State {
    daemon_pid: u32,
    pipe: PathBuf,
    record: PathBuf,
    multi_user: bool,
    pending_percentage: f64,
    pending_limits: BTreeMap<String, Limit>,
    server: Option<Server>,
    /// Waiting clients: (client PID, effective UID), in arrival order.
    queue: VecDeque<(u32, u32)>,
    servers_started: u32,
    /// A server start failed for this UID (logged once per UID).
    failed_uids: Vec<u32>,
}

impl State {
    fn log(&self, msg: &str) {
        if let Some(dir) = log_dir() {
            append_line(
                &dir.join(CONTROL_LOG),
                &log_line("Control", self.daemon_pid, msg),
            );
        }
    }

    fn shm_marker(&self, server: &Server) -> PathBuf {
        shm_dir().join(format!("mps.shm.{}.{}", server.uid, server.pid))
    }

    fn end_server(&mut self) {
        if let Some(s) = self.server.take() {
            let _ = std::fs::remove_file(self.shm_marker(&s));
            self.log(&format!("Server {} exited with status 0", s.pid));
        }
    }

    /// Starts a server for `uid` with the pending defaults; `None` if it cannot start.
    fn start_server(&mut self, uid: u32) -> Option<&mut Server> {
        if !traversable(&self.pipe, uid) {
            if !self.failed_uids.contains(&uid) {
                self.failed_uids.push(uid);
                self.log(&format!(
                    "Server for user {uid} failed to start: cannot access {}/{SOCKET} (permission denied on a parent directory); retrying",
                    self.pipe.display()
                ));
            }
            return None;
        }
        self.servers_started += 1;
        let server = Server {
            pid: self.daemon_pid * 100 + self.servers_started,
            uid,
            clients: Vec::new(),
            thread_percentage: self.pending_percentage,
            limits: self.pending_limits.clone(),
            draining: false,
            fault: false,
        };
        self.log(&format!(
            "Starting new server {} for user {uid}",
            server.pid
        ));
        self.log(&format!("NEW SERVER {}: Ready", server.pid));
        let _ = std::fs::write(self.shm_marker(&server), b"");
        self.server = Some(server);
        self.server.as_mut()
    }

    /// Ends the server when it has no clients and someone else waits or it drains.
    fn maybe_switch(&mut self) {
        let Some(s) = &self.server else { return };
        if s.clients.is_empty() && (s.draining || self.queue.iter().any(|(_, u)| *u != s.uid)) {
            self.end_server();
        }
    }

    fn server_by_pid(&mut self, pid: &str) -> Option<&mut Server> {
        let pid: u32 = pid.parse().ok()?;
        self.server.as_mut().filter(|s| s.pid == pid)
    }

    /// Answers one UI command; `None` for `quit`.
    fn handle(&mut self, command: &str) -> Option<String> {
        let words: Vec<&str> = command.split_whitespace().collect();
        let echo = env_flag(ENV_SET_ECHO);
        let drop_sets = env_flag(ENV_DROP_SETS);
        let set_ok = |what: String| if echo { what } else { String::new() };
        let answer = match words.as_slice() {
            ["quit"] | ["quit", "-t", _] => return None,
            ["get_default_active_thread_percentage"] => {
                format!("{:.1}", self.pending_percentage)
            }
            ["set_default_active_thread_percentage", pct] => match parse_percentage(pct) {
                Some(p) => {
                    if !drop_sets {
                        self.pending_percentage = p;
                    }
                    set_ok(format!(
                        "Set default active thread percentage to {p:.1} (fake)"
                    ))
                }
                None => INVALID_PERCENTAGE.to_owned(),
            },
            ["set_default_active_thread_percentage"] => INVALID_PERCENTAGE.to_owned(),
            ["set_default_device_pinned_mem_limit", dev, value] => match Limit::parse(value) {
                Some(limit) => {
                    if !drop_sets {
                        self.pending_limits.insert((*dev).to_owned(), limit);
                    }
                    set_ok(format!(
                        "Set default pinned memory limit of device {dev} to {value} (fake)"
                    ))
                }
                None => INVALID_LIMIT.to_owned(),
            },
            ["get_default_device_pinned_mem_limit", dev] => self
                .pending_limits
                .get(*dev)
                .map_or_else(|| NO_LIMIT.to_owned(), |l| l.render()),
            ["get_server_list"] => self
                .server
                .as_ref()
                .map(|s| s.pid.to_string())
                .unwrap_or_default(),
            ["get_server_status"] | ["get_client_list"] => "A server PID is required".to_owned(),
            ["get_server_status", pid] => match self.server_by_pid(pid) {
                Some(s) if s.fault => "FAULT".to_owned(),
                Some(_) => "ACTIVE".to_owned(),
                None => format!("Server {pid} not found"),
            },
            ["get_client_list", pid] => match self.server_by_pid(pid) {
                Some(s) => s
                    .clients
                    .iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join("\n"),
                None => format!("Server {pid} not found"),
            },
            ["start_server"] => "A user id (UID) is required to start a new server".to_owned(),
            ["start_server", "-uid", uid] => match uid.parse::<u32>() {
                Ok(uid) => {
                    let uid = if self.multi_user { 0 } else { uid };
                    match &self.server {
                        Some(s) if s.uid == uid => String::new(),
                        Some(_) => format!(
                            "Failed to start server using uid {uid}. A server of another user is active (fake)"
                        ),
                        None => match self.start_server(uid) {
                            Some(_) => String::new(),
                            None => format!(
                                "Failed to start server using uid {uid}. Permission denied (fake)"
                            ),
                        },
                    }
                }
                Err(_) => "A user id (UID) is required to start a new server".to_owned(),
            },
            ["shutdown_server", pid, rest @ ..] => {
                let force = rest == ["-f"];
                match self.server_by_pid(pid) {
                    Some(s) => {
                        s.draining = true;
                        if force {
                            s.clients.clear();
                        }
                        self.maybe_switch();
                        String::new()
                    }
                    None => format!("Server {pid} not found"),
                }
            }
            ["set_active_thread_percentage", pid, pct] => {
                match (parse_percentage(pct), self.server_by_pid(pid)) {
                    (None, _) => INVALID_PERCENTAGE.to_owned(),
                    (Some(p), Some(s)) => {
                        s.thread_percentage = p;
                        set_ok(format!("Set active thread percentage to {p:.1} (fake)"))
                    }
                    (Some(_), None) => format!("Server {pid} not found"),
                }
            }
            ["get_active_thread_percentage", pid] => match self.server_by_pid(pid) {
                Some(s) => format!("{:.1}", s.thread_percentage),
                None => format!("Server {pid} not found"),
            },
            ["terminate_client", spid, cpid] => {
                let client: Option<u32> = cpid.parse().ok();
                match (self.server_by_pid(spid), client) {
                    (Some(s), Some(c)) if s.clients.contains(&c) => {
                        s.clients.retain(|x| *x != c);
                        "0".to_owned()
                    }
                    _ => format!("Invalid process {cpid}!"),
                }
            }
            // Not a real command: lets a test put a server into the FAULT state.
            ["fake_fault", pid] => match self.server_by_pid(pid) {
                Some(s) => {
                    s.fault = true;
                    let spid = s.pid;
                    self.log(&format!(
                        "Server {spid}: Volta MPS: Server is handling a fatal GPU error. (fake)"
                    ));
                    String::new()
                }
                None => format!("Server {pid} not found"),
            },
            _ => format!("Unknown command \"{command}\""),
        };
        Some(answer)
    }
}

/// Clients per device a server takes: 48 (Volta and newer, MAN550); `FAKE_MPS_MAX_CLIENTS`
/// sets another (16 before Volta, fewer on a small MIG instance).
fn max_clients() -> usize {
    std::env::var(ENV_MAX_CLIENTS)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(48)
}

fn parse_percentage(text: &str) -> Option<f64> {
    text.parse::<f64>()
        .ok()
        .filter(|p| p.is_finite() && *p > 0.0 && *p <= 100.0)
}

/// True if `uid` may search (`x`) every directory from `/` down to `dir`. Only owner and
/// other bits count (the fake does not know the UID's groups): the strict reading.
fn traversable(dir: &Path, uid: u32) -> bool {
    if uid == 0 {
        return true;
    }
    dir.ancestors().all(|d| match std::fs::metadata(d) {
        Ok(m) if m.uid() == uid => m.mode() & 0o100 != 0,
        Ok(m) => m.mode() & 0o001 != 0,
        Err(_) => false,
    })
}

type Shared = Arc<(Mutex<State>, Condvar)>;

fn lock(shared: &Shared) -> MutexGuard<'_, State> {
    shared.0.lock().unwrap_or_else(|p| p.into_inner())
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
}

fn remove_files(pipe: &Path, pid: u32) {
    // Only files that are still ours (a new daemon may own the directory).
    if std::fs::read_to_string(pipe.join(PID_FILE)).is_ok_and(|p| p.trim() == pid.to_string()) {
        for f in [SOCKET, PRIVILEGED_SOCKET, LOG_FIFO, LOCK_FILE, PID_FILE] {
            let _ = std::fs::remove_file(pipe.join(f));
        }
    }
}

fn make_fifo(path: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let _ = std::fs::remove_file(path);
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: `c` is a valid NUL-terminated path that outlives the call.
    #[allow(unsafe_code)]
    let rc = unsafe { libc::mkfifo(c.as_ptr(), 0o777) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

fn daemon_loop(multi_user: bool) -> i32 {
    let pipe = pipe_dir();
    let record = record_path(&pipe);
    let devices = std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_default();
    let pid = std::process::id();
    let pending_percentage = std::env::var("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
        .ok()
        .and_then(|v| parse_percentage(&v))
        .unwrap_or(100.0);
    let state = State {
        daemon_pid: pid,
        pipe: pipe.clone(),
        record: record.clone(),
        multi_user,
        pending_percentage,
        pending_limits: BTreeMap::new(),
        server: None,
        queue: VecDeque::new(),
        servers_started: 0,
        failed_uids: Vec::new(),
    };

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
            state.log(&format!("Failed to bind {}: {e}", socket.display()));
            return 1;
        }
    };
    let _ = std::fs::remove_file(pipe.join(PRIVILEGED_SOCKET));
    let privileged = UnixListener::bind(pipe.join(PRIVILEGED_SOCKET));
    if let Err(e) = &privileged {
        // E.g. a path longer than a unix socket address takes (107 bytes).
        state.log(&format!(
            "Failed to bind {}/{PRIVILEGED_SOCKET}: {e}",
            pipe.display()
        ));
        let _ = std::fs::remove_file(&socket);
        return 1;
    }
    let extras =
        make_fifo(&pipe.join(LOG_FIFO)).and_then(|()| std::fs::write(pipe.join(LOCK_FILE), b""));
    // Pid file last and atomically: once it exists, the socket accepts connections.
    let tmp = pipe.join(format!(".{PID_FILE}.tmp"));
    if extras.is_err()
        || std::fs::write(&tmp, format!("{pid}\n")).is_err()
        || std::fs::rename(&tmp, pipe.join(PID_FILE)).is_err()
    {
        state.log(&format!(
            "Failed to create control pid file {}/{PID_FILE}",
            pipe.display()
        ));
        let _ = std::fs::remove_file(&socket);
        return 1;
    }
    append_line(
        &record,
        &format!(
            "start pid={pid} pipe={}{} devices={devices}",
            pipe.display(),
            if multi_user { " multiUser=1" } else { "" }
        ),
    );
    state.log(&format!(
        "Starting control daemon using socket {}",
        socket.display()
    ));
    state.log(&format!(
        "To connect CUDA applications to this daemon, set env CUDA_MPS_PIPE_DIRECTORY={}",
        pipe.display()
    ));
    // Tell `-d` that the socket is served; stdout is not used again.
    {
        let mut out = std::io::stdout();
        let _ = writeln!(out, "{READY}");
        let _ = out.flush();
    }

    let shared: Shared = Arc::new((Mutex::new(state), Condvar::new()));
    let last = Arc::new(AtomicU64::new(now_secs()));
    spawn_idle_exit(&shared, &last, pid);

    let no_answer = env_flag(ENV_NO_ANSWER);
    let ignore_quit = env_flag(ENV_IGNORE_QUIT);
    let mut silent: Vec<UnixStream> = Vec::new();
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        last.store(now_secs(), Ordering::Relaxed);
        if no_answer {
            // Keep the connection open and never answer.
            silent.push(stream);
            continue;
        }
        let shared = Arc::clone(&shared);
        let last = Arc::clone(&last);
        std::thread::spawn(move || serve_connection(&shared, stream, ignore_quit, &last));
    }
    0
}

fn spawn_idle_exit(shared: &Shared, last: &Arc<AtomicU64>, pid: u32) {
    // Exit by itself after a bounded idle time, so a test that forgets to quit a daemon
    // never leaks it for long.
    let idle_limit = std::env::var(ENV_IDLE_EXIT_SECS)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(DEFAULT_IDLE_EXIT_SECS);
    let shared = Arc::clone(shared);
    let last = Arc::clone(last);
    std::thread::spawn(move || {
        loop {
            std::thread::sleep(Duration::from_millis(200));
            let idle = now_secs().saturating_sub(last.load(Ordering::Relaxed)) >= idle_limit;
            let mut st = lock(&shared);
            let busy = st.server.as_ref().is_some_and(|s| !s.clients.is_empty());
            if idle && !busy {
                st.end_server();
                remove_files(&st.pipe, pid);
                append_line(&st.record, &format!("exit pid={pid} reason=idle"));
                st.log("Control daemon exiting: idle (fake)");
                std::process::exit(0);
            }
        }
    });
}

fn serve_connection(shared: &Shared, stream: UnixStream, ignore_quit: bool, last: &AtomicU64) {
    let Ok(read) = stream.try_clone() else { return };
    let mut reader = BufReader::new(read);
    let mut first = String::new();
    if reader.read_line(&mut first).unwrap_or(0) == 0 {
        return;
    }
    if let Some(rest) = first.trim_end().strip_prefix(CLIENT_HELLO) {
        serve_client(shared, stream, reader, rest);
        return;
    }
    {
        let st = lock(shared);
        st.log("Accepting connection...");
        st.log("NEW UI");
    }
    let mut writer = stream;
    let mut line = first;
    loop {
        let command = line.trim().to_owned();
        if !command.is_empty() {
            last.store(now_secs(), Ordering::Relaxed);
            let mut st = lock(shared);
            append_line(
                &st.record,
                &format!("cmd pipe={} {command}", st.pipe.display()),
            );
            st.log(&format!("Cmd:{command}"));
            match st.handle(&command) {
                Some(answer) => {
                    if !answer.is_empty() {
                        let _ = writer.write_all(format!("{answer}\n").as_bytes());
                    }
                }
                None if ignore_quit => {}
                None => {
                    // Synchronous: servers end, files go, then the UI sees the end.
                    let pid = st.daemon_pid;
                    st.log("quit command issued (fake)");
                    st.end_server();
                    remove_files(&st.pipe, pid);
                    append_line(&st.record, &format!("exit pid={pid} reason=quit"));
                    st.log("Control daemon exiting (fake)");
                    let _ = writer.flush();
                    let _ = writer.shutdown(std::net::Shutdown::Both);
                    std::process::exit(0);
                }
            }
        }
        line.clear();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            break;
        }
    }
    lock(shared).log("UI closed");
}

fn serve_client(
    shared: &Shared,
    mut stream: UnixStream,
    mut reader: BufReader<UnixStream>,
    hello: &str,
) {
    let mut words = hello.split_whitespace();
    let (Some(client), Some(uid)) = (
        words.next().and_then(|w| w.parse::<u32>().ok()),
        words.next().and_then(|w| w.parse::<u32>().ok()),
    ) else {
        return;
    };
    let (mutex, cond) = &**shared;
    let mut st = mutex.lock().unwrap_or_else(|p| p.into_inner());
    st.log("Accepting connection...");
    st.log("User did not send valid credentials");
    let effective = if st.multi_user { 0 } else { uid };
    let mut queued = false;
    // A hang-up while waiting is seen by a read with a short timeout.
    let _ = stream.set_read_timeout(Some(Duration::from_millis(50)));
    let served = loop {
        let attach = match &st.server {
            Some(s) => s.uid == effective && !s.draining,
            // No server: the first waiting UID gets the next one.
            None => st.queue.front().is_none_or(|(_, u)| *u == effective),
        };
        if attach {
            let existed = st.server.is_some();
            let server = if existed {
                st.server.as_mut()
            } else {
                st.start_server(effective)
            };
            if let Some(server) = server {
                if server.fault {
                    break Err("CUDA_ERROR_MPS_SERVER_NOT_READY".to_owned());
                }
                if server.clients.len() >= max_clients() {
                    let spid = server.pid;
                    st.log(&format!(
                        "Server {spid}: client {client} refused, the limit of {} clients per device is reached (fake)",
                        max_clients()
                    ));
                    break Err(format!(
                        "too many MPS clients (limit {}; fake: the facts name no CUDA error)",
                        max_clients()
                    ));
                }
                server.clients.push(client);
                let info = (
                    server.pid,
                    server.thread_percentage,
                    server
                        .limits
                        .iter()
                        .map(|(k, l)| format!("{k}={}", l.render()))
                        .collect::<Vec<_>>()
                        .join(","),
                );
                if existed {
                    st.log(&format!(
                        "NEW CLIENT {client} from user {effective}: Server already exists"
                    ));
                }
                st.queue.retain(|(c, _)| *c != client);
                cond.notify_all();
                break Ok(Some(info));
            }
        }
        if !queued {
            queued = true;
            st.queue.push_back((client, effective));
            st.log(&format!(
                "NEW CLIENT {client} from user {effective}: Server is not ready, push client to pending list"
            ));
            st.maybe_switch();
            cond.notify_all();
            continue;
        }
        st = cond
            .wait_timeout(st, Duration::from_millis(50))
            .map(|(g, _)| g)
            .unwrap_or_else(|p| p.into_inner().0);
        drop(st);
        let mut probe = [0u8; 1];
        let gone = matches!(reader.get_mut().read(&mut probe), Ok(0));
        st = mutex.lock().unwrap_or_else(|p| p.into_inner());
        if gone {
            st.queue.retain(|(c, _)| *c != client);
            cond.notify_all();
            break Ok(None);
        }
    };
    drop(st);
    let (spid, pct, limits) = match served {
        Ok(Some(info)) => info,
        Ok(None) => return,
        Err(error) => {
            let _ = stream.write_all(format!("ERROR {error}\n").as_bytes());
            return;
        }
    };
    let _ = stream.write_all(format!("SERVER {spid} {pct:.1} {limits}\n").as_bytes());
    // Attached until the client hangs up.
    let _ = stream.set_read_timeout(None);
    let mut buf = [0u8; 64];
    while matches!(reader.get_mut().read(&mut buf), Ok(n) if n > 0) {}
    let mut st = lock(shared);
    if let Some(s) = st.server.as_mut() {
        s.clients.retain(|c| *c != client);
        if s.clients.is_empty() {
            // Volta and newer: back to ACTIVE once the faulting clients are gone.
            s.fault = false;
        }
    }
    st.maybe_switch();
    cond.notify_all();
}

fn ui() -> i32 {
    let socket = pipe_dir().join(SOCKET);
    let mut input = String::new();
    let _ = std::io::stdin().read_to_string(&mut input);
    let commands: Vec<&str> = input
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let mut out = std::io::stdout().lock();
    let Ok(mut stream) = UnixStream::connect(&socket) else {
        let _ = writeln!(out, "{NO_DAEMON}");
        return 1;
    };
    let mut text = commands.join("\n");
    text.push('\n');
    if stream.write_all(text.as_bytes()).is_err() {
        let _ = writeln!(out, "Cannot send command to MPS control daemon process");
        return 1;
    }
    let _ = stream.shutdown(std::net::Shutdown::Write);
    let mut answer = String::new();
    if stream.read_to_string(&mut answer).is_err() {
        let _ = writeln!(out, "Cannot send command to MPS control daemon process");
        return 1;
    }
    let _ = out.write_all(answer.as_bytes());
    0
}

fn own_uid() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

/// The client's effective thread percentage and limits: the server's (`server_pct`,
/// `server_limits` as `dev=limit,...` or `none`) lowered by the client's own environment.
/// A percentage outside (0, 100] is an error, as in the real client (`%s should be between
/// (0.0, 100.0]`). Limits are keyed by the literal device string, as the daemon keeps them.
fn client_limits(server_pct: &str, server_limits: &str) -> Result<(String, String), String> {
    let mut pct: f64 = server_pct.parse().unwrap_or(100.0);
    if let Ok(text) = std::env::var("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") {
        let own = parse_percentage(&text).ok_or_else(|| {
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE should be between (0.0, 100.0]".to_owned()
        })?;
        pct = pct.min(own);
    }
    let mib = |l: Limit| {
        if l.unit == 'G' {
            l.value * 1024
        } else {
            l.value
        }
    };
    let mut limits: BTreeMap<String, Limit> = BTreeMap::new();
    for entry in server_limits
        .split(',')
        .filter(|e| *e != "none" && !e.is_empty())
    {
        if let Some((dev, text)) = entry.split_once('=')
            && let Some(limit) = Limit::parse(text)
        {
            limits.insert(dev.to_owned(), limit);
        }
    }
    if let Ok(text) = std::env::var("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT") {
        for entry in text.split(',').filter(|e| !e.is_empty()) {
            let parsed = entry.split_once('=').and_then(|(dev, l)| {
                Limit::parse(l.strip_suffix('B').unwrap_or(l)).map(|l| (dev, l))
            });
            let Some((dev, own)) = parsed else {
                return Err(format!(
                    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT entry {entry:?} is not <device>=<n>G|M"
                ));
            };
            let lower = limits.get(dev).is_none_or(|l| mib(own) < mib(*l));
            if lower {
                limits.insert(dev.to_owned(), own);
            }
        }
    }
    let limits = if limits.is_empty() {
        "none".to_owned()
    } else {
        limits
            .iter()
            .map(|(d, l)| format!("{d}={}{}", l.value, l.unit))
            .collect::<Vec<_>>()
            .join(",")
    };
    Ok((format!("{pct:.1}"), limits))
}

/// Runs the fake CUDA client (see the module docs) and returns its exit code.
pub fn client_main(args: &[String]) -> i32 {
    let mut uid = own_uid();
    let mut hold = Duration::ZERO;
    let mut wait = Duration::from_secs(10);
    let mut it = args.iter().skip(1);
    while let Some(a) = it.next() {
        let value = it.next().and_then(|v| v.parse::<u64>().ok());
        match (a.as_str(), value) {
            ("--uid", Some(v)) => uid = u32::try_from(v).unwrap_or(u32::MAX),
            ("--hold-ms", Some(v)) => hold = Duration::from_millis(v),
            ("--wait-ms", Some(v)) => wait = Duration::from_millis(v),
            _ => {
                eprintln!("usage: {CLIENT_TOOL} [--uid N] [--hold-ms MS] [--wait-ms MS]");
                return 2;
            }
        }
    }
    let Ok(mut stream) = UnixStream::connect(pipe_dir().join(SOCKET)) else {
        println!("no MPS daemon: running without MPS");
        return 0;
    };
    let hello = format!("{CLIENT_HELLO} {} {uid}\n", std::process::id());
    if stream.write_all(hello.as_bytes()).is_err() {
        println!("no MPS daemon: running without MPS");
        return 0;
    }
    let _ = stream.set_read_timeout(Some(wait));
    let started = Instant::now();
    let mut line = String::new();
    let Ok(read) = stream.try_clone() else {
        return 1;
    };
    let mut reader = BufReader::new(read);
    if reader.read_line(&mut line).unwrap_or(0) == 0 {
        if started.elapsed() >= wait {
            println!("still waiting for an MPS server after {wait:?}");
            return 3;
        }
        println!("the MPS control daemon closed the connection");
        return 1;
    }
    if let Some(error) = line.trim().strip_prefix("ERROR ") {
        println!("MPS client refused: {error}");
        return 1;
    }
    let mut words = line.split_whitespace().skip(1);
    let (Some(spid), Some(pct)) = (words.next(), words.next()) else {
        println!(
            "unexpected answer from the MPS control daemon: {}",
            line.trim()
        );
        return 1;
    };
    let limits = words.next().unwrap_or("none");
    // A client's own CUDA_MPS_ACTIVE_THREAD_PERCENTAGE and CUDA_MPS_PINNED_DEVICE_MEM_LIMIT
    // can lower what the server gives it, never raise it (NVIDIA MPS docs, "Environment
    // Variables").
    let (pct, limits) = match client_limits(pct, limits) {
        Ok(v) => v,
        Err(error) => {
            println!("MPS client refused: {error}");
            return 1;
        }
    };
    // The server's shared memory must be visible where this client looks for it.
    let suffix = format!(".{spid}");
    let shares_shm = std::fs::read_dir(shm_dir()).is_ok_and(|mut d| {
        d.any(|e| {
            e.is_ok_and(|e| {
                e.file_name()
                    .to_str()
                    .is_some_and(|n| n.starts_with("mps.shm.") && n.ends_with(&suffix))
            })
        })
    });
    if !shares_shm {
        println!(
            "MPS server {spid}: its shared memory is not in {} (the client does not share the daemon's /dev/shm)",
            shm_dir().display()
        );
        return 1;
    }
    println!(
        "served by MPS server {spid} (active thread percentage {pct}, pinned memory limits {limits})"
    );
    std::thread::sleep(hold);
    0
}
