//! The fake tools as built binaries: the MPS control protocol (daemon start and its files,
//! commands with the real messages, quit, refusal of a second daemon, a missing daemon,
//! servers per UID with queueing and the fake client, failure knobs) and nvidia-smi's
//! messages, exit codes, records and state.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const MPS: &str = env!("CARGO_BIN_EXE_nvidia-cuda-mps-control");
const SMI: &str = env!("CARGO_BIN_EXE_nvidia-smi");
const CLIENT: &str = env!("CARGO_BIN_EXE_fake-mps-client");

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

/// Starts a daemon on `pipe` with `env`; returns its PID once `-d` returned.
fn start(pipe: &Path, env: &[(&str, &str)], multi_user: bool) -> u32 {
    let mut cmd = Command::new(MPS);
    cmd.arg("-d");
    if multi_user {
        cmd.arg("-M");
    }
    let status = cmd
        .env("CUDA_MPS_PIPE_DIRECTORY", pipe)
        .env("FAKE_MPS_IDLE_EXIT_SECS", "60")
        .envs(env.iter().copied())
        .status()
        .unwrap();
    assert!(status.success());
    // `-d` returns once the daemon serves its socket: no waiting here.
    std::fs::read_to_string(pipe.join("nvidia-cuda-mps-control.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A temp dir whose parents every UID can traverse, with `pipe/`, `log/` and `shm/`.
fn dirs() -> (
    tempfile::TempDir,
    std::path::PathBuf,
    std::path::PathBuf,
    std::path::PathBuf,
) {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    let [pipe, log, shm] = ["pipe", "log", "shm"].map(|d| {
        let p = tmp.path().join(d);
        std::fs::create_dir(&p).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o777)).unwrap();
        p
    });
    (tmp, pipe, log, shm)
}

#[test]
fn mps_daemon_serves_commands_until_quit() {
    let (tmp, pipe, log, _shm) = dirs();
    let record = tmp.path().join("record.log");

    // No daemon yet: the UI says so, like the real tool, and fails.
    let out = control(&pipe, "get_default_active_thread_percentage\n");
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(stdout(&out), "Cannot find MPS control daemon process\n");

    let record_s = record.to_str().unwrap();
    let log_s = log.to_str().unwrap();
    let pid = start(
        &pipe,
        &[
            ("CUDA_VISIBLE_DEVICES", "GPU-a,MIG-b"),
            ("FAKE_MPS_RECORD", record_s),
            ("CUDA_MPS_LOG_DIRECTORY", log_s),
        ],
        false,
    );
    let _reap = Reap(Some(pid));
    assert!(alive(pid));
    // The files of the real daemon's pipe directory.
    use std::os::unix::fs::FileTypeExt;
    for socket in ["control", "control_privileged"] {
        assert!(
            std::fs::metadata(pipe.join(socket))
                .unwrap()
                .file_type()
                .is_socket()
        );
    }
    assert!(
        std::fs::metadata(pipe.join("log"))
            .unwrap()
            .file_type()
            .is_fifo()
    );
    assert!(pipe.join("control_lock").is_file());
    // The start-up lines in the real log format.
    let control_log = std::fs::read_to_string(log.join("control.log")).unwrap();
    let lines: Vec<&str> = control_log.lines().collect();
    let prefix = format!(" Control {pid:>5}] ");
    assert!(
        lines[0].starts_with("[20") && lines[0].contains(&prefix),
        "{lines:?}"
    );
    assert_eq!(lines[0].find(" Control"), Some(24), "{lines:?}");
    assert!(lines[0].ends_with(&format!(
        "Starting control daemon using socket {}/control",
        pipe.display()
    )));
    assert!(lines[1].ends_with(&format!(
        "To connect CUDA applications to this daemon, set env CUDA_MPS_PIPE_DIRECTORY={}",
        pipe.display()
    )));

    // Rejected commands answer on stdout and the exit status stays 0; device keys are
    // literal strings, never validated.
    let out = control(
        &pipe,
        "get_default_active_thread_percentage\n\
         set_default_active_thread_percentage 30\n\
         set_default_active_thread_percentage 0\n\
         set_default_active_thread_percentage 100.5\n\
         set_default_device_pinned_mem_limit 1 1536M\n\
         set_default_device_pinned_mem_limit 7 2G\n\
         set_default_device_pinned_mem_limit 0 5GB\n\
         set_default_device_pinned_mem_limit 0 1.5G\n\
         get_default_device_pinned_mem_limit MIG-b\n\
         get_default_device_pinned_mem_limit 1\n\
         get_default_device_pinned_mem_limit 7\n\
         get_default_active_thread_percentage\n\
         get_server_list\n\
         frobnicate now\n",
    );
    assert!(out.status.success());
    assert_eq!(
        stdout(&out),
        "100.0\n\
         Invalid percentage, expected between (0.0, 100.0]\n\
         Invalid percentage, expected between (0.0, 100.0]\n\
         Invalid pinned memory limit (fake: expected <n>G or <n>M)\n\
         Invalid pinned memory limit (fake: expected <n>G or <n>M)\n\
         No default pinned memory limit set for the device!\n\
         1536M\n\
         2G\n\
         30.0\n\
         Unknown command \"frobnicate now\"\n"
    );

    // A second daemon on the same pipe directory is refused.
    let second = Command::new(MPS)
        .arg("-d")
        .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
        .output()
        .unwrap();
    assert_eq!(second.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&second.stderr)
            .contains("An instance of this daemon is already running")
    );

    // Another pipe directory: an independent daemon with its own state.
    let other = tmp.path().join("other");
    std::fs::create_dir(&other).unwrap();
    let other_pid = start(&other, &[("FAKE_MPS_RECORD", record_s)], false);
    let _reap_other = Reap(Some(other_pid));
    assert_ne!(other_pid, pid);
    let out = control(&other, "get_default_active_thread_percentage\nquit\n");
    assert_eq!(stdout(&out), "100.0\n");
    assert!(wait_for(|| !alive(other_pid)));

    // quit is synchronous: when the UI returns, the daemon's files are gone.
    let out = control(&pipe, "quit\n");
    assert!(out.status.success());
    assert!(!pipe.join("nvidia-cuda-mps-control.pid").exists() && !pipe.join("control").exists());
    assert!(wait_for(|| !alive(pid)), "daemon exits on quit");
    // The set values are gone with it: a new daemon starts from the defaults.
    let pid = start(&pipe, &[("FAKE_MPS_RECORD", record_s)], false);
    let _reap_new = Reap(Some(pid));
    let out = control(
        &pipe,
        "get_default_active_thread_percentage\nget_default_device_pinned_mem_limit 1\nquit\n",
    );
    assert_eq!(
        stdout(&out),
        "100.0\nNo default pinned memory limit set for the device!\n"
    );

    let lines = std::fs::read_to_string(&record).unwrap();
    assert!(lines.starts_with(&format!(
        "start pid={pid_first} pipe={} devices=GPU-a,MIG-b\n",
        pipe.display(),
        pid_first = _reap.0.unwrap()
    )));
    assert!(lines.contains("set_default_active_thread_percentage 30\n"));
    assert!(lines.contains(&format!("exit pid={} reason=quit\n", _reap.0.unwrap())));
}

/// A fake CUDA client on `pipe` (shared memory in `shm`) as `uid`.
fn client(pipe: &Path, shm: &Path, uid: u32, extra: &[&str]) -> Command {
    let mut cmd = Command::new(CLIENT);
    cmd.env("CUDA_MPS_PIPE_DIRECTORY", pipe)
        .env("FAKE_MPS_SHM_DIR", shm)
        .args(["--uid", &uid.to_string()])
        .args(extra)
        .stdout(Stdio::piped());
    cmd
}

/// Kills a held client on drop.
struct Held(std::process::Child);

impl Drop for Held {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn server_list(pipe: &Path) -> String {
    stdout(&control(pipe, "get_server_list\n"))
}

#[test]
fn mps_servers_are_per_uid_and_take_the_pending_defaults() {
    let (_tmp, pipe, log, shm) = dirs();
    let pid = start(
        &pipe,
        &[
            ("FAKE_MPS_SHM_DIR", shm.to_str().unwrap()),
            ("CUDA_MPS_LOG_DIRECTORY", log.to_str().unwrap()),
        ],
        false,
    );
    let _reap = Reap(Some(pid));
    control(
        &pipe,
        "set_default_active_thread_percentage 30\nset_default_device_pinned_mem_limit 0 1G\n",
    );
    assert_eq!(server_list(&pipe), "", "no server before the first client");

    // The first client (UID 1000) starts a server with the pending defaults; it stays.
    let holder = Held(
        client(&pipe, &shm, 1000, &["--hold-ms", "60000"])
            .spawn()
            .unwrap(),
    );
    assert!(wait_for(|| !server_list(&pipe).is_empty()));
    let first_server = server_list(&pipe).trim().to_owned();
    // New defaults are for the next server only.
    control(&pipe, "set_default_active_thread_percentage 50\n");
    let same_user = client(&pipe, &shm, 1000, &[]).output().unwrap();
    assert!(same_user.status.success());
    assert_eq!(
        stdout(&same_user),
        format!(
            "served by MPS server {first_server} (active thread percentage 30.0, pinned memory limits 0=1G)\n"
        )
    );
    // A client's own limits lower what the server gives it, never raise it.
    let lower = client(&pipe, &shm, 1000, &[])
        .env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "20")
        .env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=512M")
        .output()
        .unwrap();
    assert!(
        stdout(&lower).contains("(active thread percentage 20.0, pinned memory limits 0=512M)"),
        "{}",
        stdout(&lower)
    );
    let higher = client(&pipe, &shm, 1000, &[])
        .env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "80")
        .env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=4G")
        .output()
        .unwrap();
    assert!(
        stdout(&higher).contains("(active thread percentage 30.0, pinned memory limits 0=1G)"),
        "{}",
        stdout(&higher)
    );
    let bad = client(&pipe, &shm, 1000, &[])
        .env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "0")
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(1));
    assert!(
        stdout(&bad).contains("should be between (0.0, 100.0]"),
        "{}",
        stdout(&bad)
    );
    // A client that does not share the daemon's /dev/shm is not served.
    let other_shm = tempfile::tempdir().unwrap();
    let no_shm = client(&pipe, other_shm.path(), 1000, &[]).output().unwrap();
    assert_eq!(no_shm.status.code(), Some(1));
    assert!(stdout(&no_shm).contains("does not share the daemon's /dev/shm"));

    // Another UID waits, with no error, while the first UID's client is attached.
    let waiting = client(&pipe, &shm, 2000, &["--wait-ms", "300"])
        .output()
        .unwrap();
    assert_eq!(waiting.status.code(), Some(3), "{}", stdout(&waiting));
    assert_eq!(server_list(&pipe).trim(), first_server);
    // Once it is gone, the next UID gets a new server, with the new defaults.
    drop(holder);
    let next = client(&pipe, &shm, 2000, &["--wait-ms", "10000"])
        .output()
        .unwrap();
    assert!(next.status.success(), "{}", stdout(&next));
    let second_server = server_list(&pipe).trim().to_owned();
    assert_ne!(second_server, first_server);
    assert!(
        stdout(&next).contains("active thread percentage 50.0"),
        "{}",
        stdout(&next)
    );
    let control_log = std::fs::read_to_string(log.join("control.log")).unwrap();
    for want in [
        "User did not send valid credentials".to_owned(),
        format!("Starting new server {first_server} for user 1000"),
        "from user 2000: Server is not ready, push client to pending list".to_owned(),
        format!("Server {first_server} exited with status 0"),
        format!("Starting new server {second_server} for user 2000"),
    ] {
        assert!(control_log.contains(&want), "{want:?} not in {control_log}");
    }

    // Quit ends the server and its shared memory; a client then runs without MPS.
    control(&pipe, "quit\n");
    assert!(wait_for(|| !alive(pid)));
    assert_eq!(std::fs::read_dir(&shm).unwrap().count(), 0);
    let plain = client(&pipe, &shm, 1000, &[]).output().unwrap();
    assert!(plain.status.success());
    assert_eq!(stdout(&plain), "no MPS daemon: running without MPS\n");
}

#[test]
fn mps_multi_user_mode_serves_every_uid_and_parents_must_be_traversable() {
    let (tmp, pipe, _log, shm) = dirs();
    let shm_s = shm.to_str().unwrap();
    let pid = start(&pipe, &[("FAKE_MPS_SHM_DIR", shm_s)], true);
    let _reap = Reap(Some(pid));
    let _a = Held(
        client(&pipe, &shm, 1000, &["--hold-ms", "60000"])
            .spawn()
            .unwrap(),
    );
    assert!(wait_for(|| !server_list(&pipe).is_empty()));
    let b = client(&pipe, &shm, 2000, &["--wait-ms", "5000"])
        .output()
        .unwrap();
    assert!(b.status.success(), "{}", stdout(&b));
    control(&pipe, "quit\n");
    assert!(wait_for(|| !alive(pid)));

    // A pipe directory below a 0700 directory: a server for UID 1000 cannot start, and the
    // client waits; root's can.
    use std::os::unix::fs::PermissionsExt;
    let closed = tmp.path().join("closed");
    std::fs::create_dir(&closed).unwrap();
    std::fs::set_permissions(&closed, std::fs::Permissions::from_mode(0o700)).unwrap();
    let pipe = closed.join("pipe");
    std::fs::create_dir(&pipe).unwrap();
    let pid = start(&pipe, &[("FAKE_MPS_SHM_DIR", shm_s)], false);
    let _reap = Reap(Some(pid));
    let owner = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(&closed).unwrap());
    let stranger = if owner == 1000 { 1001 } else { 1000 };
    let stuck = client(&pipe, &shm, stranger, &["--wait-ms", "300"])
        .output()
        .unwrap();
    assert_eq!(stuck.status.code(), Some(3), "{}", stdout(&stuck));
    control(&pipe, "quit\n");
    assert!(wait_for(|| !alive(pid)));
}

#[test]
fn mps_server_faults_and_client_limit() {
    let (_tmp, pipe, _log, shm) = dirs();
    let pid = start(
        &pipe,
        &[
            ("FAKE_MPS_SHM_DIR", shm.to_str().unwrap()),
            ("FAKE_MPS_MAX_CLIENTS", "2"),
        ],
        false,
    );
    let _reap = Reap(Some(pid));
    let holder = Held(
        client(&pipe, &shm, 1000, &["--hold-ms", "60000"])
            .spawn()
            .unwrap(),
    );
    assert!(wait_for(|| !server_list(&pipe).is_empty()));
    let server = server_list(&pipe).trim().to_owned();
    let second = Held(
        client(&pipe, &shm, 1000, &["--hold-ms", "60000"])
            .spawn()
            .unwrap(),
    );
    assert!(wait_for(|| stdout(&control(
        &pipe,
        &format!("get_client_list {server}\n")
    ))
    .lines()
    .count()
        == 2));
    // Over the limit: refused.
    let third = client(&pipe, &shm, 1000, &[]).output().unwrap();
    assert_eq!(third.status.code(), Some(1));
    assert!(
        stdout(&third).contains("too many MPS clients (limit 2"),
        "{}",
        stdout(&third)
    );
    // A fatal fault: FAULT, new clients refused until the server's clients are gone.
    drop(second);
    control(&pipe, &format!("fake_fault {server}\n"));
    assert_eq!(
        stdout(&control(&pipe, &format!("get_server_status {server}\n"))),
        "FAULT\n"
    );
    let refused = client(&pipe, &shm, 1000, &[]).output().unwrap();
    assert_eq!(
        stdout(&refused),
        "MPS client refused: CUDA_ERROR_MPS_SERVER_NOT_READY\n"
    );
    drop(holder);
    assert!(wait_for(|| stdout(&control(
        &pipe,
        &format!("get_server_status {server}\n")
    )) == "ACTIVE\n"));
    let served = client(&pipe, &shm, 1000, &[]).output().unwrap();
    assert!(served.status.success(), "{}", stdout(&served));
    assert!(stdout(&served).contains(&format!("served by MPS server {server} ")));
    assert_eq!(
        stdout(&control(
            &pipe,
            "terminate_client 1 2\nget_server_status 77\n"
        )),
        "Invalid process 2!\nServer 77 not found\n"
    );
    control(&pipe, "quit\n");
    assert!(wait_for(|| !alive(pid)));
}

#[test]
fn mps_knobs() {
    let (tmp, pipe, _log, _shm) = dirs();
    let out = Command::new(MPS)
        .arg("-d")
        .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
        .env("FAKE_MPS_FAIL_START", "1")
        .output()
        .unwrap();
    assert!(!out.status.success());
    // A missing pipe directory, in the real tool's words.
    let out = Command::new(MPS)
        .arg("-d")
        .env("CUDA_MPS_PIPE_DIRECTORY", tmp.path().join("missing"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Cannot access CUDA_MPS_PIPE_DIRECTORY=")
    );
    // A release without the multi-user switch.
    let out = Command::new(MPS)
        .args(["-d", "-M"])
        .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
        .env("FAKE_MPS_MULTIUSER", "refuse")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("'-M'"));
    assert!(!pipe.join("control").exists());

    // Echoing sets, floor-GiB read-back, dropped sets.
    let pid = start(
        &pipe,
        &[
            ("FAKE_MPS_SET_ECHO", "1"),
            ("FAKE_MPS_LIMIT_READBACK", "gib-floor"),
        ],
        false,
    );
    let _reap = Reap(Some(pid));
    let out = control(
        &pipe,
        "set_default_device_pinned_mem_limit 0 1536M\nget_default_device_pinned_mem_limit 0\nquit\n",
    );
    let text = stdout(&out);
    assert!(
        text.ends_with("\n1G\n") && text.lines().count() == 2,
        "{text}"
    );
    assert!(wait_for(|| !alive(pid)));
    let pid = start(&pipe, &[("FAKE_MPS_DROP_SETS", "1")], false);
    let _reap = Reap(Some(pid));
    let out = control(
        &pipe,
        "set_default_active_thread_percentage 20\nget_default_active_thread_percentage\nquit\n",
    );
    assert_eq!(stdout(&out), "100.0\n");
    assert!(wait_for(|| !alive(pid)));

    // A daemon nobody talks to exits by itself.
    let record = tmp.path().join("record.log");
    let pid = start(
        &pipe,
        &[
            ("FAKE_MPS_RECORD", record.to_str().unwrap()),
            ("FAKE_MPS_IDLE_EXIT_SECS", "1"),
        ],
        false,
    );
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
            .env(
                "FAKE_NVIDIA_SMI_GPUS",
                "GPU-a,GPU-b,GPU-m:mig,GPU-p:no-timeslice",
            );
        if let Some(f) = fail {
            cmd.env("FAKE_NVIDIA_SMI_FAIL", f);
        }
        cmd.output().unwrap()
    };
    let stdout = |o: &Output| String::from_utf8_lossy(&o.stdout).into_owned();

    // Compute mode: the GPU named by its bus ID, "already set" the second time.
    let set = smi(&["-i", "GPU-a", "-c", "EXCLUSIVE_PROCESS"], None);
    assert!(set.status.success());
    assert_eq!(
        stdout(&set),
        "Set compute mode to EXCLUSIVE_PROCESS for GPU 00000000:01:00.0.\nAll done.\n"
    );
    let again = smi(&["-i", "GPU-a", "-c", "3"], None);
    assert_eq!(
        stdout(&again),
        "Compute mode is already set to EXCLUSIVE_PROCESS for GPU 00000000:01:00.0.\nAll done.\n"
    );
    // MIG-enabled GPU: refused, exit 3.
    let mig = smi(&["-i", "GPU-m", "-c", "EXCLUSIVE_PROCESS"], None);
    assert_eq!(mig.status.code(), Some(3));
    assert_eq!(
        stdout(&mig),
        "Setting compute mode to EXCLUSIVE_PROCESS is not supported on a MIG-enabled device.\n"
    );
    assert_eq!(
        smi(&["-i", "GPU-a", "-c", "1"], None).status.code(),
        Some(2)
    );
    assert_eq!(
        smi(&["-i", "GPU-x", "-c", "0"], None).status.code(),
        Some(6)
    );

    // Time slice: only the separate-argument form, 0..3, names and indexes in the output.
    let ts = smi(
        &["compute-policy", "-i", "GPU-b", "--set-timeslice", "2"],
        None,
    );
    assert!(ts.status.success());
    assert_eq!(
        stdout(&ts),
        "Successfully set timeslice policy with value Medium for GPU 1\n"
    );
    for bad in [
        &["compute-policy", "-i", "GPU-a", "--set-timeslice=2"][..],
        &["compute-policy", "-i", "GPU-a", "--set-timeslice", "7"],
        &["compute-policy", "-l", "--set-timeslice", "1"],
    ] {
        assert_eq!(smi(bad, None).status.code(), Some(2), "{bad:?}");
    }
    let p4 = smi(
        &["compute-policy", "-i", "GPU-p", "--set-timeslice", "0"],
        None,
    );
    assert_eq!(p4.status.code(), Some(3));
    assert_eq!(
        stdout(&p4),
        "Failed to set timeslice policy with value Default for GPU 3 : Not Supported\n\
         Failed to set timeslice for requested devices : Not Supported\n"
    );
    let list = smi(&["compute-policy", "-l", "-i", "GPU-b"], None);
    assert!(stdout(&list).starts_with("GPU compute policies:\n"));
    assert!(stdout(&list).contains("Medium"));
    assert!(stdout(&smi(&["compute-policy", "-h"], None)).contains("0=DEFAULT, 1=SHORT"));

    let failed = smi(&["-i", "GPU-b", "-c", "DEFAULT"], Some("GPU-b"));
    assert!(!failed.status.success());
    assert!(String::from_utf8_lossy(&failed.stderr).contains("Unknown Error"));
    let list = smi(&["-L"], None);
    assert!(
        stdout(&list).starts_with("GPU 0: Fake GPU (UUID: GPU-a)\nGPU 1: Fake GPU (UUID: GPU-b)\n")
    );

    let settings = cleave_fakes::nvidia_smi::read_state(&state);
    let get = |id: &str, key: &str| settings.get(&(id.to_owned(), key.to_owned())).cloned();
    assert_eq!(
        get("GPU-a", "computeMode").as_deref(),
        Some("EXCLUSIVE_PROCESS")
    );
    assert_eq!(get("GPU-b", "timeslice").as_deref(), Some("2"));
    assert_eq!(get("GPU-b", "computeMode"), None);
    assert_eq!(get("GPU-m", "computeMode"), None);
    assert_eq!(get("GPU-p", "timeslice"), None);
    let lines = std::fs::read_to_string(&record).unwrap();
    assert_eq!(lines.lines().count(), 14);
    assert!(lines.starts_with("-i GPU-a -c EXCLUSIVE_PROCESS\n"));

    // Settings do not survive a reboot: with a boot-ID file, another boot starts clean.
    let boot = tmp.path().join("boot_id");
    std::fs::write(&boot, "boot-1\n").unwrap();
    let in_boot = |args: &[&str]| {
        Command::new(SMI)
            .args(args)
            .env("FAKE_NVIDIA_SMI_STATE", &state)
            .env("FAKE_NVIDIA_SMI_GPUS", "GPU-a")
            .env("FAKE_NVIDIA_SMI_BOOT_ID_FILE", &boot)
            .output()
            .unwrap()
    };
    in_boot(&["-i", "GPU-a", "-c", "PROHIBITED"]);
    assert!(
        stdout(&in_boot(&["-i", "GPU-a", "-c", "2"])).starts_with("Compute mode is already set")
    );
    std::fs::write(&boot, "boot-2\n").unwrap();
    assert!(cleave_fakes::nvidia_smi::read_state_in_boot(&state, Some(&boot)).is_empty());
    assert!(
        stdout(&in_boot(&["-i", "GPU-a", "-c", "2"])).starts_with("Set compute mode to PROHIBITED")
    );

    // Without -i every GPU changes (the MIG-enabled one refuses).
    std::fs::remove_file(&state).unwrap();
    smi(&["-i", "GPU-a", "-c", "EXCLUSIVE_PROCESS"], None);
    let all = smi(&["-c", "DEFAULT"], None);
    assert_eq!(all.status.code(), Some(3));
    let settings = cleave_fakes::nvidia_smi::read_state(&state);
    assert_eq!(
        settings
            .get(&("GPU-a".to_owned(), "computeMode".to_owned()))
            .map(String::as_str),
        Some("DEFAULT")
    );
}
