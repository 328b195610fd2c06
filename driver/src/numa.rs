//! The NUMA node of a GPU, for the standard attribute `resource.kubernetes.io/numaNode`
//! (KEP-6072, `keps/sig-node/6072-dra-standard-numanode`, GA in Kubernetes 1.37 with no
//! feature gate for the scalar form).
//!
//! Read from `<sysfs>/bus/pci/devices/<bus id>/numa_node`, as the upstream helper
//! `GetNUMANodeAttributeByPCIBusID` does (kubernetes
//! `staging/src/k8s.io/dynamic-resource-allocation/deviceattribute/numa_linux.go`). `-1`
//! means the platform reports no affinity: the attribute is then not published, since a
//! published value would match every other device without one; a reader treats a missing
//! attribute as unknown, never as node 0. Only the scalar form is published: the list form
//! needs the alpha gate `DRAListTypeAttributes` on the API server and the scheduler.

use std::path::Path;

/// Largest node id the upstream helper accepts (ids of 1024 and more are refused).
pub(crate) const MAX_NUMA_NODE: u32 = 1023;

/// The NUMA node of the PCI device `bus_id` (`0000:53:00.0`) under `sysfs_root`; `None`
/// when sysfs does not have the device, says `-1`, or holds something else.
pub(crate) fn numa_node(sysfs_root: &Path, bus_id: &str) -> Option<u32> {
    let path = sysfs_root
        .join("bus/pci/devices")
        .join(bus_id)
        .join("numa_node");
    let text = std::fs::read_to_string(&path).ok()?;
    parse(&text)
}

/// The value of a `numa_node` file: a node id, or `None` for `-1` and anything unreadable.
pub(crate) fn parse(text: &str) -> Option<u32> {
    let value: i64 = text.trim().parse().ok()?;
    u32::try_from(value).ok().filter(|n| *n <= MAX_NUMA_NODE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minus_one_and_garbage_mean_unknown() {
        assert_eq!(parse("1\n"), Some(1));
        assert_eq!(parse("0"), Some(0));
        assert_eq!(parse("-1\n"), None);
        assert_eq!(parse(""), None);
        assert_eq!(parse("x"), None);
        assert_eq!(parse("1024"), None);
    }

    #[test]
    fn read_from_the_pci_device_directory() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let dev = dir.path().join("bus/pci/devices/0000:53:00.0");
        std::fs::create_dir_all(&dev).unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(dev.join("numa_node"), "1\n").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(numa_node(dir.path(), "0000:53:00.0"), Some(1));
        std::fs::write(dev.join("numa_node"), "-1\n").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(numa_node(dir.path(), "0000:53:00.0"), None);
        assert_eq!(numa_node(dir.path(), "0000:64:00.0"), None);
    }
}
