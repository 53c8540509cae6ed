//! Helpers shared by the integration tests.

/// Whether GPU tests should run. Without a driver: prints `skipped: no CUDA driver` and
/// returns false, or panics when `REQUIRE_GPU=1` (the GPU machine's runs).
pub fn gpu_available(test: &str) -> bool {
    if cudalloc::cuda::driver_available() {
        return true;
    }
    if std::env::var("REQUIRE_GPU").is_ok_and(|v| v == "1") {
        panic!("{test}: REQUIRE_GPU=1 but no CUDA driver is available");
    }
    println!("{test}: skipped: no CUDA driver");
    false
}

/// Returns from the calling test unless a GPU is available (see [`gpu_available`]).
macro_rules! gpu {
    () => {
        if !$crate::support::gpu_available(module_path!()) {
            return;
        }
    };
}
