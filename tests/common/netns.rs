//! A network namespace of the test's own, joined to the host by a veth
//! pair, for faults the kernel makes: iptables DROP rules inside it black-
//! hole every packet to and from a port while connections stay open and TCP
//! keeps retransmitting. Only the namespace's own address is ever reached.
//! Each namespace is named after the test process; ones left by a killed
//! run are swept at the start, and `Drop` removes this one (the veth pair
//! and the rules go with it).
#![allow(dead_code)]

use std::process::Command;

use super::require;

const PREFIX: &str = "lhtest-";

pub struct Netns {
    pub name: String,
    /// The namespace's end of the veth pair.
    pub addr: String,
    host_if: String,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new(require("ip"))
        .args(args)
        .output()
        .map_err(|e| format!("ip {args:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {args:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Removes namespaces of earlier test runs whose process is gone.
fn sweep_stale() {
    let Ok(out) = Command::new(require("ip")).args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(rest) = name.strip_prefix(PREFIX) else {
            continue;
        };
        let pid = rest.split('-').next().unwrap_or("");
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = ip(&["netns", "del", name]);
        }
    }
}

impl Netns {
    /// A fresh namespace with its loopback up and a veth pair to the host
    /// (a /30 picked from the test's pid). Panics with the reason when the
    /// machine cannot make one (root and iproute2 are needed).
    pub fn create(tag: &str) -> Netns {
        sweep_stale();
        let pid = std::process::id();
        let name = format!("{PREFIX}{pid}-{tag}");
        let host_if = format!("lhh{}", pid % 1_000_000);
        let ns_if = format!("lhn{}", pid % 1_000_000);
        let net = format!("10.213.{}", pid % 250);
        let host_addr = format!("{net}.1/30");
        let addr = format!("{net}.2");
        let ns = Netns {
            name: name.clone(),
            addr: addr.clone(),
            host_if: host_if.clone(),
        };
        let steps: Vec<Vec<String>> = vec![
            vec!["netns".into(), "add".into(), name.clone()],
            vec![
                "-n".into(),
                name.clone(),
                "link".into(),
                "set".into(),
                "lo".into(),
                "up".into(),
            ],
            vec![
                "link".into(),
                "add".into(),
                host_if.clone(),
                "type".into(),
                "veth".into(),
                "peer".into(),
                "name".into(),
                ns_if.clone(),
                "netns".into(),
                name.clone(),
            ],
            vec![
                "addr".into(),
                "add".into(),
                host_addr,
                "dev".into(),
                host_if.clone(),
            ],
            vec!["link".into(), "set".into(), host_if.clone(), "up".into()],
            vec![
                "-n".into(),
                name.clone(),
                "addr".into(),
                "add".into(),
                format!("{addr}/30"),
                "dev".into(),
                ns_if.clone(),
            ],
            vec![
                "-n".into(),
                name.clone(),
                "link".into(),
                "set".into(),
                ns_if,
                "up".into(),
            ],
        ];
        for step in steps {
            let args: Vec<&str> = step.iter().map(String::as_str).collect();
            if let Err(e) = ip(&args) {
                panic!("cannot create the test's network namespace (needs root and iproute2): {e}");
            }
        }
        ns
    }

    /// A command that runs `program` inside the namespace.
    pub fn command(&self, program: &std::path::Path) -> Command {
        let mut cmd = Command::new(require("ip"));
        cmd.args(["netns", "exec", &self.name]).arg(program);
        cmd
    }

    fn iptables(&self, args: &[&str]) {
        let out = Command::new(require("ip"))
            .args(["netns", "exec", &self.name])
            .arg(require("iptables"))
            .args(args)
            .output()
            .expect("run iptables");
        assert!(
            out.status.success(),
            "iptables {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Drops every TCP packet to and from `port` inside the namespace:
    /// connections stay open, nothing gets through, TCP retransmits.
    pub fn blackhole(&self, port: u16) {
        let p = port.to_string();
        self.iptables(&["-A", "INPUT", "-p", "tcp", "--dport", &p, "-j", "DROP"]);
        self.iptables(&["-A", "OUTPUT", "-p", "tcp", "--sport", &p, "-j", "DROP"]);
    }

    /// Removes every rule: packets flow again.
    pub fn heal(&self) {
        self.iptables(&["-F", "INPUT"]);
        self.iptables(&["-F", "OUTPUT"]);
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = ip(&["link", "del", &self.host_if]);
        let _ = ip(&["netns", "del", &self.name]);
    }
}
