//! The x86-64 SDT argument grammar: space-separated `SIZE@LOCATION`, where SIZE is ±1, 2, 4
//! or 8 (negative = signed) and LOCATION is `%reg`, `$imm`, `disp(%reg)`,
//! `disp(%base,%index,scale)`, `sym(%rip)` / `sym+off(%rip)` or `$sym`.
//! Each argument becomes a [`UsdtArgSpec`] the BPF program evaluates from `pt_regs`.

use std::{collections::HashMap, fmt};

use profiler_common::{
    USDT_ARG_CONST, USDT_ARG_DEREF, USDT_ARG_REG, USDT_ARG_SIB, USDT_MAX_ARGS, UsdtArgSpec,
};

/// Byte offset of the 64-bit register in x86-64 `struct pt_regs`.
const PT_REGS_IP: u8 = 128;

fn reg_offset(name: &str) -> Option<u8> {
    // Every width of one register reads the same pt_regs slot; the size truncates.
    Some(match name {
        "rip" | "eip" => PT_REGS_IP,
        "r15" | "r15d" | "r15w" | "r15b" => 0,
        "r14" | "r14d" | "r14w" | "r14b" => 8,
        "r13" | "r13d" | "r13w" | "r13b" => 16,
        "r12" | "r12d" | "r12w" | "r12b" => 24,
        "rbp" | "ebp" | "bp" | "bpl" => 32,
        "rbx" | "ebx" | "bx" | "bl" | "bh" => 40,
        "r11" | "r11d" | "r11w" | "r11b" => 48,
        "r10" | "r10d" | "r10w" | "r10b" => 56,
        "r9" | "r9d" | "r9w" | "r9b" => 64,
        "r8" | "r8d" | "r8w" | "r8b" => 72,
        "rax" | "eax" | "ax" | "al" => 80,
        "rcx" | "ecx" | "cx" | "cl" => 88,
        "rdx" | "edx" | "dx" | "dl" => 96,
        "rsi" | "esi" | "si" | "sil" => 104,
        "rdi" | "edi" | "di" | "dil" => 112,
        "rsp" | "esp" | "sp" | "spl" => 152,
        _ => return None,
    })
}

/// One parsed argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArgSpec {
    /// Bytes: 1, 2, 4 or 8.
    pub size: u8,
    pub signed: bool,
    pub spec: UsdtArgSpec,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ArgError {
    /// The text does not follow the grammar (or names an unknown register).
    Syntax(String),
    /// A `sym(%rip)` / `$sym` argument whose symbol is not in the file's symbol tables.
    UnknownSymbol(String),
    /// More arguments than the BPF program evaluates.
    TooMany(usize),
}

impl fmt::Display for ArgError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ArgError::Syntax(a) => write!(f, "unsupported argument '{a}'"),
            ArgError::UnknownSymbol(s) => write!(f, "argument symbol '{s}' not found"),
            ArgError::TooMany(n) => write!(f, "{n} arguments (at most {USDT_MAX_ARGS} supported)"),
        }
    }
}

fn parse_int(s: &str) -> Option<i64> {
    let (neg, digits) = match s.strip_prefix('-') {
        Some(d) => (true, d),
        None => (false, s.strip_prefix('+').unwrap_or(s)),
    };
    let v = match digits.strip_prefix("0x").or_else(|| digits.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok()? as i64,
        None => digits.parse::<u64>().ok()? as i64,
    };
    Some(if neg { v.wrapping_neg() } else { v })
}

fn reg(s: &str) -> Option<u8> {
    reg_offset(s.strip_prefix('%')?)
}

/// `sym`, `sym+16`, `sym-8` → (sym, offset).
fn split_symbol(s: &str) -> (&str, i64) {
    for (i, c) in s.char_indices().skip(1) {
        if (c == '+' || c == '-')
            && let Some(off) = parse_int(&s[i..])
        {
            return (&s[..i], off);
        }
    }
    (s, 0)
}

fn is_symbol(s: &str) -> bool {
    s.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == '.')
        && s.chars().all(|c| c.is_ascii_alphanumeric() || "_.$@".contains(c))
}

/// Parses one `SIZE@LOCATION`. `probe_pc` is the probe's link-time address and `symbols` the
/// file's symbols: rip-relative locations become offsets from the ip at the probe, which the
/// kernel sets to the probe address, so no per-process load address is needed.
pub fn parse_arg(
    text: &str,
    probe_pc: u64,
    symbols: &HashMap<String, u64>,
) -> Result<ArgSpec, ArgError> {
    let syntax = || ArgError::Syntax(text.to_owned());
    let (size, loc) = text.split_once('@').ok_or_else(syntax)?;
    let size: i32 = size.parse().map_err(|_| syntax())?;
    let signed = size < 0;
    let bytes = size.unsigned_abs();
    if ![1, 2, 4, 8].contains(&bytes) {
        return Err(syntax());
    }
    let mut spec = UsdtArgSpec {
        bitshift: (64 - 8 * bytes) as u8,
        signed: signed as u8,
        ..Default::default()
    };
    let sym_addr = |name: &str| {
        symbols.get(name).copied().ok_or_else(|| ArgError::UnknownSymbol(name.to_owned()))
    };
    if let Some(imm) = loc.strip_prefix('$') {
        if let Some(v) = parse_int(imm) {
            spec.kind = USDT_ARG_CONST;
            spec.val_off = v;
        } else if is_symbol(split_symbol(imm).0) {
            // The address of a symbol: ip-relative so it holds in PIEs and libraries.
            let (sym, off) = split_symbol(imm);
            spec.kind = USDT_ARG_REG;
            spec.reg_off = PT_REGS_IP;
            spec.val_off = sym_addr(sym)?.wrapping_sub(probe_pc) as i64 + off;
        } else {
            return Err(syntax());
        }
    } else if loc.starts_with('%') {
        spec.kind = USDT_ARG_REG;
        spec.reg_off = reg(loc).ok_or_else(syntax)?;
    } else {
        // disp(%base) or disp(%base,%index[,scale]); disp may be a number, empty or a symbol.
        let open = loc.find('(').ok_or_else(syntax)?;
        let inner = loc[open + 1..].strip_suffix(')').ok_or_else(syntax)?;
        let disp = &loc[..open];
        let parts: Vec<&str> = inner.split(',').map(str::trim).collect();
        let base = reg(parts[0]).ok_or_else(syntax)?;
        let off = if disp.is_empty() {
            0
        } else if let Some(v) = parse_int(disp) {
            v
        } else {
            let (sym, off) = split_symbol(disp);
            if base != PT_REGS_IP || !is_symbol(sym) {
                return Err(syntax());
            }
            sym_addr(sym)?.wrapping_sub(probe_pc) as i64 + off
        };
        if base == PT_REGS_IP && parse_int(disp).is_some() {
            // A numeric rip displacement is relative to the next instruction, which we do
            // not know at the probe site.
            return Err(syntax());
        }
        spec.reg_off = base;
        match parts.len() {
            1 => spec.kind = USDT_ARG_DEREF,
            2 | 3 => {
                spec.kind = USDT_ARG_SIB;
                spec.idx_reg_off = reg(parts[1]).ok_or_else(syntax)?;
                let scale =
                    if parts.len() == 3 { parts[2].parse().map_err(|_| syntax())? } else { 1 };
                spec.scale_shift = match scale {
                    1 => 0,
                    2 => 1,
                    4 => 2,
                    8 => 3,
                    _ => return Err(syntax()),
                };
            }
            _ => return Err(syntax()),
        }
        spec.val_off = off;
    }
    Ok(ArgSpec { size: bytes as u8, signed, spec })
}

/// Parses a note's whole argument string.
pub fn parse_args(
    text: &str,
    probe_pc: u64,
    symbols: &HashMap<String, u64>,
) -> Result<Vec<ArgSpec>, ArgError> {
    let args: Vec<&str> = text.split_whitespace().collect();
    if args.len() > USDT_MAX_ARGS {
        return Err(ArgError::TooMany(args.len()));
    }
    args.iter().map(|a| parse_arg(a, probe_pc, symbols)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::usdt::notes::{
        read_probes,
        tests_paths::{LIBJVM, PYTHON},
    };

    fn one(text: &str) -> ArgSpec {
        let syms = HashMap::from([("counter".to_owned(), 0x5000u64)]);
        parse_arg(text, 0x1000, &syms).unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    #[test]
    fn table() {
        // (text, kind, reg, idx, scale_shift, val_off, size, signed)
        type Case = (&'static str, u8, u8, u8, u8, i64, u8, bool);
        let cases: &[Case] = &[
            ("8@%rax", USDT_ARG_REG, 80, 0, 0, 0, 8, false),
            ("-4@%eax", USDT_ARG_REG, 80, 0, 0, 0, 4, true),
            ("2@%ax", USDT_ARG_REG, 80, 0, 0, 0, 2, false),
            ("-1@%al", USDT_ARG_REG, 80, 0, 0, 0, 1, true),
            ("8@%r8", USDT_ARG_REG, 72, 0, 0, 0, 8, false),
            ("4@%r8d", USDT_ARG_REG, 72, 0, 0, 0, 4, false),
            ("2@%r8w", USDT_ARG_REG, 72, 0, 0, 0, 2, false),
            ("1@%r8b", USDT_ARG_REG, 72, 0, 0, 0, 1, false),
            ("1@%sil", USDT_ARG_REG, 104, 0, 0, 0, 1, false),
            ("-1@%dil", USDT_ARG_REG, 112, 0, 0, 0, 1, true),
            ("8@%r15", USDT_ARG_REG, 0, 0, 0, 0, 8, false),
            ("8@%rsp", USDT_ARG_REG, 152, 0, 0, 0, 8, false),
            ("-4@$5", USDT_ARG_CONST, 0, 0, 0, 5, 4, true),
            ("-4@$-9", USDT_ARG_CONST, 0, 0, 0, -9, 4, true),
            ("8@$0x10", USDT_ARG_CONST, 0, 0, 0, 16, 8, false),
            ("-4@-1204(%rbp)", USDT_ARG_DEREF, 32, 0, 0, -1204, 4, true),
            ("8@(%rsp)", USDT_ARG_DEREF, 152, 0, 0, 0, 8, false),
            ("-4@112(%rsp)", USDT_ARG_DEREF, 152, 0, 0, 112, 4, true),
            ("-1@-96(%rbp,%rax,8)", USDT_ARG_SIB, 32, 80, 3, -96, 1, true),
            ("1@(%rbp,%rax)", USDT_ARG_SIB, 32, 80, 0, 0, 1, false),
            ("4@8(%rdi,%rcx,4)", USDT_ARG_SIB, 112, 88, 2, 8, 4, false),
            ("8@counter(%rip)", USDT_ARG_DEREF, 128, 0, 0, 0x4000, 8, false),
            ("8@counter+16(%rip)", USDT_ARG_DEREF, 128, 0, 0, 0x4010, 8, false),
            ("8@counter-8(%rip)", USDT_ARG_DEREF, 128, 0, 0, 0x3ff8, 8, false),
            ("8@$counter", USDT_ARG_REG, 128, 0, 0, 0x4000, 8, false),
        ];
        for &(text, kind, reg, idx, scale, off, size, signed) in cases {
            let a = one(text);
            assert_eq!(
                (a.spec.kind, a.spec.reg_off, a.spec.idx_reg_off, a.spec.scale_shift),
                (kind, reg, idx, scale),
                "{text}"
            );
            assert_eq!((a.spec.val_off, a.size, a.signed), (off, size, signed), "{text}");
            assert_eq!(a.spec.bitshift, 64 - 8 * size, "{text}");
            assert_eq!(a.spec.signed, signed as u8, "{text}");
        }
    }

    #[test]
    fn rejects() {
        let syms = HashMap::new();
        for bad in [
            "8%rax",
            "3@%rax",
            "8@%xmm0",
            "8@",
            "8@$",
            "8@5(%rax",
            "8@(%rax,%rbx,3)",
            "x@%rax",
            "8@16(%rip)",
            "8@foo(%rax)",
        ] {
            assert!(matches!(parse_arg(bad, 0, &syms), Err(ArgError::Syntax(_))), "{bad}");
        }
        assert_eq!(
            parse_arg("8@missing(%rip)", 0, &syms),
            Err(ArgError::UnknownSymbol("missing".into()))
        );
        assert_eq!(parse_args(&["8@%rax"; 13].join(" "), 0, &syms), Err(ArgError::TooMany(13)));
        assert_eq!(parse_args("", 0, &syms), Ok(vec![]));
    }

    #[test]
    fn every_python_and_libjvm_spec_parses() {
        for path in [PYTHON, LIBJVM] {
            let p = read_probes(std::path::Path::new(path)).unwrap();
            let mut n = 0;
            for note in &p.notes {
                let args = parse_args(&note.args, note.pc, &p.symbols).unwrap_or_else(|e| {
                    panic!("{path} {}: {e} in {:?}", note.full_name(), note.args)
                });
                n += args.len();
            }
            assert!(n > 0, "{path}: no arguments parsed");
        }
    }
}
