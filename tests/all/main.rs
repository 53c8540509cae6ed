//! Integration tests, compiled as one binary. GPU tests call `gpu!()` first: without a
//! driver they print `skipped: no CUDA driver` and return, unless `REQUIRE_GPU=1`.

#[macro_use]
mod support;

mod allocators;
mod arena;
mod conformance;
mod counting;
#[cfg(feature = "debug-checks")]
mod debug_checks;
mod device;
mod faults;
mod gpu;
mod matrix;
mod pool;
mod props;
