//! `hookctl`: the local runner and the operator's commands, as a library so tests can spawn the
//! runner in-process and call the commands directly.

pub mod backend;
pub mod captured;
pub mod commands;
pub mod console;
pub mod db_proxy;
pub mod drill;
pub mod partner_tls;
pub mod render;
pub mod serve;
pub mod verify;
