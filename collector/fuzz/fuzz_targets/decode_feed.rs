//! Arbitrary bytes into the feed page decoder: an error, never a panic; what decodes
//! re-encodes to the same page.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(page) = kvroute::feed::Page::decode(data) {
        let again = kvroute::feed::Page::decode(&page.to_bytes()).expect("re-encoded page decodes");
        assert_eq!(page, again);
    }
});
