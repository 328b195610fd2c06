//! State local to this node: the node lock every batch holds, the instance lock and
//! `checkpoint reset`, device health, per-claim usage sampling and its commands, and the
//! CDI hook binary installed on the host.

pub mod cdi_hook;
pub mod health;
pub mod lifecycle;
pub mod node_lock;
pub mod usage;
