//! Fake `nvidia-smi`: the calls cleave makes for sharing.
//!
//! - `-i <id> -c <mode>` (also `--id=<id>`, `--compute-mode=<mode>`): mode `DEFAULT`/`0`,
//!   `PROHIBITED`/`2`, `EXCLUSIVE_PROCESS`/`3`; refused for `MIG-` ids.
//! - `compute-policy -i <id> --set-timeslice=<0..3>` (or `--set-timeslice <n>`); refused for
//!   `MIG-` ids, as on real hardware.
//! - `-L`: lists the GPUs named in `FAKE_NVIDIA_SMI_GPUS` (comma-separated UUIDs).
//!
//! Every invocation appends its arguments (space-separated, one line) to the file named by
//! `FAKE_NVIDIA_SMI_RECORD`. The resulting settings are kept in the file named by
//! `FAKE_NVIDIA_SMI_STATE` (lines `<id> computeMode <MODE>` / `<id> timeslice <n>`, last
//! setting per id and key), so tests can check what a GPU is left with.
//! `FAKE_NVIDIA_SMI_FAIL=1` makes every call fail; any other value makes the calls whose
//! argument line contains that text fail (exit 3, an error on stderr).

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
/// GPUs listed by `-L`.
pub const ENV_GPUS: &str = "FAKE_NVIDIA_SMI_GPUS";

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
        return 3;
    }
    match parse(&rest) {
        Ok(Call::List) => {
            let gpus = std::env::var(ENV_GPUS).unwrap_or_default();
            for (i, uuid) in gpus.split(',').filter(|s| !s.is_empty()).enumerate() {
                println!("GPU {i}: Fake GPU (UUID: {uuid})");
            }
            0
        }
        Ok(Call::ComputeMode { id, mode }) => {
            if id.starts_with("MIG-") {
                eprintln!("Setting compute mode is not supported for MIG device {id}");
                return 3;
            }
            set_state(id, "computeMode", mode);
            println!("Set compute mode to {mode} for GPU {id}.");
            println!("All done.");
            0
        }
        Ok(Call::Timeslice { id, value }) => {
            if id.starts_with("MIG-") {
                eprintln!("Not supported for MIG device {id}");
                return 3;
            }
            set_state(id, "timeslice", &value.to_string());
            println!("Set timeslice to {value} for GPU {id}.");
            0
        }
        Err(message) => {
            eprintln!("{TOOL} (fake): {message}");
            2
        }
    }
}

enum Call<'a> {
    List,
    ComputeMode { id: &'a str, mode: &'static str },
    Timeslice { id: &'a str, value: u8 },
}

fn parse<'a>(args: &[&'a str]) -> Result<Call<'a>, String> {
    let mut id = None;
    let mut mode = None;
    let mut timeslice = None;
    let mut policy = false;
    let mut list = false;
    let mut i = 0;
    while i < args.len() {
        let arg = args[i];
        let first = i == 0;
        let mut value = |name: &str| -> Result<&'a str, String> {
            if let Some(v) = arg.strip_prefix(&format!("{name}=")) {
                return Ok(v);
            }
            i += 1;
            args.get(i).copied().ok_or(format!("{name} needs a value"))
        };
        match arg {
            "compute-policy" if first => policy = true,
            "-L" | "--list-gpus" => list = true,
            a if a == "-i" || a.starts_with("--id") => id = Some(value("--id")?),
            a if a == "-c" || a.starts_with("--compute-mode") => {
                mode = Some(value("--compute-mode")?);
            }
            a if a.starts_with("--set-timeslice") => {
                timeslice = Some(value("--set-timeslice")?);
            }
            other => return Err(format!("unsupported argument {other:?}")),
        }
        i += 1;
    }
    if list {
        return Ok(Call::List);
    }
    let id = id.ok_or("no device given (-i)")?;
    if policy {
        let value = timeslice
            .and_then(|t| t.parse::<u8>().ok())
            .filter(|t| *t <= 3)
            .ok_or("--set-timeslice needs 0, 1, 2 or 3")?;
        return Ok(Call::Timeslice { id, value });
    }
    let mode = match mode.ok_or("nothing to do")? {
        "DEFAULT" | "0" => "DEFAULT",
        "PROHIBITED" | "2" => "PROHIBITED",
        "EXCLUSIVE_PROCESS" | "3" => "EXCLUSIVE_PROCESS",
        other => return Err(format!("invalid compute mode {other:?}")),
    };
    Ok(Call::ComputeMode { id, mode })
}

fn set_state(id: &str, key: &str, value: &str) {
    let Some(path) = std::env::var_os(ENV_STATE) else {
        return;
    };
    let mut state = read_state(Path::new(&path));
    state.insert((id.to_owned(), key.to_owned()), value.to_owned());
    let text: String = state
        .iter()
        .map(|((id, key), value)| format!("{id} {key} {value}\n"))
        .collect();
    let _ = std::fs::write(&path, text);
}

/// Reads a state file written by the fake: `(id, key) -> value`.
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
