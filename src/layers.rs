//! The crate map of `lib.rs` as a test: every `crate::` path in a module
//! names a lower layer, only `redis/` names fred, and only the transports,
//! the composition root, the command line and the ops tooling (plus the
//! generated protos and the OTLP exporter) name tonic.

use std::path::Path;

/// Layer of each top-level module; a module may only name lower layers.
const LAYERS: &[(&str, u8)] = &[
    ("limit", 0),
    ("clock", 0),
    ("tasks", 0),
    ("proto", 0),
    ("telemetry", 0),
    ("key", 1),
    ("domain", 2),
    ("redact", 2),
    ("rules", 3),
    ("redis", 3),
    ("engine", 4),
    ("metrics", 5),
    ("decision", 6),
    ("rls", 7),
    ("grpc", 8),
    ("http", 8),
    ("settings", 9),
    ("app", 10),
    ("ops", 10),
    ("cli", 11),
];

const TONIC_ALLOWED: &[&str] = &["grpc", "app", "cli", "ops", "proto", "telemetry"];

/// Items `lib.rs` re-exports at the root, and the module each comes from.
const ROOT_EXPORTS: &[(&str, &str)] = &[("REPLICA_HEADER", "grpc")];

fn layer(name: &str) -> Option<u8> {
    let name = ROOT_EXPORTS
        .iter()
        .find(|(item, _)| *item == name)
        .map_or(name, |(_, module)| module);
    LAYERS.iter().find(|(n, _)| *n == name).map(|(_, l)| *l)
}

/// (top-level module, code with comment lines removed) for every source file.
fn sources() -> Vec<(String, String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut out = Vec::new();
    let mut stack = vec![root.clone()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(&root).unwrap_or(&path);
            let top = rel
                .components()
                .next()
                .map(|c| {
                    c.as_os_str()
                        .to_string_lossy()
                        .trim_end_matches(".rs")
                        .to_string()
                })
                .unwrap_or_default();
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            let code: String = text
                .lines()
                .filter(|l| !l.trim_start().starts_with("//"))
                .collect::<Vec<_>>()
                .join("\n");
            out.push((top, rel.display().to_string(), code));
        }
    }
    out
}

#[test]
fn imports_point_down_the_crate_map() {
    let mut wrong = Vec::new();
    let files = sources();
    assert!(files.len() > 50, "found only {} source files", files.len());
    for (top, file, code) in &files {
        if top == "lib" || top == "main" || top == "layers" {
            continue;
        }
        let Some(own) = layer(top) else {
            wrong.push(format!("{file}: module `{top}` is not in LAYERS"));
            continue;
        };
        for part in code.split("crate::").skip(1) {
            let name: String = part
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if name == *top || name.is_empty() {
                continue;
            }
            match layer(&name) {
                Some(l) if l < own => {}
                _ => wrong.push(format!("{file}: `{top}` names `crate::{name}`")),
            }
        }
        let tonic = code.contains("tonic::") || code.contains("tonic_");
        if tonic && !TONIC_ALLOWED.contains(&top.as_str()) {
            wrong.push(format!("{file}: names tonic"));
        }
        if code.contains("fred::") && top != "redis" {
            wrong.push(format!("{file}: names fred"));
        }
    }
    assert!(wrong.is_empty(), "layering broken:\n{}", wrong.join("\n"));
}
