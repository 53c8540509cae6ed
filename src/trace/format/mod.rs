//! Trace files: RMM's replay log ([`rmm`]), PyTorch's memory snapshot ([`torch`]) and an
//! SVG timeline ([`svg`]). Readers return a [`TraceError`] naming the line, byte offset or
//! event of the first bad input; their lenient variants skip bad input and say what they
//! skipped ([`Lenient`]).

pub mod rmm;
pub mod svg;
pub mod torch;
mod unpickle;

use std::fmt;

use super::Trace;

/// Where in its input a [`TraceError`] was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Location {
    /// A line of a text file (1-based, the header is line 1).
    Line(u64),
    /// A byte offset into a binary file.
    Offset(u64),
    /// An event of a trace (its index in [`Trace::events`]).
    Event(u64),
    /// The input as a whole.
    Input,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Line(n) => write!(f, "line {n}"),
            Location::Offset(n) => write!(f, "byte offset {n}"),
            Location::Event(n) => write!(f, "event {n}"),
            Location::Input => f.write_str("input"),
        }
    }
}

/// Bad trace input: where, and what is wrong.
///
/// ```
/// use cudalloc::trace::format::{Location, TraceError};
/// let e = TraceError::new(Location::Line(3), "size `x` is not a number");
/// assert_eq!(e.to_string(), "line 3: size `x` is not a number");
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceError {
    /// Where.
    pub location: Location,
    /// What is wrong.
    pub message: String,
}

impl TraceError {
    /// An error at `location`.
    pub fn new(location: Location, message: impl Into<String>) -> Self {
        Self {
            location,
            message: message.into(),
        }
    }
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.location, self.message)
    }
}

impl std::error::Error for TraceError {}

/// What a lenient reader (or replay) made of its input: the trace, and the bad input it
/// skipped, each with its location.
///
/// ```
/// use cudalloc::trace::format::rmm;
/// let csv = "Thread,Time,Action,Pointer,Size,Stream\n\
///            1,10:00:00.000001,allocate,0x1000,64,0x0\n\
///            garbage\n";
/// let read = rmm::read_lenient(csv).unwrap();
/// assert_eq!(read.trace.events.len(), 1);
/// assert_eq!(read.skipped.len(), 1);
/// assert!(read.skipped[0].to_string().starts_with("line 3"));
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Lenient {
    /// What was read.
    pub trace: Trace,
    /// What was skipped, in input order.
    pub skipped: Vec<TraceError>,
}

/// Reads a trace file of any format this module reads, telling them by their content: a
/// pickle (PyTorch's snapshot) starts with the byte `0x80`, anything else is read as
/// RMM's CSV log. `lenient` skips bad input (listed in [`Lenient::skipped`]).
///
/// ```
/// use cudalloc::trace::format;
/// let csv = b"Thread,Time,Action,Pointer,Size,Stream\n1,00:00:00.000000,allocate,0x10,8,0x0\n";
/// assert_eq!(format::read_any(csv, false).unwrap().trace.events.len(), 1);
/// assert!(format::read_any(b"\x80\x02", false).is_err()); // a truncated pickle
/// assert!(format::read_any(b"\xff\xfe", false).is_err()); // neither
/// ```
pub fn read_any(bytes: &[u8], lenient: bool) -> Result<Lenient, TraceError> {
    if bytes.first() == Some(&0x80) {
        return if lenient {
            torch::read_lenient(bytes)
        } else {
            torch::read(bytes).map(|trace| Lenient {
                trace,
                skipped: Vec::new(),
            })
        };
    }
    if lenient {
        // A byte that is not UTF-8 spoils its line only: decoded as U+FFFD, which no field
        // parses, so the line is skipped and listed like any other bad line.
        return rmm::read_lenient(&String::from_utf8_lossy(bytes));
    }
    let text = std::str::from_utf8(bytes).map_err(|e| {
        TraceError::new(
            Location::Offset(e.valid_up_to() as u64),
            "neither a pickle nor UTF-8 text (an RMM log)",
        )
    })?;
    rmm::read(text).map(|trace| Lenient {
        trace,
        skipped: Vec::new(),
    })
}
