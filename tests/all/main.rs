//! Integration tests, compiled as one binary. GPU tests call `gpu!()` first: without a
//! driver they print `skipped: no CUDA driver` and return, unless `REQUIRE_GPU=1`.

#[macro_use]
mod support;

mod allocators;
mod arena;
mod conformance;
mod counting;
mod cudarc;
mod defects;
mod device;
mod gpu;
mod pool;
