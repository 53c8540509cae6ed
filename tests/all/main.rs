//! Integration tests, compiled as one binary. GPU tests call `gpu!()` first: without a
//! driver they print `skipped: no CUDA driver` and return, unless `REQUIRE_GPU=1`.

#[macro_use]
mod support;

// The examples' shared code (the A/B report, the staging pipeline), tested here.
#[path = "../../examples/common/pipeline.rs"]
mod pipeline;
#[path = "../../examples/common/plot.rs"]
mod plot;
#[path = "../../examples/common/replay_report.rs"]
mod replay_report;
#[path = "../../examples/common/report.rs"]
mod report;
#[path = "../../examples/common/sections.rs"]
mod sections;

mod ab_report;
mod allocators;
mod arena;
mod audit_staging_arena;
mod backpressure;
mod conformance;
mod counting;
mod cudarc;
#[cfg(feature = "debug-checks")]
mod debug_checks;
mod defects;
mod defects_21;
mod device;
mod device_conformance;
mod device_pages;
mod device_policy;
mod device_stats;
mod faults;
mod gpu;
mod gpu_support;
mod kernels;
mod layers;
mod matrix;
mod model;
mod nvtx;
mod pool;
mod props;
mod registration;
mod staging;
mod staging_pipeline;
mod trace_formats;
mod trace_record;
mod trace_replay;
