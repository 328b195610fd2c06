//! The node lock: prepare and unprepare batches run one at a time across threads and
//! processes.
//!
//! During a rolling update two plugin instances run on one node and share the driver's
//! checkpoint, CDI files and GPUs. Every batch therefore runs under an in-process mutex
//! and an exclusive whole-file lock (`flock`) on `<plugins dir>/<driver>/serialize.lock`.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Why a serialised batch could not run.
#[derive(Debug, thiserror::Error)]
pub(crate) enum NodeLockError {
    /// The lock file could not be opened or created.
    #[error("opening lock file {path}: {source}")]
    Open {
        /// Lock file path.
        path: PathBuf,
        /// Underlying error.
        source: std::io::Error,
    },
    /// Taking the exclusive file lock failed.
    #[error("locking {path}: {source}")]
    Lock {
        /// Lock file path.
        path: PathBuf,
        /// Underlying error.
        source: std::io::Error,
    },
    /// The blocking task panicked or was cancelled.
    #[error("serialised task did not complete: {0}")]
    Join(String),
}

/// The node lock: runs blocking closures one at a time per node (an in-process mutex
/// plus an exclusive file lock).
#[derive(Debug, Clone)]
pub(crate) struct NodeLock {
    path: Arc<PathBuf>,
    mutex: Arc<tokio::sync::Mutex<()>>,
}

impl NodeLock {
    /// A node_lock using the lock file at `path` (created on first use, mode 0600).
    pub(crate) fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: Arc::new(path.into()),
            mutex: Arc::new(tokio::sync::Mutex::new(())),
        }
    }

    /// Runs `f` on a blocking thread while holding both locks and returns its result.
    /// If the caller is cancelled, `f` still runs to completion under the locks.
    pub(crate) async fn run<T, F>(&self, f: F) -> Result<T, NodeLockError>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        let guard = Arc::clone(&self.mutex).lock_owned().await;
        let path = Arc::clone(&self.path);
        let work = move || {
            let _guard = guard;
            let file = lock_file(&path)?;
            let out = f();
            // Closing the descriptor releases the lock; unlock explicitly for clarity.
            let _ = file.unlock();
            Ok(out)
        };
        // On a multi-thread runtime the work runs right here, the worker handing its other
        // tasks to its peers: two thread hand-offs fewer per prepare than a blocking-pool
        // task. A single-thread runtime (tests) cannot do that.
        if tokio::runtime::Handle::current().runtime_flavor()
            == tokio::runtime::RuntimeFlavor::MultiThread
        {
            return tokio::task::block_in_place(work);
        }
        tokio::task::spawn_blocking(work)
            .await
            .map_err(|e| NodeLockError::Join(e.to_string()))?
    }
}

fn lock_file(path: &Path) -> Result<File, NodeLockError> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)
        .map_err(|source| NodeLockError::Open {
            path: path.to_owned(),
            source,
        })?;
    file.lock().map_err(|source| NodeLockError::Lock {
        path: path.to_owned(),
        source,
    })?;
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    /// Two serializers on one file (two plugin instances) never run batches at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn two_serializers_on_one_file_exclude_each_other() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("serialize.lock");
        let a = NodeLock::new(&path);
        let b = NodeLock::new(&path);
        let inside = Arc::new(AtomicUsize::new(0));
        let max_seen = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for i in 0..8 {
            let s = if i % 2 == 0 { a.clone() } else { b.clone() };
            let (inside, max_seen) = (Arc::clone(&inside), Arc::clone(&max_seen));
            tasks.push(tokio::spawn(async move {
                s.run(move || {
                    let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                    max_seen.fetch_max(now, Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(10));
                    inside.fetch_sub(1, Ordering::SeqCst);
                })
                .await
                .unwrap();
            }));
        }
        for t in tasks {
            tokio::time::timeout(Duration::from_secs(10), t)
                .await
                .unwrap()
                .unwrap();
        }
        assert_eq!(max_seen.load(Ordering::SeqCst), 1);
        let mode = std::fs::metadata(&path).unwrap();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777,
            0o600
        );
    }

    /// A lock held by another open file description blocks until released.
    #[tokio::test]
    async fn waits_for_a_foreign_lock() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("serialize.lock");
        let foreign = lock_file(&path).unwrap();
        let s = NodeLock::new(&path);
        let mut run = Box::pin(s.run(|| 7));
        assert!(
            tokio::time::timeout(Duration::from_millis(100), &mut run)
                .await
                .is_err(),
            "ran while another holder had the lock"
        );
        drop(foreign);
        let v = tokio::time::timeout(Duration::from_secs(5), run)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(v, 7);
    }

    #[tokio::test]
    async fn unopenable_lock_file_is_an_error() {
        let s = NodeLock::new("/nonexistent-dir/serialize.lock");
        let err = s.run(|| ()).await.unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent-dir/serialize.lock"),
            "{err}"
        );
    }
}
