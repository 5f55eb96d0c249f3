//! The engine behaviour suite: the same decisions, written once against the
//! `Engine` trait ([`suite`]), on the in-memory engine ([`memory`], with the
//! clock-controlled cases only it can inject) and on the Redis engine
//! against a real redis-server ([`redis`]; nextest runs those one at a time).

#[path = "../common/mod.rs"]
mod common;
#[macro_use]
mod suite;
mod memory;
mod redis;
