//! Fake `nvidia-smi`: the calls cleave makes for sharing, with the messages and exit codes
//! of the real tool (strings of the 550 `nvidia-smi` binary, its man page's RETURN VALUE
//! table, and NVIDIA's DRA driver's issues #41 and #222; see docs/hardware-check.md for how
//! to compare this fake with a real GPU).
//!
//! - `[-i <ids>] -c <mode>` (also `--id=<ids>`, `--compute-mode=<mode>`): mode `0`/`DEFAULT`,
//!   `1`/`EXCLUSIVE_THREAD` (refused as deprecated), `2`/`PROHIBITED`,
//!   `3`/`EXCLUSIVE_PROCESS`. Without `-i` every GPU changes. Per GPU it prints `Set compute
//!   mode to <MODE> for GPU <bus id>.` or `Compute mode is already set to <MODE> for GPU <bus
//!   id>.`, then `All done.`. A MIG-enabled GPU (or a `MIG-` id) is refused with `Setting
//!   compute mode to <MODE> is not supported on a MIG-enabled device.` and exit 3.
//! - `compute-policy [-i <ids>] --set-timeslice <0..3>`: the value must be a separate
//!   argument (`--set-timeslice 3`, the form NVIDIA's DRA driver uses on hardware; whether
//!   the real tool takes `--set-timeslice=3` is unverified, so the fake refuses it). Success:
//!   `Successfully set timeslice policy with value <Name> for GPU <index>`. A GPU marked
//!   `no-timeslice` (like a Tesla P4) prints `Failed to set timeslice policy with value
//!   <Name> for GPU <index> : Not Supported` and `Failed to set timeslice for requested
//!   devices : Not Supported` and exits 3. `compute-policy -l` lists the slices
//!   (`GPU compute policies:` header; the row layout is unverified), `-h` the help text of
//!   NVIDIA/k8s-device-plugin issue #354. Only one compute-policy command per call.
//! - `-L`: `GPU <index>: Fake GPU (UUID: <uuid>)` per GPU.
//!
//! Exit codes (man page): 0 success, 2 bad argument, 3 not supported on the target device,
//! 4 no permission, 6 not found. Error texts the facts do not give (a bad argument, an
//! unknown id, no permission) are this fake's own and say `(fake)`.
//!
//! Environment:
//! - `FAKE_NVIDIA_SMI_GPUS`: the GPUs, comma-separated `<uuid>[:<flag>]...`, index = position,
//!   PCI bus ID `00000000:<index+1 as 2 hex digits>:00.0`. Flags: `mig` (MIG mode on),
//!   `no-timeslice` (compute-policy not supported), `no-compute-mode` (`Compute mode is not
//!   supported for GPU <bus id>.`, exit 3). Unset: every `-i` id is taken as a GPU of index 0
//!   without flags (a `MIG-` id as MIG-enabled), and a call without `-i` changes nothing.
//! - `FAKE_NVIDIA_SMI_NOT_ROOT=1`: setting calls fail with exit 4 (the real tool needs root).
//! - `FAKE_NVIDIA_SMI_RECORD`: file receiving the arguments of every call, one line each.
//! - `FAKE_NVIDIA_SMI_STATE`: file keeping the settings, lines `<uuid> computeMode <MODE>` and
//!   `<uuid> timeslice <n>`, last setting per id and key. Compute modes do not survive a
//!   reboot on hardware (time slices are assumed not to either): with
//!   `FAKE_NVIDIA_SMI_BOOT_ID_FILE` naming a boot-ID file, the state file records the boot
//!   it was written in, and a state of another boot reads as empty (every GPU back to
//!   `DEFAULT`), see [`read_state_in_boot`].
//! - `FAKE_NVIDIA_SMI_FAIL=1` makes every call fail; any other value makes the calls whose
//!   argument line contains that text fail (exit 3, `Unknown Error` on stderr).

use std::collections::BTreeMap;
use std::path::Path;

use crate::append_line;

/// Tool name (`argv[0]` file name).
pub const TOOL: &str = "nvidia-smi";
/// File receiving one line per invocation.
pub const ENV_RECORD: &str = "FAKE_NVIDIA_SMI_RECORD";
/// File holding the current settings.
pub const ENV_STATE: &str = "FAKE_NVIDIA_SMI_STATE";
/// `1`: fail every call; other text: fail calls whose arguments contain it.
pub const ENV_FAIL: &str = "FAKE_NVIDIA_SMI_FAIL";
/// The GPUs and their flags.
pub const ENV_GPUS: &str = "FAKE_NVIDIA_SMI_GPUS";
/// File with the current boot ID: settings of another boot are gone.
pub const ENV_BOOT_ID_FILE: &str = "FAKE_NVIDIA_SMI_BOOT_ID_FILE";
/// `1`: the caller is not root.
pub const ENV_NOT_ROOT: &str = "FAKE_NVIDIA_SMI_NOT_ROOT";

/// Exit code: bad argument.
pub const EXIT_BAD_ARGUMENT: i32 = 2;
/// Exit code: operation not available on the target device.
pub const EXIT_NOT_SUPPORTED: i32 = 3;
/// Exit code: no permission.
pub const EXIT_NO_PERMISSION: i32 = 4;
/// Exit code: device not found.
pub const EXIT_NOT_FOUND: i32 = 6;

/// Help of `nvidia-smi compute-policy -h`, as quoted in NVIDIA/k8s-device-plugin#354.
pub const COMPUTE_POLICY_HELP: &str = "\
    compute-policy -- Control and list compute policies.

    Usage: nvidia-smi compute-policy [options]

    Options include:
    [-i | --id]: GPU device ID's. Provide comma
                 separated values for more than one device
    [-l | --list]: List all compute policies
    [    --set-timeslice]: Set timeslice config for a GPU:
                           0=DEFAULT, 1=SHORT, 2=MEDIUM, 3=LONG
    [-h | --help]: Display help information";

const TIMESLICE_NAMES: [&str; 4] = ["Default", "Short", "Medium", "Long"];

/// One GPU the fake knows.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Gpu {
    index: usize,
    uuid: String,
    mig: bool,
    no_timeslice: bool,
    no_compute_mode: bool,
}

impl Gpu {
    fn bus_id(&self) -> String {
        format!("00000000:{:02X}:00.0", self.index + 1)
    }
}

fn configured_gpus() -> Option<Vec<Gpu>> {
    let text = std::env::var(ENV_GPUS).ok()?;
    Some(
        text.split(',')
            .filter(|s| !s.is_empty())
            .enumerate()
            .map(|(index, entry)| {
                let mut parts = entry.split(':');
                let uuid = parts.next().unwrap_or_default().to_owned();
                let flags: Vec<&str> = parts.collect();
                Gpu {
                    index,
                    mig: flags.contains(&"mig"),
                    no_timeslice: flags.contains(&"no-timeslice"),
                    no_compute_mode: flags.contains(&"no-compute-mode"),
                    uuid,
                }
            })
            .collect(),
    )
}

/// The GPUs `ids` names (all of them without `ids`); `Err(id)` for an id not found.
fn select(ids: Option<&str>) -> Result<Vec<Gpu>, String> {
    let configured = configured_gpus();
    let Some(ids) = ids else {
        return Ok(configured.unwrap_or_default());
    };
    let mut out = Vec::new();
    for id in ids.split(',').filter(|s| !s.is_empty()) {
        let gpu = match &configured {
            Some(gpus) => gpus
                .iter()
                .find(|g| {
                    g.uuid.eq_ignore_ascii_case(id)
                        || g.index.to_string() == id
                        || g.bus_id().eq_ignore_ascii_case(id)
                })
                .cloned()
                .ok_or_else(|| id.to_owned())?,
            None => Gpu {
                index: 0,
                uuid: id.to_owned(),
                mig: id.starts_with("MIG-"),
                no_timeslice: false,
                no_compute_mode: false,
            },
        };
        out.push(gpu);
    }
    Ok(out)
}

/// Runs the fake with `args` (`args[0]` is the program name) and returns the exit code.
pub fn run(args: &[String]) -> i32 {
    let rest: Vec<&str> = args.iter().skip(1).map(String::as_str).collect();
    let line = rest.join(" ");
    if let Some(path) = std::env::var_os(ENV_RECORD) {
        append_line(Path::new(&path), &line);
    }
    if let Ok(fail) = std::env::var(ENV_FAIL)
        && !fail.is_empty()
        && (fail == "1" || line.contains(&fail))
    {
        eprintln!("Unable to run {TOOL} {line}: Unknown Error (fake failure)");
        return EXIT_NOT_SUPPORTED;
    }
    let call = match parse(&rest) {
        Ok(c) => c,
        Err(message) => {
            println!("{message}");
            println!("Please run '{TOOL} -h' for help. (fake)");
            return EXIT_BAD_ARGUMENT;
        }
    };
    let setting = matches!(call, Call::ComputeMode { .. } | Call::Timeslice { .. });
    if setting && std::env::var(ENV_NOT_ROOT).is_ok_and(|v| v == "1") {
        println!("Insufficient Permissions (fake: this call needs root)");
        return EXIT_NO_PERMISSION;
    }
    let ids = match &call {
        Call::List { ids }
        | Call::PolicyList { ids }
        | Call::ComputeMode { ids, .. }
        | Call::Timeslice { ids, .. } => *ids,
        Call::PolicyHelp => None,
    };
    let gpus = match select(ids) {
        Ok(g) => g,
        Err(id) => {
            println!("No devices were found matching {id} (fake)");
            return EXIT_NOT_FOUND;
        }
    };
    match call {
        Call::PolicyHelp => {
            println!("{COMPUTE_POLICY_HELP}");
            0
        }
        Call::List { .. } => {
            for g in &gpus {
                println!("GPU {}: Fake GPU (UUID: {})", g.index, g.uuid);
            }
            0
        }
        Call::PolicyList { .. } => {
            let state = read_env_state();
            println!("GPU compute policies:");
            println!("GPU  Name       Value");
            for g in &gpus {
                let value = state
                    .get(&(g.uuid.clone(), "timeslice".to_owned()))
                    .and_then(|v| v.parse::<usize>().ok())
                    .and_then(|v| TIMESLICE_NAMES.get(v))
                    .unwrap_or(&"Default");
                println!("{:<4} Timeslice  {value}", g.index);
            }
            0
        }
        Call::ComputeMode { mode, .. } => set_compute_modes(&gpus, mode),
        Call::Timeslice { value, .. } => set_timeslices(&gpus, value),
    }
}

fn set_compute_modes(gpus: &[Gpu], mode: &str) -> i32 {
    let state = read_env_state();
    let mut code = 0;
    for g in gpus {
        if g.mig {
            println!("Setting compute mode to {mode} is not supported on a MIG-enabled device.");
            code = EXIT_NOT_SUPPORTED;
            continue;
        }
        if g.no_compute_mode {
            println!("Compute mode is not supported for GPU {}.", g.bus_id());
            code = EXIT_NOT_SUPPORTED;
            continue;
        }
        let current = state
            .get(&(g.uuid.clone(), "computeMode".to_owned()))
            .map_or("DEFAULT", String::as_str);
        if current == mode {
            println!(
                "Compute mode is already set to {mode} for GPU {}.",
                g.bus_id()
            );
        } else {
            set_state(&g.uuid, "computeMode", mode);
            println!("Set compute mode to {mode} for GPU {}.", g.bus_id());
        }
    }
    if code == 0 {
        println!("All done.");
    }
    code
}

fn set_timeslices(gpus: &[Gpu], value: u8) -> i32 {
    let name = TIMESLICE_NAMES[usize::from(value)];
    let mut failed = false;
    for g in gpus {
        if g.no_timeslice || g.mig {
            println!(
                "Failed to set timeslice policy with value {name} for GPU {} : Not Supported",
                g.index
            );
            failed = true;
            continue;
        }
        set_state(&g.uuid, "timeslice", &value.to_string());
        println!(
            "Successfully set timeslice policy with value {name} for GPU {}",
            g.index
        );
    }
    if failed {
        println!("Failed to set timeslice for requested devices : Not Supported");
        return EXIT_NOT_SUPPORTED;
    }
    0
}

enum Call<'a> {
    List {
        ids: Option<&'a str>,
    },
    PolicyHelp,
    PolicyList {
        ids: Option<&'a str>,
    },
    ComputeMode {
        ids: Option<&'a str>,
        mode: &'static str,
    },
    Timeslice {
        ids: Option<&'a str>,
        value: u8,
    },
}

fn parse<'a>(args: &[&'a str]) -> Result<Call<'a>, String> {
    let mut id = None;
    let mut mode = None;
    let mut timeslice = None;
    let mut policy = false;
    let mut list = false;
    let mut policy_list = false;
    let mut help = false;
    let mut i = 0;
    while i < args.len() {
        let arg = args[i];
        let first = i == 0;
        let mut value = |name: &str, allow_equals: bool| -> Result<&'a str, String> {
            if let Some(v) = arg.strip_prefix(&format!("{name}=")) {
                return if allow_equals {
                    Ok(v)
                } else {
                    Err(format!(
                        "Invalid combination of input arguments: {arg} (fake: pass the value as a separate argument)"
                    ))
                };
            }
            i += 1;
            args.get(i)
                .copied()
                .ok_or(format!("Option {name} requires a value (fake)"))
        };
        match arg {
            "compute-policy" if first => policy = true,
            "-L" | "--list-gpus" if !policy => list = true,
            "-l" | "--list" if policy => policy_list = true,
            "-h" | "--help" if policy => help = true,
            a if a == "-i" || a.starts_with("--id") => id = Some(value("--id", true)?),
            a if !policy && (a == "-c" || a.starts_with("--compute-mode")) => {
                mode = Some(value("--compute-mode", true)?);
            }
            a if policy && a.starts_with("--set-timeslice") => {
                timeslice = Some(value("--set-timeslice", false)?);
            }
            other => return Err(format!("Invalid argument {other:?} (fake)")),
        }
        i += 1;
    }
    if policy {
        let commands =
            usize::from(help) + usize::from(policy_list) + usize::from(timeslice.is_some());
        if commands > 1 {
            return Err("One, and only one, compute-policy command allowed at a time".into());
        }
        if help {
            return Ok(Call::PolicyHelp);
        }
        if policy_list {
            return Ok(Call::PolicyList { ids: id });
        }
        let value = timeslice
            .ok_or("No compute-policy command given (fake)")?
            .parse::<u8>()
            .ok()
            .filter(|t| *t <= 3)
            .ok_or("Invalid timeslice value: use 0=DEFAULT, 1=SHORT, 2=MEDIUM, 3=LONG (fake)")?;
        return Ok(Call::Timeslice { ids: id, value });
    }
    if list {
        return Ok(Call::List { ids: id });
    }
    let mode = match mode.ok_or("Nothing to do (fake: only -L, -c and compute-policy)")? {
        "DEFAULT" | "0" => "DEFAULT",
        "EXCLUSIVE_THREAD" | "1" => {
            return Err(
                "Exclusive_Thread was deprecated! Use value 3:Exclusive_Process instead.".into(),
            );
        }
        "PROHIBITED" | "2" => "PROHIBITED",
        "EXCLUSIVE_PROCESS" | "3" => "EXCLUSIVE_PROCESS",
        other => return Err(format!("Invalid compute mode {other:?} (fake)")),
    };
    Ok(Call::ComputeMode { ids: id, mode })
}

fn boot_id_file() -> Option<std::path::PathBuf> {
    std::env::var_os(ENV_BOOT_ID_FILE).map(std::path::PathBuf::from)
}

fn read_env_state() -> BTreeMap<(String, String), String> {
    std::env::var_os(ENV_STATE)
        .map(|p| read_state_in_boot(Path::new(&p), boot_id_file().as_deref()))
        .unwrap_or_default()
}

fn set_state(id: &str, key: &str, value: &str) {
    let Some(path) = std::env::var_os(ENV_STATE) else {
        return;
    };
    let boot_file = boot_id_file();
    let mut state = read_state_in_boot(Path::new(&path), boot_file.as_deref());
    state.insert((id.to_owned(), key.to_owned()), value.to_owned());
    let mut text = String::new();
    if let Some(boot) = boot_file.as_deref().and_then(current_boot) {
        text.push_str(&format!("boot {boot}\n"));
    }
    for ((id, key), value) in &state {
        text.push_str(&format!("{id} {key} {value}\n"));
    }
    let _ = std::fs::write(&path, text);
}

fn current_boot(boot_id_file: &Path) -> Option<String> {
    std::fs::read_to_string(boot_id_file)
        .ok()
        .map(|s| s.trim().to_owned())
}

/// Reads a state file written by the fake: `(id, key) -> value`, whatever boot wrote it.
pub fn read_state(path: &Path) -> BTreeMap<(String, String), String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut parts = l.split_whitespace();
            Some((
                (parts.next()?.to_owned(), parts.next()?.to_owned()),
                parts.next()?.to_owned(),
            ))
        })
        .collect()
}

/// The settings as the GPUs have them now: empty when the state was written in another
/// boot than the one `boot_id_file` names (compute modes reset on reboot).
pub fn read_state_in_boot(
    path: &Path,
    boot_id_file: Option<&Path>,
) -> BTreeMap<(String, String), String> {
    if let Some(now) = boot_id_file.and_then(current_boot) {
        let written = std::fs::read_to_string(path).ok().and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("boot ").map(|b| b.trim().to_owned()))
        });
        if written.is_some_and(|w| w != now) {
            return BTreeMap::new();
        }
    }
    read_state(path)
}
