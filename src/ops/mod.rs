//! Operations tooling, kept apart from the server: nothing on the serving
//! path imports it. Deploy templates and their renders ([`deploy`]), the
//! local runner of the four-replica topology ([`runner`]), paced load
//! through its front doors ([`load`]), the failover demo ([`demo`]), the
//! closed-loop benchmark ([`bench`]) and their clients ([`http_client`]).

pub mod bench;
pub mod demo;
pub mod deploy;
pub mod http_client;
pub mod load;
pub mod runner;
