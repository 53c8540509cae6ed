//! A pickle reader for data (dicts, lists, tuples, sets, strings, bytes, numbers, bools,
//! `None`) with CPython's memo semantics: a memoized object is one object, however many
//! times the stream refers to it (`BINGET`) and however many batches fill it
//! (`APPENDS`/`SETITEMS` after its `MEMOIZE`).
//!
//! Why not `serde_pickle::value_from_slice`: serde-pickle 1.2 counts the references to
//! each memo entry to avoid clones, and its count drops an entry too early when a
//! memoized dict with memoized keys (the strings CPython memoizes) is referred to again
//! (its maintainer on birkenfeld/serde-pickle#24: "the ad-hoc refcounting I added is
//! imperfect"). So every public PyTorch snapshot we tried (three, from two repositories)
//! failed to read with "recursive structure found". Here the stream is first built into an arena of nodes
//! (a memo entry is a node index, shared), then converted to serde-pickle's [`Value`]
//! once the stream is complete, so the rest of the reader is unchanged.
//!
//! Read: protocols 2 to 5 (what Python 3 and PyTorch write), and the binary and numeric
//! opcodes of protocols 0 and 1 (not their quoted `STRING` and `UNICODE` text).
//! Refused, each with an error naming the byte offset: any global (`GLOBAL`,
//! `STACK_GLOBAL`, `REDUCE`, `BUILD`, `INST`, `OBJ`, `NEWOBJ`, persistent ids, extension
//! codes): data only, nothing is ever resolved or called; a recursive structure; a
//! stream that would expand (through shared references) past [`MAX_NODES`] values or
//! its byte budget ([`budget`]); values nested deeper than [`MAX_DEPTH`]; an integer
//! beyond 64 bits; a truncated stream.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde_pickle::{HashableValue, Value};

use super::{Location, TraceError};

/// The most values a stream may expand to once shared references are copied out: far
/// beyond any snapshot (PyTorch keeps at most its ring of trace entries), small enough
/// that a stream built to explode (a list holding itself twice, nested) ends in an error,
/// not in all of memory.
pub(crate) const MAX_NODES: usize = 1 << 26;

/// How deep values may nest: converting recurses once per level (and so does dropping a
/// [`Value`]), so a stream of nested lists would otherwise overflow the stack. PyTorch's
/// snapshots nest fewer than 20 deep; 128 levels stay well within a 2 MiB thread stack
/// even unoptimized.
pub(crate) const MAX_DEPTH: usize = 128;

/// What one converted value is charged against the byte budget, besides its string or
/// bytes: a [`Value`] (32 bytes) and its share of the container holding it.
const VALUE_COST: u64 = 64;

/// The most bytes a converted value may take, however long its input ([`budget`]): twice
/// what [`MAX_NODES`] values are charged, leaving room for their strings.
const MAX_BYTES: u64 = 8 << 30;

/// The bytes the value read from `input_len` bytes of pickle may take once shared
/// references are copied out: [`VALUE_COST`] a value plus the bytes of every string and
/// bytes, each copy counted. Honest snapshots expand a lot: PyTorch shares each
/// traceback's list of frames among the entries and blocks that have it, and each frame
/// dict among tracebacks (`py_symbolize` dedups them), so an entry's 2-byte reference
/// copies out a list of dozens of frames. One shaped that way (100,000 entries over
/// 2,000 tracebacks of 40 frames, 5 MB) expands about 450 times; ours in `traces/` 8
/// times. So: 1024 times the input, at least 256 MiB (small inputs) and at most
/// [`MAX_BYTES`]. A stream built to explode (one big string referred to thousands of
/// times, or `(x, x)` nested) ends in an error at this bound, in memory proportional to
/// its length, instead of taking all of memory.
fn budget(input_len: usize) -> u64 {
    (input_len as u64)
        .saturating_mul(1024)
        .saturating_add(256 << 20)
        .min(MAX_BYTES)
}

enum Node {
    Scalar(Value),
    List(Vec<usize>),
    Tuple(Vec<usize>),
    Dict(Vec<(usize, usize)>),
    Set(Vec<usize>),
    FrozenSet(Vec<usize>),
}

enum Slot {
    Mark,
    Node(usize),
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    /// Where the opcode being read starts (for errors).
    op_at: usize,
    nodes: Vec<Node>,
    stack: Vec<Slot>,
    memo: HashMap<u64, usize>,
}

fn truncated(at: usize) -> TraceError {
    TraceError::new(
        Location::Offset(at as u64),
        "truncated pickle (ends inside an opcode)",
    )
}

impl<'a> Reader<'a> {
    fn bad(&self, what: impl std::fmt::Display) -> TraceError {
        TraceError::new(Location::Offset(self.op_at as u64), format!("bad pickle: {what}"))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], TraceError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len());
        let end = end.ok_or_else(|| truncated(self.op_at))?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8, TraceError> {
        Ok(self.take(1)?[0])
    }

    fn le<const N: usize>(&mut self) -> Result<[u8; N], TraceError> {
        let mut a = [0; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn len(&mut self, width: usize) -> Result<usize, TraceError> {
        let n = match width {
            1 => u64::from(self.u8()?),
            4 => u64::from(u32::from_le_bytes(self.le()?)),
            _ => u64::from_le_bytes(self.le()?),
        };
        usize::try_from(n).map_err(|_| truncated(self.op_at))
    }

    fn push(&mut self, n: Node) -> Result<(), TraceError> {
        if self.nodes.len() >= MAX_NODES {
            return Err(self.bad(format!("more than {MAX_NODES} values")));
        }
        self.nodes.push(n);
        self.stack.push(Slot::Node(self.nodes.len() - 1));
        Ok(())
    }

    fn scalar(&mut self, v: Value) -> Result<(), TraceError> {
        self.push(Node::Scalar(v))
    }

    fn pop(&mut self) -> Result<usize, TraceError> {
        match self.stack.pop() {
            Some(Slot::Node(n)) => Ok(n),
            Some(Slot::Mark) => Err(self.bad("a mark where a value was expected")),
            None => Err(self.bad("stack underflow")),
        }
    }

    fn top(&self) -> Result<usize, TraceError> {
        match self.stack.last() {
            Some(Slot::Node(n)) => Ok(*n),
            _ => Err(self.bad("no value on the stack")),
        }
    }

    /// The values above the topmost mark, the mark removed.
    fn pop_mark(&mut self) -> Result<Vec<usize>, TraceError> {
        let m = self
            .stack
            .iter()
            .rposition(|s| matches!(s, Slot::Mark))
            .ok_or_else(|| self.bad("no mark"))?;
        let items = self
            .stack
            .drain(m + 1..)
            .map(|s| match s {
                Slot::Node(n) => n,
                Slot::Mark => unreachable!("the topmost mark is at {m}"),
            })
            .collect();
        self.stack.pop();
        Ok(items)
    }

    fn text(&mut self, width: usize) -> Result<(), TraceError> {
        let n = self.len(width)?;
        let raw = self.take(n)?;
        let s = std::str::from_utf8(raw).map_err(|e| self.bad(format!("string not UTF-8: {e}")))?;
        self.scalar(Value::String(s.to_owned()))
    }

    fn bytes(&mut self, width: usize) -> Result<(), TraceError> {
        let n = self.len(width)?;
        let raw = self.take(n)?.to_vec();
        self.scalar(Value::Bytes(raw))
    }

    /// A text line up to `\n` (protocols 0 and 1), without it.
    fn line(&mut self) -> Result<&'a str, TraceError> {
        let rest = &self.bytes[self.at..];
        let n = rest
            .iter()
            .position(|&b| b == b'\n')
            .ok_or_else(|| truncated(self.op_at))?;
        let line = &rest[..n];
        self.at += n + 1;
        std::str::from_utf8(line).map_err(|_| self.bad("a text opcode's line is not UTF-8"))
    }

    fn line_u64(&mut self) -> Result<u64, TraceError> {
        let l = self.line()?;
        l.trim()
            .parse()
            .map_err(|_| self.bad(format!("`{l}` is not a memo index")))
    }

    /// `INT` (`I01`/`I00` are `True`/`False`), `LONG` (`123L`) and `FLOAT` of protocol 0.
    fn text_number(&mut self, op: u8) -> Result<(), TraceError> {
        let l = self.line()?.trim();
        let v = match (op, l) {
            (b'I', "01") => Value::Bool(true),
            (b'I', "00") => Value::Bool(false),
            (b'F', _) => Value::F64(l.parse().map_err(|_| self.bad(format!("`{l}` is not a float")))?),
            _ => {
                let digits = l.strip_suffix('L').unwrap_or(l);
                let v: i128 = digits
                    .parse()
                    .map_err(|_| self.bad(format!("`{l}` is not an integer")))?;
                if let Ok(x) = i64::try_from(v) {
                    Value::I64(x)
                } else if let Ok(x) = u64::try_from(v) {
                    serde_pickle::to_value(&x).map_err(|e| self.bad(e))?
                } else {
                    return Err(self.bad("an integer beyond 64 bits"));
                }
            }
        };
        self.scalar(v)
    }

    /// A little-endian two's-complement integer of `n` bytes (LONG1, LONG4).
    fn long(&mut self, n: usize) -> Result<(), TraceError> {
        let raw = self.take(n)?;
        if n > 16 {
            return Err(self.bad("an integer beyond 64 bits"));
        }
        let mut v: i128 = 0;
        for (i, &b) in raw.iter().enumerate() {
            v |= i128::from(b) << (8 * i);
        }
        if n > 0 && n < 16 && raw[n - 1] & 0x80 != 0 {
            v -= 1i128 << (8 * n);
        }
        let value = if let Ok(x) = i64::try_from(v) {
            Value::I64(x)
        } else if let Ok(x) = u64::try_from(v) {
            serde_pickle::to_value(&x).map_err(|e| self.bad(e))?
        } else {
            return Err(self.bad("an integer beyond 64 bits"));
        };
        self.scalar(value)
    }

    fn add_to_list(&mut self, items: Vec<usize>) -> Result<(), TraceError> {
        let target = self.top()?;
        match &mut self.nodes[target] {
            Node::List(l) => {
                l.extend(items);
                Ok(())
            }
            _ => Err(self.bad("APPEND to something not a list")),
        }
    }

    fn add_to_dict(&mut self, items: Vec<usize>) -> Result<(), TraceError> {
        if items.len() % 2 != 0 {
            return Err(self.bad("SETITEMS with an odd number of values"));
        }
        let target = self.top()?;
        match &mut self.nodes[target] {
            Node::Dict(d) => {
                d.extend(items.chunks_exact(2).map(|kv| (kv[0], kv[1])));
                Ok(())
            }
            _ => Err(self.bad("SETITEM to something not a dict")),
        }
    }

    fn tuple(&mut self, items: Vec<usize>) -> Result<(), TraceError> {
        self.push(Node::Tuple(items))
    }

    fn memo_put(&mut self, id: u64) -> Result<(), TraceError> {
        let n = self.top()?;
        self.memo.insert(id, n);
        Ok(())
    }

    fn memo_get(&mut self, id: u64) -> Result<(), TraceError> {
        let n = *self
            .memo
            .get(&id)
            .ok_or_else(|| self.bad(format!("memo {id} never stored")))?;
        self.stack.push(Slot::Node(n));
        Ok(())
    }

    /// Reads opcodes up to `STOP`; returns the node of the value it leaves.
    fn run(&mut self) -> Result<usize, TraceError> {
        loop {
            self.op_at = self.at;
            let Some(&op) = self.bytes.get(self.at) else {
                return Err(TraceError::new(
                    Location::Offset(self.bytes.len() as u64),
                    "truncated pickle (no STOP opcode)",
                ));
            };
            self.at += 1;
            match op {
                0x80 => {
                    let proto = self.u8()?;
                    if proto > 5 {
                        return Err(self.bad(format!("protocol {proto}")));
                    }
                }
                0x95 => {
                    self.take(8)?; // FRAME: a length, a hint for buffering only
                }
                b'.' => return self.pop(),
                b'(' => self.stack.push(Slot::Mark),
                b'}' => self.push(Node::Dict(Vec::new()))?,
                b']' => self.push(Node::List(Vec::new()))?,
                b')' => self.tuple(Vec::new())?,
                0x8f => self.push(Node::Set(Vec::new()))?,
                b'd' => {
                    let items = self.pop_mark()?;
                    self.push(Node::Dict(Vec::new()))?;
                    self.add_to_dict(items)?;
                }
                b'l' => {
                    let items = self.pop_mark()?;
                    self.push(Node::List(items))?;
                }
                b't' => {
                    let items = self.pop_mark()?;
                    self.tuple(items)?;
                }
                0x85..=0x87 => {
                    let n = usize::from(op - 0x84);
                    let mut items = Vec::with_capacity(n);
                    for _ in 0..n {
                        items.push(self.pop()?);
                    }
                    items.reverse();
                    self.tuple(items)?;
                }
                0x91 => {
                    let items = self.pop_mark()?;
                    self.push(Node::FrozenSet(items))?;
                }
                0x90 => {
                    let items = self.pop_mark()?;
                    let target = self.top()?;
                    match &mut self.nodes[target] {
                        Node::Set(s) => s.extend(items),
                        _ => return Err(self.bad("ADDITEMS to something not a set")),
                    }
                }
                b'a' => {
                    let v = self.pop()?;
                    self.add_to_list(vec![v])?;
                }
                b'e' => {
                    let items = self.pop_mark()?;
                    self.add_to_list(items)?;
                }
                b's' => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    self.add_to_dict(vec![k, v])?;
                }
                b'u' => {
                    let items = self.pop_mark()?;
                    self.add_to_dict(items)?;
                }
                b'N' => self.scalar(Value::None)?,
                0x88 => self.scalar(Value::Bool(true))?,
                0x89 => self.scalar(Value::Bool(false))?,
                b'J' => {
                    let v = i32::from_le_bytes(self.le()?);
                    self.scalar(Value::I64(v.into()))?;
                }
                b'K' => {
                    let v = self.u8()?;
                    self.scalar(Value::I64(v.into()))?;
                }
                b'M' => {
                    let v = u16::from_le_bytes(self.le()?);
                    self.scalar(Value::I64(v.into()))?;
                }
                0x8a => {
                    let n = self.len(1)?;
                    self.long(n)?;
                }
                0x8b => {
                    let n = self.len(4)?;
                    self.long(n)?;
                }
                b'G' => {
                    let v = f64::from_be_bytes(self.le()?);
                    self.scalar(Value::F64(v))?;
                }
                0x8c => self.text(1)?,
                b'X' => self.text(4)?,
                0x8d => self.text(8)?,
                b'C' => self.bytes(1)?,
                b'B' => self.bytes(4)?,
                0x8e => self.bytes(8)?,
                0x96 => self.bytes(8)?, // BYTEARRAY8, read as bytes
                b'U' => self.bytes(1)?, // SHORT_BINSTRING (Python 2 `str`), as bytes
                b'T' => self.bytes(4)?, // BINSTRING
                b'I' | b'L' | b'F' => self.text_number(op)?,
                b'p' => {
                    let id = self.line_u64()?;
                    self.memo_put(id)?;
                }
                b'g' => {
                    let id = self.line_u64()?;
                    self.memo_get(id)?;
                }
                0x94 => {
                    let id = self.memo.len() as u64;
                    self.memo_put(id)?;
                }
                b'q' => {
                    let id = self.u8()?.into();
                    self.memo_put(id)?;
                }
                b'r' => {
                    let id = u32::from_le_bytes(self.le()?).into();
                    self.memo_put(id)?;
                }
                b'h' => {
                    let id = self.u8()?.into();
                    self.memo_get(id)?;
                }
                b'j' => {
                    let id = u32::from_le_bytes(self.le()?).into();
                    self.memo_get(id)?;
                }
                b'0' => {
                    self.stack.pop().ok_or_else(|| self.bad("stack underflow"))?;
                }
                b'1' => {
                    self.pop_mark()?;
                }
                b'2' => {
                    let n = self.top()?;
                    self.stack.push(Slot::Node(n));
                }
                b'c' | 0x93 | b'R' | b'b' | b'i' | b'o' | 0x81 | 0x92 | b'P' | b'Q' | 0x82..=0x84 => {
                    return Err(self.bad(format!(
                        "opcode {op:#04x} builds an object (a global, a class or a persistent id): only \
                         plain data is read, nothing is resolved"
                    )));
                }
                _ => return Err(self.bad(format!("unknown opcode {op:#04x}"))),
            }
        }
    }
}

/// Turns the arena's node `root` into a [`Value`], copying shared nodes out; refuses a
/// node that contains itself, more than [`MAX_NODES`] values or `budget` bytes in all
/// (counted as they are made, so a refused stream never takes more), and nesting deeper
/// than [`MAX_DEPTH`].
struct Convert<'a> {
    nodes: &'a [Node],
    open: BTreeSet<usize>,
    made: usize,
    /// The bytes charged so far, and the most that may be (`spent <= budget`).
    spent: u64,
    budget: u64,
}

impl Convert<'_> {
    fn err(&self, what: &str) -> TraceError {
        TraceError::new(Location::Input, format!("bad pickle: {what}"))
    }

    fn value(&mut self, n: usize) -> Result<Value, TraceError> {
        self.made += 1;
        if self.made > MAX_NODES {
            return Err(self.err(&format!("expands to more than {MAX_NODES} values")));
        }
        let own = match &self.nodes[n] {
            Node::Scalar(Value::String(s)) => s.len() as u64,
            Node::Scalar(Value::Bytes(b)) => b.len() as u64,
            _ => 0,
        };
        self.spent = self.spent.saturating_add(VALUE_COST).saturating_add(own);
        if self.spent > self.budget {
            return Err(self.err(&format!(
                "expands to more than {} bytes of values (shared references copied out)",
                self.budget
            )));
        }
        if let Node::Scalar(v) = &self.nodes[n] {
            return Ok(v.clone());
        }
        // `open` holds the containers being converted: the depth of this one.
        if self.open.len() >= MAX_DEPTH {
            return Err(self.err(&format!("values nested more than {MAX_DEPTH} deep")));
        }
        if !self.open.insert(n) {
            return Err(self.err("a recursive structure (a container inside itself)"));
        }
        let v = match &self.nodes[n] {
            Node::Scalar(_) => unreachable!("handled above"),
            Node::List(l) => Value::List(self.values(l)?),
            Node::Tuple(l) => Value::Tuple(self.values(l)?),
            Node::Set(l) => Value::Set(self.keys(l)?.into_iter().collect()),
            Node::FrozenSet(l) => Value::FrozenSet(self.keys(l)?.into_iter().collect()),
            Node::Dict(d) => {
                let mut m = BTreeMap::new();
                for &(k, v) in d {
                    let k = self.key(k)?;
                    let v = self.value(v)?;
                    m.insert(k, v);
                }
                Value::Dict(m)
            }
        };
        self.open.remove(&n);
        Ok(v)
    }

    fn values(&mut self, l: &[usize]) -> Result<Vec<Value>, TraceError> {
        l.iter().map(|&n| self.value(n)).collect()
    }

    fn keys(&mut self, l: &[usize]) -> Result<Vec<HashableValue>, TraceError> {
        l.iter().map(|&n| self.key(n)).collect()
    }

    fn key(&mut self, n: usize) -> Result<HashableValue, TraceError> {
        self.value(n)?
            .into_hashable()
            .map_err(|_| self.err("a dict key or set item that is not hashable"))
    }
}

/// Reads one pickled value from `bytes` (the whole input: trailing bytes are an error).
pub(crate) fn value_from_slice(bytes: &[u8]) -> Result<Value, TraceError> {
    let mut r = Reader {
        bytes,
        at: 0,
        op_at: 0,
        nodes: Vec::new(),
        stack: Vec::new(),
        memo: HashMap::new(),
    };
    let root = r.run()?;
    if r.at != bytes.len() {
        return Err(TraceError::new(
            Location::Offset(r.at as u64),
            "bad pickle: bytes after the STOP opcode",
        ));
    }
    Convert {
        nodes: &r.nodes,
        open: BTreeSet::new(),
        made: 0,
        spent: 0,
        budget: budget(bytes.len()),
    }
    .value(root)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What CPython's pickler (protocol 4) writes for `[D, D]` where `D = {str(i): i for i
    /// in range(n)}`: the dict memoized empty, then filled in batches of 1000
    /// (`SETITEMS`, each key memoized), then referred to again by `BINGET` (PyTorch's
    /// snapshots are lists and dicts of thousands of entries, shared strings and frames).
    fn shared_dict(n: u16) -> Vec<u8> {
        let mut p = vec![0x80, 4, b']', 0x94, b'(', b'}', 0x94];
        for batch in (0..n).collect::<Vec<_>>().chunks(1000) {
            p.push(b'(');
            for &i in batch {
                let key = i.to_string();
                p.extend([0x8c, key.len() as u8]);
                p.extend(key.as_bytes());
                let [lo, hi] = i.to_le_bytes();
                p.extend([0x94, b'M', lo, hi]);
            }
            p.push(b'u');
        }
        p.extend([b'h', 1, b'e', b'.']);
        p
    }

    #[test]
    fn a_memoized_dict_filled_in_batches_and_referred_to_again_is_one_dict() {
        let p = shared_dict(1500);
        let v = value_from_slice(&p).unwrap();
        let Value::List(outer) = &v else { panic!("{v:?}") };
        let want = Value::Dict(
            (0..1500)
                .map(|i| (HashableValue::String(i.to_string()), Value::I64(i)))
                .collect(),
        );
        assert_eq!(outer, &[want.clone(), want]);
        // serde-pickle 1.2's memo counting loses the shared dict ("recursive structure
        // found"), in one batch or two: why this module exists.
        for n in [999, 1500] {
            assert!(serde_pickle::value_from_slice(&shared_dict(n), serde_pickle::DeOptions::new()).is_err());
            assert!(value_from_slice(&shared_dict(n)).is_ok());
        }
    }

    #[test]
    fn dicts_tuples_strings_bytes_and_numbers_read_as_cpython_writes_them() {
        // pickle.dumps({'a': (1, -2, 300000, 2**40), 'b': b'xy', 'c': [True, None, 1.5]},
        // protocol=4), from CPython 3.11.
        let p = b"\x80\x04\x95<\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x01a\x94(K\x01J\xfe\xff\xff\xffJ\xe0\x93\x04\x00\x8a\x06\x00\x00\x00\x00\x00\x01t\x94\x8c\x01b\x94C\x02xy\x94\x8c\x01c\x94]\x94(\x88NG?\xf8\x00\x00\x00\x00\x00\x00eu.";
        let v = value_from_slice(p).unwrap();
        let key = |k: &str| HashableValue::String(k.into());
        let want = Value::Dict(BTreeMap::from([
            (
                key("a"),
                Value::Tuple(vec![
                    Value::I64(1),
                    Value::I64(-2),
                    Value::I64(300_000),
                    Value::I64(1 << 40),
                ]),
            ),
            (key("b"), Value::Bytes(b"xy".to_vec())),
            (
                key("c"),
                Value::List(vec![Value::Bool(true), Value::None, Value::F64(1.5)]),
            ),
        ]));
        assert_eq!(v, want);
        // Protocol 0's text numbers and memo: pickle.dumps([1, True, 2.5, [1]], protocol=0)
        // less its list's text memo ids.
        let p0 = b"(lp0\nI1\naI01\naF2.5\na(lp1\nI1\naa.";
        assert_eq!(
            value_from_slice(p0).unwrap(),
            Value::List(vec![
                Value::I64(1),
                Value::Bool(true),
                Value::F64(2.5),
                Value::List(vec![Value::I64(1)]),
            ])
        );
    }

    #[test]
    fn bad_streams_are_errors_at_their_offset() {
        let e = value_from_slice(b"\x80\x04]\x94(K\x01").unwrap_err();
        assert_eq!(e.location, Location::Offset(7), "{e}");
        assert!(e.message.contains("no STOP"), "{e}");
        let e = value_from_slice(b"\x80\x04X\x05\x00\x00\x00ab").unwrap_err();
        assert_eq!(e.location, Location::Offset(2), "{e}");
        let e = value_from_slice(b"\x80\x02cos\nsystem\n.").unwrap_err();
        assert!(e.message.contains("nothing is resolved"), "{e}");
        let e = value_from_slice(b"\x80\x04h\x07.").unwrap_err();
        assert!(e.message.contains("memo 7"), "{e}");
        let e = value_from_slice(b"\x80\x04N.N").unwrap_err();
        assert!(e.message.contains("after the STOP"), "{e}");
        // A list that contains itself: refused, not a hang or an overflow.
        let e = value_from_slice(b"\x80\x04]\x94h\x00a.").unwrap_err();
        assert!(e.message.contains("recursive"), "{e}");
        // Shared references nested to expand exponentially: refused at the bound.
        let mut p = vec![0x80, 4, b'N'];
        for _ in 0..40 {
            p.extend([0x94, b'2', 0x86]); // memoize top, DUP, TUPLE2: (x, x)
        }
        p.push(b'.');
        let e = value_from_slice(&p).unwrap_err();
        assert!(e.message.contains("more than"), "{e}");
    }
}
