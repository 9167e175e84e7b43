//! End-to-end tests of one area, in one test binary (one link instead of one per file).

mod audit;
mod check_config;
mod concurrency;
mod control;
mod docs;
mod lifecycle;
mod packaging_start;
mod reload;
mod state_disk;
