//! A Go program built `-ldflags=-s -w` (no symbol table, no DWARF) is named from its
//! `.gopclntab`: function, file and line, inlined calls as frames of their own.

use std::process::Stdio;

use anyhow::{Context as _, Result, bail};
use tests::{
    fixtures, gecko_schema, harness,
    profile_query::{function_name, sample_stacks, threads},
};

#[test]
fn stripped_go_program_is_named_from_its_pclntab_with_its_split() -> Result<()> {
    let exe = fixtures::build_go("gosplit", "-s -w", "gosplit_go")?;
    let out = harness::output_path("go_stripped", "json");
    let done = harness::command()?
        .arg("-o")
        .arg(&out)
        .arg("--")
        .arg(&exe)
        .arg("2")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .output()
        .context("run rsprof-bpf")?;
    let stderr = String::from_utf8_lossy(&done.stderr);
    if !done.status.success() {
        bail!("rsprof-bpf failed ({}):\n{stderr}", done.status);
    }
    let profile = gecko_schema::load(&out)?;
    let stacks: Vec<Vec<String>> = threads(&profile)
        .into_iter()
        .filter(|t| t.process_name == "gosplit_go")
        .flat_map(|t| sample_stacks(t.thread))
        .collect();
    let has = |s: &[String], f: &str| s.iter().any(|l| function_name(l) == f);
    let a = stacks.iter().filter(|s| has(s, "main.hotA")).count();
    let b = stacks.iter().filter(|s| has(s, "main.hotB")).count();
    assert!(a + b > 1000, "hotA {a}, hotB {b} of {} samples:\n{stderr}", stacks.len());
    let share = 100.0 * a as f64 / (a + b) as f64;
    assert!((share - 66.7).abs() <= 7.0, "hotA {share:.1}% of hotA+hotB ({a}:{b}), not 2:1");

    // hotA's loop is the inlined accumulate: its leaf frame, with the source line, over hotA.
    let source = fixtures::source_dir().join("gosplit.go");
    let text = std::fs::read_to_string(&source)?;
    let line = text.lines().position(|l| l.contains("return acc + i*i")).unwrap() + 1;
    let leaf = format!("main.accumulate (in gosplit_go) ({}:{line})", source.display());
    let inlined = stacks
        .iter()
        .filter(|s| {
            s.last() == Some(&leaf) && s.len() >= 2 && function_name(&s[s.len() - 2]) == "main.hotA"
        })
        .count();
    assert!(inlined * 2 > a, "{inlined} of hotA's {a} samples in the inlined accumulate ({leaf})");
    // Nothing of the program left as an address.
    let unnamed = stacks
        .iter()
        .flatten()
        .filter(|l| l.starts_with("0x") && l.contains("(in gosplit_go)"))
        .count();
    assert!(unnamed * 100 <= stacks.len(), "{unnamed} unnamed frames in {} samples", stacks.len());
    Ok(())
}
