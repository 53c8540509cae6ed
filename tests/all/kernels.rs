//! `cuda::Module` and `cuda::Kernel`: PTX loading, lookup, launch, and the errors a user
//! meets (a PTX version the driver does not know, a missing kernel, bad input).

use cudalloc::cuda::{Module, Stream};
use cudalloc::device::DevicePool;
use cudalloc::Error;

use crate::pipeline::{hash_rounds, KERNEL, PTX};

#[test]
fn ptx_with_a_nul_byte_is_refused_before_the_driver() {
    let err = Module::load_ptx(0, ".version 8.0\0\n").unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
}

#[test]
fn without_a_driver_loading_reports_no_driver() {
    if cudalloc::cuda::driver_available() {
        return; // the GPU tests below cover the driver's answers
    }
    assert_eq!(Module::load_ptx(0, PTX).unwrap_err(), Error::NoDriver);
}

#[test]
fn module_errors_say_what_to_do() {
    let e = Error::UnsupportedPtx {
        ptx_version: Some((9, 0)),
        driver_version: (12, 4),
    };
    let text = e.to_string();
    assert!(text.contains("9.0") && text.contains("CUDA 12.4"), "{text}");
    assert!(text.contains(".version"), "says how to fix it: {text}");
    let text = Error::KernelNotFound.to_string();
    assert!(text.contains("extern \"C\""), "{text}");
}

/// Runs the pipeline kernel over `input` with `rounds` and returns its output.
fn run_kernel(input: &[u32], rounds: u32) -> Vec<u32> {
    let stream = Stream::new(0).unwrap();
    let pool = DevicePool::get(0).unwrap();
    let module = Module::load_ptx(0, PTX).unwrap();
    let kernel = module.function(KERNEL).unwrap();
    drop(module); // the kernel keeps the module loaded
    let src = pool.from_host(input, &stream).unwrap();
    let dst = pool.alloc::<u32>(input.len(), &stream).unwrap();
    let (mut i, mut o, mut n, mut r) = (src.device_ptr(), dst.device_ptr(), input.len() as u64, rounds);
    // A small grid, so the grid-stride loop runs several times per thread.
    // SAFETY: the arguments match pipeline_hash(const u32*, u32*, u64, u32); both buffers
    // hold `n` u32s and are ordered on `stream`, their own stream.
    unsafe {
        kernel.launch(
            (7, 1, 1),
            (128, 1, 1),
            0,
            &stream,
            &mut [
                (&mut i as *mut u64).cast(),
                (&mut o as *mut u64).cast(),
                (&mut n as *mut u64).cast(),
                (&mut r as *mut u32).cast(),
            ],
        )
    }
    .unwrap();
    dst.to_vec().unwrap()
}

#[test]
fn the_pipeline_kernel_matches_the_host_reference_bit_for_bit() {
    gpu!();
    let before = cudalloc::cuda::drop_errors();
    let input: Vec<u32> = (0..100_003u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
    // 0 rounds copies; 37 is not a multiple of the compiler's unroll factor (4).
    for rounds in [0, 1, 37] {
        let out = run_kernel(&input, rounds);
        let wrong = input
            .iter()
            .zip(&out)
            .filter(|(x, y)| hash_rounds(**x, rounds) != **y)
            .count();
        assert_eq!(wrong, 0, "rounds {rounds}: {wrong} elements differ from the host");
    }
    assert_eq!(
        cudalloc::cuda::drop_errors(),
        before,
        "unloading the module failed"
    );
}

#[test]
fn a_missing_kernel_is_reported_by_name_lookup() {
    gpu!();
    let module = Module::load_ptx(0, PTX).unwrap();
    assert_eq!(
        module.function("no_such_kernel").unwrap_err(),
        Error::KernelNotFound
    );
    assert!(matches!(
        module.function("pipe\0line").unwrap_err(),
        Error::InvalidArgument(_)
    ));
    let k = module.function(KERNEL).unwrap();
    assert_eq!(k.name(), KERNEL);
    assert_eq!(k.device(), 0);
}

#[test]
fn ptx_newer_than_the_driver_is_reported_with_both_versions() {
    gpu!();
    let too_new = PTX.replace(".version 8.0", ".version 9.9");
    match Module::load_ptx(0, &too_new) {
        Err(Error::UnsupportedPtx {
            ptx_version,
            driver_version,
        }) => {
            assert_eq!(ptx_version, Some((9, 9)));
            assert!(driver_version.0 >= 12, "driver {driver_version:?}");
        }
        // A driver of CUDA 13.9 or later knows PTX 9.9: nothing to report then.
        Ok(_) => println!("this driver loads PTX 9.9"),
        Err(e) => panic!("expected UnsupportedPtx, got {e:?} ({e})"),
    }
}

#[test]
fn malformed_ptx_is_a_driver_error() {
    gpu!();
    let err = Module::load_ptx(
        0,
        ".version 8.0\n.target sm_75\n.address_size 64\nthis is not ptx\n",
    )
    .unwrap_err();
    assert!(matches!(err, Error::Cuda(_)), "{err:?}");
}

#[test]
fn launch_refuses_empty_grids_before_queuing() {
    gpu!();
    let stream = Stream::new(0).unwrap();
    let kernel = Module::load_ptx(0, PTX).unwrap().function(KERNEL).unwrap();
    // SAFETY: refused before the driver is called: no argument is read.
    let err = unsafe { kernel.launch((0, 1, 1), (128, 1, 1), 0, &stream, &mut []) }.unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
    stream.synchronize().unwrap();
}
