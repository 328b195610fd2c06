//! A model of the kube-scheduler's DRA allocator (`k8s.io/dynamic-resource-allocation/structured`,
//! v0.36.2, the "incubating" variant with the gates on by default in 1.36), written from the
//! resource.k8s.io/v1 API documentation and the scheduler facts sheet, not from cleave's code.
//!
//! Input is what the scheduler reads: ResourceSlices, DeviceClasses and ResourceClaims as API
//! objects (k8s-openapi types, normally read back from JSON). It evaluates class and request
//! selectors with CEL ([`crate::cel_env`]) and allocates one claim at a time against what
//! earlier claims hold:
//!
//! - devices are tried first-fit: slices in name order, devices in slice order; within a claim
//!   the search is depth-first and backtracks over devices and `firstAvailable` subrequests
//!   (a later request or a constraint that cannot be met makes an earlier choice move on);
//! - `allocationMode: All` takes every selected device and fails when one is not free or none
//!   exists (API doc: "at least one device must exist"); `ExactCount` defaults to `count: 1`;
//! - `matchAttribute` constraints, admin access included (a device without the attribute never
//!   matches); `distinctAttribute` is refused as input the model does not know;
//! - `adminAccess`: any selected device, free or not, consuming nothing;
//! - consumable capacity: every allocation of a device with `allowMultipleAllocations` is a
//!   share (a `shareID` and `consumedCapacity`): each capacity asked is rounded up to its
//!   policy's step from `min` (or to the next `validValues` entry), refused above `max` or
//!   when not published; a capacity not asked consumes the policy's `default` (or the whole
//!   capacity); a non-shareable device must hold what is asked;
//! - shared counters (partitionable devices): an exclusive device takes its counters, a
//!   shareable one on its first share only; a device whose counters are not free is not free;
//! - the v0.36.2 defect of the facts sheet, on by default ([`Options::counter_leak`]): when the
//!   search backtracks over a shareable device it does not give back that device's counters
//!   (for the rest of this claim's search);
//! - device taints with effect `NoSchedule`/`NoExecute` keep a device out unless tolerated;
//! - class configs are attached as `FromClass` (per request, before the claim's own configs,
//!   which are `FromClaim`).
//!
//! A pool is used only when complete (all `resourceSliceCount` slices of its newest generation).
//! CEL errors on a device fail the claim, as upstream does. Node selection is not modelled:
//! every slice given is taken to be on the node.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use cel::{Env, Value};
use k8s_openapi::api::resource::v1::{
    AllocationResult, Device, DeviceAllocationConfiguration, DeviceAllocationResult, DeviceClass,
    DeviceConstraint, DeviceRequestAllocationResult, DeviceSelector, DeviceToleration,
    ResourceClaim, ResourceSlice,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::cel_env::{self, CelError, Programs, Qty};

/// Why the model cannot allocate a claim, or cannot read its input.
#[derive(Debug, thiserror::Error)]
pub enum AllocError {
    /// The claim does not fit (the reason says where the search ended).
    #[error("unallocatable: {0}")]
    Unallocatable(String),
    /// A CEL expression failed (upstream fails the claim too).
    #[error(transparent)]
    Cel(#[from] CelError),
    /// Input the API server would not have accepted (unknown class, bad request).
    #[error("invalid input: {0}")]
    Invalid(String),
}

/// Switches for upstream behaviour that differs between versions.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// v0.36.2: backtracking over a shareable device does not release its counters.
    pub counter_leak: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options { counter_leak: true }
    }
}

type DevId = usize;
/// (pool, counter set, counter).
type CounterKey = (String, String, String);

/// A device as the allocator sees it.
struct Dev {
    driver: String,
    pool: String,
    device: Device,
    shareable: bool,
    /// The CEL `device` variable.
    cel: Value,
    /// Counters consumed, by key.
    counters: Vec<(CounterKey, Qty)>,
}

/// What claims hold on the node.
#[derive(Debug, Clone, Default)]
struct Held {
    exclusive: BTreeSet<DevId>,
    /// Shares: how many, and what they consumed together, by capacity name.
    shares: BTreeMap<DevId, (u32, BTreeMap<String, Qty>)>,
    counters: BTreeMap<CounterKey, Qty>,
}

/// A request (or a `firstAvailable` subrequest) flattened for the search.
#[derive(Debug, Clone)]
struct Req {
    /// The result's request name (`parent/sub` for a subrequest).
    name: String,
    /// The request's name in the claim (for constraints).
    parent: String,
    class: String,
    selectors: Vec<String>,
    /// `None`: `allocationMode: All`.
    count: Option<u32>,
    capacity: BTreeMap<String, Qty>,
    admin: bool,
    tolerations: Vec<DeviceToleration>,
}

/// One result so far: request name, device, what a share consumed, admin access.
type Picked = (String, DevId, Option<BTreeMap<String, Qty>>, bool);

/// One search state: what is held (tentatively), constraint values, results so far.
#[derive(Clone)]
struct State {
    held: Held,
    constraint_values: Vec<Option<Value>>,
    results: Vec<Picked>,
}

/// The allocator over one node's slices.
pub struct Allocator {
    env: Arc<Env>,
    programs: Programs,
    devices: Vec<Dev>,
    counter_totals: BTreeMap<CounterKey, Qty>,
    classes: BTreeMap<String, DeviceClass>,
    held: Held,
    options: Options,
    shares: u64,
    /// Counters leaked by backtracking in the current claim's search.
    leaked: BTreeMap<CounterKey, Qty>,
    /// Why the deepest failure of the current search failed.
    last_failure: String,
}

fn qty(q: &Quantity) -> Result<Qty, AllocError> {
    Ok(Qty::parse(&q.0)?)
}

/// An attribute's name and domain: `domain/name`, or the driver's domain when unqualified.
fn qualify<'a>(driver: &'a str, key: &'a str) -> (&'a str, &'a str) {
    key.split_once('/').unwrap_or((driver, key))
}

fn device_cel(driver: &str, d: &Device, domains: &BTreeSet<String>) -> Result<Value, AllocError> {
    let mut attrs: BTreeMap<String, Vec<(String, Value)>> = domains
        .iter()
        .map(|dom| (dom.clone(), Vec::new()))
        .collect();
    for (k, a) in d.attributes.iter().flatten() {
        let (dom, name) = qualify(driver, k);
        let v = if let Some(s) = &a.string {
            Value::String(Arc::new(s.clone()))
        } else if let Some(i) = a.int {
            Value::Int(i)
        } else if let Some(b) = a.bool {
            Value::Bool(b)
        } else if let Some(v) = &a.version {
            // Upstream: a semver value; compared here as its string.
            Value::String(Arc::new(v.clone()))
        } else {
            continue;
        };
        attrs
            .entry(dom.to_owned())
            .or_default()
            .push((name.to_owned(), v));
    }
    let mut caps: BTreeMap<String, Vec<(String, Value)>> = domains
        .iter()
        .map(|dom| (dom.clone(), Vec::new()))
        .collect();
    for (k, c) in d.capacity.iter().flatten() {
        let (dom, name) = qualify(driver, k);
        caps.entry(dom.to_owned())
            .or_default()
            .push((name.to_owned(), cel_env::qty_value(qty(&c.value)?)));
    }
    let nest = |m: BTreeMap<String, Vec<(String, Value)>>| {
        cel_env::map(m.into_iter().map(|(k, v)| (k, cel_env::map(v))))
    };
    Ok(cel_env::map([
        (
            "driver".to_owned(),
            Value::String(Arc::new(driver.to_owned())),
        ),
        ("attributes".to_owned(), nest(attrs)),
        ("capacity".to_owned(), nest(caps)),
        (
            "allowMultipleAllocations".to_owned(),
            Value::Bool(d.allow_multiple_allocations == Some(true)),
        ),
    ]))
}

/// An attribute of `d` for `matchAttribute` (a fully qualified name).
fn attribute(dev: &Dev, qualified: &str) -> Option<Value> {
    for (k, a) in dev.device.attributes.iter().flatten() {
        let (dom, name) = qualify(&dev.driver, k);
        if format!("{dom}/{name}") == qualified {
            return Some(if let Some(s) = &a.string {
                Value::String(Arc::new(s.clone()))
            } else if let Some(i) = a.int {
                Value::Int(i)
            } else if let Some(b) = a.bool {
                Value::Bool(b)
            } else {
                Value::String(Arc::new(a.version.clone()?))
            });
        }
    }
    None
}

fn tolerated(d: &Device, tolerations: &[DeviceToleration]) -> bool {
    d.taints.iter().flatten().all(|t| {
        !(t.effect == "NoSchedule" || t.effect == "NoExecute")
            || tolerations.iter().any(|tol| {
                let key = tol.key.as_deref().is_none_or(|k| k == t.key);
                let effect = tol.effect.as_deref().is_none_or(|e| e == t.effect);
                let value = match tol.operator.as_deref() {
                    Some("Exists") => true,
                    _ => tol.value.as_deref() == t.value.as_deref(),
                };
                key && effect && value
            })
    })
}

impl Allocator {
    /// The allocator over `slices` (one node's, any order) with the cluster's `classes`.
    pub fn new(
        slices: &[ResourceSlice],
        classes: &[DeviceClass],
        options: Options,
    ) -> Result<Self, AllocError> {
        let mut sorted: Vec<&ResourceSlice> = slices.iter().collect();
        sorted.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        // Complete pools only, at their newest generation.
        let mut newest: BTreeMap<(String, String), i64> = BTreeMap::new();
        for s in &sorted {
            let k = (s.spec.driver.clone(), s.spec.pool.name.clone());
            let g = newest.entry(k).or_insert(s.spec.pool.generation);
            *g = (*g).max(s.spec.pool.generation);
        }
        let current = |s: &&ResourceSlice| {
            newest[&(s.spec.driver.clone(), s.spec.pool.name.clone())] == s.spec.pool.generation
        };
        let mut count: BTreeMap<(String, String), i64> = BTreeMap::new();
        for s in sorted.iter().filter(|s| current(s)) {
            *count
                .entry((s.spec.driver.clone(), s.spec.pool.name.clone()))
                .or_default() += 1;
        }
        let complete = |s: &&ResourceSlice| {
            count[&(s.spec.driver.clone(), s.spec.pool.name.clone())]
                == s.spec.pool.resource_slice_count
        };
        let used: Vec<&ResourceSlice> = sorted
            .into_iter()
            .filter(|s| current(s) && complete(s))
            .collect();
        let mut domains = BTreeSet::new();
        for s in &used {
            domains.insert(s.spec.driver.clone());
            for d in s.spec.devices.iter().flatten() {
                for k in d.attributes.iter().flat_map(|m| m.keys()) {
                    domains.insert(qualify(&s.spec.driver, k).0.to_owned());
                }
            }
        }
        let mut counter_totals = BTreeMap::new();
        let mut devices = Vec::new();
        for s in &used {
            let pool = s.spec.pool.name.clone();
            for cs in s.spec.shared_counters.iter().flatten() {
                for (name, c) in &cs.counters {
                    counter_totals.insert(
                        (pool.clone(), cs.name.clone(), name.clone()),
                        qty(&c.value)?,
                    );
                }
            }
            for d in s.spec.devices.iter().flatten() {
                let mut counters = Vec::new();
                for c in d.consumes_counters.iter().flatten() {
                    for (name, v) in &c.counters {
                        counters.push((
                            (pool.clone(), c.counter_set.clone(), name.clone()),
                            qty(&v.value)?,
                        ));
                    }
                }
                devices.push(Dev {
                    driver: s.spec.driver.clone(),
                    pool: pool.clone(),
                    shareable: d.allow_multiple_allocations == Some(true),
                    cel: device_cel(&s.spec.driver, d, &domains)?,
                    device: d.clone(),
                    counters,
                });
            }
        }
        Ok(Allocator {
            env: cel_env::env(),
            programs: Programs::default(),
            devices,
            counter_totals,
            classes: classes
                .iter()
                .map(|c| (c.metadata.name.clone().unwrap_or_default(), c.clone()))
                .collect(),
            held: Held::default(),
            options,
            shares: 0,
            leaked: BTreeMap::new(),
            last_failure: String::new(),
        })
    }

    /// Device names in the order the allocator tries them.
    pub fn device_order(&self) -> Vec<String> {
        self.devices.iter().map(|d| d.device.name.clone()).collect()
    }

    fn flatten(&self, claim: &ResourceClaim) -> Result<Vec<Vec<Req>>, AllocError> {
        let mut out = Vec::new();
        for r in claim
            .spec
            .devices
            .iter()
            .flat_map(|d| d.requests.iter().flatten())
        {
            let mut alts = Vec::new();
            let one = |name: String,
                       class: &str,
                       selectors: &Option<Vec<DeviceSelector>>,
                       mode: &Option<String>,
                       count: Option<i64>,
                       capacity: Option<&BTreeMap<String, Quantity>>,
                       admin: bool,
                       tolerations: &Option<Vec<DeviceToleration>>|
             -> Result<Req, AllocError> {
                let selectors = selectors
                    .iter()
                    .flatten()
                    .map(|s| {
                        s.cel.as_ref().map(|c| c.expression.clone()).ok_or_else(|| {
                            AllocError::Invalid(format!("{name}: a selector without cel"))
                        })
                    })
                    .collect::<Result<_, _>>()?;
                let count = match mode.as_deref() {
                    Some("All") => None,
                    None | Some("ExactCount") => Some(
                        u32::try_from(count.unwrap_or(1))
                            .map_err(|_| AllocError::Invalid(format!("{name}: count")))?,
                    ),
                    Some(m) => {
                        return Err(AllocError::Invalid(format!("{name}: allocationMode {m}")));
                    }
                };
                Ok(Req {
                    parent: name.split('/').next().unwrap_or_default().to_owned(),
                    name,
                    class: class.to_owned(),
                    selectors,
                    count,
                    capacity: capacity
                        .into_iter()
                        .flatten()
                        .map(|(k, v)| Ok((k.clone(), qty(v)?)))
                        .collect::<Result<_, AllocError>>()?,
                    admin,
                    tolerations: tolerations.clone().unwrap_or_default(),
                })
            };
            if let Some(e) = &r.exactly {
                alts.push(one(
                    r.name.clone(),
                    &e.device_class_name,
                    &e.selectors,
                    &e.allocation_mode,
                    e.count,
                    e.capacity.as_ref().and_then(|c| c.requests.as_ref()),
                    e.admin_access == Some(true),
                    &e.tolerations,
                )?);
            } else if let Some(subs) = &r.first_available {
                for s in subs {
                    alts.push(one(
                        format!("{}/{}", r.name, s.name),
                        &s.device_class_name,
                        &s.selectors,
                        &s.allocation_mode,
                        s.count,
                        s.capacity.as_ref().and_then(|c| c.requests.as_ref()),
                        false,
                        &s.tolerations,
                    )?);
                }
            } else {
                return Err(AllocError::Invalid(format!(
                    "request {}: neither exactly nor firstAvailable",
                    r.name
                )));
            }
            out.push(alts);
        }
        Ok(out)
    }

    /// Whether the class and request selectors select `dev` (class first, as upstream).
    fn selects(&mut self, req: &Req, dev: DevId) -> Result<bool, AllocError> {
        let class = self.classes.get(&req.class).ok_or_else(|| {
            AllocError::Invalid(format!("DeviceClass {} does not exist", req.class))
        })?;
        let mut exprs: Vec<String> = class
            .spec
            .selectors
            .iter()
            .flatten()
            .filter_map(|s| s.cel.as_ref().map(|c| c.expression.clone()))
            .collect();
        exprs.extend(req.selectors.iter().cloned());
        if !tolerated(&self.devices[dev].device, &req.tolerations) {
            return Ok(false);
        }
        let mut ctx = cel_env::context(&self.env);
        ctx.add_variable_from_value("device", self.devices[dev].cel.clone());
        for e in exprs {
            let p = self.programs.get(&self.env, &e)?;
            if !cel_env::eval_bool(&p, &ctx, &e).map_err(|err| {
                AllocError::Unallocatable(format!(
                    "CEL runtime error on device {}: {err}",
                    self.devices[dev].device.name
                ))
            })? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    fn counters_free(&self, held: &Held, dev: DevId) -> bool {
        self.devices[dev].counters.iter().all(|(k, v)| {
            let Some(total) = self.counter_totals.get(k) else {
                return false;
            };
            let used = held.counters.get(k).copied().unwrap_or_default().0
                + self.leaked.get(k).copied().unwrap_or_default().0;
            used + v.0 <= total.0
        })
    }

    /// What a share of `dev` consumes for `asked`, or why it cannot be had.
    fn consumption(
        &self,
        dev: DevId,
        asked: &BTreeMap<String, Qty>,
    ) -> Result<BTreeMap<String, Qty>, String> {
        let d = &self.devices[dev].device;
        let caps = d.capacity.clone().unwrap_or_default();
        for name in asked.keys() {
            if !caps.contains_key(name) {
                return Err(format!("{} publishes no capacity {name}", d.name));
            }
        }
        let mut out = BTreeMap::new();
        for (name, c) in &caps {
            let value = qty(&c.value).map_err(|e| e.to_string())?;
            let policy = c.request_policy.as_ref();
            let consumed = match asked.get(name) {
                None => match policy.and_then(|p| p.default.as_ref()) {
                    Some(q) => qty(q).map_err(|e| e.to_string())?,
                    None => value,
                },
                Some(&want) => match policy {
                    None => want,
                    Some(p) => {
                        if let Some(r) = &p.valid_range {
                            let min = qty(&r.min).map_err(|e| e.to_string())?;
                            let mut got = if want < min { min } else { want };
                            if let Some(step) = &r.step {
                                let step = qty(step).map_err(|e| e.to_string())?;
                                if step.0 > 0 {
                                    let over = got.0 - min.0;
                                    got = Qty(min.0 + (over + step.0 - 1) / step.0 * step.0);
                                }
                            }
                            if let Some(max) = &r.max
                                && got > qty(max).map_err(|e| e.to_string())?
                            {
                                return Err(format!(
                                    "{} {name}: {} above the policy's max",
                                    d.name,
                                    got.to_k8s()
                                ));
                            }
                            got
                        } else if let Some(values) = &p.valid_values {
                            let mut vs: Vec<Qty> = values
                                .iter()
                                .map(|v| qty(v).map_err(|e| e.to_string()))
                                .collect::<Result<_, _>>()?;
                            vs.sort();
                            *vs.iter().find(|v| **v >= want).ok_or_else(|| {
                                format!(
                                    "{} {name}: {} above every valid value",
                                    d.name,
                                    want.to_k8s()
                                )
                            })?
                        } else {
                            want
                        }
                    }
                },
            };
            if consumed > value {
                return Err(format!(
                    "{} {name}: {} above the device's {}",
                    d.name,
                    consumed.to_k8s(),
                    value.to_k8s()
                ));
            }
            out.insert(name.clone(), consumed);
        }
        Ok(out)
    }

    /// Tries to take `dev` for `req` in `st`; the reason when it cannot.
    fn take(&mut self, st: &mut State, req: &Req, dev: DevId) -> Result<(), String> {
        let name = self.devices[dev].device.name.clone();
        if req.admin {
            st.results.push((req.name.clone(), dev, None, true));
            return Ok(());
        }
        if st.held.exclusive.contains(&dev) {
            return Err(format!("{name} is allocated"));
        }
        if !self.devices[dev].shareable {
            if st.held.shares.contains_key(&dev) {
                return Err(format!("{name} is shared"));
            }
            let caps = self.devices[dev]
                .device
                .capacity
                .clone()
                .unwrap_or_default();
            for (c, want) in &req.capacity {
                let have = caps
                    .get(c)
                    .map(|v| qty(&v.value))
                    .transpose()
                    .map_err(|e| e.to_string())?;
                if have.is_none_or(|h| h < *want) {
                    return Err(format!("{name} has less {c} than asked"));
                }
            }
            if !self.counters_free(&st.held, dev) {
                return Err(format!("{name}: its counters are in use"));
            }
            for (k, v) in &self.devices[dev].counters {
                st.held.counters.entry(k.clone()).or_default().0 += v.0;
            }
            st.held.exclusive.insert(dev);
            st.results.push((req.name.clone(), dev, None, false));
            return Ok(());
        }
        let consumed = self.consumption(dev, &req.capacity)?;
        let (n, so_far) = st.held.shares.get(&dev).cloned().unwrap_or_default();
        let caps = self.devices[dev]
            .device
            .capacity
            .clone()
            .unwrap_or_default();
        for (c, v) in &consumed {
            let total = qty(&caps[c].value).map_err(|e| e.to_string())?;
            if so_far.get(c).copied().unwrap_or_default().0 + v.0 > total.0 {
                return Err(format!("{name}: not enough {c} left"));
            }
        }
        if n == 0 {
            if !self.counters_free(&st.held, dev) {
                return Err(format!("{name}: its counters are in use"));
            }
            for (k, v) in &self.devices[dev].counters {
                st.held.counters.entry(k.clone()).or_default().0 += v.0;
            }
        }
        let mut sum = so_far;
        for (c, v) in &consumed {
            sum.entry(c.clone()).or_default().0 += v.0;
        }
        st.held.shares.insert(dev, (n + 1, sum));
        st.results
            .push((req.name.clone(), dev, Some(consumed), false));
        Ok(())
    }

    /// Applies the claim's constraints to `dev` taken for `req`.
    fn constrain(
        &self,
        st: &mut State,
        constraints: &[DeviceConstraint],
        req: &Req,
        dev: DevId,
    ) -> Result<(), String> {
        for (i, c) in constraints.iter().enumerate() {
            let applies = c.requests.as_ref().is_none_or(|rs| {
                rs.is_empty() || rs.iter().any(|r| *r == req.parent || *r == req.name)
            });
            if !applies {
                continue;
            }
            let Some(attr) = &c.match_attribute else {
                continue;
            };
            let Some(v) = attribute(&self.devices[dev], attr) else {
                return Err(format!(
                    "{} has no attribute {attr}",
                    self.devices[dev].device.name
                ));
            };
            match &st.constraint_values[i] {
                Some(have) if *have != v => {
                    return Err(format!(
                        "{}: {attr} differs from the other requests' device",
                        self.devices[dev].device.name
                    ));
                }
                Some(_) => {}
                None => st.constraint_values[i] = Some(v),
            }
        }
        Ok(())
    }

    /// Depth-first search over requests `reqs[i..]` (chosen alternative `alts`), device `k`
    /// of request `i`.
    fn search(
        &mut self,
        reqs: &[Vec<Req>],
        constraints: &[DeviceConstraint],
        i: usize,
        chosen: Option<&Req>,
        k: u32,
        st: State,
    ) -> Result<Option<State>, AllocError> {
        if i == reqs.len() {
            return Ok(Some(st));
        }
        let Some(req) = chosen else {
            // Pick an alternative (firstAvailable), in order, backtracking over them.
            for alt in &reqs[i] {
                if let Some(done) = self.search(reqs, constraints, i, Some(alt), 0, st.clone())? {
                    return Ok(Some(done));
                }
            }
            return Ok(None);
        };
        match req.count {
            None => {
                // All: every selected device, each must be free.
                let mut selected = Vec::new();
                for dev in 0..self.devices.len() {
                    if self.selects(req, dev)? {
                        selected.push(dev);
                    }
                }
                if selected.is_empty() {
                    self.last_failure = format!(
                        "request {}: allocationMode All, but no device is selected",
                        req.name
                    );
                    return Ok(None);
                }
                let mut st = st;
                for dev in selected {
                    if let Err(why) = self
                        .take(&mut st, req, dev)
                        .and_then(|()| self.constrain(&mut st, constraints, req, dev))
                    {
                        self.last_failure =
                            format!("request {} (allocationMode All): {why}", req.name);
                        return Ok(None);
                    }
                }
                self.search(reqs, constraints, i + 1, None, 0, st)
            }
            Some(count) if k == count => self.search(reqs, constraints, i + 1, None, 0, st),
            Some(_) => {
                let mut any_selected = false;
                for dev in 0..self.devices.len() {
                    if !self.selects(req, dev)? {
                        continue;
                    }
                    any_selected = true;
                    // One device serves one result of a request unless it is shared.
                    let mut next = st.clone();
                    if let Err(why) = self
                        .take(&mut next, req, dev)
                        .and_then(|()| self.constrain(&mut next, constraints, req, dev))
                    {
                        self.last_failure =
                            format!("request {}: no device fits (last tried: {why})", req.name);
                        continue;
                    }
                    if let Some(done) = self.search(reqs, constraints, i, Some(req), k + 1, next)? {
                        return Ok(Some(done));
                    }
                    // Backtrack; v0.36.2 keeps a shareable device's counters taken.
                    let d = &self.devices[dev];
                    if self.options.counter_leak
                        && d.shareable
                        && !req.admin
                        && st.held.shares.get(&dev).is_none_or(|(n, _)| *n == 0)
                    {
                        for (key, v) in &d.counters {
                            self.leaked.entry(key.clone()).or_default().0 += v.0;
                        }
                    }
                }
                if !any_selected {
                    self.last_failure = format!(
                        "request {}: class {} and the selectors select no device",
                        req.name, req.class
                    );
                }
                Ok(None)
            }
        }
    }

    /// Allocates `claim` (spec only is read) and records what it holds; the allocation the
    /// scheduler would write into its status.
    pub fn allocate(&mut self, claim: &ResourceClaim) -> Result<AllocationResult, AllocError> {
        let reqs = self.flatten(claim)?;
        let constraints: Vec<DeviceConstraint> = claim
            .spec
            .devices
            .as_ref()
            .and_then(|d| d.constraints.clone())
            .unwrap_or_default();
        for c in &constraints {
            if c.match_attribute.is_none() {
                return Err(AllocError::Invalid(
                    "a constraint other than matchAttribute".into(),
                ));
            }
        }
        self.leaked.clear();
        self.last_failure.clear();
        let start = State {
            held: self.held.clone(),
            constraint_values: vec![None; constraints.len()],
            results: Vec::new(),
        };
        let found = self.search(&reqs, &constraints, 0, None, 0, start);
        self.leaked.clear();
        let Some(done) = found? else {
            return Err(AllocError::Unallocatable(if self.last_failure.is_empty() {
                "no device fits".into()
            } else {
                self.last_failure.clone()
            }));
        };
        self.held = done.held;
        let mut results = Vec::new();
        for (request, dev, consumed, admin) in done.results {
            let d = &self.devices[dev];
            let share = consumed.map(|c| {
                self.shares += 1;
                (
                    format!("{:08x}-0000-4000-8000-{:012x}", self.shares, self.shares),
                    c.into_iter()
                        .map(|(k, v)| (k, Quantity(v.to_k8s())))
                        .collect(),
                )
            });
            results.push(DeviceRequestAllocationResult {
                request,
                driver: d.driver.clone(),
                pool: d.pool.clone(),
                device: d.device.name.clone(),
                admin_access: admin.then_some(true),
                share_id: share.as_ref().map(|s| s.0.clone()),
                consumed_capacity: share.map(|s| s.1),
                ..Default::default()
            });
        }
        let mut config = Vec::new();
        let mut seen = BTreeSet::new();
        for r in &results {
            if !seen.insert(r.request.clone()) {
                continue;
            }
            let class = reqs
                .iter()
                .flatten()
                .find(|q| q.name == r.request)
                .map(|q| q.class.clone())
                .unwrap_or_default();
            for c in self.classes[&class].spec.config.iter().flatten() {
                config.push(DeviceAllocationConfiguration {
                    source: "FromClass".into(),
                    requests: Some(vec![r.request.clone()]),
                    opaque: c.opaque.clone(),
                });
            }
        }
        for c in claim
            .spec
            .devices
            .iter()
            .flat_map(|d| d.config.iter().flatten())
        {
            config.push(DeviceAllocationConfiguration {
                source: "FromClaim".into(),
                requests: c.requests.clone(),
                opaque: c.opaque.clone(),
            });
        }
        Ok(AllocationResult {
            devices: Some(DeviceAllocationResult {
                results: Some(results),
                config: Some(config),
            }),
            ..Default::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const DRIVER: &str = "gpu.cleave.dev";

    fn slice(name: &str, devices: serde_json::Value, counters: serde_json::Value) -> ResourceSlice {
        serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {"driver": DRIVER, "nodeName": "n", "pool": {"name": "n", "generation": 1, "resourceSliceCount": 1},
                     "devices": devices, "sharedCounters": counters}
        }))
        .unwrap()
    }

    fn gpu(name: &str, numa: i64, shareable: bool) -> serde_json::Value {
        let mut d = json!({"name": name, "attributes": {"type": {"string": "gpu"}, "uuid": {"string": name},
                    "resource.kubernetes.io/numaNode": {"int": numa}},
                   "capacity": {"memory": {"value": "80Gi"}}});
        if shareable {
            d["allowMultipleAllocations"] = json!(true);
            d["capacity"]["memory"]["requestPolicy"] = json!({"default": "80Gi", "validRange": {"min": "1Mi", "max": "80Gi", "step": "1Mi"}});
        }
        d
    }

    fn class() -> DeviceClass {
        serde_json::from_value(json!({"metadata": {"name": "gpu"}, "spec": {"selectors": [{"cel": {"expression":
            "device.driver == \"gpu.cleave.dev\" && device.attributes[\"gpu.cleave.dev\"].type == \"gpu\""}}]}}))
        .unwrap()
    }

    fn claim(spec: serde_json::Value) -> ResourceClaim {
        serde_json::from_value(json!({"metadata": {"name": "c"}, "spec": {"devices": spec}}))
            .unwrap()
    }

    fn devices(a: &AllocationResult) -> Vec<String> {
        a.devices
            .as_ref()
            .unwrap()
            .results
            .as_ref()
            .unwrap()
            .iter()
            .map(|r| r.device.clone())
            .collect()
    }

    fn one(class: &str) -> serde_json::Value {
        json!({"requests": [{"name": "r", "exactly": {"deviceClassName": class}}]})
    }

    #[test]
    fn first_fit_in_slice_name_order_then_device_order() {
        let slices = [
            slice("b", json!([gpu("g2", 0, false)]), json!(null)),
            slice(
                "a",
                json!([gpu("g1", 0, false), gpu("g0", 0, false)]),
                json!(null),
            ),
        ];
        let mut a = Allocator::new(&slices, &[class()], Options::default()).unwrap();
        // Only the slice count of 1 per pool: both are generation 1, so the pool is incomplete.
        assert!(matches!(
            a.allocate(&claim(one("gpu"))),
            Err(AllocError::Unallocatable(_))
        ));
        let mut slices = slices;
        for s in &mut slices {
            s.spec.pool.resource_slice_count = 2;
        }
        let mut a = Allocator::new(&slices, &[class()], Options::default()).unwrap();
        assert_eq!(a.device_order(), ["g1", "g0", "g2"]);
        assert_eq!(devices(&a.allocate(&claim(one("gpu"))).unwrap()), ["g1"]);
        assert_eq!(devices(&a.allocate(&claim(one("gpu"))).unwrap()), ["g0"]);
        assert_eq!(devices(&a.allocate(&claim(one("gpu"))).unwrap()), ["g2"]);
        let e = a.allocate(&claim(one("gpu"))).unwrap_err();
        assert!(e.to_string().contains("is allocated"), "{e}");
    }

    #[test]
    fn match_attribute_backtracks_over_the_first_choice() {
        let slices = [slice(
            "a",
            json!([
                gpu("g0", 0, false),
                gpu("g1", 1, false),
                gpu("g2", 1, false)
            ]),
            json!(null),
        )];
        let mut a = Allocator::new(&slices, &[class()], Options::default()).unwrap();
        let spec = json!({"requests": [{"name": "a", "exactly": {"deviceClassName": "gpu"}},
                                       {"name": "b", "exactly": {"deviceClassName": "gpu"}}],
                          "constraints": [{"matchAttribute": "resource.kubernetes.io/numaNode"}]});
        assert_eq!(
            devices(&a.allocate(&claim(spec.clone())).unwrap()),
            ["g1", "g2"]
        );
        // g0 is alone on its NUMA node.
        assert!(a.allocate(&claim(spec)).is_err());
    }

    #[test]
    fn request_selectors_with_quantities_and_first_available() {
        let slices = [slice("a", json!([gpu("g0", 0, false)]), json!(null))];
        let mut a = Allocator::new(&slices, &[class()], Options::default()).unwrap();
        let big = json!({"requests": [{"name": "r", "exactly": {"deviceClassName": "gpu", "selectors": [{"cel": {"expression":
            "device.capacity[\"gpu.cleave.dev\"].memory.compareTo(quantity(\"100G\")) >= 0"}}]}}]});
        let e = a.allocate(&claim(big)).unwrap_err();
        assert!(e.to_string().contains("select no device"), "{e}");
        let fa = json!({"requests": [{"name": "r", "firstAvailable": [
            {"name": "big", "deviceClassName": "gpu", "selectors": [{"cel": {"expression": "device.capacity[\"gpu.cleave.dev\"].memory.isGreaterThan(quantity(\"100G\"))"}}]},
            {"name": "small", "deviceClassName": "gpu"}]}]});
        let got = a.allocate(&claim(fa)).unwrap();
        assert_eq!(got.devices.unwrap().results.unwrap()[0].request, "r/small");
    }

    #[test]
    fn shares_round_up_and_run_out() {
        let slices = [slice("a", json!([gpu("g0", 0, true)]), json!(null))];
        let mut a = Allocator::new(&slices, &[class()], Options::default()).unwrap();
        let share = |mem: &str| {
            claim(
                json!({"requests": [{"name": "r", "exactly": {"deviceClassName": "gpu",
                "capacity": {"requests": {"memory": mem}}}}]}),
            )
        };
        let got = a.allocate(&share("1000M")).unwrap();
        let r = &got.devices.unwrap().results.unwrap()[0];
        assert!(r.share_id.is_some());
        assert_eq!(
            r.consumed_capacity.as_ref().unwrap()["memory"].0,
            (954u64 << 20).to_string()
        );
        assert!(a.allocate(&share("81Gi")).is_err(), "above max");
        for _ in 0..7 {
            a.allocate(&share("10Gi")).unwrap();
        }
        assert!(
            a.allocate(&share("10Gi")).is_err(),
            "80Gi - 954Mi holds seven"
        );
        // A claim asking nothing takes the default: the whole device, no longer there.
        assert!(a.allocate(&claim(one("gpu"))).is_err());
    }

    fn mig_slices(shareable: bool) -> Vec<ResourceSlice> {
        let mig = |name: &str, profile: &str, size: i64| {
            let mut d = json!({"name": name, "attributes": {"type": {"string": "gpu"}, "uuid": {"string": "g0"},
                    "profile": {"string": profile}},
                "capacity": {"memory": {"value": "10Gi"}},
                "consumesCounters": [{"counterSet": "g0", "counters": {"s0": {"value": size.to_string()}}}]});
            if shareable {
                d["allowMultipleAllocations"] = json!(true);
                d["capacity"]["memory"]["requestPolicy"] =
                    json!({"default": "10Gi", "validRange": {"min": "1Mi", "step": "1Mi"}});
            }
            d
        };
        vec![slice(
            "a",
            json!([mig("small", "1g", 1), mig("big", "2g", 2)]),
            json!([{"name": "g0", "counters": {"s0": {"value": "2"}}}]),
        )]
    }

    #[test]
    fn counters_are_shared_and_leak_on_backtracking_over_shares() {
        let spec = json!({"requests": [
            {"name": "a", "exactly": {"deviceClassName": "gpu", "capacity": {"requests": {"memory": "1Gi"}}}},
            {"name": "b", "exactly": {"deviceClassName": "gpu", "capacity": {"requests": {"memory": "1Gi"}},
                "selectors": [{"cel": {"expression": "device.attributes[\"gpu.cleave.dev\"].profile == \"2g\""}}]}}]});
        // Exclusive devices: a=small, b=big (counters 1 + 2 > 2); a=big, b has nothing left.
        let mut a = Allocator::new(&mig_slices(false), &[class()], Options::default()).unwrap();
        assert!(a.allocate(&claim(spec.clone())).is_err());
        // Shares, as a fixed allocator would: a=small fails b; a=big, b=big (a second share).
        let mut a = Allocator::new(
            &mig_slices(true),
            &[class()],
            Options {
                counter_leak: false,
            },
        )
        .unwrap();
        assert_eq!(
            devices(&a.allocate(&claim(spec.clone())).unwrap()),
            ["big", "big"]
        );
        // big's counters stay held while its shares live: small is not free.
        let e = a.allocate(&claim(one("gpu"))).unwrap_err();
        assert!(
            e.to_string().contains("not enough memory") || e.to_string().contains("counters"),
            "{e}"
        );
        // v0.36.2: backtracking over small keeps its counter, so big no longer fits.
        let mut a = Allocator::new(&mig_slices(true), &[class()], Options::default()).unwrap();
        let e = a.allocate(&claim(spec)).unwrap_err();
        assert!(e.to_string().contains("counters are in use"), "{e}");
    }

    #[test]
    fn all_needs_every_selected_device_free_and_at_least_one() {
        let slices = [slice(
            "a",
            json!([gpu("g0", 0, false), gpu("g1", 0, false)]),
            json!(null),
        )];
        let all = json!({"requests": [{"name": "r", "exactly": {"deviceClassName": "gpu", "allocationMode": "All"}}]});
        let mut a = Allocator::new(&slices, &[class()], Options::default()).unwrap();
        assert_eq!(
            devices(&a.allocate(&claim(all.clone())).unwrap()),
            ["g0", "g1"]
        );
        let mut a = Allocator::new(&slices, &[class()], Options::default()).unwrap();
        a.allocate(&claim(one("gpu"))).unwrap();
        let e = a.allocate(&claim(all)).unwrap_err();
        assert!(e.to_string().contains("g0 is allocated"), "{e}");
        let none = json!({"requests": [{"name": "r", "exactly": {"deviceClassName": "gpu", "allocationMode": "All",
            "selectors": [{"cel": {"expression": "device.attributes[\"gpu.cleave.dev\"].type == \"mig\""}}]}}]});
        let e = a.allocate(&claim(none)).unwrap_err();
        assert!(e.to_string().contains("no device is selected"), "{e}");
    }

    #[test]
    fn admin_access_takes_a_held_device_and_consumes_nothing() {
        let slices = [slice("a", json!([gpu("g0", 0, false)]), json!(null))];
        let mut a = Allocator::new(&slices, &[class()], Options::default()).unwrap();
        a.allocate(&claim(one("gpu"))).unwrap();
        let admin = json!({"requests": [{"name": "w", "exactly": {"deviceClassName": "gpu", "adminAccess": true}}]});
        let got = a.allocate(&claim(admin.clone())).unwrap();
        let r = &got.devices.unwrap().results.unwrap()[0];
        assert_eq!((r.device.as_str(), r.admin_access), ("g0", Some(true)));
        assert!(r.share_id.is_none());
        assert!(a.allocate(&claim(admin)).is_ok(), "admin access again");
    }

    #[test]
    fn first_available_backtracks_to_meet_a_constraint() {
        // a: one device; b: first alternative on NUMA 1 (g1), else any. With a on g0 (NUMA 0)
        // and a constraint on NUMA, b's first alternative fails and its second gets g2.
        let slices = [slice(
            "a",
            json!([
                gpu("g0", 0, false),
                gpu("g1", 1, false),
                gpu("g2", 0, false)
            ]),
            json!(null),
        )];
        let mut a = Allocator::new(&slices, &[class()], Options::default()).unwrap();
        let spec = json!({"requests": [
            {"name": "a", "exactly": {"deviceClassName": "gpu"}},
            {"name": "b", "firstAvailable": [
                {"name": "far", "deviceClassName": "gpu", "selectors": [{"cel": {"expression": "device.attributes[\"resource.kubernetes.io\"].numaNode == 1"}}]},
                {"name": "any", "deviceClassName": "gpu"}]}],
            "constraints": [{"requests": ["a", "b"], "matchAttribute": "resource.kubernetes.io/numaNode"}]});
        let got = a.allocate(&claim(spec)).unwrap();
        let rs = got.devices.unwrap().results.unwrap();
        let pairs: Vec<(&str, &str)> = rs
            .iter()
            .map(|r| (r.request.as_str(), r.device.as_str()))
            .collect();
        // a=g0 fails "far" (g1 is NUMA 1); "any" takes g2 (g0 is held, same NUMA).
        assert_eq!(pairs, [("a", "g0"), ("b/any", "g2")]);
    }

    #[test]
    fn policies_with_valid_values_unknown_capacities_and_taints() {
        let mut d = gpu("g0", 0, true);
        d["capacity"]["memory"]["requestPolicy"] =
            json!({"default": "80Gi", "validValues": ["10Gi", "40Gi", "80Gi"]});
        d["taints"] = json!([{"key": "gpu.cleave.dev/unhealthy", "effect": "NoSchedule"}]);
        let slices = [slice("a", json!([d]), json!(null))];
        let mut a = Allocator::new(&slices, &[class()], Options::default()).unwrap();
        let share = |mem: &str, tolerate: bool| {
            let mut e =
                json!({"deviceClassName": "gpu", "capacity": {"requests": {"memory": mem}}});
            if tolerate {
                e["tolerations"] =
                    json!([{"key": "gpu.cleave.dev/unhealthy", "operator": "Exists"}]);
            }
            claim(json!({"requests": [{"name": "r", "exactly": e}]}))
        };
        assert!(a.allocate(&share("12Gi", false)).is_err(), "tainted");
        let got = a.allocate(&share("12Gi", true)).unwrap();
        let r = &got.devices.unwrap().results.unwrap()[0];
        assert_eq!(
            r.consumed_capacity.as_ref().unwrap()["memory"].0,
            (40u64 << 30).to_string()
        );
        let other = claim(
            json!({"requests": [{"name": "r", "exactly": {"deviceClassName": "gpu",
            "tolerations": [{"operator": "Exists"}], "capacity": {"requests": {"bandwidth": "1"}}}}]}),
        );
        let e = a.allocate(&other).unwrap_err();
        assert!(
            e.to_string().contains("publishes no capacity bandwidth"),
            "{e}"
        );
    }

    #[test]
    fn class_configs_come_first_then_the_claims() {
        let mut c = class();
        c.spec.config = Some(vec![
            serde_json::from_value(json!({"opaque": {"driver": DRIVER, "parameters": {"k": 1}}}))
                .unwrap(),
        ]);
        let slices = [slice("a", json!([gpu("g0", 0, false)]), json!(null))];
        let mut a = Allocator::new(&slices, &[c], Options::default()).unwrap();
        let got = a
            .allocate(&claim(json!({"requests": [{"name": "r", "exactly": {"deviceClassName": "gpu"}}],
                "config": [{"requests": ["r"], "opaque": {"driver": DRIVER, "parameters": {"k": 2}}}]})))
            .unwrap();
        let cfg = got.devices.unwrap().config.unwrap();
        let sources: Vec<&str> = cfg.iter().map(|c| c.source.as_str()).collect();
        assert_eq!(sources, ["FromClass", "FromClaim"]);
        assert_eq!(cfg[0].requests.as_deref(), Some(&["r".to_owned()][..]));
    }
}
