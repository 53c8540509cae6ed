//! A pool of reusable CUDA events per device, so that recording a use of a pooled block
//! costs a `cuEventRecord` and not also a `cuEventCreate`/`cuEventDestroy` pair. Events
//! are taken and returned under a short lock; no driver call runs under it.

use super::driver::{device_count, driver};
use super::stream::{Event, Stream, StreamId};
use crate::error::{Error, Result};
use crate::sync::global::OnceLock;
use crate::sync::{lock, Mutex};

/// Idle events kept per device; more are destroyed when returned.
const MAX_IDLE: usize = 256;

fn pools() -> &'static [Mutex<Vec<Event>>] {
    static POOLS: OnceLock<Box<[Mutex<Vec<Event>>]>> = OnceLock::new();
    POOLS.get_or_init(|| (0..device_count()).map(|_| Mutex::new(Vec::new())).collect())
}

/// An event taken from the per-device pool and recorded on a stream; it goes back to the
/// pool when dropped.
#[derive(Debug)]
pub(crate) struct PooledEvent {
    event: Option<Event>,
    stream: StreamId,
}

impl PooledEvent {
    /// Takes an idle event of `stream`'s device (or creates one) and records it at the
    /// current end of `stream`.
    pub(crate) fn record(stream: &Stream) -> Result<Self> {
        driver()?;
        let pool = pools()
            .get(stream.device())
            .ok_or(Error::InvalidArgument("no CUDA device with that ordinal"))?;
        let idle = lock(pool).pop();
        let event = match idle {
            Some(e) => e,
            None => Event::new(stream.device())?,
        };
        // If recording fails the event still goes back to the pool through Drop.
        let pooled = Self {
            event: Some(event),
            stream: stream.id(),
        };
        pooled.event().record(stream)?;
        Ok(pooled)
    }

    pub(crate) fn event(&self) -> &Event {
        self.event
            .as_ref()
            .expect("a PooledEvent holds its event until dropped")
    }

    /// Whether the recorded work has completed (never blocks).
    pub(crate) fn is_complete(&self) -> Result<bool> {
        self.event().is_complete()
    }

    /// Blocks until the recorded work has completed.
    pub(crate) fn synchronize(&self) -> Result<()> {
        self.event().synchronize()
    }

    /// The stream it was recorded on.
    pub(crate) fn stream_id(&self) -> StreamId {
        self.stream
    }
}

impl Drop for PooledEvent {
    fn drop(&mut self) {
        let Some(event) = self.event.take() else { return };
        if let Some(pool) = pools().get(event.device()) {
            let mut idle = lock(pool);
            if idle.len() < MAX_IDLE {
                idle.push(event);
                return;
            }
        }
        // Destroyed outside the lock.
        drop(event);
    }
}
