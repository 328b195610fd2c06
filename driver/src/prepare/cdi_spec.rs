//! What the apply step ([`NodeDriver::apply`]) writes for a claim besides its hardware
//! state: its CDI spec (each recorded device's edits plus the sharing edits) and, with
//! `--device-metadata`, a device metadata file and its CDI spec per request. [`cdi_name`]
//! also names the CDI devices prepare records before anything is written.

use cleave_api::merge::base_request;

use super::{NodeDriver, PrepareError, device_need, device_uuid};
use crate::cdi::{self, CdiDevice};
use crate::checkpoint::ClaimRecord;
use crate::driver_root::DeviceNeed;
use crate::model::NodeInventory;
use crate::sharing::SharingEdits;

/// CDI device name (the device part) of a record: the device name, with the share for a
/// share.
pub(super) fn cdi_name(device: &str, share: Option<&crate::checkpoint::ShareRecord>) -> String {
    match share {
        Some(s) => cdi::share_device_name(device, &s.share_id),
        None => device.to_owned(),
    }
}

impl NodeDriver {
    /// Writes the claim's CDI spec from its record and the sharing edits.
    pub(super) fn write_cdi(
        &self,
        uid: &str,
        record: &ClaimRecord,
        edits: &SharingEdits,
    ) -> Result<(), PrepareError> {
        let needs: Vec<DeviceNeed> = record
            .devices
            .iter()
            .map(|r| device_need(r.gpu_minor, r.mig.as_ref()))
            .collect();
        let label = format!("{}/{}", record.namespace, record.name);
        let view = self.files.view_for(&label, &needs)?;
        let devices: Vec<CdiDevice> = record
            .devices
            .iter()
            .map(|r| {
                let mut device_edits = match (&r.mig, r.kind) {
                    (Some(m), _) => cdi::mig_device_edits(
                        &view.files,
                        &r.name,
                        &device_uuid(r),
                        r.gpu_minor,
                        m.gi_id.unwrap_or_default(),
                        m.ci_id.unwrap_or_default(),
                    ),
                    (None, _) => {
                        cdi::gpu_device_edits(&view.files, &r.name, &r.gpu_uuid, r.gpu_minor)
                    }
                };
                if let Some(extra) = edits.device_edits.get(&r.name) {
                    device_edits.extend(extra);
                }
                CdiDevice {
                    device_name: cdi_name(&r.name, r.share.as_ref()),
                    edits: device_edits,
                }
            })
            .collect();
        view.cdi
            .write_claim_spec(uid, &devices, &edits.claim_edits)
            .map_err(|source| PrepareError::Cdi {
                claim: uid.to_owned(),
                source,
            })?;
        Ok(())
    }

    /// Writes a device metadata file and its CDI spec for each request of `record`
    /// ([`crate::metadata`]) and adds each spec's CDI ID to the request's first device.
    /// Each device lists the attributes the pool publishes for it, plus `uuid` (the MIG
    /// device's for a MIG device, created at prepare or not) and, for a MIG device,
    /// `parentUUID`. A request whose write fails is logged and served without metadata.
    pub(super) fn write_metadata(
        &self,
        m: &super::MetadataSettings,
        pod_claim_name: Option<&str>,
        record: &mut ClaimRecord,
        data: &crate::checkpoint::CheckpointData,
        inventory: &NodeInventory,
    ) {
        use cleave_api::names::attr;
        use k8s_openapi::api::resource::v1::DeviceAttribute;
        let owned_instances = data
            .claims
            .values()
            .chain(std::iter::once(&*record))
            .flat_map(|r| &r.devices)
            .filter_map(|d| d.mig.as_ref())
            .filter(|m| m.is_cleaves())
            .filter_map(|m| m.uuid.clone())
            .collect();
        let pool = crate::pool::build_pool(
            inventory,
            &crate::pool::PoolOptions {
                owned_instances,
                ..m.pool.clone()
            },
        );
        let claim = crate::metadata::ClaimRef {
            namespace: record.namespace.clone(),
            name: record.name.clone(),
            uid: record.uid.clone(),
            pod_claim_name: pod_claim_name.map(str::to_owned),
        };
        // Requests in order of first appearance: (name as allocated, device indexes).
        let mut requests: Vec<(String, Vec<usize>)> = Vec::new();
        for (i, d) in record.devices.iter().enumerate() {
            for r in &d.request_names {
                let base = base_request(r);
                match requests.iter_mut().find(|(n, _)| base_request(n) == base) {
                    Some((_, idx)) if !idx.contains(&i) => idx.push(i),
                    Some(_) => {}
                    None => requests.push((r.clone(), vec![i])),
                }
            }
        }
        let string = |v: &str| DeviceAttribute {
            string: Some(v.to_owned()),
            ..Default::default()
        };
        for (name, idx) in requests {
            let devices = idx
                .iter()
                .map(|&i| {
                    let d = &record.devices[i];
                    let mut attrs = pool
                        .devices()
                        .find(|p| p.name == d.name)
                        .and_then(|p| p.attributes.clone())
                        .unwrap_or_default();
                    attrs.insert(attr::UUID.to_owned(), string(&device_uuid(d)));
                    if d.mig.is_some() {
                        attrs.insert(attr::PARENT_UUID.to_owned(), string(&d.gpu_uuid));
                    }
                    crate::metadata::MetadataDevice::new(
                        &self.config.driver_name,
                        &d.pool,
                        &d.name,
                        attrs,
                    )
                })
                .collect();
            let request = crate::metadata::RequestMetadata {
                name: name.clone(),
                devices,
            };
            match m.store.write(&claim, &request) {
                Ok(id) => {
                    let first = &mut record.devices[idx[0]];
                    if !first.cdi_device_ids.contains(&id) {
                        first.cdi_device_ids.push(id);
                    }
                }
                Err(e) => {
                    tracing::warn!(request = %name, error = %e, "device metadata not written; the claim is served without it");
                }
            }
        }
    }
}
