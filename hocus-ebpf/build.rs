// Rebuild the eBPF object when bpf-linker changes: it is not tracked by cargo.
fn main() {
    if let Ok(linker) = which::which("bpf-linker") {
        println!("cargo:rerun-if-changed={}", linker.display());
    }
}
