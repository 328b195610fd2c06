//! Logging: tracing with an `EnvFilter`, as text or JSON lines on stderr (stdout stays
//! free for `inspect` output).

use tracing_subscriber::EnvFilter;

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
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let result = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
    result.map_err(|e| format!("installing the log subscriber: {e}"))
}
