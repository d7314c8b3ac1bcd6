//! Tables compiled from the CFI of real files on this machine.

use object::{Object, ObjectSection, ObjectSymbol, SymbolKind};
use profiler_common::*;
use profiler_unwind::{CfiSections, Error, PageIndex, UnwindTable};

const LIBC: &str = "/lib/x86_64-linux-gnu/libc.so.6";
const PYTHON: &str = "/usr/bin/python3.11";
const LD_SO: &str = "/lib64/ld-linux-x86-64.so.2";

/// The file's bytes, or a failure naming the Debian package that provides it.
fn read(path: &str) -> Vec<u8> {
    let package = match path {
        LIBC | LD_SO => "libc6",
        PYTHON => "python3.11-minimal",
        _ => "gcc (cc built it)",
    };
    std::fs::read(path).unwrap_or_else(|e| {
        panic!("cannot read {path} ({e}): install the Debian package {package}")
    })
}

/// A shared object assembled by `cc` from `.cfi_*` directives: frames over 64 KiB as
/// compilers lay them out (rustc's `run_compiler` closure: rbp pushed first, CFA = rsp +
/// 540,080; gcc's: no rbp, CFA = rsp + 600,016; rbp pushed last of six, at CFA - 56), one
/// whose rbp slot is beyond the large row's 4 bits, and one over 8 MiB. Built once per run.
fn large_frames_so() -> &'static str {
    static PATH: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    PATH.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("profiler-unwind-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let src = dir.join("large_frames.s");
        std::fs::write(&src, LARGE_FRAMES_ASM).unwrap();
        let out = dir.join("liblarge_frames.so");
        let st = std::process::Command::new("cc")
            .args(["-shared", "-nostdlib", "-o"])
            .arg(&out)
            .arg(&src)
            .status()
            .unwrap_or_else(|e| panic!("running cc ({e}): install the Debian package gcc"));
        assert!(st.success(), "assembling {}", src.display());
        out.to_str().unwrap().to_owned()
    })
}

const LARGE_FRAMES_ASM: &str = "
    .text
    .globl rustc_like
    .type rustc_like, @function
rustc_like:
    .cfi_startproc
    push %rbp
    .cfi_def_cfa_offset 16
    .cfi_offset %rbp, -16
    sub $540064, %rsp
    .cfi_def_cfa_offset 540080
    call rustc_like
    add $540064, %rsp
    .cfi_def_cfa_offset 16
    pop %rbp
    .cfi_def_cfa_offset 8
    ret
    .cfi_endproc
    .size rustc_like, .-rustc_like

    .globl gcc_like
    .type gcc_like, @function
gcc_like:
    .cfi_startproc
    sub $600008, %rsp
    .cfi_def_cfa_offset 600016
    call gcc_like
    add $600008, %rsp
    .cfi_def_cfa_offset 8
    ret
    .cfi_endproc
    .size gcc_like, .-gcc_like

    .globl six_saved
    .type six_saved, @function
six_saved:
    .cfi_startproc
    push %r15
    .cfi_def_cfa_offset 16
    .cfi_offset %r15, -16
    push %r14
    .cfi_def_cfa_offset 24
    push %r13
    .cfi_def_cfa_offset 32
    push %r12
    .cfi_def_cfa_offset 40
    push %rbx
    .cfi_def_cfa_offset 48
    push %rbp
    .cfi_def_cfa_offset 56
    .cfi_offset %rbp, -56
    sub $200000, %rsp
    .cfi_def_cfa_offset 200056
    call six_saved
    .cfi_offset %rbp, -72
    nop
    .cfi_def_cfa_offset 9000000
    nop
    ret
    .cfi_endproc
    .size six_saved, .-six_saved
";

struct Function {
    name: String,
    address: u64,
    code: Vec<u8>,
}

/// Function symbols (static and dynamic) with their first bytes of code.
fn functions(data: &[u8]) -> Vec<Function> {
    let file = object::File::parse(data).unwrap();
    let mut out: Vec<Function> = file
        .symbols()
        .chain(file.dynamic_symbols())
        .filter(|s| s.kind() == SymbolKind::Text && s.size() > 0 && s.address() != 0)
        .filter_map(|s| {
            let section = file.section_by_index(s.section_index()?).ok()?;
            let bytes = section.data().ok()?;
            let start = (s.address() - section.address()) as usize;
            let end = (start + s.size() as usize).min(bytes.len());
            Some(Function {
                name: s.name().ok()?.to_string(),
                address: s.address(),
                code: bytes.get(start..end)?.to_vec(),
            })
        })
        .collect();
    out.sort_by_key(|f| f.address);
    out
}

fn compile(path: &str) -> (Vec<u8>, UnwindTable) {
    let data = read(path);
    let table = UnwindTable::from_elf(&data)
        .unwrap_or_else(|e| panic!("compiling the unwind table of {path}: {e}"));
    (data, table)
}

fn row(table: &UnwindTable, addr: u64) -> UnwindRow {
    table.lookup(addr).unwrap_or_else(|| panic!("no unwind info at {addr:#x}"))
}

fn assert_rsp(row: UnwindRow, offset: u16, what: &str) {
    assert_eq!(
        (row.cfa_kind(), row.cfa_offset),
        (UNWIND_CFA_RSP, offset),
        "{what}: expected CFA = rsp + {offset}, got {row:?}"
    );
}

#[test]
fn known_functions_start_with_cfa_rsp_plus_8() {
    for (path, names) in [
        (LIBC, &["malloc", "free", "qsort", "fopen", "printf", "__libc_start_main"][..]),
        (
            PYTHON,
            &["Py_BytesMain", "PyObject_Call", "_PyEval_EvalFrameDefault", "PyDict_GetItem"][..],
        ),
    ] {
        let (data, table) = compile(path);
        let functions = functions(&data);
        for name in names {
            let f = functions
                .iter()
                .find(|f| f.name == *name)
                .unwrap_or_else(|| panic!("{name} not in the symbols of {path}"));
            let entry = row(&table, f.address);
            assert_rsp(entry, 8, &format!("{path} {name} at entry"));
            assert_eq!(entry.rbp_kind(), UNWIND_RBP_UNCHANGED, "{name}: {entry:?}");
        }
    }
}

/// In every function that begins with `[endbr64;] push rbp`, the row right after the push
/// says CFA = rsp + 16 with rbp saved at CFA - 16.
#[test]
fn push_rbp_prologues() {
    for path in [LIBC, PYTHON] {
        let (data, table) = compile(path);
        let mut checked = 0;
        for f in functions(&data) {
            let prefix = if f.code.starts_with(&[0xf3, 0x0f, 0x1e, 0xfa]) { 4 } else { 0 };
            if f.code.get(prefix) != Some(&0x55) {
                continue;
            }
            let what = format!("{path} {} at {:#x}", f.name, f.address);
            assert_rsp(row(&table, f.address), 8, &format!("{what}, entry"));
            let after = row(&table, f.address + prefix as u64 + 1);
            assert_rsp(after, 16, &format!("{what}, after push rbp"));
            assert_eq!(
                (after.rbp_kind(), after.rbp_offset()),
                (UNWIND_RBP_CFA_OFFSET, -16),
                "{what}, after push rbp: {after:?}"
            );
            checked += 1;
        }
        eprintln!("{path}: {checked} functions start with push rbp");
        assert!(checked >= 20, "{path}: only {checked} functions start with push rbp");
    }
}

#[test]
fn plt_stubs_use_the_plt_rule() {
    for path in [LIBC, PYTHON] {
        let (data, table) = compile(path);
        let file = object::File::parse(&*data).unwrap();
        let plt = file.section_by_name(".plt").unwrap_or_else(|| panic!("{path}: no .plt"));
        assert_eq!(plt.address() % 16, 0, "the PLT rule assumes 16-byte aligned stubs");
        // PLT0 pushes the link map, then jumps to the resolver.
        assert_rsp(row(&table, plt.address()), 16, "PLT0");
        assert_rsp(row(&table, plt.address() + 6), 24, "PLT0 after push");
        let mut stubs = 0;
        for stub in (plt.address() + 16..plt.address() + plt.size()).step_by(16) {
            for addr in [stub, stub + 11, stub + 15] {
                let r = row(&table, addr);
                assert_eq!(
                    (r.cfa_kind(), r.cfa_offset, r.aux, r.rbp_kind()),
                    (UNWIND_CFA_PLT, 8, 11, UNWIND_RBP_UNCHANGED),
                    "{path} PLT stub at {stub:#x}: {r:?}"
                );
            }
            stubs += 1;
        }
        assert!(stubs > 10, "{path}: {stubs} PLT stubs");
        assert!(table.stats().plt_rows >= 1);
    }
}

/// glibc's `__restore_rt` (`mov $15, %rax; syscall`: rt_sigreturn) is a signal trampoline.
#[test]
fn libc_restore_rt_is_a_signal_frame() {
    let (data, table) = compile(LIBC);
    let file = object::File::parse(&*data).unwrap();
    let text = file.section_by_name(".text").unwrap();
    let code = text.data().unwrap();
    let pattern = [0x48, 0xc7, 0xc0, 0x0f, 0x00, 0x00, 0x00, 0x0f, 0x05];
    let at = code
        .windows(pattern.len())
        .position(|w| w == pattern)
        .expect("rt_sigreturn sequence not found in libc .text");
    let addr = text.address() + at as u64;
    let r = row(&table, addr);
    assert_eq!(r.cfa_kind(), UNWIND_CFA_SIGNAL, "__restore_rt at {addr:#x}: {r:?}");
    assert_eq!(table.stats().signal_fdes, 1);
}

/// `_start` marks the return address undefined: the walk ends there.
#[test]
fn python_start_ends_the_stack() {
    let (data, table) = compile(PYTHON);
    let start = functions(&data).into_iter().find(|f| f.name == "_start");
    let start = start.expect("_start not in the symbols of python3.11");
    // The rule after `xor %ebp,%ebp` (or endbr64 first), anywhere in _start's body.
    let r = row(&table, start.address + 4);
    assert_eq!(r.cfa_kind(), UNWIND_CFA_END, "_start: {r:?}");
}

#[test]
fn ld_so_entry_code_without_cfi_ends_the_stack() {
    // ld.so's `_start` and `_dl_start_user` (hand-written, no FDE) are where every dynamically
    // linked process starts; a walk reaching them has reached the outermost frame.
    let data = read(LD_SO);
    let entry = u64::from_le_bytes(data[24..32].try_into().unwrap());
    let file = object::File::parse(&*data).unwrap();
    assert_eq!(file.entry(), entry);
    let table = UnwindTable::from_elf(&data).unwrap();
    for addr in [entry, entry + 1, entry + 8] {
        assert_eq!(row(&table, addr).cfa_kind(), UNWIND_CFA_END, "at {addr:#x}");
    }
    // Only the gap from the entry point on: the rows stay sorted, and the next function
    // (the first row after the entry point) keeps its own rule.
    assert!(table.rows().windows(2).all(|w| w[0].pc < w[1].pc));
    let next = table.rows().iter().find(|r| u64::from(r.pc) > entry).expect("a row after");
    assert_ne!(next.cfa_kind(), UNWIND_CFA_END, "{next:?}");
}

#[test]
fn table_sizes() {
    let mut total = 0;
    for path in [LIBC, PYTHON] {
        let (_, table) = compile(path);
        let stats = table.stats();
        eprintln!("{path}: {stats:#?}");
        assert_eq!(stats.bytes, stats.rows * 8);
        assert!(stats.eh_frame_fdes > 1000, "{path}: {} FDEs", stats.eh_frame_fdes);
        assert!(stats.rows > stats.fdes(), "{path}: {} rows", stats.rows);
        total += stats.bytes;
    }
    eprintln!("python3.11 + libc: {total} bytes");
    assert!(total <= 8 << 20, "tables take {total} bytes, more than 8 MiB");
}

/// Every row of libc is well formed, and `lookup` returns it over its whole range.
#[test]
fn every_libc_row_decodes() {
    let (_, table) = compile(LIBC);
    let rows = table.rows();
    assert!(rows.len() > 10_000, "{} rows", rows.len());
    assert_eq!(rows.last().unwrap().cfa_kind(), UNWIND_CFA_NONE, "the table must end in NONE");
    let mut kinds = [0usize; 7];
    for (i, r) in rows.iter().enumerate() {
        assert!(r.cfa_kind() <= UNWIND_CFA_UNSUPPORTED, "row {i}: {r:?}");
        assert!(r.rbp_kind() <= UNWIND_RBP_UNSUPPORTED, "row {i}: {r:?}");
        kinds[r.cfa_kind() as usize] += 1;
        if r.cfa_kind() == UNWIND_CFA_UNSUPPORTED {
            eprintln!("unsupported rule at {:#x}", r.pc);
        }
        let expect = (r.cfa_kind() != UNWIND_CFA_NONE).then_some(*r);
        assert_eq!(table.lookup(r.pc as u64), expect, "row {i} at its start");
        if let Some(prev) = i.checked_sub(1).map(|p| rows[p]) {
            assert!(prev.pc < r.pc, "rows {} and {i} out of order", i - 1);
            assert!(!prev.same_rule(r), "rows {} and {i} should have merged", i - 1);
            let expect = (prev.cfa_kind() != UNWIND_CFA_NONE).then_some(prev);
            assert_eq!(table.lookup(r.pc as u64 - 1), expect, "row {} at its end", i - 1);
        }
        if r.cfa_kind() == UNWIND_CFA_RBP || r.cfa_kind() == UNWIND_CFA_RSP {
            assert!(r.cfa_offset >= 8, "row {i}: CFA below the return address: {r:?}");
        }
    }
    eprintln!("libc rows by CFA kind (NONE, RSP, RBP, PLT, SIGNAL, END, UNSUPPORTED): {kinds:?}");
    assert!(kinds[UNWIND_CFA_NONE as usize] > 1, "no gaps between FDEs at all?");
    assert!(table.lookup(u64::from(rows[0].pc) - 1).is_none());
    assert!(table.lookup(u64::from(rows.last().unwrap().pc)).is_none());
    assert!(table.lookup(1 << 40).is_none());
}

/// FDEs reached through `.eh_frame_hdr` (the default) and by walking `.eh_frame` give the
/// same table; so do files without section headers (found through `PT_GNU_EH_FRAME`).
#[test]
fn eh_frame_hdr_section_walk_and_no_section_headers_agree() {
    let (data, table) = compile(LIBC);
    let file = object::File::parse(&*data).unwrap();
    let eh = file.section_by_name(".eh_frame").unwrap();
    let walked = UnwindTable::from_sections(&CfiSections {
        eh_frame: Some((eh.address(), eh.data().unwrap())),
        eh_frame_hdr: None,
        debug_frame: None,
        separate_debug_frame: None,
        text_address: None,
        got_address: None,
    })
    .unwrap();
    assert_eq!(walked.rows(), table.rows());

    // e_shoff (0x28), e_shnum (0x3c) and e_shstrndx (0x3e) zeroed: no section headers.
    let mut stripped = data.clone();
    stripped[0x28..0x30].fill(0);
    stripped[0x3c..0x40].fill(0);
    let from_segments = UnwindTable::from_elf(&stripped).unwrap();
    assert_eq!(from_segments.rows(), table.rows());
}

#[test]
fn bad_input_is_a_clear_error() {
    let data = read(LIBC);
    let mut arm = data.clone();
    arm[0x12..0x14].copy_from_slice(&183u16.to_le_bytes()); // EM_AARCH64
    let err = UnwindTable::from_elf(&arm).unwrap_err();
    assert!(matches!(err, Error::UnsupportedMachine(183)), "{err}");
    assert!(err.to_string().contains("x86-64"), "{err}");

    let err = UnwindTable::from_elf(b"#!/bin/sh\necho not elf\n").unwrap_err();
    assert!(!err.to_string().is_empty());

    let mut elf32 = data[..64].to_vec();
    elf32[4] = 1; // ELFCLASS32
    let err = UnwindTable::from_elf(&elf32).unwrap_err();
    assert!(matches!(err, Error::UnsupportedFormat(_) | Error::Elf(_)), "{err}");

    // Cut anywhere: an error or a (smaller) table, never a panic.
    for len in [64, 4096, data.len() / 2, data.len() - 1] {
        let _ = UnwindTable::from_elf(&data[..len]);
    }
}

/// Every CFI row binutils' `readelf -wF` prints (an independent DWARF CFI interpreter) with
/// CFA = rsp/rbp + N and the return address at CFA - 8 has the same rule in our table,
/// and so does its rbp column.
#[test]
fn rows_agree_with_readelf() {
    for path in [LIBC, PYTHON, large_frames_so()] {
        let (_, table) = compile(path);
        let out =
            std::process::Command::new("readelf").args(["-wF", path]).output().unwrap_or_else(
                |e| panic!("running readelf ({e}): install the Debian package binutils"),
            );
        // readelf exits with 1 on files without .debug_* sections, having printed the CFI.
        let text = String::from_utf8(out.stdout).unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(text.contains(" FDE "), "readelf -wF {path} printed no FDE: {stderr}");
        let (mut columns, mut checked, mut in_fde) = (Vec::new(), 0, false);
        for line in text.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // CIEs print their initial rows too, at LOC 0.
            if fields.len() >= 4 && (fields[3] == "FDE" || fields[3] == "CIE") {
                in_fde = fields[3] == "FDE";
                continue;
            }
            if !in_fde {
                continue;
            }
            if fields.first() == Some(&"LOC") {
                columns = fields;
                continue;
            }
            let Some(loc) = fields.first().and_then(|f| u64::from_str_radix(f, 16).ok()) else {
                continue;
            };
            if fields.len() != columns.len() || fields[1] == "exp" {
                continue;
            }
            let column = |name| columns.iter().position(|c| *c == name).map(|i| fields[i]);
            if column("ra") != Some("c-8") {
                continue;
            }
            let (base, offset) = fields[1].split_once('+').unwrap();
            let kind = match base {
                "rsp" => UNWIND_CFA_RSP,
                "rbp" => UNWIND_CFA_RBP,
                _ => continue,
            };
            let r = row(&table, loc);
            let what = format!("{path} at {loc:#x}: readelf says {line:?}, table says {r:?}");
            let offset: u64 = offset.parse().unwrap();
            if !offset_fits(kind, offset) {
                assert_eq!(r.cfa_kind(), UNWIND_CFA_UNSUPPORTED, "{what}");
                checked += 1;
                continue;
            }
            assert_eq!(cfa_rule(r), (kind, offset), "{what}");
            match column("rbp") {
                None | Some("u") => assert_eq!(r.rbp_kind(), UNWIND_RBP_UNCHANGED, "{what}"),
                Some(saved) => {
                    let slot: i64 = saved.strip_prefix('c').unwrap().parse().unwrap();
                    if offset > u64::from(u16::MAX) && !(-64..=56).contains(&slot) {
                        // Out of a large frame row's 4-bit slot: rbp is lost, the CFA kept.
                        assert_eq!(r.rbp_kind(), UNWIND_RBP_UNSUPPORTED, "{what}");
                        checked += 1;
                        continue;
                    }
                    assert_eq!(
                        (r.rbp_kind(), r.rbp_offset()),
                        (UNWIND_RBP_CFA_OFFSET, slot),
                        "{what}"
                    );
                }
            }
            checked += 1;
        }
        eprintln!("{path}: {checked} readelf rows agree");
        assert!(checked > table.stats().cfi_rows * 9 / 10, "{path}: only {checked} rows checked");
    }
}

/// The row's CFA as (base kind, offset): an `RSP_LARGE` row is rsp + its large offset.
fn cfa_rule(r: UnwindRow) -> (u8, u64) {
    match r.cfa_kind() {
        UNWIND_CFA_RSP_LARGE => (UNWIND_CFA_RSP, r.large_cfa_offset()),
        kind => (kind, u64::from(r.cfa_offset)),
    }
}

/// Whether a row can hold CFA = base + offset: 16 bits, or for rsp a multiple of 8 up to
/// `UNWIND_LARGE_CFA_MAX` (an `RSP_LARGE` row).
fn offset_fits(kind: u8, offset: u64) -> bool {
    offset <= u64::from(u16::MAX)
        || (kind == UNWIND_CFA_RSP && offset.is_multiple_of(8) && offset <= UNWIND_LARGE_CFA_MAX)
}

/// The assembled large frames: each body row is an `RSP_LARGE` row with its rbp slot, the
/// slot out of 4 bits loses rbp but keeps the CFA, and a frame over 8 MiB is unsupported.
#[test]
fn large_frames_from_cfi_directives() {
    let path = large_frames_so();
    let (data, table) = compile(path);
    let at = |name: &str, skip: u64| {
        let f = functions(&data).into_iter().find(|f| f.name == name).expect(name);
        let r = row(&table, f.address + skip);
        (r.cfa_kind(), cfa_rule(r).1, r.rbp_kind(), r.rbp_offset())
    };
    let (large, saved) = (UNWIND_CFA_RSP_LARGE, UNWIND_RBP_CFA_OFFSET);
    // After `push %rbp` (1 byte) and `sub $imm32, %rsp` (7).
    assert_eq!(at("rustc_like", 8), (large, 540_080, saved, -16));
    assert_eq!(at("gcc_like", 7), (large, 600_016, UNWIND_RBP_UNCHANGED, 0));
    // Six pushes (2+2+2+2+1+1 bytes) and the `sub`: then the call (5), a nop, a nop.
    assert_eq!(at("six_saved", 17), (large, 200_056, saved, -56));
    assert_eq!(at("six_saved", 22), (large, 200_056, UNWIND_RBP_UNSUPPORTED, 0));
    assert_eq!(at("six_saved", 23).0, UNWIND_CFA_UNSUPPORTED);
    let stats = table.stats();
    assert_eq!(stats.large_frame_rows, 4, "{stats:?}");
    assert_eq!((stats.unsupported.rbp, stats.unsupported.cfa_offset_range), (1, 1));
}

/// What readelf's interpretation of one CFI row says the table must hold there.
#[derive(Debug, PartialEq)]
enum Expect {
    /// CFA = rsp/rbp + offset, rbp rule (kind, slot).
    Rule(u8, u64, u8, i64),
    /// Return address undefined: the end of the stack.
    End,
    /// A CFA expression: the PLT rule or unsupported (readelf prints only "exp").
    Expression,
    /// CFA = rsp/rbp + offset, with an rbp rule the table cannot express.
    RbpUnsupported(u8, u64),
    Unsupported(&'static str),
}

/// One row of `readelf -wF` in an FDE, with its column names: what the table must say.
fn expect_from_readelf(columns: &[&str], fields: &[&str]) -> Expect {
    let column = |name| columns.iter().position(|c| *c == name).map(|i| fields[i]);
    match column("ra") {
        Some("c-8") => {}
        Some("u") => return Expect::End,
        _ => return Expect::Unsupported("return_address"),
    }
    if fields[1] == "exp" {
        return Expect::Expression;
    }
    let (base, offset) = fields[1].split_once('+').expect("CFA as REG+N");
    let kind = match base {
        "rsp" => UNWIND_CFA_RSP,
        "rbp" => UNWIND_CFA_RBP,
        _ => return Expect::Unsupported("cfa_register"),
    };
    let offset: u64 = offset.parse().expect("CFA offset");
    if !offset_fits(kind, offset) {
        return Expect::Unsupported("cfa_offset_range");
    }
    // A large frame's row has 4 bits for the rbp slot, a normal one 8.
    let slots = if offset > u64::from(u16::MAX) { -8..=7 } else { -128..=127 };
    match column("rbp") {
        // "u": readelf's mark for a column not set (yet) in this FDE.
        None | Some("u") | Some("s") => Expect::Rule(kind, offset, UNWIND_RBP_UNCHANGED, 0),
        Some(saved) => match saved.strip_prefix('c').and_then(|n| n.parse::<i64>().ok()) {
            Some(n) if n % 8 == 0 && slots.contains(&(n / 8)) => {
                Expect::Rule(kind, offset, UNWIND_RBP_CFA_OFFSET, n)
            }
            _ => Expect::RbpUnsupported(kind, offset),
        },
    }
}

/// Tallies of what readelf's rows imply, compared with the compiler's `Stats`.
#[derive(Default)]
struct Tally {
    fdes: usize,
    signal_fdes: usize,
    rows: usize,
    ends: usize,
    plt: usize,
    large: usize,
    reasons: std::collections::BTreeMap<&'static str, usize>,
}

/// Checks the table at `loc` against one row readelf printed (`in_signal`: the FDE's CIE has
/// augmentation `S`).
fn check_readelf_row(
    table: &UnwindTable,
    tally: &mut Tally,
    in_signal: bool,
    columns: &[String],
    fields: &[String],
    what: &str,
) {
    let loc = u64::from_str_radix(&fields[0], 16).unwrap();
    tally.rows += 1;
    let r = row(table, loc);
    let what = format!("at {loc:#x}: readelf says {what:?}, table says {r:?}");
    if in_signal {
        assert_eq!(r.cfa_kind(), UNWIND_CFA_SIGNAL, "{what}");
        return;
    }
    let columns: Vec<&str> = columns.iter().map(String::as_str).collect();
    let fields: Vec<&str> = fields.iter().map(String::as_str).collect();
    let (cfa_kind, cfa_offset) = cfa_rule(r);
    let got = (cfa_kind, cfa_offset, r.rbp_kind(), r.rbp_offset());
    tally.large += usize::from(r.cfa_kind() == UNWIND_CFA_RSP_LARGE);
    match expect_from_readelf(&columns, &fields) {
        Expect::Rule(kind, offset, rbp_kind, rbp_offset) => {
            assert_eq!(got, (kind, offset, rbp_kind, rbp_offset), "{what}")
        }
        Expect::RbpUnsupported(kind, offset) => {
            *tally.reasons.entry("rbp").or_default() += 1;
            assert_eq!(got, (kind, offset, UNWIND_RBP_UNSUPPORTED, 0), "{what}");
        }
        Expect::End => {
            tally.ends += 1;
            assert_eq!(r.cfa_kind(), UNWIND_CFA_END, "{what}");
        }
        Expect::Expression => match r.cfa_kind() {
            UNWIND_CFA_PLT => tally.plt += 1,
            UNWIND_CFA_UNSUPPORTED => *tally.reasons.entry("cfa_expression").or_default() += 1,
            _ => panic!("{what}: a CFA expression is PLT or unsupported"),
        },
        Expect::Unsupported(reason) => {
            *tally.reasons.entry(reason).or_default() += 1;
            assert_eq!(r.cfa_kind(), UNWIND_CFA_UNSUPPORTED, "{what}");
        }
    }
}

/// Every FDE of the file compiles, and every CFI row readelf prints (not a sample: all of
/// them; an FDE without instructions, which readelf prints no row for, by its CIE's initial
/// row) has the rule the table gives at its address; the rows the table cannot express are
/// counted in `Stats` under the reason readelf's rule implies, number for number.
#[test]
fn every_fde_compiles_or_is_counted_with_its_reason() {
    for path in [LIBC, PYTHON, large_frames_so()] {
        let (_, table) = compile(path);
        let stats = *table.stats();
        let out = std::process::Command::new("readelf")
            .args(["--debug-dump=frames-interp", path])
            .output()
            .unwrap_or_else(|e| {
                panic!("running readelf ({e}): install the Debian package binutils")
            });
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(text.contains(" FDE "), "readelf printed no FDE for {path}");

        // Per CIE (by offset): signal frame?, and its initial row with the column names.
        type Cies = std::collections::HashMap<String, (bool, Vec<String>, Vec<String>)>;
        let mut cies = Cies::default();
        let mut tally = Tally::default();
        let mut columns: Vec<String> = Vec::new();
        // The entry being read: Some(cie offset) for a CIE, or the FDE's (start, cie, rows).
        let mut cie: Option<String> = None;
        let mut fde: Option<(u64, String, usize)> = None;
        let finish_fde =
            |fde: &mut Option<(u64, String, usize)>, cies: &Cies, tally: &mut Tally| {
                if let Some((start, cie, 0)) = fde.take() {
                    let (signal, columns, initial) = &cies[&cie];
                    let mut fields = initial.clone();
                    fields[0] = format!("{start:016x}");
                    let what = format!("(no rows: CIE {cie}'s) {}", fields.join(" "));
                    check_readelf_row(&table, tally, *signal, columns, &fields, &what);
                }
            };
        for line in text.lines() {
            // Register rules print as "r9 (r9)": one field each.
            let joined = line.replace(" (", "(");
            let fields: Vec<String> = joined.split_whitespace().map(str::to_owned).collect();
            let is_header = fields.len() >= 4 && (fields[3] == "CIE" || fields[3] == "FDE");
            if is_header || fields.get(1).map(String::as_str) == Some("ZERO") {
                finish_fde(&mut fde, &cies, &mut tally);
                cie = None;
            }
            if is_header && fields[3] == "CIE" {
                let signal = fields.get(4).is_some_and(|aug| aug.trim_matches('"').contains('S'));
                cies.insert(fields[0].clone(), (signal, Vec::new(), Vec::new()));
                cie = Some(fields[0].clone());
                continue;
            }
            if is_header {
                let cie = fields[4].strip_prefix("cie=").expect("FDE's cie=").to_owned();
                let range = fields[5].strip_prefix("pc=").expect("FDE's pc=");
                let start = u64::from_str_radix(range.split_once("..").unwrap().0, 16).unwrap();
                tally.fdes += 1;
                tally.signal_fdes += usize::from(cies[&cie].0);
                fde = Some((start, cie, 0));
                continue;
            }
            if fields.first().map(String::as_str) == Some("LOC") {
                columns = fields;
                continue;
            }
            let is_row = fields.first().is_some_and(|f| u64::from_str_radix(f, 16).is_ok());
            if !is_row || fields.len() != columns.len() {
                continue;
            }
            if let Some(c) = &cie {
                let entry = cies.get_mut(c).unwrap();
                if entry.2.is_empty() {
                    (entry.1, entry.2) = (columns.clone(), fields);
                }
            } else if let Some((_, c, rows)) = &mut fde {
                *rows += 1;
                let signal = cies[c].0;
                check_readelf_row(&table, &mut tally, signal, &columns, &fields, line);
            }
        }
        finish_fde(&mut fde, &cies, &mut tally);

        let Tally { fdes, signal_fdes, rows, ends, plt, large, reasons } = tally;
        eprintln!(
            "{path}: {fdes} FDEs ({signal_fdes} signal), {rows} rows, {ends} end, {plt} PLT, \
             unsupported {reasons:?}\n{stats:#?}"
        );
        assert_eq!(stats.unsupported.fde_errors, 0, "{path}: FDEs that failed to evaluate");
        assert_eq!(fdes, stats.fdes(), "{path}: FDEs readelf lists vs compiled");
        assert_eq!(signal_fdes, stats.signal_fdes, "{path}: signal FDEs");
        assert_eq!(ends, stats.end_rows, "{path}: rows ending the stack");
        assert_eq!(plt, stats.plt_rows, "{path}: PLT rows");
        assert_eq!(large, stats.large_frame_rows, "{path}: rows of frames over 64 KiB");
        let count = |reason| reasons.get(reason).copied().unwrap_or(0);
        let u = stats.unsupported;
        assert_eq!(count("return_address"), u.return_address, "{path}");
        assert_eq!(count("cfa_register"), u.cfa_register, "{path}");
        assert_eq!(count("cfa_expression"), u.cfa_expression, "{path}");
        assert_eq!(count("cfa_offset_range"), u.cfa_offset_range, "{path}");
        assert_eq!(count("rbp"), u.rbp, "{path}");
        // One rule per signal FDE, not its rows; otherwise readelf's rows are gimli's.
        assert_eq!(rows - signal_fdes, stats.cfi_rows, "{path}: rows, readelf vs compiled");
    }
}

/// The row in force at `addr` by a plain search of all rows (gaps included).
fn in_force(rows: &[UnwindRow], addr: u32) -> Option<UnwindRow> {
    let after = rows.partition_point(|r| r.pc <= addr);
    rows.get(after.checked_sub(1)?).copied()
}

/// The walker's search through the page index, with its bounded halvings, finds the row a
/// search of the whole table finds: at every row's start and the bytes around it, and every
/// few bytes across the file's code, below the first row and past the last.
#[test]
fn page_index_search_agrees_with_a_search_of_all_rows() {
    for path in [LIBC, PYTHON, LD_SO] {
        let (_, table) = compile(path);
        let rows = table.rows();
        let index = table.page_index();
        let (first, last) = (rows[0].pc, rows[rows.len() - 1].pc);
        let pages = (last >> UNWIND_PAGE_SHIFT) - (first >> UNWIND_PAGE_SHIFT) + 1;
        assert_eq!(index.entries.len() as u32, pages + 1, "{path}");
        let mut checked = 0u64;
        let mut check = |addr: u32| {
            assert_eq!(index.lookup(rows, addr), in_force(rows, addr), "{path} at {addr:#x}");
            checked += 1;
        };
        for r in rows {
            for a in [r.pc.wrapping_sub(1), r.pc, r.pc + 1] {
                check(a);
            }
        }
        for a in (first.saturating_sub(4096)..last + 4096).step_by(7) {
            check(a);
        }
        check(0);
        check(u32::MAX);
        assert!(checked > 20_000, "{path}: {checked} addresses checked");
        // The most rows one search sees stays within the walker's bound.
        let most = index.entries.windows(2).map(|w| w[1].pc - w[0].pc + 1).max().unwrap_or(1);
        assert!(most <= (1 << UNWIND_PAGE_STEPS) + 1, "{path}: {most} rows in one page");
    }
}

/// The densest table possible, a row at every byte of a page, is still searched exactly
/// within the walker's bound of halvings.
#[test]
fn page_index_search_handles_a_row_at_every_byte() {
    let page = 1u32 << UNWIND_PAGE_SHIFT;
    let rows: Vec<UnwindRow> = (0..3 * page)
        .map(|i| UnwindRow::new(5 * page + i, UNWIND_CFA_RSP, (i % 500) as u16 + 8, 0, 0))
        .chain([UnwindRow::new(8 * page + 100, UNWIND_CFA_NONE, 0, 0, 0)])
        .collect();
    let index = PageIndex::of(&rows);
    assert_eq!((index.base, index.entries.len()), (5, 5));
    for addr in 0..10 * page {
        assert_eq!(index.lookup(&rows, addr), in_force(&rows, addr), "at {addr:#x}");
    }
}
