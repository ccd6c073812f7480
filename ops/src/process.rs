//! Who a process is, beyond its pid. A pid is reused once its process is gone, so a coordinator
//! that adopted workers from a journal must not signal a pid on its word alone: it signals only
//! a process whose start time (clock ticks after boot), boot and executable are still the ones
//! the worker reported when it registered, and it holds a pidfd while it checks, so the process
//! it checked is the one it signals.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// A process's identity on one host.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessIdentity {
    pub pid: u32,
    /// Field 22 of `/proc/PID/stat`: when the process started, in clock ticks after boot.
    pub start_ticks: u64,
    /// `/proc/sys/kernel/random/boot_id`: start times count from this boot only.
    pub boot_id: String,
    /// The executable (`/proc/PID/exe`).
    pub executable: PathBuf,
}

/// Why a pid is not (or no longer) the process a journal names.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IdentityError {
    #[error("pid {pid} is gone")]
    Gone { pid: u32 },
    #[error("pid {pid} is another process now ({what} differs: {found}, the worker reported {expected})")]
    Different { pid: u32, what: &'static str, expected: String, found: String },
    #[error("the journal holds no identity for pid {pid} (start time, boot, executable): it is never signalled")]
    Unknown { pid: u32 },
    #[error("signalling pid {pid}: {why}")]
    Signal { pid: u32, why: String },
}

fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id").map(|s| s.trim().to_string()).unwrap_or_default()
}

/// Field 22 (starttime) and field 3 (state) of `/proc/PID/stat`; the command name (field 2)
/// may hold spaces and parentheses, so fields count from its last `)`.
fn stat_of(pid: u32) -> Option<(char, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(") ")?;
    let mut fields = rest.split_ascii_whitespace();
    let state = fields.next()?.chars().next()?;
    // rest starts at field 3; starttime is field 22.
    let start = fields.nth(22 - 4)?.parse().ok()?;
    Some((state, start))
}

impl ProcessIdentity {
    /// This process.
    pub fn of_self() -> Self {
        Self::of_pid(std::process::id()).unwrap_or(Self { pid: std::process::id(), ..Self::default() })
    }

    /// The process with this pid now, when it exists and is not a zombie.
    pub fn of_pid(pid: u32) -> Option<Self> {
        let (state, start_ticks) = stat_of(pid)?;
        if state == 'Z' || state == 'X' {
            return None;
        }
        let executable = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap_or_default();
        Some(Self { pid, start_ticks, boot_id: boot_id(), executable })
    }

    /// Whether the journal's record says enough to recognize the process again.
    pub fn is_known(&self) -> bool {
        self.pid > 0 && self.start_ticks > 0 && !self.boot_id.is_empty()
    }

    /// Checks that the process with this identity's pid is still this process.
    pub fn verify(&self) -> Result<(), IdentityError> {
        if !self.is_known() {
            return Err(IdentityError::Unknown { pid: self.pid });
        }
        let now = Self::of_pid(self.pid).ok_or(IdentityError::Gone { pid: self.pid })?;
        let differ = |what, expected: String, found: String| IdentityError::Different { pid: self.pid, what, expected, found };
        if now.boot_id != self.boot_id {
            return Err(differ("boot", self.boot_id.clone(), now.boot_id));
        }
        if now.start_ticks != self.start_ticks {
            return Err(differ("start time", self.start_ticks.to_string(), now.start_ticks.to_string()));
        }
        // A worker's executable may be replaced on disk while it runs (a rebuild): the kernel
        // then shows " (deleted)" after the same path.
        let exe = now.executable.to_string_lossy();
        let exe = exe.strip_suffix(" (deleted)").unwrap_or(&exe);
        if !self.executable.as_os_str().is_empty() && std::path::Path::new(exe) != self.executable {
            return Err(differ("executable", self.executable.display().to_string(), exe.to_string()));
        }
        Ok(())
    }

    /// Whether the process still runs as this identity.
    pub fn alive(&self) -> bool {
        match self.verify() {
            Ok(()) => true,
            // Without a recorded identity only the pid can be asked (it is never signalled).
            Err(IdentityError::Unknown { .. }) => Self::of_pid(self.pid).is_some(),
            Err(_) => false,
        }
    }

    /// Sends SIGKILL, only to this very process: a pidfd is opened first, the identity is checked
    /// while the pidfd holds the process, and the signal goes through the pidfd (so a pid reused
    /// between the check and the signal cannot be hit).
    #[cfg(target_os = "linux")]
    pub fn kill(&self) -> Result<(), IdentityError> {
        let pid = libc::pid_t::try_from(self.pid).map_err(|_| IdentityError::Gone { pid: self.pid })?;
        if pid <= 0 {
            return Err(IdentityError::Gone { pid: self.pid });
        }
        // SAFETY: pidfd_open takes a pid and flags and returns a new file descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            return Err(IdentityError::Gone { pid: self.pid });
        }
        let fd = fd as libc::c_int;
        let result = self.verify().and_then(|()| {
            // SAFETY: fd is the pidfd opened above; no siginfo; flags 0.
            let r = unsafe { libc::syscall(libc::SYS_pidfd_send_signal, fd, libc::SIGKILL, std::ptr::null::<libc::siginfo_t>(), 0) };
            if r == 0 { Ok(()) } else { Err(IdentityError::Signal { pid: self.pid, why: std::io::Error::last_os_error().to_string() }) }
        });
        // SAFETY: fd is ours and closed once.
        unsafe { libc::close(fd) };
        result
    }

    #[cfg(not(target_os = "linux"))]
    pub fn kill(&self) -> Result<(), IdentityError> {
        Err(IdentityError::Signal { pid: self.pid, why: "signalling adopted workers needs Linux pidfds".into() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_recognized_and_a_changed_identity_is_not() {
        let me = ProcessIdentity::of_self();
        assert!(me.is_known(), "{me:?}");
        me.verify().unwrap();
        let other_start = ProcessIdentity { start_ticks: me.start_ticks + 1, ..me.clone() };
        assert!(matches!(other_start.verify(), Err(IdentityError::Different { what: "start time", .. })));
        let other_exe = ProcessIdentity { executable: "/bin/sleep".into(), ..me.clone() };
        assert!(matches!(other_exe.verify(), Err(IdentityError::Different { what: "executable", .. })));
        let unknown = ProcessIdentity { pid: me.pid, ..ProcessIdentity::default() };
        assert!(matches!(unknown.verify(), Err(IdentityError::Unknown { .. })));
        assert!(matches!(unknown.kill(), Err(IdentityError::Unknown { .. })), "never signalled without an identity");
    }

    /// A process that merely has the recorded pid (here: a `sleep` standing in for a reused pid)
    /// is never signalled; the process itself is.
    #[test]
    fn only_the_recorded_process_is_killed() {
        let mut sleep = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let real = ProcessIdentity::of_pid(sleep.id()).unwrap();
        let impostor = ProcessIdentity { start_ticks: real.start_ticks.wrapping_sub(1), ..real.clone() };
        assert!(matches!(impostor.kill(), Err(IdentityError::Different { .. })));
        assert_eq!(sleep.try_wait().unwrap(), None, "the impostor check must not signal");
        real.kill().unwrap();
        let status = sleep.wait().unwrap();
        assert!(!status.success());
        assert!(matches!(real.verify(), Err(IdentityError::Gone { .. })));
    }
}
