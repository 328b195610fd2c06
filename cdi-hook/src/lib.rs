//! cleave's CDI hook: the program cleave's CDI specs name in `createContainer` hooks, with
//! the subcommands and argument forms of NVIDIA's `nvidia-cdi-hook` so the specs look alike.
//! It reads the OCI container state on stdin, finds the container root from the bundle,
//! and changes files inside that root only.

mod compat;
mod deadline;
mod error;
mod ldcache;
mod log;
mod mount;
mod params;
mod root;
mod state;
mod symlinks;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::error::Result;
use crate::root::ContainerRoot;

/// Subcommands this build knows; anything else is logged and ignored, as NVIDIA's hook does,
/// so that a spec written for a newer hook does not stop containers from starting.
const KNOWN: &[&str] = &[
    "create-symlinks",
    "update-ldcache",
    "enable-cuda-compat",
    "disable-device-node-modification",
    "help",
];

#[derive(Debug, Parser)]
#[command(
    name = "cleave-cdi-hook",
    version,
    about = "OCI createContainer hook for cleave's CDI specs (reads the OCI state on stdin)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Create symlinks inside the container root.
    CreateSymlinks {
        /// `<target>::<link>`; the link is a container path, the target is written as given.
        #[arg(long = "link")]
        links: Vec<String>,
        #[command(flatten)]
        spec: SpecArg,
    },
    /// Add folders to an ld.so.conf.d drop-in and rebuild the container's ld cache with the
    /// host's ldconfig.
    UpdateLdcache {
        /// Container folder holding injected libraries (repeatable).
        #[arg(long = "folder")]
        folders: Vec<PathBuf>,
        /// The host's ldconfig; `<path>.real` is used when it exists.
        #[arg(long = "ldconfig-path", default_value = ldcache::DEFAULT_LDCONFIG)]
        ldconfig_path: PathBuf,
        /// Seconds the host's ldconfig may run before it is killed (for tests).
        #[arg(long = "ldconfig-timeout-secs", default_value_t = ldcache::LDCONFIG_TIMEOUT.as_secs(), hide = true)]
        ldconfig_timeout_secs: u64,
        #[command(flatten)]
        spec: SpecArg,
    },
    /// Put the image's CUDA forward-compat libraries first in the ld search path when they
    /// are newer than the host driver.
    EnableCudaCompat {
        /// The host driver version, e.g. 550.163.01.
        #[arg(long = "host-driver-version")]
        host_driver_version: Option<String>,
        /// The CUDA version the host driver supports, e.g. 12.4.
        #[arg(long = "host-cuda-version")]
        host_cuda_version: Option<String>,
        /// Folder of the compat libraries in the container.
        #[arg(long = "cuda-compat-container-root", default_value = compat::DEFAULT_COMPAT_DIR)]
        compat_dir: PathBuf,
        #[command(flatten)]
        spec: SpecArg,
    },
    /// Show the container a /proc/driver/nvidia/params with ModifyDeviceFiles: 0.
    DisableDeviceNodeModification {
        /// The host's params file (for tests).
        #[arg(long = "host-params-path", default_value = params::PARAMS_PATH, hide = true)]
        host_params: PathBuf,
        #[command(flatten)]
        spec: SpecArg,
    },
}

#[derive(Debug, clap::Args)]
struct SpecArg {
    /// Read the OCI state from this file instead of stdin (`-` is stdin); for testing.
    #[arg(long = "container-spec", hide = true)]
    container_spec: Option<PathBuf>,
    /// Seconds after which the whole hook gives up and exits 1 (for tests).
    #[arg(long = "deadline-secs", default_value_t = deadline::DEFAULT.as_secs(), hide = true)]
    deadline_secs: u64,
}

impl Command {
    fn spec(&self) -> &SpecArg {
        match self {
            Command::CreateSymlinks { spec, .. }
            | Command::UpdateLdcache { spec, .. }
            | Command::EnableCudaCompat { spec, .. }
            | Command::DisableDeviceNodeModification { spec, .. } => spec,
        }
    }
}

impl SpecArg {
    fn root(&self) -> Result<ContainerRoot> {
        let source = match &self.container_spec {
            Some(p) if p != Path::new("-") => p.display().to_string(),
            _ => "stdin".to_owned(),
        };
        let st = state::load(self.container_spec.as_deref())?;
        ContainerRoot::new(&st.container_root(&source)?)
    }
}

fn run(cmd: Command) -> Result<()> {
    match cmd {
        Command::CreateSymlinks { links, spec } => {
            if links.is_empty() {
                log::line(
                    "create-symlinks",
                    format_args!("no --link given; nothing to do"),
                );
                return Ok(());
            }
            symlinks::run(&spec.root()?, &links)
        }
        Command::UpdateLdcache {
            folders,
            ldconfig_path,
            ldconfig_timeout_secs,
            spec,
        } => ldcache::run(
            &spec.root()?,
            &ldcache::Options {
                folders,
                ldconfig: ldconfig_path,
                timeout: std::time::Duration::from_secs(ldconfig_timeout_secs),
            },
        ),
        Command::EnableCudaCompat {
            host_driver_version,
            host_cuda_version,
            compat_dir,
            spec,
        } => {
            let given = |v: &Option<String>| v.as_deref().is_some_and(|s| !s.is_empty());
            if !given(&host_driver_version) && !given(&host_cuda_version) {
                log::line(
                    "enable-cuda-compat",
                    format_args!("no host driver or CUDA version given; nothing to do"),
                );
                return Ok(());
            }
            compat::run(
                &spec.root()?,
                &compat::Options {
                    host_driver_version,
                    host_cuda_version,
                    compat_dir,
                },
            )
        }
        Command::DisableDeviceNodeModification { host_params, spec } => {
            match params::plan(&host_params)? {
                None => {
                    params::log_nothing_to_do(&host_params);
                    Ok(())
                }
                Some(contents) => params::apply(&spec.root()?, &contents).map(|_| ()),
            }
        }
    }
}

/// The hook's entry point: parses the command line, runs the subcommand on the container
/// whose OCI state is on stdin, and returns the exit code (1 on any failure, with the
/// reason on stderr). The `cleave-cdi-hook` binary of the plugin package calls only this.
pub fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if let Some(first) = args.iter().skip(1).find(|a| !a.starts_with('-'))
        && !KNOWN.contains(&first.as_str())
    {
        eprintln!("cleave-cdi-hook: unsupported hook {first:?}; ignoring it");
        return ExitCode::SUCCESS;
    }
    let cli = Cli::parse_from(args);
    deadline::start(std::time::Duration::from_secs(
        cli.command.spec().deadline_secs,
    ));
    match run(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let mut msg = e.to_string();
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                let s_text = s.to_string();
                if !msg.contains(&s_text) {
                    msg.push_str(": ");
                    msg.push_str(&s_text);
                }
                src = s.source();
            }
            eprintln!("cleave-cdi-hook: error: {}", log::escape(&msg));
            ExitCode::FAILURE
        }
    }
}
