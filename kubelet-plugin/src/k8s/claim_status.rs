//! What a claim got, in the claim: `ResourceClaim.status.devices` entries (KEP-4817,
//! `keps/sig-node/4817-resource-claim-device-status`; resource.k8s.io/v1
//! `AllocatedDeviceStatus`), written by this node's plugin for its own devices.
//!
//! - At prepare the handler hands the driver's [`ClaimStatusReport`] to [`ClaimStatusWriter`]
//!   and answers the kubelet at once: the write runs in a background task, so it never sits on
//!   the pod start path. A failed write is logged and counted; the claim stays served.
//! - Each entry carries the driver's versioned `data` (see `docs/attributes.md`) and two
//!   conditions: `Ready` (prepared, or why not) and `Healthy` (from [`DeviceHealth`]: an Xid
//!   or a lost GPU turns it `False` with the event in the message). A health change rewrites
//!   the entries of every claim on the device.
//! - At unprepare the entries are removed (the API server also drops entries whose device
//!   left the allocation, but an unprepared claim may stay allocated).
//!
//! Only this driver's entries in this node's pool are touched: the writer keeps every other
//! entry as it is and replaces the status (`PUT …/status` with the resourceVersion of the
//! object it starts from, so a stale object is refused with 409 Conflict and can never revert
//! someone else's change). It never changes `status.allocation` or
//! `status.reservedFor`, so the API server's granular status authorization (gate
//! `DRAResourceClaimGranularStatusAuthorization`, beta from 1.36) checks only
//! `resourceclaims/driver` with `associated-node:update` for this driver's name, which lets a
//! node's plugin write only claims allocated to its node (kubernetes
//! `pkg/registry/resource/utils.go`, AuthorizedForDeviceStatus).
//!
//! Requests per claim: the object a write starts from is the one the handler read at prepare
//! (handed over with the report), then what the last successful write returned; only a 409
//! Conflict (or a claim this process has not seen, e.g. after a plugin restart) costs a GET.
//! So a claim costs one GET (the handler's) and one status write at prepare, and one write
//! and no read at unprepare. The objects are kept only for prepared claims and claims with a
//! write pending, and dropped once the unprepare's write is done.
//!
//! Writes stand aside for the node's own work: none starts while a prepare or unprepare batch
//! runs or within [`SETTLE`] after one ended (the kubelet often sends the next batch at once:
//! another pod's claims, or the unprepare of a pod that failed to start), unless it has waited
//! [`MAX_DEFER`] already. Wishes for one claim made meanwhile replace each other, so a claim
//! unprepared before its entries were written costs no write at all (its object from the
//! prepare shows none of our entries).
//!
//! At shutdown the plugin flushes the writer ([`ClaimStatusWriter::flush`]): every pending
//! write is tried once at once, so entries do not wait for the next start.
//!
//! Failed writes are retried with exponential back-off (from [`INITIAL_BACKOFF`] up to
//! [`MAX_BACKOFF`], at most [`MAX_ATTEMPTS`] tries); a newer wish for the same claim (a
//! health change, the unprepare) replaces the one being retried. A claim that is gone, or
//! was replaced by another of the same name, is dropped without error.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use cleave_driver::prepare::{ClaimStatusReport, DeviceStatusEntry};
use k8s_openapi::api::resource::v1::{AllocatedDeviceStatus, ResourceClaim};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::apimachinery::pkg::runtime::RawExtension;
use kube::Api;
use kube::api::PostParams;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::kubelet::handler::ClaimRef;
use crate::node::device_health::DeviceHealth;
use cleave_driver::health::HealthEventKind;

/// Condition type: the device is set up as the class and claim config ask.
pub(crate) const CONDITION_READY: &str = "Ready";
/// Condition type: no Xid, ECC error or loss marks the device (or its parent GPU).
pub(crate) const CONDITION_HEALTHY: &str = "Healthy";
/// First wait before retrying a failed write.
pub(crate) const INITIAL_BACKOFF: Duration = Duration::from_millis(200);
/// Longest wait between retries.
pub(crate) const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// Tries of one write before it is given up (logged and counted).
pub(crate) const MAX_ATTEMPTS: u32 = 10;
/// Quiet time after a prepare or unprepare batch before a status write starts: a write
/// (here and in the API server) would compete with the kubelet's next call for the CPU.
pub(crate) const SETTLE: Duration = Duration::from_millis(20);
/// The longest a due write waits for a quiet node (under a steady stream of batches).
pub(crate) const MAX_DEFER: Duration = Duration::from_secs(1);

/// Where the writer reports what its writes did (the metrics registry implements it).
pub(crate) trait StatusObserver: Send + Sync + std::fmt::Debug {
    /// One finished write: `result` is `ok`, `unchanged`, `gone`, `retry` or `failed`.
    fn status_write(&self, result: &'static str);
}

/// Why one status write did not go through.
#[derive(Debug, thiserror::Error)]
pub(crate) enum StatusWriteError {
    /// Reading or writing the claim failed.
    #[error("{operation} claim {namespace}/{name}: {source}")]
    Api {
        /// `reading` or `writing`.
        operation: &'static str,
        /// Claim namespace.
        namespace: String,
        /// Claim name.
        name: String,
        /// The API error.
        source: kube::Error,
    },
}

/// A write that did not go through, with the object it started from (still good for a
/// retry unless the error is a conflict).
#[derive(Debug)]
pub(crate) struct WriteFailure {
    /// Why.
    pub error: StatusWriteError,
    /// The object the write started from, if it got that far.
    pub base: Option<ResourceClaim>,
}

impl StatusWriteError {
    fn is_conflict(&self) -> bool {
        matches!(self, Self::Api { source: kube::Error::Api(s), .. } if s.code == 409)
    }
}

/// What a write found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WriteOutcome {
    /// The status was replaced.
    Written,
    /// The stored entries were already what was wanted.
    Unchanged,
    /// The claim is gone or was replaced (another UID): nothing to write.
    Gone,
}

enum Job {
    /// The report of a prepared claim and, when the caller has it, the claim as just read.
    Set(ClaimStatusReport, Option<Box<ResourceClaim>>),
    Clear(ClaimRef),
}

/// Writes this node's `status.devices` entries in the background; cheap to clone.
#[derive(Clone, Debug)]
pub(crate) struct ClaimStatusWriter {
    /// Each wish with when it was made (its write is due from then).
    tx: mpsc::UnboundedSender<(Job, Instant)>,
    /// Flush requests, each answered with how many writes are still pending after it.
    flush_tx: mpsc::UnboundedSender<tokio::sync::oneshot::Sender<usize>>,
    activity: Arc<Activity>,
}

/// The node's prepare and unprepare batches as the writer sees them: how many run now and
/// when the last one ended. Batches never wake the writer: it looks again when it planned to.
#[derive(Debug, Default)]
struct Activity {
    state: std::sync::Mutex<ActivityState>,
}

#[derive(Debug, Default)]
struct ActivityState {
    running: usize,
    last_end: Option<Instant>,
}

impl Activity {
    fn state(&self) -> std::sync::MutexGuard<'_, ActivityState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// `None` when the node is quiet at `now` (no batch runs, none ended within [`SETTLE`]);
    /// else when to look again: [`SETTLE`] after the last batch ended, or from `now` while
    /// one runs.
    fn quiet_at(&self, now: Instant) -> Option<Instant> {
        let st = self.state();
        if st.running > 0 {
            return Some(now + SETTLE);
        }
        st.last_end.map(|end| end + SETTLE).filter(|at| *at > now)
    }

    /// When to look again at a write due at `due` (it may start once that is not after
    /// `now`): when it is due and the node is quiet, never later than [`MAX_DEFER`] after
    /// `due`.
    fn write_at(&self, due: Instant, now: Instant) -> Instant {
        self.quiet_at(now)
            .map_or(due, |quiet| due.max(quiet))
            .min(due + MAX_DEFER)
    }
}

/// A batch's mark on the writer's [`Activity`]; the batch ends when it is dropped.
#[derive(Debug)]
#[must_use = "the batch ends when the guard is dropped"]
pub(crate) struct BatchGuard {
    activity: Arc<Activity>,
}

impl Drop for BatchGuard {
    fn drop(&mut self) {
        let mut st = self.activity.state();
        st.running = st.running.saturating_sub(1);
        st.last_end = Some(Instant::now());
    }
}

/// Identity of the writer: whose entries are whose.
#[derive(Debug, Clone)]
pub(crate) struct WriterConfig {
    /// The driver name entries are written under.
    pub driver_name: String,
    /// This node's pool.
    pub pool_name: String,
}

impl ClaimStatusWriter {
    /// Starts the writer task on the current runtime; it ends when every clone of the
    /// writer is dropped (pending writes are abandoned then: [`Self::flush`] first).
    pub(crate) fn start(
        client: kube::Client,
        config: WriterConfig,
        health: Option<Arc<DeviceHealth>>,
        observer: Option<Arc<dyn StatusObserver>>,
    ) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let (flush_tx, flush_rx) = mpsc::unbounded_channel();
        let activity = Arc::new(Activity::default());
        let worker = Worker {
            client,
            config,
            health,
            observer,
            activity: Arc::clone(&activity),
            claims: BTreeMap::new(),
            pending: BTreeMap::new(),
            known: BTreeMap::new(),
        };
        tokio::spawn(worker.run(rx, flush_rx));
        Self {
            tx,
            flush_tx,
            activity,
        }
    }

    /// Writes every pending wish now, once, without waiting for a quiet node or a retry's
    /// back-off (for shutdown, after the last batch). Returns how many are still pending
    /// (their write failed), or `None` when the writer is gone or `timeout` passed first.
    pub(crate) async fn flush(&self, timeout: Duration) -> Option<usize> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.flush_tx.send(reply).ok()?;
        tokio::time::timeout(timeout, answer).await.ok()?.ok()
    }

    /// Marks a prepare or unprepare batch as running until the guard is dropped: writes wait
    /// for it and [`SETTLE`] after it. Hand the batch's reports over before dropping it.
    pub(crate) fn batch(&self) -> BatchGuard {
        self.activity.state().running += 1;
        BatchGuard {
            activity: Arc::clone(&self.activity),
        }
    }

    /// Writes the entries of a claim that was prepared (or whose state changed); returns at
    /// once. `read` is the claim as the caller just read it (same UID): the first write
    /// starts from it instead of reading the claim again.
    pub(crate) fn prepared(&self, report: ClaimStatusReport, read: Option<ResourceClaim>) {
        let _ = self
            .tx
            .send((Job::Set(report, read.map(Box::new)), Instant::now()));
    }

    /// Removes the entries of a claim that was unprepared; returns at once.
    pub(crate) fn unprepared(&self, claim: ClaimRef) {
        let _ = self.tx.send((Job::Clear(claim), Instant::now()));
    }
}

struct Pending {
    claim: ClaimRef,
    /// The entries to write; `None`: remove ours.
    want: Option<Vec<AllocatedDeviceStatus>>,
    attempts: u32,
    due: Instant,
}

struct Worker {
    client: kube::Client,
    config: WriterConfig,
    health: Option<Arc<DeviceHealth>>,
    observer: Option<Arc<dyn StatusObserver>>,
    /// The node's batches: writes start when it is quiet.
    activity: Arc<Activity>,
    /// Prepared claims: their reports and the entries last asked for (health changes
    /// rewrite the claims whose entries differ).
    claims: BTreeMap<String, (ClaimStatusReport, Vec<AllocatedDeviceStatus>)>,
    /// Writes to do, by claim UID (a newer wish replaces an older one).
    pending: BTreeMap<String, Pending>,
    /// The latest object known per claim UID (read at prepare, or returned by our last
    /// write): the next write starts from it without a GET. Kept only while the claim is in
    /// `claims` or `pending`; dropped on a conflict (the next try reads the claim).
    known: BTreeMap<String, ResourceClaim>,
}

impl Worker {
    async fn run(
        mut self,
        mut rx: mpsc::UnboundedReceiver<(Job, Instant)>,
        mut flush_rx: mpsc::UnboundedReceiver<tokio::sync::oneshot::Sender<usize>>,
    ) {
        let mut health_changes = self.health.as_ref().map(|h| h.subscribe());
        loop {
            let now = Instant::now();
            let next_due = self.pending.values().map(|p| p.due).min();
            let write_at = next_due.map(|due| self.activity.write_at(due, now));
            let quiet_at = self.activity.quiet_at(now);
            // With writes waiting on a busy node, new wishes stay in the channel (receiving
            // each would wake this task beside the batch that sent it) until this task looks
            // again, when the node may be quiet or a write is due.
            let listen = write_at.is_none() || quiet_at.is_none();
            let wake = match (write_at, quiet_at) {
                (Some(write), Some(quiet)) => Some(write.min(quiet)),
                (write, _) => write,
            };
            tokio::select! {
                Some(reply) = flush_rx.recv() => {
                    // Every wish sent before the flush, then each pending write once.
                    while let Ok((job, made)) = rx.try_recv() {
                        self.take(job, made);
                    }
                    self.write_due(true).await;
                    let _ = reply.send(self.pending.len());
                }
                job = rx.recv(), if listen => match job {
                    Some((job, made)) => self.take(job, made),
                    None => break,
                },
                changed = async {
                    match health_changes.as_mut() {
                        Some(rx) => rx.changed().await.is_ok(),
                        None => std::future::pending().await,
                    }
                } => {
                    if changed {
                        self.health_changed();
                    } else {
                        health_changes = None;
                    }
                }
                () = async {
                    match wake {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                } => {
                    // The wishes made meanwhile first: a later one replaces an earlier one.
                    loop {
                        match rx.try_recv() {
                            Ok((job, made)) => self.take(job, made),
                            Err(mpsc::error::TryRecvError::Empty) => break,
                            Err(mpsc::error::TryRecvError::Disconnected) => return,
                        }
                    }
                    self.write_due(false).await;
                }
            }
        }
    }

    fn take(&mut self, job: Job, made: Instant) {
        match job {
            Job::Set(report, read) => {
                let claim = report.claim.clone();
                if let Some(object) = read
                    && object.metadata.uid.as_deref() == Some(claim.uid.as_str())
                {
                    self.known.insert(claim.uid.clone(), *object);
                }
                let want = entries(&self.config, &report, self.health.as_deref());
                self.claims
                    .insert(claim.uid.clone(), (report, want.clone()));
                self.schedule(claim, Some(want), made);
            }
            Job::Clear(claim) => {
                self.claims.remove(&claim.uid);
                self.schedule(claim, None, made);
            }
        }
    }

    /// Makes `want` the claim's pending write, due from `made` (a newer wish replaces an
    /// older one and its back-off).
    fn schedule(
        &mut self,
        claim: ClaimRef,
        want: Option<Vec<AllocatedDeviceStatus>>,
        made: Instant,
    ) {
        self.pending.insert(
            claim.uid.clone(),
            Pending {
                claim,
                want,
                attempts: 0,
                due: made,
            },
        );
    }

    /// Rewrites the claims whose conditions changed with the new health.
    fn health_changed(&mut self) {
        let mut changed = Vec::new();
        for (report, last) in self.claims.values_mut() {
            let want = entries(&self.config, report, self.health.as_deref());
            if entries_without_times(last) != entries_without_times(&want) {
                last.clone_from(&want);
                changed.push((report.claim.clone(), want));
            }
        }
        for (claim, want) in changed {
            debug!(namespace = %claim.namespace, name = %claim.name, "device health changed; rewriting claim status");
            self.schedule(claim, Some(want), Instant::now());
        }
    }

    /// Writes what is due on a quiet node; `now_all`: every pending wish, at once.
    async fn write_due(&mut self, now_all: bool) {
        let now = Instant::now();
        let due: Vec<String> = self
            .pending
            .iter()
            .filter(|(_, p)| now_all || p.due <= now)
            .map(|(uid, _)| uid.clone())
            .collect();
        for uid in due {
            let Some(p) = self.pending.get(&uid) else {
                continue;
            };
            // Not yet due, or a batch started meanwhile: it waits for a quiet node.
            let now = Instant::now();
            if !now_all && self.activity.write_at(p.due, now) > now {
                continue;
            }
            let claim = p.claim.clone();
            let want = p.want.clone();
            let base = self.known.remove(&uid);
            let result = write(&self.client, &self.config, &claim, want.as_deref(), base).await;
            let Some(p) = self.pending.get_mut(&uid) else {
                continue;
            };
            match result {
                Ok((outcome, latest)) => {
                    // Kept for the next write of a claim still prepared; the unprepare's
                    // write (or a gone claim) ends what this claim costs in memory.
                    if let Some(latest) = latest {
                        self.known.insert(uid.clone(), latest);
                    }
                    debug!(namespace = %claim.namespace, name = %claim.name, ?outcome, "claim device status written");
                    self.observe(match outcome {
                        WriteOutcome::Written => "ok",
                        WriteOutcome::Unchanged => "unchanged",
                        WriteOutcome::Gone => "gone",
                    });
                    self.pending.remove(&uid);
                }
                Err(WriteFailure { error: e, base }) => {
                    // A conflict means the object is stale: the next try reads the claim.
                    if let Some(base) = base
                        && !e.is_conflict()
                    {
                        self.known.insert(uid.clone(), base);
                    }
                    p.attempts += 1;
                    if p.attempts >= MAX_ATTEMPTS {
                        warn!(namespace = %claim.namespace, name = %claim.name, attempts = p.attempts, error = %e, "giving up writing the claim's device status; the claim stays prepared");
                        self.observe("failed");
                        self.pending.remove(&uid);
                        self.forget_if_done(&uid);
                        continue;
                    }
                    let delay = if e.is_conflict() {
                        Duration::ZERO
                    } else {
                        backoff(p.attempts)
                    };
                    info!(namespace = %claim.namespace, name = %claim.name, attempt = p.attempts, retry_in_ms = delay.as_millis() as u64, error = %e, "writing the claim's device status failed; retrying");
                    p.due = Instant::now() + delay;
                    self.observe("retry");
                }
            }
            self.forget_if_done(&uid);
        }
    }

    /// Drops the object kept for a claim that is neither prepared nor waiting for a write.
    fn forget_if_done(&mut self, uid: &str) {
        if !self.claims.contains_key(uid) && !self.pending.contains_key(uid) {
            self.known.remove(uid);
        }
    }

    fn observe(&self, result: &'static str) {
        if let Some(o) = &self.observer {
            o.status_write(result);
        }
    }
}

/// The wait after `attempts` failed tries: [`INITIAL_BACKOFF`] doubled per try, at most
/// [`MAX_BACKOFF`].
pub(crate) fn backoff(attempts: u32) -> Duration {
    let factor = 2u32.saturating_pow(attempts.saturating_sub(1).min(16));
    INITIAL_BACKOFF.saturating_mul(factor).min(MAX_BACKOFF)
}

/// Entries compared without their conditions' times.
fn entries_without_times(list: &[AllocatedDeviceStatus]) -> Vec<AllocatedDeviceStatus> {
    list.iter()
        .map(|d| {
            let mut d = d.clone();
            if let Some(cs) = d.conditions.as_mut() {
                for c in cs {
                    c.last_transition_time = Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH);
                }
            }
            d
        })
        .collect()
}

/// The API entries of a report, with `Ready` from the report and `Healthy` from `health`.
pub(crate) fn entries(
    config: &WriterConfig,
    report: &ClaimStatusReport,
    health: Option<&DeviceHealth>,
) -> Vec<AllocatedDeviceStatus> {
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    report
        .entries
        .iter()
        .map(|e| entry(config, report, e, health, &now))
        .collect()
}

fn entry(
    config: &WriterConfig,
    report: &ClaimStatusReport,
    e: &DeviceStatusEntry,
    health: Option<&DeviceHealth>,
    now: &Time,
) -> AllocatedDeviceStatus {
    let ready = if report.ready {
        condition(
            CONDITION_READY,
            true,
            "Prepared",
            "prepared by the plugin",
            now,
        )
    } else {
        let reason = report.not_ready_reason.as_deref().unwrap_or("NotPrepared");
        condition(CONDITION_READY, false, reason, "not prepared yet", now)
    };
    let healthy = match health.and_then(|h| h.condition(&e.device)) {
        Some(c) => condition(
            CONDITION_HEALTHY,
            false,
            condition_reason(c.kind),
            &c.message,
            now,
        ),
        None => condition(
            CONDITION_HEALTHY,
            true,
            if health.is_some() {
                "Healthy"
            } else {
                "NotChecked"
            },
            if health.is_some() {
                "no Xid, ECC error or loss seen"
            } else {
                "device health checks are off"
            },
            now,
        ),
    };
    let data = serde_json::to_value(&e.data).unwrap_or_default();
    AllocatedDeviceStatus {
        driver: config.driver_name.clone(),
        pool: e.pool.clone(),
        device: e.device.clone(),
        share_id: e.share_id.clone(),
        conditions: Some(vec![ready, healthy]),
        data: data.is_object().then_some(RawExtension(data)),
        network_data: None,
    }
}

/// The condition reason (`^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$`) of a health mark.
fn condition_reason(kind: HealthEventKind) -> &'static str {
    match kind {
        HealthEventKind::Xid => "Xid",
        HealthEventKind::DoubleBitEcc => "DoubleBitEccError",
        HealthEventKind::Lost => "GpuLost",
        HealthEventKind::Recovered => "Unhealthy",
    }
}

fn condition(type_: &str, ok: bool, reason: &str, message: &str, now: &Time) -> Condition {
    // The API allows 32768 bytes of message; health messages are far shorter.
    let mut message = message.to_owned();
    if message.len() > 1024 {
        let mut end = 1021;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message.truncate(end);
        message.push_str("...");
    }
    Condition {
        type_: type_.to_owned(),
        status: if ok { "True" } else { "False" }.to_owned(),
        reason: reason.to_owned(),
        message,
        last_transition_time: now.clone(),
        observed_generation: None,
    }
}

/// Replaces this driver's entries in this pool with `want` (`None`: removes them), keeping
/// every other entry and the transition time of conditions that did not change. Starts from
/// `base` (the claim as last seen) or, without one, reads the claim. Entries for devices that
/// are not (or no longer) in the claim's allocation are not sent: the API server would refuse
/// the whole write. Returns the claim as it now stands (`None` when gone).
pub(crate) async fn write(
    client: &kube::Client,
    config: &WriterConfig,
    claim: &ClaimRef,
    want: Option<&[AllocatedDeviceStatus]>,
    base: Option<ResourceClaim>,
) -> Result<(WriteOutcome, Option<ResourceClaim>), WriteFailure> {
    let api: Api<ResourceClaim> = Api::namespaced(client.clone(), &claim.namespace);
    let api_err = |operation, source| StatusWriteError::Api {
        operation,
        namespace: claim.namespace.clone(),
        name: claim.name.clone(),
        source,
    };
    let object = match base {
        Some(object) => Some(object),
        None => api.get_opt(&claim.name).await.map_err(|e| WriteFailure {
            error: api_err("reading", e),
            base: None,
        })?,
    };
    let Some(base) = object else {
        return Ok((WriteOutcome::Gone, None));
    };
    if base.metadata.uid.as_deref() != Some(claim.uid.as_str()) {
        return Ok((WriteOutcome::Gone, None));
    }
    let mut object = base.clone();
    let status = object.status.get_or_insert_with(Default::default);
    let allocated: Vec<(String, String, String, Option<String>)> = status
        .allocation
        .as_ref()
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_ref())
        .map(|results| {
            results
                .iter()
                .map(|r| {
                    (
                        r.driver.clone(),
                        r.pool.clone(),
                        r.device.clone(),
                        r.share_id.clone(),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    let existing = status.devices.clone().unwrap_or_default();
    let ours =
        |d: &AllocatedDeviceStatus| d.driver == config.driver_name && d.pool == config.pool_name;
    let mut next: Vec<AllocatedDeviceStatus> =
        existing.iter().filter(|d| !ours(d)).cloned().collect();
    for mut d in want.unwrap_or_default().iter().cloned() {
        let key = (
            d.driver.clone(),
            d.pool.clone(),
            d.device.clone(),
            d.share_id.clone(),
        );
        if !allocated.contains(&key) {
            debug!(device = %d.device, "device not in the claim's allocation; no status entry");
            continue;
        }
        let before = existing.iter().find(|o| {
            o.driver == d.driver
                && o.pool == d.pool
                && o.device == d.device
                && o.share_id == d.share_id
        });
        if let (Some(before), Some(conditions)) = (before, d.conditions.as_mut()) {
            for c in conditions.iter_mut() {
                if let Some(old) = before
                    .conditions
                    .iter()
                    .flatten()
                    .find(|o| o.type_ == c.type_ && o.status == c.status)
                {
                    c.last_transition_time = old.last_transition_time.clone();
                }
            }
        }
        next.push(d);
    }
    if next == existing {
        return Ok((WriteOutcome::Unchanged, Some(base)));
    }
    status.devices = (!next.is_empty()).then_some(next);
    // The resourceVersion of `base` rides along: if anyone wrote the claim since, the API
    // server answers 409 and nothing of theirs is reverted.
    match api
        .replace_status(&claim.name, &PostParams::default(), &object)
        .await
    {
        Ok(written) => Ok((WriteOutcome::Written, Some(written))),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok((WriteOutcome::Gone, None)),
        Err(e) => Err(WriteFailure {
            error: api_err("writing", e),
            base: Some(base),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cleave_driver::prepare::{DeviceStatusData, STATUS_API_VERSION, STATUS_KIND};

    fn report(ready: bool) -> ClaimStatusReport {
        ClaimStatusReport {
            claim: ClaimRef {
                uid: "u".into(),
                namespace: "ns".into(),
                name: "c".into(),
            },
            ready,
            not_ready_reason: (!ready).then(|| "Preparing".into()),
            entries: vec![DeviceStatusEntry {
                pool: "node-a".into(),
                device: "gpu-0".into(),
                share_id: None,
                gpu_uuid: "GPU-0".into(),
                data: DeviceStatusData {
                    api_version: STATUS_API_VERSION.into(),
                    kind: STATUS_KIND.into(),
                    uuid: "GPU-0".into(),
                    gpu_uuid: "GPU-0".into(),
                    mig: None,
                    mps: None,
                    share: None,
                    time_slice: None,
                    admin_access: false,
                    cdi_device_ids: Vec::new(),
                },
            }],
        }
    }

    fn config() -> WriterConfig {
        WriterConfig {
            driver_name: "gpu.cleave.dev".into(),
            pool_name: "node-a".into(),
        }
    }

    #[test]
    fn entries_carry_data_ready_and_healthy() {
        let e = entries(&config(), &report(true), None);
        assert_eq!(e.len(), 1);
        assert_eq!(e[0].driver, "gpu.cleave.dev");
        let data = &e[0].data.as_ref().map(|d| d.0.clone()).unwrap_or_default();
        assert_eq!(data["uuid"], "GPU-0");
        let conds = e[0].conditions.clone().unwrap_or_default();
        assert_eq!(conds.len(), 2);
        assert_eq!(conds[0].type_, CONDITION_READY);
        assert_eq!(conds[0].status, "True");
        assert_eq!(conds[1].type_, CONDITION_HEALTHY);
        assert_eq!(conds[1].reason, "NotChecked");
        let not_ready = entries(&config(), &report(false), None);
        let c = not_ready[0].conditions.clone().unwrap_or_default();
        assert_eq!(
            (c[0].status.as_str(), c[0].reason.as_str()),
            ("False", "Preparing")
        );
    }

    /// `(claim GETs, status writes, 409 answers)` the stand-in served.
    fn claim_requests(standin: &cleave_apiserver_standin::StandIn) -> (usize, usize, usize) {
        let recs: Vec<_> = standin
            .requests()
            .into_iter()
            .filter(|r| r.resource == "resourceclaims")
            .collect();
        let gets = recs.iter().filter(|r| r.verb == "get").count();
        let writes = recs
            .iter()
            .filter(|r| {
                matches!(r.verb.as_str(), "update" | "patch") && r.path.ends_with("/status")
            })
            .count();
        let conflicts = recs.iter().filter(|r| r.status == 409).count();
        (gets, writes, conflicts)
    }

    async fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
        let started = std::time::Instant::now();
        while !f() {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "timed out waiting for {what}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The object handed over at prepare is stale (someone reserved the claim for another
    /// pod after it was read): the write is refused with 409, the writer reads the claim
    /// once and writes again, and the other pod's reservation survives. The unprepare then
    /// writes from what that write returned, with no read.
    #[tokio::test]
    async fn a_stale_object_costs_one_conflict_and_one_read_and_reverts_nothing() {
        use k8s_openapi::api::resource::v1::ResourceClaimConsumerReference;
        let standin = cleave_apiserver_standin::StandIn::start(Default::default())
            .await
            .unwrap();
        let claim = cleave_apiserver_standin::fixtures::resource_claim(
            "ns",
            "c",
            "u",
            "gpu.cleave.dev",
            "node-a",
            &[("gpu", "gpu-0")],
            &[],
        );
        standin.put(&claim).unwrap();
        let stale: ResourceClaim = standin.get_as("resourceclaims", "ns", "c").unwrap();
        let mut foreign = stale.clone();
        let status = foreign.status.as_mut().unwrap();
        status
            .reserved_for
            .get_or_insert_with(Vec::new)
            .push(ResourceClaimConsumerReference {
                api_group: None,
                resource: "pods".into(),
                name: "other".into(),
                uid: "pod-other".into(),
            });
        standin.put(&foreign).unwrap();
        standin.reset_counts();

        let writer = ClaimStatusWriter::start(standin.client(), config(), None, None);
        writer.prepared(report(true), Some(stale));
        let devices = |s: &cleave_apiserver_standin::StandIn| {
            s.get("resourceclaims", "ns", "c")
                .and_then(|c| c["status"]["devices"].as_array().cloned())
                .unwrap_or_default()
        };
        wait_for("the entry written", || {
            !devices(&standin).is_empty() && claim_requests(&standin).1 == 2
        })
        .await;
        assert_eq!(claim_requests(&standin), (1, 2, 1));
        let stored = standin.get("resourceclaims", "ns", "c").unwrap();
        let reserved = stored["status"]["reservedFor"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        assert!(
            reserved.iter().any(|r| r["uid"] == "pod-other"),
            "the other pod's reservation was reverted: {stored}"
        );

        standin.reset_counts();
        writer.unprepared(report(true).claim);
        wait_for("the entry removed", || {
            devices(&standin).is_empty() && claim_requests(&standin).1 == 1
        })
        .await;
        assert_eq!(claim_requests(&standin), (0, 1, 0));
    }

    /// A write starts when it is due if the node is quiet, [`SETTLE`] after the last batch
    /// ended, and while batches run it is looked at again every [`SETTLE`] and starts at most
    /// [`MAX_DEFER`] late.
    #[test]
    fn writes_start_on_a_quiet_node_or_at_most_max_defer_late() {
        let activity = Arc::new(Activity::default());
        let due = Instant::now();
        let now = due + Duration::from_millis(1);
        assert_eq!(activity.write_at(due, now), due, "no batch yet");
        let writer = ClaimStatusWriter {
            tx: mpsc::unbounded_channel().0,
            flush_tx: mpsc::unbounded_channel().0,
            activity: Arc::clone(&activity),
        };
        let batch = writer.batch();
        let nested = writer.batch();
        assert_eq!(activity.write_at(due, now), now + SETTLE, "a batch runs");
        let late = due + MAX_DEFER;
        assert_eq!(activity.write_at(due, late), late, "waited long enough");
        drop(batch);
        assert_eq!(activity.write_at(due, now), now + SETTLE, "one still runs");
        drop(nested);
        let end = activity.state().last_end.unwrap();
        assert!(end >= due);
        assert_eq!(activity.write_at(due, end), end + SETTLE, "settling");
        let later = end + SETTLE + Duration::from_millis(5);
        assert_eq!(
            activity.write_at(later, later),
            later,
            "due after the node settled"
        );
        let long_ago = due.checked_sub(MAX_DEFER).unwrap();
        assert_eq!(activity.write_at(long_ago, end), due, "capped");
    }

    /// Records what each write did and when it finished.
    #[derive(Debug, Default)]
    struct Seen(std::sync::Mutex<Vec<(&'static str, Instant)>>);

    impl StatusObserver for Seen {
        fn status_write(&self, result: &'static str) {
            self.0.lock().unwrap().push((result, Instant::now()));
        }
    }

    /// A writer over a stand-in that holds the claim `ns/c` (UID `u`), the claim as read,
    /// and what the writer reported.
    async fn writer_with_claim() -> (
        cleave_apiserver_standin::StandIn,
        ClaimStatusWriter,
        ResourceClaim,
        Arc<Seen>,
    ) {
        let standin = cleave_apiserver_standin::StandIn::start(Default::default())
            .await
            .unwrap();
        let claim = cleave_apiserver_standin::fixtures::resource_claim(
            "ns",
            "c",
            "u",
            "gpu.cleave.dev",
            "node-a",
            &[("gpu", "gpu-0")],
            &[],
        );
        standin.put(&claim).unwrap();
        let read: ResourceClaim = standin.get_as("resourceclaims", "ns", "c").unwrap();
        let seen = Arc::new(Seen::default());
        let writer = ClaimStatusWriter::start(
            standin.client(),
            config(),
            None,
            Some(Arc::clone(&seen) as Arc<dyn StatusObserver>),
        );
        (standin, writer, read, seen)
    }

    /// A write waits for the batch that asked for it and [`SETTLE`] after it; a claim
    /// unprepared before its entries were written costs no request at all.
    #[tokio::test]
    async fn writes_wait_for_the_batch_and_a_quick_unprepare_costs_nothing() {
        let (standin, writer, read, seen) = writer_with_claim().await;
        standin.reset_counts();

        // Prepared and unprepared in two batches in a row: nothing to write.
        let batch = writer.batch();
        writer.prepared(report(true), Some(read.clone()));
        drop(batch);
        let batch = writer.batch();
        writer.unprepared(report(true).claim);
        drop(batch);
        wait_for("the coalesced wish", || !seen.0.lock().unwrap().is_empty()).await;
        assert_eq!(seen.0.lock().unwrap()[0].0, "unchanged");
        assert_eq!(claim_requests(&standin), (0, 0, 0));

        // Prepared and left prepared: written once the batch has ended and settled.
        let read: ResourceClaim = standin.get_as("resourceclaims", "ns", "c").unwrap();
        standin.reset_counts();
        let batch = writer.batch();
        writer.prepared(report(true), Some(read));
        tokio::time::sleep(Duration::from_millis(30)).await;
        let ended = Instant::now();
        drop(batch);
        wait_for("the entry written", || seen.0.lock().unwrap().len() == 2).await;
        let (result, at) = seen.0.lock().unwrap()[1];
        assert_eq!(result, "ok");
        assert!(
            at >= ended + SETTLE,
            "written {:?} after the batch",
            at - ended
        );
        assert_eq!(claim_requests(&standin), (0, 1, 0));
    }

    /// A flush (at shutdown) writes what is pending at once, without waiting for the batch
    /// that still runs or for [`SETTLE`], and says nothing is left.
    #[tokio::test]
    async fn a_flush_writes_at_once_even_while_a_batch_runs() {
        let (standin, writer, read, seen) = writer_with_claim().await;
        standin.reset_counts();
        // Held: without the flush the write would wait for it (up to MAX_DEFER).
        let batch = writer.batch();
        writer.prepared(report(true), Some(read));
        assert_eq!(writer.flush(Duration::from_secs(30)).await, Some(0));
        assert_eq!(seen.0.lock().unwrap()[0].0, "ok");
        assert_eq!(claim_requests(&standin), (0, 1, 0));
        drop(batch);
    }

    #[test]
    fn backoff_doubles_to_its_bound() {
        assert_eq!(backoff(1), INITIAL_BACKOFF);
        assert_eq!(backoff(2), INITIAL_BACKOFF * 2);
        assert_eq!(backoff(40), MAX_BACKOFF);
    }

    #[test]
    fn reasons_are_valid_condition_reasons() {
        for kind in [
            HealthEventKind::Xid,
            HealthEventKind::DoubleBitEcc,
            HealthEventKind::Lost,
            HealthEventKind::Recovered,
        ] {
            let r = condition_reason(kind);
            assert!(r.chars().all(|c| c.is_ascii_alphanumeric()), "{r}");
        }
    }
}
