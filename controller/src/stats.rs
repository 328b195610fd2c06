//! Counting API requests by verb and result, for metrics (the plugin wires a callback to
//! Prometheus) and for tests and benchmarks ([`ApiStats`]).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// Called once per API request the publisher makes: `(verb, result)`.
/// Verbs: `get_version`, `get_node`, `get`, `list`, `watch`, `create`, `update`,
/// `delete`. Results: `ok`, `conflict`, `not_found`, `error`.
/// `list`/`watch` are counted per watcher (re)start and watcher error, since the
/// watcher issues them itself.
pub type ApiObserver = Arc<dyn Fn(&'static str, &'static str) + Send + Sync>;

/// A ready-made observer target that just counts.
#[derive(Debug, Default)]
pub struct ApiStats {
    counts: Mutex<BTreeMap<(&'static str, &'static str), u64>>,
}

impl ApiStats {
    /// A new, shared counter set.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// An observer feeding these counters.
    pub fn observer(self: &Arc<Self>) -> ApiObserver {
        let me = Arc::clone(self);
        Arc::new(move |verb, result| me.record(verb, result))
    }

    /// Counts one request.
    pub fn record(&self, verb: &'static str, result: &'static str) {
        if let Ok(mut m) = self.counts.lock() {
            *m.entry((verb, result)).or_default() += 1;
        }
    }

    /// Requests with this verb and result.
    pub fn get(&self, verb: &str, result: &str) -> u64 {
        self.counts
            .lock()
            .map(|m| {
                m.iter()
                    .filter(|((v, r), _)| *v == verb && *r == result)
                    .map(|(_, n)| n)
                    .sum()
            })
            .unwrap_or(0)
    }

    /// Requests with this verb, any result.
    pub fn verb(&self, verb: &str) -> u64 {
        self.counts
            .lock()
            .map(|m| {
                m.iter()
                    .filter(|((v, _), _)| *v == verb)
                    .map(|(_, n)| n)
                    .sum()
            })
            .unwrap_or(0)
    }

    /// Write requests (create, update, delete), any result.
    pub fn writes(&self) -> u64 {
        self.verb("create") + self.verb("update") + self.verb("delete")
    }

    /// All counters.
    pub fn snapshot(&self) -> BTreeMap<(&'static str, &'static str), u64> {
        self.counts.lock().map(|m| m.clone()).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_by_verb_and_result() {
        let s = ApiStats::new();
        let o = s.observer();
        o("create", "ok");
        o("create", "ok");
        o("update", "conflict");
        assert_eq!(s.get("create", "ok"), 2);
        assert_eq!(s.verb("update"), 1);
        assert_eq!(s.writes(), 3);
        assert_eq!(s.snapshot().len(), 2);
    }
}
