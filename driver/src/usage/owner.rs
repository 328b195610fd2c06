//! Which Kubernetes pod a host process runs in, from its cgroup (`<proc root>/<pid>/cgroup`).
//!
//! The kubelet names a pod's cgroup `pod` + the pod UID under its QoS class cgroup
//! (kubelet `pkg/kubelet/cm/pod_container_manager_linux.go`, `GetPodContainerName`:
//! `podCgroupNamePrefix + string(pod.UID)`), and writes it per cgroup driver
//! (`pkg/kubelet/cm/cgroup_manager_linux.go`): the cgroupfs driver joins the parts
//! (`/kubepods/burstable/pod<uid>/<container id>`), the systemd driver turns each part into
//! a nested slice and escapes `-` as `_` (`escapeSystemdCgroupName`):
//! `/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid with _>.slice/cri-containerd-<id>.scope`.
//! Guaranteed pods sit directly under `kubepods`. Lines are `0::<path>` on cgroup v2 and
//! `<n>:<controllers>:<path>` on v1; every line is looked at, the first pod found wins.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The pod UID named by one cgroup path, if any.
fn pod_in_path(path: &str) -> Option<String> {
    path.split('/').find_map(|part| {
        // systemd: `kubepods-burstable-pod<uid>.slice` (the last `-` part); cgroupfs: `pod<uid>`.
        let part = part.strip_suffix(".slice").unwrap_or(part);
        let last = part.rsplit('-').next().unwrap_or(part);
        [part, last].into_iter().find_map(|c| {
            let uid = c.strip_prefix("pod")?.replace('_', "-");
            looks_like_uid(&uid).then_some(uid)
        })
    })
}

/// A pod UID: a UUID, or the 32 hex digits of a static pod's config hash.
fn looks_like_uid(s: &str) -> bool {
    let hex = s.bytes().filter(u8::is_ascii_hexdigit).count();
    hex == 32 && s.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
}

/// The pod UID named by the text of a `/proc/<pid>/cgroup` file, if any.
pub(crate) fn pod_of_cgroup_file(text: &str) -> Option<String> {
    text.lines().find_map(|line| {
        let path = line.splitn(3, ':').nth(2)?;
        pod_in_path(path)
    })
}

/// Resolves host PIDs to pod UIDs under one proc root, each PID read at most once per
/// resolver (one sampling round). A PID whose file is gone or unreadable, or that runs in
/// no pod, has no owner.
#[derive(Debug, Default)]
pub struct PodResolver {
    proc_root: PathBuf,
    /// Per PID: `None` when its file could not be read, else the pod it names, if any.
    seen: HashMap<u32, Option<Option<String>>>,
}

impl PodResolver {
    /// A resolver reading `<proc_root>/<pid>/cgroup`.
    pub fn new(proc_root: &Path) -> Self {
        Self {
            proc_root: proc_root.to_path_buf(),
            seen: HashMap::new(),
        }
    }

    fn lookup(&mut self, pid: u32) -> &Option<Option<String>> {
        let root = &self.proc_root;
        self.seen.entry(pid).or_insert_with(|| {
            let file: PathBuf = root.join(pid.to_string()).join("cgroup");
            std::fs::read_to_string(file)
                .ok()
                .map(|t| pod_of_cgroup_file(&t))
        })
    }

    /// The UID of the pod `pid` runs in.
    pub(crate) fn pod_of(&mut self, pid: u32) -> Option<&str> {
        self.lookup(pid).as_ref().and_then(|p| p.as_deref())
    }

    /// Whether the cgroup file of `pid` could be read (the process is visible under the
    /// proc root: same PID namespace, still running).
    pub fn readable(&mut self, pid: u32) -> bool {
        self.lookup(pid).is_some()
    }

    /// How many PIDs were read.
    pub fn resolved(&self) -> usize {
        self.seen.len()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    const UID: &str = "0f6b2c1e-7a3d-4c55-9e21-8b1d2f3a4c5d";

    #[test]
    fn cgroup_v2_systemd_driver() {
        let text = "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0f6b2c1e_7a3d_4c55_9e21_8b1d2f3a4c5d.slice/cri-containerd-5e1f0c9a3b7d2e4f6a8c0b1d3e5f7a9c1b3d5e7f9a0c2e4b6d8f0a1c3e5b7d9f.scope\n";
        assert_eq!(pod_of_cgroup_file(text).as_deref(), Some(UID));
        let besteffort = "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0f6b2c1e_7a3d_4c55_9e21_8b1d2f3a4c5d.slice/crio-1234abcd.scope\n";
        assert_eq!(pod_of_cgroup_file(besteffort).as_deref(), Some(UID));
        let guaranteed = "0::/kubepods.slice/kubepods-pod0f6b2c1e_7a3d_4c55_9e21_8b1d2f3a4c5d.slice/cri-containerd-ab12.scope\n";
        assert_eq!(pod_of_cgroup_file(guaranteed).as_deref(), Some(UID));
    }

    #[test]
    fn cgroup_v2_cgroupfs_driver_and_namespaced_paths() {
        for text in [
            "0::/kubepods/burstable/pod0f6b2c1e-7a3d-4c55-9e21-8b1d2f3a4c5d/5e1f0c9a3b7d2e4f6a8c0b1d3e5f7a9c\n",
            "0::/kubepods/besteffort/pod0f6b2c1e-7a3d-4c55-9e21-8b1d2f3a4c5d/5e1f0c9a\n",
            "0::/kubepods/pod0f6b2c1e-7a3d-4c55-9e21-8b1d2f3a4c5d/5e1f0c9a\n",
            // Seen from a private cgroup namespace, or under kind's nested kubelet slice.
            "0::/../../kubepods-burstable-pod0f6b2c1e_7a3d_4c55_9e21_8b1d2f3a4c5d.slice/cri-containerd-ab.scope\n",
            "0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod0f6b2c1e_7a3d_4c55_9e21_8b1d2f3a4c5d.slice/cri-containerd-ab.scope\n",
        ] {
            assert_eq!(pod_of_cgroup_file(text).as_deref(), Some(UID), "{text}");
        }
    }

    #[test]
    fn cgroup_v1_lines() {
        let text = "12:pids:/kubepods/burstable/pod0f6b2c1e-7a3d-4c55-9e21-8b1d2f3a4c5d/9f8e7d\n\
                    11:memory:/kubepods/burstable/pod0f6b2c1e-7a3d-4c55-9e21-8b1d2f3a4c5d/9f8e7d\n\
                    1:name=systemd:/kubepods/burstable/pod0f6b2c1e-7a3d-4c55-9e21-8b1d2f3a4c5d/9f8e7d\n";
        assert_eq!(pod_of_cgroup_file(text).as_deref(), Some(UID));
        let systemd = "4:cpu,cpuacct:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0f6b2c1e_7a3d_4c55_9e21_8b1d2f3a4c5d.slice/docker-9f8e.scope\n";
        assert_eq!(pod_of_cgroup_file(systemd).as_deref(), Some(UID));
        // A static pod: its UID is the 32-hex-digit config hash.
        let static_pod = "0::/kubepods/burstable/pod6b1f3d2a9c8e7f6a5b4c3d2e1f0a9b8c/ab\n";
        assert_eq!(
            pod_of_cgroup_file(static_pod).as_deref(),
            Some("6b1f3d2a9c8e7f6a5b4c3d2e1f0a9b8c")
        );
    }

    #[test]
    fn host_processes_have_no_pod() {
        for text in [
            "0::/system.slice/containerd.service\n",
            "0::/user.slice/user-1000.slice/session-3.scope\n",
            "0::/kubepods.slice/kubepods-burstable.slice\n",
            "0::/\n",
            "12:pids:/\n1:name=systemd:/init.scope\n",
            "0::/kubepods/burstable/podnot-a-uid/ab\n",
            "",
        ] {
            assert_eq!(pod_of_cgroup_file(text), None, "{text}");
        }
    }

    #[test]
    fn resolver_reads_each_pid_once_and_gone_pids_have_no_owner() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("4242");
        std::fs::create_dir(&p).unwrap();
        std::fs::write(
            p.join("cgroup"),
            "0::/kubepods/besteffort/pod0f6b2c1e-7a3d-4c55-9e21-8b1d2f3a4c5d/ab\n",
        )
        .unwrap();
        let mut r = PodResolver::new(dir.path());
        assert_eq!(r.pod_of(4242), Some(UID));
        assert_eq!(r.pod_of(4343), None, "no such PID");
        assert!(r.readable(4242) && !r.readable(4343));
        std::fs::remove_dir_all(&p).unwrap();
        assert_eq!(r.pod_of(4242), Some(UID), "cached for the round");
        assert_eq!(r.resolved(), 2);
    }
}
