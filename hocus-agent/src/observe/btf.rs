//! Where the kernel keeps the fields the eBPF programs read (a task's descriptors and
//! working directory, a file's path, a dentry's name and parent ...), read from the
//! kernel's own type information (`/sys/kernel/btf/vmlinux`). Rust eBPF has no CO-RE
//! relocations, so the agent resolves each offset here and passes them in as read-only
//! globals. The verifier checks the programs' plain loads through typed pointers against
//! the same BTF; what they read with `bpf_probe_read_kernel` (which tolerates a wrong
//! address but would return garbage) is not checked, so `tracer::calibrate` compares
//! the results with what `fstat` says before anything is trusted.
//!
//! Only what is needed of the BTF format is read: the type section (to walk struct and
//! union members, anonymous ones included) and the string section (for names).

use std::{collections::HashMap, path::Path};

use anyhow::{Context, Result, bail};
use hocus_common::{KernelOffsets, nfs_learn::NfsOffsets, requests::RequestOffsets};

const MAGIC: u16 = 0xeb9f;

const KIND_INT: u32 = 1;
const KIND_PTR: u32 = 2;
const KIND_ARRAY: u32 = 3;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;
const KIND_ENUM: u32 = 6;
const KIND_TYPEDEF: u32 = 8;
const KIND_FUNC: u32 = 12;
const KIND_VOLATILE: u32 = 9;
const KIND_CONST: u32 = 10;
const KIND_RESTRICT: u32 = 11;
const KIND_FUNC_PROTO: u32 = 13;
const KIND_VAR: u32 = 14;
const KIND_DATASEC: u32 = 15;
const KIND_DECL_TAG: u32 = 17;
const KIND_TYPE_TAG: u32 = 18;
const KIND_ENUM64: u32 = 19;

#[derive(Debug, Clone, Copy)]
struct Member {
    name_off: u32,
    type_id: u32,
    /// Bit offset from the start of the enclosing struct or union.
    bit_offset: u32,
}

#[derive(Debug, Clone)]
struct Type {
    name_off: u32,
    kind: u32,
    /// The referenced type, for typedefs and modifiers.
    refers_to: u32,
    /// A struct's or union's members; a function prototype's parameters (no offset).
    members: Vec<Member>,
    /// An enum's names (their string offsets).
    names: Vec<u32>,
}

/// The kernel's types, as far as struct layouts go.
pub struct Btf {
    /// By type id; id 0 is `void`.
    types: Vec<Type>,
    strings: Vec<u8>,
    structs_by_name: HashMap<String, u32>,
}

impl Btf {
    pub fn from_kernel() -> Result<Self> {
        let path = Path::new("/sys/kernel/btf/vmlinux");
        let data = std::fs::read(path).with_context(|| {
            format!(
                "reading {}: hocus needs a kernel built with CONFIG_DEBUG_INFO_BTF",
                path.display()
            )
        })?;
        Self::parse(&data).with_context(|| format!("reading {}", path.display()))
    }

    pub fn parse(data: &[u8]) -> Result<Self> {
        let (parsed, strings) = read_sections(data)?;
        let mut types = vec![Type {
            name_off: 0,
            kind: 0,
            refers_to: 0,
            members: Vec::new(),
            names: Vec::new(),
        }];
        types.extend(parsed);
        let mut btf = Self {
            types,
            strings,
            structs_by_name: HashMap::new(),
        };
        for (id, t) in btf.types.iter().enumerate() {
            if t.kind == KIND_STRUCT && t.name_off != 0 {
                let name = btf.name(t.name_off).to_owned();
                // The first definition wins; a later one of the same name is a forward
                // declaration's twin in practice.
                btf.structs_by_name.entry(name).or_insert(id as u32);
            }
        }
        Ok(btf)
    }

    fn name(&self, off: u32) -> &str {
        name_in(&self.strings, off)
    }

    /// Follows typedefs and modifiers to the type they name.
    fn resolve(&self, mut id: u32) -> Option<&Type> {
        for _ in 0..32 {
            let t = self.types.get(id as usize)?;
            match t.kind {
                KIND_TYPEDEF | KIND_VOLATILE | KIND_CONST | KIND_RESTRICT | KIND_TYPE_TAG => {
                    id = t.refers_to;
                }
                _ => return Some(t),
            }
        }
        None
    }

    /// The bit offset of `field` in `ty`, looking through anonymous structs and unions.
    fn find(&self, ty: &Type, field: &str) -> Option<(u32, u32)> {
        for m in &ty.members {
            if m.name_off != 0 {
                if self.name(m.name_off) == field {
                    return Some((m.bit_offset, m.type_id));
                }
                continue;
            }
            let inner = self.resolve(m.type_id)?;
            if matches!(inner.kind, KIND_STRUCT | KIND_UNION) {
                if let Some((bits, id)) = self.find(inner, field) {
                    return Some((m.bit_offset + bits, id));
                }
            }
        }
        None
    }

    /// The byte offset of a dotted field path (`"f_path.dentry"`) in struct `name`.
    pub fn offset(&self, name: &str, fields: &str) -> Result<u32> {
        let id = *self
            .structs_by_name
            .get(name)
            .with_context(|| format!("the kernel has no struct {name}"))?;
        let mut ty = self.resolve(id).context("unresolvable type")?;
        let mut bits = 0;
        for field in fields.split('.') {
            let (at, member_type) = self
                .find(ty, field)
                .with_context(|| format!("struct {name} has no field {fields}"))?;
            bits += at;
            ty = self.resolve(member_type).context("unresolvable type")?;
        }
        if bits % 8 != 0 {
            bail!("{name}.{fields} is a bit field");
        }
        Ok(bits / 8)
    }

    pub fn has(&self, name: &str, fields: &str) -> bool {
        self.offset(name, fields).is_ok()
    }

    /// The id of the kernel function `name` (a kfunc's, for a call to it).
    pub fn function(&self, name: &str) -> Option<u32> {
        let id = self
            .types
            .iter()
            .position(|t| t.kind == KIND_FUNC && self.name(t.name_off) == name)?;
        u32::try_from(id).ok()
    }

    /// Kernel function `name` (built in): its id, and what each of its parameters points
    /// to (`ModuleBtf::function`).
    pub fn function_params(&self, name: &str) -> Option<(u32, Vec<String>)> {
        let id = self.function(name)?;
        let proto = self.types.get(self.types[id as usize].refers_to as usize)?;
        let params = pointees(proto, |id| self.resolve(id), |off| self.name(off));
        Some((id, params))
    }

    /// Whether the kernel has BPF helper `name` (`get_current_task_btf`): its enum of
    /// helpers (`bpf_func_id`) names every one it has.
    pub fn has_helper(&self, name: &str) -> bool {
        let wanted = format!("BPF_FUNC_{name}");
        self.types
            .iter()
            .filter(|t| matches!(t.kind, KIND_ENUM | KIND_ENUM64))
            .filter(|t| self.name(t.name_off) == "bpf_func_id")
            .any(|t| t.names.iter().any(|n| self.name(*n) == wanted))
    }

    /// The id of struct `name`.
    pub fn struct_id(&self, name: &str) -> Option<u32> {
        self.structs_by_name.get(name).copied()
    }

    /// The id of struct `name` if its first field points to a struct `target`.
    pub fn first_field_points_to(&self, name: &str, target: &str) -> Option<u32> {
        let id = *self.structs_by_name.get(name)?;
        let first = self.resolve(id)?.members.first()?;
        let pointer = self.resolve(first.type_id)?;
        let pointee = self.resolve(pointer.refers_to)?;
        (first.bit_offset == 0
            && pointer.kind == KIND_PTR
            && pointee.kind == KIND_STRUCT
            && self.name(pointee.name_off) == target)
            .then_some(id)
    }
}

/// The string at `off` in a string section.
fn name_in(strings: &[u8], off: u32) -> &str {
    let rest = strings.get(off as usize..).unwrap_or_default();
    let end = rest.iter().position(|b| *b == 0).unwrap_or(rest.len());
    std::str::from_utf8(&rest[..end]).unwrap_or_default()
}

/// A kernel module's types (`/sys/kernel/btf/<module>`, Linux 5.11): split BTF, whose
/// type ids and string offsets go on from vmlinux's.
pub struct ModuleBtf<'a> {
    base: &'a Btf,
    types: Vec<Type>,
    strings: Vec<u8>,
}

impl<'a> ModuleBtf<'a> {
    /// Module `name`'s types, on top of vmlinux's `base`.
    pub fn read(base: &'a Btf, name: &str) -> Result<Self> {
        let path = Path::new("/sys/kernel/btf").join(name);
        let data = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        let (types, strings) =
            read_sections(&data).with_context(|| format!("reading {}", path.display()))?;
        Ok(Self {
            base,
            types,
            strings,
        })
    }

    fn name(&self, off: u32) -> &str {
        match off.checked_sub(self.base.strings.len() as u32) {
            Some(own) => name_in(&self.strings, own),
            None => self.base.name(off),
        }
    }

    fn get(&self, id: u32) -> Option<&Type> {
        match id.checked_sub(self.base.types.len() as u32) {
            Some(own) => self.types.get(own as usize),
            None => self.base.types.get(id as usize),
        }
    }

    /// Follows typedefs and modifiers to the type they name.
    fn resolve(&self, mut id: u32) -> Option<&Type> {
        for _ in 0..32 {
            let t = self.get(id)?;
            match t.kind {
                KIND_TYPEDEF | KIND_VOLATILE | KIND_CONST | KIND_RESTRICT | KIND_TYPE_TAG => {
                    id = t.refers_to;
                }
                _ => return Some(t),
            }
        }
        None
    }

    /// Function `name` of the module: its type id, and what each of its parameters
    /// points to, in order (a struct's name; empty for anything else).
    pub fn function(&self, name: &str) -> Option<(u32, Vec<String>)> {
        let at = self
            .types
            .iter()
            .position(|t| t.kind == KIND_FUNC && self.name(t.name_off) == name)?;
        let proto = self.get(self.types[at].refers_to)?;
        let params = pointees(proto, |id| self.resolve(id), |off| self.name(off));
        let id = self.base.types.len() + at;
        Some((u32::try_from(id).ok()?, params))
    }
}

/// What each parameter of function prototype `proto` points to: a struct's name, or
/// empty.
fn pointees<'a>(
    proto: &Type,
    resolve: impl Fn(u32) -> Option<&'a Type>,
    name: impl Fn(u32) -> &'a str,
) -> Vec<String> {
    proto
        .members
        .iter()
        .map(|p| {
            resolve(p.type_id)
                .filter(|t| t.kind == KIND_PTR)
                .and_then(|t| resolve(t.refers_to))
                .filter(|t| t.kind == KIND_STRUCT)
                .map_or(String::new(), |t| name(t.name_off).to_owned())
        })
        .collect()
}

/// A BTF blob's types (in order: the first has the blob's first id) and its strings.
fn read_sections(data: &[u8]) -> Result<(Vec<Type>, Vec<u8>)> {
    let u16_at = |at: usize| -> Result<u16> {
        Ok(u16::from_le_bytes(
            data.get(at..at + 2).context("truncated")?.try_into()?,
        ))
    };
    let u32_at = |at: usize| -> Result<u32> {
        Ok(u32::from_le_bytes(
            data.get(at..at + 4).context("truncated")?.try_into()?,
        ))
    };
    if u16_at(0)? != MAGIC {
        bail!("not little-endian BTF");
    }
    let hdr_len = u32_at(4)? as usize;
    let (type_off, type_len) = (u32_at(8)? as usize, u32_at(12)? as usize);
    let (str_off, str_len) = (u32_at(16)? as usize, u32_at(20)? as usize);
    let strings = data
        .get(hdr_len + str_off..hdr_len + str_off + str_len)
        .context("string section out of bounds")?
        .to_vec();
    let mut types = Vec::new();
    let mut at = hdr_len + type_off;
    let end = at + type_len;
    while at < end {
        let name_off = u32_at(at)?;
        let info = u32_at(at + 4)?;
        let size_or_type = u32_at(at + 8)?;
        let (vlen, kind, kind_flag) = (
            (info & 0xffff) as usize,
            (info >> 24) & 0x1f,
            info >> 31 == 1,
        );
        at += 12;
        let mut members = Vec::new();
        let mut names = Vec::new();
        let extra = match kind {
            KIND_INT | KIND_VAR | KIND_DECL_TAG => 4,
            KIND_ARRAY => 12,
            KIND_STRUCT | KIND_UNION => {
                for i in 0..vlen {
                    let m = at + 12 * i;
                    let offset = u32_at(m + 8)?;
                    members.push(Member {
                        name_off: u32_at(m)?,
                        type_id: u32_at(m + 4)?,
                        bit_offset: if kind_flag {
                            offset & 0xff_ffff
                        } else {
                            offset
                        },
                    });
                }
                12 * vlen
            }
            KIND_ENUM | KIND_ENUM64 => {
                let size = if kind == KIND_ENUM { 8 } else { 12 };
                for i in 0..vlen {
                    names.push(u32_at(at + size * i)?);
                }
                size * vlen
            }
            KIND_FUNC_PROTO => {
                for i in 0..vlen {
                    members.push(Member {
                        name_off: u32_at(at + 8 * i)?,
                        type_id: u32_at(at + 8 * i + 4)?,
                        bit_offset: 0,
                    });
                }
                8 * vlen
            }
            KIND_DATASEC => 12 * vlen,
            _ => 0,
        };
        at += extra;
        types.push(Type {
            name_off,
            kind,
            refers_to: size_or_type,
            members,
            names,
        });
    }
    Ok((types, strings))
}

/// Every offset the programs use, from this kernel's BTF.
pub fn kernel_offsets(btf: &Btf) -> Result<KernelOffsets> {
    let o = |s: &str, f: &str| btf.offset(s, f);
    // A mount namespace's id that is never reused: `ns.ns_id` (6.18), else `seq`.
    let mnt_ns_id = if btf.has("mnt_namespace", "ns.ns_id") {
        o("mnt_namespace", "ns.ns_id")?
    } else {
        o("mnt_namespace", "seq")?
    };
    // The programs read a struct path (mnt, dentry) and a vfsmount's (mnt_root, mnt_sb)
    // in one go each.
    for (s, first, second) in [
        ("path", "mnt", "dentry"),
        ("vfsmount", "mnt_root", "mnt_sb"),
    ] {
        if o(s, second)? != o(s, first)? + 8 {
            bail!("struct {s}: {second} does not follow {first}");
        }
    }
    Ok(KernelOffsets {
        task_files: o("task_struct", "files")?,
        task_fs: o("task_struct", "fs")?,
        task_nsproxy: o("task_struct", "nsproxy")?,
        files_fdt: o("files_struct", "fdt")?,
        fdt_fd: o("fdtable", "fd")?,
        file_mnt: o("file", "f_path.mnt")?,
        fs_pwd_mnt: o("fs_struct", "pwd.mnt")?,
        fs_root_dentry: o("fs_struct", "root.dentry")?,
        dentry_parent: o("dentry", "d_parent")?,
        dentry_name_len: o("dentry", "d_name.len")?,
        dentry_name: o("dentry", "d_name.name")?,
        vfsmount_root: o("vfsmount", "mnt_root")?,
        sb_root: o("super_block", "s_root")?,
        sb_dev: o("super_block", "s_dev")?,
        nsproxy_mnt_ns: o("nsproxy", "mnt_ns")?,
        mnt_ns_id,
        mnt_ns_inum: o("mnt_namespace", "ns.inum")?,
        file_pos: o("file", "f_pos")?,
        regs_nr: o("pt_regs", SYSCALL_NR_REGISTER)?,
        thread_status: o("task_struct", "thread_info.status")?,
        dentry_inode: o("dentry", "d_inode")?,
        dentry_sb: o("dentry", "d_sb")?,
        inode_ino: o("inode", "i_ino")?,
        task_signal: o("task_struct", "signal")?,
        signal_live: o("signal_struct", "live")?,
        regs_args: syscall_arguments(btf)?,
        file_pointer_type: file_pointer_type(btf),
    })
}

/// A struct to cast a descriptor table's slot to, so that it reads as a typed `struct
/// file` (`KernelOffsets::file_pointer_type`); 0 if the kernel has none. Whether the
/// kernel can cast at all (`bpf_rdonly_cast`) is the loader's to decide.
fn file_pointer_type(btf: &Btf) -> u32 {
    btf.first_field_points_to("kiocb", "file").unwrap_or(0)
}

/// The registers of a 64-bit syscall's arguments and number (x86-64's syscall ABI: the
/// `sys_exit` tracepoint hands the program the saved `pt_regs`).
#[cfg(target_arch = "x86_64")]
const SYSCALL_ARGUMENT_REGISTERS: [&str; 6] = ["di", "si", "dx", "r10", "r8", "r9"];
#[cfg(target_arch = "x86_64")]
const SYSCALL_NR_REGISTER: &str = "orig_ax";
#[cfg(not(target_arch = "x86_64"))]
compile_error!(
    "hocus reads syscall arguments from x86-64 registers; other architectures need their pt_regs names here"
);

/// Where each of a syscall's six arguments is in `struct pt_regs`, by position.
fn syscall_arguments(btf: &Btf) -> Result<[u32; 6]> {
    let mut at = [0u32; 6];
    for (slot, register) in at.iter_mut().zip(SYSCALL_ARGUMENT_REGISTERS) {
        *slot = btf.offset("pt_regs", register)?;
    }
    Ok(at)
}

/// Where the FUSE request programs read a request and a walk (`requests`), from this
/// kernel's BTF; None where it lacks what they read. The layouts they assume (a header's
/// opcode, unique and node id at 4, 8 and 16; an argument's size and value 16 bytes
/// apart; a qstr's len and name at 4 and 8) are checked too.
pub fn request_offsets(btf: &Btf) -> Result<RequestOffsets> {
    let o = |s: &str, f: &str| btf.offset(s, f);
    let layouts = [
        ("fuse_in_header", "opcode", 4),
        ("fuse_in_header", "unique", 8),
        ("fuse_in_header", "nodeid", 16),
        ("fuse_out_header", "error", 4),
        ("fuse_in_arg", "value", 8),
        ("fuse_arg", "value", 8),
        ("qstr", "len", 4),
        ("qstr", "name", 8),
        ("path", "dentry", 8),
    ];
    for (s, f, at) in layouts {
        if o(s, f)? != at {
            bail!("struct {s}: {f} is not at byte {at}");
        }
    }
    Ok(RequestOffsets {
        req_args: o("fuse_req", "args")?,
        req_in: o("fuse_req", "in.h")?,
        req_out: o("fuse_req", "out.h")?,
        req_mount: o("fuse_req", "fm")?,
        mount_conn: o("fuse_mount", "fc")?,
        conn_dev: o("fuse_conn", "dev")?,
        args_in: o("fuse_args", "in_args")?,
        args_out: o("fuse_args", "out_args")?,
        task_nameidata: o("task_struct", "nameidata")?,
        nd_path: o("nameidata", "path")?,
        nd_last: o("nameidata", "last")?,
        dentry_inline_name: o("dentry", "d_shortname").or_else(|_| o("dentry", "d_iname"))?,
        dentry_type: btf
            .struct_id("dentry")
            .context("the kernel has no struct dentry")?,
    })
}

/// Where the NFS programs read a file's flags, a dentry's superblock and a setattr's
/// attributes (`nfs_learn`), from this kernel's BTF.
pub fn nfs_offsets(btf: &Btf) -> Result<NfsOffsets> {
    // A kiocb's file is read as its first field.
    btf.first_field_points_to("kiocb", "file")
        .context("struct kiocb does not start with its file")?;
    Ok(NfsOffsets {
        file_flags: btf.offset("file", "f_flags")?,
        iattr_valid: btf.offset("iattr", "ia_valid")?,
        kiocb_pos: btf.offset("kiocb", "ki_pos")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_kernel_has_every_field() {
        // The machines hocus runs on have BTF (the integration tests load for real).
        let o = kernel_offsets(&Btf::from_kernel().unwrap()).unwrap();
        // d_name is a qstr: a 32-bit hash and length, then the name pointer.
        assert_eq!(o.dentry_name_len + 4, o.dentry_name);
        assert_ne!(o.task_files, o.task_fs);
        // x86-64's pt_regs: r15 first, then down to di at 112; orig_ax after ax.
        assert_eq!(o.regs_nr, 120);
        assert_eq!(o.regs_args, [112, 104, 96, 56, 72, 64]);
    }

    #[test]
    fn says_what_a_kernel_functions_parameters_point_to() {
        let btf = Btf::from_kernel().unwrap();
        let (id, params) = btf.function_params("vfs_read").unwrap();
        assert_eq!(Some(id), btf.function("vfs_read"));
        // vfs_read(struct file *, char __user *, size_t, loff_t *)
        assert_eq!(params, ["file", "", "", ""]);
        // vfs_unlink(idmap, struct inode *dir, struct dentry *, struct inode **): a
        // pointer to a pointer is no struct's.
        let (_, params) = btf.function_params("vfs_unlink").unwrap();
        assert_eq!(params[params.len() - 3..], ["inode", "dentry", ""]);
    }

    #[test]
    fn knows_the_helpers_the_kernel_has() {
        let btf = Btf::from_kernel().unwrap();
        // 5.11 and later: the kernels hocus is tested on here.
        assert!(btf.has_helper("get_current_task_btf"));
        assert!(btf.has_helper("probe_read_kernel"));
        assert!(!btf.has_helper("no_such_helper"));
    }

    #[test]
    fn finds_the_kfunc_and_the_struct_to_cast_to() {
        use hocus_common::kfunc;
        let btf = Btf::from_kernel().unwrap();
        // 6.2 and later: the kernels hocus is tested on.
        assert!(btf.function(kfunc::RDONLY_CAST_NAME).is_some());
        assert!(btf.function("no_such_kernel_function").is_none());
        let kiocb = btf.first_field_points_to("kiocb", "file").unwrap();
        assert_eq!(kernel_offsets(&btf).unwrap().file_pointer_type, kiocb);
        // A struct whose first field is no pointer to a file.
        assert!(btf.first_field_points_to("dentry", "file").is_none());
        assert!(btf.first_field_points_to("kiocb", "inode").is_none());
    }

    #[test]
    fn finds_what_the_request_programs_read_where_fuse_is_built_in() {
        let btf = Btf::from_kernel().unwrap();
        match request_offsets(&btf) {
            Ok(o) => {
                // A walk starts with where it is, then the name it looks up.
                assert_eq!((o.nd_path, o.nd_last), (0, 16));
                assert!(o.req_in > o.req_args && o.req_out > o.req_in);
                assert_ne!(o.conn_dev, 0);
            }
            // FUSE as a module: its structs are in its own BTF, not vmlinux's.
            Err(e) => assert!(!btf.has("fuse_req", "args"), "{e:#}"),
        }
    }
}
