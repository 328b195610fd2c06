//! Property-based fuzzing of the DRA gRPC request handling: arbitrary v1 and
//! v1beta1 prepare/unprepare batches (empty, huge, unicode, NUL, path-like strings,
//! duplicate UIDs, up to 50 claims) and raw garbage bodies, sent over the unix socket to
//! the in-process server with a recording fake handler and to the real plugin binary
//! (mock NVML, API server stand-in). Every call must answer within [`CALL_TIMEOUT`],
//! with one entry per distinct UID and a non-empty, claim-naming message for each
//! failure; the server must keep answering afterwards and write nothing outside its
//! CDI root and state directory.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cleave_kubelet_plugin::PluginServer;
use cleave_kubelet_plugin::proto::dra::{v1, v1beta1};
use cleave_kubelet_plugin::proto::registration::InfoRequest;
use common::node::{NodeDirs, Plugin, PluginOptions, put_claim, start_standin};
use common::*;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::Channel;

/// No single call may take longer than this (a hang is a failure).
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// Which RPC a generated request goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Call {
    PrepareV1,
    UnprepareV1,
    PrepareV1beta1,
    UnprepareV1beta1,
}

impl Call {
    fn is_prepare(self) -> bool {
        matches!(self, Self::PrepareV1 | Self::PrepareV1beta1)
    }
}

/// One generated claim reference: (namespace, name, uid).
type Triple = (String, String, String);

/// One response entry, version-independent: (error, device count, CDI device IDs).
#[derive(Debug)]
struct Outcome {
    error: String,
    devices: usize,
    cdi_ids: Vec<String>,
}

fn field() -> impl Strategy<Value = String> {
    prop_oneof![
        2 => Just(String::new()),
        4 => "[a-z0-9-]{1,12}",
        2 => prop::sample::select(vec![
            "default", "good", "bad-claim", "../../etc", "a/b", "x?y#z", "%2e%2e", "\0",
            "ns\0name", " ", "ü-名前", "\u{202e}rtl", "..",
        ])
        .prop_map(String::from),
        3 => any::<String>(),
        1 => "\\PC{0,64}",
        1 => "[a-z]{1000,4000}",
    ]
}

fn uid() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => field(),
        2 => prop::sample::select(vec!["u1", "u2", "u3", "uid-good"]).prop_map(String::from),
    ]
}

fn triple() -> impl Strategy<Value = Triple> {
    prop_oneof![
        1 => Just(("default".to_owned(), "good".to_owned(), "uid-good".to_owned())),
        9 => (field(), field(), uid()),
    ]
}

fn request() -> impl Strategy<Value = (Call, Vec<Triple>)> {
    (
        prop::sample::select(vec![
            Call::PrepareV1,
            Call::UnprepareV1,
            Call::PrepareV1beta1,
            Call::UnprepareV1beta1,
        ]),
        prop::collection::vec(triple(), 0..50),
    )
}

/// A runner with a fixed seed: the same cases every run (deterministic, reproducible).
fn runner(cases: u32) -> TestRunner {
    TestRunner::new_with_rng(
        Config {
            cases,
            failure_persistence: None,
            ..Config::default()
        },
        TestRng::deterministic_rng(RngAlgorithm::ChaCha),
    )
}

/// What the service's validation makes of a batch: distinct UID -> the claim's
/// (namespace, name) when every occurrence is well-formed and identical, else `None`.
fn model(claims: &[Triple]) -> BTreeMap<String, Option<(String, String)>> {
    let mut out: BTreeMap<String, Option<(String, String)>> = BTreeMap::new();
    for (ns, name, uid) in claims {
        // Non-empty, and Kubernetes names: namespace a DNS-1123 label, name a DNS-1123
        // subdomain, UID a DNS-1123 label (checked before any API request).
        let ok = !uid.is_empty()
            && !ns.is_empty()
            && !name.is_empty()
            && cleave_api::names::is_dns_label(ns)
            && cleave_api::names::node_name_problem(name).is_none()
            && cleave_api::names::is_dns_label(uid);
        let this = ok.then(|| (ns.clone(), name.clone()));
        match out.get(uid) {
            None => {
                out.insert(uid.clone(), this);
            }
            Some(prev) if *prev != this => {
                out.insert(uid.clone(), None);
            }
            Some(_) => {}
        }
    }
    out
}

async fn send(
    chan: &Channel,
    call: Call,
    claims: &[Triple],
) -> Result<BTreeMap<String, Outcome>, tonic::Status> {
    let v1c: Vec<v1::Claim> = claims.iter().map(|(n, m, u)| v1_claim(n, m, u)).collect();
    let b1c: Vec<v1beta1::Claim> = claims
        .iter()
        .map(|(n, m, u)| v1beta1_claim(n, m, u))
        .collect();
    let fut = async {
        Ok(match call {
            Call::PrepareV1 => v1::dra_plugin_client::DraPluginClient::new(chan.clone())
                .node_prepare_resources(v1::NodePrepareResourcesRequest { claims: v1c })
                .await?
                .into_inner()
                .claims
                .into_iter()
                .map(|(u, r)| {
                    let cdi_ids = r.devices.iter().flat_map(|d| d.cdi_device_ids.clone());
                    let o = Outcome {
                        devices: r.devices.len(),
                        cdi_ids: cdi_ids.collect(),
                        error: r.error,
                    };
                    (u, o)
                })
                .collect(),
            Call::UnprepareV1 => v1::dra_plugin_client::DraPluginClient::new(chan.clone())
                .node_unprepare_resources(v1::NodeUnprepareResourcesRequest { claims: v1c })
                .await?
                .into_inner()
                .claims
                .into_iter()
                .map(|(u, r)| {
                    let o = Outcome {
                        error: r.error,
                        devices: 0,
                        cdi_ids: Vec::new(),
                    };
                    (u, o)
                })
                .collect(),
            Call::PrepareV1beta1 => v1beta1::dra_plugin_client::DraPluginClient::new(chan.clone())
                .node_prepare_resources(v1beta1::NodePrepareResourcesRequest { claims: b1c })
                .await?
                .into_inner()
                .claims
                .into_iter()
                .map(|(u, r)| {
                    let cdi_ids = r.devices.iter().flat_map(|d| d.cdi_device_ids.clone());
                    let o = Outcome {
                        devices: r.devices.len(),
                        cdi_ids: cdi_ids.collect(),
                        error: r.error,
                    };
                    (u, o)
                })
                .collect(),
            Call::UnprepareV1beta1 => {
                v1beta1::dra_plugin_client::DraPluginClient::new(chan.clone())
                    .node_unprepare_resources(v1beta1::NodeUnprepareResourcesRequest {
                        claims: b1c,
                    })
                    .await?
                    .into_inner()
                    .claims
                    .into_iter()
                    .map(|(u, r)| {
                        let o = Outcome {
                            error: r.error,
                            devices: 0,
                            cdi_ids: Vec::new(),
                        };
                        (u, o)
                    })
                    .collect()
            }
        })
    };
    let started = Instant::now();
    let res = tokio::time::timeout(CALL_TIMEOUT, fut).await;
    match res {
        Ok(r) => r,
        Err(_) => panic!(
            "{call:?} with {} claims hung for {:?}",
            claims.len(),
            started.elapsed()
        ),
    }
}

/// Checks what every server must do, whatever the handler: one entry per distinct UID,
/// and every malformed claim rejected with a message naming it or the problem.
fn check_common(
    expected: &BTreeMap<String, Option<(String, String)>>,
    got: &BTreeMap<String, Outcome>,
) -> Result<(), TestCaseError> {
    let want: BTreeSet<&String> = expected.keys().collect();
    let have: BTreeSet<&String> = got.keys().collect();
    prop_assert_eq!(want, have, "response keys differ from distinct UIDs");
    for (uid, valid) in expected {
        let o = &got[uid];
        if valid.is_none() {
            prop_assert!(!o.error.is_empty(), "malformed claim {:?} accepted", uid);
            prop_assert_eq!(o.devices, 0);
            if uid.is_empty() {
                prop_assert!(o.error.contains("uid must not be empty"), "{}", o.error);
            } else {
                // Named as is, or quoted with escapes (a field that is not a Kubernetes
                // name), its first 80 characters.
                let cut: String = uid.chars().take(80).collect();
                prop_assert!(
                    o.error.contains(uid.as_str()) || o.error.contains(&format!("{cut:?}")),
                    "{:?}: {}",
                    uid,
                    o.error
                );
            }
        }
        if !o.error.is_empty() {
            prop_assert!(
                o.error.contains(uid.as_str()) || o.error.to_lowercase().contains("claim"),
                "error for {:?} names neither the claim nor a claim problem: {}",
                uid,
                o.error
            );
        }
    }
    Ok(())
}

/// Every path under `root`, relative to it.
fn tree(root: &Path) -> BTreeSet<PathBuf> {
    let mut out = BTreeSet::new();
    let mut todo = vec![root.to_path_buf()];
    while let Some(dir) = todo.pop() {
        let Ok(rd) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                todo.push(p.clone());
            }
            out.insert(p.strip_prefix(root).unwrap().to_path_buf());
        }
    }
    out
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

async fn still_serving(reg_sock: &Path, dra_sock: &Path) {
    let info = tokio::time::timeout(
        CALL_TIMEOUT,
        registration(reg_sock).await.get_info(InfoRequest {}),
    )
    .await
    .expect("GetInfo hung after fuzzing")
    .expect("GetInfo failed after fuzzing");
    assert_eq!(info.into_inner().name, "gpu.cleave.dev");
    let resp = tokio::time::timeout(
        CALL_TIMEOUT,
        dra_v1(dra_sock)
            .await
            .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
                claims: vec![v1_claim("default", "after", "uid-after")],
            }),
    )
    .await
    .expect("unprepare hung after fuzzing")
    .expect("unprepare failed after fuzzing")
    .into_inner();
    assert_eq!(resp.claims.len(), 1);
}

#[test]
fn fake_handler_sees_only_valid_deduplicated_claims() {
    const CASES: u32 = 128;
    let rt = rt();
    let dir = tempfile::tempdir().unwrap();
    let handler = Arc::new(FakeHandler::default());
    let server = rt
        .block_on(PluginServer::start(
            &config(dir.path()),
            Arc::clone(&handler),
        ))
        .unwrap();
    let chan = rt.block_on(channel(server.dra_socket()));
    let before = tree(dir.path());
    let started = Instant::now();
    let max_claims = std::cell::Cell::new(0);

    runner(CASES)
        .run(&request(), |(call, claims)| {
            let expected = model(&claims);
            // Only this case's batches are checked; the history would grow quadratically.
            handler.prepared.lock().unwrap().clear();
            handler.unprepared.lock().unwrap().clear();
            let batches_before = 0;
            let got = rt.block_on(send(&chan, call, &claims));
            let got = got.map_err(|s| TestCaseError::fail(format!("{call:?}: status {s:?}")))?;
            check_common(&expected, &got)?;

            // The handler got each valid UID exactly once, all fields non-empty.
            let batches = if call.is_prepare() {
                handler.prepare_batches()
            } else {
                handler.unprepare_batches()
            };
            let valid: BTreeMap<&String, &(String, String)> = expected
                .iter()
                .filter_map(|(u, v)| v.as_ref().map(|v| (u, v)))
                .collect();
            if valid.is_empty() {
                prop_assert_eq!(batches.len(), batches_before, "empty batch reached handler");
            } else {
                prop_assert_eq!(batches.len(), batches_before + 1);
                let batch = batches.last().unwrap();
                max_claims.set(max_claims.get().max(batch.len()));
                prop_assert_eq!(batch.len(), valid.len(), "handler saw duplicates");
                for c in batch {
                    prop_assert!(
                        !c.uid.is_empty() && !c.namespace.is_empty() && !c.name.is_empty()
                    );
                    prop_assert_eq!(
                        valid.get(&c.uid).copied(),
                        Some(&(c.namespace.clone(), c.name.clone()))
                    );
                }
            }
            for (uid, (ns, name)) in &valid {
                let o = &got[*uid];
                match (call.is_prepare(), name.starts_with("bad")) {
                    (true, true) => prop_assert_eq!(&o.error, &format!("claim {ns}/{name} is bad")),
                    (false, true) => prop_assert_eq!(&o.error, &format!("cannot unprepare {name}")),
                    (true, false) => {
                        prop_assert_eq!(&o.error, "");
                        prop_assert_eq!(o.devices, 1);
                        prop_assert_eq!(
                            &o.cdi_ids,
                            &vec![format!("k8s.gpu.cleave.dev/claim={uid}-gpu-0")]
                        );
                    }
                    (false, false) => prop_assert_eq!(&o.error, ""),
                }
            }
            Ok(())
        })
        .unwrap();
    eprintln!(
        "fake handler: {CASES} cases in {:?} (largest handler batch {})",
        started.elapsed(),
        max_claims.get()
    );

    rt.block_on(still_serving(
        server.registration_socket(),
        server.dra_socket(),
    ));
    assert_eq!(tree(dir.path()), before, "fuzzing created or removed files");
    rt.block_on(server.shutdown()).unwrap();
}

#[test]
fn real_binary_answers_every_fuzzed_request_and_writes_only_its_dirs() {
    const CASES: u32 = 64;
    let rt = rt();
    let dirs = NodeDirs::new();
    let standin = rt.block_on(start_standin(&dirs));
    put_claim(&standin, "good", "uid-good", &[("gpu", "gpu-0")], &[]);
    let plugin = Plugin::start(&dirs, &PluginOptions::default());
    let chan = rt.block_on(channel(&plugin.dra_socket));
    let before = tree(dirs.path());
    let started = Instant::now();
    let (prepared_good, claims_sent) = (std::cell::Cell::new(0u32), std::cell::Cell::new(0usize));

    runner(CASES)
        .run(&request(), |(call, claims)| {
            let expected = model(&claims);
            claims_sent.set(claims_sent.get() + claims.len());
            let got = rt.block_on(send(&chan, call, &claims));
            let got = got.map_err(|s| TestCaseError::fail(format!("{call:?}: status {s:?}")))?;
            check_common(&expected, &got)?;
            for (uid, valid) in &expected {
                let Some((ns, name)) = valid else { continue };
                let o = &got[uid];
                let real = ns == "default" && name == "good" && uid == "uid-good";
                if call.is_prepare() {
                    if real {
                        prop_assert_eq!(&o.error, "", "the allocated claim failed");
                        prop_assert_eq!(o.devices, 1);
                        prepared_good.set(prepared_good.get() + 1);
                    } else {
                        prop_assert!(!o.error.is_empty(), "unknown claim {:?} prepared", uid);
                        prop_assert_eq!(o.devices, 0);
                    }
                }
            }
            Ok(())
        })
        .unwrap();
    let elapsed = started.elapsed();
    assert_no_panic_logged(&dirs, plugin.child.id());

    rt.block_on(still_serving(
        &plugin.registration_socket,
        &plugin.dra_socket,
    ));
    let after = tree(dirs.path());
    let cdi = dirs
        .cdi_root()
        .strip_prefix(dirs.path())
        .unwrap()
        .to_owned();
    let state = dirs
        .state_dir()
        .strip_prefix(dirs.path())
        .unwrap()
        .to_owned();
    for p in after.difference(&before) {
        assert!(
            p.starts_with(&cdi) || p.starts_with(&state),
            "fuzzing created {} outside the CDI root and state dir",
            p.display()
        );
    }
    for f in dirs.cdi_files() {
        assert!(f.contains("uid-good"), "unexpected CDI spec {f}");
    }
    // Releasing the one real claim leaves no CDI spec behind.
    let chan2 = chan.clone();
    let resp = rt
        .block_on(send(
            &chan2,
            Call::UnprepareV1,
            &[("default".into(), "good".into(), "uid-good".into())],
        ))
        .unwrap();
    assert_eq!(resp["uid-good"].error, "");
    assert!(dirs.cdi_files().is_empty(), "{:?}", dirs.cdi_files());
    eprintln!(
        "real binary: {CASES} cases, {} claims in {elapsed:?}; the allocated claim prepared {} times",
        claims_sent.get(),
        prepared_good.get()
    );
    assert!(
        prepared_good.get() > 0,
        "the success path was never exercised"
    );
    drop(plugin);
}

/// The plugin process must not have panicked (its log says so if it did).
fn assert_no_panic_logged(dirs: &NodeDirs, pid: u32) {
    let log = dirs.log();
    assert!(!log.contains("panicked"), "plugin {pid} panicked:\n{log}");
}

/// Sends raw bytes as one gRPC message, bypassing protobuf encoding.
#[derive(Debug, Clone, Copy, Default)]
struct RawCodec;
#[derive(Debug)]
struct RawEncoder;
#[derive(Debug)]
struct RawDecoder;

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawEncoder;
    type Decoder = RawDecoder;
    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }
    fn decoder(&mut self) -> RawDecoder {
        RawDecoder
    }
}

impl tonic::codec::Encoder for RawEncoder {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(
        &mut self,
        item: Vec<u8>,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        bytes::BufMut::put_slice(dst, &item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawDecoder {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<Vec<u8>>, tonic::Status> {
        let n = bytes::Buf::remaining(src);
        Ok(Some(bytes::Buf::copy_to_bytes(src, n).to_vec()))
    }
}

const PATHS: [&str; 4] = [
    "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
    "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources",
    "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodePrepareResources",
    "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodeUnprepareResources",
];

async fn raw_call(
    chan: &Channel,
    path: &'static str,
    body: Vec<u8>,
) -> Result<Vec<u8>, tonic::Status> {
    let mut grpc = tonic::client::Grpc::new(chan.clone());
    let fut = async {
        grpc.ready()
            .await
            .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        grpc.unary(
            tonic::Request::new(body),
            PathAndQuery::from_static(path),
            RawCodec,
        )
        .await
        .map(tonic::Response::into_inner)
    };
    tokio::time::timeout(CALL_TIMEOUT, fut)
        .await
        .unwrap_or_else(|_| panic!("raw call to {path} hung"))
}

/// Whether `bytes` decode as the response message `M`.
fn decode<M: prost::Message + Default>(bytes: &[u8]) -> Result<(), prost::DecodeError> {
    M::decode(bytes).map(|_| ())
}

/// Random bytes, or an encoded request with one byte changed and/or cut short.
fn garbage() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..512),
        (
            prop::collection::vec(triple(), 1..8),
            any::<prop::sample::Index>(),
            any::<u8>(),
            prop::option::of(any::<prop::sample::Index>()),
        )
            .prop_map(|(claims, at, xor, cut)| {
                let req = v1::NodePrepareResourcesRequest {
                    claims: claims.iter().map(|(n, m, u)| v1_claim(n, m, u)).collect(),
                };
                let mut body = prost::Message::encode_to_vec(&req);
                let i = at.index(body.len());
                body[i] ^= xor;
                if let Some(cut) = cut {
                    body.truncate(cut.index(body.len() + 1).max(i));
                }
                body
            }),
    ]
}

#[test]
fn garbage_bodies_get_clean_errors_and_the_server_survives() {
    const CASES: u32 = 128;
    let rt = rt();
    let dir = tempfile::tempdir().unwrap();
    let handler = Arc::new(FakeHandler::default());
    let server = rt
        .block_on(PluginServer::start(
            &config(dir.path()),
            Arc::clone(&handler),
        ))
        .unwrap();
    let chan = rt.block_on(channel(server.dra_socket()));

    // Invalid UTF-8 in a claim's namespace: not a valid request, must be refused.
    let bad_utf8 = vec![0x0a, 0x03, 0x0a, 0x01, 0xff];
    // A length prefix running past the end of the body.
    let truncated = vec![0x0a, 0x7f, 0x0a];
    // A field with the reserved wire type 7.
    let bad_wire = vec![0x0f, 0x00];
    for path in PATHS {
        for body in [bad_utf8.clone(), truncated.clone(), bad_wire.clone()] {
            let err = rt
                .block_on(raw_call(&chan, path, body.clone()))
                .unwrap_err();
            assert_eq!(
                err.code(),
                tonic::Code::Internal,
                "{path} {body:?}: {err:?}"
            );
            assert!(
                err.message().contains("decode"),
                "{path} {body:?}: unclear message {:?}",
                err.message()
            );
        }
    }
    let err = rt
        .block_on(raw_call(
            &chan,
            "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/Nope",
            vec![],
        ))
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unimplemented, "{err:?}");

    let started = Instant::now();
    let counts = std::cell::Cell::new((0u32, 0u32));
    runner(CASES)
        .run(&(0..PATHS.len(), garbage()), |(i, body)| {
            let path = PATHS[i];
            match rt.block_on(raw_call(&chan, path, body)) {
                Ok(resp) => {
                    // Some garbage happens to be valid protobuf; the answer must be too.
                    // PATHS order: v1 prepare, v1 unprepare, v1beta1 prepare, v1beta1 unprepare.
                    let decoded = match i {
                        0 => decode::<v1::NodePrepareResourcesResponse>(&resp),
                        1 => decode::<v1::NodeUnprepareResourcesResponse>(&resp),
                        2 => decode::<v1beta1::NodePrepareResourcesResponse>(&resp),
                        _ => decode::<v1beta1::NodeUnprepareResourcesResponse>(&resp),
                    };
                    prop_assert!(decoded.is_ok(), "undecodable answer from {}", path);
                    let (o, r) = counts.get();
                    counts.set((o + 1, r));
                }
                Err(s) => {
                    prop_assert!(
                        !s.message().is_empty(),
                        "empty error from {}: {:?}",
                        path,
                        s
                    );
                    prop_assert_ne!(s.code(), tonic::Code::Unavailable, "{:?}", s);
                    let (o, r) = counts.get();
                    counts.set((o, r + 1));
                }
            }
            Ok(())
        })
        .unwrap();
    let (ok, refused) = counts.get();
    eprintln!(
        "garbage: {CASES} cases in {:?}: {ok} decoded as requests, {refused} refused",
        started.elapsed()
    );
    assert!(
        refused > 0,
        "no garbage body was refused: the check cannot fail"
    );

    rt.block_on(still_serving(
        server.registration_socket(),
        server.dra_socket(),
    ));
    rt.block_on(server.shutdown()).unwrap();
}

/// Sends `body` as the raw HTTP/2 request body (gRPC framing included) and returns the
/// `grpc-status` and `grpc-message` of the answer, from its headers or trailers.
async fn raw_frame(chan: &Channel, path: &str, body: Vec<u8>) -> (String, String) {
    use http_body_util::BodyExt as _;
    use tower::ServiceExt as _;
    let req = tonic::codegen::http::Request::builder()
        .method("POST")
        .uri(format!("http://localhost{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(tonic::body::Body::new(http_body_util::Full::new(
            bytes::Bytes::from(body),
        )))
        .unwrap();
    let fut = async {
        let resp = chan.clone().oneshot(req).await.expect("transport error");
        let (parts, body) = resp.into_parts();
        let trailers = body
            .collect()
            .await
            .expect("body error")
            .trailers()
            .cloned()
            .unwrap_or_default();
        let get = |name: &str| {
            parts
                .headers
                .get(name)
                .or_else(|| trailers.get(name))
                .map(|v| v.to_str().unwrap().to_owned())
                .unwrap_or_default()
        };
        (get("grpc-status"), get("grpc-message"))
    };
    tokio::time::timeout(CALL_TIMEOUT, fut)
        .await
        .unwrap_or_else(|_| panic!("raw frame to {path} hung"))
}

#[test]
fn broken_grpc_framing_gets_an_error_status_and_the_server_survives() {
    let rt = rt();
    let dir = tempfile::tempdir().unwrap();
    let handler = Arc::new(FakeHandler::default());
    let server = rt
        .block_on(PluginServer::start(
            &config(dir.path()),
            Arc::clone(&handler),
        ))
        .unwrap();
    let chan = rt.block_on(channel(server.dra_socket()));
    let frames: [(&str, Vec<u8>); 4] = [
        // Compressed flag without a grpc-encoding header.
        ("compressed", vec![1, 0, 0, 0, 2, 0x0a, 0x00]),
        // The length prefix promises more than the body holds.
        ("truncated", vec![0, 0, 0, 0, 10, 0x0a, 0x00]),
        // A length far beyond the server's message size limit.
        ("oversized", vec![0, 0xff, 0xff, 0xff, 0xff, 0x0a]),
        // Half a frame header.
        ("half header", vec![0, 0]),
    ];
    for path in PATHS {
        // Control: an empty, well-framed request is answered with status 0.
        let (status, _) = rt.block_on(raw_frame(&chan, path, vec![0, 0, 0, 0, 0]));
        assert_eq!(status, "0", "{path}");
        for (what, body) in &frames {
            let (status, message) = rt.block_on(raw_frame(&chan, path, body.clone()));
            assert!(
                !status.is_empty() && status != "0",
                "{what} frame to {path} accepted: status {status:?} {message:?}"
            );
            assert!(
                !message.is_empty(),
                "{what} frame to {path}: status {status} without a message"
            );
            if path == PATHS[0] {
                eprintln!("{what}: grpc-status {status}, {message:?}");
            }
        }
    }
    assert!(handler.prepare_batches().is_empty());
    assert!(handler.unprepare_batches().is_empty());
    rt.block_on(still_serving(
        server.registration_socket(),
        server.dra_socket(),
    ));
    rt.block_on(server.shutdown()).unwrap();
}
