//! Writing command output.

use std::io::Write as _;

/// Writes to stdout; a reader that went away (`| head`) ends the process quietly instead of
/// a panic, any other write error exits with status 2.
pub fn emit(text: &str) {
    let mut stdout = std::io::stdout().lock();
    if let Err(e) = stdout.write_all(text.as_bytes()).and_then(|()| stdout.flush()) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("error: writing to stdout: {e}");
        std::process::exit(2);
    }
}

/// The process exit code of a command: 0 when it succeeded and every check agreed, 1 when a
/// check failed, 2 on an error (printed on stderr).
pub fn exit_code(result: anyhow::Result<bool>) -> std::process::ExitCode {
    match result {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => std::process::ExitCode::from(1),
        Err(e) => {
            eprintln!("error: {}", error_text(&e));
            std::process::ExitCode::from(2)
        }
    }
}

/// An error and its causes on one line, each cause once: a cause that the message before it
/// already ends with (an error that shows its source in its own message, as many of ours do,
/// and also exposes it as its source) is not repeated, as `{:#}` would.
pub fn error_text(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let cause = cause.to_string();
        if text.ends_with(&cause) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&cause);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("state directory /s: {source}")]
    struct Shown {
        source: std::io::Error,
    }

    #[test]
    fn a_cause_is_printed_once() {
        let e = anyhow::Error::new(Shown { source: std::io::Error::from(std::io::ErrorKind::StorageFull) }).context("recover");
        assert_eq!(format!("{e:#}"), "recover: state directory /s: no storage space: no storage space");
        assert_eq!(error_text(&e), "recover: state directory /s: no storage space");
        let e = anyhow::anyhow!("inner").context("middle").context("outer");
        assert_eq!(error_text(&e), "outer: middle: inner");
    }
}
