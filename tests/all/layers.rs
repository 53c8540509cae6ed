//! Dependencies in `src/` run one way (issue 23): no import cycle between modules, and
//! `src/cuda/` never names `src/device/`.
//!
//! The sources are embedded at compile time (`include_str!`), so the test runs anywhere,
//! the GPU machine included, where the sources are absent. Limits, stated honestly:
//! - The list of files below is written by hand: a new file is checked only once it is
//!   listed. Where the sources are present (CI, a developer's checkout) the test also
//!   compares the list with `src/` and fails on a file missing from it; elsewhere that
//!   check is skipped (it says so).
//! - A dependency is a path in code (comments stripped): a `use` of `crate::`, `super::`
//!   or `self::` paths (braces expanded), or such a path written inline. A path through a
//!   module's re-export (`pub use`) is followed to the module that defines the item;
//!   one that stops at an ancestor (a glob, a re-export not followed) is not counted, and
//!   neither is a module's edge to its own submodules (containment, not use). Macros,
//!   and names made by macros, are not seen.

use std::collections::{BTreeMap, BTreeSet};

macro_rules! sources {
    ($($path:literal),* $(,)?) => {
        &[$(($path, include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/src/", $path)))),*]
    };
}

/// Every source file of the library, by its path under `src/`.
const SOURCES: &[(&str, &str)] = sources![
    "arena/bump.rs",
    "arena/mod.rs",
    "budget.rs",
    "class_geometry.rs",
    "copy.rs",
    "count/counters.rs",
    "count/mod.rs",
    "count/sites.rs",
    "count/sites/table.rs",
    "count/thread.rs",
    "count/window.rs",
    "cuda/async_memory.rs",
    "cuda/completion.rs",
    "cuda/driver.rs",
    "cuda/event_pool.rs",
    "cuda/exit.rs",
    "cuda/mem_pool.rs",
    "cuda/memory.rs",
    "cuda/mod.rs",
    "cuda/module.rs",
    "cuda/nvtx.rs",
    "cuda/peer.rs",
    "cuda/stream.rs",
    "cuda/stream_cudarc.rs",
    "cuda/vmm.rs",
    "device/arena.rs",
    "device/arena/slice.rs",
    "device/backend.rs",
    "device/buffer.rs",
    "device/cache.rs",
    "device/cache/free.rs",
    "device/cache/idle.rs",
    "device/cache/lists.rs",
    "device/cache/release.rs",
    "device/cache/settings.rs",
    "device/cache/stats.rs",
    "device/close.rs",
    "device/config.rs",
    "device/fake/mod.rs",
    "device/fake/physical.rs",
    "device/fake/pool_model.rs",
    "device/local.rs",
    "device/loom_models.rs",
    "device/mod.rs",
    "device/order.rs",
    "device/pages/clocks.rs",
    "device/pages/clocks/tests.rs",
    "device/pages/early.rs",
    "device/pages/held.rs",
    "device/pages/map.rs",
    "device/pages/mod.rs",
    "device/pages/reclaim.rs",
    "device/pages/space.rs",
    "device/pages/stats.rs",
    "device/pages/tests.rs",
    "device/pages/tests/idle_queries.rs",
    "device/pages/tests/unlocked.rs",
    "device/pages/trim.rs",
    "device/phys.rs",
    "device/pool.rs",
    "device/report.rs",
    "device/reserve.rs",
    "device/reserve/growing.rs",
    "device/reserve/tests.rs",
    "device/runs.rs",
    "device/sim.rs",
    "device/sim/close_tests.rs",
    "device/size_class.rs",
    "device/tests.rs",
    "device/tests/cache.rs",
    "device/tests/marks.rs",
    "device/tests/paged.rs",
    "device/tests/pages.rs",
    "device/tests/threads.rs",
    "device/thread_cache.rs",
    "device/thread_cache/published.rs",
    "device/thread_cache/slow.rs",
    "direct.rs",
    "error.rs",
    "fence/mod.rs",
    "fence/registry.rs",
    "guide.rs",
    "handle/mod.rs",
    "handle/pools.rs",
    "handle/sanitizer_exit.rs",
    "interop/cudarc.rs",
    "interop/mod.rs",
    "lib.rs",
    "observe.rs",
    "pool/accounting.rs",
    "pool/async_alloc.rs",
    "pool/checks.rs",
    "pool/chunks.rs",
    "pool/large.rs",
    "pool/loom_models.rs",
    "pool/mod.rs",
    "pool/shared.rs",
    "pool/size_class.rs",
    "pool/small.rs",
    "pool/stats.rs",
    "pool/tests.rs",
    "pool/thread_cache.rs",
    "pool/transfers.rs",
    "pool/uses.rs",
    "registration.rs",
    "slot_table.rs",
    "source/host.rs",
    "source/managed.rs",
    "source/mod.rs",
    "source/pinned.rs",
    "source/pinned_pool.rs",
    "source/prefault.rs",
    "source/registered.rs",
    "staging/flight.rs",
    "staging/mod.rs",
    "staging/pipeline.rs",
    "staging/threaded.rs",
    "staging/threaded/tests.rs",
    "sync.rs",
    "testing/mod.rs",
    "testing/raw_pinned.rs",
    "testing/workload.rs",
    "thread_registry.rs",
    "trace/event.rs",
    "trace/format/mod.rs",
    "trace/format/rmm.rs",
    "trace/format/svg.rs",
    "trace/format/torch.rs",
    "trace/format/unpickle.rs",
    "trace/growth.rs",
    "trace/mod.rs",
    "trace/record.rs",
    "trace/record/env.rs",
    "trace/record/sites.rs",
    "trace/replay/mod.rs",
    "trace/replay/targets.rs",
    "trace/replay/workload.rs",
    "trace/traced.rs",
    "util.rs",
];

/// Files whose module is not their path (`#[path]`).
const PATH_MODULES: &[(&str, &str)] = &[("cuda/stream_cudarc.rs", "cuda::stream::cudarc_side")];

fn module_of(file: &str) -> String {
    if let Some(&(_, m)) = PATH_MODULES.iter().find(|(f, _)| *f == file) {
        return m.to_string();
    }
    let p = file.trim_end_matches(".rs");
    let p = p.strip_suffix("/mod").unwrap_or(p);
    if p == "lib" {
        String::new()
    } else {
        p.replace('/', "::")
    }
}

/// The code of a file without comments (line comments and doc comments; block comments
/// are not used in this crate) and without the contents of string literals.
fn code(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    for line in src.lines() {
        let mut in_str = false;
        let mut prev = ' ';
        let mut kept = String::new();
        let chars: Vec<char> = line.chars().collect();
        let mut i = 0;
        while i < chars.len() {
            let c = chars[i];
            if in_str {
                if c == '"' && prev != '\\' {
                    in_str = false;
                    kept.push('"');
                }
                prev = if c == '\\' && prev == '\\' { ' ' } else { c };
                i += 1;
                continue;
            }
            if c == '/' && chars.get(i + 1) == Some(&'/') {
                break;
            }
            if c == '"' && prev != '\'' {
                in_str = true;
            }
            kept.push(c);
            prev = c;
            i += 1;
        }
        out.push_str(&kept);
        out.push('\n');
    }
    out
}

/// Expands a `use` tree (`a::{b, c::{d, e}}`) into its paths.
fn expand(tree: &str, prefix: &str, out: &mut Vec<String>) {
    let tree = tree.trim();
    if let Some(open) = tree.find('{') {
        let head = tree[..open].trim().trim_end_matches("::");
        let inner = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
        let base = join(prefix, head);
        let mut depth = 0;
        let mut start = 0;
        for (i, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    expand(&inner[start..i], &base, out);
                    start = i + 1;
                }
                _ => {}
            }
        }
        expand(&inner[start..], &base, out);
    } else if !tree.is_empty() {
        let path = tree.split(" as ").next().unwrap_or(tree).trim();
        let path = path.trim_end_matches("::*").trim_end_matches("::self");
        if path != "self" {
            out.push(join(prefix, path));
        }
    }
}

fn join(a: &str, b: &str) -> String {
    match (a.is_empty(), b.is_empty()) {
        (true, _) => b.to_string(),
        (_, true) => a.to_string(),
        _ => format!("{a}::{b}"),
    }
}

/// A path named in code: the module it is named in, the path, whether it is a public
/// `use` (a re-export).
type Named = (String, String, bool);

/// The paths a file names, each with the module it is named in (the file's module, or an
/// inline module in it: `mod fake { use super::... }`).
fn paths(module: &str, src: &str) -> Vec<Named> {
    let code = code(src);
    let mut out = Vec::new();
    // Inline modules: (name, brace depth at which it opened).
    let mut stack: Vec<(String, i32)> = Vec::new();
    let mut depth = 0i32;
    let mut pending_mod: Option<String> = None;
    let mut stmt: Option<(String, bool)> = None;
    let here = |stack: &Vec<(String, i32)>| {
        let mut m = module.to_string();
        for (n, _) in stack {
            m = join(&m, n);
        }
        m
    };
    let text = code.as_str();
    let mut i = 0;
    let bytes = text.as_bytes();
    while i < bytes.len() {
        if let Some((s, public)) = &mut stmt {
            if bytes[i] == b';' {
                let mut ps = Vec::new();
                expand(s, "", &mut ps);
                let m = here(&stack);
                let public = *public;
                out.extend(ps.into_iter().map(|p| (m.clone(), p, public)));
                stmt = None;
            } else {
                s.push(bytes[i] as char);
            }
            i += 1;
            continue;
        }
        let rest = &text[i..];
        let boundary = i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_');
        if boundary && rest.starts_with("use ") {
            let public = text[..i].trim_end().ends_with("pub")
                || text[..i].trim_end().ends_with(')') && text[..i].trim_end().contains("pub(");
            stmt = Some((
                String::new(),
                public && !text[..i].trim_end().ends_with("(super)"),
            ));
            i += 4;
            continue;
        }
        if boundary && rest.starts_with("mod ") {
            let name: String = rest[4..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            let after = rest[4 + name.len()..].trim_start();
            if after.starts_with('{') {
                pending_mod = Some(name);
            }
            i += 4;
            continue;
        }
        if boundary && (rest.starts_with("crate::") || rest.starts_with("super::")) {
            let p: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                .collect();
            out.push((here(&stack), p.trim_end_matches(':').to_string(), false));
            i += p.len();
            continue;
        }
        match bytes[i] {
            b'{' => {
                depth += 1;
                if let Some(n) = pending_mod.take() {
                    stack.push((n, depth));
                }
            }
            b'}' => {
                if stack.last().is_some_and(|&(_, d)| d == depth) {
                    stack.pop();
                }
                depth -= 1;
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// `path` as named in module `at`, made absolute (`None`: not a crate path).
fn absolute(at: &str, path: &str) -> Option<Vec<String>> {
    let mut parts: Vec<&str> = path.split("::").collect();
    let mut base: Vec<String> = match parts.first() {
        Some(&"crate") => {
            parts.remove(0);
            Vec::new()
        }
        Some(&"super") | Some(&"self") => at
            .split("::")
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect(),
        _ => return None,
    };
    while let Some(&first) = parts.first() {
        match first {
            "super" => {
                base.pop();
            }
            "self" => {}
            _ => break,
        }
        parts.remove(0);
    }
    base.extend(parts.into_iter().filter(|p| !p.is_empty()).map(String::from));
    Some(base)
}

struct Graph {
    modules: BTreeSet<String>,
    /// Per module, its public re-exports: name -> absolute path.
    reexports: BTreeMap<String, BTreeMap<String, Vec<String>>>,
    edges: BTreeMap<String, BTreeSet<String>>,
}

impl Graph {
    /// The module that defines what `path` names (following re-exports), if a module of
    /// the crate.
    fn resolve(&self, path: &[String], hops: usize) -> Option<String> {
        let mut best = None;
        for i in (0..=path.len()).rev() {
            let m = path[..i].join("::");
            if self.modules.contains(&m) {
                best = Some((m, i));
                break;
            }
        }
        let (m, i) = best?;
        if hops < 8 {
            if let Some(target) = path.get(i).and_then(|n| self.reexports.get(&m)?.get(n)) {
                let mut t = target.clone();
                t.extend(path[i + 1..].iter().cloned());
                if let Some(r) = self.resolve(&t, hops + 1) {
                    return Some(r);
                }
            }
        }
        Some(m)
    }
}

fn graph() -> Graph {
    let modules: BTreeSet<String> = SOURCES.iter().map(|(f, _)| module_of(f)).collect();
    let named: Vec<(String, Vec<Named>)> = SOURCES
        .iter()
        .map(|(f, src)| (module_of(f), paths(&module_of(f), src)))
        .collect();
    let mut g = Graph {
        modules,
        reexports: BTreeMap::new(),
        edges: BTreeMap::new(),
    };
    for (_, ps) in &named {
        for (at, p, public) in ps {
            if let (true, Some(abs)) = (*public, absolute(at, p)) {
                if let Some(name) = abs.last() {
                    g.reexports
                        .entry(at.clone())
                        .or_default()
                        .insert(name.clone(), abs.clone());
                }
            }
        }
    }
    for (file_module, ps) in &named {
        for (at, p, _) in ps {
            let Some(abs) = absolute(at, p) else { continue };
            let Some(to) = g.resolve(&abs, 0) else { continue };
            let from = file_module;
            let within = |a: &str, b: &str| b.is_empty() || a == b || a.starts_with(&format!("{b}::"));
            if within(&to, from) || within(from, &to) {
                continue; // the same module, a submodule, or an ancestor
            }
            g.edges.entry(from.clone()).or_default().insert(to);
        }
    }
    g
}

/// The strongly connected components of more than one module (Tarjan's algorithm).
fn cycles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct T<'a> {
        edges: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a str) {
        let n = t.index.len();
        t.index.insert(v, n);
        t.low.insert(v, n);
        t.stack.push(v);
        t.on.insert(v);
        if let Some(ws) = t.edges.get(v) {
            for w in ws {
                let w = w.as_str();
                if !t.index.contains_key(w) {
                    visit(t, w);
                    let lw = t.low[w];
                    let lv = t.low.get_mut(v).unwrap();
                    *lv = (*lv).min(lw);
                } else if t.on.contains(w) {
                    let iw = t.index[w];
                    let lv = t.low.get_mut(v).unwrap();
                    *lv = (*lv).min(iw);
                }
            }
        }
        if t.low[v] == t.index[v] {
            let mut comp = Vec::new();
            loop {
                let w = t.stack.pop().unwrap();
                t.on.remove(w);
                comp.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                t.out.push(comp);
            }
        }
    }
    let mut t = T {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in edges.keys() {
        if !t.index.contains_key(v.as_str()) {
            visit(&mut t, v);
        }
    }
    t.out
}

#[test]
fn src_has_no_import_cycle() {
    let g = graph();
    let found = cycles(&g.edges);
    let shown: Vec<String> = found
        .iter()
        .map(|c| {
            let inner: Vec<String> = c
                .iter()
                .map(|m| {
                    let to: Vec<&String> = g.edges[m].iter().filter(|t| c.contains(t)).collect();
                    format!("{m} -> {to:?}")
                })
                .collect();
            inner.join("; ")
        })
        .collect();
    assert!(found.is_empty(), "import cycles in src/: {shown:#?}");
    assert!(
        g.edges.len() > 30,
        "the graph was read: {} modules with edges",
        g.edges.len()
    );
}

#[test]
fn cuda_never_names_device() {
    let g = graph();
    let up: Vec<(&String, Vec<&String>)> = g
        .edges
        .iter()
        .filter(|(m, _)| m.starts_with("cuda"))
        .map(|(m, to)| {
            (
                m,
                to.iter().filter(|t| t.starts_with("device")).collect::<Vec<_>>(),
            )
        })
        .filter(|(_, to)| !to.is_empty())
        .collect();
    assert!(up.is_empty(), "src/cuda/ names src/device/: {up:?}");
}

/// The checks can fail: a cycle and an upward edge written here are found.
#[test]
fn the_checks_see_a_cycle_and_an_upward_edge() {
    let a = paths(
        "device::pages",
        "use super::backend::Backend;\nfn f() { crate::cuda::vmm::x(); }\n",
    );
    assert_eq!(
        a.iter().map(|(_, p, _)| p.as_str()).collect::<Vec<_>>(),
        ["super::backend::Backend", "crate::cuda::vmm::x"]
    );
    let inline = paths(
        "device::backend",
        "mod fake {\n    use super::super::pages::{PageHeap, X};\n}\n",
    );
    assert_eq!(
        absolute(&inline[0].0, &inline[0].1).unwrap().join("::"),
        "device::pages::PageHeap"
    );
    let mut edges = BTreeMap::new();
    edges.insert("a".to_string(), BTreeSet::from(["b".to_string()]));
    edges.insert("b".to_string(), BTreeSet::from(["c".to_string()]));
    edges.insert("c".to_string(), BTreeSet::from(["a".to_string()]));
    assert_eq!(cycles(&edges), vec![vec!["a", "b", "c"]]);
    // The crate's own graph with one upward edge added has a cycle.
    let mut g = graph();
    g.edges
        .entry("cuda::vmm".to_string())
        .or_default()
        .insert("device::pages".to_string());
    assert!(!cycles(&g.edges).is_empty(), "vmm -> pages -> ... -> vmm");
}

/// Where the sources are present, the list above names every file of `src/`.
#[test]
fn the_list_of_sources_is_complete() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    if !root.is_dir() {
        println!("skipped: the sources are not here (checked where they are: CI, a checkout)");
        return;
    }
    fn walk(dir: &std::path::Path, root: &std::path::Path, out: &mut BTreeSet<String>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p, root, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let rel = p.strip_prefix(root).unwrap().to_string_lossy().replace('\\', "/");
                out.insert(rel);
            }
        }
    }
    let mut present = BTreeSet::new();
    walk(&root, &root, &mut present);
    let listed: BTreeSet<String> = SOURCES.iter().map(|(f, _)| f.to_string()).collect();
    let missing: Vec<&String> = present.difference(&listed).collect();
    assert!(
        missing.is_empty(),
        "add these to SOURCES in tests/all/layers.rs: {missing:?}"
    );
}
