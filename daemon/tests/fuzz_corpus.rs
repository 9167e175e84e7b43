//! The committed fuzz corpus (`fuzz/corpus/<target>/`) replayed through the fuzz targets'
//! own checks (`fuzz/src/lib.rs`) on the stable toolchain, as part of the main build. The
//! fuzz crate stays its own workspace for cargo-fuzz (docs/fuzzing.md); building it only
//! to replay the corpus would compile the daemon and its dependencies a second time.

#[path = "../../fuzz/src/lib.rs"]
mod checks;
