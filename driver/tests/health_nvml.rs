//! The health watcher against the mock NVML: Xid events through the control file, the
//! application-Xid filter, GPU/compute instance attribution and lost/recovered GPUs.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::mpsc;
use std::time::Duration;

use cleave_driver::backend::GpuBackend as _;
use cleave_driver::health::{HealthEvent, HealthEventKind, HealthWatcher, WatchOptions};
use cleave_driver::nvml::NvmlBackend;
use common::{mock_lib, run_child, scenario};

fn next(rx: &mpsc::Receiver<HealthEvent>) -> HealthEvent {
    rx.recv_timeout(Duration::from_secs(10))
        .expect("no health event within 10 s")
}

#[test]
fn xid_events_and_lost_gpus() {
    if scenario().is_some() {
        let control = std::path::PathBuf::from(std::env::var("MOCK_NVML_CONTROL").unwrap());
        let backend = NvmlBackend::open(Some(&mock_lib())).unwrap();
        let inv = backend.inventory().unwrap();
        let uuids: Vec<String> = inv.gpus.iter().map(|g| g.uuid.clone()).collect();
        let (tx, rx) = mpsc::channel();
        // The backend's own NVML handle serves the events.
        let watcher = HealthWatcher::start(
            backend.event_source().unwrap(),
            uuids.clone(),
            WatchOptions {
                wait: Duration::from_millis(100),
                lost_check_interval: Duration::from_millis(200),
                ..WatchOptions::default()
            },
            move |e| {
                let _ = tx.send(e);
            },
        )
        .unwrap();
        let mut lines = String::new();
        let mut push = |line: &str| {
            lines.push_str(line);
            lines.push('\n');
            std::fs::write(&control, &lines).unwrap();
        };
        // An application Xid: reported, not fatal.
        push("xid 1 31");
        let ev = next(&rx);
        assert_eq!(
            (ev.kind, ev.xid, ev.fatal),
            (HealthEventKind::Xid, Some(31), false)
        );
        assert_eq!(ev.gpu_uuid, uuids[1]);
        // A fatal GPU-wide Xid.
        push("xid 0 79");
        let ev = next(&rx);
        assert_eq!((ev.xid, ev.fatal, ev.gi), (Some(79), true, None));
        assert_eq!(ev.gpu_uuid, uuids[0]);
        // Attributed to a GPU/compute instance.
        push("xid 2 48 7 0");
        let ev = next(&rx);
        assert_eq!(
            (ev.xid, ev.gi, ev.ci, ev.fatal),
            (Some(48), Some(7), Some(0), true)
        );
        // GPU 3 falls off the bus, then comes back.
        push("lost 3");
        let ev = next(&rx);
        assert_eq!((ev.kind, ev.fatal), (HealthEventKind::Lost, true));
        assert_eq!(ev.gpu_uuid, uuids[3]);
        lines.clear();
        std::fs::write(&control, "xid 0 79\nxid 1 31\nxid 2 48 7 0\n").unwrap();
        let ev = next(&rx);
        assert_eq!((ev.kind, ev.fatal), (HealthEventKind::Recovered, false));
        assert_eq!(ev.gpu_uuid, uuids[3]);
        // Stops promptly.
        let started = std::time::Instant::now();
        watcher.stop();
        assert!(started.elapsed() < Duration::from_secs(2));
        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err());
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let control = dir.path().join("control");
    std::fs::write(&control, "").unwrap();
    run_child(
        "xid_events_and_lost_gpus",
        "h100",
        &[
            ("MOCK_NVML_PROFILE", "h100-80gb-x8"),
            ("MOCK_NVML_CONTROL", control.to_str().unwrap()),
        ],
    );
}
