//! The cudarc side of [`Stream`] (feature `cudarc`): one cudarc context per device, the
//! cudarc view every stream carries, and the map from cudarc streams back to the crate
//! streams that wrap them (so that one cudarc stream is one crate stream, one
//! [`StreamId`](super::StreamId), and so that code handed only a `&CudaStream` can find
//! a live crate handle to record on later).

use std::collections::BTreeMap;

use cudarc::driver::{sys, CudaContext, CudaStream};

use super::{Owner, Stream, StreamId, StreamInner, PER_THREAD, PER_THREAD_REFUSED};
use crate::cuda::driver::{bind, device_count, driver, CudaError};
use crate::error::{Error, Result};
use crate::sync::global::{lock, Arc, Mutex, OnceLock, Weak};

/// A device's cudarc context, as the crate keeps it.
struct DeviceContext {
    ctx: Arc<CudaContext>,
    /// A stream of the context that is never used and never dropped: it keeps cudarc in
    /// multi-stream mode for good (see [`context`]).
    _anchor: Arc<CudaStream>,
}

/// The cudarc context of device `device`: its primary context (the one the crate binds),
/// retained by cudarc once and kept for the life of the process, so every view of a crate
/// stream shares one `CudaContext` (its sticky error and its stream-tracking state).
///
/// cudarc's `new_stream` synchronizes the whole context when it switches from one stream
/// to several (its multi-stream mode, where it orders its own slices across streams with
/// events), which it does each time its count of streams goes from 0 to 1: a crate stream
/// created after the last one was dropped would wait for all work on the device, even
/// work queued behind a host function the caller has yet to release. So the context gets
/// one anchor stream of its own, made while event tracking is briefly off (the context is
/// not shared yet, so no slice can be created meanwhile, and there is no earlier work of
/// its slices to wait for), and kept: the count never returns to 0, and the crate's
/// streams never synchronize the context.
pub(super) fn context(device: usize) -> Result<Arc<CudaContext>> {
    static CONTEXTS: OnceLock<Box<[OnceLock<DeviceContext>]>> = OnceLock::new();
    driver()?;
    let slots = CONTEXTS.get_or_init(|| (0..device_count()).map(|_| OnceLock::new()).collect());
    let slot = slots
        .get(device)
        .ok_or(Error::InvalidArgument("no CUDA device with that ordinal"))?;
    if let Some(d) = slot.get() {
        return Ok(d.ctx.clone());
    }
    // Two threads may race here: the loser's context and anchor are dropped, which
    // destroys its stream and releases the one retain of the primary context it took.
    let ctx = CudaContext::new(device).map_err(CudaError::from)?;
    // SAFETY: `ctx` is ours alone until the slot publishes it, so no CudaSlice is created
    // while tracking is off (the obligation of disable_event_tracking), and tracking is on
    // again before anyone else sees the context.
    unsafe { ctx.disable_event_tracking() };
    let anchor = ctx.new_stream();
    // SAFETY: as above: no slice was created while tracking was off.
    unsafe { ctx.enable_event_tracking() };
    let anchor = anchor.map_err(CudaError::from)?;
    Ok(slot
        .get_or_init(|| DeviceContext { ctx, _anchor: anchor })
        .ctx
        .clone())
}

/// A new stream on `device`, made by cudarc and owned by its view (see [`Stream::new`]).
pub(super) fn create(device: usize) -> Result<Stream> {
    let view = context(device)?.new_stream().map_err(CudaError::from)?;
    Ok(intern(&view, true))
}

/// A cudarc view of a stream the crate does not own.
///
/// # Safety
/// 1. `raw` is a live stream (or null, the legacy default stream) of the primary context
///    of `device`.
/// 2. It outlives the view and every clone of it.
pub(super) unsafe fn borrowed_view(device: usize, raw: sys::CUstream) -> Result<Arc<CudaStream>> {
    let ctx = context(device)?;
    // SAFETY: `ctx` is the primary context of `device`, which `raw` belongs to
    // (obligation 1); obligation 2 keeps it alive as long as the view; work submitted
    // through cudarc and through the crate goes to the same stream, in its order.
    Ok(unsafe { ctx.wrap_borrowed_stream(raw) })
}

/// A live crate stream, as the map keeps it.
struct Known {
    raw: usize,
    device: usize,
    stream: Weak<StreamInner>,
}

/// Live crate streams by the address of their cudarc view (`Arc::as_ptr`). An entry's
/// stream holds its view, so while the entry's `Weak` upgrades, no other `CudaStream` can
/// live at that address; an entry that no longer upgrades is stale and may be replaced.
static KNOWN: Mutex<BTreeMap<usize, Known>> = Mutex::new(BTreeMap::new());

fn view_key(view: &CudaStream) -> usize {
    view as *const CudaStream as usize
}

/// Records a new handle in the map (its view is new, so any entry at that address is
/// stale).
pub(super) fn remember(stream: &Stream) {
    let entry = Known {
        raw: stream.inner.raw as usize,
        device: stream.inner.device,
        stream: Arc::downgrade(&stream.inner),
    };
    lock(&KNOWN).insert(view_key(&stream.inner.view), entry);
}

/// Removes a dying handle's entry (if it is still its own: a new handle may have taken
/// the address once this one's count reached zero).
pub(super) fn forget(inner: &StreamInner) {
    let key = view_key(&inner.view);
    let mut known = lock(&KNOWN);
    if known
        .get(&key)
        .is_some_and(|k| core::ptr::eq(k.stream.as_ptr(), inner))
    {
        known.remove(&key);
    }
}

/// The crate stream whose view is `view` (found by address), or a new handle over it,
/// made and recorded under one lock so that two threads converting the same cudarc stream
/// get the same handle.
fn intern(view: &Arc<CudaStream>, created: bool) -> Stream {
    let key = view_key(view);
    let mut known = lock(&KNOWN);
    if let Some(inner) = known.get(&key).and_then(|k| k.stream.upgrade()) {
        return Stream { inner };
    }
    let inner = Arc::new(StreamInner {
        raw: view.cu_stream(),
        device: view.context().ordinal(),
        id: StreamId::fresh(),
        owner: Owner::Cudarc { created },
        view: view.clone(),
    });
    let entry = Known {
        raw: inner.raw as usize,
        device: inner.device,
        stream: Arc::downgrade(&inner),
    };
    known.insert(key, entry);
    Stream { inner }
}

/// [`Stream::from_cudarc`].
pub(super) fn from_cudarc(view: &Arc<CudaStream>) -> Result<Stream> {
    driver()?;
    let ctx = view.context();
    if !ctx.is_primary() {
        return Err(Error::InvalidArgument(
            "the cudarc stream's context is not its device's primary context",
        ));
    }
    if view.cu_stream() == PER_THREAD {
        return Err(Error::InvalidArgument(PER_THREAD_REFUSED));
    }
    bind(ctx.ordinal())?;
    Ok(intern(view, false))
}

/// The live crate stream that `stream` is, if any: the crate stream whose view it is (or
/// that was made from it), else a crate stream over the same driver stream in the same
/// (primary) context. Code that cudarc hands only a `&CudaStream` (no `Arc` to keep)
/// uses it to get a handle that keeps the stream alive, to record on it later.
///
/// The per-thread default stream is never matched by handle: it is a different stream
/// on each thread.
pub(crate) fn known(stream: &CudaStream) -> Option<Stream> {
    let raw = stream.cu_stream();
    let ctx = stream.context();
    let device = ctx.ordinal();
    let candidates: Vec<Weak<StreamInner>> = {
        let known = lock(&KNOWN);
        if let Some(inner) = known.get(&view_key(stream)).and_then(|k| k.stream.upgrade()) {
            return Some(Stream { inner });
        }
        if raw == PER_THREAD {
            return None;
        }
        known
            .values()
            .filter(|k| k.raw == raw as usize && k.device == device)
            .map(|k| k.stream.clone())
            .collect()
    };
    // The same handle value means the same stream only in the same context (the null
    // handle is every context's legacy stream); crate streams are in the primary one.
    if !ctx.is_primary() || context(device).ok()?.cu_ctx() != ctx.cu_ctx() {
        return None;
    }
    candidates
        .iter()
        .find_map(Weak::upgrade)
        .map(|inner| Stream { inner })
}

/// Makes work queued on `later` from now on wait for the work queued on `stream` so far
/// (an event recorded on `stream`, waited for on the GPU: the host does not block).
pub(crate) fn order_after(later: &CudaStream, stream: &Stream) -> Result<()> {
    let event = crate::cuda::PooledEvent::record(stream)?;
    later.context().bind_to_thread().map_err(CudaError::from)?;
    // SAFETY: both handles are live: `later` is borrowed for this call, the event is
    // held here (returning it to its pool after the wait is queued is allowed: the wait
    // keeps the state captured at the call).
    crate::cuda::driver::check(unsafe { sys::cuStreamWaitEvent(later.cu_stream(), event.event().raw, 0) })?;
    Ok(())
}

/// Whether `view` is `stream` (the same driver stream in the same context).
pub(crate) fn is_same(view: &CudaStream, stream: &Stream) -> bool {
    let own = &stream.inner.view;
    view.cu_stream() == own.cu_stream() && view.context().cu_ctx() == own.context().cu_ctx()
}
