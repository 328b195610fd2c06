//! cleave-api: what users write and what every part of cleave agrees on.
//!
//! - [`names`]: driver, attribute, capacity, class and CDI names; the device-name grammar.
//! - [`pool`]: the plain-data pool handed from the node side to the slice publisher.

pub mod limits;
pub mod names;
pub mod pool;

pub use names::DeviceName;
