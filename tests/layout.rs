//! The layout of every crate's sources: no file imports, through a chain of others, a file
//! that imports it back. An import is any `crate::` or `super::` path outside a comment (a
//! `use` line or a path written in place), resolved segment by segment to the file of the
//! last module it names. The crate roots (`lib.rs`, `main.rs`) and `plumbing.rs` only name
//! and re-export modules, so paths to them (`crate::ShardError`) are not edges.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const CRATES: [&str; 6] = ["cpu", "comm", "data", "model", "sharding", "train"];

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The directory whose files are `file`'s child modules.
fn module_dir(src: &Path, file: &Path) -> PathBuf {
    let name = file.file_name().unwrap().to_str().unwrap();
    let parent = file.parent().unwrap().to_path_buf();
    if file.parent() == Some(src) && (name == "lib.rs" || name == "main.rs") || name == "mod.rs" {
        parent
    } else {
        parent.join(file.file_stem().unwrap())
    }
}

/// The file of the module whose child modules live in `dir`: `dir/mod.rs`, the crate root
/// in `dir`, or `dir.rs` beside it.
fn module_file(dir: &Path) -> PathBuf {
    for name in ["mod.rs", "lib.rs", "main.rs"] {
        if dir.join(name).exists() {
            return dir.join(name);
        }
    }
    dir.with_extension("rs")
}

/// The file of the deepest module `segments` names, starting from the module whose file is
/// `file` and whose child modules live in `dir`.
fn resolve(mut file: PathBuf, mut dir: PathBuf, segments: &[&str]) -> PathBuf {
    for s in segments {
        if *s == "super" {
            dir = dir.parent().unwrap().to_path_buf();
            file = module_file(&dir);
            continue;
        }
        let as_dir = dir.join(s).join("mod.rs");
        let as_file = dir.join(format!("{s}.rs"));
        if as_dir.exists() {
            file = as_dir;
        } else if as_file.exists() {
            file = as_file;
        } else {
            break;
        }
        dir = dir.join(s);
    }
    file
}

/// The module paths a line names: `crate::a::b`, `super::a`, and each first-level item of
/// `crate::{a::B, c}`.
fn paths(line: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let code = line.split("//").next().unwrap();
    for start in ["crate::", "super::"] {
        let mut rest = code;
        while let Some(i) = rest.find(start) {
            let before = &rest[..i];
            rest = &rest[i..];
            if before.ends_with('$') || before.ends_with(|c: char| c.is_alphanumeric() || c == '_')
            {
                rest = &rest[start.len()..];
                continue;
            }
            let head = start.trim_end_matches("::").to_string();
            let mut tail = &rest[start.len()..];
            // `super::super::x`
            let mut prefix = vec![head];
            while let Some(t) = tail.strip_prefix("super::") {
                prefix.push("super".into());
                tail = t;
            }
            if let Some(group) = tail.strip_prefix('{') {
                let inner: String = group.split('}').next().unwrap().to_string();
                for item in inner.split(',') {
                    let mut p = prefix.clone();
                    p.extend(segments_of(item.trim()));
                    out.push(p);
                }
            } else {
                let mut p = prefix.clone();
                p.extend(segments_of(tail));
                out.push(p);
            }
            rest = &rest[start.len()..];
        }
    }
    out
}

fn segments_of(path: &str) -> Vec<String> {
    path.split("::")
        .map(|s| {
            s.chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect::<String>()
        })
        .take_while(|s| !s.is_empty())
        .collect()
}

fn edges(src: &Path) -> BTreeMap<PathBuf, BTreeSet<PathBuf>> {
    let mut files = Vec::new();
    sources(src, &mut files);
    let facade = |f: &Path| {
        f.parent() == Some(src)
            && ["lib.rs", "main.rs", "plumbing.rs"]
                .iter()
                .any(|n| f.file_name().unwrap() == *n)
    };
    let mut out = BTreeMap::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        let dir = module_dir(src, file);
        let mut to = BTreeSet::new();
        // Inline modules (`mod dot { ... }`) open at these brace depths: a `super` inside one
        // names a module of the same file.
        let mut inline: Vec<i64> = Vec::new();
        let mut depth = 0i64;
        for line in text.lines() {
            let trimmed = line.trim_start();
            if trimmed.starts_with("//") {
                continue;
            }
            // Unit tests may import what their file is tested with.
            if trimmed.starts_with("mod tests {") {
                break;
            }
            let words: Vec<&str> = trimmed.split_whitespace().collect();
            let opens_mod = words
                .iter()
                .position(|w| *w == "mod")
                .is_some_and(|i| words.get(i + 2) == Some(&"{"));
            if opens_mod {
                inline.push(depth);
            }
            for mut p in paths(line) {
                let mut local = inline.len();
                while p[0] == "super" && local > 0 {
                    p.remove(0);
                    local -= 1;
                    if p.is_empty() || p[0] != "super" {
                        p.insert(0, "self".into());
                        break;
                    }
                }
                let segs: Vec<&str> = p[1..].iter().map(String::as_str).collect();
                let target = match p[0].as_str() {
                    "crate" => resolve(src.join("lib.rs"), src.to_path_buf(), &segs),
                    "self" => resolve(file.clone(), dir.clone(), &segs),
                    _ => {
                        let mut s = vec!["super"];
                        s.extend(&segs);
                        resolve(file.clone(), dir.clone(), &s)
                    }
                };
                if &target != file && !facade(&target) {
                    to.insert(target);
                }
            }
            depth += line.matches('{').count() as i64 - line.matches('}').count() as i64;
            while inline.last().is_some_and(|&d| depth <= d) {
                inline.pop();
            }
        }
        out.insert(file.clone(), to);
    }
    out
}

/// A circle of imports through `start`, if there is one.
fn circle(graph: &BTreeMap<PathBuf, BTreeSet<PathBuf>>, start: &Path) -> Option<Vec<PathBuf>> {
    let mut stack = vec![(start.to_path_buf(), vec![start.to_path_buf()])];
    let mut seen = BTreeSet::new();
    while let Some((at, trail)) = stack.pop() {
        for next in graph.get(&at).into_iter().flatten() {
            if next == start {
                return Some(trail);
            }
            if seen.insert(next.clone()) {
                let mut t = trail.clone();
                t.push(next.clone());
                stack.push((next.clone(), t));
            }
        }
    }
    None
}

#[test]
fn no_file_imports_a_file_that_imports_it_back() {
    let root = workspace();
    let mut found = Vec::new();
    let mut files = 0;
    for krate in CRATES {
        let src = root.join(krate).join("src");
        let graph = edges(&src);
        files += graph.len();
        for file in graph.keys() {
            if let Some(trail) = circle(&graph, file) {
                let names: Vec<String> = trail
                    .iter()
                    .map(|p| p.strip_prefix(&root).unwrap().display().to_string())
                    .collect();
                found.push(names.join(" -> "));
            }
        }
    }
    assert!(files > 100, "only {files} source files were read");
    assert!(found.is_empty(), "import circles:\n{}", found.join("\n"));
}

#[test]
fn the_resolver_sees_a_circle_where_there_is_one() {
    // Two files importing each other, and one importing the crate root only.
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path();
    std::fs::write(src.join("lib.rs"), "mod a;\nmod b;\nmod c;\n").unwrap();
    std::fs::create_dir(src.join("b")).unwrap();
    std::fs::write(src.join("a.rs"), "use crate::b::inner::X;\n").unwrap();
    std::fs::write(src.join("b.rs"), "mod inner;\n").unwrap();
    std::fs::write(
        src.join("b").join("inner.rs"),
        "pub struct X;\nfn f() { crate::a::g(); }\n",
    )
    .unwrap();
    std::fs::write(src.join("c.rs"), "use crate::Thing; // crate::a::g\n").unwrap();
    let graph = edges(src);
    assert!(circle(&graph, &src.join("a.rs")).is_some());
    assert!(circle(&graph, &src.join("c.rs")).is_none());
    assert!(graph[&src.join("c.rs")].is_empty());
}

/// ember's CubeCL kernels index their tensors as dense row-major arrays, so every tensor they
/// write is allocated contiguous. CubeCL's default allocation (`empty_device_dtype`,
/// `Client::empty_tensor`) is "optimized": on CUDA and ROCm a row whose bytes are not a
/// multiple of the row alignment (up to 512 B) is padded, and the tensor's strides say so
/// (bf16 logits of 50,304 columns, f32 of 50,257). wgpu allocates contiguously either way, so
/// no wgpu test would see a kernel write such a tensor as if it were dense.
#[test]
fn kernels_allocate_what_they_write_contiguous() {
    let root = workspace();
    let mut files = Vec::new();
    for krate in CRATES {
        sources(&root.join(krate).join("src"), &mut files);
    }
    let mut found = Vec::new();
    let mut kernel_files = 0;
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        kernel_files += usize::from(text.contains("#[cube("));
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap();
            if code.contains("empty_device_dtype") || code.contains(".empty_tensor(") {
                let at = file.strip_prefix(&root).unwrap().display();
                found.push(format!("{at}:{}: {}", n + 1, line.trim()));
            }
        }
    }
    assert!(
        kernel_files >= 6,
        "only {kernel_files} kernel files were read"
    );
    assert!(
        found.is_empty(),
        "allocations that may be padded:\n{}",
        found.join("\n")
    );
}
