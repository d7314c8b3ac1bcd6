//! `cargo xtask layers`: the import graph between each crate's top-level modules, read from the
//! sources (`crate::m` paths and `use crate::{m::…}` groups, test modules left out), failing
//! on a cycle. The folders are meant to show the pipeline; a cycle means two stages that can no
//! longer be read (or moved) apart.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

use anyhow::Context as _;

use crate::{step, workspace_root};

/// The crates whose modules must form layers.
const CRATES: [&str; 2] = ["rsprof-core/src", "profiler-user/src"];

pub fn layers() -> anyhow::Result<()> {
    step("layers: imports between top-level modules, per crate");
    let mut cycles = Vec::new();
    for krate in CRATES {
        let graph = module_graph(&workspace_root().join(krate))?;
        println!("{krate}:");
        for (m, deps) in &graph {
            let deps: Vec<_> = deps.keys().map(String::as_str).collect();
            println!("  {m} -> {}", if deps.is_empty() { "-".into() } else { deps.join(", ") });
        }
        for c in cycles_of(&graph) {
            let why: Vec<String> = c
                .iter()
                .flat_map(|m| {
                    graph[m]
                        .iter()
                        .filter(|(d, _)| c.contains(*d))
                        .map(move |(d, files)| format!("{m} -> {d} ({})", files.join(", ")))
                })
                .collect();
            cycles.push(format!("{krate}: {}", why.join("; ")));
        }
    }
    anyhow::ensure!(cycles.is_empty(), "import cycles:\n{}", cycles.join("\n"));
    println!("no import cycle between top-level modules");
    Ok(())
}

/// Module -> (module it imports -> files that do).
type Graph = BTreeMap<String, BTreeMap<String, Vec<String>>>;

fn module_graph(src: &Path) -> anyhow::Result<Graph> {
    let mut graph = Graph::new();
    let modules: BTreeSet<String> = std::fs::read_dir(src)
        .with_context(|| format!("reading {}", src.display()))?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let stem = name.strip_suffix(".rs").unwrap_or(&name).to_owned();
            (stem != "lib" && stem != "main").then_some(stem)
        })
        .collect();
    for m in &modules {
        let deps = graph.entry(m.clone()).or_default();
        for file in rust_files(&src.join(m), &src.join(format!("{m}.rs"))) {
            let text = std::fs::read_to_string(&file)?;
            let rel = file.strip_prefix(src).unwrap_or(&file).display().to_string();
            for d in imports(&text) {
                if &d != m && modules.contains(&d) {
                    let files = deps.entry(d).or_default();
                    if !files.contains(&rel) {
                        files.push(rel.clone());
                    }
                }
            }
        }
    }
    Ok(graph)
}

fn rust_files(dir: &Path, file: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if file.is_file() {
        out.push(file.to_owned());
    }
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().filter_map(|e| e.ok()) {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// Top-level modules a file's non-test code names through `crate::`.
fn imports(text: &str) -> BTreeSet<String> {
    // Test modules may reach anywhere; they sit at the end of a file by convention.
    let code = text.split("#[cfg(test)]\nmod tests").next().unwrap_or(text);
    let code: String =
        code.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n");
    let mut out = BTreeSet::new();
    let mut rest = code.as_str();
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // `use crate::{a::x, b::{y, z}}`: the first segment of each top-level entry.
            let mut depth = 0;
            let mut entry_start = true;
            for (i, ch) in group.char_indices() {
                match ch {
                    '{' => depth += 1,
                    '}' if depth == 0 => {
                        rest = &group[i..];
                        break;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 0 => entry_start = true,
                    c if entry_start && (c.is_alphanumeric() || c == '_') => {
                        out.insert(ident(&group[i..]));
                        entry_start = false;
                    }
                    _ => {}
                }
            }
        } else {
            out.insert(ident(rest));
        }
    }
    out
}

fn ident(s: &str) -> String {
    s.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect()
}

/// Strongly connected components of more than one module (Tarjan's algorithm).
fn cycles_of(graph: &Graph) -> Vec<BTreeSet<String>> {
    struct Walk<'a> {
        graph: &'a Graph,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        out: Vec<BTreeSet<String>>,
    }
    fn visit<'a>(w: &mut Walk<'a>, m: &'a str) {
        let i = w.index.len();
        w.index.insert(m, i);
        w.low.insert(m, i);
        w.stack.push(m);
        w.on_stack.insert(m);
        for d in w.graph[m].keys() {
            let d = d.as_str();
            if !w.index.contains_key(d) {
                visit(w, d);
                let l = w.low[m].min(w.low[d]);
                w.low.insert(m, l);
            } else if w.on_stack.contains(d) {
                let l = w.low[m].min(w.index[d]);
                w.low.insert(m, l);
            }
        }
        if w.low[m] == w.index[m] {
            let mut scc = BTreeSet::new();
            while let Some(x) = w.stack.pop() {
                w.on_stack.remove(x);
                scc.insert(x.to_owned());
                if x == m {
                    break;
                }
            }
            if scc.len() > 1 {
                w.out.push(scc);
            }
        }
    }
    let mut w = Walk {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for m in graph.keys() {
        if !w.index.contains_key(m.as_str()) {
            visit(&mut w, m);
        }
    }
    w.out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_paths_and_use_groups_but_not_comments_or_tests() {
        let src = "use crate::{a::x, b::{c::y, z}, d};\nfn f() { crate::e::g(); }\n\
                   // crate::h\n#[cfg(test)]\nmod tests { use crate::i; }";
        let got: Vec<_> = imports(src).into_iter().collect();
        assert_eq!(got, ["a", "b", "d", "e"]);
    }

    #[test]
    fn finds_a_cycle_and_only_it() {
        let mut g = Graph::new();
        let edge = |g: &mut Graph, a: &str, b: &str| {
            g.entry(a.into()).or_default().insert(b.into(), vec![]);
            g.entry(b.into()).or_default();
        };
        edge(&mut g, "a", "b");
        edge(&mut g, "b", "c");
        edge(&mut g, "c", "b");
        edge(&mut g, "c", "d");
        let c = cycles_of(&g);
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].iter().collect::<Vec<_>>(), ["b", "c"]);
    }

    /// The workspace itself has no cycle (what `cargo xtask layers` checks).
    #[test]
    fn the_workspace_has_no_import_cycle() {
        for krate in CRATES {
            let g = module_graph(&workspace_root().join(krate)).unwrap();
            assert!(g.len() > 3, "{krate}: modules not found");
            assert_eq!(cycles_of(&g), Vec::<BTreeSet<String>>::new(), "{krate}: {g:#?}");
        }
    }
}
