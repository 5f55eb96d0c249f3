//! The rules loader on arbitrary text: an error naming a line, or rules
//! whose every domain can be asked about, never a panic or a hang.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let opts = leasehold::rules::LoadOptions::default();
    match leasehold::rules::load_text(Path::new("fuzz.yaml"), text, opts) {
        Ok(set) => {
            for name in set.domains.keys() {
                assert!(set.domain(name).is_some());
            }
        }
        Err(errors) => assert!(!errors.to_string().is_empty()),
    }
});
