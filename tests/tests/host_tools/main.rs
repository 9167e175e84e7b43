//! End-to-end tests of one area, in one test binary (one link instead of one per file).

mod docker;
mod files;
mod grants;
mod jobs;
mod services;
mod turns;
mod upstreams;
