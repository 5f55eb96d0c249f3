//! The planning rules, without an engine: default hits, overrides,
//! `replaces`, unlimited rules, shadow and quota roles, shared wildcards.

use super::*;
use crate::limit::{Algorithm, Unit};
use crate::rules::{load_paths, LoadOptions, RuleSet};

const RULES: &str = r#"
domain: d
descriptors:
  - key: plain
    rate_limit: { unit: minute, requests_per_unit: 5 }
  - key: named_a
    rate_limit: { unit: minute, requests_per_unit: 1, name: a }
  - key: named_b
    detailed_metric: true
    rate_limit:
      unit: hour
      requests_per_unit: 100
      name: b
      replaces: [ { name: a } ]
  - key: unl
    rate_limit: { unlimited: true }
  - key: shadow
    shadow_mode: true
    rate_limit: { unit: minute, requests_per_unit: 1 }
  - key: quota
    quota_mode: true
    rate_limit: { unit: minute, requests_per_unit: 1 }
  - key: shared
    value: files/*
    share_threshold: true
    rate_limit: { unit: second, requests_per_unit: 2 }
"#;

fn rules() -> RuleSet {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("d.yaml");
    std::fs::write(&file, RULES).expect("write rules");
    load_paths(&[file], LoadOptions::default()).expect("rules load")
}

fn d(key: &str, value: &str) -> Descriptor {
    Descriptor {
        entries: vec![(key.into(), value.into())],
        ..Default::default()
    }
}

fn plan_of(descriptors: Vec<Descriptor>, hits_addend: u32, settings: &DecisionSettings) -> Planned {
    let set = rules();
    let req = Request {
        domain: "d".into(),
        descriptors,
        hits_addend,
    };
    let domain = set.domain("d").expect("domain d");
    plan(&req, domain, settings)
}

fn roles(p: &Planned) -> Vec<Role> {
    p.batch.charges.iter().map(|c| c.role).collect()
}

#[test]
fn hits_default_to_one_and_a_descriptor_value_wins_over_the_request() {
    let s = DecisionSettings::default();
    let p = plan_of(vec![d("plain", "x")], 0, &s);
    assert_eq!(p.batch.charges[0].hits, 1, "request hits 0 means 1");
    let p = plan_of(vec![d("plain", "x")], 7, &s);
    assert_eq!(p.batch.charges[0].hits, 7);
    let check = Descriptor {
        hits: Some(0),
        ..d("plain", "x")
    };
    let p = plan_of(vec![check], 7, &s);
    assert_eq!(p.batch.charges[0].hits, 0, "descriptor hits 0 is a check");
}

#[test]
fn a_request_override_is_a_fixed_window_keyed_by_the_request_values() {
    let over = Descriptor {
        limit_override: Some((9, Unit::Hour)),
        refund: true,
        ..d("shadow", "v")
    };
    let p = plan_of(vec![over], 0, &DecisionSettings::default());
    let c = &p.batch.charges[0];
    assert_eq!(c.spec, LimitSpec::fixed(9, Unit::Hour));
    assert_eq!(c.spec.algorithm, Algorithm::FixedWindow);
    // The matching shadow rule is not consulted: the override is enforced.
    assert_eq!(c.role, Role::Enforce);
    assert!(c.refund);
    assert_eq!(c.key, CounterKey::new("d", [("shadow", "v")], &c.spec));
    assert_eq!(
        p.plans[0],
        Plan::Limited {
            charge: 0,
            info: CurrentLimit {
                requests_per_unit: 9,
                unit: Unit::Hour,
                name: String::new()
            },
            shadow: false,
            quota: false,
            detailed: false,
        }
    );
}

#[test]
fn replaced_unlimited_and_unmatched_descriptors_charge_nothing() {
    let p = plan_of(
        vec![
            d("named_a", "1"),
            d("nothing", "1"),
            d("unl", "1"),
            d("named_b", "1"),
        ],
        0,
        &DecisionSettings::default(),
    );
    assert_eq!(p.plans[0], Plan::None, "a is replaced by b");
    assert_eq!(p.plans[1], Plan::None);
    assert_eq!(p.plans[2], Plan::Unlimited);
    assert_eq!(p.batch.charges.len(), 1, "only b charges");
    let Plan::Limited {
        charge,
        info,
        detailed,
        ..
    } = &p.plans[3]
    else {
        panic!("b is limited: {:?}", p.plans[3]);
    };
    assert_eq!((*charge, info.name.as_str(), *detailed), (0, "b", true));
    assert_eq!(p.batch.charges[0].spec.unit, Unit::Hour);
    // Without b in the request, a applies.
    let p = plan_of(vec![d("named_a", "1")], 0, &DecisionSettings::default());
    assert_eq!(p.batch.charges.len(), 1);
}

#[test]
fn roles_follow_rule_modes_and_the_global_settings() {
    let descriptors = || vec![d("plain", "1"), d("shadow", "1"), d("quota", "1")];
    let p = plan_of(descriptors(), 0, &DecisionSettings::default());
    assert_eq!(roles(&p), [Role::Enforce, Role::Shadow, Role::Quota]);
    assert!(!p.batch.never_deny);

    let global = DecisionSettings {
        global_quota_mode: true,
        global_shadow_mode: true,
        ..DecisionSettings::default()
    };
    let p = plan_of(descriptors(), 0, &global);
    // A shadow rule stays shadow; everything else becomes quota.
    assert_eq!(roles(&p), [Role::Quota, Role::Shadow, Role::Quota]);
    assert!(p.batch.never_deny, "global shadow mode never denies");
    let quota_override = Descriptor {
        limit_override: Some((1, Unit::Second)),
        ..d("x", "1")
    };
    let p = plan_of(vec![quota_override], 0, &global);
    assert_eq!(roles(&p), [Role::Quota]);
}

#[test]
fn a_shared_wildcard_keys_every_matching_value_by_its_pattern() {
    let s = DecisionSettings::default();
    let one = plan_of(vec![d("shared", "files/a")], 0, &s);
    let two = plan_of(vec![d("shared", "files/b")], 0, &s);
    assert_eq!(one.batch.charges[0].key, two.batch.charges[0].key);
    let spec = one.batch.charges[0].spec;
    assert_eq!(
        one.batch.charges[0].key,
        CounterKey::new("d", [("shared", "files/*")], &spec)
    );
    let plain_a = plan_of(vec![d("plain", "a")], 0, &s);
    let plain_b = plan_of(vec![d("plain", "b")], 0, &s);
    assert_ne!(plain_a.batch.charges[0].key, plain_b.batch.charges[0].key);
}

#[test]
fn charge_indexes_line_up_with_limited_descriptors_only() {
    let p = plan_of(
        vec![
            d("unl", "1"),
            d("plain", "1"),
            d("nothing", "1"),
            d("quota", "1"),
        ],
        0,
        &DecisionSettings::default(),
    );
    let charges: Vec<usize> = p
        .plans
        .iter()
        .filter_map(|pl| match pl {
            Plan::Limited { charge, .. } => Some(*charge),
            _ => None,
        })
        .collect();
    assert_eq!(charges, [0, 1]);
    assert_eq!(p.batch.charges[1].role, Role::Quota);
}
