//! Request costs of the stand-in through an unmodified `kube::Client`: claim GET (the
//! kubelet plugin's prepare floor), `/version`, slice create/replace with and without
//! validation, and the pure validator. Prints p50/p99 and ratios measured in this run.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::time::{Duration, Instant};

use cleave_apiserver_standin::{
    KubeVersion, StandIn, StandInOptions, fixtures, validate_resource_slice,
};
use k8s_openapi::api::resource::v1::{
    Device, DeviceAttribute, ResourceClaim, ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, PostParams};

fn slice(name: &str, n: usize) -> ResourceSlice {
    let devices = (0..n)
        .map(|i| Device {
            name: format!("gpu-{i}"),
            attributes: Some(
                (0..8)
                    .map(|a| {
                        (
                            format!("attr{a}"),
                            DeviceAttribute {
                                string: Some("value".into()),
                                ..Default::default()
                            },
                        )
                    })
                    .collect(),
            ),
            ..Default::default()
        })
        .collect();
    ResourceSlice {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        spec: ResourceSliceSpec {
            driver: "gpu.cleave.dev".into(),
            node_name: Some("node-1".into()),
            pool: ResourcePool {
                name: "node-1".into(),
                generation: 1,
                resource_slice_count: 1,
            },
            devices: Some(devices),
            ..Default::default()
        },
    }
}

struct Stats {
    p50: Duration,
    p99: Duration,
}

fn stats(mut v: Vec<Duration>) -> Stats {
    v.sort();
    let at = |q: f64| v[((v.len() as f64 - 1.0) * q).round() as usize];
    Stats {
        p50: at(0.50),
        p99: at(0.99),
    }
}

async fn time<F, Fut>(n: usize, mut f: F) -> Stats
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    for i in 0..n / 10 {
        f(i).await;
    }
    let mut v = Vec::with_capacity(n);
    for i in 0..n {
        let t = Instant::now();
        f(i).await;
        v.push(t.elapsed());
    }
    stats(v)
}

fn show(what: &str, s: &Stats) {
    println!("{what:<44} p50 {:>9.1?}  p99 {:>9.1?}", s.p50, s.p99);
}

async fn slice_writes(validate: bool, n: usize) -> Stats {
    let s = StandIn::start(StandInOptions {
        validate,
        ..StandInOptions::with_version(KubeVersion::V1_35)
    })
    .await
    .unwrap();
    let api: Api<ResourceSlice> = Api::all(s.client());
    let mut current = api
        .create(&PostParams::default(), &slice("s", 128))
        .await
        .unwrap();
    let mut v = Vec::with_capacity(n);
    for i in 0..n + n / 10 {
        let mut next = current.clone();
        next.spec.pool.generation = i as i64 + 2;
        let t = Instant::now();
        current = api
            .replace("s", &PostParams::default(), &next)
            .await
            .unwrap();
        if i >= n / 10 {
            v.push(t.elapsed());
        }
    }
    stats(v)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let n = 2000;
    let s = StandIn::start(StandInOptions::default()).await.unwrap();
    let claim = fixtures::resource_claim(
        "default",
        "claim",
        "11111111-2222-4333-8444-555555555555",
        "gpu.cleave.dev",
        "node-1",
        &[("gpu", "gpu-0")],
        &[],
    );
    s.put(&claim).unwrap();
    let claims: Api<ResourceClaim> = Api::namespaced(s.client(), "default");
    let client = s.client();
    let version = time(n, |_| {
        let c = client.clone();
        async move {
            c.apiserver_version().await.unwrap();
        }
    })
    .await;
    let get = time(n, |_| {
        let a = claims.clone();
        async move {
            a.get("claim").await.unwrap();
        }
    })
    .await;
    let writes = n / 4;
    let with = slice_writes(true, writes).await;
    let without = slice_writes(false, writes).await;
    let value = serde_json::to_value(slice("s", 128)).unwrap();
    let pure = {
        let mut v = Vec::new();
        for _ in 0..writes {
            let t = Instant::now();
            validate_resource_slice(&value, KubeVersion::V1_35).unwrap();
            v.push(t.elapsed());
        }
        stats(v)
    };
    println!(
        "API server stand-in, {n} requests each (writes: {writes}), kube::Client over loopback"
    );
    show("GET /version", &version);
    show("GET resourceclaim", &get);
    show("PUT 128-device slice, validation on", &with);
    show("PUT 128-device slice, validation off", &without);
    show("validate_resource_slice (128 devices)", &pure);
    println!(
        "ratios: claim GET / version GET p50 = {:.2}; PUT validated / unvalidated p50 = {:.2}",
        get.p50.as_secs_f64() / version.p50.as_secs_f64(),
        with.p50.as_secs_f64() / without.p50.as_secs_f64()
    );
}
