//! The servers in-process, with the test acting as the kubelet over the unix sockets.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::sync::Arc;
use std::time::Instant;

use cleave_kubelet_plugin::proto::dra::{v1, v1beta1};
use cleave_kubelet_plugin::proto::registration::{InfoRequest, RegistrationStatus};
use cleave_kubelet_plugin::{PluginServer, RegistrationState};
use common::*;

async fn start(dir: &std::path::Path) -> (PluginServer, Arc<FakeHandler>) {
    let handler = Arc::new(FakeHandler::default());
    let server = PluginServer::start(&config(dir), Arc::clone(&handler))
        .await
        .unwrap();
    (server, handler)
}

#[tokio::test]
async fn get_info_answers_endpoint_and_versions_quickly() {
    let dir = tempfile::tempdir().unwrap();
    let (server, _) = start(dir.path()).await;
    let reg_sock = dir.path().join("plugins_registry/gpu.cleave.dev-reg.sock");
    let dra_sock = dir.path().join("plugins/gpu.cleave.dev/dra.sock");
    assert_eq!(server.registration_socket(), reg_sock);
    assert_eq!(server.dra_socket(), dra_sock);

    let mut client = registration(&reg_sock).await;
    let started = Instant::now();
    let info = tokio::time::timeout(TIMEOUT, client.get_info(InfoRequest {}))
        .await
        .unwrap()
        .unwrap()
        .into_inner();
    // The kubelet allows GetInfo one second.
    assert!(
        started.elapsed().as_millis() < 1000,
        "{:?}",
        started.elapsed()
    );
    assert_eq!(info.r#type, "DRAPlugin");
    assert_eq!(info.name, "gpu.cleave.dev");
    assert_eq!(info.endpoint, dra_sock.display().to_string());
    assert!(std::path::Path::new(&info.endpoint).is_absolute());
    assert_eq!(
        info.supported_versions,
        ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
    );
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn notify_registration_status_is_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let (server, _) = start(dir.path()).await;
    let mut state = server.registration_state();
    assert_eq!(*state.borrow(), RegistrationState::Pending);
    let mut client = registration(server.registration_socket()).await;

    let err = client
        .notify_registration_status(RegistrationStatus {
            plugin_registered: false,
            error: "version mismatch".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(
        err.message(),
        "failed registration process: version mismatch"
    );
    tokio::time::timeout(TIMEOUT, state.changed())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        *state.borrow_and_update(),
        RegistrationState::Failed("version mismatch".into())
    );

    client
        .notify_registration_status(RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        })
        .await
        .unwrap();
    tokio::time::timeout(TIMEOUT, state.changed())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(*state.borrow(), RegistrationState::Registered);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn v1_prepare_and_unprepare_reach_the_handler_with_per_claim_errors() {
    let dir = tempfile::tempdir().unwrap();
    let (server, handler) = start(dir.path()).await;
    let mut client = dra_v1(server.dra_socket()).await;

    let resp = client
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: vec![
                v1_claim("ns", "good", "uid-1"),
                v1_claim("ns", "bad", "uid-2"),
                v1_claim("", "nameless-ns", "uid-3"),
                v1_claim("ns", "good", "uid-1"),
            ],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        resp.claims
            .keys()
            .cloned()
            .collect::<std::collections::BTreeSet<_>>(),
        ["uid-1", "uid-2", "uid-3"].map(String::from).into()
    );
    let good = &resp.claims["uid-1"];
    assert_eq!(good.error, "");
    assert_eq!(good.devices.len(), 1);
    assert_eq!(good.devices[0].device_name, "gpu-0");
    assert_eq!(good.devices[0].pool_name, "node-a");
    assert_eq!(good.devices[0].request_names, ["gpu"]);
    assert_eq!(
        good.devices[0].cdi_device_ids,
        ["k8s.gpu.cleave.dev/claim=uid-1-gpu-0"]
    );
    assert_eq!(good.devices[0].share_id.as_deref(), Some("share-1"));
    assert_eq!(resp.claims["uid-2"].error, "claim ns/bad is bad");
    assert!(resp.claims["uid-2"].devices.is_empty());
    assert!(
        resp.claims["uid-3"]
            .error
            .contains("namespace must not be empty")
    );
    // The malformed claim never reaches the handler; the duplicate is passed once.
    assert_eq!(
        handler.prepare_batches(),
        [vec![
            claim_ref("ns", "good", "uid-1"),
            claim_ref("ns", "bad", "uid-2")
        ]]
    );

    let resp = client
        .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
            claims: vec![
                v1_claim("ns", "good", "uid-1"),
                v1_claim("ns", "bad", "uid-2"),
            ],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.claims.len(), 2);
    assert_eq!(resp.claims["uid-1"].error, "");
    assert_eq!(resp.claims["uid-2"].error, "cannot unprepare bad");
    assert_eq!(
        handler.unprepare_batches(),
        [vec![
            claim_ref("ns", "good", "uid-1"),
            claim_ref("ns", "bad", "uid-2")
        ]]
    );
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn v1beta1_prepare_and_unprepare_reach_the_same_handler() {
    let dir = tempfile::tempdir().unwrap();
    let (server, handler) = start(dir.path()).await;
    let mut client = dra_v1beta1(server.dra_socket()).await;

    let resp = client
        .node_prepare_resources(v1beta1::NodePrepareResourcesRequest {
            claims: vec![
                v1beta1_claim("team", "good", "u1"),
                v1beta1_claim("team", "bad", "u2"),
            ],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.claims.len(), 2);
    assert_eq!(resp.claims["u1"].error, "");
    assert_eq!(
        resp.claims["u1"].devices[0].cdi_device_ids,
        ["k8s.gpu.cleave.dev/claim=u1-gpu-0"]
    );
    assert_eq!(resp.claims["u2"].error, "claim team/bad is bad");

    let resp = client
        .node_unprepare_resources(v1beta1::NodeUnprepareResourcesRequest {
            claims: vec![
                v1beta1_claim("team", "good", "u1"),
                v1beta1_claim("team", "x", ""),
            ],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.claims.len(), 2);
    assert_eq!(resp.claims["u1"].error, "");
    assert!(resp.claims[""].error.contains("uid must not be empty"));
    assert_eq!(
        handler.prepare_batches(),
        [vec![
            claim_ref("team", "good", "u1"),
            claim_ref("team", "bad", "u2")
        ]]
    );
    assert_eq!(
        handler.unprepare_batches(),
        [vec![claim_ref("team", "good", "u1")]]
    );
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn missing_handler_result_becomes_a_claim_error() {
    let dir = tempfile::tempdir().unwrap();
    let handler = Arc::new(FakeHandler {
        forget_lost: true,
        ..FakeHandler::default()
    });
    let server = PluginServer::start(&config(dir.path()), handler)
        .await
        .unwrap();
    let mut client = dra_v1(server.dra_socket()).await;
    let resp = client
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: vec![v1_claim("ns", "lost", "u1"), v1_claim("ns", "ok", "u2")],
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        resp.claims["u1"].error.contains("no result"),
        "{:?}",
        resp.claims["u1"]
    );
    assert_eq!(resp.claims["u2"].error, "");
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn empty_batch_gets_empty_map() {
    let dir = tempfile::tempdir().unwrap();
    let (server, handler) = start(dir.path()).await;
    let mut client = dra_v1(server.dra_socket()).await;
    let resp = client
        .node_prepare_resources(v1::NodePrepareResourcesRequest { claims: vec![] })
        .await
        .unwrap()
        .into_inner();
    assert!(resp.claims.is_empty());
    assert!(handler.prepare_batches().is_empty());
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn sockets_are_0600_and_state_dir_0700() {
    let dir = tempfile::tempdir().unwrap();
    let (server, _) = start(dir.path()).await;
    for sock in [server.dra_socket(), server.registration_socket()] {
        let meta = std::fs::symlink_metadata(sock).unwrap();
        assert!(meta.file_type().is_socket());
        assert_eq!(
            meta.permissions().mode() & 0o777,
            0o600,
            "{}",
            sock.display()
        );
    }
    let state = std::fs::metadata(dir.path().join("plugins/gpu.cleave.dev")).unwrap();
    assert_eq!(state.permissions().mode() & 0o777, 0o700);
    server.shutdown().await.unwrap();
    assert!(!dir.path().join("plugins/gpu.cleave.dev/dra.sock").exists());
    assert!(
        !dir.path()
            .join("plugins_registry/gpu.cleave.dev-reg.sock")
            .exists()
    );
}

#[tokio::test]
async fn stale_socket_from_previous_run_is_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path());
    cfg.prepare_dirs().unwrap();
    // A previous run that died without cleaning up: socket files with no server behind.
    for path in [cfg.dra_socket(), cfg.registration_socket()] {
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        assert!(path.exists());
    }
    let (server, _) = start(dir.path()).await;
    let mut client = registration(server.registration_socket()).await;
    let info = client.get_info(InfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.name, "gpu.cleave.dev");
    let mut dra = dra_v1(server.dra_socket()).await;
    dra.node_prepare_resources(v1::NodePrepareResourcesRequest {
        claims: vec![v1_claim("ns", "a", "u")],
    })
    .await
    .unwrap();
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_live_socket_is_never_taken_over() {
    let dir = tempfile::tempdir().unwrap();
    let (first, first_handler) = start(dir.path()).await;
    let second = PluginServer::start(&config(dir.path()), Arc::new(FakeHandler::default())).await;
    let err = second.expect_err("a second server on the same sockets must fail");
    let msg = err.to_string();
    assert!(
        matches!(err, cleave_kubelet_plugin::ServerError::InUse { .. }),
        "{msg}"
    );
    assert!(
        msg.contains(&format!("served by process {}", std::process::id())),
        "{msg}"
    );
    assert!(
        msg.contains(&first.dra_socket().display().to_string()),
        "{msg}"
    );
    // The early check says the same without binding anything.
    let early = cleave_kubelet_plugin::check_sockets_free(&config(dir.path()))
        .await
        .unwrap_err();
    assert!(
        matches!(early, cleave_kubelet_plugin::ServerError::InUse { .. }),
        "{early}"
    );
    // The first server still answers on both sockets, and no temporary name is left.
    let mut client = registration(first.registration_socket()).await;
    let info = client.get_info(InfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.endpoint, first.dra_socket().display().to_string());
    let mut dra = dra_v1(first.dra_socket()).await;
    dra.node_prepare_resources(v1::NodePrepareResourcesRequest {
        claims: vec![v1_claim("ns", "a", "u")],
    })
    .await
    .unwrap();
    let batches = first_handler.prepare_batches();
    assert_eq!(batches.len(), 1);
    assert_eq!(batches[0][0].uid, "u");
    for sub in ["plugins_registry", "plugins/gpu.cleave.dev"] {
        let names: Vec<String> = std::fs::read_dir(dir.path().join(sub))
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with('.'))
            .collect();
        assert!(names.is_empty(), "{sub}: {names:?}");
    }
    first.shutdown().await.unwrap();
    assert!(!dir.path().join("plugins/gpu.cleave.dev/dra.sock").exists());
}

#[tokio::test]
async fn pod_uid_names_let_two_instances_run_side_by_side() {
    let dir = tempfile::tempdir().unwrap();
    let old_handler = Arc::new(FakeHandler::default());
    let new_handler = Arc::new(FakeHandler::default());
    let old_cfg = config(dir.path()).with_pod_uid(Some("pod-old".into()));
    let new_cfg = config(dir.path()).with_pod_uid(Some("pod-new".into()));
    let old = PluginServer::start(&old_cfg, Arc::clone(&old_handler))
        .await
        .unwrap();
    let new = PluginServer::start(&new_cfg, Arc::clone(&new_handler))
        .await
        .unwrap();
    assert_eq!(
        old.registration_socket(),
        dir.path()
            .join("plugins_registry/gpu.cleave.dev-pod-old-reg.sock")
    );
    assert_eq!(
        old.dra_socket(),
        dir.path().join("plugins/gpu.cleave.dev/dra-pod-old.sock")
    );
    assert_eq!(
        new.dra_socket(),
        dir.path().join("plugins/gpu.cleave.dev/dra-pod-new.sock")
    );

    // Each registration socket points the kubelet at its own DRA socket.
    for server in [&old, &new] {
        let info = registration(server.registration_socket())
            .await
            .get_info(InfoRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(info.endpoint, server.dra_socket().display().to_string());
    }
    for (server, uid) in [(&old, "u-old"), (&new, "u-new")] {
        dra_v1(server.dra_socket())
            .await
            .node_prepare_resources(v1::NodePrepareResourcesRequest {
                claims: vec![v1_claim("ns", "c", uid)],
            })
            .await
            .unwrap();
    }
    assert_eq!(
        old_handler.prepare_batches(),
        [vec![claim_ref("ns", "c", "u-old")]]
    );
    assert_eq!(
        new_handler.prepare_batches(),
        [vec![claim_ref("ns", "c", "u-new")]]
    );

    // The old pod goes away: only its sockets disappear; the new one keeps serving.
    old.shutdown().await.unwrap();
    assert!(!old_cfg.dra_socket().exists());
    assert!(!old_cfg.registration_socket().exists());
    assert!(new_cfg.dra_socket().exists());
    assert!(new_cfg.registration_socket().exists());
    let info = registration(new.registration_socket())
        .await
        .get_info(InfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.endpoint, new_cfg.dra_socket().display().to_string());
    new.shutdown().await.unwrap();
}

#[tokio::test]
async fn instance_whose_socket_was_taken_over_leaves_it_alone() {
    // A live socket is never taken over (see a_live_socket_is_never_taken_over), but its
    // file can still vanish under a running instance (someone deleted it); a second
    // instance then binds the free name, and the first must not delete the second's
    // sockets when it stops.
    let dir = tempfile::tempdir().unwrap();
    let (first, _) = start(dir.path()).await;
    std::fs::remove_file(first.dra_socket()).unwrap();
    std::fs::remove_file(first.registration_socket()).unwrap();
    let (second, handler) = start(dir.path()).await;
    first.shutdown().await.unwrap();
    assert!(second.dra_socket().exists());
    assert!(second.registration_socket().exists());
    dra_v1(second.dra_socket())
        .await
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: vec![v1_claim("ns", "a", "u")],
        })
        .await
        .unwrap();
    assert_eq!(handler.prepare_batches().len(), 1);
    second.shutdown().await.unwrap();
}

#[tokio::test]
async fn dropping_the_server_removes_its_sockets() {
    let dir = tempfile::tempdir().unwrap();
    let (server, _) = start(dir.path()).await;
    let (dra, reg) = (
        server.dra_socket().to_owned(),
        server.registration_socket().to_owned(),
    );
    drop(server);
    assert!(!dra.exists());
    assert!(!reg.exists());
}
