//! Memory of one device used by another: whether a device can reach a peer's memory
//! (`cuDeviceCanAccessPeer`), and stream-ordered copies between device addresses, on one
//! device (`cuMemcpyDtoDAsync`) or across devices (`cuMemcpyPeerAsync`). Access of a peer
//! to a memory pool's blocks is granted on the pool ([`MemPool::set_access`],
//! `cuMemPoolSetAccess`): pool memory ignores `cuCtxEnablePeerAccess`.
//!
//! [`MemPool::set_access`]: super::mem_pool::MemPool::set_access

use cudarc::driver::{result, sys};

use super::driver::{bind, check, driver, ordinal_i32, CudaError};
use super::stream::Stream;
use crate::error::{Error, Result};

fn cu_device(ordinal: usize) -> Result<sys::CUdevice> {
    let n = ordinal_i32(ordinal)?;
    Ok(result::device::get(n).map_err(CudaError::from)?)
}

/// Whether kernels and copies on device `device` can access memory of device `peer`
/// directly (NVLink or PCIe peer-to-peer). True for a device and itself.
///
/// ```
/// use cudalloc::cuda::{can_access_peer, device_count};
/// if device_count() >= 2 {
///     println!("0 -> 1: {}", can_access_peer(0, 1).unwrap());
/// } else if device_count() == 1 {
///     assert!(can_access_peer(0, 0).unwrap());
/// }
/// ```
pub fn can_access_peer(device: usize, peer: usize) -> Result<bool> {
    driver()?;
    bind(device)?;
    if device == peer {
        cu_device(device)?;
        return Ok(true);
    }
    let (d, p) = (cu_device(device)?, cu_device(peer)?);
    let mut can: core::ffi::c_int = 0;
    // SAFETY: cuDeviceCanAccessPeer writes one int; both devices are valid handles.
    check(unsafe { sys::cuDeviceCanAccessPeer(&mut can, d, p) })?;
    Ok(can != 0)
}

/// The primary context of `device` (retained by `bind` for the life of the process).
fn context(device: usize) -> Result<sys::CUcontext> {
    bind(device)?;
    result::ctx::get_current()
        .map_err(CudaError::from)?
        .ok_or(Error::InvalidArgument(
            "no current context after binding the device",
        ))
}

/// Queues a copy of `bytes` bytes from device address `src` (on device `src_device`) to
/// `dst` (on `dst_device`), ordered on `stream`, and returns at once. Across devices it
/// is a peer copy (`cuMemcpyPeerAsync`), direct over NVLink or PCIe when the destination
/// may access the source (see `DevicePool::enable_peer_access`), staged otherwise.
///
/// ```
/// use cudalloc::{cuda::{copy_async, Stream}, device::DevicePool};
/// if let (Ok(pool), Ok(s)) = (DevicePool::get(0), Stream::new(0)) {
///     let src = pool.from_host(&[9u8; 4096], &s).unwrap();
///     let dst = pool.alloc::<u8>(4096, &s).unwrap();
///     // SAFETY: both buffers are 4096 bytes of device 0, alive and used only on `s`,
///     // which orders the copy after the fill and before the read below.
///     unsafe { copy_async(dst.device_ptr(), 0, src.device_ptr(), 0, 4096, &s) }.unwrap();
///     assert_eq!(dst.to_vec().unwrap(), vec![9u8; 4096]);
/// }
/// ```
///
/// # Safety
/// 1. `src..src+bytes` is device memory of `src_device` and `dst..dst+bytes` device
///    memory of `dst_device` that the caller may write; both stay allocated until the
///    copy has completed on `stream`.
/// 2. Nothing else writes either range (or reads `dst`) while the copy may run: other
///    streams' work on them is ordered with `stream` by events.
pub unsafe fn copy_async(
    dst: u64,
    dst_device: usize,
    src: u64,
    src_device: usize,
    bytes: usize,
    stream: &Stream,
) -> Result<()> {
    driver()?;
    if bytes == 0 {
        return Ok(());
    }
    if dst_device == src_device {
        bind(stream.device())?;
        // SAFETY: obligations 1 and 2; the stream is live.
        check(unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, stream.cu()) })?;
        return Ok(());
    }
    let (dst_ctx, src_ctx) = (context(dst_device)?, context(src_device)?);
    bind(stream.device())?;
    // SAFETY: obligations 1 and 2; both contexts are retained primary contexts that are
    // never released; the stream is live.
    check(unsafe { sys::cuMemcpyPeerAsync(dst, dst_ctx, src, src_ctx, bytes, stream.cu()) })?;
    Ok(())
}
