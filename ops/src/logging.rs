//! Logging for both binaries: `tracing` events on stderr, filtered by `RUST_LOG`, as text or
//! as JSON (`--log-format json`: one event per line, its fields flattened beside `message`,
//! so `rank`, `replica` and `version` are top-level keys a log pipeline can index).

/// How events are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// The variable `--log-format` also reads (a coordinator sets it for the workers it starts).
pub const LOG_FORMAT_ENV: &str = "ORCHESTRATOR_LOG_FORMAT";

static CURRENT: std::sync::OnceLock<LogFormat> = std::sync::OnceLock::new();

/// The format [`init`] installed (text before it ran).
pub fn current() -> LogFormat {
    CURRENT.get().copied().unwrap_or_default()
}

impl LogFormat {
    pub fn name(self) -> &'static str {
        match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        }
    }
}

/// Installs the process's subscriber. Without `RUST_LOG`, text shows errors only (the
/// reports are the output) and JSON shows info and above (a log pipeline wants the events).
pub fn init(format: LogFormat) {
    use tracing_subscriber::EnvFilter;
    let _ = CURRENT.set(format);
    let filter = match std::env::var(EnvFilter::DEFAULT_ENV) {
        Ok(v) if !v.is_empty() => EnvFilter::new(v),
        _ => EnvFilter::new(if format == LogFormat::Json { "info" } else { "error" }),
    };
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).with_current_span(false).with_span_list(false).init(),
    }
}

#[doc(hidden)]
pub use tracing as __tracing;

/// `status!(field = value, ...; "format", args...)`: a line for the operator on stderr, or with
/// `--log-format json` an info event with those fields and the line as its message.
#[macro_export]
macro_rules! status {
    ($($field:ident = $value:expr),* ; $($fmt:tt)+) => {{
        let message = format!($($fmt)+);
        if $crate::logging::current() == $crate::logging::LogFormat::Json {
            $crate::logging::__tracing::info!($($field = $value,)* "{message}");
        } else {
            eprintln!("{message}");
        }
    }};
}
