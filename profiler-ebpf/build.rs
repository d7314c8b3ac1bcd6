use which::which;

/// bpf-linker is an undeclared dependency of the BPF build: rebuild when it changes and fail
/// with a hint when it is missing.
fn main() {
    match which("bpf-linker") {
        Ok(path) => println!("cargo:rerun-if-changed={}", path.display()),
        Err(_) => panic!("bpf-linker not found on PATH: run `cargo xtask setup`"),
    }
}
