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
            eprintln!("error: {e:#}");
            std::process::ExitCode::from(2)
        }
    }
}
