//! One line per action on stderr, which the runtime keeps in its log for the container.

use std::fmt::Arguments;

/// Writes `cleave-cdi-hook <hook>: <message>` to stderr.
pub fn line(hook: &str, message: Arguments<'_>) {
    eprintln!("cleave-cdi-hook {hook}: {message}");
}
