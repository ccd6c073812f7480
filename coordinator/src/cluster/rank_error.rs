//! Why a rank gave no answer, as data: a process that exited, a rank silent past its heartbeat
//! timeout, a call it refused or that broke, a rank that never registered. Callers decide on the
//! variant (a launch's report says a rank exited only where the error is not that already; the
//! health loop pulls a replica out of rotation or keeps it out by [`RankDown::is_dead`]), and
//! the user reads the text, which each variant writes as the strings before it did.

/// A rank the health check found down.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum RankDown {
    /// Its process ended (a local child, or an adopted process that is gone): `how` as
    /// [`super::WorkerProcess::exited`] says it ("exited (exit status: 1)", ...).
    #[error("{rank} {how}")]
    Exited { rank: String, how: String },
    /// No heartbeat for `silent_s` seconds, longer than the timeout; `presumed_dead` for a
    /// remote rank silent so long that its own coordinator grace has ended it.
    #[error(
        "{rank} (pid {pid} on host {host}, {device}) {}: no heartbeat for {silent_s:.1} s",
        if *presumed_dead { "is presumed dead" } else { "stopped answering" }
    )]
    Silent { rank: String, pid: u32, host: String, device: String, silent_s: f64, presumed_dead: bool },
}

impl RankDown {
    /// Whether the text names the rank's host (a silent rank's does).
    pub fn names_host(&self) -> bool {
        matches!(self, Self::Silent { .. })
    }

    /// Gone for good (its process ended, or it is presumed dead), not merely silent.
    pub fn is_dead(&self) -> bool {
        match self {
            Self::Exited { .. } => true,
            Self::Silent { presumed_dead, .. } => *presumed_dead,
        }
    }
}

/// Why a rank's call has no answer.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum RankError {
    /// Its process ended before it registered.
    #[error("{rank} {how} before registering")]
    ExitedBeforeRegistering { rank: String, how: String },
    /// It did not register in time; `joined` says which hosts did.
    #[error("rank {id} (dp{dp}/tp{tp}) did not register within {within_s} s ({joined})")]
    NotRegistered { id: u32, dp: u32, tp: u32, within_s: u64, joined: String },
    /// It is not (or no longer) in the registry.
    #[error("{rank} is not registered")]
    Unregistered { rank: String },
    /// Connecting to the address it registered failed.
    #[error("{rank}: {}{message}", address.as_ref().map(|a| format!("connecting to {a}: ")).unwrap_or_default())]
    Connect { rank: String, address: Option<String>, message: String },
    /// No connection to call it on.
    #[error("{rank} is not connected")]
    NotConnected { rank: String },
    /// It went down while the call was in flight.
    #[error(transparent)]
    Down(#[from] RankDown),
    /// The call failed: the rank refused it (`code` says how), or the transport broke.
    #[error("{rank}: {call}: {message}")]
    Call { rank: String, call: &'static str, code: tonic::Code, message: String },
    /// The call ended without its answer (a reply stream that stopped before its last message).
    #[error("{rank}: {what}")]
    Incomplete { rank: String, what: &'static str },
}

impl RankError {
    /// The failed call `call` on `rank` from its status.
    pub fn call(rank: String, call: &'static str, status: &tonic::Status) -> Self {
        Self::Call { rank, call, code: status.code(), message: status.message().to_string() }
    }

    /// Whether the text names the rank's host.
    pub fn names_host(&self) -> bool {
        matches!(self, Self::Down(down) if down.names_host())
    }

    /// Whether the error already says that the rank's process ended (so a report need not add
    /// it).
    pub fn says_it_exited(&self) -> bool {
        matches!(self, Self::ExitedBeforeRegistering { .. } | Self::Down(RankDown::Exited { .. }))
    }
}

impl From<&RankError> for crate::consistency::RowFailure {
    fn from(e: &RankError) -> Self {
        Self { text: e.to_string(), names_host: e.names_host() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each variant's text is the one the coordinator wrote before its errors were typed.
    #[test]
    fn the_texts_are_the_users() {
        let rank = || "rank dp0/tp1 (worker 1)".to_string();
        let cases: [(RankError, &str); 10] = [
            (RankError::Unregistered { rank: rank() }, "rank dp0/tp1 (worker 1) is not registered"),
            (
                RankError::ExitedBeforeRegistering { rank: rank(), how: "exited (exit status: 3)".into() },
                "rank dp0/tp1 (worker 1) exited (exit status: 3) before registering",
            ),
            (
                RankError::NotRegistered { id: 3, dp: 1, tp: 1, within_s: 30, joined: "no host joined".into() },
                "rank 3 (dp1/tp1) did not register within 30 s (no host joined)",
            ),
            (
                RankError::Connect { rank: rank(), address: Some("10.0.0.2:50051".into()), message: "refused".into() },
                "rank dp0/tp1 (worker 1): connecting to 10.0.0.2:50051: refused",
            ),
            (RankError::Connect { rank: rank(), address: None, message: "bad uri".into() }, "rank dp0/tp1 (worker 1): bad uri"),
            (RankError::NotConnected { rank: rank() }, "rank dp0/tp1 (worker 1) is not connected"),
            (
                RankDown::Exited { rank: rank(), how: "exited (signal: 9 (SIGKILL))".into() }.into(),
                "rank dp0/tp1 (worker 1) exited (signal: 9 (SIGKILL))",
            ),
            (
                RankDown::Silent { rank: rank(), pid: 42, host: "n1".into(), device: "cpu".into(), silent_s: 4.54, presumed_dead: false }
                    .into(),
                "rank dp0/tp1 (worker 1) (pid 42 on host n1, cpu) stopped answering: no heartbeat for 4.5 s",
            ),
            (RankError::call(rank(), "stage", &tonic::Status::failed_precondition("no plan")), "rank dp0/tp1 (worker 1): stage: no plan"),
            (RankError::Incomplete { rank: rank(), what: "stage stream ended early" }, "rank dp0/tp1 (worker 1): stage stream ended early"),
        ];
        for (error, text) in cases {
            assert_eq!(error.to_string(), text);
        }
        let silent = |presumed_dead| RankDown::Silent {
            rank: rank(),
            pid: 1,
            host: "n2".into(),
            device: "cpu".into(),
            silent_s: 61.0,
            presumed_dead,
        };
        assert!(silent(true).to_string().ends_with("is presumed dead: no heartbeat for 61.0 s"));
        assert!(silent(true).is_dead() && !silent(false).is_dead());
        assert!(RankDown::Exited { rank: rank(), how: "exited".into() }.is_dead());
    }

    /// Only a silent rank's text names its host (a report then adds no `[on host ...]`).
    #[test]
    fn only_a_silent_rank_names_its_host() {
        let rank = || "rank dp1/tp0 (worker 2)".to_string();
        let silent =
            RankDown::Silent { rank: rank(), pid: 9, host: "n2".into(), device: "cpu".into(), silent_s: 5.0, presumed_dead: false };
        assert!(silent.to_string().contains("on host n2") && silent.names_host());
        assert!(RankError::from(silent.clone()).names_host());
        let row: crate::consistency::RowFailure = (&RankError::from(silent)).into();
        assert!(row.names_host);
        assert!(!RankDown::Exited { rank: rank(), how: "exited".into() }.names_host());
        assert!(!RankError::call(rank(), "report", &tonic::Status::internal("host n2 said no")).names_host());
        assert!(!RankError::NotConnected { rank: rank() }.names_host());
    }

    /// Only the errors that say the process ended say so.
    #[test]
    fn an_error_says_it_exited_only_where_it_does() {
        let rank = || "rank dp0/tp0 (worker 0)".to_string();
        assert!(RankError::ExitedBeforeRegistering { rank: rank(), how: "exited".into() }.says_it_exited());
        assert!(RankError::from(RankDown::Exited { rank: rank(), how: "exited".into() }).says_it_exited());
        assert!(!RankError::call(rank(), "load", &tonic::Status::unavailable("transport error")).says_it_exited());
        assert!(!RankError::NotConnected { rank: rank() }.says_it_exited());
    }
}
