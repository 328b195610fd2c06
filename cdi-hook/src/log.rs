//! One line per action on stderr, which the runtime keeps in its log for the container.
//! Control characters are escaped: names from the image must not forge lines in that log.

use std::fmt::Arguments;

/// Writes `cleave-cdi-hook <hook>: <message>` to stderr.
pub fn line(hook: &str, message: Arguments<'_>) {
    eprintln!("cleave-cdi-hook {hook}: {}", escape(&message.to_string()));
}

/// `text` with every control character (line breaks too) written as a Rust escape.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(escape("/opt/x\n/etc/cron.d"), "/opt/x\\n/etc/cron.d");
        assert_eq!(escape("a\u{1b}[2Jb\rc"), "a\\u{1b}[2Jb\\rc");
        assert_eq!(escape("plain /usr/lib é"), "plain /usr/lib é");
    }
}
