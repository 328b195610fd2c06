//! Unit tests of the sharing modules' pure parts (paths, limits, share sizes, daemon names);
//! the strategies end to end are in the crate's `tests/sharing.rs`.

mod manager {
    use std::path::{Path, PathBuf};

    use crate::sharing::{SharingBinaries, SharingConfig, SharingManager};

    #[test]
    fn tools_are_found_under_the_driver_root_or_given() {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(root.path().join("bin")).unwrap();
        std::fs::write(root.path().join("bin/nvidia-smi"), "").unwrap();
        let found = SharingBinaries::under_driver_root(root.path());
        assert_eq!(found.nvidia_smi, root.path().join("bin/nvidia-smi"));
        // Missing: the usual place, so that an error names where it was expected.
        assert_eq!(
            found.mps_control,
            root.path().join("usr/bin/nvidia-cuda-mps-control")
        );
        let given = found.with_overrides(Some("/opt/mps".into()), None);
        assert_eq!(given.mps_control, PathBuf::from("/opt/mps"));
        assert_eq!(given.nvidia_smi, root.path().join("bin/nvidia-smi"));
    }

    #[test]
    fn mount_source_is_the_host_view_of_the_state_dir() {
        let mut config = SharingConfig::new(
            "/var/lib/kubelet/plugins/gpu.cleave.dev",
            SharingBinaries::under_driver_root(Path::new("/")),
        );
        config.host_state_dir = Some("/host/plugins/gpu.cleave.dev".into());
        let m = SharingManager::new(config);
        assert_eq!(
            m.host_pipe_dir("uid-1"),
            PathBuf::from("/host/plugins/gpu.cleave.dev/mps/uid-1/pipe")
        );
        assert_eq!(
            m.spec("uid-1", vec![]).pipe_dir,
            PathBuf::from("/var/lib/kubelet/plugins/gpu.cleave.dev/mps/uid-1/pipe")
        );
    }
}

mod mps {
    use std::fs;
    use std::path::{Path, PathBuf};

    use crate::sharing::mps::*;

    #[test]
    fn limits_use_whole_gib_or_mib_rounded_down() {
        assert_eq!(format_limit(10 << 30).as_deref(), Some("10G"));
        assert_eq!(format_limit(8192 << 20).as_deref(), Some("8G"));
        assert_eq!(format_limit(1536 << 20).as_deref(), Some("1536M"));
        assert_eq!(format_limit((5 << 20) + 123).as_deref(), Some("5M"));
        assert_eq!(format_limit(1_000_000_000).as_deref(), Some("953M"));
        assert_eq!(format_limit((1 << 20) - 1), None);
    }

    #[test]
    fn socket_paths_must_fit_a_unix_socket_address() {
        let dir = PathBuf::from(format!("/{}", "d".repeat(94)));
        assert_eq!(socket_path_too_long(&dir, CONTROL_SOCKET), None);
        assert_eq!(socket_path_too_long(&dir, LONGEST_SOCKET), Some(114));
        let dir = PathBuf::from(format!("/{}", "d".repeat(87)));
        assert_eq!(
            socket_path_too_long(&dir, LONGEST_SOCKET),
            None,
            "107 bytes fit"
        );
        let dir = PathBuf::from(format!("/{}", "d".repeat(88)));
        assert_eq!(socket_path_too_long(&dir, LONGEST_SOCKET), Some(108));
    }

    #[test]
    fn closed_parents_of_the_pipe_directory_are_found() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let open = tmp.path().join("open");
        let closed = open.join("closed");
        let pipe = closed.join("pipe");
        fs::create_dir_all(&pipe).unwrap();
        let set =
            |p: &Path, mode| fs::set_permissions(p, fs::Permissions::from_mode(mode)).unwrap();
        set(tmp.path(), 0o711);
        set(&open, 0o755);
        set(&closed, 0o700);
        set(&pipe, 0o777);
        assert_eq!(closed_parent(&pipe), Some(closed.clone()));
        set(&closed, 0o711);
        assert_eq!(closed_parent(&pipe), None);
    }

    #[test]
    fn limits_read_back_in_either_unit() {
        assert_eq!(parse_limit("1536M"), Some(1536 << 20));
        assert_eq!(parse_limit("10G"), Some(10 << 30));
        assert_eq!(parse_limit("1.5G"), None);
        assert_eq!(parse_limit("G"), None);
        assert!(limit_matches("8G", "8192M"));
        assert!(limit_matches("1536M", "1536M"));
        // Driver 595 as reported: whole GiB rounded down.
        assert!(limit_matches("1536M", "1G"));
        assert!(!limit_matches("1536M", "2G"));
        assert!(!limit_matches("512M", "0G"));
        assert!(!limit_matches(
            "10G",
            "No default pinned memory limit set for the device!"
        ));
    }

    #[test]
    fn percentage_answer_takes_the_last_line() {
        assert_eq!(parse_percentage("100.0\n"), Some(100.0));
        assert_eq!(parse_percentage("\n25.0\n\n"), Some(25.0));
        assert_eq!(parse_percentage("Invalid device 3\n25.0\n"), Some(25.0));
        assert_eq!(
            parse_percentage("Cannot find MPS control daemon process"),
            None
        );
        assert_eq!(parse_percentage(""), None);
    }

    #[test]
    fn commands_and_client_env_use_ordinals() {
        let record = MpsRecord {
            spec: DaemonSpec {
                claim_uid: "u".into(),
                pipe_dir: "/s/mps/u/pipe".into(),
                log_dir: "/s/mps/u/log".into(),
                visible_devices: vec!["GPU-a".into(), "MIG-b".into()],
                multi_user: false,
            },
            host_pipe_dir: "/s/mps/u/pipe".into(),
            active_thread_percentage: 25,
            pinned_limits: vec![
                PinnedLimit {
                    ordinal: 0,
                    uuid: "GPU-a".into(),
                    limit: "10G".into(),
                },
                PinnedLimit {
                    ordinal: 1,
                    uuid: "MIG-b".into(),
                    limit: "512M".into(),
                },
            ],
            exclusive_gpus: vec!["GPU-a".into()],
            daemon: None,
        };
        assert_eq!(
            record.limit_commands(),
            "set_default_active_thread_percentage 25\n\
                 set_default_device_pinned_mem_limit 0 10G\n\
                 set_default_device_pinned_mem_limit 1 512M\n\
                 get_default_active_thread_percentage\n\
                 get_default_device_pinned_mem_limit 0\n\
                 get_default_device_pinned_mem_limit 1\n"
        );
        // Read back: each value as set.
        assert_eq!(record.check_limit_answer("25.0\n10G\n512M\n"), Ok(()));
        // Sets that print an acknowledgement: still the last lines count.
        assert_eq!(
            record.check_limit_answer("ok\nok\nok\n25.0\n10G\n512M\n"),
            Ok(())
        );
        // A rejected set (exit status 0, error on stdout): the daemon's words come back.
        let err = record
            .check_limit_answer(
                "Invalid percentage, expected between (0.0, 100.0]\n100.0\n10G\n512M\n",
            )
            .unwrap_err();
        assert!(
            err.contains("active thread percentage: set 25")
                && err.contains("answered `100.0`")
                && err.contains("Invalid percentage, expected between (0.0, 100.0]"),
            "{err}"
        );
        let err = record
            .check_limit_answer("25.0\nNo default pinned memory limit set for the device!\n512M\n")
            .unwrap_err();
        assert!(
            err.contains("device 0 (GPU-a): set 10G")
                && err.contains("No default pinned memory limit set for the device!"),
            "{err}"
        );
        assert!(record.check_limit_answer("25.0\n").is_err());
        assert_eq!(
            record.client_memory_limit().as_deref(),
            Some("0=10G,1=512M")
        );
        let json = serde_json::to_value(&record).unwrap();
        assert_eq!(serde_json::from_value::<MpsRecord>(json).unwrap(), record);
    }
}

mod shares {
    use crate::sharing::{
        Capacity, GpuFacts, ShareDevice, legacy_shared_daemon_key, shared_daemon_key,
        takes_whole_device,
    };

    fn share(used: (Option<u64>, Option<u32>), device: (u64, Option<u32>)) -> ShareDevice {
        ShareDevice {
            device_name: "gpu-0".into(),
            uuid: "GPU-1".into(),
            gpu_uuid: "GPU-1".into(),
            gpu: Some(GpuFacts {
                uuid: "GPU-1".into(),
                index: 0,
                minor: 0,
                product_name: "H100".into(),
                compute_capability: (9, 0),
                device_memory_bytes: Some(device.0),
                multiprocessors: device.1,
                mig_enabled: false,
            }),
            device_multiprocessors: device.1,
            share_id: "s".into(),
            memory_bytes: used.0,
            multiprocessors: used.1,
            client_thread_percentage: None,
            client_memory_bytes: None,
        }
    }

    #[test]
    fn share_thread_percentage_and_whole_device() {
        const GIB: u64 = 1 << 30;
        // H100 80GB: 81559 MiB and 1/2 MiB more, published rounded down to 1Mi.
        let memory = 81_559 * (1 << 20) + (1 << 19);
        let s = |m, sms| share((Some(m), Some(sms)), (memory, Some(132)));
        assert_eq!(s(20 * GIB, 44).thread_percentage(), 33);
        assert_eq!(s(20 * GIB, 1).thread_percentage(), 1, "at least 1");
        assert_eq!(s(20 * GIB, 132).thread_percentage(), 100);
        assert_eq!(share((None, None), (memory, None)).thread_percentage(), 100);
        assert!(!s(20 * GIB, 132).takes_whole_device());
        assert!(!s(81_559 << 20, 131).takes_whole_device());
        assert!(s(81_559 << 20, 132).takes_whole_device());
        assert!(!share((Some(memory), None), (memory, Some(132))).takes_whole_device());
    }

    #[test]
    fn shared_daemon_names_are_valid_claim_names() {
        let long_ns = "n".repeat(63);
        for device in [
            "gpu-0",
            "gpu-12-mig-1g10gb-6",
            &"a".repeat(63),
            &format!("{}-b", "a".repeat(44)),
        ] {
            for ns in ["default", "a", long_ns.as_str()] {
                let key = shared_daemon_key(device, ns);
                assert!(key.len() <= 63, "{key}");
                crate::cdi::validate_claim_uid(&key).unwrap();
            }
            let legacy = legacy_shared_daemon_key(device);
            assert!(legacy.len() <= 63, "{legacy}");
            crate::cdi::validate_claim_uid(&legacy).unwrap();
        }
        // One daemon per device and namespace; never the name an earlier release used.
        let a = shared_daemon_key("gpu-0", "team-a");
        assert!(a.starts_with("shared-gpu-0-"), "{a}");
        assert_ne!(a, shared_daemon_key("gpu-0", "team-b"));
        assert_ne!(a, shared_daemon_key("gpu-1", "team-a"));
        assert_eq!(a, shared_daemon_key("gpu-0", "team-a"));
        assert_ne!(a, legacy_shared_daemon_key("gpu-0"));
        assert_eq!(legacy_shared_daemon_key("gpu-0"), "shared-gpu-0");
        let name = crate::cdi::share_device_name(
            "gpu-7-mig-3g40gb-4",
            "5a000000-0000-4000-8000-00000000000a",
        );
        assert!(name.len() <= 63 && !name.ends_with('-'), "{name}");
        crate::cdi::validate_device_name(&name).unwrap();
    }

    #[test]
    fn whole_device_needs_all_of_both_sizes_known() {
        let device = Capacity {
            memory_bytes: Some((10 << 30) + 100),
            multiprocessors: Some(100),
        };
        let used = |m: Option<u64>, n: Option<u32>| Capacity {
            memory_bytes: m,
            multiprocessors: n,
        };
        // The device's memory counts rounded down to 1Mi, as published.
        assert!(takes_whole_device(used(Some(10 << 30), Some(100)), device));
        assert!(takes_whole_device(used(Some(11 << 30), Some(101)), device));
        assert!(!takes_whole_device(
            used(Some((10 << 30) - 1), Some(100)),
            device
        ));
        assert!(!takes_whole_device(used(Some(10 << 30), Some(99)), device));
        assert!(!takes_whole_device(used(None, Some(100)), device));
        let unknown = Capacity {
            memory_bytes: Some(10 << 30),
            multiprocessors: None,
        };
        assert!(!takes_whole_device(
            used(Some(10 << 30), Some(100)),
            unknown
        ));
    }
}
