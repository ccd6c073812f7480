//! The coordinator's durable state (`--state-dir`): an append-only journal of the plan, the
//! workers, and every step of every rolling update, one JSON object per line, each line
//! flushed to disk (`fsync`) before the step it records goes on. A coordinator restarted from
//! the directory (`orchestrator recover`) replays it to find the workers again and to see
//! which update was in flight and how far it got.
//!
//! A line cut short by a kill mid-write is the only damage tolerated, and only as the last
//! line; anything else is refused with the file and line named.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use orchestrator_proto::v1 as pb;
use serde::{Deserialize, Serialize};

/// The journal's file name inside the state directory.
pub const JOURNAL_FILE: &str = "journal.jsonl";
/// The cluster token a launch with a state directory generates there.
pub const TOKEN_FILE: &str = "token";

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("state directory {dir}: {source}")]
    Io { dir: PathBuf, source: std::io::Error },
    #[error("{file}:{line}: {message}")]
    Corrupt { file: PathBuf, line: usize, message: String },
    #[error("{file}: {message}")]
    Invalid { file: PathBuf, message: String },
    /// Another coordinator holds the state directory (it is alive): nothing was changed.
    #[error("state directory {dir} is held by a running coordinator ({holder}); nothing was changed")]
    Locked { dir: PathBuf, holder: String },
    /// An event replay would refuse to find after what the journal holds, refused unwritten.
    #[error("{file}: refused unwritten: {message}")]
    Refused { file: PathBuf, message: String },
    /// An update's begin that cannot follow what the journal holds ([`check_begin`]): refused
    /// unwritten by [`Journal::record`] (no `line`), or found at `line` by [`replay`].
    #[error("{}{}: {refused}", .file.display(), .line.map(|l| format!(":{l}")).unwrap_or_default())]
    Begin { file: PathBuf, line: Option<usize>, refused: BeginRefused },
}

/// Why an update cannot begin after what a journal holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BeginRefused {
    #[error("update {update} begins while update {open} has not ended")]
    OverOpen { update: u64, open: u64 },
    #[error("update {update} resumes update {resumes}, which is not in flight")]
    NothingToResume { update: u64, resumes: u64 },
    #[error("update {update} resumes update {resumes}, which is not an earlier one")]
    NotLater { update: u64, resumes: u64 },
    #[error("update number {update} is out of range (at most {MAX_UPDATE})")]
    OutOfRange { update: u64 },
}

/// The largest update number a journal holds (so that the next one, and the one a recovery
/// begins to resolve it, are always numbers too: a hand-edited journal cannot overflow them).
pub const MAX_UPDATE: u64 = 1 << 53;

/// The one rule for an update's begin, which the writer keeps (refusing the line unwritten) and
/// replay checks (refusing a journal that breaks it), so that nothing replay refuses is
/// written: with no update open, a begin that resumes none; with update `open` open, only a
/// later update's begin that resumes it (closing it in the same line).
pub fn check_begin(open: Option<u64>, update: u64, resumes: Option<u64>) -> Result<(), BeginRefused> {
    if update > MAX_UPDATE {
        return Err(BeginRefused::OutOfRange { update });
    }
    match (open, resumes) {
        (None, None) => Ok(()),
        (Some(open), Some(r)) if r == open && update > r => Ok(()),
        (Some(open), Some(r)) if r == open => Err(BeginRefused::NotLater { update, resumes: r }),
        (Some(open), _) => Err(BeginRefused::OverOpen { update, open }),
        (None, Some(r)) => Err(BeginRefused::NothingToResume { update, resumes: r }),
    }
}

/// The lock file a coordinator holds (an exclusive advisory lock) for as long as it runs on a
/// state directory, so a second `launch` or `recover` on the same directory is refused before
/// it changes anything. The lock goes away with the process, however it ends.
pub const LOCK_FILE: &str = "lock";

/// Takes the state directory's lock, or says who holds it.
fn lock_dir(dir: &Path) -> Result<File, JournalError> {
    let io = |source| JournalError::Io { dir: dir.to_path_buf(), source };
    let path = dir.join(LOCK_FILE);
    let mut file = OpenOptions::new().create(true).truncate(false).read(true).write(true).open(&path).map_err(io)?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let holder = std::fs::read_to_string(&path).unwrap_or_default();
            let holder = if holder.trim().is_empty() { "pid unknown".to_string() } else { holder.trim().to_string() };
            return Err(JournalError::Locked { dir: dir.to_path_buf(), holder });
        }
        Err(std::fs::TryLockError::Error(e)) => return Err(io(e)),
    }
    file.set_len(0).map_err(io)?;
    file.write_all(format!("coordinator pid {}\n", std::process::id()).as_bytes()).map_err(io)?;
    Ok(file)
}

/// What the workers load: a checkpoint directory or generated weights.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SourceRecord {
    Checkpoint { dir: PathBuf },
    Dummy { preset: String, layers: u32, seed: u64, bf16: bool },
}

impl SourceRecord {
    pub fn from_pb(s: &pb::LoadSource) -> Option<Self> {
        Some(match s.kind.as_ref()? {
            pb::load_source::Kind::CheckpointDir(d) => Self::Checkpoint { dir: PathBuf::from(d) },
            pb::load_source::Kind::Dummy(d) => Self::Dummy { preset: d.preset.clone(), layers: d.layers, seed: d.seed, bf16: d.bf16 },
        })
    }

    pub fn to_pb(&self) -> pb::LoadSource {
        let kind = match self {
            Self::Checkpoint { dir } => pb::load_source::Kind::CheckpointDir(dir.display().to_string()),
            Self::Dummy { preset, layers, seed, bf16 } => {
                pb::load_source::Kind::Dummy(pb::DummySource { preset: preset.clone(), layers: *layers, seed: *seed, bf16: *bf16 })
            }
        };
        pb::LoadSource { kind: Some(kind), content: None }
    }
}

/// One rank's worker as the launch started it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorkerRecord {
    pub id: u32,
    pub dp: u32,
    pub tp: u32,
    /// The worker's gRPC address (`http://host:port`).
    pub address: String,
    pub pid: u32,
    /// The rest of the process's identity (see `ProcessIdentity`): a restarted coordinator
    /// signals the pid only while these still match.
    #[serde(default)]
    pub start_ticks: u64,
    #[serde(default)]
    pub boot_id: String,
    #[serde(default)]
    pub executable: PathBuf,
    /// Its collective (ring) listener.
    pub collective: String,
    /// GPU workers: the NCCL unique id of the group (hex; empty on CPU workers).
    #[serde(default)]
    pub nccl_unique_id: String,
    /// Started by an engine or a user (not by the coordinator): adopted as remote, never signalled.
    #[serde(default)]
    pub remote: bool,
    /// The host it registered from.
    #[serde(default)]
    pub host: String,
}

impl WorkerRecord {
    /// The worker's process identity as recorded.
    pub fn identity(&self) -> orchestrator_ops::process::ProcessIdentity {
        orchestrator_ops::process::ProcessIdentity {
            pid: self.pid,
            start_ticks: self.start_ticks,
            boot_id: self.boot_id.clone(),
            executable: self.executable.clone(),
        }
    }
}

/// Lower-case hex of bytes.
pub fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Bytes of lower- or upper-case hex; `None` when it is not hex.
pub fn from_hex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len()).step_by(2).map(|i| text.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok())).collect()
}

/// The plan a launch brought up.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanRecord {
    /// The coordinator's listening address (a restarted coordinator binds it again, so the
    /// workers' heartbeats reach it).
    pub coordinator: String,
    pub tp: u32,
    pub dp: u32,
    pub source: SourceRecord,
    pub source_desc: String,
    pub scale_rule: String,
    /// Probe size `(tokens, latents, seed)`, if probes are configured.
    pub probe: Option<(u32, u32, u64)>,
    pub token_file: PathBuf,
    /// The cluster's TLS directory, when the control plane runs over TLS.
    #[serde(default)]
    pub tls_dir: Option<PathBuf>,
    pub workers: Vec<WorkerRecord>,
    /// The version every replica loaded.
    pub version: String,
    /// The directories the workers may read checkpoints from.
    #[serde(default)]
    pub allow_roots: Vec<PathBuf>,
    /// `--commit-timeout` in milliseconds.
    #[serde(default)]
    pub commit_timeout_ms: Option<u64>,
}

impl PlanRecord {
    /// Whether a launch could have written this plan: a cluster shape within the limits, one
    /// worker per rank (`id = dp * tp_size + tp`, each once), NCCL ids in hex, a probe within the
    /// size limits, a commit timeout in (0, 3600] s. Says what is wrong otherwise.
    pub fn check(&self) -> Result<(), String> {
        let world = orchestrator_model::limits::check_cluster(self.tp as usize, self.dp as usize, false)
            .map_err(|e| format!("tp {} dp {}: {e}", self.tp, self.dp))?;
        if self.workers.len() != world {
            return Err(format!("{} workers for tp {} x dp {} = {world} ranks", self.workers.len(), self.tp, self.dp));
        }
        let mut seen = vec![false; world];
        for w in &self.workers {
            let rank = format!("worker {} (dp{}/tp{})", w.id, w.dp, w.tp);
            if w.tp >= self.tp || w.dp >= self.dp || w.id as usize != w.dp as usize * self.tp as usize + w.tp as usize {
                return Err(format!("{rank}: not a rank of tp {} x dp {}", self.tp, self.dp));
            }
            if std::mem::replace(&mut seen[w.id as usize], true) {
                return Err(format!("{rank}: recorded twice"));
            }
            if from_hex(&w.nccl_unique_id).is_none() {
                return Err(format!("{rank}: nccl_unique_id is not hex"));
            }
        }
        if let Some((t, s, seed)) = self.probe {
            orchestrator_model::limits::check_probe(t as usize, s as usize).map_err(|e| format!("probe {t},{s},{seed}: {e}"))?;
        }
        match self.commit_timeout_ms {
            Some(ms) if ms == 0 || ms > 3_600_000 => Err(format!("commit_timeout_ms {ms}: must be in (0, 3600000]")),
            _ => Ok(()),
        }
    }
}

/// A step of a rolling update on one replica.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Step {
    /// Out of rotation, staging the new version.
    Staging,
    /// Staged and verified on every rank.
    Verified,
    /// The commit decision, written before any rank is told to swap: from here on the replica's
    /// version is the new one and the commit is driven to every rank (never aborted).
    Decided,
    /// Every rank swapped to the new version.
    Committed,
    /// The abort decision (only ever before `decided`), written before any rank is told to drop
    /// what it staged; the replica keeps its version.
    Aborted,
    /// An explicit rollback of a committed replica (`recover --rollback`), written before any
    /// rank is told to swap back to the version its commit replaced.
    RolledBack,
}

/// One journal event.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    Launched(PlanRecord),
    UpdateBegin {
        update: u64,
        from: SourceRecord,
        to: SourceRecord,
        new_version: String,
        max_unavailable: u32,
        /// A recovery's update that resolves (finishes or rolls back) the interrupted update
        /// `resumes`: its begin also closes that one, as not applied, in the same line, so no
        /// moment is journaled where the interrupted update has ended and nothing resolves it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        resumes: Option<u64>,
    },
    UpdateStep {
        update: u64,
        dp: u32,
        step: Step,
    },
    UpdateEnd {
        update: u64,
        ok: bool,
        note: String,
    },
    /// A commit decided in an update that has ended was confirmed by every rank of the replica
    /// later (a rank that had stalled answered again; or `recover` finished it).
    CommitConfirmed {
        dp: u32,
        version: String,
    },
    /// A restarted coordinator took over the cluster.
    Recovered {
        note: String,
    },
    /// The cluster was shut down on purpose.
    Shutdown,
}

impl Event {
    /// The update this event ends (an update's end, or a begin that resumes it).
    fn closes_update(&self) -> Option<u64> {
        match self {
            Event::UpdateEnd { update, .. } => Some(*update),
            Event::UpdateBegin { resumes, .. } => *resumes,
            _ => None,
        }
    }

    /// What must still be journaled when this event could not be: the end of the update it
    /// closes (a later begin over an update never ended would make the journal unreplayable).
    fn closes(&self) -> Option<Event> {
        match self {
            Event::UpdateEnd { .. } => Some(self.clone()),
            Event::UpdateBegin { update, resumes: Some(r), .. } => Some(Event::UpdateEnd {
                update: *r,
                ok: false,
                note: format!("interrupted by a coordinator restart; update {update}, which was to resolve it, could not be journaled"),
            }),
            _ => None,
        }
    }
}

#[derive(Serialize, Deserialize)]
struct Line {
    seq: u64,
    unix_ms: u64,
    #[serde(flatten)]
    event: Event,
}

/// An update that began and has not ended.
#[derive(Clone, Debug, PartialEq)]
pub struct PendingUpdate {
    pub update: u64,
    pub from: SourceRecord,
    pub to: SourceRecord,
    pub new_version: String,
    pub max_unavailable: u32,
    /// The last step recorded for each replica.
    pub steps: BTreeMap<u32, Step>,
}

/// The journal replayed.
#[derive(Clone, Debug, PartialEq)]
pub struct Replayed {
    pub plan: PlanRecord,
    /// The source every replica serves when no update is in flight (the last completed one).
    pub current: SourceRecord,
    /// Version of `current`.
    pub current_version: String,
    pub pending: Option<PendingUpdate>,
    pub shut_down: bool,
    pub last_update: u64,
    /// Replicas with a commit decision that no confirmation followed: replica -> decided version.
    pub decided: BTreeMap<u32, String>,
    /// The last update, ended not applied while every replica it reached was committed or
    /// decided: once the last of those commits is confirmed, its target is `current`.
    pub settling: Option<Settling>,
    /// A torn last line was ignored.
    pub torn_tail: bool,
    /// Complete lines, and the bytes they take (where appending resumes).
    pub lines: u64,
    pub complete_bytes: u64,
}

/// An update that ended not applied only because some of its decided commits were not yet
/// confirmed (every replica it reached was committed or decided).
#[derive(Clone, Debug, PartialEq)]
pub struct Settling {
    pub to: SourceRecord,
    pub version: String,
    /// The replicas whose commit to `version` is still unconfirmed.
    pub unconfirmed: BTreeSet<u32>,
}

impl Settling {
    /// What an update ending not applied leaves to settle: `None` unless every replica it
    /// reached (`steps`) was committed or decided.
    pub fn after(to: SourceRecord, version: String, steps: &BTreeMap<u32, Step>) -> Option<Self> {
        let reached_all = !steps.is_empty() && steps.values().all(|s| matches!(s, Step::Committed | Step::Decided));
        reached_all.then(|| {
            let unconfirmed = steps.iter().filter(|(_, s)| **s == Step::Decided).map(|(dp, _)| *dp).collect();
            Self { to, version, unconfirmed }
        })
    }

    /// Replica `dp` confirmed its commit to `version`.
    pub fn confirm(&mut self, dp: u32, version: &str) {
        if version == self.version {
            self.unconfirmed.remove(&dp);
        }
    }
}

/// Debugging (`--journal-fault`): the coordinator fails at one line of its journal, so a test
/// can walk every step of the protocol with the coordinator dying, or its disk failing, there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JournalFault {
    pub kind: JournalFaultKind,
    /// The line's sequence number (the launch's plan is line 1).
    pub line: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JournalFaultKind {
    /// The process is killed (SIGKILL) just before the line is written: what the workers were
    /// told since the line before happened, the journal does not say so.
    CrashBefore,
    /// The process is killed (SIGKILL) once the line is on disk, before anything it records is
    /// acted on.
    CrashAfter,
    /// The line's write fails once, as on a full disk (nothing of it stays in the file).
    Fail,
}

impl std::str::FromStr for JournalFault {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (kind, line) = s.rsplit_once(':').ok_or_else(|| format!("`{s}`: expected KIND:LINE"))?;
        let kind = match kind {
            "crash-before" => JournalFaultKind::CrashBefore,
            "crash-after" => JournalFaultKind::CrashAfter,
            "fail" => JournalFaultKind::Fail,
            other => return Err(format!("`{s}`: unknown kind `{other}` (crash-before, crash-after, fail)")),
        };
        let line = line.parse().ok().filter(|&l| l >= 1).ok_or_else(|| format!("`{s}`: the line must be a number from 1"))?;
        Ok(Self { kind, line })
    }
}

/// Ends this process the way `kill -9` does: no destructor, no flush, no answer to anyone.
fn die() -> ! {
    // SAFETY: kill(2) on this process's own pid with a signal that cannot be caught.
    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    std::process::abort()
}

/// Where appending goes on: the file, the last sequence number and the length of the complete
/// lines written.
struct Appender {
    file: File,
    seq: u64,
    len: u64,
    /// Set when a failed write could not be cut back off: the file is not appended to again.
    broken: Option<String>,
    /// An update's end whose write failed: written before the next event (a later update's
    /// begin over an update never ended would make the journal unreplayable).
    owed: Option<Event>,
    /// Debugging: the line to fail at (`--journal-fault`).
    fault: Option<JournalFault>,
    /// What the file holds, as replay would find it (`None` before the launch record): each
    /// event is taken by it before it is written, and refused unwritten where replay would
    /// refuse its line.
    state: Option<Replayed>,
    /// Tests: how many of the next writes fail as a full disk would.
    #[cfg(test)]
    fail_writes: u32,
}

impl Appender {
    fn new(file: File, seq: u64, len: u64) -> Self {
        Self {
            file,
            seq,
            len,
            broken: None,
            owed: None,
            fault: None,
            state: None,
            #[cfg(test)]
            fail_writes: 0,
        }
    }
}

/// The open journal.
pub struct Journal {
    path: PathBuf,
    file: Mutex<Appender>,
    /// The state directory's lock, held for the journal's life.
    _lock: File,
}

impl Journal {
    /// Starts a new journal in `dir` (created if needed); refuses a directory whose journal
    /// describes a cluster that was not shut down (recover it instead).
    pub fn create(dir: &Path) -> Result<Self, JournalError> {
        let io = |source| JournalError::Io { dir: dir.to_path_buf(), source };
        std::fs::create_dir_all(dir).map_err(io)?;
        let lock = lock_dir(dir)?;
        let path = dir.join(JOURNAL_FILE);
        if path.exists() {
            let replayed = replay(&path)?;
            if let Some(r) = replayed
                && !r.shut_down
            {
                return Err(JournalError::Invalid {
                    file: path,
                    message: format!(
                        "holds a cluster that was not shut down (coordinator {}): run `orchestrator recover --state-dir {}` or remove the directory",
                        r.plan.coordinator,
                        dir.display()
                    ),
                });
            }
            std::fs::remove_file(&path).map_err(io)?;
        }
        let file = OpenOptions::new().create_new(true).append(true).open(&path).map_err(io)?;
        Ok(Self { path, file: Mutex::new(Appender::new(file, 0, 0)), _lock: lock })
    }

    /// Opens an existing journal to append to, after replaying it.
    pub fn open(dir: &Path) -> Result<(Self, Replayed), JournalError> {
        // First: a directory a live coordinator holds is left exactly as it is.
        let lock = lock_dir(dir)?;
        let path = dir.join(JOURNAL_FILE);
        let replayed = replay(&path)?.ok_or_else(|| JournalError::Invalid {
            file: path.clone(),
            message: "records no launched cluster (nothing to recover)".into(),
        })?;
        // A plan no launch could have written (edited by hand, damaged) is refused before the
        // torn tail is cut or anything is started from it.
        replayed
            .plan
            .check()
            .map_err(|message| JournalError::Invalid { file: path.clone(), message: format!("the launched plan: {message}") })?;
        let io = |source| JournalError::Io { dir: dir.to_path_buf(), source };
        let file = OpenOptions::new().append(true).open(&path).map_err(io)?;
        if replayed.torn_tail {
            // Drop the torn tail so the next line starts clean.
            file.set_len(replayed.complete_bytes).map_err(io)?;
        }
        let mut appender = Appender::new(file, replayed.lines, replayed.complete_bytes);
        appender.state = Some(replayed.clone());
        Ok((Self { path, file: Mutex::new(appender), _lock: lock }, replayed))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The update the journal holds begun and not ended (what a recovery would resolve).
    pub fn open_update(&self) -> Option<u64> {
        self.file.lock().unwrap_or_else(|p| p.into_inner()).state.as_ref().and_then(|s| s.pending.as_ref()).map(|p| p.update)
    }

    /// The source every replica serves by the journal's account, and its version (what a
    /// recovery would serve, and roll an interrupted update back to).
    pub fn serving(&self) -> Option<(SourceRecord, String)> {
        self.file.lock().unwrap_or_else(|p| p.into_inner()).state.as_ref().map(|s| (s.current.clone(), s.current_version.clone()))
    }

    /// Debugging: fail at one line from now on (see [`JournalFault`]).
    pub fn inject_fault(&self, fault: JournalFault) {
        self.file.lock().unwrap_or_else(|p| p.into_inner()).fault = Some(fault);
    }

    /// Appends one event and flushes it to disk before returning.
    /// A write that fails (a full disk) is cut back off the file and uses up no sequence
    /// number, so the journal stays replayable; if even that fails, every later write is refused.
    /// An update's end that could not be written (or a begin that was to close an interrupted
    /// update) leaves that update's end owed: it is written before the next event, which fails
    /// (unwritten) while it cannot be.
    pub fn record(&self, event: Event) -> Result<(), JournalError> {
        let mut a = self.file.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(owed) = a.owed.take() {
            let superseded = matches!((owed.closes_update(), event.closes_update()), (Some(o), Some(e)) if o == e);
            if !superseded && let Err(e) = self.append(&mut a, &owed) {
                a.owed = Some(owed);
                return Err(e);
            }
        }
        self.append(&mut a, &event).inspect_err(|e| {
            // A line refused by the rules was never going to be written; one whose write failed
            // leaves the update it closes owed.
            if !matches!(e, JournalError::Begin { .. } | JournalError::Refused { .. }) {
                a.owed = event.closes();
            }
        })
    }

    /// Writes `event` where replay would take its line (else refuses it unwritten: replay would
    /// refuse the journal from that line on, and with it every `recover`), and keeps what the
    /// file then holds.
    fn append(&self, a: &mut Appender, event: &Event) -> Result<(), JournalError> {
        let next = match (&a.state, event) {
            (_, Event::Launched(plan)) => Replayed::launched(plan.clone()),
            (Some(held), _) => {
                let mut next = held.clone();
                next.apply(event.clone()).map_err(|refusal| match refusal {
                    Refusal::Begin(refused) => JournalError::Begin { file: self.path.clone(), line: None, refused },
                    Refusal::Other(message) => JournalError::Refused { file: self.path.clone(), message },
                })?;
                next
            }
            (None, _) => {
                return Err(JournalError::Refused { file: self.path.clone(), message: "an event before the launch record".into() });
            }
        };
        self.write(a, event)?;
        a.state = Some(next);
        Ok(())
    }

    fn write(&self, a: &mut Appender, event: &Event) -> Result<(), JournalError> {
        let io = |source| JournalError::Io { dir: self.path.parent().unwrap_or(Path::new(".")).to_path_buf(), source };
        if let Some(why) = &a.broken {
            return Err(JournalError::Invalid {
                file: self.path.clone(),
                message: format!("refusing to write after a failed write: {why}"),
            });
        }
        let seq = a.seq + 1;
        let unix_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        let mut text = serde_json::to_string(&Line { seq, unix_ms, event: event.clone() })
            .map_err(|e| JournalError::Invalid { file: self.path.clone(), message: e.to_string() })?;
        text.push('\n');
        #[cfg(test)]
        if a.fail_writes > 0 {
            a.fail_writes -= 1;
            return Err(io(std::io::Error::from(std::io::ErrorKind::StorageFull)));
        }
        let fault = a.fault.filter(|f| f.line == seq).map(|f| f.kind);
        match fault {
            Some(JournalFaultKind::CrashBefore) => die(),
            Some(JournalFaultKind::Fail) => {
                a.fault = None;
                return Err(io(std::io::Error::from(std::io::ErrorKind::StorageFull)));
            }
            _ => {}
        }
        match a.file.write_all(text.as_bytes()).and_then(|()| a.file.sync_data()) {
            Ok(()) => {
                a.seq = seq;
                a.len += text.len() as u64;
                if fault == Some(JournalFaultKind::CrashAfter) {
                    die();
                }
                Ok(())
            }
            Err(e) => {
                let len = a.len;
                if let Err(cut) = a.file.set_len(len).and_then(|()| a.file.sync_data()) {
                    a.broken = Some(format!("{e}; cutting the partial line off failed too: {cut}"));
                }
                Err(io(e))
            }
        }
    }

    /// [`Journal::record`], logging instead of failing (a step that already happened on the
    /// workers cannot be undone because the disk is full; the report says what happened).
    pub fn note(&self, event: Event) {
        if let Err(e) = self.record(event) {
            tracing::error!("journal {}: {e}", self.path.display());
            eprintln!("warning: could not write the journal {}: {e}", self.path.display());
        }
    }
}

/// Why an event cannot follow what a journal holds.
#[derive(Debug)]
enum Refusal {
    Begin(BeginRefused),
    Other(String),
}

impl Replayed {
    /// What a journal holds right after its launch record.
    fn launched(plan: PlanRecord) -> Self {
        Self {
            current: plan.source.clone(),
            current_version: plan.version.clone(),
            plan,
            pending: None,
            shut_down: false,
            last_update: 0,
            decided: BTreeMap::new(),
            settling: None,
            torn_tail: false,
            lines: 0,
            complete_bytes: 0,
        }
    }

    /// An update left settling whose every commit is now confirmed: its target is what every
    /// replica serves.
    fn settle(&mut self) {
        if self.settling.as_ref().is_some_and(|st| st.unconfirmed.is_empty())
            && let Some(done) = self.settling.take()
        {
            self.current = done.to;
            self.current_version = done.version;
        }
    }

    /// Takes one event after the launch record, as replay reads it and as the writer keeps it
    /// (the one place each rule is written: the writer refuses, unwritten, what this refuses).
    fn apply(&mut self, event: Event) -> Result<(), Refusal> {
        let s = self;
        match event {
            Event::Launched(_) => return Err(Refusal::Other("a second launch record".into())),
            Event::UpdateBegin { update, from, to, new_version, max_unavailable, resumes } => {
                // A resumed update is closed here as its own end (not applied) would close it.
                check_begin(s.pending.as_ref().map(|p| p.update), update, resumes).map_err(Refusal::Begin)?;
                s.last_update = s.last_update.max(update);
                s.pending = Some(PendingUpdate { update, from, to, new_version, max_unavailable, steps: BTreeMap::new() });
                s.settling = None;
            }
            Event::UpdateStep { update, dp, step } => match &mut s.pending {
                Some(p) if p.update == update && dp < s.plan.dp => {
                    if step == Step::Aborted && p.steps.get(&dp) == Some(&Step::Decided) {
                        return Err(Refusal::Other(format!("replica dp{dp} aborted after its commit was decided")));
                    }
                    p.steps.insert(dp, step);
                    match step {
                        Step::Decided => {
                            s.decided.insert(dp, p.new_version.clone());
                        }
                        Step::Committed | Step::RolledBack => {
                            s.decided.remove(&dp);
                        }
                        Step::Staging | Step::Verified | Step::Aborted => {}
                    }
                }
                _ => return Err(Refusal::Other(format!("a step of update {update} (replica dp{dp}) outside that update"))),
            },
            Event::UpdateEnd { update, ok, .. } => match s.pending.take() {
                Some(p) if p.update == update => {
                    if ok {
                        s.current = p.to;
                        s.current_version = p.new_version;
                    } else {
                        s.settling = Settling::after(p.to, p.new_version, &p.steps);
                        // Every commit it decided may have been confirmed before it ended.
                        s.settle();
                    }
                }
                _ => return Err(Refusal::Other(format!("update {update} ends without having begun"))),
            },
            Event::CommitConfirmed { dp, version } => {
                if s.decided.get(&dp) != Some(&version) {
                    return Err(Refusal::Other(format!("replica dp{dp} confirms a commit to {version} that was not decided")));
                }
                s.decided.remove(&dp);
                // Confirmed while its update is still open (the update let the replica go with
                // its commit unconfirmed, and the health loop finished it): the replica is
                // committed in that update.
                if let Some(p) = s.pending.as_mut()
                    && p.new_version == version
                    && p.steps.get(&dp) == Some(&Step::Decided)
                {
                    p.steps.insert(dp, Step::Committed);
                }
                // The last confirmation of an update that ended only short of them: its
                // target is what every replica serves.
                if let Some(settling) = s.settling.as_mut() {
                    settling.confirm(dp, &version);
                }
                s.settle();
            }
            Event::Recovered { .. } => s.shut_down = false,
            Event::Shutdown => s.shut_down = true,
        }
        Ok(())
    }
}

/// Replays the journal at `path`: `None` when it records no launch.
pub fn replay(path: &Path) -> Result<Option<Replayed>, JournalError> {
    let bytes =
        orchestrator_proto::limits::read_bounded(path, orchestrator_proto::limits::MAX_JOURNAL_BYTES).map_err(|e| match e.kind() {
            std::io::ErrorKind::InvalidData => JournalError::Invalid { file: path.to_path_buf(), message: e.to_string() },
            _ => JournalError::Io { dir: path.parent().unwrap_or(Path::new(".")).to_path_buf(), source: e },
        })?;
    let complete_bytes = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1) as u64;
    let text = String::from_utf8_lossy(&bytes);
    let complete = text.ends_with('\n') || text.is_empty();
    let lines: Vec<&str> = text.lines().collect();
    let mut state: Option<Replayed> = None;
    let mut torn_tail = false;
    for (i, line) in lines.iter().enumerate() {
        let last = i + 1 == lines.len();
        let corrupt = |message: String| JournalError::Corrupt { file: path.to_path_buf(), line: i + 1, message };
        // A last line without its newline was cut short by a kill (even if what was written
        // parses): the step it records was never confirmed on disk.
        if last && !complete {
            torn_tail = true;
            break;
        }
        let parsed: Line = serde_json::from_str(line).map_err(|e| corrupt(e.to_string()))?;
        if parsed.seq != i as u64 + 1 {
            return Err(corrupt(format!("sequence number {} where {} was expected", parsed.seq, i + 1)));
        }
        match parsed.event {
            Event::Launched(plan) => state = Some(Replayed::launched(plan)),
            other => {
                let s = state.as_mut().ok_or_else(|| corrupt("an event before the launch record".into()))?;
                s.apply(other).map_err(|e| match e {
                    Refusal::Begin(refused) => JournalError::Begin { file: path.to_path_buf(), line: Some(i + 1), refused },
                    Refusal::Other(message) => corrupt(message),
                })?;
            }
        }
    }
    if let Some(s) = state.as_mut() {
        s.torn_tail = torn_tail;
        s.lines = (lines.len() - usize::from(torn_tail)) as u64;
        s.complete_bytes = complete_bytes;
    }
    Ok(state)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> PlanRecord {
        PlanRecord {
            coordinator: "127.0.0.1:5000".into(),
            tp: 2,
            dp: 2,
            source: SourceRecord::Checkpoint { dir: "/ck/A".into() },
            source_desc: "checkpoint /ck/A".into(),
            scale_rule: "rceil".into(),
            probe: Some((2, 16, 0)),
            token_file: "/state/token".into(),
            tls_dir: None,
            workers: (0..4)
                .map(|id| WorkerRecord {
                    id,
                    dp: id / 2,
                    tp: id % 2,
                    address: format!("http://127.0.0.1:{}", 6000 + id),
                    pid: 100 + id,
                    collective: format!("127.0.0.1:{}", 7000 + id),
                    nccl_unique_id: if id % 2 == 0 { to_hex(&[0, 1, 0xfe, 0xff]) } else { String::new() },
                    start_ticks: 1000 + u64::from(id),
                    boot_id: "boot".into(),
                    executable: "/usr/bin/orchestrator-worker".into(),
                    remote: id == 3,
                    host: format!("n{}", id / 2),
                })
                .collect(),
            version: "va".into(),
            allow_roots: vec!["/ck".into()],
            commit_timeout_ms: Some(20_000),
        }
    }

    fn begin(update: u64) -> Event {
        Event::UpdateBegin {
            update,
            from: SourceRecord::Checkpoint { dir: "/ck/A".into() },
            to: SourceRecord::Checkpoint { dir: "/ck/B".into() },
            new_version: "vb".into(),
            max_unavailable: 1,
            resumes: None,
        }
    }

    #[test]
    fn hex_round_trips() {
        assert_eq!(to_hex(&[0, 1, 0xab, 0xff]), "0001abff");
        assert_eq!(from_hex("0001abFF"), Some(vec![0, 1, 0xab, 0xff]));
        assert_eq!(from_hex(""), Some(vec![]));
        for bad in ["0", "zz", "0g", "é1"] {
            assert_eq!(from_hex(bad), None, "{bad}");
        }
    }

    #[test]
    fn replays_a_pending_update_and_a_finished_one() {
        let tmp = tempfile::tempdir().unwrap();
        let j = Journal::create(tmp.path()).unwrap();
        j.record(Event::Launched(plan())).unwrap();
        j.record(begin(1)).unwrap();
        j.record(Event::UpdateStep { update: 1, dp: 0, step: Step::Staging }).unwrap();
        j.record(Event::UpdateStep { update: 1, dp: 0, step: Step::Committed }).unwrap();
        j.record(Event::UpdateStep { update: 1, dp: 1, step: Step::Staging }).unwrap();
        let r = replay(j.path()).unwrap().unwrap();
        assert_eq!(r.plan, plan());
        assert_eq!(r.current_version, "va");
        let p = r.pending.clone().unwrap();
        assert_eq!((p.update, p.new_version.as_str()), (1, "vb"));
        assert_eq!(p.steps, BTreeMap::from([(0, Step::Committed), (1, Step::Staging)]));
        assert!(!r.shut_down && !r.torn_tail);

        j.record(Event::UpdateEnd { update: 1, ok: true, note: String::new() }).unwrap();
        let r = replay(j.path()).unwrap().unwrap();
        assert_eq!(r.pending, None);
        assert_eq!((r.current_version.as_str(), &r.current), ("vb", &SourceRecord::Checkpoint { dir: "/ck/B".into() }));
        // A live cluster's directory is not reused by a new launch.
        drop(j);
        let e = Journal::create(tmp.path()).err().unwrap();
        assert!(matches!(e, JournalError::Invalid { .. }) && e.to_string().contains("orchestrator recover"), "{e}");
    }

    /// What every replica serves after an update that ended not applied: its target once every
    /// replica it reached is committed (a replica with a dead rank skipped: never reached) or
    /// its decided commit is confirmed after the end; the version before while a replica it
    /// reached stays behind (aborted, or still staging), or once another update begins.
    #[test]
    fn an_update_ended_short_of_confirmations_settles_on_its_target() {
        let b = SourceRecord::Checkpoint { dir: "/ck/B".into() };
        let run = |steps: &[(u32, Step)], after: &[Event]| {
            let tmp = tempfile::tempdir().unwrap();
            let j = Journal::create(tmp.path()).unwrap();
            j.record(Event::Launched(plan())).unwrap();
            j.record(begin(1)).unwrap();
            for &(dp, step) in steps {
                j.record(Event::UpdateStep { update: 1, dp, step }).unwrap();
            }
            j.record(Event::UpdateEnd { update: 1, ok: false, note: "short".into() }).unwrap();
            for e in after {
                j.record(e.clone()).unwrap();
            }
            let r = replay(j.path()).unwrap().unwrap();
            (r.current_version, r.current, r.settling.map(|s| s.unconfirmed))
        };
        let through = |dp, last| {
            let all = [Step::Staging, Step::Verified, Step::Decided, Step::Committed];
            all.into_iter().take_while(move |s| *s != last).chain([last]).map(move |s| (dp, s)).collect::<Vec<_>>()
        };
        let confirm = |dp| Event::CommitConfirmed { dp, version: "vb".into() };
        let a = SourceRecord::Checkpoint { dir: "/ck/A".into() };
        let both_decided: Vec<_> = [through(0, Step::Committed), through(1, Step::Decided)].concat();
        // dp1's commit unconfirmed at the end: settling; confirmed after it: the target.
        assert_eq!(run(&both_decided, &[]), ("va".into(), a.clone(), Some(BTreeSet::from([1]))));
        assert_eq!(run(&both_decided, &[confirm(1)]), ("vb".into(), b.clone(), None));
        // dp0's commit confirmed while the update was still open (it let dp0 go unconfirmed and
        // the health loop finished it): committed in that update.
        let late = [through(0, Step::Decided), through(1, Step::Committed)].concat();
        let tmp = tempfile::tempdir().unwrap();
        let j = Journal::create(tmp.path()).unwrap();
        j.record(Event::Launched(plan())).unwrap();
        j.record(begin(1)).unwrap();
        for (i, &(dp, step)) in late.iter().enumerate() {
            j.record(Event::UpdateStep { update: 1, dp, step }).unwrap();
            if i == 2 {
                j.record(confirm(0)).unwrap();
            }
        }
        j.record(Event::UpdateEnd { update: 1, ok: false, note: "short".into() }).unwrap();
        assert_eq!(j.serving(), Some((b.clone(), "vb".into())), "the writer's account");
        assert_eq!(replay(j.path()).unwrap().unwrap().current_version, "vb", "replay's");
        // dp1 skipped (a dead rank): every replica reached committed.
        assert_eq!(run(&through(0, Step::Committed), &[]), ("vb".into(), b.clone(), None));
        // dp1 aborted, or never past staging: the version before.
        for dp1 in [vec![(1, Step::Staging), (1, Step::Aborted)], vec![(1, Step::Staging)]] {
            assert_eq!(run(&[through(0, Step::Committed), dp1].concat(), &[]), ("va".into(), a.clone(), None));
        }
        // Another update begins first: its own end decides (nothing settles from update 1).
        let mut second = begin(2);
        if let Event::UpdateBegin { to, new_version, .. } = &mut second {
            *to = SourceRecord::Checkpoint { dir: "/ck/C".into() };
            *new_version = "vc".into();
        }
        let after = [second, Event::UpdateEnd { update: 2, ok: false, note: "refused".into() }, confirm(1)];
        assert_eq!(run(&both_decided, &after), ("va".into(), a, None));
    }

    /// A commit decision outlives the update that made it until a confirmation follows, in that
    /// update or after it; a confirmation of an undecided commit is corruption.
    #[test]
    fn commit_decisions_are_replayed_until_confirmed() {
        let tmp = tempfile::tempdir().unwrap();
        let j = Journal::create(tmp.path()).unwrap();
        j.record(Event::Launched(plan())).unwrap();
        j.record(begin(1)).unwrap();
        for (dp, step) in [(0, Step::Staging), (0, Step::Verified), (0, Step::Decided), (0, Step::Committed), (1, Step::Staging)] {
            j.record(Event::UpdateStep { update: 1, dp, step }).unwrap();
        }
        assert!(replay(j.path()).unwrap().unwrap().decided.is_empty());
        j.record(Event::UpdateStep { update: 1, dp: 1, step: Step::Verified }).unwrap();
        j.record(Event::UpdateStep { update: 1, dp: 1, step: Step::Decided }).unwrap();
        assert_eq!(replay(j.path()).unwrap().unwrap().decided, BTreeMap::from([(1, "vb".to_string())]));
        // The update ends with dp1's commit unconfirmed (a rank stalled): the decision stays.
        j.record(Event::UpdateEnd { update: 1, ok: false, note: "dp1: commit pending".into() }).unwrap();
        let r = replay(j.path()).unwrap().unwrap();
        assert_eq!((r.pending.as_ref(), r.decided.get(&1).map(String::as_str)), (None, Some("vb")));
        j.record(Event::CommitConfirmed { dp: 1, version: "vb".into() }).unwrap();
        assert!(replay(j.path()).unwrap().unwrap().decided.is_empty());
        let e = j.record(Event::CommitConfirmed { dp: 0, version: "vb".into() }).unwrap_err();
        assert!(matches!(e, JournalError::Refused { .. }), "{e}");
        plant(j.path(), 12, Event::CommitConfirmed { dp: 0, version: "vb".into() });
        let e = replay(j.path()).unwrap_err();
        assert!(matches!(e, JournalError::Corrupt { line: 12, .. }), "{e}");

        // An abort after a commit decision is never written, and never accepted.
        let tmp = tempfile::tempdir().unwrap();
        let j = Journal::create(tmp.path()).unwrap();
        j.record(Event::Launched(plan())).unwrap();
        j.record(begin(1)).unwrap();
        j.record(Event::UpdateStep { update: 1, dp: 0, step: Step::Decided }).unwrap();
        assert!(matches!(j.record(Event::UpdateStep { update: 1, dp: 0, step: Step::Aborted }), Err(JournalError::Refused { .. })));
        plant(j.path(), 4, Event::UpdateStep { update: 1, dp: 0, step: Step::Aborted });
        let e = replay(j.path()).unwrap_err();
        assert!(matches!(&e, JournalError::Corrupt { line: 4, message, .. } if message.contains("after its commit was decided")), "{e}");
    }

    /// While a coordinator holds the state directory, neither a new launch nor a recovery may
    /// touch it; once it is gone, the directory opens again.
    #[test]
    fn a_held_state_directory_is_refused_untouched() {
        let tmp = tempfile::tempdir().unwrap();
        let j = Journal::create(tmp.path()).unwrap();
        j.record(Event::Launched(plan())).unwrap();
        let before = std::fs::read(j.path()).unwrap();
        assert!(matches!(Journal::open(tmp.path()), Err(JournalError::Locked { .. })));
        let e = Journal::create(tmp.path()).err().unwrap();
        assert!(matches!(&e, JournalError::Locked { holder, .. } if holder.contains(&std::process::id().to_string())), "{e}");
        assert_eq!(std::fs::read(j.path()).unwrap(), before);
        drop(j);
        let (_j, r) = Journal::open(tmp.path()).unwrap();
        assert_eq!(r.plan, plan());
    }

    /// A plan no launch could have written is named and refused by `open`, which leaves the
    /// journal as it was (its torn tail included); each kind of damage is caught.
    #[test]
    fn a_plan_no_launch_could_write_is_refused_untouched() {
        assert_eq!(plan().check(), Ok(()));
        type Damage = (fn(&mut PlanRecord), &'static str);
        let table: Vec<Damage> = vec![
            (|p| p.dp = 0, "DP size must be at least 1"),
            (|p| p.tp = 4096, "TP size is 4096"),
            (|p| p.dp = u32::MAX, "world size"),
            (|p| p.tp = 1, "4 workers for tp 1 x dp 2 = 2 ranks"),
            (|p| p.workers[3].tp = 2, "worker 3 (dp1/tp2): not a rank"),
            (|p| p.workers[3].id = 2, "worker 2 (dp1/tp1): not a rank"),
            (
                |p| {
                    p.workers[3] = p.workers[2].clone();
                },
                "worker 2 (dp1/tp0): recorded twice",
            ),
            (|p| p.workers[0].nccl_unique_id = "zz".into(), "worker 0 (dp0/tp0): nccl_unique_id is not hex"),
            (|p| p.probe = Some((0, 16, 0)), "probe 0,16,0: probe tokens must be at least 1"),
            (|p| p.commit_timeout_ms = Some(0), "commit_timeout_ms 0"),
            (|p| p.commit_timeout_ms = Some(u64::MAX), "commit_timeout_ms 18446744073709551615"),
        ];
        for (damage, want) in table {
            let mut p = plan();
            damage(&mut p);
            let e = p.check().unwrap_err();
            assert!(e.contains(want), "{e} (want {want})");
            let tmp = tempfile::tempdir().unwrap();
            let j = Journal::create(tmp.path()).unwrap();
            j.record(Event::Launched(p)).unwrap();
            drop(j);
            let path = tmp.path().join(JOURNAL_FILE);
            let mut f = OpenOptions::new().append(true).open(&path).unwrap();
            f.write_all(b"{\"seq\":2,\"unix").unwrap();
            drop(f);
            let before = std::fs::read(&path).unwrap();
            let e = Journal::open(tmp.path()).err().unwrap();
            assert!(matches!(&e, JournalError::Invalid { message, .. } if message.contains(want)), "{e}");
            assert_eq!(std::fs::read(&path).unwrap(), before, "{want}: the journal is untouched");
        }
    }

    /// Appends `event` to the journal at `path` by hand, as line `seq` (what the writer refuses to
    /// write, for replay to refuse).
    fn plant(path: &Path, seq: u64, event: Event) {
        let mut f = OpenOptions::new().append(true).open(path).unwrap();
        writeln!(f, "{}", serde_json::to_string(&Line { seq, unix_ms: 0, event }).unwrap()).unwrap();
    }

    /// `begin(update)` resuming update `r`.
    fn resume(update: u64, r: u64) -> Event {
        match begin(update) {
            Event::UpdateBegin { update, from, to, new_version, max_unavailable, .. } => {
                Event::UpdateBegin { update, from, to, new_version, max_unavailable, resumes: Some(r) }
            }
            _ => unreachable!(),
        }
    }

    /// A recovery's update closes the interrupted one in its begin's line (nothing in flight
    /// between them); a resuming begin that cannot be written leaves the interrupted update's
    /// end owed.
    #[test]
    fn a_resuming_begin_closes_the_interrupted_update_in_one_line() {
        let tmp = tempfile::tempdir().unwrap();
        let j = Journal::create(tmp.path()).unwrap();
        j.record(Event::Launched(plan())).unwrap();
        j.record(begin(1)).unwrap();
        j.record(resume(2, 1)).unwrap();
        let r = replay(j.path()).unwrap().unwrap();
        assert_eq!((r.lines, r.pending.map(|p| p.update), r.current_version.as_str()), (3, Some(2), "va"), "update 1 not applied");
        // A resuming begin that fails leaves the interrupted update's end owed.
        let tmp = tempfile::tempdir().unwrap();
        let j = Journal::create(tmp.path()).unwrap();
        j.record(Event::Launched(plan())).unwrap();
        j.record(begin(1)).unwrap();
        j.file.lock().unwrap().fail_writes = 1;
        assert!(j.record(resume(2, 1)).is_err());
        j.record(Event::Recovered { note: "next".into() }).unwrap();
        let r = replay(j.path()).unwrap().unwrap();
        assert_eq!((r.lines, r.pending.map(|p| p.update)), (4, None), "the owed end, then the event");
    }

    /// The writer and replay keep one rule for a begin: for every update open (none, 1, 2), every
    /// update number and every update resumed (none, 1 to 3), the writer takes the begin exactly
    /// where replay takes a journal holding it, and refuses it (unwritten) for the reason replay
    /// gives, with its line, for the same line written by hand. The begins taken are exactly a
    /// plain begin with nothing open and a later update's begin resuming the open one.
    #[test]
    fn the_writer_and_replay_take_and_refuse_the_same_begins() {
        let mut taken = Vec::new();
        for open in [None, Some(1), Some(2)] {
            for update in 1..=3 {
                for resumes in [None, Some(1), Some(2), Some(3)] {
                    let case = format!("open {open:?}, update {update}, resumes {resumes:?}");
                    let tmp = tempfile::tempdir().unwrap();
                    let j = Journal::create(tmp.path()).unwrap();
                    j.record(Event::Launched(plan())).unwrap();
                    if let Some(open) = open {
                        j.record(begin(open)).unwrap();
                    }
                    let event = match resumes {
                        Some(r) => resume(update, r),
                        None => begin(update),
                    };
                    let lines = 1 + u64::from(open.is_some());
                    match j.record(event.clone()) {
                        Ok(()) => {
                            let r = replay(j.path()).unwrap().unwrap();
                            assert_eq!((r.lines, r.pending.map(|p| p.update)), (lines + 1, Some(update)), "{case}");
                            taken.push((open, update, resumes));
                        }
                        Err(JournalError::Begin { line: None, refused, .. }) => {
                            assert_eq!(replay(j.path()).unwrap().unwrap().lines, lines, "{case}: unwritten");
                            plant(j.path(), lines + 1, event);
                            match replay(j.path()) {
                                Err(JournalError::Begin { line: Some(at), refused: why, .. }) => {
                                    assert_eq!((at as u64, why), (lines + 1, refused), "{case}")
                                }
                                other => panic!("{case}: the writer refused it ({refused}), replay gave {other:?}"),
                            }
                        }
                        Err(e) => panic!("{case}: {e}"),
                    }
                }
            }
        }
        // An update number past the range is refused whatever else holds.
        for open in [None, Some(1)] {
            assert_eq!(check_begin(open, MAX_UPDATE + 1, open), Err(BeginRefused::OutOfRange { update: MAX_UPDATE + 1 }));
        }
        assert_eq!(check_begin(None, MAX_UPDATE, None), Ok(()));
        let want: Vec<_> =
            [(None, 1, None), (None, 2, None), (None, 3, None), (Some(1), 2, Some(1)), (Some(1), 3, Some(1)), (Some(2), 3, Some(2))]
                .into_iter()
                .collect();
        let mut got = taken;
        got.sort();
        let mut want = want;
        want.sort();
        assert_eq!(got, want);
    }

    /// Every event replay would refuse to find after what the journal holds is refused
    /// unwritten by the writer (the journal stays replayable, and the next event goes on).
    #[test]
    fn events_replay_would_refuse_are_refused_unwritten() {
        let tmp = tempfile::tempdir().unwrap();
        let j = Journal::create(tmp.path()).unwrap();
        assert!(matches!(j.record(Event::Recovered { note: "x".into() }), Err(JournalError::Refused { .. })), "before the launch");
        j.record(Event::Launched(plan())).unwrap();
        let refused = [
            Event::UpdateStep { update: 1, dp: 0, step: Step::Staging },
            Event::UpdateEnd { update: 1, ok: true, note: String::new() },
            Event::CommitConfirmed { dp: 0, version: "vb".into() },
        ];
        for e in refused {
            let got = j.record(e.clone());
            assert!(matches!(got, Err(JournalError::Refused { .. })), "{e:?}: {got:?}");
        }
        j.record(begin(1)).unwrap();
        for (dp, step) in [(0, Step::Staging), (0, Step::Verified), (0, Step::Decided)] {
            j.record(Event::UpdateStep { update: 1, dp, step }).unwrap();
        }
        let more = [
            Event::UpdateStep { update: 1, dp: 0, step: Step::Aborted },
            Event::UpdateStep { update: 1, dp: 7, step: Step::Staging },
            Event::UpdateStep { update: 2, dp: 0, step: Step::Staging },
            Event::CommitConfirmed { dp: 0, version: "vz".into() },
        ];
        for e in more {
            let got = j.record(e.clone());
            assert!(matches!(got, Err(JournalError::Refused { .. })), "{e:?}: {got:?}");
        }
        let r = replay(j.path()).unwrap().unwrap();
        assert_eq!(r.lines, 5, "nothing refused was written");
        j.record(Event::UpdateStep { update: 1, dp: 0, step: Step::Committed }).unwrap();
        j.record(Event::UpdateEnd { update: 1, ok: true, note: String::new() }).unwrap();
        assert_eq!(replay(j.path()).unwrap().unwrap().current_version, "vb");
    }

    /// A begin over an update the journal holds open is refused unwritten (replay would refuse
    /// the journal from that line on); the update open is tracked across writes and a reopen.
    #[test]
    fn a_begin_over_an_open_update_is_refused_unwritten() {
        let tmp = tempfile::tempdir().unwrap();
        let j = Journal::create(tmp.path()).unwrap();
        j.record(Event::Launched(plan())).unwrap();
        assert_eq!(j.open_update(), None);
        j.record(begin(1)).unwrap();
        assert_eq!(j.open_update(), Some(1));
        let e = j.record(begin(2)).unwrap_err();
        assert!(matches!(e, JournalError::Begin { line: None, refused: BeginRefused::OverOpen { update: 2, open: 1 }, .. }), "{e}");
        assert!(e.to_string().ends_with("journal.jsonl: update 2 begins while update 1 has not ended"), "{e}");
        drop(j);
        let (j, r) = Journal::open(tmp.path()).unwrap();
        assert_eq!((r.lines, j.open_update()), (2, Some(1)), "nothing written; still open after a reopen");
        assert!(j.record(begin(2)).is_err());
        j.record(Event::UpdateEnd { update: 1, ok: false, note: "closed".into() }).unwrap();
        assert_eq!(j.open_update(), None);
        j.record(begin(2)).unwrap();
        assert_eq!(replay(j.path()).unwrap().unwrap().pending.map(|p| p.update), Some(2));
    }

    /// `--journal-fault fail:N` fails the write of line N once, leaving nothing of it and using
    /// up no sequence number; the faults parse as the flag documents them.
    #[test]
    fn a_journal_fault_fails_its_line_once() {
        let tmp = tempfile::tempdir().unwrap();
        let j = Journal::create(tmp.path()).unwrap();
        j.inject_fault("fail:2".parse().unwrap());
        j.record(Event::Launched(plan())).unwrap();
        assert!(matches!(j.record(begin(1)), Err(JournalError::Io { source, .. }) if source.kind() == std::io::ErrorKind::StorageFull));
        assert_eq!(replay(j.path()).unwrap().unwrap().lines, 1);
        j.record(begin(1)).unwrap();
        let r = replay(j.path()).unwrap().unwrap();
        assert_eq!((r.lines, r.pending.map(|p| p.update)), (2, Some(1)));
        let parsed: JournalFault = "crash-before:7".parse().unwrap();
        assert_eq!(parsed, JournalFault { kind: JournalFaultKind::CrashBefore, line: 7 });
        assert_eq!("crash-after:1".parse::<JournalFault>().unwrap().kind, JournalFaultKind::CrashAfter);
        for bad in ["crash", "crash-before:0", "crash-before:x", "explode:3", "fail:-1"] {
            assert!(bad.parse::<JournalFault>().is_err(), "{bad}");
        }
    }

    /// An update's end lost to a failed write (a full disk) is written before the next event:
    /// the next update's begin never lands over an update that did not end, which replay
    /// refuses (and with it `recover`). While it cannot be written, nothing after it is.
    #[test]
    fn an_update_end_lost_to_a_failed_write_is_written_before_the_next_event() {
        let tmp = tempfile::tempdir().unwrap();
        let j = Journal::create(tmp.path()).unwrap();
        j.record(Event::Launched(plan())).unwrap();
        j.record(begin(1)).unwrap();
        let fail = |n| j.file.lock().unwrap().fail_writes = n;
        fail(1);
        j.note(Event::UpdateEnd { update: 1, ok: true, note: "done".into() });
        assert_eq!(replay(j.path()).unwrap().unwrap().pending.map(|p| p.update), Some(1), "the end is not on disk");
        // The owed end fails again: the next update's begin is refused, unwritten.
        fail(1);
        assert!(matches!(j.record(begin(2)), Err(JournalError::Io { .. })));
        let r = replay(j.path()).unwrap().unwrap();
        assert_eq!((r.lines, r.pending.map(|p| p.update)), (2, Some(1)));
        // The disk has room again: the end first, then the begin.
        j.record(begin(2)).unwrap();
        let r = replay(j.path()).unwrap().unwrap();
        assert_eq!((r.lines, r.pending.as_ref().map(|p| p.update)), (4, Some(2)), "update 1 ended, update 2 open");
        assert_eq!(r.current_version, "vb", "update 1's end is the one the coordinator meant (ok)");
        // An end owed and the same end written again: written once.
        fail(1);
        j.note(Event::UpdateEnd { update: 2, ok: false, note: "refused".into() });
        j.record(Event::UpdateEnd { update: 2, ok: false, note: "refused".into() }).unwrap();
        let r = replay(j.path()).unwrap().unwrap();
        assert_eq!((r.lines, r.pending.is_none()), (5, true));
    }

    #[test]
    fn a_torn_last_line_is_dropped_and_appending_goes_on() {
        let tmp = tempfile::tempdir().unwrap();
        let j = Journal::create(tmp.path()).unwrap();
        j.record(Event::Launched(plan())).unwrap();
        j.record(begin(1)).unwrap();
        drop(j);
        let path = tmp.path().join(JOURNAL_FILE);
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(b"{\"seq\":3,\"unix_ms\":1,\"event\":\"update_st").unwrap();
        drop(f);
        let (j, r) = Journal::open(tmp.path()).unwrap();
        assert!(r.torn_tail);
        assert_eq!(r.lines, 2);
        assert_eq!(r.pending.as_ref().map(|p| p.update), Some(1));
        j.record(Event::UpdateEnd { update: 1, ok: false, note: "rolled back".into() }).unwrap();
        let r = replay(&path).unwrap().unwrap();
        assert!(!r.torn_tail && r.pending.is_none());
        assert_eq!(r.current_version, "va");
        // A whole event written without its newline (killed between the two) is torn too:
        // appending after it would glue two events onto one line.
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(br#"{"seq":4,"unix_ms":1,"event":"shutdown"}"#).unwrap();
        drop(f);
        drop(j);
        let (j, r) = Journal::open(tmp.path()).unwrap();
        assert!(r.torn_tail && !r.shut_down);
        j.record(Event::Shutdown).unwrap();
        let r = replay(&path).unwrap().unwrap();
        assert!(!r.torn_tail && r.shut_down);
        assert_eq!(r.lines, 4);
    }

    #[test]
    fn damage_other_than_a_torn_tail_is_refused_with_the_line() {
        let tmp = tempfile::tempdir().unwrap();
        let j = Journal::create(tmp.path()).unwrap();
        j.record(Event::Launched(plan())).unwrap();
        j.record(begin(1)).unwrap();
        j.record(Event::Shutdown).unwrap();
        let path = tmp.path().join(JOURNAL_FILE);
        let text = std::fs::read_to_string(&path).unwrap();
        let cases = [
            (text.replacen("\"seq\":2", "\"seq\":7", 1), 2, "sequence"),
            (text.replacen("update_begin", "update_bgin", 1), 2, "unknown variant"),
            (
                text.lines().skip(1).map(|l| format!("{l}\n")).collect::<String>().replacen("\"seq\":2", "\"seq\":1", 1),
                1,
                "before the launch",
            ),
            (text.replacen("\"seq\":3,", "\"seq\":3,\"x\":", 1) + "", 3, ""),
        ];
        for (damaged, line, what) in cases {
            std::fs::write(&path, &damaged).unwrap();
            match replay(&path) {
                Err(JournalError::Corrupt { line: l, message, file }) => {
                    assert_eq!(l, line, "{message}");
                    assert!(message.contains(what), "{message}");
                    assert_eq!(file, path);
                }
                other => panic!("{what}: {other:?}"),
            }
        }
        // An update step outside any update.
        std::fs::write(&path, &text).unwrap();
        drop(j);
        let (j, _) = Journal::open(tmp.path()).unwrap();
        assert!(matches!(j.record(Event::UpdateStep { update: 9, dp: 0, step: Step::Staging }), Err(JournalError::Refused { .. })));
        plant(&path, 4, Event::UpdateStep { update: 9, dp: 0, step: Step::Staging });
        assert!(matches!(replay(&path), Err(JournalError::Corrupt { line: 4, .. })));
        assert!(matches!(Journal::open(&tmp.path().join("missing")), Err(JournalError::Io { .. })));
    }
}
