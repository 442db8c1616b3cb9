//! Every pyo3 entry point of both wheels runs inside `pd_bridge_bindings::guard`, so no Rust panic
//! reaches vLLM or oMLX as pyo3's `PanicException` (a `BaseException`). A source check: a
//! `#[pyfunction]`, or a `fn` directly inside a `#[pymethods]` impl, whose body does not start
//! with `guard(` fails here, naming it.

use std::path::Path;

/// `(line, name)` of each entry point in `src` whose body does not start with `guard(`.
fn unguarded(src: &str) -> Vec<(usize, String)> {
    let lines: Vec<&str> = src.lines().collect();
    let mut out = Vec::new();
    let mut depth: i64 = 0;
    let mut methods_depth: Option<i64> = None;
    for (i, line) in lines.iter().enumerate() {
        let t = line.trim_start();
        let is_fn = t.starts_with("fn ") || t.starts_with("pub fn ") || t.starts_with("pub(crate) fn ");
        if is_fn {
            let mut attrs = lines[..i].iter().rev().take_while(|l| {
                let l = l.trim_start();
                l.starts_with("#[") || l.starts_with("///")
            });
            let pyfunction = attrs.any(|l| l.trim_start().starts_with("#[pyfunction"));
            let method = methods_depth.is_some_and(|d| depth == d + 1);
            if pyfunction || method {
                let open = (i..lines.len()).find(|&j| lines[j].trim_end().ends_with('{')).expect("a fn body");
                let body = lines[open + 1..].iter().find(|l| !l.trim().is_empty()).map_or("", |l| l.trim());
                if !body.starts_with("guard(") {
                    let name = t.split("fn ").nth(1).and_then(|r| r.split(['(', '<']).next()).unwrap_or("?");
                    out.push((i + 1, name.to_string()));
                }
            }
        }
        if t.starts_with("impl ") && i > 0 && lines[i - 1].trim() == "#[pymethods]" {
            methods_depth = Some(depth);
        }
        depth += line.matches('{').count() as i64 - line.matches('}').count() as i64;
        if methods_depth.is_some_and(|d| depth <= d) && !t.starts_with("impl ") {
            methods_depth = None;
        }
    }
    out
}

#[test]
fn every_entry_point_of_both_wheels_is_guarded() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut missing = Vec::new();
    let mut seen = 0;
    // Every source file of each wheel (a family's entry points may live in a module of their own).
    let mut files: Vec<String> = Vec::new();
    for crate_src in ["omlx_patch/src", "vllm_plugin/src"] {
        for e in std::fs::read_dir(root.join(crate_src)).unwrap() {
            let name = e.unwrap().file_name().into_string().unwrap();
            if name.ends_with(".rs") {
                files.push(format!("{crate_src}/{name}"));
            }
        }
    }
    files.sort();
    assert!(files.contains(&"omlx_patch/src/lib.rs".to_string()) && files.contains(&"vllm_plugin/src/lib.rs".to_string()), "{files:?}");
    for wheel in &files {
        let src = std::fs::read_to_string(root.join(wheel)).unwrap();
        seen += src.matches("#[pyfunction]").count() + src.matches("#[pymethods]").count();
        missing.extend(unguarded(&src).into_iter().map(|(line, name)| format!("{wheel}:{line} {name}")));
    }
    assert!(seen >= 8, "found only {seen} pyo3 entry-point sites: the check is not reading the wheels");
    assert!(missing.is_empty(), "not inside pd_bridge_bindings::guard: {missing:?}");
}

#[test]
fn the_check_finds_an_unguarded_entry_point() {
    let src = "#[pymethods]\nimpl X {\n    #[getter]\n    fn a(&self) -> PyResult<u8> {\n        guard(|| Ok(1))\n    }\n\n    fn b(&self) -> u8 {\n        1\n    }\n}\n\nfn helper() -> u8 {\n    2\n}\n\n/// doc\n#[pyfunction]\nfn f() -> u8 {\n    3\n}\n";
    assert_eq!(unguarded(src), vec![(8, "b".to_string()), (19, "f".to_string())]);
}
