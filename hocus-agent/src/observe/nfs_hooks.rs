//! Attaching the NFS programs (`hocus-ebpf/src/hooks/nfs_learn.rs`) to the NFS client's
//! functions: fentry and fexit on a module's functions need the module's BTF (Linux
//! 5.11; a patched aya, third_party/README.md), or vmlinux's where NFS is built in. Each
//! function's parameters are checked against what the program reads of them: a kernel
//! whose functions differ keeps learning jobs from their syscalls.

use anyhow::{Context, Result, bail};
use aya::{
    Ebpf,
    programs::{FEntry, FExit, fentry::FEntryLinkId, fexit::FExitLinkId},
};

use crate::observe::btf::{Btf, ModuleBtf};

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
const NFS_HOOKS: [Hook; 15] = [
    ("nfs_opened", "nfs", "nfs_file_open", At::Exit, &["inode", "file"]),
    ("nfs4_opened", "nfsv4", "nfs4_file_open", At::Exit, &["inode", "file"]),
    ("nfs_dir_opened", "nfs", "nfs_opendir", At::Exit, &["inode", "file"]),
    ("nfs_atomic_opened", "nfs", "nfs_atomic_open", At::Exit, &["inode", "dentry", "file", "", ""]),
    ("nfs_read", "nfs", "nfs_file_read", At::Exit, &["kiocb", "iov_iter"]),
    ("nfs_write", "nfs", "nfs_file_write", At::Entry, &["kiocb", "iov_iter"]),
    ("nfs_mapped", "nfs", "nfs_file_mmap", At::Exit, &["file", "vm_area_struct"]),
    ("nfs_released", "nfs", "nfs_file_release", At::Entry, &["inode", "file"]),
    ("nfs_dir_closed", "nfs", "nfs_closedir", At::Entry, &["inode", "file"]),
    ("nfs_looked_up", "nfs", "nfs_lookup", At::Exit, &["inode", "dentry", ""]),
    ("nfs_unlinked", "nfs", "nfs_unlink", At::Entry, &["inode", "dentry"]),
    ("nfs_rmdired", "nfs", "nfs_rmdir", At::Entry, &["inode", "dentry"]),
    ("nfs_mkdired", "nfs", "nfs_mkdir", At::Entry, &["*", "inode", "dentry", ""]),
    ("nfs_renamed", "nfs", "nfs_rename", At::Entry, &["*", "inode", "dentry", "inode", "dentry", ""]),
    ("nfs_setattred", "nfs", "nfs_setattr", At::Entry, &["*", "dentry", "iattr"]),
];

pub enum Link {
    Entry(FEntryLinkId),
    Exit(FExitLinkId),
}

/// Detaches program `name` from where `link` attached it.
pub fn detach(ebpf: &mut Ebpf, name: &str, link: Link) -> Result<()> {
    let program = ebpf
        .program_mut(name)
        .with_context(|| format!("no program {name}"))?;
    match link {
        Link::Entry(id) => <&mut FEntry>::try_from(program)?.detach(id)?,
        Link::Exit(id) => <&mut FExit>::try_from(program)?.detach(id)?,
    }
    Ok(())
}

/// Loads and attaches the NFS programs; `vmlinux` is the kernel's own BTF. The NFSv4
/// client's open is hooked where its module is loaded (a node with no NFSv4 mount has
/// none to learn from). All or none: an error says which the kernel refused.
pub fn attach(ebpf: &mut Ebpf, vmlinux: &Btf) -> Result<Vec<(&'static str, Link)>> {
    let mut links = Vec::new();
    if let Err(e) = attach_each(ebpf, vmlinux, &mut links) {
        for (name, link) in links {
            let _ = detach(ebpf, name, link);
        }
        return Err(e);
    }
    Ok(links)
}

fn attach_each(
    ebpf: &mut Ebpf,
    vmlinux: &Btf,
    links: &mut Vec<(&'static str, Link)>,
) -> Result<()> {
    for (name, module, function, at, params) in NFS_HOOKS {
        let Some((id, btf)) = find(vmlinux, module, function, params)? else {
            continue;
        };
        let program = ebpf
            .program_mut(name)
            .with_context(|| format!("no program {name}"))?;
        let refused = || format!("the kernel's verifier rejected {name} (on {function})");
        let attaching = || format!("attaching {name} to {function}");
        let link = match at {
            At::Entry => {
                let p: &mut FEntry = program.try_into()?;
                match btf {
                    Some(fd) => p.load_in_module(id, fd),
                    None => p.load(function, &aya::Btf::from_sys_fs()?),
                }
                .with_context(refused)?;
                Link::Entry(p.attach().with_context(attaching)?)
            }
            At::Exit => {
                let p: &mut FExit = program.try_into()?;
                match btf {
                    Some(fd) => p.load_in_module(id, fd),
                    None => p.load(function, &aya::Btf::from_sys_fs()?),
                }
                .with_context(refused)?;
                Link::Exit(p.attach().with_context(attaching)?)
            }
        };
        links.push((name, link));
    }
    Ok(())
}

/// Function `function` of `module`: its BTF id and the module's BTF object, or None
/// with vmlinux's (built in); Ok(None) for NFSv4's module, not loaded. Errs where the
/// kernel lacks it or its parameters are not `params`.
fn find(
    vmlinux: &Btf,
    module: &str,
    function: &str,
    params: &[&str],
) -> Result<Option<(u32, Option<std::os::fd::OwnedFd>)>> {
    let loaded = std::path::Path::new("/sys/kernel/btf")
        .join(module)
        .exists();
    let (id, found, object) = if loaded {
        let btf = ModuleBtf::read(vmlinux, module)?;
        let (id, found) = btf
            .function(function)
            .with_context(|| format!("module {module} has no function {function}"))?;
        (id, found, Some(super::modules::btf_object(module)?))
    } else if let Some((id, found)) = vmlinux.function_params(function) {
        (id, found, None)
    } else if module == "nfsv4" {
        return Ok(None);
    } else {
        bail!(
            "the kernel has no BTF for {function}: {module} is a module, and the kernel has no BTF for modules (before 5.11), or it is not loaded"
        );
    };
    let fits =
        found.len() == params.len() && found.iter().zip(params).all(|(f, p)| *p == "*" || f == p);
    if !fits {
        bail!("{function}'s parameters are not what the program reads: {found:?}, not {params:?}");
    }
    Ok(Some((id, object)))
}
