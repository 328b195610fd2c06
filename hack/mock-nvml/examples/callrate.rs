//! Prints how long mock NVML calls take through nvml-wrapper (the cost a test or the demo
//! pays per call): a call that touches no state, a state read, and a full MIG
//! create/destroy cycle (GI + CI create, CI + GI destroy: four locked read-modify-writes).
//!
//! `cargo build -p cleave-mock-nvml && cargo run --release -p cleave-mock-nvml --example callrate`
#![allow(unsafe_code)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Instant;

use nvml_wrapper::Nvml;
use nvml_wrapper_sys::bindings::*;

fn per_call_us(n: u32, mut f: impl FnMut()) -> f64 {
    let t = Instant::now();
    for _ in 0..n {
        f();
    }
    t.elapsed().as_secs_f64() * 1e6 / f64::from(n)
}

fn main() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state.json");
    // SAFETY: single-threaded here, before the library is loaded.
    unsafe {
        std::env::set_var("MOCK_NVML_STATE", &state);
        std::env::set_var("MOCK_NVML_PROFILE", "h100-80gb-x8");
    }
    let lib = mock_nvml::locate::cdylib_path().expect("run cargo build -p cleave-mock-nvml first");
    println!("library: {}", lib.display());
    let nvml = Nvml::builder().lib_path(lib.as_os_str()).init().unwrap();
    let d = nvml.device_by_index(0).unwrap();
    let h = unsafe { d.handle() };

    let uuid = per_call_us(5000, || {
        d.uuid().unwrap();
    });
    let mig_mode = per_call_us(5000, || {
        d.mig_mode().unwrap();
    });
    let cycle = per_call_us(300, || unsafe {
        let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
        let p = nvmlGpuInstancePlacement_t { start: 4, size: 4 };
        assert_eq!(
            nvml.lib()
                .nvmlDeviceCreateGpuInstanceWithPlacement(h, 9, &p, &mut gi),
            0
        );
        let mut ci: nvmlComputeInstance_t = std::ptr::null_mut();
        assert_eq!(
            nvml.lib()
                .nvmlGpuInstanceCreateComputeInstance(gi, 2, &mut ci),
            0
        );
        assert_eq!(nvml.lib().nvmlComputeInstanceDestroy(ci), 0);
        assert_eq!(nvml.lib().nvmlGpuInstanceDestroy(gi), 0);
    });
    println!("nvmlDeviceGetUUID (no state):      {uuid:8.1} us/call");
    println!(
        "nvmlDeviceGetMigMode (state read): {mig_mode:8.1} us/call ({:.1}x the UUID call)",
        mig_mode / uuid
    );
    println!(
        "3g GI+CI create+destroy cycle:     {cycle:8.1} us/cycle ({:.1}x a state read)",
        cycle / mig_mode
    );
}
