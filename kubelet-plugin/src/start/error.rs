//! Why start-up did not finish: one variant per step that can fail, each naming what
//! failed and how to fix it, the cause kept as `#[source]`. The variant decides the retry
//! policy of [`super::start_when_possible`]: [`StartError::DriverNotReady`] and
//! [`StartError::CheckpointUnreadable`] wait and retry, the rest end start-up.

use std::net::SocketAddr;
use std::path::PathBuf;

use cleave_driver::backend::BackendError;
use cleave_driver::prepare::PrepareError;

use crate::kubelet::server::ServerError;
use crate::node::cdi_hook::CdiHookError;
use crate::node::lifecycle::short_reason;
use crate::node::node_lock::NodeLockError;

/// Why the NVIDIA driver is not usable yet (retried with backoff).
#[derive(Debug, thiserror::Error)]
pub(crate) enum DriverNotReady {
    /// NVML cannot be loaded or initialised.
    #[error("loading NVML")]
    Load(#[source] BackendError),
    /// NVML loaded but cannot list the GPUs.
    #[error("listing GPUs through NVML")]
    Inventory(#[source] BackendError),
    /// NVML sees no GPU and `--allow-no-gpus` is off.
    #[error(
        "NVML found no GPU (driver not ready, or a node without GPUs: then pass --allow-no-gpus)"
    )]
    NoGpus,
}

/// Why start-up did not finish; the variant decides the retry policy
/// ([`super::start_when_possible`]).
#[derive(Debug, thiserror::Error)]
pub(crate) enum StartError {
    /// NVML cannot be loaded or initialised, or sees no GPU: retried with backoff.
    #[error("NVIDIA driver not ready")]
    DriverNotReady(#[source] DriverNotReady),
    /// The checkpoint cannot be read: retried with backoff, never reset by the plugin.
    #[error("checkpoint unreadable: {error}")]
    CheckpointUnreadable {
        /// The path and what is wrong, without the recovery text (for `/readyz`, Events).
        reason: String,
        /// The whole checkpoint error, with its recovery text.
        error: String,
    },
    /// The kubeconfig named by `--kubeconfig` (`KUBECONFIG`) cannot be read or used.
    #[error("loading kubeconfig {path} (check the file named by --kubeconfig / KUBECONFIG)")]
    Kubeconfig {
        /// The kubeconfig file.
        path: PathBuf,
        /// What is wrong with it.
        #[source]
        source: kube::config::KubeconfigError,
    },
    /// No kubeconfig was given and the process runs outside a cluster.
    #[error(
        "no kubeconfig given and no in-cluster configuration (pass --kubeconfig, or run in a pod with a service account)"
    )]
    NoClusterConfig(#[source] kube::config::InferConfigError),
    /// The Kubernetes client cannot be built from the configuration (TLS, proxy, URL).
    #[error("creating the Kubernetes client from its configuration")]
    Client(#[source] kube::Error),
    /// A flag needs another flag that is not set.
    #[error("{flag} needs {needs}")]
    MissingFlag {
        /// The flag as given.
        flag: &'static str,
        /// The flag it needs (and its environment variable).
        needs: &'static str,
    },
    /// The owner of the MPS daemon pods (the plugin's DaemonSet, or the Node) cannot be read
    /// from the API server.
    #[error(
        "finding the owner of MPS daemon pods (the plugin's pod and Node must be readable: check the RBAC rules)"
    )]
    MpsPodOwner(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The plugin's socket or state directories cannot be created.
    #[error("preparing plugin directories")]
    Dirs(#[source] ServerError),
    /// The plugin's sockets are served by another instance, or cannot be checked.
    #[error("checking the plugin sockets")]
    Sockets(#[source] ServerError),
    /// The CDI hook cannot be installed in the state directory.
    #[error("installing the CDI hook")]
    CdiHook(#[source] CdiHookError),
    /// The node driver failed to start for another reason than its checkpoint.
    #[error("starting the node driver")]
    Driver(#[source] Box<PrepareError>),
    /// The node lock (serialising every prepare) cannot be taken.
    #[error("taking the node lock")]
    NodeLock(#[source] NodeLockError),
    /// The shared instance lock in the state directory cannot be taken.
    #[error("taking the instance lock {path} (check the state directory's permissions)")]
    InstanceLock {
        /// The lock file.
        path: PathBuf,
        /// Underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The DRA and registration servers failed to start.
    #[error("starting the plugin servers")]
    Servers(#[source] ServerError),
    /// The metrics and health endpoints cannot listen on `--metrics-addr`.
    #[error("serving metrics on {addr} (is the port taken? change --metrics-addr)")]
    Metrics {
        /// The address asked for.
        addr: SocketAddr,
        /// Underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A blocking start-up step panicked or was cancelled.
    #[error("a start-up task did not finish")]
    Task(#[source] tokio::task::JoinError),
}

impl StartError {
    /// The node driver's start error: a checkpoint error is [`Self::CheckpointUnreadable`]
    /// (retried), anything else [`Self::Driver`].
    pub(crate) fn from_driver(e: PrepareError) -> Self {
        match e {
            PrepareError::Checkpoint(ce) => Self::CheckpointUnreadable {
                reason: short_reason(&ce),
                error: ce.to_string(),
            },
            e => Self::Driver(Box::new(e)),
        }
    }

    /// Whether [`super::start_when_possible`] waits and tries again after this error.
    pub(crate) fn is_retried(&self) -> bool {
        matches!(
            self,
            Self::DriverNotReady(_) | Self::CheckpointUnreadable { .. }
        )
    }

    /// The message with every cause, `: `-separated (for `/readyz`, Events and logs).
    pub(crate) fn chain(&self) -> String {
        let mut text = self.to_string();
        let mut cause = std::error::Error::source(self);
        while let Some(c) = cause {
            text.push_str(": ");
            text.push_str(&c.to_string());
            cause = c.source();
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cleave_driver::checkpoint::CheckpointError;

    #[test]
    fn checkpoint_errors_are_retried_other_driver_errors_not() {
        let ce = CheckpointError::Corrupt {
            path: "/x/checkpoint.json".into(),
            reason: "bad".into(),
        };
        let e = StartError::from_driver(PrepareError::from(ce));
        assert!(
            matches!(&e, StartError::CheckpointUnreadable { reason, .. } if reason == "/x/checkpoint.json is corrupt: bad"),
            "{e:?}"
        );
        assert!(e.is_retried());
        let e = StartError::from_driver(PrepareError::NotAllocated {
            claim: "ns/c".into(),
        });
        assert!(matches!(e, StartError::Driver(_)), "{e:?}");
        assert!(!e.is_retried());
    }

    #[test]
    fn a_driver_not_ready_reason_names_the_cause() {
        let e = StartError::DriverNotReady(DriverNotReady::NoGpus);
        assert!(e.is_retried());
        assert_eq!(
            e.chain(),
            "NVIDIA driver not ready: NVML found no GPU (driver not ready, or a node without GPUs: then pass --allow-no-gpus)"
        );
        let e = StartError::DriverNotReady(DriverNotReady::Load(BackendError::Unavailable(
            "no libnvidia-ml.so.1".into(),
        )));
        assert!(
            e.chain()
                .starts_with("NVIDIA driver not ready: loading NVML: "),
            "{}",
            e.chain()
        );
    }

    #[test]
    fn the_other_variants_end_start_up_and_say_what_to_fix() {
        let io = || std::io::Error::from(std::io::ErrorKind::PermissionDenied);
        let cases = [
            (
                StartError::MissingFlag {
                    flag: "--mps-launcher=pod",
                    needs: "--mps-daemon-image",
                },
                "--mps-launcher=pod needs --mps-daemon-image",
            ),
            (
                StartError::InstanceLock {
                    path: "/s/instance.lock".into(),
                    source: io(),
                },
                "taking the instance lock /s/instance.lock (check the state directory's permissions)",
            ),
            (
                StartError::Metrics {
                    addr: "127.0.0.1:1".parse().unwrap(),
                    source: io(),
                },
                "serving metrics on 127.0.0.1:1 (is the port taken? change --metrics-addr)",
            ),
            (
                StartError::CdiHook(CdiHookError::NoDirectory("/".into())),
                "installing the CDI hook",
            ),
            (
                StartError::MpsPodOwner("reading node n1".into()),
                "finding the owner of MPS daemon pods",
            ),
        ];
        for (e, text) in cases {
            assert!(!e.is_retried(), "{e:?}");
            assert!(e.to_string().starts_with(text), "{e}");
            assert!(e.chain().len() >= e.to_string().len());
        }
    }
}
