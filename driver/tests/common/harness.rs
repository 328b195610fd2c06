//! For the tests that run without libtest (`harness = false`): they are also the fake
//! NVIDIA tools (this executable, symlinked under the tool names) and spawn themselves,
//! so they need their own `main`. It takes libtest's arguments (a name filter, `--list`;
//! other flags are ignored) and prints libtest's result line.

use std::time::{Duration, Instant};

/// What the command line asks: a name filter, and whether to list instead of run.
pub fn parse_args(args: &[String]) -> (Option<String>, bool) {
    let mut filter = None;
    let mut list = false;
    let mut rest = args.iter().skip(1);
    while let Some(arg) = rest.next() {
        match arg.as_str() {
            "--list" => list = true,
            "--test-threads" | "--skip" | "--format" | "--color" | "--logfile" | "-Z" => {
                rest.next();
            }
            a if a.starts_with('-') => {}
            a => filter = Some(a.to_owned()),
        }
    }
    (filter, list)
}

/// Prints libtest's closing line and exits 101 when something failed.
pub fn report(passed: usize, failed: usize) {
    println!(
        "\ntest result: {}. {passed} passed; {failed} failed",
        if failed == 0 { "ok" } else { "FAILED" },
    );
    if failed > 0 {
        std::process::exit(101);
    }
}

/// The whole `main`: plays a fake tool when `argv[0]` names one, else runs `tests` one by
/// one (each caught, timed and reported like libtest).
pub fn main(tests: &[(&str, fn())]) {
    let args: Vec<String> = std::env::args().collect();
    if let Some(code) = cleave_fakes::dispatch(&args) {
        std::process::exit(code);
    }
    let (filter, list) = parse_args(&args);
    if list {
        for (name, _) in tests {
            println!("{name}: test");
        }
        return;
    }
    let mut failed = Vec::new();
    let mut ran = 0;
    for (name, test) in tests {
        if filter.as_ref().is_some_and(|f| !name.contains(f.as_str())) {
            continue;
        }
        ran += 1;
        let started = Instant::now();
        let result = std::panic::catch_unwind(test);
        let status = if result.is_ok() { "ok" } else { "FAILED" };
        println!("test {name} ... {status} ({:.2?})", started.elapsed());
        if result.is_err() {
            failed.push(*name);
        }
    }
    report(ran - failed.len(), failed.len());
}

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

/// PIDs of every daemon the fake `nvidia-cuda-mps-control` recorded starting in `record`.
pub fn started_pids(record: &std::path::Path) -> Vec<u32> {
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
