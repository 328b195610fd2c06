//! Inputs a tenant or a confused kubelet controls, end to end through the plugin binary:
//! namespace, name and UID from the kubelet are checked as Kubernetes names before any API
//! request (the stand-in counts the claim reads), and a claim's config key holding a
//! newline and a terminal sequence reaches neither the kubelet's error, nor the Event, nor
//! the log as raw control characters.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use cleave_apiserver_standin::fixtures;
use common::node::*;
use common::*;
use serde_json::json;

/// The kubelet's names go into API URLs only when they are Kubernetes names; a bad one is
/// that claim's error, naming the field, and costs no request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_from_the_kubelet_are_checked_before_any_request() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    put_claim(&standin, "good", "uid-good", &[("gpu", "gpu-0")], &[]);
    let plugin = Plugin::start(&dirs, &PluginOptions::default());
    let mut dra = dra_v1(&plugin.dra_socket).await;
    let bad = |ns: &str, name: &str, uid: &str| {
        let mut c = claim(name, uid);
        c.namespace = ns.into();
        c
    };
    standin.reset_counts();
    let resp = prepare(
        &mut dra,
        vec![
            claim("good", "uid-good"),
            bad("../../api/v1/namespaces/kube-system/secrets", "x", "uid-ns"),
            bad("default", "x/../../../secrets?watch=1", "uid-name"),
            bad("default", "x", "../uid"),
            bad("default\n", "x", "uid-nl"),
        ],
    )
    .await;
    assert_eq!(resp.claims["uid-good"].error, "", "{:?}", resp.claims);
    assert!(
        resp.claims["uid-ns"].error.contains("namespace"),
        "{:?}",
        resp.claims
    );
    assert!(
        resp.claims["uid-name"].error.contains(": name "),
        "{:?}",
        resp.claims
    );
    assert!(
        resp.claims["../uid"].error.contains("uid"),
        "{:?}",
        resp.claims
    );
    assert!(
        resp.claims["uid-nl"].error.contains("namespace"),
        "{:?}",
        resp.claims
    );
    for r in resp.claims.values() {
        assert!(!r.error.chars().any(char::is_control), "{:?}", r.error);
    }
    // Every claim request (the read, the status write) is about the good claim.
    let paths: Vec<String> = standin
        .requests()
        .into_iter()
        .filter(|r| r.resource == "resourceclaims" || r.path.contains("secrets"))
        .map(|r| r.path)
        .collect();
    assert!(!paths.is_empty());
    for p in &paths {
        assert!(
            p.starts_with("/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/good"),
            "a request for a bad name: {paths:?}"
        );
    }
}

/// A config key with a newline and an ESC sequence: the kubelet's error and the Event show
/// it escaped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_characters_in_a_config_key_are_escaped() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    let forged_key = "x\n2026-01-01T00:00:00Z  INFO forged\u{1b}[31m";
    let mut parameters = json!({"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig"});
    parameters[forged_key] = json!(1);
    let config = fixtures::opaque_config("FromClaim", &[], DRIVER, parameters);
    put_claim(
        &standin,
        "forged",
        "uid-forged",
        &[("gpu", "gpu-0")],
        &[config],
    );
    let plugin = Plugin::start(&dirs, &PluginOptions::default());
    let mut dra = dra_v1(&plugin.dra_socket).await;
    let resp = prepare(&mut dra, vec![claim("forged", "uid-forged")]).await;
    let error = &resp.claims["uid-forged"].error;
    assert!(error.contains("forged"), "{error:?}");
    assert!(!error.chars().any(char::is_control), "{error:?}");
    assert!(
        error.contains("x\\n2026") && error.contains("\\u{1b}[31m"),
        "{error:?}"
    );

    let event = wait_event(&standin, "PrepareFailed").await;
    let note = event["note"].as_str().unwrap();
    assert!(note.contains("forged"), "{note:?}");
    assert!(!note.chars().any(char::is_control), "{note:?}");

    // The log: the key stays inside its record's line.
    drop(plugin);
    let log = dirs.log();
    assert!(log.contains("forged"), "{log}");
    assert!(
        !log.lines().any(|l| l.starts_with("2026-01-01T00:00:00Z")),
        "a forged log line:\n{log}"
    );
    assert!(!log.contains('\u{1b}'), "raw ESC in the log:\n{log}");
}
