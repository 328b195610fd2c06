//! Logging: tracing with an `EnvFilter`, as text or JSON lines on stderr (stdout stays
//! free for `inspect` output).
//!
//! Text lines are written through [`EscapingWriter`]: tracing's text format writes field
//! values as they are, so an error that quotes user input (a claim's config key holding a
//! newline or a terminal sequence) could otherwise forge log lines. JSON escapes by itself.

use std::io::Write;

use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

/// Installs the global subscriber. `level` is an `EnvFilter` directive string
/// (`info`, `cleave_kubelet_plugin=debug,warn`, ...); `None` means `info`.
pub fn init(format: LogFormat, level: Option<&str>) -> Result<(), String> {
    let filter = EnvFilter::try_new(level.unwrap_or("info"))
        .map_err(|e| format!("invalid log level {level:?}: {e}"))?;
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(EscapingWriter { keep_esc: ansi })
        .with_ansi(ansi);
    let result = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
    result.map_err(|e| format!("installing the log subscriber: {e}"))
}

/// Makes stderr writers that escape control characters in each log record (one record is
/// one write): every control character but the record's final newline is written as
/// `\xNN` (C1 controls as `\u{NN}`). With `keep_esc` (colours on a terminal) ESC is kept.
#[derive(Debug, Clone, Copy)]
pub(crate) struct EscapingWriter {
    /// Keep ESC bytes (tracing's own colour codes on a terminal).
    pub keep_esc: bool,
}

/// One record's writer of [`EscapingWriter`].
pub(crate) struct Escaping<W> {
    inner: W,
    keep_esc: bool,
}

impl<'a> MakeWriter<'a> for EscapingWriter {
    type Writer = Escaping<std::io::Stderr>;
    fn make_writer(&'a self) -> Self::Writer {
        Escaping {
            inner: std::io::stderr(),
            keep_esc: self.keep_esc,
        }
    }
}

impl<W: Write> Write for Escaping<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.inner.write_all(&escape_record(buf, self.keep_esc))?;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// `record` with its control characters escaped (see [`EscapingWriter`]).
pub(crate) fn escape_record(record: &[u8], keep_esc: bool) -> std::borrow::Cow<'_, [u8]> {
    let body = record.strip_suffix(b"\n").unwrap_or(record);
    let c1 = |w: &[u8]| w[0] == 0xc2 && (0x80..=0x9f).contains(&w[1]);
    let bad = |b: u8| (b < 0x20 || b == 0x7f) && !(keep_esc && b == 0x1b);
    if !body.iter().any(|&b| bad(b)) && !body.windows(2).any(c1) {
        return std::borrow::Cow::Borrowed(record);
    }
    let mut out = Vec::with_capacity(record.len() + 16);
    let mut i = 0;
    while i < body.len() {
        let b = body[i];
        if bad(b) {
            out.extend_from_slice(format!("\\x{b:02x}").as_bytes());
        } else if i + 1 < body.len() && c1(&body[i..i + 2]) {
            out.extend_from_slice(format!("\\u{{{:x}}}", body[i + 1]).as_bytes());
            i += 1;
        } else {
            out.push(b);
        }
        i += 1;
    }
    if body.len() < record.len() {
        out.push(b'\n');
    }
    std::borrow::Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A value holding a newline and terminal sequences stays on its record's one line.
    #[test]
    fn log_records_cannot_forge_lines() {
        let rec = "2026-01-01T00:00:00Z  WARN prepare failed error=unknown field `a\nFORGED\u{1b}[31m\u{9b}2J\r`\n";
        let out = escape_record(rec.as_bytes(), false);
        let text = String::from_utf8(out.into_owned()).unwrap();
        assert_eq!(text.matches('\n').count(), 1, "{text:?}");
        assert!(text.ends_with("`\n"), "{text:?}");
        assert!(
            !text.trim_end_matches('\n').chars().any(char::is_control),
            "{text:?}"
        );
        assert!(
            text.contains("a\\x0aFORGED\\x1b[31m\\u{9b}2J\\x0d"),
            "{text:?}"
        );
        // Tracing's own colours survive on a terminal; a plain record is untouched.
        let coloured = "\u{1b}[32m INFO\u{1b}[0m ok\n";
        assert_eq!(
            escape_record(coloured.as_bytes(), true),
            coloured.as_bytes()
        );
        assert_eq!(escape_record(b"plain\n", false), &b"plain\n"[..]);
    }
}
