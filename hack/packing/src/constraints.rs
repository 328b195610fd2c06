//! First fit with a `matchAttribute` constraint, as the upstream allocator
//! (`k8s.io/dynamic-resource-allocation/structured`) treats one: the requests of a claim are
//! satisfied in order, each by the first free device in publish order that its class
//! selects, and a device joins only if its value of the constrained attribute equals the
//! value of the devices already chosen; a device without the attribute never satisfies the
//! constraint. When a later request finds no device, the allocator backtracks to the
//! previous request's next candidate. Enough to place claims that align devices on
//! `resource.kubernetes.io/numaNode`; it models one claim on one node and whole devices.

use std::collections::BTreeSet;

use cleave_api::pool::PoolDevices;

/// One device of the published pool, as the model sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelDevice {
    /// Device name.
    pub name: String,
    /// `type` attribute (`gpu`, `mig`).
    pub kind: String,
    /// Value of the constrained attribute, rendered (`int:1`), when the device has it.
    pub value: Option<String>,
}

/// The devices of `pool` in publish order with their value of `attribute` (a fully
/// qualified name; the driver's own attributes are looked up without its domain).
pub fn devices(pool: &PoolDevices, attribute: &str, driver: &str) -> Vec<ModelDevice> {
    let local = attribute
        .strip_prefix(driver)
        .and_then(|a| a.strip_prefix('/'))
        .unwrap_or(attribute);
    pool.groups
        .iter()
        .flat_map(|g| &g.devices)
        .map(|d| {
            let attrs = d.attributes.as_ref();
            let value = attrs.and_then(|a| a.get(local)).map(|v| {
                match (&v.int, &v.string, &v.bool, &v.version) {
                    (Some(i), ..) => format!("int:{i}"),
                    (_, Some(s), ..) => format!("string:{s}"),
                    (_, _, Some(b), _) => format!("bool:{b}"),
                    (.., Some(v)) => format!("version:{v}"),
                    _ => String::new(),
                }
            });
            let kind = attrs
                .and_then(|a| a.get("type"))
                .and_then(|v| v.string.clone())
                .unwrap_or_default();
            ModelDevice {
                name: d.name.clone(),
                kind,
                value,
            }
        })
        .collect()
}

/// Places `requests` (each the `type` its class selects) on `devices` minus `taken`, all
/// with one value of the constrained attribute; the chosen device names per request, or
/// `None` when the claim does not fit.
pub fn place(
    devices: &[ModelDevice],
    taken: &BTreeSet<String>,
    requests: &[&str],
) -> Option<Vec<String>> {
    let mut chosen: Vec<usize> = Vec::new();
    search(devices, taken, requests, &mut chosen)
        .then(|| chosen.iter().map(|&i| devices[i].name.clone()).collect())
}

fn search(
    devices: &[ModelDevice],
    taken: &BTreeSet<String>,
    requests: &[&str],
    chosen: &mut Vec<usize>,
) -> bool {
    let Some(kind) = requests.get(chosen.len()) else {
        return true;
    };
    let want = chosen.first().and_then(|&i| devices[i].value.clone());
    for (i, d) in devices.iter().enumerate() {
        let fits = d.kind == *kind
            && !taken.contains(&d.name)
            && !chosen.contains(&i)
            && d.value.is_some()
            && (want.is_none() || d.value == want);
        if !fits {
            continue;
        }
        chosen.push(i);
        if search(devices, taken, requests, chosen) {
            return true;
        }
        chosen.pop();
    }
    false
}
