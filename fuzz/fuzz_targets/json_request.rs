//! `POST /json`'s decoder and request validation on arbitrary bytes: a
//! request or a message, never a panic; a valid request's values survive.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(proto) = leasehold::rls::json::parse_request(data) else {
        return;
    };
    let entries: usize = proto.descriptors.iter().map(|d| d.entries.len()).sum();
    match leasehold::rls::to_domain(proto, &leasehold::rls::Bounds::default()) {
        Ok(req) => {
            let kept: usize = req.descriptors.iter().map(|d| d.entries.len()).sum();
            assert_eq!(kept, entries);
            assert!(!req.domain.is_empty());
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }
});
