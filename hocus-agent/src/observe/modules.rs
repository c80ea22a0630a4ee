//! Kernel modules' BTF objects: a program attached to a module's function (the NFS
//! client's, on distribution kernels) names the module's BTF to the kernel by a
//! descriptor, found here by the module's name. The kernel lists its BTF objects only
//! by id (`BPF_BTF_GET_NEXT_ID`), each named in its info.

use std::{
    io,
    os::fd::{FromRawFd, OwnedFd},
};

use anyhow::{Result, bail};

const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_BTF_GET_FD_BY_ID: libc::c_long = 19;
const BPF_BTF_GET_NEXT_ID: libc::c_long = 23;

/// `union bpf_attr`, larger than any command here reads; unused bytes stay zero, as the
/// kernel requires.
#[repr(C, align(8))]
#[derive(Default)]
struct Attr([u32; 32]);

/// `struct bpf_btf_info` (5.11 and later: with the name).
#[repr(C)]
#[derive(Default)]
struct BtfInfo {
    btf: u64,
    btf_size: u32,
    id: u32,
    name: u64,
    name_len: u32,
    kernel_btf: u32,
}

fn bpf(cmd: libc::c_long, attr: &mut Attr) -> io::Result<libc::c_long> {
    // SAFETY: the bpf syscall with a buffer of the size given.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut Attr,
            std::mem::size_of::<Attr>(),
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(r)
}

/// A descriptor of module `name`'s BTF object, loaded in the kernel.
pub fn btf_object(name: &str) -> Result<OwnedFd> {
    let mut id = 0;
    loop {
        let mut attr = Attr::default();
        attr.0[0] = id;
        match bpf(BPF_BTF_GET_NEXT_ID, &mut attr) {
            Ok(_) => id = attr.0[1],
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => break,
            Err(e) => bail!("listing the kernel's BTF objects: {e}"),
        }
        let mut attr = Attr::default();
        attr.0[0] = id;
        let fd = match bpf(BPF_BTF_GET_FD_BY_ID, &mut attr) {
            // SAFETY: a descriptor the kernel just gave, owned by nobody else.
            Ok(fd) => unsafe { OwnedFd::from_raw_fd(fd as i32) },
            // Gone since it was listed (a module unloaded).
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => continue,
            Err(e) => bail!("opening the kernel's BTF object {id}: {e}"),
        };
        if object_name(&fd)?.as_deref() == Some(name) {
            return Ok(fd);
        }
    }
    bail!(
        "the kernel has no BTF for module {name} (not loaded, or no CONFIG_DEBUG_INFO_BTF_MODULES)"
    )
}

/// A kernel BTF object's name (`vmlinux`, a module's); None for a program's own.
fn object_name(fd: &OwnedFd) -> Result<Option<String>> {
    use std::os::fd::AsRawFd;
    let mut name = [0u8; 64];
    let mut info = BtfInfo {
        name: name.as_mut_ptr() as u64,
        name_len: name.len() as u32,
        ..BtfInfo::default()
    };
    let mut attr = Attr::default();
    attr.0[0] = fd.as_raw_fd() as u32;
    attr.0[1] = std::mem::size_of::<BtfInfo>() as u32;
    let at = &mut info as *mut BtfInfo as u64;
    attr.0[2] = at as u32;
    attr.0[3] = (at >> 32) as u32;
    if let Err(e) = bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr) {
        bail!("reading a BTF object's info: {e}");
    }
    if info.kernel_btf == 0 {
        return Ok(None);
    }
    let len = name.iter().position(|b| *b == 0).unwrap_or(name.len());
    Ok(Some(String::from_utf8_lossy(&name[..len]).into_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_vmlinux_and_says_which_module_is_missing() {
        // Every kernel with BTF lists its own as "vmlinux" (the tests run as root).
        assert!(btf_object("vmlinux").is_ok());
        let e = btf_object("no_such_module").unwrap_err().to_string();
        assert!(e.contains("no BTF for module no_such_module"), "{e}");
    }
}
