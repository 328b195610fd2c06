//! Serving the DRA and registration services on unix sockets, the way the kubelet
//! expects them.
//!
//! Layout (kubelet defaults): the DRA socket `<plugins dir>/<driver>/dra.sock` inside a
//! root-only (0700) state directory, and the registration socket
//! `<registrar dir>/<driver>-reg.sock` which the kubelet's plugin watcher discovers.
//! With a pod UID the names become `dra-<uid>.sock` and `<driver>-<uid>-reg.sock`, so
//! during a rolling update the new pod registers beside the old one (seamless upgrade).
//! The DRA service is served before the registration socket appears; on shutdown the
//! registration socket goes first. Each instance removes only sockets it created.
//!
//! Sockets are owned: before a path is taken, it is probed by connecting to it. A socket
//! nobody listens on (left by a crash) is replaced; a live one never is, and the new
//! instance stops with [`ServerError::InUse`] naming the process that serves it. A socket
//! is bound at a temporary dot-name in the same directory, given mode 0600, and only then
//! linked under its real name, so nobody ever sees it half made.

use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::UnixListener;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tracing::{debug, info, warn};

use super::dra::{DraObserver, DraService};
use super::registration::{RegistrationService, RegistrationState};
use super::resource_health::{HEALTH_V1, HEALTH_V1ALPHA1, HealthService};
use crate::kubelet::handler::ClaimHandler;
use crate::node::device_health::DeviceHealth;

/// How long shutdown waits for in-flight calls before it aborts a server.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Why the servers could not start or stop cleanly.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// A directory could not be created or given its permissions.
    #[error("creating directory {path}: {source}")]
    CreateDir {
        /// Directory path.
        path: PathBuf,
        /// Underlying error.
        source: std::io::Error,
    },
    /// Something that is not a socket sits where a socket must go.
    #[error("{path} exists and is not a socket; refusing to remove it")]
    NotASocket {
        /// The offending path.
        path: PathBuf,
    },
    /// Another process serves the socket: this instance must not take it over.
    #[error(
        "{path} is served by {owner}: another cleave-kubelet-plugin instance is running with the same socket names; \
         stop it first, or give each instance its own pod UID (POD_UID from the downward API, as the Helm chart sets it) \
         so that both can run side by side during a rolling update"
    )]
    InUse {
        /// The live socket.
        path: PathBuf,
        /// Who listens on it (process ID when visible).
        owner: String,
    },
    /// What sits at a socket path could not be examined.
    #[error("probing socket {path}: {source}")]
    Probe {
        /// Socket path.
        path: PathBuf,
        /// Underlying error.
        source: std::io::Error,
    },
    /// A stale socket could not be removed.
    #[error("removing stale socket {path}: {source}")]
    RemoveStale {
        /// Socket path.
        path: PathBuf,
        /// Underlying error.
        source: std::io::Error,
    },
    /// Binding the unix socket failed.
    #[error("listening on {path}: {source}")]
    Bind {
        /// Socket path.
        path: PathBuf,
        /// Underlying error.
        source: std::io::Error,
    },
    /// Restricting the socket's permissions failed.
    #[error("setting permissions of {path}: {source}")]
    Permissions {
        /// Socket path.
        path: PathBuf,
        /// Underlying error.
        source: std::io::Error,
    },
    /// A gRPC server stopped with an error.
    #[error("serving {path}: {source}")]
    Serve {
        /// Socket path.
        path: PathBuf,
        /// Underlying error.
        source: tonic::transport::Error,
    },
    /// The pod UID cannot be part of a file name.
    #[error("invalid pod UID {0:?}: must be non-empty and contain only [A-Za-z0-9._-]")]
    InvalidPodUid(String),
}

/// Where the plugin's sockets and state live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginConfig {
    /// DRA driver name, e.g. `gpu.cleave.dev`.
    pub driver_name: String,
    /// Kubelet plugin registration directory (`/var/lib/kubelet/plugins_registry`).
    pub registrar_dir: PathBuf,
    /// Kubelet plugins directory (`/var/lib/kubelet/plugins`).
    pub plugins_dir: PathBuf,
    /// UID of the plugin's pod; when set, socket names carry it (seamless upgrade).
    pub pod_uid: Option<String>,
}

impl PluginConfig {
    /// A configuration without pod UID.
    pub fn new(
        driver_name: impl Into<String>,
        registrar_dir: impl Into<PathBuf>,
        plugins_dir: impl Into<PathBuf>,
    ) -> Self {
        Self {
            driver_name: driver_name.into(),
            registrar_dir: registrar_dir.into(),
            plugins_dir: plugins_dir.into(),
            pod_uid: None,
        }
    }

    /// Sets the pod UID; an empty string means none.
    pub fn with_pod_uid(mut self, pod_uid: Option<String>) -> Self {
        self.pod_uid = pod_uid.filter(|u| !u.is_empty());
        self
    }

    /// The driver's state directory: `<plugins dir>/<driver>` (checkpoint, lock, DRA socket).
    pub(crate) fn data_dir(&self) -> PathBuf {
        self.plugins_dir.join(&self.driver_name)
    }

    /// The DRA service socket: `dra.sock` or `dra-<pod UID>.sock` in the data directory.
    pub fn dra_socket(&self) -> PathBuf {
        match &self.pod_uid {
            Some(uid) => self.data_dir().join(format!("dra-{uid}.sock")),
            None => self.data_dir().join("dra.sock"),
        }
    }

    /// The registration socket: `<driver>-reg.sock` or `<driver>-<pod UID>-reg.sock`.
    pub fn registration_socket(&self) -> PathBuf {
        let name = match &self.pod_uid {
            Some(uid) => format!("{}-{uid}-reg.sock", self.driver_name),
            None => format!("{}-reg.sock", self.driver_name),
        };
        self.registrar_dir.join(name)
    }

    /// The node-wide serialisation lock file shared by all instances.
    pub(crate) fn lock_file(&self) -> PathBuf {
        self.data_dir().join("serialize.lock")
    }

    /// Checks names and creates the directories: the registrar directory, and the state
    /// directory with mode 0700 (root only).
    pub fn prepare_dirs(&self) -> Result<(), ServerError> {
        if let Some(uid) = &self.pod_uid
            && !uid
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
        {
            return Err(ServerError::InvalidPodUid(uid.clone()));
        }
        let create = |path: &Path, mode: Option<u32>| -> Result<(), ServerError> {
            let err = |source| ServerError::CreateDir {
                path: path.to_owned(),
                source,
            };
            let mut builder = std::fs::DirBuilder::new();
            builder.recursive(true);
            if let Some(mode) = mode {
                builder.mode(mode);
            }
            builder.create(path).map_err(err)?;
            if let Some(mode) = mode {
                std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
                    .map_err(err)?;
            }
            Ok(())
        };
        create(&self.registrar_dir, None)?;
        create(&self.plugins_dir, None)?;
        create(&self.data_dir(), Some(0o700))
    }
}

/// One gRPC server on one socket file that this instance created.
struct ServedSocket {
    path: PathBuf,
    /// (device, inode) of the socket we bound: removal only if the file is still ours.
    identity: (u64, u64),
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), tonic::transport::Error>>>,
}

impl ServedSocket {
    fn remove_if_ours(&self) {
        match std::fs::symlink_metadata(&self.path) {
            Ok(m) if (m.dev(), m.ino()) == self.identity => {
                if let Err(e) = std::fs::remove_file(&self.path) {
                    warn!(path = %self.path.display(), error = %e, "could not remove socket");
                }
            }
            Ok(_) => {
                debug!(path = %self.path.display(), "socket replaced by another instance; left alone")
            }
            Err(_) => {}
        }
    }

    async fn stop(mut self) -> Result<(), ServerError> {
        // Removing the file first: the kubelet sees the registration socket vanish
        // (deregistration) and no new connections reach a stopping server.
        self.remove_if_ours();
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let Some(mut task) = self.task.take() else {
            return Ok(());
        };
        match tokio::time::timeout(SHUTDOWN_GRACE, &mut task).await {
            Ok(Ok(Ok(()))) => Ok(()),
            Ok(Ok(Err(source))) => Err(ServerError::Serve {
                path: self.path.clone(),
                source,
            }),
            Ok(Err(join)) => {
                warn!(path = %self.path.display(), error = %join, "server task failed");
                Ok(())
            }
            Err(_) => {
                warn!(path = %self.path.display(), "server did not stop in time; aborting it");
                task.abort();
                Ok(())
            }
        }
    }
}

impl Drop for ServedSocket {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
            self.remove_if_ours();
        }
    }
}

/// What sits at a socket path before this instance binds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SocketProbe {
    /// Nothing: the path is free.
    Free,
    /// A socket file with no listener (a previous instance died without removing it).
    Stale,
    /// A socket another process listens on. `pid` is the listener's process ID as this
    /// process sees it (`SO_PEERCRED`); `None` when it runs in another PID namespace or its
    /// backlog is full.
    Live {
        /// The listening process, when visible.
        pid: Option<i32>,
    },
}

/// How long a probe waits for a connection before it counts the socket as live (a
/// listener whose backlog is full answers late, but it is there).
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Probes `path` by connecting to it, as the kubelet would. A socket that refuses the
/// connection is stale; one that accepts it (or keeps it waiting) is live and belongs to
/// someone else. `connect(2)` on a unix socket with no listener fails with
/// `ECONNREFUSED`, on a missing path with `ENOENT` (unix(7)); the listener's credentials
/// come from `SO_PEERCRED`, "those that were in effect at the time of the call to
/// listen(2)" (unix(7)).
pub(crate) async fn probe_socket(path: &Path) -> Result<SocketProbe, ServerError> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {}
        Ok(_) => {
            return Err(ServerError::NotASocket {
                path: path.to_owned(),
            });
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(SocketProbe::Free),
        Err(source) => {
            return Err(ServerError::Probe {
                path: path.to_owned(),
                source,
            });
        }
    }
    match tokio::time::timeout(PROBE_TIMEOUT, tokio::net::UnixStream::connect(path)).await {
        Err(_) => Ok(SocketProbe::Live { pid: None }),
        Ok(Ok(stream)) => {
            let pid = stream
                .peer_cred()
                .ok()
                .and_then(|c| c.pid())
                .filter(|p| *p > 0);
            Ok(SocketProbe::Live { pid })
        }
        Ok(Err(e)) => match e.kind() {
            std::io::ErrorKind::ConnectionRefused => Ok(SocketProbe::Stale),
            std::io::ErrorKind::NotFound => Ok(SocketProbe::Free),
            // A listener whose backlog is full makes a non-blocking connect fail with EAGAIN.
            std::io::ErrorKind::WouldBlock => Ok(SocketProbe::Live { pid: None }),
            _ => Err(ServerError::Probe {
                path: path.to_owned(),
                source: e,
            }),
        },
    }
}

/// Fails when another process serves `path`; removes a stale socket file.
async fn claim_path(path: &Path) -> Result<(), ServerError> {
    match probe_socket(path).await? {
        SocketProbe::Free => Ok(()),
        SocketProbe::Stale => {
            info!(path = %path.display(), "removing stale socket (no process listens on it)");
            match std::fs::remove_file(path) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(source) => Err(ServerError::RemoveStale {
                    path: path.to_owned(),
                    source,
                }),
            }
        }
        SocketProbe::Live { pid } => Err(ServerError::InUse {
            path: path.to_owned(),
            owner: describe_owner(pid),
        }),
    }
}

fn describe_owner(pid: Option<i32>) -> String {
    match pid {
        Some(pid) => format!("process {pid}"),
        None => "a process outside this PID namespace (another pod?)".to_owned(),
    }
}

/// Checks that no other instance serves this configuration's sockets, before the plugin
/// does anything else (loads its checkpoint, publishes): a second instance on the same
/// socket names exits with [`ServerError::InUse`] instead of taking over. Stale sockets
/// are left for [`PluginServer::start`] to replace.
pub async fn check_sockets_free(config: &PluginConfig) -> Result<(), ServerError> {
    for path in [config.dra_socket(), config.registration_socket()] {
        let path = absolute(&path);
        if let SocketProbe::Live { pid } = probe_socket(&path).await? {
            return Err(ServerError::InUse {
                path,
                owner: describe_owner(pid),
            });
        }
    }
    Ok(())
}

/// A temporary name in `path`'s directory. It starts with '.', so the kubelet's plugin
/// watcher ignores it (kubernetes/kubernetes
/// pkg/kubelet/pluginmanager/pluginwatcher/plugin_watcher.go, `handleCreateEvent`:
/// "Ignoring file (starts with '.')"), and it is short, so it fits the 108-byte limit
/// of a unix socket path wherever the final name fits.
fn temporary_name(path: &Path) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let name = format!(".cleave-{}-{n}.tmp", std::process::id());
    path.parent().unwrap_or(Path::new(".")).join(name)
}

/// Binds a unix socket at `path` with mode 0600, never replacing a live socket.
///
/// The socket is bound at a temporary name in the same directory, restricted to 0600,
/// and only then linked to `path` (`link(2)` fails with `EEXIST` instead of replacing
/// what another instance put there meanwhile), so neither the kubelet nor anyone else
/// ever sees it under its name with another mode. A stale socket at `path` is removed;
/// a live one is an error naming its owner.
async fn bind(path: &Path) -> Result<(UnixListener, (u64, u64)), ServerError> {
    let tmp = temporary_name(path);
    let _ = std::fs::remove_file(&tmp);
    let listener = UnixListener::bind(&tmp).map_err(|source| ServerError::Bind {
        path: path.to_owned(),
        source,
    })?;
    let result = publish_socket(&tmp, path).await;
    // The temporary name goes in every case: on success the socket lives on under `path`.
    let _ = std::fs::remove_file(&tmp);
    let identity = result?;
    Ok((listener, identity))
}

/// Gives the socket at `tmp` mode 0600 and the name `path`; returns its (device, inode).
async fn publish_socket(tmp: &Path, path: &Path) -> Result<(u64, u64), ServerError> {
    let perm_err = |source| ServerError::Permissions {
        path: path.to_owned(),
        source,
    };
    std::fs::set_permissions(tmp, std::fs::Permissions::from_mode(0o600)).map_err(perm_err)?;
    let m = std::fs::symlink_metadata(tmp).map_err(perm_err)?;
    let identity = (m.dev(), m.ino());
    // A few rounds: a stale socket removed, then another instance racing us to the name.
    for _ in 0..3 {
        claim_path(path).await?;
        match std::fs::hard_link(tmp, path) {
            Ok(()) => return Ok(identity),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => {
                // A file system without hard links: rename, which replaces; the path was
                // just found free, so only a racing instance could lose its name here.
                debug!(path = %path.display(), error = %e, "hard link failed; renaming instead");
                std::fs::rename(tmp, path).map_err(|source| ServerError::Bind {
                    path: path.to_owned(),
                    source,
                })?;
                return Ok(identity);
            }
        }
    }
    Err(ServerError::InUse {
        path: path.to_owned(),
        owner: "another instance that keeps creating it".to_owned(),
    })
}

fn serve(
    path: PathBuf,
    identity: (u64, u64),
    listener: UnixListener,
    router: tonic::transport::server::Router,
) -> ServedSocket {
    let (stop, stopped) = oneshot::channel::<()>();
    let incoming = UnixListenerStream::new(listener);
    let task = tokio::spawn(router.serve_with_incoming_shutdown(incoming, async {
        let _ = stopped.await;
    }));
    ServedSocket {
        path,
        identity,
        stop: Some(stop),
        task: Some(task),
    }
}

/// The running DRA and registration servers of one plugin instance.
///
/// Dropping it stops both servers (without waiting) and removes its sockets;
/// [`PluginServer::shutdown`] does the same and waits for in-flight calls.
pub struct PluginServer {
    registration: Option<ServedSocket>,
    dra: Option<ServedSocket>,
    health: Option<Arc<DeviceHealth>>,
    state: watch::Receiver<RegistrationState>,
    dra_socket: PathBuf,
    registration_socket: PathBuf,
}

impl std::fmt::Debug for PluginServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginServer")
            .field("dra_socket", &self.dra_socket)
            .field("registration_socket", &self.registration_socket)
            .finish_non_exhaustive()
    }
}

impl PluginServer {
    /// Creates the directories, serves the DRA service (v1 and v1beta1) on the DRA
    /// socket, then the registration service on the registration socket.
    pub async fn start<H: ClaimHandler>(
        config: &PluginConfig,
        handler: Arc<H>,
    ) -> Result<Self, ServerError> {
        Self::start_with_metrics(config, handler, None).await
    }

    /// [`PluginServer::start`], reporting every DRA batch to `observer`.
    pub(crate) async fn start_with_metrics<H: ClaimHandler>(
        config: &PluginConfig,
        handler: Arc<H>,
        observer: Option<Arc<dyn DraObserver>>,
    ) -> Result<Self, ServerError> {
        Self::start_with_health(config, handler, observer, None).await
    }

    /// [`PluginServer::start_with_metrics`], also serving the device health stream
    /// (`v1alpha1` and `v1` `DRAResourceHealth`) on the DRA socket when `health` is given,
    /// advertised after the DRA versions.
    pub async fn start_with_health<H: ClaimHandler>(
        config: &PluginConfig,
        handler: Arc<H>,
        observer: Option<Arc<dyn DraObserver>>,
        health: Option<Arc<DeviceHealth>>,
    ) -> Result<Self, ServerError> {
        config.prepare_dirs()?;
        let dra_socket = absolute(&config.dra_socket());
        let registration_socket = absolute(&config.registration_socket());

        let dra_service = DraService::new(handler).with_observer(observer);
        let (listener, identity) = bind(&dra_socket).await?;
        let router = tonic::transport::Server::builder()
            .add_service(dra_service.v1_svc())
            .add_service(dra_service.v1beta1_svc())
            .add_optional_service(
                health
                    .as_ref()
                    .map(|h| HealthService(Arc::clone(h)).v1alpha1_svc()),
            )
            .add_optional_service(
                health
                    .as_ref()
                    .map(|h| HealthService(Arc::clone(h)).v1_svc()),
            );
        let dra = serve(dra_socket.clone(), identity, listener, router);
        info!(path = %dra_socket.display(), "serving DRA service");

        let mut registration_service = RegistrationService::new(&config.driver_name, &dra_socket);
        if health.is_some() {
            registration_service = registration_service
                .with_supported_version(HEALTH_V1ALPHA1)
                .with_supported_version(HEALTH_V1);
        }
        let state = registration_service.state();
        let (listener, identity) = bind(&registration_socket).await?;
        let router = tonic::transport::Server::builder().add_service(registration_service.svc());
        let registration = serve(registration_socket.clone(), identity, listener, router);
        info!(path = %registration_socket.display(), "serving registration service");

        Ok(Self {
            registration: Some(registration),
            dra: Some(dra),
            health,
            state,
            dra_socket,
            registration_socket,
        })
    }

    /// Absolute path of the DRA service socket (the advertised endpoint).
    pub fn dra_socket(&self) -> &Path {
        &self.dra_socket
    }

    /// Absolute path of the registration socket.
    pub fn registration_socket(&self) -> &Path {
        &self.registration_socket
    }

    /// The device health state served on the health stream, if any.
    pub fn health(&self) -> Option<&Arc<DeviceHealth>> {
        self.health.as_ref()
    }

    /// Follows the kubelet's registration verdicts.
    pub fn registration_state(&self) -> watch::Receiver<RegistrationState> {
        self.state.clone()
    }

    /// Stops registration first, then the DRA service (waiting for in-flight calls up to
    /// a grace period), and removes the sockets this instance created.
    pub async fn shutdown(mut self) -> Result<(), ServerError> {
        let reg = match self.registration.take() {
            Some(s) => s.stop().await,
            None => Ok(()),
        };
        // Health streams never end by themselves: end them so the DRA server can stop.
        if let Some(h) = self.health.take() {
            h.close();
        }
        let dra = match self.dra.take() {
            Some(s) => s.stop().await,
            None => Ok(()),
        };
        info!("plugin servers stopped");
        reg.and(dra)
    }
}

fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_owned())
}

/// Connects a gRPC channel to a unix socket, as the kubelet does.
pub async fn connect_unix(
    path: impl Into<PathBuf>,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    let path: Arc<PathBuf> = Arc::new(path.into());
    tonic::transport::Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = Arc::clone(&path);
            async move {
                let stream = tokio::net::UnixStream::connect(path.as_path()).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
            }
        }))
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_names_follow_kubelet_layout() {
        let c = PluginConfig::new("gpu.cleave.dev", "/r", "/p");
        assert_eq!(c.dra_socket(), Path::new("/p/gpu.cleave.dev/dra.sock"));
        assert_eq!(
            c.registration_socket(),
            Path::new("/r/gpu.cleave.dev-reg.sock")
        );
        assert_eq!(c.lock_file(), Path::new("/p/gpu.cleave.dev/serialize.lock"));
        let c = c.with_pod_uid(Some("abc-1".into()));
        assert_eq!(
            c.dra_socket(),
            Path::new("/p/gpu.cleave.dev/dra-abc-1.sock")
        );
        assert_eq!(
            c.registration_socket(),
            Path::new("/r/gpu.cleave.dev-abc-1-reg.sock")
        );
        let c = c.with_pod_uid(Some(String::new()));
        assert_eq!(c.pod_uid, None);
    }

    #[test]
    fn pod_uid_with_slash_is_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let c = PluginConfig::new("d", dir.path().join("r"), dir.path().join("p"))
            .with_pod_uid(Some("../x".into()));
        assert!(matches!(
            c.prepare_dirs(),
            Err(ServerError::InvalidPodUid(_))
        ));
    }

    #[test]
    fn state_dir_is_root_only() {
        let dir = tempfile::tempdir().unwrap();
        let c = PluginConfig::new("d", dir.path().join("r"), dir.path().join("p"));
        std::fs::create_dir_all(c.data_dir()).unwrap();
        std::fs::set_permissions(c.data_dir(), std::fs::Permissions::from_mode(0o755)).unwrap();
        c.prepare_dirs().unwrap();
        let mode = std::fs::metadata(c.data_dir())
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700);
    }

    #[tokio::test]
    async fn probe_tells_free_stale_and_live_sockets_apart() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.sock");
        assert_eq!(probe_socket(&path).await.unwrap(), SocketProbe::Free);
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        assert_eq!(probe_socket(&path).await.unwrap(), SocketProbe::Stale);
        std::fs::remove_file(&path).unwrap();
        let _live = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let pid = i32::try_from(std::process::id()).unwrap();
        assert_eq!(
            probe_socket(&path).await.unwrap(),
            SocketProbe::Live { pid: Some(pid) }
        );
    }

    #[tokio::test]
    async fn bind_replaces_a_stale_socket_but_never_a_live_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.sock");
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        let (listener, identity) = bind(&path).await.unwrap();
        let m = std::fs::symlink_metadata(&path).unwrap();
        assert_eq!((m.dev(), m.ino()), identity);
        assert_eq!(m.permissions().mode() & 0o777, 0o600);
        // The socket answers under its final name; the temporary name is gone.
        let _client = std::os::unix::net::UnixStream::connect(&path).unwrap();
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(left, [std::ffi::OsString::from("x.sock")]);
        let err = bind(&path).await.map(|_| ()).unwrap_err();
        assert!(matches!(err, ServerError::InUse { .. }), "{err}");
        let m = std::fs::symlink_metadata(&path).unwrap();
        assert_eq!((m.dev(), m.ino()), identity, "the live socket was replaced");
        drop(listener);
    }

    #[test]
    fn regular_file_in_place_of_socket_is_not_removed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.sock");
        std::fs::write(&path, b"keep").unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let err = rt
            .block_on(async { bind(&path).await.map(|_| ()) })
            .unwrap_err();
        assert!(matches!(err, ServerError::NotASocket { .. }), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), b"keep");
    }
}
