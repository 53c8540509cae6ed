//! SVG timeline.

use crate::trace::Trace;

/// The timeline.
pub fn timeline(trace: &Trace) -> String {
    let _ = trace;
    String::from("<svg xmlns=\"http://www.w3.org/2000/svg\"/>")
}
