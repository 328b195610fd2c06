//! Existing vs desired slices: semantic comparison, matching and the pool-generation rule.
//!
//! Pure: given what the API server holds (for this driver and node) and the planned
//! [`SliceSpec`]s, [`diff`] says which objects to delete, update and create and which
//! pool generation they carry. Server-set metadata is ignored; quantities compare by
//! value (`1Gi` == `1024Mi`); empty and absent lists/maps are the same.
//!
//! Matching (so a change on one GPU touches one slice): identical content first, then
//! identical device/counter-set name sets, then the largest name overlap, then any
//! leftover pairs (an update is cheaper than a delete plus a create).
//! Generation (as the Go helper, refined): the highest generation seen (or published
//! before) is kept when nothing is deleted, at most one existing slice changes and any
//! created slice only restores content that vanished (same slice count, no device or
//! counter set moving between slices; e.g. someone deleted one slice); otherwise it is
//! bumped and every slice is rewritten with the new one. A pool with no slices left
//! (first publish, kubelet wipe) always gets a new generation.

use std::cell::OnceCell;
use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::{
    Counter, Device, ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::plan::SliceSpec;

/// What the sync must write to turn `existing` into `desired`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SyncPlan {
    /// Pool generation all slices carry after the sync.
    pub generation: i64,
    /// Existing objects to delete (obsolete).
    pub deletes: Vec<ResourceSlice>,
    /// Existing objects with their new spec (metadata, resourceVersion included, kept).
    pub updates: Vec<ResourceSlice>,
    /// Specs of slices to create.
    pub creates: Vec<ResourceSliceSpec>,
}

impl SyncPlan {
    /// Nothing to write.
    pub fn is_empty(&self) -> bool {
        self.deletes.is_empty() && self.updates.is_empty() && self.creates.is_empty()
    }

    /// Number of write requests this plan makes.
    pub fn writes(&self) -> usize {
        self.deletes.len() + self.updates.len() + self.creates.len()
    }
}

/// Identity of the pool the slices belong to.
#[derive(Debug, Clone)]
pub struct PoolTarget<'a> {
    /// Driver name.
    pub driver: &'a str,
    /// Node name (also the pool name).
    pub node: &'a str,
    /// Lowest generation to use (the last one this process published), so that a
    /// republish after a wipe never goes back in generation.
    pub min_generation: i64,
}

/// Canonical value of a Kubernetes quantity string, so that `1Gi`, `1024Mi` and
/// `1073741824` compare equal. `None` when it is not a quantity this parser knows.
pub(crate) fn canonical_quantity(s: &str) -> Option<String> {
    let s = s.trim();
    let (neg, rest) = match s.strip_prefix('-') {
        Some(r) => (true, r),
        None => (false, s.strip_prefix('+').unwrap_or(s)),
    };
    let num_end = rest
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(rest.len());
    let (num, suffix) = rest.split_at(num_end);
    if num.is_empty() || num == "." || num.matches('.').count() > 1 {
        return None;
    }
    let (int_part, frac_part) = num.split_once('.').unwrap_or((num, ""));
    let digits = format!("{int_part}{frac_part}");
    let mut mantissa: i128 = digits.parse().ok()?;
    let mut p10: i64 = -i64::try_from(frac_part.len()).ok()?;
    let mut p2: u32 = 0;
    match suffix {
        "" => {}
        "Ki" => p2 = 10,
        "Mi" => p2 = 20,
        "Gi" => p2 = 30,
        "Ti" => p2 = 40,
        "Pi" => p2 = 50,
        "Ei" => p2 = 60,
        "n" => p10 -= 9,
        "u" => p10 -= 6,
        "m" => p10 -= 3,
        "k" => p10 += 3,
        "M" => p10 += 6,
        "G" => p10 += 9,
        "T" => p10 += 12,
        "P" => p10 += 15,
        "E" => p10 += 18,
        other => {
            let exp = other
                .strip_prefix('e')
                .or_else(|| other.strip_prefix('E'))?;
            p10 += exp.parse::<i64>().ok()?;
        }
    }
    mantissa = mantissa.checked_mul(1i128.checked_shl(p2)?)?;
    if mantissa == 0 {
        return Some("q0".to_owned());
    }
    while mantissa % 10 == 0 {
        mantissa /= 10;
        p10 += 1;
    }
    let sign = if neg { "-" } else { "" };
    Some(format!("q{sign}{mantissa}e{p10}"))
}

fn quantity(q: &mut Quantity) {
    if let Some(c) = canonical_quantity(&q.0) {
        q.0 = c;
    }
}

/// `Some(empty)` -> `None`: the server drops empty lists and maps.
fn drop_empty<T: IsEmpty>(o: &mut Option<T>) {
    if o.as_ref().is_some_and(IsEmpty::is_empty) {
        *o = None;
    }
}

trait IsEmpty {
    fn is_empty(&self) -> bool;
}
impl<T> IsEmpty for Vec<T> {
    fn is_empty(&self) -> bool {
        Vec::is_empty(self)
    }
}
impl<K, V> IsEmpty for BTreeMap<K, V> {
    fn is_empty(&self) -> bool {
        BTreeMap::is_empty(self)
    }
}

fn normalize_counters(counters: &mut BTreeMap<String, Counter>) {
    counters.values_mut().for_each(|c| quantity(&mut c.value));
}

fn normalize_device(d: &mut Device) {
    drop_empty(&mut d.attributes);
    drop_empty(&mut d.capacity);
    for c in d.capacity.iter_mut().flat_map(BTreeMap::values_mut) {
        quantity(&mut c.value);
        if let Some(p) = &mut c.request_policy {
            p.default.iter_mut().for_each(quantity);
            p.valid_values.iter_mut().flatten().for_each(quantity);
            drop_empty(&mut p.valid_values);
            if let Some(r) = &mut p.valid_range {
                quantity(&mut r.min);
                r.max.iter_mut().for_each(quantity);
                r.step.iter_mut().for_each(quantity);
            }
        }
    }
    drop_empty(&mut d.consumes_counters);
    d.consumes_counters
        .iter_mut()
        .flatten()
        .for_each(|c| normalize_counters(&mut c.counters));
    // The server stamps timeAdded on taints that lack it.
    d.taints
        .iter_mut()
        .flatten()
        .for_each(|t| t.time_added = None);
    drop_empty(&mut d.taints);
    drop_empty(&mut d.binding_conditions);
    drop_empty(&mut d.binding_failure_conditions);
}

/// Semantic form of a spec without its pool (the pool is compared on its own): quantities
/// canonical, empty lists and maps absent, taint times ignored. Attribute and capacity
/// maps are keyed by name, so order there never matters; device and counter-set order does.
pub(crate) fn content_key(spec: &ResourceSliceSpec) -> ResourceSliceSpec {
    let mut spec = spec.clone();
    spec.pool = ResourcePool::default();
    drop_empty(&mut spec.devices);
    spec.devices.iter_mut().flatten().for_each(normalize_device);
    drop_empty(&mut spec.shared_counters);
    spec.shared_counters
        .iter_mut()
        .flatten()
        .for_each(|c| normalize_counters(&mut c.counters));
    spec
}

/// Plain equality of everything but the pool (the fast path: what we wrote usually comes
/// back unchanged).
fn same_raw(a: &ResourceSliceSpec, b: &ResourceSliceSpec) -> bool {
    let ResourceSliceSpec {
        all_nodes,
        devices,
        driver,
        node_name,
        node_selector,
        per_device_node_selection,
        pool: _,
        shared_counters,
    } = a;
    *all_nodes == b.all_nodes
        && *devices == b.devices
        && *driver == b.driver
        && *node_name == b.node_name
        && *node_selector == b.node_selector
        && *per_device_node_selection == b.per_device_node_selection
        && *shared_counters == b.shared_counters
}

fn names(spec: &ResourceSliceSpec) -> BTreeSet<String> {
    let devices = spec
        .devices
        .iter()
        .flatten()
        .map(|d| format!("d/{}", d.name));
    let sets = spec
        .shared_counters
        .iter()
        .flatten()
        .map(|c| format!("c/{}", c.name));
    devices.chain(sets).collect()
}

/// Which existing slice each desired one becomes. Normalized forms and name sets are
/// computed lazily: in the steady state nearly every slice is found by plain equality, and
/// only changed ones need normalizing.
struct Matching<'a> {
    desired: &'a [ResourceSliceSpec],
    ours: &'a [&'a ResourceSlice],
    desired_keys: Vec<OnceCell<ResourceSliceSpec>>,
    existing_keys: Vec<OnceCell<ResourceSliceSpec>>,
    desired_names: Vec<OnceCell<BTreeSet<String>>>,
    existing_names: Vec<OnceCell<BTreeSet<String>>>,
}

impl<'a> Matching<'a> {
    fn new(desired: &'a [ResourceSliceSpec], ours: &'a [&'a ResourceSlice]) -> Self {
        let cells = |n: usize| (0..n).map(|_| OnceCell::new()).collect();
        Self {
            desired,
            ours,
            desired_keys: cells(desired.len()),
            existing_keys: cells(ours.len()),
            desired_names: (0..desired.len()).map(|_| OnceCell::new()).collect(),
            existing_names: (0..ours.len()).map(|_| OnceCell::new()).collect(),
        }
    }

    fn desired_names(&self, d: usize) -> &BTreeSet<String> {
        self.desired_names[d].get_or_init(|| names(&self.desired[d]))
    }

    fn existing_names(&self, e: usize) -> &BTreeSet<String> {
        self.existing_names[e].get_or_init(|| names(&self.ours[e].spec))
    }

    fn same_raw(&self, d: usize, e: usize) -> bool {
        same_raw(&self.desired[d], &self.ours[e].spec)
    }

    fn same_content(&self, d: usize, e: usize) -> bool {
        self.same_raw(d, e)
            || self.desired_keys[d].get_or_init(|| content_key(&self.desired[d]))
                == self.existing_keys[e].get_or_init(|| content_key(&self.ours[e].spec))
    }

    /// `pairs[d]`: the index into `ours` desired slice `d` becomes (`None`: created);
    /// `taken[e]`: whether existing slice `e` is kept. Equal slices first, then equal
    /// content, equal names, the largest overlap of names (greedily), then any.
    fn pair(&self) -> (Vec<Option<usize>>, Vec<bool>) {
        let mut pairs: Vec<Option<usize>> = vec![None; self.desired.len()];
        let mut taken = vec![false; self.ours.len()];
        let pair_by = |pairs: &mut Vec<Option<usize>>,
                       taken: &mut Vec<bool>,
                       same: &dyn Fn(usize, usize) -> bool| {
            for (d, slot) in pairs.iter_mut().enumerate() {
                if slot.is_some() {
                    continue;
                }
                if let Some(e) = (0..taken.len()).find(|&e| !taken[e] && same(d, e)) {
                    taken[e] = true;
                    *slot = Some(e);
                }
            }
        };
        pair_by(&mut pairs, &mut taken, &|d, e| self.same_raw(d, e));
        pair_by(&mut pairs, &mut taken, &|d, e| self.same_content(d, e));
        pair_by(&mut pairs, &mut taken, &|d, e| {
            self.desired_names(d) == self.existing_names(e)
        });
        // Largest overlap first, greedily.
        loop {
            let best = pairs
                .iter()
                .enumerate()
                .filter(|(_, p)| p.is_none())
                .flat_map(|(d, _)| (0..taken.len()).filter(|&e| !taken[e]).map(move |e| (d, e)))
                .map(|(d, e)| {
                    let n = self
                        .desired_names(d)
                        .intersection(self.existing_names(e))
                        .count();
                    (n, d, e)
                })
                .filter(|(n, _, _)| *n > 0)
                .max_by_key(|(n, d, e)| (*n, std::cmp::Reverse(*d), std::cmp::Reverse(*e)));
            let Some((_, d, e)) = best else { break };
            pairs[d] = Some(e);
            taken[e] = true;
        }
        pair_by(&mut pairs, &mut taken, &|_, _| true);
        (pairs, taken)
    }
}

/// Computes the writes that turn `existing` (this driver's slices on this node) into
/// `desired` for pool `target.node`.
pub fn diff<'a>(
    existing: impl IntoIterator<Item = &'a ResourceSlice>,
    desired: &[SliceSpec],
    target: &PoolTarget<'_>,
) -> SyncPlan {
    let pool_name = target.node;
    let mut plan = SyncPlan::default();
    // Slices of another pool name (this node used to publish under another name) are
    // obsolete: pool name, driver and node are immutable.
    let mut ours: Vec<&ResourceSlice> = Vec::new();
    for s in existing {
        if s.spec.pool.name == pool_name
            && s.spec.driver == target.driver
            && s.spec.node_name.as_deref() == Some(target.node)
        {
            ours.push(s);
        } else {
            plan.deletes.push(s.clone());
        }
    }
    let base_generation = ours
        .iter()
        .map(|s| s.spec.pool.generation)
        .chain([target.min_generation])
        .max()
        .unwrap_or(0);

    let desired_specs: Vec<ResourceSliceSpec> = desired
        .iter()
        .map(|d| d.to_spec(target.driver, target.node, ResourcePool::default()))
        .collect();
    let m = Matching::new(&desired_specs, &ours);
    let (pairs, taken) = m.pair();
    let dn = |d: usize| m.desired_names(d);
    let en = |e: usize| m.existing_names(e);
    let same_content = |d: usize, e: usize| m.same_content(d, e);

    let count = i64::try_from(desired.len()).unwrap_or(i64::MAX);
    let pool_at = |generation| ResourcePool {
        name: pool_name.to_owned(),
        generation,
        resource_slice_count: count,
    };
    let needs_update = |d: usize, e: usize, generation: i64| {
        ours[e].spec.pool != pool_at(generation) || !same_content(d, e)
    };
    let changed = pairs
        .iter()
        .enumerate()
        .filter(|(d, p)| p.is_some_and(|e| needs_update(*d, e, base_generation)))
        .count();
    let deleting = taken.iter().any(|t| !t) || !plan.deletes.is_empty();
    // Creating slices needs a new generation unless each one only restores content that
    // vanished (someone deleted it): same slice count, and none of its devices or
    // counter sets is published in another slice now (nothing moves between slices).
    let creating: Vec<usize> = (0..pairs.len()).filter(|&d| pairs[d].is_none()).collect();
    let creates_restore_only = creating.is_empty()
        || (ours
            .iter()
            .all(|s| s.spec.pool.resource_slice_count == count)
            && {
                let existing_all: BTreeSet<&String> = (0..ours.len()).flat_map(en).collect();
                creating
                    .iter()
                    .all(|&d| dn(d).iter().all(|n| !existing_all.contains(n)))
            });
    let bump = ours.is_empty() || deleting || changed > 1 || !creates_restore_only;
    plan.generation = if bump {
        base_generation + 1
    } else {
        base_generation
    };

    for (e, t) in taken.iter().enumerate() {
        if !t {
            plan.deletes.push(ours[e].clone());
        }
    }
    for (d, p) in pairs.iter().enumerate() {
        let mut spec = desired_specs[d].clone();
        spec.pool = pool_at(plan.generation);
        match p {
            Some(e) if !needs_update(d, *e, plan.generation) => {}
            Some(e) => {
                let mut obj = ours[*e].clone();
                obj.metadata.managed_fields = None;
                obj.spec = spec;
                plan.updates.push(obj);
            }
            None => plan.creates.push(spec),
        }
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{on_demand_mig_group, on_demand_mig_pool};
    use crate::plan::{SliceLayout, plan_slices};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    const T: PoolTarget<'static> = PoolTarget {
        driver: "gpu.cleave.dev",
        node: "n1",
        min_generation: 0,
    };

    /// Applies a plan like a server would: returns the resulting objects.
    fn apply(existing: &[ResourceSlice], plan: &SyncPlan) -> Vec<ResourceSlice> {
        let gone: BTreeSet<_> = plan
            .deletes
            .iter()
            .map(|s| s.metadata.name.clone())
            .collect();
        let updated: Vec<_> = plan
            .updates
            .iter()
            .map(|s| s.metadata.name.clone())
            .collect();
        let mut out: Vec<ResourceSlice> = existing
            .iter()
            .filter(|s| !gone.contains(&s.metadata.name) && !updated.contains(&s.metadata.name))
            .cloned()
            .collect();
        out.extend(plan.updates.iter().cloned());
        let mut n = existing.len() + 100;
        for spec in &plan.creates {
            n += 1;
            out.push(ResourceSlice {
                metadata: ObjectMeta {
                    name: Some(format!("s{n}")),
                    ..ObjectMeta::default()
                },
                spec: spec.clone(),
            });
        }
        out
    }

    fn publish(
        existing: &[ResourceSlice],
        pool: &cleave_api::pool::PoolDevices,
        layout: SliceLayout,
    ) -> (SyncPlan, Vec<ResourceSlice>) {
        let desired = plan_slices(pool, layout).unwrap();
        let plan = diff(existing, &desired, &T);
        let after = apply(existing, &plan);
        assert!(diff(&after, &desired, &T).is_empty(), "plan converges");
        (plan, after)
    }

    #[test]
    fn quantities_compare_by_value() {
        assert_eq!(canonical_quantity("1Gi"), canonical_quantity("1024Mi"));
        assert_eq!(canonical_quantity("1073741824"), canonical_quantity("1Gi"));
        assert_eq!(canonical_quantity("1k"), canonical_quantity("1000"));
        assert_eq!(canonical_quantity("1e3"), canonical_quantity("1000"));
        assert_eq!(canonical_quantity("500m"), canonical_quantity("0.5"));
        assert_eq!(canonical_quantity("0"), canonical_quantity("0Gi"));
        assert_ne!(canonical_quantity("1Gi"), canonical_quantity("1G"));
        assert_ne!(canonical_quantity("7"), canonical_quantity("-7"));
        assert_eq!(canonical_quantity("abc"), None);
        assert_eq!(canonical_quantity("1.2.3"), None);
    }

    #[test]
    fn first_publish_creates_all_with_generation_one() {
        for layout in [
            SliceLayout::CountersWithDevices,
            SliceLayout::SeparateCounterSlices,
        ] {
            let (plan, after) = publish(&[], &on_demand_mig_pool(8), layout);
            assert_eq!(plan.generation, 1);
            assert!(plan.deletes.is_empty() && plan.updates.is_empty());
            assert_eq!(plan.creates.len(), after.len());
            assert!(
                after
                    .iter()
                    .all(|s| s.spec.pool.resource_slice_count == after.len() as i64)
            );
        }
    }

    #[test]
    fn same_state_needs_no_writes_even_with_canonicalized_quantities_and_server_metadata() {
        let (_, mut after) = publish(
            &[],
            &on_demand_mig_pool(2),
            SliceLayout::CountersWithDevices,
        );
        for s in &mut after {
            s.metadata.resource_version = Some("42".into());
            s.metadata.uid = Some("uid".into());
            for d in s.spec.devices.iter_mut().flatten() {
                for c in d.capacity.iter_mut().flat_map(|m| m.values_mut()) {
                    if c.value.0 == "80Gi" {
                        c.value.0 = "81920Mi".into();
                    }
                }
                if d.taints.is_none() {
                    d.taints = Some(Vec::new());
                }
            }
        }
        let desired =
            plan_slices(&on_demand_mig_pool(2), SliceLayout::CountersWithDevices).unwrap();
        assert!(diff(&after, &desired, &T).is_empty());
    }

    #[test]
    fn one_gpu_changing_touches_one_slice_without_bump() {
        for layout in [
            SliceLayout::CountersWithDevices,
            SliceLayout::SeparateCounterSlices,
        ] {
            let (_, after) = publish(&[], &on_demand_mig_pool(8), layout);
            let mut pool = on_demand_mig_pool(8);
            pool.groups[3] = on_demand_mig_group(3, 7);
            let (plan, _) = publish(&after, &pool, layout);
            assert_eq!(plan.generation, 1, "{layout}");
            assert_eq!(
                (plan.deletes.len(), plan.updates.len(), plan.creates.len()),
                (0, 1, 0),
                "{layout}"
            );
            let names: BTreeSet<_> = plan.updates[0]
                .spec
                .devices
                .iter()
                .flatten()
                .map(|d| d.name.clone())
                .collect();
            assert!(names.contains("gpu-3"));
        }
    }

    #[test]
    fn gpu_disappearing_bumps_generation_once_and_rewrites_the_rest() {
        for layout in [
            SliceLayout::CountersWithDevices,
            SliceLayout::SeparateCounterSlices,
        ] {
            let (_, after) = publish(&[], &on_demand_mig_pool(8), layout);
            let mut pool = on_demand_mig_pool(8);
            pool.groups.remove(5);
            let (plan, after2) = publish(&after, &pool, layout);
            assert_eq!(plan.generation, 2);
            assert_eq!(plan.deletes.len(), 1, "{layout}");
            assert!(plan.creates.is_empty(), "{layout}");
            assert_eq!(
                plan.updates.len(),
                after2.len(),
                "{layout}: every slice carries the new generation"
            );
            assert!(after2.iter().all(|s| s.spec.pool.generation == 2));
        }
    }

    #[test]
    fn two_changed_slices_bump_generation() {
        let (_, after) = publish(
            &[],
            &on_demand_mig_pool(4),
            SliceLayout::CountersWithDevices,
        );
        let mut pool = on_demand_mig_pool(4);
        pool.groups[0] = on_demand_mig_group(0, 1);
        pool.groups[1] = on_demand_mig_group(1, 1);
        let (plan, _) = publish(&after, &pool, SliceLayout::CountersWithDevices);
        assert_eq!(plan.generation, 2);
        assert_eq!(plan.updates.len(), 4);
    }

    #[test]
    fn foreign_pool_and_stale_generation_are_repaired() {
        let (_, mut after) = publish(
            &[],
            &on_demand_mig_pool(3),
            SliceLayout::CountersWithDevices,
        );
        // One slice got an older generation (e.g. a crash mid-way): only it is rewritten.
        after[1].spec.pool.generation = 0;
        let desired =
            plan_slices(&on_demand_mig_pool(3), SliceLayout::CountersWithDevices).unwrap();
        let plan = diff(&after, &desired, &T);
        assert_eq!(
            (plan.generation, plan.updates.len(), plan.writes()),
            (1, 1, 1)
        );
        // A slice of another pool name is deleted, and the pool generation bumped.
        let mut foreign = after[0].clone();
        foreign.spec.pool.name = "old-name".into();
        after[1].spec.pool.generation = 1;
        after.push(foreign);
        let plan = diff(&after, &desired, &T);
        assert_eq!(plan.deletes.len(), 1);
        assert_eq!(plan.generation, 2);
    }

    #[test]
    fn restoring_a_deleted_slice_keeps_the_generation_and_touches_nothing_else() {
        let (_, mut after) = publish(
            &[],
            &on_demand_mig_pool(8),
            SliceLayout::CountersWithDevices,
        );
        after.remove(2);
        let (plan, _) = publish(
            &after,
            &on_demand_mig_pool(8),
            SliceLayout::CountersWithDevices,
        );
        assert_eq!(
            (plan.generation, plan.writes(), plan.creates.len()),
            (1, 1, 1)
        );
    }

    #[test]
    fn a_new_gpu_bumps_the_generation() {
        let (_, after) = publish(
            &[],
            &on_demand_mig_pool(2),
            SliceLayout::CountersWithDevices,
        );
        let (plan, _) = publish(
            &after,
            &on_demand_mig_pool(3),
            SliceLayout::CountersWithDevices,
        );
        assert_eq!(
            (plan.generation, plan.creates.len(), plan.updates.len()),
            (2, 1, 2)
        );
    }

    #[test]
    fn generation_never_goes_back_after_a_wipe() {
        let desired =
            plan_slices(&on_demand_mig_pool(1), SliceLayout::CountersWithDevices).unwrap();
        let t = PoolTarget {
            min_generation: 9,
            ..T
        };
        assert_eq!(diff(&[], &desired, &t).generation, 10);
    }
}
