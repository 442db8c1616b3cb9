//! No import cycle between the core's files (issue 22): every file under `core/src` is a room,
//! every path into another file of the crate an arrow, and the arrows must not run in a circle.
//!
//! The graph is read from the source text, with no compiler help: a file is the module it
//! defines (`a/b.rs` is `a::b`, `a/mod.rs` and `a.rs` are `a`, `lib.rs` the crate root), and an
//! arrow goes from a file to the deepest module file a path in it names: `use crate::…`,
//! `super::…`, `self::…`, paths relative to the module (`child::…`) and paths through a name a
//! `use` brought in, in `use` statements and in code alike (inline `mod tests { … }` included;
//! comments and string literals are not code). A path that ends at a name a parent module merely
//! re-exports (`pub use child::Name`) is followed to the child that defines it.
//!
//! Allowed, and not arrows: a parent module declaring its children (`mod child;`) and
//! re-exporting them (`pub use child::…` of its own descendants) — that is what a `mod.rs` (or
//! `lib.rs`) is for. Anything else a parent takes from its child is an arrow like any other.
//!
//! `PD_BRIDGE_CYCLE_SRC=/some/core/src` checks another tree (an older commit, say) instead.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// One lexical token of the parts of Rust source this test reads.
#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ident(String),
    /// `::`
    Path,
    Punct(char),
}

/// Tokens with their line numbers; comments, strings and char literals dropped.
fn tokenize(src: &str) -> Vec<(Tok, usize)> {
    let b: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let (mut i, mut line) = (0usize, 1usize);
    let n = b.len();
    while i < n {
        let c = b[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c == '/' && i + 1 < n && b[i + 1] == '/' {
            while i < n && b[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && i + 1 < n && b[i + 1] == '*' {
            let mut depth = 0;
            while i < n {
                if b[i] == '/' && i + 1 < n && b[i + 1] == '*' {
                    depth += 1;
                    i += 2;
                } else if b[i] == '*' && i + 1 < n && b[i + 1] == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if b[i] == '\n' {
                        line += 1;
                    }
                    i += 1;
                }
            }
        } else if c == 'r' && i + 1 < n && (b[i + 1] == '"' || (b[i + 1] == '#' && i + 2 < n && (b[i + 2] == '"' || b[i + 2] == '#'))) {
            // Raw string r"…", r#"…"#.
            let mut j = i + 1;
            let mut hashes = 0;
            while j < n && b[j] == '#' {
                hashes += 1;
                j += 1;
            }
            j += 1; // the opening quote
            while j < n {
                if b[j] == '\n' {
                    line += 1;
                }
                if b[j] == '"' && (0..hashes).all(|k| j + 1 + k < n && b[j + 1 + k] == '#') {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            i = j;
        } else if c == '"' || (c == 'b' && i + 1 < n && b[i + 1] == '"') {
            let mut j = if c == 'b' { i + 2 } else { i + 1 };
            while j < n && b[j] != '"' {
                if b[j] == '\\' {
                    j += 1;
                }
                if j < n && b[j] == '\n' {
                    line += 1;
                }
                j += 1;
            }
            i = j + 1;
        } else if c == '\'' {
            // A char literal ('a', '\n', '\u{..}') or a lifetime ('a).
            if i + 1 < n && b[i + 1] == '\\' {
                let mut j = i + 2;
                while j < n && b[j] != '\'' {
                    j += 1;
                }
                i = j + 1;
            } else if i + 2 < n && b[i + 2] == '\'' {
                i += 3;
            } else {
                i += 1;
                while i < n && (b[i].is_alphanumeric() || b[i] == '_') {
                    i += 1;
                }
            }
        } else if c.is_alphabetic() || c == '_' {
            let s = i;
            while i < n && (b[i].is_alphanumeric() || b[i] == '_') {
                i += 1;
            }
            let word: String = b[s..i].iter().collect();
            // `r#ident`
            out.push((Tok::Ident(word.trim_start_matches("r#").to_string()), line));
        } else if c.is_ascii_digit() {
            while i < n && (b[i].is_alphanumeric() || b[i] == '_' || b[i] == '.') {
                i += 1;
            }
        } else if c == ':' && i + 1 < n && b[i + 1] == ':' {
            out.push((Tok::Path, line));
            i += 2;
        } else {
            out.push((Tok::Punct(c), line));
            i += 1;
        }
    }
    out
}

/// A module path, from the crate root.
type ModPath = Vec<String>;

/// What one file says about other modules.
#[derive(Default, Debug)]
struct FileRefs {
    /// Absolute paths named (use leaves and paths in code), with the line.
    paths: Vec<(ModPath, usize)>,
    /// `mod child;` declarations and `pub use` leaves: (path, line), for the parent rule.
    declared: Vec<ModPath>,
    /// `pub use` leaves: (path, line, the name it makes visible).
    reexports: Vec<(ModPath, usize, String)>,
    /// Identifiers in code (outside `use` statements): a re-exported name used here is an arrow.
    code: std::collections::HashSet<String>,
    /// Names a `pub use` makes visible here: name -> absolute source path.
    exports: HashMap<String, ModPath>,
}

struct Crate {
    /// Module path -> file (relative to src).
    files: BTreeMap<ModPath, String>,
}

impl Crate {
    fn is_module(&self, p: &[String]) -> bool {
        self.files.contains_key(p)
    }
}

fn module_of(rel: &str) -> ModPath {
    let no_ext = rel.strip_suffix(".rs").unwrap_or(rel);
    let mut parts: Vec<String> = no_ext.split('/').map(str::to_string).collect();
    if parts.last().map(String::as_str) == Some("mod") || (parts.len() == 1 && parts[0] == "lib") {
        parts.pop();
    }
    parts
}

/// Expand a `use` tree starting at `toks[i]` (after `use`) into leaves: (segments, alias).
fn use_tree(toks: &[(Tok, usize)], i: &mut usize, prefix: &[String], out: &mut Vec<(Vec<String>, Option<String>)>) {
    let mut segs = prefix.to_vec();
    loop {
        match toks.get(*i).map(|t| &t.0) {
            Some(Tok::Ident(s)) => {
                segs.push(s.clone());
                *i += 1;
                match toks.get(*i).map(|t| &t.0) {
                    Some(Tok::Path) => {
                        *i += 1;
                        continue;
                    }
                    Some(Tok::Ident(a)) if a == "as" => {
                        let alias = match toks.get(*i + 1).map(|t| &t.0) {
                            Some(Tok::Ident(x)) => Some(x.clone()),
                            _ => None,
                        };
                        *i += 2;
                        out.push((segs, alias));
                        return;
                    }
                    _ => {
                        out.push((segs, None));
                        return;
                    }
                }
            }
            Some(Tok::Punct('*')) => {
                *i += 1;
                out.push((segs, Some("*".into())));
                return;
            }
            Some(Tok::Punct('{')) => {
                *i += 1;
                loop {
                    match toks.get(*i).map(|t| &t.0) {
                        Some(Tok::Punct('}')) => {
                            *i += 1;
                            return;
                        }
                        Some(Tok::Punct(',')) => *i += 1,
                        None => return,
                        _ => use_tree(toks, i, &segs, out),
                    }
                }
            }
            _ => {
                out.push((segs, None));
                return;
            }
        }
    }
}

/// Resolve `segs` as written in module `here` (`crate`, `super`, `self`, a child, or an alias)
/// to an absolute path, if it is a path into this crate.
fn absolute(segs: &[String], here: &[String], aliases: &HashMap<String, ModPath>, krate: &Crate) -> Option<ModPath> {
    let first = segs.first()?;
    let mut base: ModPath = match first.as_str() {
        "crate" => Vec::new(),
        "self" => here.to_vec(),
        "super" => {
            let mut b = here.to_vec();
            let mut k = 0;
            while segs.get(k).map(String::as_str) == Some("super") {
                b.pop()?;
                k += 1;
            }
            b.extend(segs[k..].iter().cloned());
            return Some(b);
        }
        _ => {
            let mut child = here.to_vec();
            child.push(first.clone());
            if krate.is_module(&child) {
                child.extend(segs[1..].iter().cloned());
                return Some(child);
            }
            let mut a = aliases.get(first)?.clone();
            a.extend(segs[1..].iter().cloned());
            return Some(a);
        }
    };
    base.extend(segs[1..].iter().cloned());
    Some(base)
}

fn scan(rel: &str, src: &str, krate: &Crate) -> FileRefs {
    let toks = tokenize(src);
    let file_mod = module_of(rel);
    let mut refs = FileRefs::default();
    // Inline modules: (name, brace depth at which it opened).
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let mut aliases: HashMap<String, ModPath> = HashMap::new();
    let here = |inline: &Vec<(String, usize)>| {
        let mut m = file_mod.clone();
        m.extend(inline.iter().map(|(n, _)| n.clone()));
        m
    };
    let mut i = 0;
    while i < toks.len() {
        let (t, line) = (&toks[i].0, toks[i].1);
        match t {
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => {
                depth = depth.saturating_sub(1);
                while inline.last().is_some_and(|(_, d)| *d > depth) {
                    inline.pop();
                }
            }
            Tok::Ident(k) if k == "mod" => {
                if let (Some((Tok::Ident(name), _)), Some((next, _))) = (toks.get(i + 1), toks.get(i + 2)) {
                    match next {
                        Tok::Punct(';') => {
                            let mut p = here(&inline);
                            p.push(name.clone());
                            refs.declared.push(p);
                        }
                        Tok::Punct('{') => {
                            depth += 1;
                            inline.push((name.clone(), depth));
                            i += 3;
                            continue;
                        }
                        _ => {}
                    }
                }
            }
            Tok::Ident(k) if k == "use" => {
                // `pub use` / `pub(crate) use`: a re-export.
                let public = i >= 1 && (matches!(&toks[i - 1].0, Tok::Ident(p) if p == "pub") || (i >= 4 && matches!(&toks[i - 1].0, Tok::Punct(')')) && matches!(&toks[i - 4].0, Tok::Ident(p) if p == "pub")));
                let mut j = i + 1;
                let mut leaves = Vec::new();
                use_tree(&toks, &mut j, &[], &mut leaves);
                let m = here(&inline);
                for (segs, alias) in leaves {
                    // `use a::b::{self}` names `a::b`.
                    let segs: Vec<String> = if segs.last().map(String::as_str) == Some("self") { segs[..segs.len() - 1].to_vec() } else { segs };
                    let Some(abs) = absolute(&segs, &m, &aliases, krate) else { continue };
                    let name = alias.clone().unwrap_or_else(|| segs.last().cloned().unwrap_or_default());
                    if krate.is_module(&abs) && name != "*" {
                        aliases.insert(name.clone(), abs.clone());
                    }
                    if public && name != "*" {
                        refs.exports.insert(name.clone(), abs.clone());
                    }
                    if public {
                        refs.reexports.push((abs, line, name));
                    } else {
                        refs.paths.push((abs, line));
                    }
                }
                i = j;
                continue;
            }
            Tok::Ident(word) if !matches!(toks.get(i + 1), Some((Tok::Path, _))) => {
                refs.code.insert(word.clone());
            }
            // A path in code: `a::b::c`. (Not preceded by `::`: that is the middle of one.)
            Tok::Ident(first) if i == 0 || toks[i - 1].0 != Tok::Path => {
                refs.code.insert(first.clone());
                let mut segs = vec![first.clone()];
                let mut j = i + 1;
                while let (Some((Tok::Path, _)), Some((Tok::Ident(s), _))) = (toks.get(j), toks.get(j + 1)) {
                    segs.push(s.clone());
                    j += 2;
                }
                if let Some(abs) = absolute(&segs, &here(&inline), &aliases, krate) {
                    refs.paths.push((abs, line));
                }
                i = j;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    refs
}

/// The file a path leads to: its deepest module, through re-exports of parents to the child
/// that defines the name.
fn target(path: &[String], krate: &Crate, refs: &HashMap<String, FileRefs>, hops: usize) -> Option<String> {
    let mut k = path.len();
    while k > 0 && !krate.is_module(&path[..k]) {
        k -= 1;
    }
    let file = krate.files.get(&path[..k])?.clone();
    if hops < 8 {
        if let Some(name) = path.get(k) {
            if let Some(src) = refs.get(&file).and_then(|r| r.exports.get(name)) {
                let mut p = src.clone();
                p.extend(path[k + 1..].iter().cloned());
                if p != path {
                    return target(&p, krate, refs, hops + 1).or(Some(file));
                }
            }
        }
    }
    Some(file)
}

/// An arrow: from, to, and the line in `from` that makes it.
type Edges = BTreeMap<(String, String), usize>;

fn graph(sources: &[(String, String)]) -> Edges {
    let krate = Crate { files: sources.iter().map(|(rel, _)| (module_of(rel), rel.clone())).collect() };
    let refs: HashMap<String, FileRefs> = sources.iter().map(|(rel, src)| (rel.clone(), scan(rel, src, &krate))).collect();
    let mut edges = Edges::new();
    for (rel, _) in sources {
        let r = &refs[rel];
        let me = module_of(rel);
        for (p, line) in &r.paths {
            if let Some(to) = target(p, &krate, &refs, 0) {
                if &to != rel {
                    edges.entry((rel.clone(), to)).or_insert(*line);
                }
            }
        }
        // A parent re-exporting its own descendants is allowed (unless it also uses the name in its
        // own code); any other re-export is an arrow.
        for (p, line, name) in &r.reexports {
            if p.starts_with(&me) && p.len() > me.len() && !r.code.contains(name) {
                continue;
            }
            if let Some(to) = target(p, &krate, &refs, 0) {
                if &to != rel {
                    edges.entry((rel.clone(), to)).or_insert(*line);
                }
            }
        }
    }
    edges
}

/// Strongly connected components of more than one file (Tarjan).
fn cycles(edges: &Edges) -> Vec<Vec<String>> {
    let nodes: BTreeSet<&String> = edges.keys().flat_map(|(a, b)| [a, b]).collect();
    let nodes: Vec<&String> = nodes.into_iter().collect();
    let idx: HashMap<&String, usize> = nodes.iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let mut adj = vec![Vec::new(); nodes.len()];
    for (a, b) in edges.keys() {
        adj[idx[a]].push(idx[b]);
    }
    struct T {
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    fn visit(v: usize, adj: &[Vec<usize>], t: &mut T) {
        t.index[v] = Some(t.next);
        t.low[v] = t.next;
        t.next += 1;
        t.stack.push(v);
        t.on[v] = true;
        for &w in &adj[v] {
            match t.index[w] {
                None => {
                    visit(w, adj, t);
                    t.low[v] = t.low[v].min(t.low[w]);
                }
                Some(iw) if t.on[w] => t.low[v] = t.low[v].min(iw),
                _ => {}
            }
        }
        if Some(t.low[v]) == t.index[v] {
            let mut c = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on[w] = false;
                c.push(w);
                if w == v {
                    break;
                }
            }
            if c.len() > 1 {
                t.out.push(c);
            }
        }
    }
    let n = nodes.len();
    let mut t = T { index: vec![None; n], low: vec![0; n], on: vec![false; n], stack: Vec::new(), next: 0, out: Vec::new() };
    for v in 0..n {
        if t.index[v].is_none() {
            visit(v, &adj, &mut t);
        }
    }
    let mut out: Vec<Vec<String>> = t.out.into_iter().map(|c| {
        let mut c: Vec<String> = c.into_iter().map(|i| nodes[i].clone()).collect();
        c.sort();
        c
    }).collect();
    out.sort_by_key(|c| std::cmp::Reverse(c.len()));
    out
}

fn read_tree(root: &Path) -> Vec<(String, String)> {
    fn walk(dir: &Path, root: &Path, out: &mut Vec<(String, String)>) {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())).map(|e| e.unwrap().path()).collect();
        entries.sort();
        for p in entries {
            if p.is_dir() {
                walk(&p, root, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let rel = p.strip_prefix(root).unwrap().to_string_lossy().replace('\\', "/");
                out.push((rel, std::fs::read_to_string(&p).unwrap()));
            }
        }
    }
    let mut out = Vec::new();
    walk(root, root, &mut out);
    out
}

/// The arrows inside a cycle, for the failure message.
fn describe(c: &[String], edges: &Edges) -> String {
    let inside: BTreeSet<&String> = c.iter().collect();
    let arrows: Vec<String> = edges.iter().filter(|((a, b), _)| inside.contains(a) && inside.contains(b)).map(|((a, b), l)| format!("    {a}:{l} -> {b}")).collect();
    format!("  {} files: {}\n{}", c.len(), c.join(", "), arrows.join("\n"))
}

#[test]
fn the_core_has_no_import_cycle() {
    let root = std::env::var_os("PD_BRIDGE_CYCLE_SRC").map(PathBuf::from).unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    let sources = read_tree(&root);
    assert!(sources.len() > 20, "{}: only {} files", root.display(), sources.len());
    let edges = graph(&sources);
    // The graph is not empty: the reader did find arrows (a parser that saw none would pass).
    assert!(edges.len() > 50, "only {} arrows found in {}", edges.len(), root.display());
    let found = cycles(&edges);
    let text: Vec<String> = found.iter().map(|c| describe(c, &edges)).collect();
    assert!(found.is_empty(), "import cycles between the files of {} (largest first):\n{}", root.display(), text.join("\n"));
}

fn tree(files: &[(&str, &str)]) -> Vec<(String, String)> {
    files.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect()
}

/// The reader itself: it must see a cycle through `use crate::…`, through `super::…` and through
/// a path in code, but not a parent that only declares and re-exports its children.
#[test]
fn the_reader_finds_cycles_and_allows_parents() {
    let base = [
        ("lib.rs", "pub mod a;\npub mod b;\npub mod p;\npub use a::A;"),
        ("p/mod.rs", "//! use crate::a::A; (a comment)\nmod c;\npub use c::C;\nconst S: &str = \"crate::a::A\";"),
        ("p/c.rs", "use super::super::b::B;\npub struct C;"),
        ("b.rs", "pub struct B;"),
    ];
    let clean = tree(&[base.as_slice(), &[("a.rs", "use crate::p::C;\npub struct A;")]].concat());
    assert!(cycles(&graph(&clean)).is_empty(), "{:?}", graph(&clean));
    // `crate::p::C` is re-exported by p/mod.rs: the arrow goes to p/c.rs.
    assert!(graph(&clean).contains_key(&("a.rs".to_string(), "p/c.rs".to_string())));

    // b -> a -> p/c -> b, the middle arrow a path in code, the last one through `super`.
    let mut cyc = clean.clone();
    cyc[3].1 = "pub struct B(crate::a::A);".into();
    let c = cycles(&graph(&cyc));
    assert_eq!(c, vec![vec!["a.rs".to_string(), "b.rs".into(), "p/c.rs".into()]]);

    // A parent that uses its child's item, and the child that uses the parent's: a cycle.
    let mut back = clean.clone();
    back[1].1 = "mod c;\npub struct D;\npub fn f() -> c::C { c::C }".into();
    back[2].1 = "use super::D;\npub struct C;".into();
    let c = cycles(&graph(&back));
    assert_eq!(c, vec![vec!["p/c.rs".to_string(), "p/mod.rs".into()]]);

    // A parent that re-exports its child's item and uses it in its own code depends on it.
    let mut uses = clean.clone();
    uses[1].1 = "mod c;\npub use c::C;\npub struct D;\npub fn f() -> C { C }".into();
    uses[2].1 = "use super::D;\npub struct C;".into();
    let c = cycles(&graph(&uses));
    assert_eq!(c, vec![vec!["p/c.rs".to_string(), "p/mod.rs".into()]]);

    // An inline `mod tests` whose `use super::*` is the file itself, and an alias brought in by `use`.
    let mut inline = clean.clone();
    inline[3].1 = "use crate::p;\npub struct B;\n#[cfg(test)]\nmod tests {\n use super::*;\n fn f(_: p::C) {}\n}".into();
    let c = cycles(&graph(&inline));
    assert_eq!(c, vec![vec!["b.rs".to_string(), "p/c.rs".into()]]);
}
