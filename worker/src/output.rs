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
