//! The import check: no two source files of a crate import each other, and no two
//! folders (a crate's top-level module directories) import each other through any files.
//!
//! Every `.rs` file under each workspace crate's `src/` (the library's module tree: not
//! `src/bin/`, nor `main.rs` beside a `lib.rs`) is parsed with `syn`; the `crate::…`,
//! `super::…`, `self::…` and child-module paths it names, in `use` trees (grouped ones
//! included) and inline in its items, are mapped to the module file they land in. Items
//! under `#[cfg(test)]` are left out: test code may reach anywhere. The crate root
//! (`lib.rs`/`main.rs`) is left out too: it declares the modules and re-exports the
//! crate's surface, so every module "imports" it and it "imports" them.
//!
//! A module and its own submodules count as one for the file check (the parent declares
//! its children and re-exports from them; they use what it defines). A file `foo.rs`
//! beside a directory `foo/` belongs to folder `foo`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use proc_macro2::{Spacing, TokenStream, TokenTree};
use quote::ToTokens as _;

/// Folder loops in the driver that a restructure in progress removes, as
/// `"a/ <-> b/"`; each is printed when the check runs, and is to be deleted here once the
/// loop is gone (the `prepare/ <-> sharing/` loop went with the sharing seam).
const KNOWN_DRIVER_LOOPS: &[&str] = &[];

/// One module path (`crate::a::b` is `["a", "b"]`).
type ModPath = Vec<String>;

/// A path found in a file, before resolution: how it starts and its segments after that.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Start {
    /// `crate::…`
    Crate,
    /// `super::…` as many times as the count, then the rest.
    Super(usize),
    /// `self::…` or a child module's name: relative to the current module.
    Here,
}

/// A path named in a file: where it starts, the module it is named in, its segments.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Named {
    start: Start,
    /// The module (file module plus inline `mod`s) the path is written in.
    within: ModPath,
    segments: Vec<String>,
}

impl Named {
    /// The absolute module path this names (its last segments may be items).
    fn absolute(&self) -> Option<ModPath> {
        let mut base = match self.start {
            Start::Crate => Vec::new(),
            Start::Here => self.within.clone(),
            Start::Super(n) => {
                if n > self.within.len() {
                    return None;
                }
                self.within[..self.within.len() - n].to_vec()
            }
        };
        base.extend(self.segments.iter().cloned());
        Some(base)
    }
}

/// Whether the attributes hold `#[cfg(test)]`.
fn is_test_only(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("cfg")
            && a.meta
                .require_list()
                .is_ok_and(|l| l.tokens.to_string() == "test")
    })
}

/// The paths named in a file whose module is `module`; `children(m)` says which names
/// are child modules of module `m` (so `foo::bar` in `m` means `m::foo::bar`).
fn named_paths(
    src: &str,
    module: &ModPath,
    children: &dyn Fn(&ModPath) -> BTreeSet<String>,
) -> Result<Vec<Named>, syn::Error> {
    let file = syn::parse_file(src)?;
    let mut out = Vec::new();
    walk_items(&file.items, module, children, &mut out);
    Ok(out)
}

fn walk_items(
    items: &[syn::Item],
    within: &ModPath,
    children: &dyn Fn(&ModPath) -> BTreeSet<String>,
    out: &mut Vec<Named>,
) {
    // Child modules declared here, file-backed or inline.
    let mut kids = children(within);
    for item in items {
        if let syn::Item::Mod(m) = item {
            kids.insert(m.ident.to_string());
        }
    }
    for item in items {
        match item {
            syn::Item::Use(u) if !is_test_only(&u.attrs) => {
                use_tree(&u.tree, &mut Vec::new(), within, &kids, out);
            }
            syn::Item::Mod(m) if !is_test_only(&m.attrs) => {
                if let Some((_, inner)) = &m.content {
                    let mut path = within.clone();
                    path.push(m.ident.to_string());
                    walk_items(inner, &path, children, out);
                }
            }
            syn::Item::Use(_) | syn::Item::Mod(_) => {}
            other => {
                let attrs: &[syn::Attribute] = match other {
                    syn::Item::Fn(f) => &f.attrs,
                    syn::Item::Impl(i) => &i.attrs,
                    syn::Item::Struct(s) => &s.attrs,
                    syn::Item::Enum(e) => &e.attrs,
                    syn::Item::Const(c) => &c.attrs,
                    syn::Item::Static(s) => &s.attrs,
                    syn::Item::Trait(t) => &t.attrs,
                    syn::Item::Type(t) => &t.attrs,
                    syn::Item::Macro(m) => &m.attrs,
                    _ => &[],
                };
                if !is_test_only(attrs) {
                    inline_paths(other.to_token_stream(), within, &kids, out);
                }
            }
        }
    }
}

/// Walks a `use` tree; `prefix` is the path above this subtree.
fn use_tree(
    tree: &syn::UseTree,
    prefix: &mut Vec<String>,
    within: &ModPath,
    kids: &BTreeSet<String>,
    out: &mut Vec<Named>,
) {
    match tree {
        syn::UseTree::Path(p) => {
            prefix.push(p.ident.to_string());
            use_tree(&p.tree, prefix, within, kids, out);
            prefix.pop();
        }
        syn::UseTree::Name(n) => {
            let mut full = prefix.clone();
            full.push(n.ident.to_string());
            push_named(&full, within, kids, out);
        }
        syn::UseTree::Rename(r) => {
            let mut full = prefix.clone();
            full.push(r.ident.to_string());
            push_named(&full, within, kids, out);
        }
        syn::UseTree::Glob(_) => push_named(prefix, within, kids, out),
        syn::UseTree::Group(g) => {
            for t in &g.items {
                use_tree(t, prefix, within, kids, out);
            }
        }
    }
}

/// Records `segments` if it starts inside this crate.
fn push_named(
    segments: &[String],
    within: &ModPath,
    kids: &BTreeSet<String>,
    out: &mut Vec<Named>,
) {
    let Some(first) = segments.first() else {
        return;
    };
    let (start, rest) = match first.as_str() {
        "crate" => (Start::Crate, &segments[1..]),
        "self" => (Start::Here, &segments[1..]),
        "super" => {
            let n = segments.iter().take_while(|s| *s == "super").count();
            (Start::Super(n), &segments[n..])
        }
        name if kids.contains(name) => (Start::Here, segments),
        _ => return,
    };
    out.push(Named {
        start,
        within: within.clone(),
        segments: rest.to_vec(),
    });
}

/// Finds `crate::a::b`, `super::a`, `self::a` and `child::a` paths in a token stream
/// (strings and comments are single tokens or gone, so they are never read).
fn inline_paths(
    tokens: TokenStream,
    within: &ModPath,
    kids: &BTreeSet<String>,
    out: &mut Vec<Named>,
) {
    let tts: Vec<TokenTree> = tokens.into_iter().collect();
    let is_sep = |i: usize| {
        matches!((tts.get(i), tts.get(i + 1)),
            (Some(TokenTree::Punct(a)), Some(TokenTree::Punct(b)))
                if a.as_char() == ':' && a.spacing() == Spacing::Joint && b.as_char() == ':')
    };
    let mut i = 0;
    while i < tts.len() {
        if let TokenTree::Group(g) = &tts[i] {
            inline_paths(g.stream(), within, kids, out);
            i += 1;
            continue;
        }
        // A path starts at an identifier not preceded by `::` or `.`.
        let preceded = i > 0
            && matches!(&tts[i - 1], TokenTree::Punct(p) if p.as_char() == ':' || p.as_char() == '.');
        let TokenTree::Ident(first) = &tts[i] else {
            i += 1;
            continue;
        };
        if preceded || !is_sep(i + 1) {
            i += 1;
            continue;
        }
        let mut segments = vec![first.to_string()];
        let mut j = i + 1;
        while is_sep(j) {
            match tts.get(j + 2) {
                Some(TokenTree::Ident(id)) => {
                    segments.push(id.to_string());
                    j += 3;
                }
                _ => break,
            }
        }
        if segments.len() > 1 {
            push_named(&segments, within, kids, out);
        }
        i = j.max(i + 1);
    }
}

/// One crate's library module tree: module path -> file (relative to `src/`).
fn module_files(src: &Path) -> BTreeMap<ModPath, PathBuf> {
    fn walk(dir: &Path, src: &Path, out: &mut Vec<PathBuf>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        entries.sort();
        for p in entries {
            let rel = p.strip_prefix(src).unwrap().to_path_buf();
            if p.is_dir() {
                if rel != Path::new("bin") {
                    walk(&p, src, out);
                }
            } else if p.extension().is_some_and(|e| e == "rs") {
                out.push(rel);
            }
        }
    }
    let mut files = Vec::new();
    walk(src, src, &mut files);
    let has_lib = files.iter().any(|f| f == Path::new("lib.rs"));
    let mut map = BTreeMap::new();
    for rel in files {
        let parts: Vec<String> = rel
            .iter()
            .map(|c| c.to_string_lossy().into_owned())
            .collect();
        let (last, dirs) = parts.split_last().unwrap();
        let mut module: ModPath = dirs.to_vec();
        match last.as_str() {
            "lib.rs" if dirs.is_empty() => {}
            "main.rs" if dirs.is_empty() => {
                if has_lib {
                    continue;
                }
            }
            "mod.rs" => {}
            name => module.push(name.trim_end_matches(".rs").to_owned()),
        }
        map.insert(module, rel);
    }
    map
}

/// The folder a file belongs to: its top-level directory, or `foo` for a `foo.rs` beside
/// a directory `foo/`; `None` for other files at the top.
fn folder_of(rel: &Path, dirs: &BTreeSet<String>) -> Option<String> {
    let mut comps = rel.iter();
    let first = comps.next()?.to_string_lossy().into_owned();
    if comps.next().is_some() {
        return Some(first);
    }
    let stem = first.trim_end_matches(".rs");
    dirs.contains(stem).then(|| stem.to_owned())
}

/// A file-to-file import: the importing file, the imported file, the path as written.
#[derive(Debug, Clone)]
struct Edge {
    from: PathBuf,
    to: PathBuf,
    path: String,
    /// The importing file's module is inside the imported one's, or the reverse.
    nested: bool,
}

/// Every import between two different files of the crate at `src` (crate root left out).
fn file_edges(src: &Path) -> Vec<Edge> {
    let files = module_files(src);
    let children = |m: &ModPath| -> BTreeSet<String> {
        files
            .keys()
            .filter(|k| k.len() == m.len() + 1 && k.starts_with(m))
            .map(|k| k[m.len()].clone())
            .collect()
    };
    let mut edges = Vec::new();
    for (module, rel) in &files {
        if module.is_empty() {
            continue;
        }
        let text = std::fs::read_to_string(src.join(rel)).unwrap();
        let named = named_paths(&text, module, &children)
            .unwrap_or_else(|e| panic!("parsing {}: {e}", src.join(rel).display()));
        for n in named {
            let Some(abs) = n.absolute() else { continue };
            // The longest prefix that is a file's module is where the path lands.
            let target = (0..=abs.len())
                .rev()
                .find_map(|len| files.get(&abs[..len]).map(|f| (len, f)));
            let Some((len, to)) = target else { continue };
            if len == 0 || to == rel {
                continue;
            }
            let target_module = &abs[..len];
            edges.push(Edge {
                from: rel.clone(),
                to: to.clone(),
                path: format!("crate::{}", abs.join("::")),
                nested: module.starts_with(target_module) || target_module.starts_with(module),
            });
        }
    }
    edges
}

/// The loops in one crate: files importing each other, and folders importing each other
/// (strongly connected groups of folders), each as one line naming the files involved.
fn loops(src: &Path) -> (Vec<String>, Vec<String>) {
    let edges = file_edges(src);
    let mut by_pair: BTreeMap<(PathBuf, PathBuf), String> = BTreeMap::new();
    for e in edges.iter().filter(|e| !e.nested) {
        by_pair
            .entry((e.from.clone(), e.to.clone()))
            .or_insert_with(|| e.path.clone());
    }
    let mut file_loops = Vec::new();
    for ((a, b), via) in &by_pair {
        if a < b
            && let Some(back) = by_pair.get(&(b.clone(), a.clone()))
        {
            file_loops.push(format!(
                "{} <-> {} ({via}; {back})",
                a.display(),
                b.display()
            ));
        }
    }

    let dirs: BTreeSet<String> = std::fs::read_dir(src)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir() && !p.ends_with("bin"))
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    let mut graph: BTreeMap<String, BTreeMap<String, &Edge>> = BTreeMap::new();
    for e in &edges {
        let (Some(a), Some(b)) = (folder_of(&e.from, &dirs), folder_of(&e.to, &dirs)) else {
            continue;
        };
        if a != b {
            graph.entry(a).or_default().entry(b).or_insert(e);
        }
    }
    let mut folder_loops = Vec::new();
    for group in cycles(&graph) {
        let mut why = Vec::new();
        for a in &group {
            for (b, e) in &graph[a] {
                if group.contains(b) {
                    why.push(format!(
                        "{} -> {} ({})",
                        e.from.display(),
                        e.to.display(),
                        e.path
                    ));
                }
            }
        }
        let names: Vec<String> = group.iter().map(|g| format!("{g}/")).collect();
        folder_loops.push(format!("{} ({})", names.join(" <-> "), why.join("; ")));
    }
    (file_loops, folder_loops)
}

/// The strongly connected groups of more than one node (Tarjan), each sorted.
fn cycles<V>(graph: &BTreeMap<String, BTreeMap<String, V>>) -> Vec<BTreeSet<String>> {
    struct State<'g, V> {
        graph: &'g BTreeMap<String, BTreeMap<String, V>>,
        index: BTreeMap<&'g str, usize>,
        low: BTreeMap<&'g str, usize>,
        stack: Vec<&'g str>,
        on_stack: BTreeSet<&'g str>,
        out: Vec<BTreeSet<String>>,
    }
    fn visit<'g, V>(s: &mut State<'g, V>, v: &'g str) {
        let i = s.index.len();
        s.index.insert(v, i);
        s.low.insert(v, i);
        s.stack.push(v);
        s.on_stack.insert(v);
        if let Some(next) = s.graph.get(v) {
            for w in next.keys() {
                let w = w.as_str();
                if !s.index.contains_key(w) {
                    visit(s, w);
                    let lw = s.low[w];
                    let lv = s.low.get_mut(v).unwrap();
                    *lv = (*lv).min(lw);
                } else if s.on_stack.contains(w) {
                    let iw = s.index[w];
                    let lv = s.low.get_mut(v).unwrap();
                    *lv = (*lv).min(iw);
                }
            }
        }
        if s.low[v] == s.index[v] {
            let mut group = BTreeSet::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                group.insert(w.to_owned());
                if w == v {
                    break;
                }
            }
            if group.len() > 1 {
                s.out.push(group);
            }
        }
    }
    let mut s = State {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !s.index.contains_key(v.as_str()) {
            visit(&mut s, v);
        }
    }
    s.out
}

/// The workspace's crates with a `src/`: `(name as a directory, src path)`.
fn crates() -> Vec<(String, PathBuf)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut out = Vec::new();
    for parent in [root.clone(), root.join("hack")] {
        let mut dirs: Vec<PathBuf> = std::fs::read_dir(&parent)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        dirs.sort();
        for d in dirs {
            if d.join("Cargo.toml").is_file() && d.join("src").is_dir() {
                let name = d
                    .strip_prefix(&root)
                    .unwrap()
                    .to_string_lossy()
                    .into_owned();
                out.push((name, d.join("src")));
            }
        }
    }
    out
}

#[test]
fn no_crate_has_import_loops() {
    let crates = crates();
    assert!(
        crates.iter().any(|(n, _)| n == "kubelet-plugin")
            && crates.iter().any(|(n, _)| n == "driver"),
        "{crates:?}"
    );
    let mut failures = Vec::new();
    let mut known_seen = BTreeSet::new();
    for (name, src) in &crates {
        let (files, folders) = loops(src);
        for l in files {
            failures.push(format!("{name}: files import each other: {l}"));
        }
        for l in folders {
            let pair = l.split(" (").next().unwrap_or_default().to_owned();
            if name == "driver" && KNOWN_DRIVER_LOOPS.contains(&pair.as_str()) {
                println!("known driver folder loop (to remove): {l}");
                known_seen.insert(pair);
                continue;
            }
            failures.push(format!("{name}: folders import each other: {l}"));
        }
    }
    for k in KNOWN_DRIVER_LOOPS {
        if !known_seen.contains(*k) {
            println!("KNOWN_DRIVER_LOOPS lists {k}, which is gone: delete it from the list");
        }
    }
    assert!(
        failures.is_empty(),
        "import loops:\n{}",
        failures.join("\n")
    );
}

#[cfg(test)]
mod parser {
    use super::*;

    fn parse(src: &str, module: &[&str], kids: &[&str]) -> Vec<String> {
        let module: ModPath = module.iter().map(|s| s.to_string()).collect();
        let kids: BTreeSet<String> = kids.iter().map(|s| s.to_string()).collect();
        let top = module.clone();
        let children = move |m: &ModPath| {
            if *m == top {
                kids.clone()
            } else {
                BTreeSet::new()
            }
        };
        named_paths(src, &module, &children)
            .unwrap()
            .iter()
            .map(|n| {
                n.absolute()
                    .map_or("<outside>".to_owned(), |a| a.join("::"))
            })
            .collect()
    }

    #[test]
    fn use_trees_grouped_renamed_and_globbed() {
        let got = parse(
            "use crate::{a::b, c::{d, e as f}, g::*};\nuse std::fmt;\nuse cleave_driver::x;",
            &["m"],
            &[],
        );
        assert_eq!(got, ["a::b", "c::d", "c::e", "g"]);
    }

    #[test]
    fn super_self_and_child_modules_resolve_from_the_module() {
        let got = parse(
            "use super::x::Y;\nuse super::super::z;\nuse self::k::A;\nuse kid::B;\nuse other::C;",
            &["a", "b"],
            &["kid"],
        );
        assert_eq!(got, ["a::x::Y", "z", "a::b::k::A", "a::b::kid::B"]);
        assert_eq!(
            parse("use super::super::super::x;", &["a"], &[]),
            ["<outside>"]
        );
    }

    #[test]
    fn inline_paths_in_items_but_not_in_strings_comments_or_foreign_crates() {
        let got = parse(
            r#"
            /// See [`crate::doc::Link`].
            fn f() -> crate::a::T {
                // crate::comment::x
                let s = "crate::string::x";
                let v = cleave_driver::kid::x();
                let w = x.kid::<u8>();
                format!("{}", crate::b::c(super::d::E::new()))
            }
            impl kid::Trait for S {}
            "#,
            &["m", "n"],
            &["kid"],
        );
        assert_eq!(got, ["a::T", "b::c", "m::d::E::new", "m::n::kid::Trait"]);
    }

    #[test]
    fn inline_modules_and_test_code() {
        let got = parse(
            r#"
            mod inner { use super::x::Y; fn g() { crate::p::q(); } }
            #[cfg(test)]
            mod tests { use crate::only::in_tests; }
            #[cfg(test)]
            use crate::test::helper;
            "#,
            &["m"],
            &[],
        );
        assert_eq!(got, ["m::x::Y", "p::q"]);
    }

    #[test]
    fn a_folder_is_a_top_level_directory_or_the_file_beside_it() {
        let dirs: BTreeSet<String> = ["k8s".to_owned(), "start".to_owned()].into();
        assert_eq!(
            folder_of(Path::new("k8s/events.rs"), &dirs).as_deref(),
            Some("k8s")
        );
        assert_eq!(
            folder_of(Path::new("start.rs"), &dirs).as_deref(),
            Some("start")
        );
        assert_eq!(folder_of(Path::new("daemon.rs"), &dirs), None);
    }

    #[test]
    fn loops_are_found_between_two_nodes_and_around_three() {
        let mut g: BTreeMap<String, BTreeMap<String, ()>> = BTreeMap::new();
        for (a, b) in [
            ("a", "b"),
            ("b", "a"),
            ("c", "d"),
            ("d", "e"),
            ("e", "c"),
            ("f", "a"),
        ] {
            g.entry(a.into()).or_default().insert(b.into(), ());
        }
        let got: Vec<Vec<String>> = cycles(&g)
            .into_iter()
            .map(|s| s.into_iter().collect())
            .collect();
        assert_eq!(got.len(), 2, "{got:?}");
        assert!(got.contains(&vec!["a".into(), "b".into()]));
        assert!(got.contains(&vec!["c".into(), "d".into(), "e".into()]));
    }
}
