//! Calls of kernel functions (kfuncs) in the programs. Rust eBPF cannot declare a kfunc,
//! so the programs call a helper number no kernel has (`hocus_common::kfunc`), and this
//! rewrites each such call in the object file, before aya loads it, into what the
//! kernel's verifier expects of a kfunc call: source register `BPF_PSEUDO_KFUNC_CALL`
//! and the function's id in the kernel's BTF (libbpf does the same for C programs'
//! `__ksym` declarations). On a kernel without the kfunc the call becomes a copy of its
//! first argument, on a path the programs never take there.

use anyhow::{Result, bail};

/// `BPF_JMP | BPF_CALL`.
const CALL: u8 = 0x85;
/// `BPF_PSEUDO_KFUNC_CALL` in the source register (high nibble of the register byte).
const KFUNC_CALL_REGISTERS: u8 = 2 << 4;
/// `BPF_ALU64 | BPF_MOV | BPF_X`, and registers dst r0, src r1: `r0 = r1`.
const MOVE: u8 = 0xbf;
const R0_FROM_R1: u8 = 1 << 4;

const SHT_PROGBITS: u32 = 1;
const SHF_EXECINSTR: u64 = 0x4;

/// The object file with every call of placeholder `helper` made a call of kfunc `id`,
/// or, with no id, `r0 = r1`. Returned as 8-byte words: aya wants the object aligned.
pub fn rewrite(elf: &[u8], helper: i32, id: Option<u32>) -> Result<Vec<u64>> {
    let mut words = vec![0u64; elf.len().div_ceil(8)];
    // SAFETY: u64s are plain bytes; the slice covers exactly their memory.
    let bytes =
        unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), words.len() * 8) };
    bytes[..elf.len()].copy_from_slice(elf);
    let mut calls = 0;
    for (offset, size) in code_sections(elf)? {
        let code = &mut bytes[offset..offset + size];
        for insn in code.chunks_exact_mut(8) {
            let is_placeholder = insn[0] == CALL
                && insn[1] == 0
                && insn[2..4] == [0, 0]
                && insn[4..8] == helper.to_le_bytes();
            if !is_placeholder {
                continue;
            }
            match id {
                Some(id) => {
                    insn[1] = KFUNC_CALL_REGISTERS;
                    insn[4..8].copy_from_slice(&id.to_le_bytes());
                }
                None => insn.copy_from_slice(&[MOVE, R0_FROM_R1, 0, 0, 0, 0, 0, 0]),
            }
            calls += 1;
        }
    }
    if calls == 0 {
        bail!("the eBPF object calls no kfunc placeholder {helper:#x}: built from other sources");
    }
    Ok(words)
}

/// The rewritten object as bytes, for aya.
pub fn as_bytes(words: &[u64]) -> &[u8] {
    // SAFETY: u64s are plain bytes; the slice covers exactly their memory.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast(), words.len() * 8) }
}

/// The (offset, size) of each section of executable code in a 64-bit little-endian ELF.
fn code_sections(elf: &[u8]) -> Result<Vec<(usize, usize)>> {
    let u16_at = |at: usize| {
        elf.get(at..at + 2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
    };
    let u32_at = |at: usize| {
        elf.get(at..at + 4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
    };
    let u64_at = |at: usize| {
        elf.get(at..at + 8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
    };
    if elf.get(..6) != Some(b"\x7fELF\x02\x01".as_slice()) {
        bail!("the eBPF object is not a 64-bit little-endian ELF file");
    }
    let truncated = || anyhow::anyhow!("the eBPF object is truncated");
    let table = usize::try_from(u64_at(0x28).ok_or_else(truncated)?)?;
    let entry_size = usize::from(u16_at(0x3a).ok_or_else(truncated)?);
    let count = usize::from(u16_at(0x3c).ok_or_else(truncated)?);
    let mut sections = Vec::new();
    for i in 0..count {
        let header = table + i * entry_size;
        let kind = u32_at(header + 4).ok_or_else(truncated)?;
        let flags = u64_at(header + 8).ok_or_else(truncated)?;
        if kind != SHT_PROGBITS || flags & SHF_EXECINSTR == 0 {
            continue;
        }
        let offset = usize::try_from(u64_at(header + 0x18).ok_or_else(truncated)?)?;
        let size = usize::try_from(u64_at(header + 0x20).ok_or_else(truncated)?)?;
        if offset.checked_add(size).is_none_or(|end| end > elf.len()) || size % 8 != 0 {
            bail!("the eBPF object's section {i} lies outside it");
        }
        sections.push((offset, size));
    }
    Ok(sections)
}

#[cfg(test)]
mod tests {
    use hocus_common::kfunc;

    use super::*;

    const PROGRAMS: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/hocus"));

    fn calls(words: &[u64], code: u8, registers: u8, imm: u32) -> usize {
        words
            .iter()
            .filter(|w| {
                let b = w.to_le_bytes();
                b[0] == code && b[1] == registers && b[4..8] == imm.to_le_bytes()
            })
            .count()
    }

    #[test]
    fn rewrites_every_placeholder_call_and_nothing_else() {
        let original: Vec<u64> = PROGRAMS
            .chunks(8)
            .map(|c| {
                let mut w = [0u8; 8];
                w[..c.len()].copy_from_slice(c);
                u64::from_le_bytes(w)
            })
            .collect();
        let helper = kfunc::RDONLY_CAST;
        let placeholders = calls(&original, CALL, 0, helper as u32);
        assert!(placeholders > 0, "the programs cast files");
        let kfunc = rewrite(PROGRAMS, helper, Some(1234)).unwrap();
        assert_eq!(calls(&kfunc, CALL, 0, helper as u32), 0);
        assert_eq!(
            calls(&kfunc, CALL, KFUNC_CALL_REGISTERS, 1234),
            placeholders
        );
        let changed = kfunc.iter().zip(&original).filter(|(a, b)| a != b).count();
        assert_eq!(changed, placeholders);
        let moved = rewrite(PROGRAMS, helper, None).unwrap();
        assert_eq!(calls(&moved, CALL, 0, helper as u32), 0);
        let moves = |words| calls(words, MOVE, R0_FROM_R1, 0);
        assert_eq!(moves(&moved), moves(&original) + placeholders);
    }

    #[test]
    fn refuses_what_is_not_an_object_with_placeholders() {
        assert!(rewrite(b"not an ELF file", kfunc::RDONLY_CAST, Some(1)).is_err());
        assert!(rewrite(PROGRAMS, 0x7fff_fff0, Some(1)).is_err());
    }
}
