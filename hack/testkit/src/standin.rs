//! The API server stand-in as a node's cluster: running, holding the Node, and named by a
//! kubeconfig file for child processes.

use std::path::Path;

use cleave_apiserver_standin::{StandIn, StandInOptions, fixtures};

/// Starts the stand-in (on this runtime) with Node `node` and writes a kubeconfig naming it
/// to `kubeconfig`; installs rustls' crypto provider first, as every kube client needs one.
pub async fn start_with_node(node: &str, kubeconfig: &Path) -> StandIn {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let standin = StandIn::start(StandInOptions::default())
        .await
        .expect("starting the API server stand-in");
    standin.put(&fixtures::node(node)).unwrap();
    standin.write_kubeconfig(kubeconfig).unwrap();
    standin
}
