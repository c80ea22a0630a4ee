//! Learning jobs on NFS from the NFS client's own functions (fentry and fexit on the
//! `nfs` and `nfsv4` modules' functions, through their BTF: Linux 5.11 and later),
//! instead of from every syscall on the node: what those programs read, found by the
//! agent in the kernel's BTF.

/// Where the kernel keeps what the NFS programs read; all 0 where the kernel cannot give
/// them (the programs are then not attached). The hooked functions' arguments are where
/// Linux 5.12 and later put them (checked by the agent against their BTF).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NfsOffsets {
    /// file.f_flags: the flags the file was opened with
    pub file_flags: u32,
    /// iattr.ia_valid: which attributes a setattr changes (ATTR_SIZE)
    pub iattr_valid: u32,
    /// kiocb.ki_pos: where a read through it stands
    pub kiocb_pos: u32,
}

/// `ia_valid`'s ATTR_SIZE.
pub const ATTR_SIZE: u32 = 1 << 3;
