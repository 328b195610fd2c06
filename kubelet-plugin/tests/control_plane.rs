//! What a node costs the API server, counted with three plugin processes (two whole-GPU
//! nodes, one on-demand MIG node) against one stand-in: at start, per claim at prepare and
//! unprepare, and at restart; and that no request walks other nodes' objects except each
//! watch's one initial list at start. `benches/control_plane.rs` prints the same figures
//! for tens of nodes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod cost_world;

use cost_world::{Kind, Tally, World};

/// Per start, as measured: Node GETs (the publisher's, the daemon pods' owner, the
/// coexistence check), the initial LIST of each watch (slices; daemon pods with the pod
/// launcher), the coexistence check's LIST of this node's slices, the slice creates, the
/// watches (slices: at most one per GPU, one more, and on a MIG node the counter probe's
/// dry run). No claim is read (none is prepared).
fn assert_start(t: &Tally, slices: usize, what: &str) {
    assert!(t.get("get nodes") <= 3, "{what}: {}", t.line());
    assert!(t.get("list resourceslices") <= 2, "{what}: {}", t.line());
    assert!(t.get("list pods") <= 1, "{what}: {}", t.line());
    assert!(
        t.get("create resourceslices") <= slices,
        "{what}: {}",
        t.line()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nodes_cost_is_its_own_and_does_not_grow_with_the_cluster() {
    let bin = std::path::PathBuf::from(env!("CARGO_BIN_EXE_cleave-kubelet-plugin"));
    let mut w = World::new(&bin, 1);
    for kind in [Kind::Whole, Kind::Whole, Kind::Mig] {
        w.add_node(kind);
    }
    let mut starts = Vec::new();
    for i in 0..w.nodes.len() {
        let mark = w.standin.requests().len();
        w.start(i);
        starts.push(Tally::of(&w.of_node(mark, i)));
    }
    for (i, t) in starts.iter().enumerate() {
        assert_start(t, 10, &format!("start of node {i}"));
        assert_eq!(
            t.reads("resourceclaims"),
            0,
            "start of node {i}: {}",
            t.line()
        );
    }

    // Per claim, whole and MIG: one claim GET and one status PUT at prepare, one status
    // PUT at unprepare, nothing else (no LIST, no other node's object).
    for i in [0, 2] {
        let mut dra = cost_world::dra(&w.nodes[i]).await;
        let claim = w.new_claim(i);
        let mark = w.standin.requests().len();
        cost_world::prepare(&mut dra, &claim).await;
        w.wait_status(mark, &claim.name, true);
        let prep = Tally::of(&w.of_node(mark, i));
        let mark = w.standin.requests().len();
        cost_world::unprepare(&mut dra, &claim).await;
        w.wait_status(mark, &claim.name, false);
        let unprep = Tally::of(&w.of_node(mark, i));
        let what = format!("{:?} claim on node {i}", w.nodes[i].kind);
        assert_eq!(prep.get("get resourceclaims"), 1, "{what}: {}", prep.line());
        assert_eq!(
            prep.get("update resourceclaims"),
            1,
            "{what}: {}",
            prep.line()
        );
        assert_eq!(prep.total, 2, "{what} prepare: {}", prep.line());
        assert_eq!(
            unprep.get("update resourceclaims"),
            1,
            "{what}: {}",
            unprep.line()
        );
        assert_eq!(unprep.total, 1, "{what} unprepare: {}", unprep.line());
        assert_eq!(prep.scanned + unprep.scanned, 0, "{what}");
    }

    // A restart with a claim prepared: the start's requests plus one GET of that claim
    // (is it still there?), and no more.
    let mut dra = cost_world::dra(&w.nodes[1]).await;
    let claim = w.new_claim(1);
    let mark = w.standin.requests().len();
    cost_world::prepare(&mut dra, &claim).await;
    w.wait_status(mark, &claim.name, true);
    drop(dra);
    w.stop(1);
    let mark = w.standin.requests().len();
    w.start(1);
    let restart = Tally::of(&w.of_node(mark, 1));
    assert_start(&restart, 10, "restart of node 1");
    assert_eq!(restart.reads("resourceclaims"), 1, "{}", restart.line());

    // Everything the three nodes sent: the only requests that walk objects are LISTs at
    // start (no LIST per claim or at rest), each selecting its own node by field. As API
    // Priority and Fairness charges them, they still walk every slice and every pod of the
    // namespace: the one cost at start that grows with the cluster.
    let all = w.since(0);
    let walking: Vec<_> = all.iter().filter(|r| r.scanned > 0).collect();
    assert!(
        walking.iter().all(|r| r.verb == "list"
            && (r.resource == "resourceslices" || r.resource == "pods")
            && w.nodes
                .iter()
                .any(|n| r.query.contains(&format!("spec.nodeName%3D{}", n.name)))),
        "{walking:?}"
    );
    // 4 starts: at most 2 slice LISTs and 1 pod LIST each.
    assert!(
        all.iter().filter(|r| r.verb == "list").count() <= 12,
        "{all:?}"
    );
}
