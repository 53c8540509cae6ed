//! Integration tests, compiled as one binary. GPU tests call `gpu!()` first: without a
//! driver they print `skipped: no CUDA driver` and return, unless `REQUIRE_GPU=1`.

#[macro_use]
mod support;

mod allocators;
mod arena;
mod conformance;
mod counting;
mod device;
mod device_arena;
mod device_conformance;
mod device_multi;
mod device_race;
mod device_stats;
mod gpu;
mod pool;
