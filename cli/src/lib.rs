//! `hookctl`: the local runner and the operator's commands, as a library so tests can spawn the
//! runner in-process and call the commands directly.

pub mod captured;
pub mod serve;
pub mod verify;
