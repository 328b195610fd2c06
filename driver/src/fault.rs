//! Fault injection for crash-consistency tests: named points on every step of prepare,
//! unprepare, recreation and the durable file writes.
//!
//! A point does nothing unless the process was started with one of these variables (read
//! once, at the first point; afterwards a point costs one `OnceLock` load):
//!
//! - `CLEAVE_FAULT_KILL_AT=<point>[#<n>]`: the `n`-th time (default 1) `<point>` is reached,
//!   the process sends itself `SIGKILL`: a real crash, no destructor, no flush, no unwinding.
//! - `CLEAVE_FAULT_LIST=<file>`: every point reached appends its name and a newline to
//!   `<file>`, so a harness discovers the points (and how often each is hit) by running the
//!   call once, instead of hard-coding them.
//! - `CLEAVE_FAULT_ERROR_AT=<point>[#<n>]=<errno>` (`ENOSPC`, `EROFS`, `EIO`, `EACCES`,
//!   `EDQUOT` or a number): [`io_point`] at `<point>` fails with that OS error from its `n`-th
//!   hit on (default: every hit), to test disk full or a read-only file system where the
//!   test cannot make one.
//!
//! Production never sets these variables; the kubelet plugin does not document them.

#![allow(unsafe_code)]

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

/// Variable naming the point (and hit) at which the process kills itself.
pub const KILL_AT_ENV: &str = "CLEAVE_FAULT_KILL_AT";
/// Variable naming the file that collects the names of the points reached.
pub const LIST_ENV: &str = "CLEAVE_FAULT_LIST";
/// Variable naming the point at which [`io_point`] fails, and with which error.
pub const ERROR_AT_ENV: &str = "CLEAVE_FAULT_ERROR_AT";

struct Config {
    kill_at: Option<(String, u64)>,
    list: Option<PathBuf>,
    error_at: Option<((String, u64), i32)>,
    hits: Mutex<BTreeMap<&'static str, u64>>,
}

static CONFIG: OnceLock<Option<Config>> = OnceLock::new();

fn config() -> Option<&'static Config> {
    CONFIG
        .get_or_init(|| {
            let kill_at = std::env::var(KILL_AT_ENV)
                .ok()
                .filter(|v| !v.is_empty())
                .map(|v| parse_kill_at(&v));
            let list = std::env::var_os(LIST_ENV)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from);
            let error_at = std::env::var(ERROR_AT_ENV)
                .ok()
                .and_then(|v| parse_error_at(&v));
            if kill_at.is_none() && list.is_none() && error_at.is_none() {
                return None;
            }
            Some(Config {
                kill_at,
                list,
                error_at,
                hits: Mutex::new(BTreeMap::new()),
            })
        })
        .as_ref()
}

/// Parses `<point>[#<n>]` (a missing or bad `n` is 1).
pub(crate) fn parse_kill_at(value: &str) -> (String, u64) {
    match value.rsplit_once('#') {
        Some((name, n)) => (name.to_owned(), n.parse().unwrap_or(1).max(1)),
        None => (value.to_owned(), 1),
    }
}

/// Parses `<point>[#<n>]=<errno name or number>`.
pub(crate) fn parse_error_at(value: &str) -> Option<((String, u64), i32)> {
    let (name, errno) = value.rsplit_once('=')?;
    let code = match errno {
        "ENOSPC" => libc::ENOSPC,
        "EROFS" => libc::EROFS,
        "EIO" => libc::EIO,
        "EACCES" => libc::EACCES,
        "EDQUOT" => libc::EDQUOT,
        other => other.parse().ok()?,
    };
    Some((parse_kill_at(name), code))
}

/// A named step was reached: lists it and kills the process if it is the chosen one.
pub fn point(name: &'static str) {
    hit(name);
}

/// Counts, lists and maybe kills; returns how often `name` was reached (0: injection off).
fn hit(name: &'static str) -> u64 {
    let Some(config) = config() else { return 0 };
    let hit = {
        let mut hits = config.hits.lock().unwrap_or_else(|p| p.into_inner());
        let n = hits.entry(name).or_insert(0);
        *n += 1;
        *n
    };
    if let Some(path) = &config.list {
        // Best effort: a failed append only makes the harness see fewer points.
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            let _ = writeln!(f, "{name}");
        }
    }
    if let Some((kill, n)) = &config.kill_at
        && kill == name
        && *n == hit
    {
        // SAFETY: getpid and kill have no memory-safety preconditions; SIGKILL ends the
        // process at once, which is the point.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
    }
    hit
}

/// Like [`point`], and fails with the injected OS error when `CLEAVE_FAULT_ERROR_AT` names
/// this point.
pub(crate) fn io_point(name: &'static str) -> std::io::Result<()> {
    let n = hit(name);
    match config().and_then(|c| c.error_at.as_ref()) {
        Some(((at, from), code)) if at == name && n >= *from => {
            Err(std::io::Error::from_raw_os_error(*code))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_settings() {
        assert_eq!(parse_kill_at("a.b"), ("a.b".into(), 1));
        assert_eq!(parse_kill_at("a.b#3"), ("a.b".into(), 3));
        assert_eq!(parse_kill_at("a.b#x"), ("a.b".into(), 1));
        assert_eq!(
            parse_error_at("cdi.write=ENOSPC"),
            Some((("cdi.write".into(), 1), libc::ENOSPC))
        );
        assert_eq!(
            parse_error_at("checkpoint.write#3=EROFS"),
            Some((("checkpoint.write".into(), 3), libc::EROFS))
        );
        assert_eq!(parse_error_at("x=5"), Some((("x".into(), 1), 5)));
        assert_eq!(parse_error_at("x=EWHAT"), None);
        assert_eq!(parse_error_at("x"), None);
    }

    #[test]
    fn points_are_inert_without_settings() {
        // The test process does not set the variables.
        point("test.nothing");
        assert!(io_point("test.nothing").is_ok());
    }
}
