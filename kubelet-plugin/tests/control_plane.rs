//! What a node costs the API server, counted with three plugin processes (two whole-GPU
//! nodes, one on-demand MIG node) against one stand-in: at start, per claim at prepare and
//! unprepare, and at restart; that the only requests walking objects are each watch's
//! initial list at start, selected by `spec.nodeName` (served from the API server's field
//! index, so they walk only the node's own objects: the last node started walks no more than
//! the first); and that no request is charged more than API Priority and Fairness's maximum
//! of 10 seats. `benches/control_plane.rs` prints the same figures for tens of nodes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod cost_world;

use cost_world::{Kind, Tally, World};

/// Per start, as measured: one Node GET (read once, for the publisher, the daemon pods'
/// owner, the coexistence check and Events), the initial LIST of each watch (slices of this
/// node, of every driver: the coexistence check reads other drivers' there; daemon pods with
/// the pod launcher), the slice creates (at most one per GPU, one more, and on a MIG node
/// the counter probe's dry run), the watches. No claim is read (none is prepared).
fn assert_start(t: &Tally, slices: usize, what: &str) {
    assert_eq!(t.get("get nodes"), 1, "{what}: {}", t.line());
    assert_eq!(t.get("list resourceslices"), 1, "{what}: {}", t.line());
    assert_eq!(t.get("list pods"), 1, "{what}: {}", t.line());
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
    // A start walks its own node's objects only (none of its slices exist yet; its plugin
    // pod): the third node started walks as many as the first.
    assert_eq!(
        starts[2].scanned,
        starts[0].scanned,
        "{}\n{}",
        starts[0].line(),
        starts[2].line()
    );
    assert_eq!(starts[0].scanned, 1, "{}", starts[0].line());
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
    // start (no LIST per claim or at rest), each selecting its own node by field, and none
    // is charged more than APF's maximum of 10 seats.
    let all = w.since(0);
    assert!(all.iter().all(|r| r.seats <= 10), "{all:?}");
    let walking: Vec<_> = all.iter().filter(|r| r.scanned > 0).collect();
    assert!(
        walking.iter().all(|r| r.verb == "list"
            && (r.resource == "resourceslices" || r.resource == "pods")
            && w.nodes
                .iter()
                .any(|n| r.query.contains(&format!("spec.nodeName%3D{}", n.name)))),
        "{walking:?}"
    );
    // 4 starts: 1 slice LIST and 1 pod LIST each.
    assert_eq!(
        all.iter().filter(|r| r.verb == "list").count(),
        8,
        "{all:?}"
    );
}
