//! `y = a * x + y` on the GPU through cudarc, on memory from cudalloc:
//!
//! - the kernel is PTX text kept in the repository (`kernels/saxpy.cu`, compiled once by
//!   `kernels/build-ptx.sh`), loaded by the driver at run time: no nvcc, no NVRTC;
//! - inputs are staged in pinned `Vec`s (`Vec<f32, PinnedAlloc>`) and copied with
//!   cudarc through [`PinnedView`]: asynchronous, and the `Vec`s may be dropped at once;
//! - device buffers come from cudalloc's [`DevicePool`] and go straight into cudarc's
//!   copies and `launch_builder(..).arg(&buf)`;
//! - the result comes back into a pinned `Vec` through [`PinnedViewMut`] and is checked.
//!
//! Run with `cargo run --release --example cudarc --features cudarc`. Without a GPU it
//! says so and exits successfully.

use std::error::Error;
use std::process::ExitCode;

use allocator_api2::vec::Vec;
use cudalloc::cuda::Stream;
use cudalloc::device::DevicePool;
use cudalloc::{PinnedAlloc, PinnedView, PinnedViewMut};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

/// The kernel, compiled from `kernels/saxpy.cu`:
/// `saxpy(float a, const float* x, float* y, unsigned n)`.
const SAXPY_PTX: &str = include_str!("../kernels/saxpy.ptx");

fn main() -> ExitCode {
    if !cudalloc::cuda::driver_available() {
        println!("cudarc example: no CUDA driver or device here, nothing to run");
        return ExitCode::SUCCESS;
    }
    match saxpy_on_the_gpu(1 << 22, 2.0) {
        Ok(summary) => {
            println!("{summary}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("cudarc example failed: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Computes `a * x + y` for `x[i] = i`, `y[i] = 1` over `n` elements on device 0 and checks
/// every result; returns a one-line summary.
pub fn saxpy_on_the_gpu(n: usize, a: f32) -> Result<String, Box<dyn Error>> {
    if n == 0 || n > 1 << 22 {
        return Err("n must be in 1..=2^22 (so that 2 * x + y stays exact in f32)".into());
    }
    let n32 = u32::try_from(n)?;
    // One stream for everything: the crate's handle and cudarc's view of it are one
    // stream, so copies, the kernel and the frees run in this order with no events.
    let stream = Stream::new(0)?;
    let cs = stream.cudarc();
    let saxpy = cs
        .context()
        .load_module(Ptx::from_src(SAXPY_PTX))?
        .load_function("saxpy")?;

    // Stage the inputs in pinned memory (full PCIe speed, truly asynchronous copies).
    let mut x: Vec<f32, PinnedAlloc> = Vec::with_capacity_in(n, PinnedAlloc);
    x.extend((0..n).map(|i| i as f32));
    let mut y: Vec<f32, PinnedAlloc> = Vec::with_capacity_in(n, PinnedAlloc);
    y.resize(n, 1.0);

    let pool = DevicePool::get(0)?;
    let mut dx = pool.alloc::<f32>(n, &stream)?;
    let mut dy = pool.alloc::<f32>(n, &stream)?;
    // Asynchronous: these return once the copies are queued. Dropping the staging
    // vectors right away is safe: the pinned pool keeps each block from its next owner
    // until the copy that reads it has completed.
    cs.memcpy_htod(&PinnedView::new(&x)?, &mut dx)?;
    cs.memcpy_htod(&PinnedView::new(&y)?, &mut dy)?;
    drop((x, y));

    let mut launch = cs.launch_builder(&saxpy);
    launch.arg(&a).arg(&dx).arg(&mut dy).arg(&n32);
    // SAFETY: the arguments match `saxpy(float, const float*, float*, unsigned)` in type
    // and order; both buffers hold n floats and belong to the launch's stream.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n32)) }?;

    // Back into pinned memory. PinnedViewMut::new makes the copy complete before the
    // call returns, so `out` may be read at once (`new_async` does not wait, and is
    // `unsafe`: the caller must not touch `out` until the copy is done).
    let mut out: Vec<f32, PinnedAlloc> = Vec::with_capacity_in(n, PinnedAlloc);
    out.resize(n, 0.0);
    cs.memcpy_dtoh(&dy, &mut PinnedViewMut::new(&mut out)?)?;

    // With a = 2 every value is an integer below 2^24, exact in f32: the GPU's fused
    // multiply-add and the CPU's multiply then add give the same bits.
    let wrong = out
        .iter()
        .enumerate()
        .filter(|&(i, &v)| v != a * i as f32 + 1.0)
        .count();
    if wrong > 0 {
        return Err(format!("{wrong} of {n} results are wrong").into());
    }
    Ok(format!(
        "saxpy: {n} elements checked on {} (a = {a}, y[n-1] = {})",
        cudalloc::cuda::device_name(0).unwrap_or_else(|_| "device 0".into()),
        out[n - 1]
    ))
}
