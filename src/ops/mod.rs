//! Operations tooling, kept apart from the server: nothing on the serving
//! path imports it. Deploy templates and their renders ([`deploy`]), the
//! local runner of the four-replica topology ([`runner`]), paced load
//! through its front doors ([`load`]), the failover demo ([`demo`]), the
//! closed-loop benchmark ([`bench`]), their clients ([`http_client`]) and the
//! child processes they own by pid ([`process`]), which the test suites use
//! too.

pub mod bench;
pub mod demo;
pub mod deploy;
pub mod http_client;
pub mod load;
pub mod process;
pub mod runner;
