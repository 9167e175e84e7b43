#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| robota_fuzz::bearer(data));
