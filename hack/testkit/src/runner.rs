//! The `main` of tests built with `harness = false`: such a binary is also the fake NVIDIA
//! tools (see [`crate::fake_tools`]), so it needs its own entry point. It takes libtest's
//! arguments (name filters, `--list`; other flags are ignored), runs each test caught and
//! timed, and prints libtest's lines, so `cargo test` reads it as usual.

use std::process::ExitCode;
use std::sync::Mutex;
use std::time::Instant;

/// One test: its name and its body (a panic fails it).
pub type Test = (&'static str, fn());

/// First argument of a command line that plays a fake tool:
/// `<test binary> __fake <tool path> <args>...` (what [`crate::fake_tools`]' wrappers run).
pub const FAKE_TOOL_ARG: &str = "__fake";

/// Plays the fake tool this command line asks for and returns its exit code: the tool a
/// wrapper names after [`FAKE_TOOL_ARG`], or the one `argv[0]` names (a symlink to the test
/// binary, or the fake MPS daemon re-running itself under the tool's path). `None` when
/// the command line names no tool.
pub fn play_fake_tool(args: &[String]) -> Option<i32> {
    match args.get(1).map(String::as_str) {
        Some(FAKE_TOOL_ARG) => Some(cleave_fakes::dispatch(&args[2..]).unwrap_or(2)),
        _ => cleave_fakes::dispatch(args),
    }
}

/// What the command line asks: name filters (a test runs when one is part of its name, or
/// when there is none), and whether to list the tests instead of running them.
pub fn parse_args(args: &[String]) -> (Vec<String>, bool) {
    let mut filters = Vec::new();
    let mut list = false;
    let mut rest = args.iter().skip(1);
    while let Some(arg) = rest.next() {
        match arg.as_str() {
            "--list" => list = true,
            "--test-threads" | "--skip" | "--format" | "--color" | "--logfile" | "-Z" => {
                rest.next();
            }
            a if a.starts_with('-') => {}
            a => filters.push(a.to_owned()),
        }
    }
    (filters, list)
}

static SKIPPED: Mutex<Option<String>> = Mutex::new(None);

/// Marks the running test as skipped (it should return right after): for a test whose
/// environment cannot run it (no podman, say), reported as `ignored` rather than passed.
pub fn skip(reason: &str) {
    *SKIPPED.lock().unwrap() = Some(reason.to_owned());
}

/// Whether an outside tool must be there: its `require_env` is set (to anything but `0`), or
/// the run is CI's (`CI` set to anything but `0`/`false`), where `.ci/run` installs it.
pub fn tool_required(require_env: &str) -> bool {
    let set =
        |name: &str| std::env::var(name).is_ok_and(|v| !v.is_empty() && v != "0" && v != "false");
    set(require_env) || set("CI")
}

/// For a test whose outside tool (podman, runc, Prometheus, a schema copy) is missing:
/// fails it where the tool is required ([`tool_required`]), naming the tool and why; else
/// marks it skipped ([`skip`]: reported `ignored`, never `ok`) with a loud message. The
/// test returns right after.
pub fn tool_missing(tool: &str, require_env: &str, why: &str) {
    assert!(
        !tool_required(require_env),
        "{tool} is required here ({require_env} or CI is set) but cannot be used: {why}"
    );
    eprintln!(
        "\n{bar}\nSKIPPED: {tool} cannot be used here: {why}\n(set {require_env}=1 to make this a failure)\n{bar}\n",
        bar = "!".repeat(78)
    );
    skip(&format!("{tool}: {why}"));
}

/// The whole `main`: plays a fake tool when the command line asks for one, else runs
/// `tests` one by one and exits non-zero when one failed.
pub fn main(tests: &[Test]) -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if let Some(code) = play_fake_tool(&args) {
        return ExitCode::from(u8::try_from(code).unwrap_or(1));
    }
    let (filters, list) = parse_args(&args);
    if list {
        for (name, _) in tests {
            println!("{name}: test");
        }
        return ExitCode::SUCCESS;
    }
    let (mut passed, mut failed, mut ignored) = (0, 0, 0);
    for (name, test) in tests {
        if !filters.is_empty() && !filters.iter().any(|f| name.contains(f.as_str())) {
            continue;
        }
        let started = Instant::now();
        *SKIPPED.lock().unwrap() = None;
        let result = std::panic::catch_unwind(test);
        let skipped = SKIPPED.lock().unwrap().take();
        let status = match (&result, skipped) {
            (Err(_), _) => {
                failed += 1;
                "FAILED".to_owned()
            }
            (Ok(()), Some(reason)) => {
                ignored += 1;
                format!("ignored ({reason})")
            }
            (Ok(()), None) => {
                passed += 1;
                "ok".to_owned()
            }
        };
        println!("test {name} ... {status} ({:.2?})", started.elapsed());
    }
    println!(
        "\ntest result: {}. {passed} passed; {failed} failed; {ignored} ignored",
        if failed == 0 { "ok" } else { "FAILED" },
    );
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Runs an async test body on a runtime of its own (two worker threads).
pub fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("building a tokio runtime")
        .block_on(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn filters_and_list_are_read_and_flag_values_skipped() {
        let (filters, list) = parse_args(&args(&[
            "t",
            "--test-threads",
            "1",
            "--nocapture",
            "mps",
            "shares",
        ]));
        assert_eq!(filters, ["mps", "shares"]);
        assert!(!list);
        assert!(parse_args(&args(&["t", "--list"])).1);
    }

    #[test]
    fn a_command_line_naming_no_tool_plays_none() {
        assert_eq!(
            play_fake_tool(&args(&["/tmp/deps/usage-0123", "--list"])),
            None
        );
    }
}
