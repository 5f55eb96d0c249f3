//! Rules loading: configs the reference accepts load unchanged; bad configs
//! fail with file, line and what is wrong; directories, dot entries, symlink
//! swaps and domain merging.

use std::path::{Path, PathBuf};

use leasehold::limit::{Algorithm, Unit};
use leasehold::rules::{fingerprint, load_paths, LoadOptions, RuleErrors, RuleSet};

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    if let Some(parent) = p.parent() {
        std::fs::create_dir_all(parent).expect("mkdir");
    }
    std::fs::write(&p, text).expect("write");
    p
}

fn load_one(text: &str) -> Result<RuleSet, RuleErrors> {
    let dir = tempfile::tempdir().expect("tempdir");
    let p = write(dir.path(), "rules.yaml", text);
    load_paths(&[p], LoadOptions::default())
}

fn errors(text: &str) -> Vec<(usize, String)> {
    match load_one(text) {
        Ok(_) => panic!("expected errors for:\n{text}"),
        Err(e) => e.0.into_iter().map(|e| (e.line, e.message)).collect(),
    }
}

/// The reference's README examples, verbatim in shape.
const REFERENCE_EXAMPLE: &str = r#"
domain: mongo_cps
descriptors:
  - key: database
    value: users
    rate_limit:
      unit: second
      requests_per_unit: 500

  - key: database
    value: default
    rate_limit:
      unit: second
      requests_per_unit: 500
---
"#;

#[test]
fn reference_configs_load_unchanged() {
    let set = load_one(REFERENCE_EXAMPLE).expect("loads");
    assert_eq!(set.domains["mongo_cps"].rules.len(), 2);

    let full = r#"
domain: edge_proxy_per_ip
descriptors:
  - key: remote_address
    rate_limit:
      unit: Second
      requests_per_unit: 10
    detailed_metric: true
  - key: remote_address
    value: 50.0.0.5
    rate_limit:
      unlimited: true
  - key: to_message_type
    value: "*_cmd"
    shadow_mode: true
    quota_mode: true
    value_to_metric: true
    metadata:
      team: payments
      tier: [gold, silver]
    rate_limit:
      unit: WEEK
      requests_per_unit: 7
      name: weekly
      replaces:
        - name: daily
  - key: files
    value: files/*
    share_threshold: true
    rate_limit:
      unit: year
      requests_per_unit: 100
  - key: key2
    descriptors:
      - key: subkey
        value: "123"
        rate_limit:
          requests_per_unit: 300
          unit: month
"#;
    let set = load_one(full).expect("loads");
    let d = &set.domains["edge_proxy_per_ip"];
    let keys: Vec<_> = d.rules.iter().map(|r| r.full_key.as_str()).collect();
    assert_eq!(
        keys,
        [
            "edge_proxy_per_ip.remote_address",
            "edge_proxy_per_ip.remote_address_50.0.0.5",
            "edge_proxy_per_ip.to_message_type_*_cmd",
            "edge_proxy_per_ip.files_files/*",
            "edge_proxy_per_ip.key2.subkey_123",
        ]
    );
    assert_eq!(d.rules[0].spec.unit, Unit::Second);
    assert!(d.rules[0].detailed_metric);
    assert!(d.rules[1].unlimited);
    let weekly = &d.rules[2];
    assert!(weekly.shadow_mode && weekly.quota_mode && weekly.value_to_metric);
    assert_eq!(
        (weekly.spec.unit, weekly.name.as_deref()),
        (Unit::Week, Some("weekly"))
    );
    assert_eq!(weekly.replaces, ["daily"]);
    assert_eq!(weekly.metadata["tier"][1], "silver");
    assert_eq!(d.rules[4].spec.requests_per_unit, 300);
    assert_eq!(d.rules[4].line, 37, "the line of its rate_limit key");
    // The matcher walks the same tree.
    let m = d.find([("key2", "any"), ("subkey", "123")]).expect("match");
    assert_eq!(m.rule.spec.unit, Unit::Month);
    let m = d.find([("files", "files/x")]).expect("match");
    assert_eq!(&*m.shared[0].1, "files/*");
}

#[test]
fn extensions_parse() {
    let set = load_one(
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 10, algorithm: token_bucket, burst: 25}\n  - key: s\n    rate_limit: {unit: hour, requests_per_unit: 3, algorithm: SLIDING_LOG}\n",
    )
    .expect("loads");
    let r = &set.domains["d"].rules;
    assert_eq!(
        (r[0].spec.algorithm, r[0].spec.burst),
        (Algorithm::TokenBucket, 25)
    );
    assert_eq!(
        (r[1].spec.algorithm, r[1].spec.burst),
        (Algorithm::SlidingLog, 3)
    );
}

#[test]
fn errors_name_line_and_problem() {
    let cases: &[(&str, usize, &str)] = &[
        ("descriptors: []\n", 1, "empty domain"),
        ("domain: \"\"\n", 1, "empty domain"),
        ("domain: d\ndescriptors:\n  - value: v\n", 3, "empty key"),
        ("domain: d\ndescriptors:\n  - key: \"\"\n", 3, "empty key"),
        (
            "domain: d\ndescriptors:\n  - key: k\n    value: v\n  - key: k\n    value: v\n",
            5,
            "duplicate descriptor composite key 'd.k_v'",
        ),
        ("domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: fortnight\n      requests_per_unit: 1\n", 5, "invalid rate limit unit 'fortnight'"),
        ("domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      requests_per_unit: 1\n", 4, "unit is required"),
        ("domain: d\ndescriptors:\n  - key: k\n    rate_limt:\n      unit: second\n", 4, "unknown key 'rate_limt'"),
        ("domain: d\nextra: 1\n", 2, "unknown key 'extra'"),
        ("domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: second\n      unlimited: true\n", 5, "should not specify rate limit unit when unlimited"),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: second\n      requests_per_unit: 1\n      name: a\n      replaces: [{name: a}]\n",
            8,
            "own name 'a'",
        ),
        ("domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: second\n      replaces: [{name: \"\"}]\n", 6, "replaces name cannot be empty"),
        ("domain: d\ndescriptors:\n  - key: k\n    value: v\n    share_threshold: true\n", 5, "share_threshold"),
        ("domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: second\n      requests_per_unit: -1\n", 6, "requests_per_unit"),
        ("domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: second\n      algorithm: leaky\n", 6, "invalid algorithm 'leaky'"),
        ("domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: second\n      burst: 5\n", 6, "burst is only valid with algorithm token_bucket"),
        ("domain: d\ndescriptors:\n  - just a string\n", 3, "a descriptor must be a map"),
        ("domain: d\ndescriptors: [a\n", 3, "invalid YAML"),
        ("- a\n- b\n", 1, "top level must be a map"),
        ("domain: d\ndescriptors:\n  - key: k\n    shadow_mode: maybe\n", 4, "'shadow_mode' must be true or false"),
    ];
    for (text, line, needle) in cases {
        let errs = errors(text);
        assert!(
            errs.iter().any(|(l, m)| l == line && m.contains(needle)),
            "want line {line} containing {needle:?}, got {errs:?} for:\n{text}"
        );
    }
}

#[test]
fn error_display_names_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let p = write(
        dir.path(),
        "bad.yaml",
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: eon}\n",
    );
    let e = load_paths(std::slice::from_ref(&p), LoadOptions::default()).expect_err("bad");
    let text = e.to_string();
    assert!(text.starts_with(&format!("{}:4: ", p.display())), "{text}");
}

#[test]
fn misplaced_known_keys_are_ignored_like_the_reference() {
    // The reference validates against one flat list of keys, so `unit` at
    // descriptor level loads there (and is ignored). Accept it too.
    let set = load_one("domain: d\ndescriptors:\n  - key: k\n    unit: second\n").expect("loads");
    assert!(set.domains["d"].rules.is_empty());
}

#[test]
fn directories_skip_dot_entries_and_merge_when_asked() {
    let dir = tempfile::tempdir().expect("tempdir");
    write(dir.path(), "a.yaml", "domain: one\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1}\n");
    write(dir.path(), "sub/b.yaml", "domain: two\ndescriptors:\n  - key: b\n    rate_limit: {unit: second, requests_per_unit: 2}\n");
    write(dir.path(), ".hidden/c.yaml", "not: valid: yaml: [");
    write(dir.path(), ".dotfile.yaml", "garbage: [");
    let set = load_paths(&[dir.path().to_path_buf()], LoadOptions::default()).expect("loads");
    let mut names: Vec<_> = set.domains.keys().cloned().collect();
    names.sort();
    assert_eq!(names, ["one", "two"]);

    write(dir.path(), "sub/c.yaml", "domain: one\ndescriptors:\n  - key: c\n    rate_limit: {unit: second, requests_per_unit: 3}\n");
    let e = load_paths(&[dir.path().to_path_buf()], LoadOptions::default())
        .expect_err("duplicate domain");
    assert!(e.to_string().contains("duplicate domain 'one'"), "{e}");
    let merged = load_paths(
        &[dir.path().to_path_buf()],
        LoadOptions {
            merge_domains: true,
        },
    )
    .expect("merges");
    assert_eq!(merged.domains["one"].rules.len(), 2);
    // Merging still rejects a duplicate composite key.
    write(dir.path(), "sub/d.yaml", "domain: one\ndescriptors:\n  - key: c\n    rate_limit: {unit: second, requests_per_unit: 3}\n");
    let e = load_paths(
        &[dir.path().to_path_buf()],
        LoadOptions {
            merge_domains: true,
        },
    )
    .expect_err("dup key");
    assert!(
        e.to_string()
            .contains("duplicate descriptor composite key 'one.c'"),
        "{e}"
    );
}

#[test]
fn configmap_symlink_swap_is_followed() {
    // Kubernetes layout: ..2024_a/rules.yaml, ..data -> ..2024_a, rules.yaml -> ..data/rules.yaml
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path();
    write(root, "..v1/rules.yaml", "domain: v1\ndescriptors: []\n");
    write(root, "..v2/rules.yaml", "domain: v2\ndescriptors: []\n");
    std::os::unix::fs::symlink("..v1", root.join("..data")).expect("symlink");
    std::os::unix::fs::symlink("..data/rules.yaml", root.join("rules.yaml")).expect("symlink");
    let paths = [root.to_path_buf()];
    let set = load_paths(&paths, LoadOptions::default()).expect("loads");
    assert!(set.domains.contains_key("v1") && set.domains.len() == 1);
    let before = fingerprint(&paths);
    assert_eq!(before, set.hash);
    // Atomic swap of ..data.
    std::os::unix::fs::symlink("..v2", root.join("..data_tmp")).expect("symlink");
    std::fs::rename(root.join("..data_tmp"), root.join("..data")).expect("rename");
    assert_ne!(fingerprint(&paths), before);
    let set = load_paths(&paths, LoadOptions::default()).expect("loads");
    assert!(set.domains.contains_key("v2") && set.domains.len() == 1);
}

#[test]
fn missing_path_is_an_error() {
    let e = load_paths(
        &[PathBuf::from("/nonexistent/leasehold-rules")],
        LoadOptions::default(),
    )
    .expect_err("missing");
    assert!(e.to_string().contains("cannot read rules path"), "{e}");
}
