//! The chart's spend recording rules (`deployments/helm/cleave/files/spend-rules.yaml`) under
//! the real rule engine: `promtool test rules` on a scripted two-team day, whose expected
//! GPU-hours per namespace and per team the test file states.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::process::Command;

/// Set (to anything but `0`) where promtool must run: a skip is then a failure.
const REQUIRE_PROMETHEUS: &str = "CLEAVE_REQUIRE_PROMETHEUS";

fn files() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../deployments/helm/cleave/files")
}

fn promtool(args: &[&str]) -> Option<std::process::Output> {
    Command::new("promtool")
        .args(args)
        .current_dir(files())
        .output()
        .ok()
}

fn spend_rules_hold_for_a_two_team_day() {
    let Some(check) = promtool(&["check", "rules", "spend-rules.yaml"]) else {
        cleave_testkit::runner::tool_missing(
            "promtool",
            REQUIRE_PROMETHEUS,
            "promtool is not installed (Debian: apt-get install prometheus)",
        );
        return;
    };
    let text = |o: &std::process::Output| {
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    };
    assert!(
        check.status.success(),
        "promtool check rules: {}",
        text(&check)
    );
    assert!(text(&check).contains("12 rules found"), "{}", text(&check));
    let test = promtool(&["test", "rules", "tests/spend-rules.test.yaml"]).unwrap();
    assert!(
        test.status.success(),
        "promtool test rules: {}",
        text(&test)
    );
    assert!(text(&test).contains("SUCCESS"), "{}", text(&test));
}

fn main() -> std::process::ExitCode {
    cleave_testkit::runner::main(&[(
        "spend_rules_hold_for_a_two_team_day",
        spend_rules_hold_for_a_two_team_day,
    )])
}
