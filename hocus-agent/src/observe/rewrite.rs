//! The programs' instructions, fitted to this kernel before aya loads them:
//!
//! - Calls of kernel functions (kfuncs). Rust eBPF cannot declare a kfunc, so the
//!   programs call a helper number no kernel has (`hocus_common::kfunc`), and each such
//!   call becomes what the kernel's verifier expects of a kfunc call: source register
//!   `BPF_PSEUDO_KFUNC_CALL` and the function's id in the kernel's BTF (libbpf does the
//!   same for C programs' `__ksym` declarations). On a kernel without the kfunc the call
//!   becomes a copy of its first argument, on a path the programs never take there.
//! - Compare-exchanges, on a kernel without BPF atomics (before 5.12), whose verifier
//!   refuses a program holding one anywhere, even where it never runs: each becomes a
//!   plain store of the new value, with r0 left as the expected one (so the program takes
//!   it as done). The programs use one to claim a watched file's close: there, a close
//!   and a racing open of another thread may both report it, and the agent takes the
//!   first (docs/kernels.md).

use anyhow::{Result, bail};

use crate::observe::probe::CMPXCHG;

/// `BPF_JMP | BPF_CALL`.
const CALL: u8 = 0x85;
/// `BPF_PSEUDO_KFUNC_CALL` in the source register (high nibble of the register byte).
const KFUNC_CALL_REGISTERS: u8 = 2 << 4;
/// `BPF_ALU64 | BPF_MOV | BPF_X`, and registers dst r0, src r1: `r0 = r1`.
const MOVE: u8 = 0xbf;
const R0_FROM_R1: u8 = 1 << 4;
/// `BPF_STX | BPF_ATOMIC | BPF_DW` and `BPF_STX | BPF_MEM | BPF_DW`.
const ATOMIC_64: u8 = 0xdb;
const STORE_64: u8 = 0x7b;

const SHT_PROGBITS: u32 = 1;
const SHF_EXECINSTR: u64 = 0x4;

/// A copy of the programs' object file, as 8-byte words (aya wants it aligned).
pub struct Object {
    words: Vec<u64>,
    len: usize,
}

impl Object {
    pub fn new(elf: &[u8]) -> Self {
        let mut words = vec![0u64; elf.len().div_ceil(8)];
        // SAFETY: u64s are plain bytes; the slice covers exactly their memory.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), words.len() * 8)
        };
        bytes[..elf.len()].copy_from_slice(elf);
        Self {
            words,
            len: elf.len(),
        }
    }

    /// The object as bytes, for aya.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: u64s are plain bytes; the slice covers exactly their memory.
        let all =
            unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast(), self.words.len() * 8) };
        &all[..self.len]
    }

    /// Calls `f` with each instruction of the code sections, writable.
    fn each_instruction(&mut self, mut f: impl FnMut(&mut [u8])) -> Result<()> {
        let sections = code_sections(self.bytes())?;
        // SAFETY: as in `bytes`.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(
                self.words.as_mut_ptr().cast::<u8>(),
                self.words.len() * 8,
            )
        };
        for (offset, size) in sections {
            bytes[offset..offset + size]
                .chunks_exact_mut(8)
                .for_each(&mut f);
        }
        Ok(())
    }

    /// Makes every call of placeholder `helper` a call of kfunc `id`, or, with no id,
    /// `r0 = r1`. Fails if there is none: the object was built from other sources.
    pub fn kfunc_calls(&mut self, helper: i32, id: Option<u32>) -> Result<()> {
        let mut calls = 0;
        self.each_instruction(|insn| {
            let is_placeholder = insn[0] == CALL
                && insn[1] == 0
                && insn[2..4] == [0, 0]
                && insn[4..8] == helper.to_le_bytes();
            if !is_placeholder {
                return;
            }
            match id {
                Some(id) => {
                    insn[1] = KFUNC_CALL_REGISTERS;
                    insn[4..8].copy_from_slice(&id.to_le_bytes());
                }
                None => insn.copy_from_slice(&[MOVE, R0_FROM_R1, 0, 0, 0, 0, 0, 0]),
            }
            calls += 1;
        })?;
        if calls == 0 {
            bail!(
                "the eBPF object calls no kfunc placeholder {helper:#x}: built from other sources"
            );
        }
        Ok(())
    }

    /// Makes every 64-bit compare-exchange a plain store of its new value (same
    /// registers and offset); returns how many.
    pub fn plain_compare_exchanges(&mut self) -> Result<usize> {
        let mut n = 0;
        self.each_instruction(|insn| {
            if insn[0] == ATOMIC_64 && insn[4..8] == CMPXCHG.to_le_bytes() {
                insn[0] = STORE_64;
                insn[4..8].copy_from_slice(&[0; 4]);
                n += 1;
            }
        })?;
        Ok(n)
    }
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

    fn count(o: &Object, code: u8, registers: u8, imm: i32) -> usize {
        let b = o.bytes();
        code_sections(b)
            .unwrap()
            .into_iter()
            .flat_map(|(at, size)| b[at..at + size].chunks_exact(8))
            .filter(|i| i[0] == code && i[1] == registers && i[4..8] == imm.to_le_bytes())
            .count()
    }

    fn changed(a: &Object, b: &Object) -> usize {
        a.words.iter().zip(&b.words).filter(|(x, y)| x != y).count()
    }

    #[test]
    fn rewrites_every_placeholder_call_and_nothing_else() {
        let original = Object::new(PROGRAMS);
        let helper = kfunc::RDONLY_CAST;
        let placeholders = count(&original, CALL, 0, helper);
        assert!(placeholders > 0, "the programs cast files");
        let mut kfunc = Object::new(PROGRAMS);
        kfunc.kfunc_calls(helper, Some(1234)).unwrap();
        assert_eq!(count(&kfunc, CALL, 0, helper), 0);
        assert_eq!(
            count(&kfunc, CALL, KFUNC_CALL_REGISTERS, 1234),
            placeholders
        );
        assert_eq!(changed(&kfunc, &original), placeholders);
        let mut moved = Object::new(PROGRAMS);
        moved.kfunc_calls(helper, None).unwrap();
        assert_eq!(count(&moved, CALL, 0, helper), 0);
        let moves = |o| count(o, MOVE, R0_FROM_R1, 0);
        assert_eq!(moves(&moved), moves(&original) + placeholders);
        assert_eq!(moved.bytes().len(), PROGRAMS.len());
    }

    #[test]
    fn compare_exchanges_become_plain_stores_with_their_registers() {
        let original = Object::new(PROGRAMS);
        let is_cmpxchg = |i: &[u8]| i[0] == ATOMIC_64 && i[4..8] == CMPXCHG.to_le_bytes();
        let b = original.bytes();
        let sites: Vec<[u8; 8]> = code_sections(b)
            .unwrap()
            .into_iter()
            .flat_map(|(at, size)| b[at..at + size].chunks_exact(8))
            .filter(|i| is_cmpxchg(i))
            .map(|i| i.try_into().unwrap())
            .collect();
        assert!(!sites.is_empty(), "the programs claim closes with one");
        let mut plain = Object::new(PROGRAMS);
        assert_eq!(plain.plain_compare_exchanges().unwrap(), sites.len());
        assert_eq!(changed(&plain, &original), sites.len());
        // Each in its place, with the same registers and offset, stored plainly.
        for (was, now) in original.words.iter().zip(&plain.words) {
            let (was, now) = (was.to_le_bytes(), now.to_le_bytes());
            if sites.contains(&was) {
                assert_eq!(now[..4], [STORE_64, was[1], was[2], was[3]]);
                assert_eq!(now[4..], [0; 4]);
            }
        }
        assert_eq!(plain.plain_compare_exchanges().unwrap(), 0);
    }

    #[test]
    fn refuses_what_is_not_an_object_with_placeholders() {
        assert!(
            Object::new(b"not an ELF file")
                .kfunc_calls(kfunc::RDONLY_CAST, Some(1))
                .is_err()
        );
        assert!(
            Object::new(PROGRAMS)
                .kfunc_calls(0x7fff_fff0, Some(1))
                .is_err()
        );
    }
}
