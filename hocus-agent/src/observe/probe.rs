//! What this kernel's BPF offers, found by asking it: a tiny program that uses a feature
//! is given to the verifier, and its answer is the probe (as `bpftool feature probe`
//! does). Each feature the programs use has a fallback, chosen in `loader`.

use std::io;

/// `bpf(BPF_PROG_LOAD)`.
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_TYPE_SOCKET_FILTER: u32 = 1;

/// One instruction: opcode, registers (source high, destination low), offset, immediate.
fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> [u8; 8] {
    let [o0, o1] = off.to_le_bytes();
    let [i0, i1, i2, i3] = imm.to_le_bytes();
    [code, (src << 4) | dst, o0, o1, i0, i1, i2, i3]
}

const R0: u8 = 0;
const R1: u8 = 1;
const R10: u8 = 10;
/// `BPF_ALU64 | BPF_MOV | BPF_K`: `dst = imm`.
const MOV_IMM: u8 = 0xb7;
/// `BPF_STX | BPF_MEM | BPF_DW`: `*(u64 *)(dst + off) = src`.
const STORE: u8 = 0x7b;
/// `BPF_STX | BPF_ATOMIC | BPF_DW` (5.12; the same opcode was `BPF_XADD` before, which
/// takes no operation in its immediate).
const ATOMIC: u8 = 0xdb;
/// `BPF_CMPXCHG`: compare with r0, exchange, r0 = the old value.
pub const CMPXCHG: i32 = 0xf1;
const EXIT: u8 = 0x95;

/// Whether the verifier takes a compare-exchange (BPF atomics, 5.12): the programs claim
/// a watched file's close with one.
pub fn atomics() -> bool {
    let program = [
        insn(MOV_IMM, R0, 0, 0, 0),
        insn(STORE, R10, R0, -8, 0),
        insn(MOV_IMM, R1, 0, 0, 1),
        insn(ATOMIC, R10, R1, -8, CMPXCHG),
        insn(MOV_IMM, R0, 0, 0, 0),
        insn(EXIT, 0, 0, 0, 0),
    ];
    load(&program).is_ok()
}

/// Gives `program` to the verifier as a socket filter, and closes it again.
fn load(program: &[[u8; 8]]) -> io::Result<()> {
    let license = c"GPL";
    // union bpf_attr's BPF_PROG_LOAD part: prog_type, insn_cnt, insns, license; the rest
    // zeros (no log, no flags).
    let mut attr = [0u8; 128];
    attr[0..4].copy_from_slice(&BPF_PROG_TYPE_SOCKET_FILTER.to_ne_bytes());
    attr[4..8].copy_from_slice(&(program.len() as u32).to_ne_bytes());
    attr[8..16].copy_from_slice(&(program.as_ptr() as u64).to_ne_bytes());
    attr[16..24].copy_from_slice(&(license.as_ptr() as u64).to_ne_bytes());
    // SAFETY: the attr and the memory it points to live across the call.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_PROG_LOAD,
            attr.as_ptr(),
            attr.len() as u32,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor the kernel just gave us.
    unsafe { libc::close(fd as i32) };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_kernel_has_atomics_and_refuses_nonsense() {
        // 5.12 and later: the kernels the unit tests run on.
        assert!(atomics());
        // An unknown atomic operation is refused: the probe can say no.
        let bad = [
            insn(MOV_IMM, R0, 0, 0, 0),
            insn(STORE, R10, R0, -8, 0),
            insn(ATOMIC, R10, R0, -8, 0x7f),
            insn(EXIT, 0, 0, 0, 0),
        ];
        assert!(load(&bad).is_err());
    }
}
