//! Attaching the NFS programs (`hocus-ebpf/src/hooks/nfs_learn.rs`) to the NFS client's
//! functions: fentry and fexit on a module's functions need the module's BTF (Linux
//! 5.11; a patched aya, third_party/README.md), or vmlinux's where NFS is built in. Each
//! function's parameters are checked against what the program reads of them: a kernel
//! whose functions differ keeps learning jobs from their syscalls.

use std::{os::fd::OwnedFd, path::Path};

use anyhow::{Context, Result, bail};
use aya::{
    Ebpf,
    programs::{FEntry, FExit, Program, fentry::FEntryLinkId, fexit::FExitLinkId},
};

use crate::observe::{
    btf::{Btf, ModuleBtf},
    modules,
};

/// Where a program goes: at a function's entry or its exit.
#[derive(Clone, Copy, PartialEq, Eq)]
enum At {
    Entry,
    Exit,
}

/// A program, the module and function it goes on, and what each of the function's
/// parameters must point to (a struct's name; "" a scalar; "*" anything): a program at
/// the exit reads the return value after the last.
type Hook = (
    &'static str,
    &'static str,
    &'static str,
    At,
    &'static [&'static str],
);

// A table, one hook a line.
#[rustfmt::skip]
const NFS_HOOKS: [Hook; 19] = [
    ("nfs_opened", "nfs", "nfs_file_open", At::Exit, &["inode", "file"]),
    ("nfs4_opened", "nfsv4", "nfs4_file_open", At::Exit, &["inode", "file"]),
    ("nfs_dir_opened", "nfs", "nfs_opendir", At::Exit, &["inode", "file"]),
    ("nfs_atomic_opened", "nfs", "nfs_atomic_open", At::Exit, &["inode", "dentry", "file", "", ""]),
    ("nfs_read", "nfs", "nfs_file_read", At::Exit, &["kiocb", "iov_iter"]),
    ("nfs_write", "nfs", "nfs_file_write", At::Exit, &["kiocb", "iov_iter"]),
    ("nfs_mapped", "nfs", "nfs_file_mmap", At::Exit, &["file", "vm_area_struct"]),
    ("nfs_released", "nfs", "nfs_file_release", At::Entry, &["inode", "file"]),
    ("nfs_dir_closed", "nfs", "nfs_closedir", At::Entry, &["inode", "file"]),
    ("nfs_looked_up", "nfs", "nfs_lookup", At::Exit, &["inode", "dentry", ""]),
    ("nfs_unlinking", "nfs", "nfs_unlink", At::Entry, &["inode", "dentry"]),
    ("nfs_unlinked", "nfs", "nfs_unlink", At::Exit, &["inode", "dentry"]),
    ("nfs_rmdiring", "nfs", "nfs_rmdir", At::Entry, &["inode", "dentry"]),
    ("nfs_rmdired", "nfs", "nfs_rmdir", At::Exit, &["inode", "dentry"]),
    ("nfs_mkdired", "nfs", "nfs_mkdir", At::Entry, &["*", "inode", "dentry", ""]),
    ("nfs_renaming", "nfs", "nfs_rename", At::Entry, &["*", "inode", "dentry", "inode", "dentry", ""]),
    ("nfs_renamed", "nfs", "nfs_rename", At::Exit, &["*", "inode", "dentry", "inode", "dentry", ""]),
    ("nfs_setattring", "nfs", "nfs_setattr", At::Entry, &["*", "dentry", "iattr"]),
    ("nfs_setattred", "nfs", "nfs_setattr", At::Exit, &["*", "dentry", "iattr"]),
];

pub enum Link {
    Entry(FEntryLinkId),
    Exit(FExitLinkId),
}

/// Detaches `program` from where `link` attached it.
pub fn detach(program: &mut Program, link: Link) -> Result<()> {
    match link {
        Link::Entry(id) => <&mut FEntry>::try_from(program)?.detach(id)?,
        Link::Exit(id) => <&mut FExit>::try_from(program)?.detach(id)?,
    }
    Ok(())
}

/// Loads and attaches the NFS programs; `vmlinux` is the kernel's own BTF (and
/// `aya_vmlinux` aya's reading of it, for a client built in). The NFSv4
/// client's open is hooked where its module is loaded (a node with no NFSv4 mount has
/// none to learn from). All or none: an error says which the kernel refused.
pub fn attach(
    ebpf: &mut Ebpf,
    vmlinux: &Btf,
    aya_vmlinux: Option<&aya::Btf>,
) -> Result<Vec<(&'static str, Link)>> {
    let mut links = Vec::new();
    if let Err(e) = attach_each(ebpf, vmlinux, aya_vmlinux, &mut links) {
        for (name, link) in links {
            if let Some(program) = ebpf.program_mut(name) {
                let _ = detach(program, link);
            }
        }
        return Err(e);
    }
    Ok(links)
}

/// A loaded module's types, read once for all its functions, and its BTF object.
struct Module<'a> {
    btf: ModuleBtf<'a>,
    object: OwnedFd,
}

impl<'a> Module<'a> {
    /// Module `name`, if loaded with BTF of its own (else built in, or absent).
    fn open(vmlinux: &'a Btf, name: &str) -> Result<Option<Self>> {
        if !Path::new("/sys/kernel/btf").join(name).exists() {
            return Ok(None);
        }
        Ok(Some(Self {
            btf: ModuleBtf::read(vmlinux, name)?,
            object: modules::btf_object(name)?,
        }))
    }
}

/// Where a hooked function's type is: a module's BTF (its id there, and the module's
/// BTF object), or vmlinux's.
enum Target {
    Module(u32, OwnedFd),
    Vmlinux,
}

fn attach_each(
    ebpf: &mut Ebpf,
    vmlinux: &Btf,
    aya_vmlinux: Option<&aya::Btf>,
    links: &mut Vec<(&'static str, Link)>,
) -> Result<()> {
    let mut modules: Vec<(&str, Option<Module>)> = Vec::new();
    for (name, module, function, at, params) in NFS_HOOKS {
        if !modules.iter().any(|(m, _)| *m == module) {
            modules.push((module, Module::open(vmlinux, module)?));
        }
        let loaded = modules
            .iter()
            .find(|(m, _)| *m == module)
            .and_then(|(_, m)| m.as_ref());
        let (target, found) = if let Some(m) = loaded {
            let (id, found) = m
                .btf
                .function(function)
                .with_context(|| format!("module {module} has no function {function}"))?;
            (Target::Module(id, m.object.try_clone()?), found)
        } else if let Some((_, found)) = vmlinux.function_params(function) {
            (Target::Vmlinux, found)
        } else if module == "nfsv4" {
            continue;
        } else {
            bail!(
                "the kernel has no BTF for {function}: {module} is a module, and the kernel has no BTF for modules (before 5.11), or it is not loaded"
            );
        };
        let fits = found.len() == params.len()
            && found.iter().zip(params).all(|(f, p)| *p == "*" || f == p);
        if !fits {
            bail!(
                "{function}'s parameters are not what the program reads: {found:?}, not {params:?}"
            );
        }
        let program = ebpf
            .program_mut(name)
            .with_context(|| format!("no program {name}"))?;
        let refused = || format!("the kernel's verifier rejected {name} (on {function})");
        let attaching = || format!("attaching {name} to {function}");
        // FEntry and FExit load and attach alike, but share no trait.
        macro_rules! load_and_attach {
            ($program:ty, $link:path) => {{
                let p: &mut $program = program.try_into()?;
                match target {
                    Target::Module(id, object) => p.load_in_module(id, object),
                    Target::Vmlinux => {
                        let btf = aya_vmlinux.context("aya could not read the kernel's BTF")?;
                        p.load(function, btf)
                    }
                }
                .with_context(refused)?;
                $link(p.attach().with_context(attaching)?)
            }};
        }
        let link = match at {
            At::Entry => load_and_attach!(FEntry, Link::Entry),
            At::Exit => load_and_attach!(FExit, Link::Exit),
        };
        links.push((name, link));
    }
    Ok(())
}
