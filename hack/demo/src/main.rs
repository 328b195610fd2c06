//! `cleave-demo`: the whole kubelet plugin in one process on a simulated node, as a guided
//! tour (see [`tour`]). Built on the plugin library, the API server stand-in, the mock NVML
//! library and the fake NVIDIA tools; none of them is in the shipped plugin.
//!
//! The binary is also the demo's `nvidia-cuda-mps-control` and `nvidia-smi`: the tool
//! wrappers in the simulated driver root run it as `cleave-demo __fake <tool> <args>...`.
//! And it is the demo's CDI hook: the plugin installs a copy of it as `cleave-cdi-hook`
//! (the hook of the plugin package is not built by `cargo run -p cleave-demo`), and run
//! under that name it is the real hook (`cleave_cdi_hook::main`).

use std::process::ExitCode;

use anyhow::Context as _;
use clap::Parser;

mod tour;

/// Runs the whole cleave kubelet plugin in-process against mock GPUs and an API server
/// stand-in, and checks every step.
#[derive(Debug, Parser)]
#[command(name = "cleave-demo", version, about, long_about = None)]
struct Cli {
    /// Logging flags.
    #[command(flatten)]
    log: cleave_kubelet_plugin::args::LogArgs,
    /// What to simulate.
    #[command(flatten)]
    demo: tour::DemoArgs,
}

fn main() -> ExitCode {
    // The demo's tool wrappers run this binary as its fake NVIDIA tools (never in --help).
    let args: Vec<String> = std::env::args().collect();
    if runs_as_cdi_hook(&args) {
        return cleave_cdi_hook::main();
    }
    if let Some(code) = cleave_testkit::runner::play_fake_tool(&args) {
        return ExitCode::from(u8::try_from(code).unwrap_or(1));
    }
    let cli = Cli::parse();
    cleave_kubelet_plugin::install_crypto_provider();
    match run(&cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Whether this process was started under the CDI hook's name, as the runtime runs the copy
/// the plugin installed (`args[0]` of a CDI hook is its program name).
fn runs_as_cdi_hook(args: &[String]) -> bool {
    args.first()
        .and_then(|a0| std::path::Path::new(a0).file_name())
        .is_some_and(|name| name == cleave_driver::driver_root::CDI_HOOK_NAME)
}

fn run(cli: &Cli) -> anyhow::Result<ExitCode> {
    // Environment changes must happen while the process is single-threaded.
    let exe = std::env::current_exe()?;
    let lib = cleave_testkit::locate::cdylib_path().ok_or_else(|| {
        anyhow::anyhow!(
            "demo: no {} next to {} (build it with `cargo build -p cleave-mock-nvml`)",
            cleave_testkit::locate::CDYLIB_NAME,
            exe.display()
        )
    })?;
    // Short: the MPS daemon's sockets lie below it, and a unix socket path has at most 107
    // bytes (`<dir>/plugins/gpu.cleave.dev/mps/<claim uid>/pipe/control_privileged`).
    let dir = tempfile::Builder::new()
        .prefix("cleave-")
        .tempdir()
        .context("creating the demo's working directory")?;
    for (key, value) in tour::mock_env(&cli.demo, dir.path()) {
        cleave_testkit::set_env(key, &value);
    }
    // The demo's output is the tour; its logs only say what went wrong.
    cleave_kubelet_plugin::init_telemetry(
        cli.log.log_format,
        Some(cli.log.log_level.as_deref().unwrap_or("warn")),
    )
    .map_err(anyhow::Error::msg)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(tour::run(&cli.demo, dir.path(), lib))
}
