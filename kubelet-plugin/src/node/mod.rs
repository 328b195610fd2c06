//! State local to this node: the node lock every batch holds, the instance lock and
//! `checkpoint reset`, device health, per-claim usage sampling and its commands, and the
//! CDI hook binary installed on the host.

pub(crate) mod cdi_hook;
pub(crate) mod device_health;
pub(crate) mod lifecycle;
pub(crate) mod node_lock;
pub(crate) mod usage;
